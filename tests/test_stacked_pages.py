"""``LaunchConfig.stack_pages``: the tiers one lane walks a whole page per step take
several consecutive pages of the item per step, with one running-max check for them.

The running max is then raised at other points of the walk, so the partials ``o, m,
l`` differ by a power of two: the launch must give the same normalized output
``o / l`` and log-sum ``m + log l`` with and without stacking (interpret mode,
random pages and ragged rows, every loop form, the merged launch, and compiled on
the GPU), and the same logits wherever it stores them. A step's pages past the
item's last must store nothing: their columns belong to the row's next item.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk

from tests.test_early_row_loads import (COMPILED_CASES, compiled_case, interpret_case,
                                        launch_case)


def normalized(leaves):
    """``[o / l, m + log l, *logits]`` of a launch's partials (0 where ``l`` is 0:
    items or rows without tokens)."""
    o, m, l = (np.asarray(x, np.float64) for x in leaves[:3])
    live = l > 0
    safe = np.where(live, l, 1.0)
    return ([np.where(live[..., None], o / safe[..., None], 0.0),
             np.where(live, m + np.log(safe), 0.0)]
            + [np.asarray(x) for x in leaves[3:]])


def assert_same(plain, stacked, *, rtol, atol, used=None, tiers=None):
    """Normalized outputs close (over the ``used`` items where given); logits close
    and at the same places NaN in interpret mode (whole buffers), or below each row's
    token count (``tiers`` given: a compiled launch writes only there)."""
    a, b = normalized(plain), normalized(stacked)
    for x, y in zip(a[:2], b[:2]):
        if used is not None:
            x, y = x[used], y[used]
        np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)
    for i, (x, y) in enumerate(zip(a[2:], b[2:])):
        if tiers is None:
            np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
            np.testing.assert_allclose(y, x, rtol=rtol, atol=atol)
            continue
        valid = np.arange(x.shape[-1]) < np.asarray(tiers[i].n_tok)[..., None]
        valid = np.broadcast_to(valid[:, :, None, :], x.shape)
        assert valid.any()
        np.testing.assert_allclose(y[valid], x[valid], rtol=rtol, atol=atol)


@pytest.mark.parametrize("tier_set,D,G,pad,kw", [
    ("k8v4+k4v2", 64, 3, None, {}),
    ("k8v4+k4v2 wide", 128, 4, None, dict(tier_weights=(1, 2))),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2),
                                       values_in_place=True, lane_meta_select=True)),
    ("k8v4+k4v2 wide", 128, 4, 8, dict(transposed=True, page_lanes=2, tier_weights=(1, 2),
                                       early_row_loads=True)),
    ("k8v4+k4v2", 64, 3, None, dict(lazy_rescale=False)),
    ("k2v2", 64, 8, None, {}),
])
@pytest.mark.parametrize("work_items,stack", [(None, 2), (11, 2), (16, 4), (64, 2)])
def test_stacked_pages_give_the_same_attention(tier_set, D, G, pad, kw, work_items, stack):
    cfg, run = interpret_case(tier_set, D, G, pad, kw, work_items, seed=work_items or 2)
    plain = jax.tree.leaves(run(cfg))
    stacked = jax.tree.leaves(run(dataclasses.replace(cfg, stack_pages=stack)))
    assert np.isfinite(np.asarray(plain[0])).all()
    assert_same(plain, stacked, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "16bit"])
def test_tiers_not_walked_a_whole_page_by_one_lane_are_unchanged(tier_set):
    # Sub-page steps and 16-bit pages are not stacked: the launch is the same one.
    kw = dict(sub_slots=16) if tier_set != "16bit" else {}
    cfg, run = interpret_case(tier_set, 128 if tier_set != "16bit" else 64, 4, None, kw, 16,
                              seed=3)
    for x, y in zip(jax.tree.leaves(run(cfg)),
                    jax.tree.leaves(run(dataclasses.replace(cfg, stack_pages=4)))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_stacked_pages_in_the_merged_launch():
    q, tiers = launch_case("k8v4+k4v2 wide", 128, 4, seed=4)
    S, H = q.shape[:2]
    cfg = pdk.LaunchConfig(dot_dtype="float32", logits_dtype="float32", tier_weights=(1, 2))
    work = pdk.plan_work(pdk.row_pages(tiers, weights=cfg.tier_weights), 16)
    outs = []
    for stack in (1, 2):
        c = dataclasses.replace(cfg, stack_pages=stack)
        out, M, L, *_ = pdk.paged_decode_merged(q, tiers, work=work, group=4, cfg=c,
                                                interpret=True)
        live = np.asarray(L) > 0
        outs.append((np.asarray(out), np.where(live, np.asarray(M) + np.log(
            np.where(live, np.asarray(L), 1.0)), 0.0)))
    assert np.isfinite(outs[0][0]).all() and (outs[0][1] != 0).any()
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=2e-5, atol=2e-6)


def test_a_step_past_the_item_stores_no_logits():
    # Rows of 5 pages of one tier cut into items of 3 and 2 pages: a stacked step of
    # 4 pages reaches past the first item's last page into the second's. Every logit
    # must come from the item that owns the page (the same as unstacked).
    q, tiers = launch_case("k8v4", 64, 3, seed=6)
    tiers = [dataclasses.replace(t, n_tok=jnp.full_like(t.n_tok, 5 * t.fmt.slots))
             for t in tiers]
    cfg = pdk.LaunchConfig(num_splits=2, dot_dtype="float32", logits_dtype="float32")
    logits = []
    for stack in (1, 4):
        c = dataclasses.replace(cfg, stack_pages=stack)
        logits.append(np.asarray(pdk.paged_decode_partials(q, tiers, group=3, cfg=c,
                                                           interpret=True)[3]))
    assert np.isfinite(logits[0]).all()
    np.testing.assert_allclose(logits[1], logits[0], rtol=2e-5, atol=2e-6)


def test_stack_setting_is_checked():
    with pytest.raises(ValueError, match="power of two"):
        pdk.LaunchConfig(stack_pages=3)
    with pytest.raises(ValueError, match="power of two"):
        pdk.LaunchConfig(stack_pages=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        pdk.LaunchConfig(stack_pages=2, l2_prefetch=1)


@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
def test_compiled_cases_with_stacked_pages_lower_for_cuda(tier_set, D, G, pad, kw):
    q, _, _, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    c = dataclasses.replace(cfg, stack_pages=2)
    jax.jit(lambda q: run(c, q)).trace(q).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set,D,G,pad,kw", COMPILED_CASES)
@pytest.mark.parametrize("stack", [2, 4])
def test_compiled_stacked_pages_give_the_same_attention_on_gpu(tier_set, D, G, pad, kw,
                                                               stack):
    # float16 dot operands on the GPU: the same products, the running max raised at
    # other steps (probabilities rounded against another max).
    _, tiers, work, cfg, run = compiled_case(tier_set, D, G, pad, kw)
    plain = jax.tree.leaves(run(cfg))
    stacked = jax.tree.leaves(run(dataclasses.replace(cfg, stack_pages=stack)))
    used = np.asarray(work.seg) < work.num_rows
    assert used.any() and np.isfinite(np.asarray(plain[0])[used]).all()
    assert_same(plain, stacked, rtol=2e-3, atol=2e-3, used=used, tiers=tiers)
