"""A memory budget in bytes -> pool pages: exact for every method, and the Engine built from it."""

import jax
import numpy as np
import pytest

from diffkv_jax import memory_budget as mb
from diffkv_jax.engine import Engine
from diffkv_jax.generation import SamplingParams
from diffkv_jax.methods import make_method


def allocated_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize("kind", ["full", "diffkv", "kivi2"])
def test_pages_fill_the_budget_exactly(tiny_model, kind):
    cfg, _ = tiny_model
    method = make_method(kind, cfg, max_seqs=3, max_context=64, page_size=8)
    budget = 3 * mb.state_bytes(method, 40) + 12345  # not a whole number of pages
    pages = mb.pages_for_memory(method, budget)
    assert mb.state_bytes(method, pages) <= budget < mb.state_bytes(method, pages + 1)
    # The shapes' count is what an allocated state really takes.
    assert allocated_bytes(method.init_state(pages)) == mb.state_bytes(method, pages)


def test_budget_below_the_tables_is_refused(tiny_model):
    cfg, _ = tiny_model
    method = make_method("diffkv", cfg, max_seqs=3, max_context=64, page_size=8)
    with pytest.raises(ValueError, match="holds no page"):
        mb.pages_for_memory(method, mb.state_bytes(method, 1) - 1)
    assert mb.pages_for_memory(method, mb.state_bytes(method, 1)) == 1


def test_diffkv_kernel_pools_skip_the_unaddressable_sizes(tiny_model, monkeypatch):
    """Without wide offsets, code pools of 2 - 4 GiB overflow the GPU kernel's 32-bit
    offsets: a budget there gets the largest pool under 2 GiB (counted from shapes,
    never allocated)."""
    from pallas_kernels import backend

    monkeypatch.setattr(backend, "wide_offsets", lambda: False)
    cfg, _ = tiny_model
    method = make_method("diffkv", cfg, max_seqs=2, max_context=64, page_size=16,
                         attention_impl="pallas")
    data = method.layout.data_bytes
    with pytest.warns(UserWarning, match=r"cannot address.*unused") as caught:
        pages = mb.pages_for_memory(method, 3 * 2**30 // data * method.page_bytes)
    assert (pages + 1) * data <= 2**31 < (pages + 2) * data
    # The warning names the budgets that use all their memory: the one of this pool,
    # and the smallest whose pool is past 4 GiB of codes.
    message = str(caught[0].message)
    above = 2**32 // data  # (above + 1) pages of codes are exactly 2^32 bytes or more
    above += (above + 1) * data <= 2**32
    assert f"from {mb.state_bytes(method, above) / 2**30:.2f} GiB" in message
    assert f"up to {mb.state_bytes(method, pages) / 2**30:.2f} GiB" in message
    assert method.addressable_pages(above) == above
    assert method.addressable_pages(above - 1) != above - 1
    assert method.addressable_pages(pages) == pages
    with pytest.raises(ValueError, match="32-bit offsets"):
        method.init_state(3 * 2**30 // data)
    big = 5 * 2**30 // data  # past 4 GiB the offsets are 64-bit again
    assert method.addressable_pages(big) == big
    reference = make_method("diffkv", cfg, max_seqs=2, max_context=64, page_size=16)
    assert reference.addressable_pages(3 * 2**30 // data) == 3 * 2**30 // data


def test_wide_offsets_give_a_3gib_budget_all_its_pages(tiny_model):
    """With 64-bit offsets for 2 - 4 GiB refs (pallas_kernels.backend.wide_offsets),
    a kernel pool of 3 GiB is addressable: the budget's pages are all used, no
    warning."""
    import warnings

    from pallas_kernels import backend

    assert backend.wide_offsets()
    cfg, _ = tiny_model
    method = make_method("diffkv", cfg, max_seqs=2, max_context=64, page_size=16,
                         attention_impl="pallas")
    budget = mb.state_bytes(method, 3 * 2**30 // method.layout.data_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pages = mb.pages_for_memory(method, budget)
    assert pages == 3 * 2**30 // method.layout.data_bytes
    assert method.addressable_pages(pages) == pages


def test_engine_from_a_memory_budget_serves(tiny_model):
    cfg, params = tiny_model
    method = make_method("diffkv", cfg, max_seqs=2, max_context=64, page_size=8)
    budget = mb.state_bytes(method, 300)
    eng = Engine(cfg, params, method, memory_bytes=budget)
    assert eng.num_pages == 300
    assert allocated_bytes(eng.state) <= budget
    rng = np.random.default_rng(0)
    out = eng.generate([list(rng.integers(0, cfg.vocab_size, 9)) for _ in range(3)],
                       [SamplingParams(max_new_tokens=5)] * 3)
    assert [len(r.output) for r in out] == [5, 5, 5]
    assert eng.free_pages == eng.num_pages
    with pytest.raises(ValueError, match="not both"):
        Engine(cfg, params, method, num_pages=10, memory_bytes=budget)


def test_default_budget_is_a_share_of_free_memory(tiny_model, monkeypatch):
    cfg, params = tiny_model
    method = make_method("full", cfg, max_seqs=2, max_context=64, page_size=8)
    free = mb.state_bytes(method, 1000)
    monkeypatch.setattr(mb, "device_free_bytes", lambda device=None: free)
    eng = Engine(cfg, params, method)
    assert eng.num_pages == mb.pages_for_memory(method, int(free * mb.DEFAULT_MEMORY_FRACTION))
    assert 800 < eng.num_pages < 1000
    monkeypatch.undo()
    assert mb.device_free_bytes() > 0
