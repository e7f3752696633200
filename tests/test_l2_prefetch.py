"""``LaunchConfig.l2_prefetch``: each program asks the L2 cache for the pages a few
steps ahead of its loop, across into the next tier's first pages.

A hint that changes no result: the launch gives bit-identical outputs with and
without it (interpret mode, where the prefetch's page lookups run and the
prefetch itself is left out, and compiled on the GPU), and its CUDA lowering
issues one bulk prefetch per page part where the design says (checked on the CPU).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels import paged_decode as pdk

from tests.test_early_row_loads import (COMPILED_CASES, assert_equal_where_written,
                                        compiled_case, interpret_case)
from tests.test_paged_decode_kernel import lowering_tiers


def both_ways(run, cfg, ahead=3, field="l2_prefetch"):
    """``run(cfg)``'s outputs without and with ``ahead`` pages prefetched (``field``:
    every step's pages ahead, or ``l2_prefetch_next``: the next tier's first pages)."""
    a = run(dataclasses.replace(cfg, l2_prefetch=0, l2_prefetch_next=0))
    b = run(dataclasses.replace(cfg, **{field: ahead}))
    return jax.tree.leaves(a), jax.tree.leaves(b)


@pytest.mark.parametrize("tier_set,D,G,pad,kw", [
    ("k8v4+k4v2", 64, 3, None, {}),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2),
                                       lane_meta_select=True, values_in_place=True)),
    ("k8v4+k4v2 wide", 128, 4, None, dict(sub_slots=16)),
    ("16bit", 64, 3, None, {}),
])
@pytest.mark.parametrize("work_items,ahead,field", [
    (None, 1, "l2_prefetch"), (16, 3, "l2_prefetch"), (64, 8, "l2_prefetch"),
    (16, 2, "l2_prefetch_next"), (64, 5, "l2_prefetch_next")])
def test_prefetch_gives_identical_partials(tier_set, D, G, pad, kw, work_items, ahead, field):
    cfg, run = interpret_case(tier_set, D, G, pad, kw, work_items, seed=work_items or 1)
    plain, ahead_out = both_ways(run, cfg, ahead, field)
    assert np.isfinite(np.asarray(plain[0])).all()
    for x, y in zip(plain, ahead_out):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_prefetch_setting_is_checked():
    with pytest.raises(ValueError, match="l2_prefetch"):
        pdk.LaunchConfig(l2_prefetch=-1)
    with pytest.raises(ValueError, match="alternative"):
        pdk.LaunchConfig(l2_prefetch=2, l2_prefetch_next=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        backend.prefetch_asm(100)
    asm = backend.prefetch_asm(6144)
    assert "cp.async.bulk.prefetch.L2.global [$1], 6144" in asm and "$2" in asm


def lowered_prefetches(cfg, tiers, D, G, padded_rows):
    """``(prefetches before the first loop, in all)`` of the launch lowered for CUDA
    (on the CPU), and their sizes in bytes."""
    from scripts.kernel_resources import strip_locations, triton_ir

    work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
    fn = jax.jit(lambda q: pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg, work=work,
                                                     padded_rows=padded_rows,
                                                     interpret=False))
    ir = strip_locations(triton_ir(fn, jnp.zeros((1, 1, G, D), jnp.bfloat16)))
    pattern = r"cp\.async\.bulk\.prefetch\.L2\.global \[\$1\], (\d+);"
    head = ir[:ir.index("scf.for")]
    return (len(re.findall(pattern, head)), len(re.findall(pattern, ir)),
            sorted({int(n) for n in re.findall(pattern, ir)}))


@pytest.mark.parametrize("ahead", [2, 5])
def test_gpu_lowering_prefetches_each_page_part(ahead):
    # Lowered for CUDA on the CPU, the caches' two-tier launch (token tiles, two lanes).
    # A page is three parts: its 6 KB of codes and its two metadata rows (32 K8V4 or
    # 64 K4V2 slots of 4 bytes). Before the first loop: the walk's first `ahead` pages,
    # each asked of both tiers (the high tier's where the index is its own, else the
    # low tier's). The K8V4 loop: a page per lane (two), both tiers' again; the K4V2
    # loop: one page, its own tier's only (it is the last).
    if not backend.L2_PREFETCH:
        pytest.skip("this JAX's Triton lowering is not the one the prefetch is written for")
    D, G = 128, 4
    tiers = lowering_tiers(D)
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, tier_weights=(1, 2),
                           l2_prefetch=ahead)
    head, total, sizes = lowered_prefetches(cfg, tiers, D, G, 8)
    assert head == ahead * 3 * 2
    assert total == head + 2 * 3 * 2 + 3
    assert sizes == [128, 256, 6144]
    none = lowered_prefetches(dataclasses.replace(cfg, l2_prefetch=0), tiers, D, G, 8)
    assert none == (0, 0, [])


def test_gpu_lowering_asks_for_the_next_tier_once_in_a_branch():
    # l2_prefetch_next=4: nothing before the first loop; in the K8V4 loop, inside the
    # branch of the one step that asks, the K4V2 tier's first four pages, three
    # parts each; nothing in the K4V2 loop (the last tier).
    if not backend.L2_PREFETCH:
        pytest.skip("this JAX's Triton lowering is not the one the prefetch is written for")
    D, G = 128, 4
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, tier_weights=(1, 2),
                           l2_prefetch_next=4)
    head, total, sizes = lowered_prefetches(cfg, lowering_tiers(D), D, G, 8)
    assert (head, total, sizes) == (0, 4 * 3, [256, 6144])


@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
def test_compiled_cases_with_prefetch_lower_for_cuda(tier_set, D, G, pad, kw):
    q, _, _, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    for c in (dataclasses.replace(cfg, l2_prefetch=3),
              dataclasses.replace(cfg, l2_prefetch_next=3)):
        jax.jit(lambda q, c=c: run(c, q)).trace(q).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
@pytest.mark.parametrize("field", ["l2_prefetch", "l2_prefetch_next"])
def test_compiled_prefetch_gives_identical_partials_on_gpu(tier_set, D, G, pad, kw, field):
    _, tiers, work, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    plain, ahead = both_ways(run, cfg, 3, field)
    used = np.asarray(work.seg) < work.num_rows
    assert used.any() and np.isfinite(np.asarray(plain[0])[used]).all()
    assert_equal_where_written(plain, ahead, work, tiers)


def test_gpu_lowering_leaves_out_parts_off_16_byte_boundaries():
    # Metadata rows of cap + 3 words (as the random test tiers have) start off 16-byte
    # boundaries, which a bulk prefetch refuses (a misaligned-address fault on the
    # GPU): only the pages' codes are asked for.
    if not backend.L2_PREFETCH:
        pytest.skip("this JAX's Triton lowering is not the one the prefetch is written for")
    D, G = 128, 4
    tiers = [dataclasses.replace(t, meta=tuple(jnp.zeros((8, t.fmt.slots + 3), jnp.uint32)
                                               for _ in range(2)))
             for t in lowering_tiers(D)]
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, tier_weights=(1, 2), l2_prefetch=2)
    head, total, sizes = lowered_prefetches(cfg, tiers, D, G, 8)
    assert sizes == [6144] and head == 2 * 2 and total == head + 2 * 2 + 1
