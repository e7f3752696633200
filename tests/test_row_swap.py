"""A slot's cache copied out and put back into another slot, through fresh pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import row_swap
from diffkv_jax.batch import PrefillBatch
from diffkv_jax.methods import make_method
from diffkv_jax.steps import CompiledSteps


def _prefill(steps, params, state, rng, vocab, slots, n):
    toks = rng.integers(0, vocab, size=(len(slots), n)).astype(np.int32)
    batch = PrefillBatch(jnp.asarray(toks), jnp.full((len(slots),), n, jnp.int32),
                         jnp.asarray(slots, jnp.int32))
    return steps.prefill(params, state, batch)[0]


def _slot_contents(method, state, slot):
    """A slot's entries and, per pool array, the rows of its owned pages in
    page-table order (what decoding reads), independent of which pages they are."""
    owned = np.asarray(method.owned_columns(state)[slot])
    ids = np.asarray(state.page_table[slot])[owned]
    pools = {f: np.asarray(getattr(state, f))[ids] for f in method.swap_pool_fields}
    rows = {f: np.asarray(getattr(state, f)[slot]) for f in method.swap_row_fields}
    return pools, rows, ids


@pytest.mark.parametrize("kind", ["full", "diffkv"])
def test_a_slot_comes_back_through_fresh_pages(tiny_model, kind):
    cfg, params = tiny_model
    opts = dict(window=4, alpha_high=1.0, alpha_low=0.5) if kind == "diffkv" else {}
    m = make_method(kind, cfg, max_seqs=3, max_context=96, **opts)
    steps = CompiledSteps(cfg, m, jnp.float32)
    rng = np.random.default_rng(0)
    pages = 3 * m.pages_for_tokens(96)
    state = m.init_state(pages)
    state = _prefill(steps, params, state, rng, cfg.vocab_size, [0, 1], 70)
    pools0, rows0, ids0 = _slot_contents(m, state, 0)
    other = _slot_contents(m, state, 1)
    assert len(ids0) > 0

    n = int(2 ** np.ceil(np.log2(len(ids0) + 5)))  # a bucket above what it owns
    row = jax.device_get(jax.jit(lambda st, s: row_swap.export_row(m, st, s, n))(
        state, jnp.int32(0)))
    assert int(row.count) == len(ids0) and row.nbytes > 0
    mask = np.zeros(m.max_seqs + 1, bool)
    mask[0] = True
    state = steps.release(state, jnp.asarray(mask))
    # Someone else takes slot 0 and some of the pages it gave back.
    state = _prefill(steps, params, state, rng, cfg.vocab_size, [0], 30)
    free_before = int(state.free.num_free)
    state = jax.jit(lambda st, s, r: row_swap.import_row(m, st, s, r))(state, jnp.int32(2), row)

    assert not bool(state.alloc_failed)
    assert int(state.free.num_free) == free_before - len(ids0)
    pools2, rows2, ids2 = _slot_contents(m, state, 2)
    for f in m.swap_row_fields:
        np.testing.assert_array_equal(rows2[f], rows0[f])
    for f in m.swap_pool_fields:
        np.testing.assert_array_equal(pools2[f], pools0[f])
    # Fresh pages, owned by nobody else.
    live = np.concatenate([_slot_contents(m, state, s)[2] for s in (0, 1)])
    assert not set(ids2.tolist()) & set(live.tolist())
    for a, b in zip(jax.tree_util.tree_leaves(other[:2]),
                    jax.tree_util.tree_leaves(_slot_contents(m, state, 1)[:2])):
        np.testing.assert_array_equal(a, b)


def test_a_copy_too_small_says_so(tiny_model):
    cfg, params = tiny_model
    m = make_method("full", cfg, max_seqs=2, max_context=96)
    steps = CompiledSteps(cfg, m, jnp.float32)
    state = _prefill(steps, params, m.init_state(2 * m.pages_for_tokens(96)),
                     np.random.default_rng(1), cfg.vocab_size, [0], 70)
    row = row_swap.export_row(m, state, jnp.int32(0), 4)
    assert int(row.count) > 4  # the engine then recomputes instead


def test_copy_buckets_waste_at_most_a_quarter():
    for pages in range(1, 3000):
        n = row_swap.row_pages_bucket(pages, 10**9)
        assert pages <= n and n * 4 <= pages * 5, (pages, n)
    assert row_swap.row_pages_bucket(1000, 900) == 900
    assert len({row_swap.row_pages_bucket(p, 10**9) for p in range(1, 4097)}) < 60


def test_host_copy_round_trip():
    """The copy lands in page-locked host memory where the device has it, and
    comes back unchanged."""
    rng = np.random.default_rng(3)
    row = row_swap.SwappedRow(pages={"a": jnp.asarray(rng.integers(0, 255, (6, 8), np.uint8))},
                              rows={"b": jnp.asarray(rng.normal(size=3), jnp.float32)},
                              count=jnp.int32(5))
    (device,) = row.pages["a"].devices()
    host = row_swap.to_host(row)
    assert host.nbytes == row.nbytes
    if row_swap.host_memory(device) is not None:
        assert host.pages["a"].sharding.memory_kind == "pinned_host"
    back = row_swap.to_device(host, device)
    assert back.pages["a"].sharding.memory_kind == device.default_memory().kind
    for a, b in zip(jax.tree_util.tree_leaves(row), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_host_pool_grows_on_gpus_only():
    (device,) = jax.devices()[:1]
    grown = row_swap.grow_host_pool(device, 1 << 20)
    assert grown == (device.platform != "cpu" and row_swap.host_memory(device) is not None)
    assert not row_swap.grow_host_pool(device, 0)


@pytest.mark.gpu
def test_swaps_after_growing_the_host_pool_round_trip():
    (device,) = jax.devices()[:1]
    assert row_swap.grow_host_pool(device, 64 << 20)
    rng = np.random.default_rng(4)
    row = row_swap.SwappedRow(pages={"a": jnp.asarray(rng.integers(0, 255, (1 << 20,), np.uint8))},
                              rows={}, count=jnp.int32(1))
    back = row_swap.to_device(row_swap.to_host(row), device)
    np.testing.assert_array_equal(np.asarray(back.pages["a"]), np.asarray(row.pages["a"]))
