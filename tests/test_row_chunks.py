"""``LaunchConfig.row_chunk``: a row's items walk a fixed share of the row each, then
take the rest in chunks from the row's cursor (an atomic add) as the launch runs.

In interpret mode the programs run one after another, so a row's first item takes
every chunk and the others none: the results must not depend on who walks what
(against the plain-jnp reference and the launch without cursors), an item without
chunks must leave an empty partial, and the cursors must come back zero. The
atomic's interleaving is checked compiled on the GPU (marked ``gpu``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels import paged_decode as pdk
from tests.test_merged_decode import check_merged, launch_case, merged_and_reference
from tests.test_paged_decode_kernel import check_kernel


@pytest.mark.parametrize("chunk,share", [(2, 25), (3, 100), (4, 0), (1, 60)])
@pytest.mark.parametrize("tier_set,D,G", [("k8v4+k4v2 wide", 128, 4), ("k8v8", 64, 3),
                                          ("16bit", 64, 8)])
def test_row_chunks_match_reference(chunk, share, tier_set, D, G):
    quantized = tier_set != "16bit"
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype="float16", tol=3e-2,
                 pad=8 if quantized else 16, page_lanes=2 if quantized else 1, work_items=16,
                 seed=chunk + share, rows_in_kernel=True, transposed=quantized,
                 tier_weights=(1, 2) if "+" in tier_set else (), values_in_place=quantized,
                 lane_meta_select=quantized, row_chunk=chunk, row_share=share)


def _launch(tier_set, D, G, work_items, cfg_fields, seed=11, transposed=False):
    """launch_case's: float32 dots unless ``transposed`` (then float16 codes, whose
    rounding of the weights depends on each partial's running max)."""
    q, tiers, cfg, work, rows, ref = launch_case(tier_set, D, G, work_items, seed=seed,
                                                 transposed=transposed, lanes=2)
    return q, tiers, dataclasses.replace(cfg, **cfg_fields), work, rows, ref


@pytest.mark.parametrize("share", [0, 50, 100])
def test_the_first_item_of_a_row_takes_every_chunk(share):
    # Sequential programs: the row's first item takes every chunk of the cursor's share,
    # the others walk their fixed shares only (none at share=100: empty partials).
    q, tiers, cfg, work, rows, _ = _launch("k8v4+k4v2 wide", 128, 4, 40,
                                           dict(row_chunk=2, row_share=share))
    S, H = q.shape[:2]
    plain = dataclasses.replace(cfg, row_chunk=0)
    o, m, l, _ = pdk.paged_decode_partials(q, tiers, group=4, cfg=cfg, work=work,
                                           padded_rows=rows, interpret=True)
    o0, m0, l0, _ = pdk.paged_decode_partials(q, tiers, group=4, cfg=plain, work=work,
                                              padded_rows=rows, interpret=True)
    ranges = np.asarray(work.ranges)
    assert (ranges[:, 1] >= 3).any()
    l, later = np.asarray(l), []
    for first, count in ranges:
        if count > 1:
            later += list(range(first + 1, first + count))
            assert (l[first] > 0).all()
    if share == 100:  # the later items walk nothing: empty partials
        assert (l[later] == 0).all() and (np.asarray(o)[later] == 0).all()
    else:  # their fixed shares (a share may hold no page's first unit)
        assert (l[later] > 0).all(axis=-1).mean() > 0.5
    # Merged, the rows are the launch's without cursors: the outputs and the log-sum-exp
    # (a partial's running max lags its logits by up to RESCALE_SLACK, so M and L
    # alone depend on who walked what).
    (out, M, L), (out0, M0, L0) = (pdk.merge_work(*x, work, S, H)
                                   for x in ((o, m, l), (o0, m0, l0)))
    has = ranges[:, 1].reshape(S, H) > 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(out0), rtol=2e-5, atol=2e-5)
    lse, lse0 = (np.asarray(a + jnp.log(b))[has] for a, b in ((M, L), (M0, L0)))
    np.testing.assert_allclose(lse, lse0, rtol=2e-5, atol=2e-5)


def test_cursors_come_back_zero():
    q, tiers, cfg, work, rows, _ = _launch("k8v4+k4v2", 64, 3, 40,
                                           dict(row_chunk=3, row_share=40))
    S, H = q.shape[:2]
    outs = pdk._decode_call(q, tiers, 3, rows, cfg, work, True)
    cursors = outs[3 + len(tiers)]
    assert cursors.shape == (S * H,) and cursors.dtype == jnp.int32
    assert not np.asarray(cursors).any()


@pytest.mark.parametrize("share", [25, 100])
def test_merged_launch_with_row_chunks(share):
    q, tiers, cfg, work, rows, jnp_ref = _launch("k8v4+k4v2 wide", 128, 4, 40,
                                                 dict(row_chunk=2, row_share=share),
                                                 transposed=True)
    got, ref, logits = merged_and_reference(q, tiers, cfg, work, rows, 4)
    check_merged(got, ref, logits, tiers, work, 2e-5)
    S, H = q.shape[:2]
    # The cursors follow the merge counters in the same array, zero again after.
    assert got[4].shape == (2 * S * H,)
    has = np.asarray(work.ranges)[:, 1].reshape(q.shape[:2]) > 0
    scale = float(jnp.abs(jnp_ref[has]).max())
    assert float(jnp.abs(got[0] - jnp_ref)[has].max()) <= 3e-2 * scale
    # A launch's counters passed to the next: the same rows again.
    again, _, _ = merged_and_reference(q, tiers, cfg, work, rows, 4, counters=got[4])
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(got[0]))


def test_merged_launch_counters_hold_the_cursors():
    q, tiers, cfg, work, rows, _ = _launch("k8v4+k4v2", 64, 3, 16, dict(row_chunk=2))
    S, H = q.shape[:2]
    assert pdk.merge_counters(S, H, cfg).shape == (2 * S * H,)
    assert pdk.merge_counters(S, H).shape == (S * H,)
    with pytest.raises(ValueError, match="merge_counters"):  # the counters alone
        pdk.paged_decode_merged(q, tiers, work=work, counters=pdk.merge_counters(S, H),
                                group=3, cfg=cfg, padded_rows=rows, interpret=True)


def test_bad_row_chunk_settings():
    with pytest.raises(ValueError, match="row_chunk must be"):
        pdk.LaunchConfig(row_chunk=-1)
    with pytest.raises(ValueError, match="row_share"):
        pdk.LaunchConfig(row_chunk=2, row_share=101)
    with pytest.raises(ValueError, match="early_row_loads"):
        pdk.LaunchConfig(row_chunk=2, early_row_loads=True)
    q, tiers, cfg, work, rows, _ = _launch("k8v4+k4v2", 64, 3, 16, dict(row_chunk=2))
    with pytest.raises(ValueError, match="ranges"):  # even splits: no ranges
        pdk.paged_decode_partials(q, tiers, group=3, cfg=cfg, padded_rows=rows,
                                  interpret=True)


@pytest.mark.parametrize("merged", [False, True])
def test_gpu_lowering_takes_chunks_with_masked_atomics(merged):
    # Lowered for CUDA on the CPU: one masked, relaxed add of the chunk (an i32, not
    # the mask: Pallas' lowering passed the i1 there when the added value was
    # computed) on the row's cursor per tier loop, each tier's page loop inside a loop
    # over chunks; no other atomic but, in a launch that merges its rows, the merge
    # counter's.
    import re

    from scripts.kernel_resources import strip_locations, triton_ir
    from tests.test_paged_decode_kernel import lowering_tiers

    D, G = 128, 4
    tiers = lowering_tiers(D)
    work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, values_in_place=True,
                           row_chunk=4)
    launch = pdk.paged_decode_merged if merged else pdk.paged_decode_partials
    fn = jax.jit(lambda q: launch(q, tiers, group=G, cfg=cfg, work=work, padded_rows=8,
                                  interpret=False))
    ir = strip_locations(triton_ir(fn, jnp.zeros((1, 1, G, D), jnp.bfloat16)))
    assert backend.RELAXED_ATOMICS
    atomics = re.findall(r"tt\.atomic_rmw add, relaxed, gpu, [^\n]*", ir)
    assert len(atomics) == len(tiers) == ir.count("tt.atomic_rmw") - merged
    assert all(re.search(r"%\w+, %\w+, %\w+ : \(!tt\.ptr<i32>, i32, i1\) -> i32", a)
               for a in atomics)
    assert len(re.findall(r"scf\.while", ir)) == len(tiers)


@pytest.mark.gpu
@pytest.mark.parametrize("warps,share", [(1, 25), (2, 25), (2, 100)])
def test_compiled_row_chunks_match_on_gpu(warps, share):
    # Many items per row taking chunks in any order over 16 chained launches: every
    # launch's rows equal the launch's without cursors (up to the summation order of
    # its partials) and the plain-jnp reference.
    q, tiers, cfg, work, rows, jnp_ref = launch_case("k8v4+k4v2 wide", 128, 4, 1024,
                                                     seed=5, S=8, H=8, NP=48, P=400,
                                                     transposed=True, lanes=2,
                                                     interpret=False)
    cfg = dataclasses.replace(cfg, num_warps=warps, values_in_place=True,
                              lane_meta_select=True, tier_weights=(1, 2))
    work = pdk.plan_work(pdk.row_pages(tiers, weights=(1, 2)), 1024, min_pages=2)
    chunked = dataclasses.replace(cfg, row_chunk=2, row_share=share)
    S, H = q.shape[:2]
    assert np.asarray(work.ranges)[:, 1].max() >= 8

    def launch(c):
        o, m, l, _ = pdk.paged_decode_partials(q, tiers, group=4, cfg=c, work=work,
                                               padded_rows=rows)
        return pdk.merge_work(o, m, l, work, S, H)[0]

    want = jax.jit(lambda: launch(cfg))()
    outs = jax.jit(lambda: jnp.stack([launch(chunked) for _ in range(16)]))()
    has = np.asarray(work.ranges)[:, 1].reshape(S, H) > 0  # rows with tokens
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(outs - want[None]).max()) <= 1e-3 * scale
    assert float(jnp.abs(want - jnp_ref)[has].max()) <= 3e-2 * scale


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_caches_with_row_chunks_serve_the_same_tokens(tiny_model, compiled, monkeypatch):
    # diffkv_kernel_attention.ROW_CHUNK: the caches' launches take their rows' rest
    # from cursors kept after the merge counters in the state. The same greedy
    # tokens and scores as without, up to the summation order (a cursor left
    # nonzero would skip the next launch's chunks: other tokens).
    from diffkv_jax import diffkv_kernel_attention as dka
    from tests.test_diffkv_kernel_path import (_assert_scores_agree, _kernel_method, _serve,
                                               _two_prompts)

    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=13)
    method = _kernel_method(cfg, compiled, merge_impl="launch")
    runs = []
    for chunk in (0, 2):
        monkeypatch.setattr(dka, "ROW_CHUNK", chunk)
        jax.clear_caches()  # the launch settings are read when the step is traced
        runs.append(_serve(cfg, params, method, prompts, max_new=40, steps=30))
        counters = method.init_state(64).merge_counters
        assert counters.shape == ((2 if chunk else 1) * 2 * cfg.num_kv_heads,)
    # early_row_loads launches take no chunks: their state holds no cursors.
    early = dataclasses.replace(method, early_row_loads=True)
    assert early.init_state(64).merge_counters.shape == (2 * cfg.num_kv_heads,)
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) > 20
    assert runs[0][2]["frac_low"] > 0
    if not compiled:
        _assert_scores_agree(runs[1][1], runs[0][1], compiled)
        return
    # Compiled, each partial's float16 weights round against its own running max,
    # and a program's chunks change who walks what: a rounding step can tip one of
    # the policy's near-ties, which moves the few scores after it (on an H100 3 of
    # 5,920 scores beyond 5e-3 relative + 2e-3, at most 8.8e-3 / 2.3% off). A
    # launch that lost or walked a chunk twice would be off in most scores.
    got, want = runs[1][1], runs[0][1]
    close = np.abs(got - want) <= 2e-3 + 5e-3 * np.abs(want)
    assert close.mean() >= 0.995, f"{(~close).sum()} of {close.size} scores off"
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=2e-2)
