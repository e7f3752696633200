"""``LaunchConfig.carried_page_ids``: each loop step reads the next step's page IDs
from the table and carries them.

The launch is checked against the same launch without it (interpret mode: the same
operations, so the same partials up to fused rounding; every quantized tier set,
both tile orientations, page lanes, split pages, work lists), against the plain-jnp
reference, and compiled on the GPU (marked ``gpu``).
"""

import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import TIER_SETS, check_kernel, random_partials

LAUNCHES = {
    "token tiles, lanes": dict(dot_dtype="float16", transposed=True, page_lanes=2, num_splits=2,
                               values_in_place=True, lane_meta_select=True),
    "token tiles, split pages": dict(dot_dtype="float16", transposed=True, page_lanes=2,
                                     num_splits=2, split_pages=True),
    "query tiles, sub-slots": dict(dot_dtype="float32", num_splits=3, sub_slots=16),
}


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k8v4+k4v2", "k2v2", "k8v8", "16bit"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_carried_page_ids_give_the_same_partials(tier_set, launch):
    base = LAUNCHES[launch]
    if tier_set == "16bit" and base.get("transposed"):
        pytest.skip("16-bit pages keep query tiles")
    pad = 8 if base.get("transposed") else 16
    a = random_partials(tier_set, pdk.LaunchConfig(**base), seed=5, pad=pad)
    b = random_partials(tier_set, pdk.LaunchConfig(carried_page_ids=True, **base), seed=5,
                        pad=pad)
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
        x, y = np.nan_to_num(x), np.nan_to_num(y)
        # The same pages and operations; a product and sum may fuse differently (one
        # float16 rounding of a stored logit at most).
        np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-4 * max(np.abs(x).max(), 1.0))


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k8v4+k4v2", "k4v4"])
def test_carried_page_ids_match_reference_over_work_lists(tier_set):
    D, G = (128, 4) if "wide" in tier_set else (64, 3)
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype="float16", tol=3e-3, pad=8,
                 page_lanes=2, work_items=16, seed=23, rows_in_kernel=True, transposed=True,
                 tier_weights=(1, 2)[:len(TIER_SETS[tier_set])], carried_page_ids=True)


def test_carried_page_ids_refuse_other_look_aheads():
    for extra in (dict(keys_ahead=True), dict(stack_pages=2), dict(l2_prefetch=2),
                  dict(l2_prefetch_next=1)):
        with pytest.raises(ValueError, match="carried_page_ids"):
            pdk.LaunchConfig(carried_page_ids=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k8v4+k4v2", "k2v2"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 2), (128, 4, 2), (128, 8, 1)])
def test_compiled_carried_page_ids_match_reference_on_gpu(tier_set, D, G, lanes):
    for nw, st in ((1, 3), (2, 3), (2, 5)):
        check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-3, pad=8,
                     page_lanes=lanes, work_items=16, seed=230 + G + lanes, rows_in_kernel=True,
                     transposed=True, num_warps=nw, num_stages=st, values_in_place=True,
                     tier_weights=(1, 2)[:len(TIER_SETS[tier_set])], carried_page_ids=True)
