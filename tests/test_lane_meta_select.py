"""``LaunchConfig.lane_meta_select``: with page lanes, each lane's metadata words
loaded once as a vector and chosen per query column instead of gathered per
element. The same words reach the same arithmetic, so the partials agree to float32
rounding (XLA's fusions of the two graphs may round differently; interpret mode:
whole pages per lane, split pages, both tile orientations, work lists); compiled on
the GPU against the reference (``gpu``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import TIER_SETS, check_kernel, make_tier


@pytest.mark.parametrize("tier_set,D,G,pad,kw", [
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True)),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, split_pages=True)),
    ("k8v4+k4v2", 64, 3, 16, {}),
    ("k8v4+k4v2", 64, 3, 16, dict(lane_slots=64, page_lanes=4)),
    ("k2v2", 64, 4, 8, dict(transposed=True)),
])
@pytest.mark.parametrize("work_items", [None, 16])
def test_selected_metadata_give_the_same_partials(tier_set, D, G, pad, kw, work_items):
    rng = np.random.default_rng(len(kw) + (work_items or 0))
    S, H, P, NP = 5, 2, 40, 5
    tiers = [make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)[0]
             for kb, vb, cap in TIER_SETS[tier_set]]
    q = pdk.pad_group(jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32), pad)
    base = dict(num_splits=2, dot_dtype="float32", logits_dtype="float32", page_lanes=2,
                tier_weights=(1, 2)[:len(tiers)])
    base.update(kw)
    work = None
    if work_items is not None:
        work = pdk.plan_work(pdk.row_pages(tiers, jnp.asarray([1, 0, 1, 1, 0], bool),
                                           base["tier_weights"]), work_items)

    def run(select):
        cfg = pdk.LaunchConfig(lane_meta_select=select, **base)
        assert cfg.lanes(pad, G) > 1  # the option is live
        return jax.tree.leaves(pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg, work=work,
                                                         interpret=True))

    gathered, selected = run(False), run(True)
    assert np.isfinite(np.asarray(gathered[0])).all()
    for x, y in zip(gathered, selected):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * max(1.0, float(np.abs(x).max())))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("D,G", [(128, 4), (64, 3)])
def test_compiled_selected_metadata_match_reference_on_gpu(split, D, G):
    check_kernel("k8v4+k4v2 wide", D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, work_items=16, seed=160 + D + G, rows_in_kernel=True,
                 transposed=True, tier_weights=(1, 2), split_pages=split,
                 values_in_place=True, lane_meta_select=True)
    check_kernel("k8v4+k4v2", D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=16, page_lanes=2, seed=170 + D + G, lane_meta_select=True)
