"""The caches' bound on how many pages the next decode steps allocate (what the
engine reserves): never below what the steps do allocate, far below the worst case."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import decode_width
from diffkv_jax.methods import make_method
from diffkv_jax.steps import GROWTH_STEPS, CompiledSteps, pool_counts


@pytest.mark.parametrize("kind,opts", [("full", {}),
                                       ("diffkv", dict(alpha_high=1.0, alpha_low=0.5, window=4)),
                                       ("diffkv", dict(alpha_high=1.0, alpha_low=0.0,
                                                       low_tier=False, window=4))])
def test_growth_bound_covers_the_allocations_of_the_next_steps(tiny_model, kind, opts):
    cfg, params = tiny_model
    S, T = 4, 96
    m = make_method(kind, cfg, max_seqs=S, max_context=T, page_size=4 if kind == "full" else 8,
                    **opts)
    steps = CompiledSteps(cfg, m, jnp.float32)
    rng = np.random.default_rng(0)
    lens = np.asarray([13, 30, 7], np.int32)
    toks = rng.integers(0, cfg.vocab_size, size=(3, 32)).astype(np.int32)
    state = m.init_state(S * m.pages_for_tokens(T))
    state, _ = steps.prefill(params, state, PrefillBatch(jnp.asarray(toks), jnp.asarray(lens),
                                                         jnp.asarray([0, 1, 3], np.int32)))
    active = np.asarray([True, True, False, True])
    free, bounds = [], []
    for step in range(40):
        counts = np.asarray(pool_counts(m, state))
        free.append(int(counts[0]))
        bounds.append(counts[1:1 + GROWTH_STEPS])
        assert counts[-1] == 0  # no allocation failed
        if step == 20:
            active[1] = False  # a row stops decoding: the bound may only overestimate
        width = decode_width(m, int(lens.max()) + step + 2)
        last = jnp.asarray(rng.integers(0, cfg.vocab_size, size=S), jnp.int32)
        state, _ = steps.decode(params, state, DecodeBatch(last, jnp.asarray(active), width))
    assert not bool(state.alloc_failed)
    worst = 3 * m.num_layers * m.num_kv_heads * m.max_new_pages_per_row
    valid = min(GROWTH_STEPS, m.page_size if kind == "full" else m.cap(0))
    grew = False
    for t in range(len(free) - GROWTH_STEPS):
        for k in range(1, valid + 1):
            used = free[t] - free[t + k]
            assert 0 <= used <= bounds[t][k - 1], (t, k, used, bounds[t])
            grew |= used > 0
        assert bounds[t][0] < worst  # far from every row gaining every page
    assert grew
    assert all((b[valid:] == -1).all() for b in bounds)
