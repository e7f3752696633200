"""``LaunchConfig.early_row_loads``: every tier's token count and the table entry of
each tier's first page loaded as soon as the work item is known.

The launch must give bit-identical results with and without it (interpret mode,
random pages and ragged rows, every loop form: whole pages, parts of pages, page
lanes, split pages, token tiles, weighted work units, the merged launch), and its CUDA lowering
must issue those loads before the first tier's loop (checked on the CPU).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import TIER_SETS, lowering_tiers, make_tier


def launch_case(tier_set, D, G, seed):
    rng = np.random.default_rng(seed)
    S, H, P, NP = 5, 2, 40, 5
    tiers = [make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)[0]
             for kb, vb, cap in TIER_SETS[tier_set]]
    q = jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32)
    return q, tiers


def interpret_case(tier_set, D, G, pad, kw, work_items, seed):
    """``(cfg, run)`` of an interpret-mode launch case: ``run(cfg)`` launches it over
    random tiers (even splits, or ``work_items`` planned over three active rows of
    five), q padded to ``pad`` rows in memory where given."""
    q, tiers = launch_case(tier_set, D, G, seed)
    cfg = pdk.LaunchConfig(num_splits=3, dot_dtype="float32", logits_dtype="float32", **kw)
    qk = q if pad is None else pdk.pad_group(q, pad)
    work = None
    if work_items is not None:
        active = jnp.asarray([True, False, True, True, False])
        work = pdk.plan_work(pdk.row_pages(tiers, active, cfg.tier_weights), work_items)

    def run(c):
        return pdk.paged_decode_partials(qk, tiers, group=G, cfg=c, work=work, interpret=True)

    return cfg, run


def both_ways(run, cfg):
    """``run(cfg)``'s outputs without and with the early loads."""
    a = run(dataclasses.replace(cfg, early_row_loads=False))
    b = run(dataclasses.replace(cfg, early_row_loads=True))
    return jax.tree.leaves(a), jax.tree.leaves(b)


@pytest.mark.parametrize("tier_set,D,G,pad,kw", [
    ("k8v4+k4v2", 64, 3, None, {}),
    ("k8v4+k4v2 wide", 128, 4, None, dict(tier_weights=(1, 2))),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2))),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2),
                                       split_pages=True)),
    ("k8v4+k4v2", 64, 3, None, dict(page_lanes=4, lane_slots=64)),
    ("k8v4+k4v2 wide", 128, 4, None, dict(sub_slots=16)),
    ("k2v2", 64, 8, None, {}),
    ("16bit", 64, 3, None, {}),
])
@pytest.mark.parametrize("work_items", [None, 11, 16, 64])
def test_early_loads_give_identical_partials(tier_set, D, G, pad, kw, work_items):
    cfg, run = interpret_case(tier_set, D, G, pad, kw, work_items, seed=work_items or 0)
    plain, early = both_ways(run, cfg)
    assert np.isfinite(np.asarray(plain[0])).all()
    for x, y in zip(plain, early):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_early_loads_in_the_merged_launch():
    q, tiers = launch_case("k8v4+k4v2 wide", 128, 4, seed=3)
    S, H = q.shape[:2]
    cfg = pdk.LaunchConfig(dot_dtype="float32", logits_dtype="float32", tier_weights=(1, 2))
    work = pdk.plan_work(pdk.row_pages(tiers, weights=(1, 2)), 24)

    def run(c):
        return pdk.paged_decode_merged(q, tiers, work=work, group=4, cfg=c, interpret=True,
                                       counters=pdk.merge_counters(S, H))

    plain, early = both_ways(run, cfg)
    for x, y in zip(plain, early):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def lowered_loads(cfg, tiers, D, G, padded_rows):
    """``(loads before the first loop, masked scalar table loads)`` of the launch
    lowered for CUDA (on the CPU)."""
    from scripts.kernel_resources import strip_locations, triton_ir

    work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
    fn = jax.jit(lambda q: pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg, work=work,
                                                     padded_rows=padded_rows,
                                                     interpret=False))
    ir = strip_locations(triton_ir(fn, jnp.zeros((1, 1, G, D), jnp.bfloat16)))
    head = ir[:ir.index("scf.for")]
    masked = re.findall(r"= tt\.load %\w+, %\w+, %\w+ : !tt\.ptr<i32>", ir)
    return len(re.findall(r"= tt\.load ", head)), len(masked)


@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_lowering_issues_the_row_loads_before_the_first_loop(transposed):
    # Lowered for CUDA on the CPU. Without the option the first loop is preceded by the
    # item's four words, the first tier's token count and the query; with it, also the
    # second tier's count and the entries of each tier's first pages: the pages of the
    # num_stages - 1 = 2 steps the pipeline reads ahead, two per step in the page lanes
    # of the K8V4 tier (transposed, 2 lanes), one per step otherwise. In the loops each
    # step's table read is masked off for those entries (one per lane and tier).
    D, G = 128, 4
    tiers = lowering_tiers(D)
    cfg = pdk.LaunchConfig(transposed=transposed, page_lanes=2 if transposed else 1,
                           tier_weights=(1, 2))
    rows = 8 if transposed else None
    plain, plain_masked = lowered_loads(cfg, tiers, D, G, rows)
    early, masked = lowered_loads(dataclasses.replace(cfg, early_row_loads=True), tiers,
                                  D, G, rows)
    entries = (2 * 2 if transposed else 2) + 2
    assert early == plain + 1 + entries
    assert plain_masked == 0 and masked == (2 if transposed else 1) + 1


COMPILED_CASES = [
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2))),
    # a group of 3 is padded to 16 rows inside the launch, as the caches launch it
    # (a compiled launch's tiles need power-of-two rows)
    ("k8v4+k4v2", 64, 3, 16, {}),
    ("16bit", 128, 4, None, {}),
]


def compiled_case(tier_set, D, G, pad, kw):
    """(q, tiers, work, cfg, run) of a compiled launch case: ``run(cfg)`` launches it."""
    q, tiers = launch_case(tier_set, D, G, seed=5)
    cfg = pdk.LaunchConfig(**kw)
    work = pdk.plan_work(pdk.row_pages(tiers, weights=cfg.tier_weights), 64)

    def run(c, q=q):
        return pdk.paged_decode_partials(q, tiers, group=G, cfg=c, work=work,
                                         padded_rows=pad, interpret=False)

    return q, tiers, work, cfg, run


@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
def test_compiled_cases_lower_for_cuda(tier_set, D, G, pad, kw):
    # The GPU test's launches, lowered for CUDA here (no GPU needed), both ways.
    q, _, _, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    for early in (False, True):
        c = dataclasses.replace(cfg, early_row_loads=early)
        jax.jit(lambda q, c=c: run(c, q)).trace(q).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
def test_compiled_early_loads_give_identical_partials_on_gpu(tier_set, D, G, pad, kw):
    _, tiers, work, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    plain, early = both_ways(run, cfg)
    used = np.asarray(work.seg) < work.num_rows
    assert used.any() and np.isfinite(np.asarray(plain[0])[used]).all()
    assert_equal_where_written(plain, early, work, tiers)


def assert_equal_where_written(plain, early, work, tiers):
    """A launch's outputs ``[o, m, l, *logits]`` compared where it stores them: the
    used items' partials and each tier's logits below its token count. The rest of
    a compiled launch's buffers is never written and holds whatever the memory held
    (interpret mode fills it, so the tests there compare everything)."""
    plain, early = [np.asarray(x) for x in plain], [np.asarray(x) for x in early]
    assert len(plain) == len(early) == 3 + len(tiers)
    used = np.asarray(work.seg) < work.num_rows
    for x, y in zip(plain[:3], early[:3]):
        np.testing.assert_array_equal(x[used], y[used])
    for x, y, t in zip(plain[3:], early[3:], tiers):
        valid = np.arange(x.shape[-1]) < np.asarray(t.n_tok)[..., None]  # [S, H, positions]
        valid = np.broadcast_to(valid[:, :, None, :], x.shape)
        assert valid.any()
        np.testing.assert_array_equal(x[valid], y[valid])
