"""The decode launch that merges its own rows (paged_decode_merged) against the same
launch's partials merged by paged_decode.merge_work.

Each row's last item to finish folds the row's partials; a row of one item writes
itself. In interpret mode the programs run one after another, so the counters'
bookkeeping (one item done after another, reset by the last) is checked there;
the atomic and its memory ordering are checked in the CUDA lowering on the CPU
and, marked ``gpu``, compiled on the GPU over many launches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk
from tests.test_paged_decode_kernel import TIER_SETS, lowering_tiers, make_tier


def launch_case(tier_set, D, G, work_items, *, seed, S=5, H=2, NP=5, P=40, transposed=False,
                lanes=1, interpret=True):
    """Random tiers of ``S x H`` rows (sequences 1 and 4 inactive, row (0, 0) empty),
    queries, the launch setting and a work list of ``work_items`` items."""
    rng = np.random.default_rng(seed)
    made = [make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)
            for kb, vb, cap in TIER_SETS[tier_set]]
    tiers = [t for t, _, _ in made]
    q = jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32)
    exact = interpret and not transposed
    quantized = tiers[0].fmt.quantized
    cfg = pdk.LaunchConfig(dot_dtype="float32" if exact else "float16",
                           logits_dtype="float32" if exact else "float16",
                           transposed=transposed and quantized,
                           page_lanes=lanes if quantized else 1)
    active = np.ones(S, bool)
    active[[1, 4] if S > 4 else []] = False
    work = pdk.plan_work(pdk.row_pages(tiers, jnp.asarray(active)), work_items)
    rows = pdk.tile_rows(G, cfg.transposed) if not interpret else G
    # The plain-jnp reference's attention of every row over its dequantized tokens.
    ref = pdk.merge_partials([pdk.tier_attention_reference(q, kh, vh, t.n_tok)[:3]
                              for t, kh, vh in made])[0]
    return q, tiers, cfg, work, rows, ref


def merged_and_reference(q, tiers, cfg, work, rows, G, *, interpret=True, items_per_step=4,
                         counters=None, out_dtype=jnp.float32):
    S, H = q.shape[:2]
    o, m, l, logits = pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg, work=work,
                                                padded_rows=rows, interpret=interpret)
    ref = pdk.merge_work(o, m, l, work, S, H)
    got = pdk.paged_decode_merged(q, tiers, work=work, counters=counters, group=G, cfg=cfg,
                                  out_dtype=out_dtype, padded_rows=rows,
                                  items_per_step=items_per_step, interpret=interpret)
    return got, ref, logits


def check_merged(got, ref, logits, tiers, work, rtol, logit_tol=0.0):
    """``logit_tol``: the logits' tolerance relative to their magnitude (0: equal, as
    in interpret mode; compiled, the two launches' codes may contract a multiply and
    an add differently, a float16 rounding step apart)."""
    out, M, L, got_logits, counters = got
    for g, r in zip((out, M, L), ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), rtol=rtol,
                                   atol=rtol)
    # The launch's logits are the same launch's, wherever a row with items has a token.
    walked = (np.asarray(work.ranges)[:, 1] > 0).reshape(out.shape[:2])
    for a, b, t in zip(got_logits, logits, tiers):
        valid = np.arange(a.shape[-1])[None, None, None, :] < np.asarray(t.n_tok)[..., None, None]
        valid &= walked[..., None, None]
        a, b = (np.where(valid, np.asarray(x, np.float32), 0) for x in (a, b))
        assert (np.abs(a - b) <= logit_tol * np.maximum(1.0, np.abs(b))).all()
    assert not np.asarray(counters).any()  # every row's counter back at zero


@pytest.mark.parametrize("tier_set,D,G", [("k8v4+k4v2", 64, 3), ("k8v4+k4v2 wide", 128, 4),
                                          ("16bit", 64, 8), ("k8v8", 64, 1)])
@pytest.mark.parametrize("work_items", [11, 16, 64])
@pytest.mark.parametrize("items_per_step", [1, 4])
def test_merged_launch_matches_its_partials_merged(tier_set, D, G, work_items,
                                                   items_per_step):
    # 11 items: most rows have one (written directly); 64: rows of up to ~10 items,
    # folded in blocks of 1 or 4 (the last block partly past the row).
    q, tiers, cfg, work, rows, jnp_ref = launch_case(tier_set, D, G, work_items,
                                            seed=work_items + D + G + items_per_step)
    counts = np.asarray(work.ranges)[:, 1]
    assert (counts == 0).any()  # inactive and empty rows: no items
    if work_items >= 16:
        assert (counts > 1).any()
    got, ref, logits = merged_and_reference(q, tiers, cfg, work, rows, G,
                                            items_per_step=items_per_step)
    check_merged(got, ref, logits, tiers, work, 2e-5)
    out, M, L = got[:3]
    no_items = counts.reshape(q.shape[:2]) == 0
    # Against the plain-jnp reference too (float32 dots; rows with tokens).
    scale = float(jnp.abs(jnp_ref[~no_items]).max())
    assert float(jnp.abs(out - jnp_ref)[~no_items].max()) <= 1e-4 * scale
    assert float(jnp.abs(out[no_items]).max()) == 0 and float(L[no_items].max()) == 0
    assert float(M[no_items].max()) == np.float32(pdk.NEG_INF)
    assert float(jnp.abs(out[~no_items]).min()) > 0


@pytest.mark.parametrize("transposed,lanes", [(True, 2), (False, 2)])
def test_merged_launch_with_token_tiles_and_lanes(transposed, lanes):
    # The engine's quantized launch: float16 codes, page lanes, token tiles.
    q, tiers, cfg, work, rows, jnp_ref = launch_case("k8v4+k4v2 wide", 128, 4, 40, seed=7,
                                            transposed=transposed, lanes=lanes)
    got, ref, logits = merged_and_reference(q, tiers, cfg, work, rows, 4)
    check_merged(got, ref, logits, tiers, work, 2e-5)


def test_counters_pass_from_launch_to_launch():
    # A decode step makes the counters once and passes each launch's to the next
    # (donated, updated in place); every launch merges the same.
    q, tiers, cfg, work, rows, jnp_ref = launch_case("k8v4+k4v2", 64, 3, 40, seed=3)
    _, ref, _ = merged_and_reference(q, tiers, cfg, work, rows, 3)

    @jax.jit
    def three(q, counters):
        outs = []
        for _ in range(3):
            out, _, _, _, counters = pdk.paged_decode_merged(
                q, tiers, work=work, counters=counters, group=3, cfg=cfg, interpret=True)
            outs.append(out)
        return outs, counters

    outs, counters = three(q, pdk.merge_counters(*q.shape[:2]))
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), rtol=2e-5, atol=2e-5)
    assert not np.asarray(counters).any()


def test_out_dtype_and_bad_arguments():
    q, tiers, cfg, work, rows, jnp_ref = launch_case("k8v4+k4v2", 64, 3, 16, seed=5)
    got, ref, _ = merged_and_reference(q, tiers, cfg, work, rows, 3, out_dtype=jnp.bfloat16)
    assert got[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref[0]), rtol=1e-2,
                               atol=1e-2)
    S, H = q.shape[:2]
    call = lambda **kw: pdk.paged_decode_merged(q, tiers, group=3, cfg=cfg,  # noqa: E731
                                                interpret=True, **kw)
    with pytest.raises(ValueError, match="ranges"):
        call(work=pdk.WorkList(work.items, work.seg, S * H))
    with pytest.raises(ValueError, match="power of two"):
        call(work=work, items_per_step=3)
    with pytest.raises(ValueError, match="counters"):
        call(work=work, counters=jnp.zeros((S * H + 1,), jnp.int32))


def test_gpu_lowering_releases_partials_before_counting():
    # Lowered for CUDA on the CPU: the partial stores, then a barrier of the program's
    # threads, then one acquire-release atomic add at GPU scope, and the last item's
    # reads of the other items' partials volatile (not served from a stale L1).
    import re

    from scripts.kernel_resources import strip_locations, triton_ir

    D, G = 128, 4
    tiers = lowering_tiers(D)
    work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2)
    fn = jax.jit(lambda q: pdk.paged_decode_merged(q, tiers, work=work, group=G, cfg=cfg,
                                                   padded_rows=8, interpret=False))
    ir = strip_locations(triton_ir(fn, jnp.zeros((1, 1, G, D), jnp.bfloat16)))
    atomics = [m.start() for m in re.finditer(r"tt\.atomic_rmw add, acq_rel, gpu", ir)]
    assert len(atomics) == 1 and "tt.atomic_rmw" not in ir[atomics[0] + 1:]
    before = ir[:atomics[0]]
    barrier = before.rfind("gpu.barrier")
    assert barrier > before.rfind("tt.store")  # every partial store precedes the barrier
    after = ir[atomics[0]:]
    fold = after[after.index("scf.for"):after.index("scf.yield")]  # the last item's walk
    loads = re.findall(r"tt\.load [^\n]*", fold)
    assert len(loads) == 3 and all("isVolatile = true" in x for x in loads)  # m, l, o


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set,D,G,lanes", [("k8v4+k4v2 wide", 128, 4, 2),
                                                ("k8v4+k4v2", 64, 3, 2), ("16bit", 128, 4, 1)])
def test_compiled_merged_launch_matches_on_gpu(tier_set, D, G, lanes):
    # Many items per row finishing in any order, 24 launches passing their counters
    # on: every launch's rows equal the same partials merged by XLA (the fold's order
    # is fixed, so only a lost or stale partial would move them).
    q, tiers, cfg, work, rows, jnp_ref = launch_case(tier_set, D, G, 1024, seed=D + G, S=8, H=8,
                                            NP=48, P=400, transposed=True, lanes=lanes,
                                            interpret=False)
    assert np.asarray(work.ranges)[:, 1].max() >= 8
    got, ref, logits = merged_and_reference(q, tiers, cfg, work, rows, G, interpret=False)
    check_merged(got, ref, logits, tiers, work, 1e-5, logit_tol=2e-3)

    @jax.jit
    def chain(q, counters):
        outs = []
        for _ in range(24):
            out, _, _, _, counters = pdk.paged_decode_merged(
                q, tiers, work=work, counters=counters, group=G, cfg=cfg, padded_rows=rows)
            outs.append(out)
        return jnp.stack(outs), counters

    outs, counters = chain(q, pdk.merge_counters(*q.shape[:2]))
    err = np.abs(np.asarray(outs) - np.asarray(ref[0])[None]).max()
    assert err <= 1e-5 * max(1.0, float(np.abs(np.asarray(ref[0])).max()))
    assert not np.asarray(counters).any()


def test_unnormalized_rows_are_one_partial_each():
    # normalize=False: (out, M, L) of a row is one partial (out / L the attention), so
    # merging it with another source gives what merging every item with it gives.
    q, tiers, cfg, work, rows, _ = launch_case("k8v4+k4v2", 64, 3, 40, seed=13)
    S, H = q.shape[:2]
    o, m, l, _ = pdk.paged_decode_partials(q, tiers, group=3, cfg=cfg, work=work,
                                           interpret=True)
    rng = np.random.default_rng(1)
    extra = (jnp.asarray(rng.normal(size=(S, H, 3, 64)), jnp.float32),
             jnp.asarray(rng.normal(size=(S, H, 3)), jnp.float32), jnp.ones((S, H, 3)))
    ref = pdk.merge_work(o, m, l, work, S, H, extra)
    out, M, L, _, _ = pdk.paged_decode_merged(q, tiers, work=work, group=3, cfg=cfg,
                                              normalize=False, interpret=True)
    has = np.asarray(work.ranges)[:, 1] > 0
    # One item per row (rows without items: the empty partial, zeros and NEG_INF).
    rows_ = jnp.arange(S * H, dtype=jnp.int32)
    one = pdk.WorkList(work.items[:S * H], rows_, S * H,
                       jnp.stack([rows_, jnp.ones_like(rows_)], -1))
    got = pdk.merge_work(out.reshape(S * H, 3, 64), M.reshape(S * H, 3), L.reshape(S * H, 3),
                         one, S, H, extra)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
    # Left unnormalized, a row's output is its sum of weighted values, not their mean.
    normalized = pdk.paged_decode_merged(q, tiers, work=work, group=3, cfg=cfg,
                                         interpret=True)[0]
    live = has.reshape(S, H)
    np.testing.assert_allclose(np.asarray(out / L[..., None])[live],
                               np.asarray(normalized)[live], rtol=2e-5, atol=2e-5)
