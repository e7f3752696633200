"""``LaunchConfig.split_pages``: pages longer than ``lane_slots`` (K4V2's 64 slots)
walked a page per loop step, one part per page lane, instead of by the first lane's
rows alone.

Checked against the plain-jnp reference on random pages, ragged rows and work
lists (interpret mode; compiled on the GPU, marked ``gpu``), and shown to change
nothing where no tier qualifies (bit for bit).
"""

import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import check_kernel, random_partials


@pytest.mark.parametrize("D,G,pad,transposed", [(128, 4, 8, True), (64, 3, 8, True),
                                                (128, 4, 16, False)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_split_pages_match_reference(D, G, pad, transposed, work_items):
    check_kernel("k8v4+k4v2 wide", D, G, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=pad, page_lanes=2, work_items=work_items, seed=D + G + (work_items or 0),
                 rows_in_kernel=work_items is not None, transposed=transposed,
                 tier_weights=(1, 2), split_pages=True)


def test_split_pages_with_float16_codes_match_reference():
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, work_items=16, seed=5, rows_in_kernel=True,
                 transposed=True, tier_weights=(1, 2), split_pages=True)


@pytest.mark.parametrize("tier_set,kw", [
    ("k8v4", {}),  # 32-slot pages: walked a page per lane already
    ("k8v4+k4v2 wide", dict(lane_slots=64)),  # 64-slot pages a page per lane
    ("k8v4+k4v2 wide", dict(page_lanes=1)),  # no lanes to split over
])
def test_split_pages_leave_other_launches_alone(tier_set, kw):
    base = dict(dot_dtype="float32", logits_dtype="float32", transposed=True, page_lanes=2)
    base.update(kw)
    plain = random_partials(tier_set, pdk.LaunchConfig(**base))
    split = random_partials(tier_set, pdk.LaunchConfig(split_pages=True, **base))
    for x, y in zip(plain, split):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_pages_change_the_64_slot_loop():
    # The option is live where it should be: the same launch's partials differ (the
    # parts' running maxima and sums are taken in another order), and describe the
    # same attention: equal normalized outputs and log-sum-exps within float32.
    base = dict(dot_dtype="float32", logits_dtype="float32", transposed=True, page_lanes=2)
    plain = random_partials("k8v4+k4v2 wide", pdk.LaunchConfig(**base), seed=2)
    split = random_partials("k8v4+k4v2 wide", pdk.LaunchConfig(split_pages=True, **base), seed=2)
    assert not np.array_equal(np.asarray(plain[0]), np.asarray(split[0]))
    (o_a, m_a, l_a), (o_b, m_b, l_b) = ([np.asarray(x, np.float64) for x in p[:3]]
                                        for p in (plain, split))
    live = l_a > 0
    assert live.any() and np.array_equal(live, l_b > 0)
    norm_a, norm_b = o_a[live] / l_a[live][:, None], o_b[live] / l_b[live][:, None]
    np.testing.assert_allclose(norm_b, norm_a, atol=1e-5 * np.abs(norm_a).max())
    np.testing.assert_allclose(m_b[live] + np.log(l_b[live]), m_a[live] + np.log(l_a[live]),
                               atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("D,G", [(128, 4), (64, 3)])
@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_split_pages_match_reference_on_gpu(D, G, in_place):
    check_kernel("k8v4+k4v2 wide", D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, work_items=16, seed=120 + D + G, rows_in_kernel=True,
                 transposed=True, tier_weights=(1, 2), split_pages=True,
                 values_in_place=in_place)
    check_kernel("k8v4+k4v2 wide", D, G, 3, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, seed=130 + D + G, transposed=True, tier_weights=(1, 2),
                 split_pages=True, values_in_place=in_place)
