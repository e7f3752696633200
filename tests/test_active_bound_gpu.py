"""A bound on the active rows changes how the kernels split rows, never the results."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.methods import make_method
from diffkv_jax.steps import CompiledSteps


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "diffkv"])
def test_decode_with_few_active_rows_matches_the_unbounded_step_on_gpu(tiny_model, name):
    """Two long rows active out of 32 slots: with ``max_active=2`` the kernels split each
    row into many pieces (one split at no bound); the logits agree within the kernels'
    float16-dot tolerance and the greedy tokens are the same."""
    cfg, params = tiny_model
    S, T = 32, 512
    method = make_method(name, cfg, max_seqs=S, max_context=T + 8, dtype=jnp.float32,
                         attention_impl="pallas")
    steps = CompiledSteps(cfg, method, jnp.float32)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, size=(2, T)).astype(np.int32)
    lens = np.asarray([T, 301], np.int32)
    slots = np.asarray([3, 17], np.int32)
    active = np.zeros(S, bool)
    active[slots] = True
    last = np.zeros(S, np.int32)
    last[slots] = rng.integers(0, cfg.vocab_size, size=2)
    outs = []
    for bound in (0, 2):
        state = method.init_state(S * method.pages_for_tokens(T + 8))
        state, _ = steps.prefill(params, state, PrefillBatch(jnp.asarray(toks), jnp.asarray(lens),
                                                             jnp.asarray(slots)))
        batch = DecodeBatch(jnp.asarray(last), jnp.asarray(active), method.row_len, bound)
        state, logits = steps.decode(params, state, batch)
        outs.append(np.asarray(logits)[slots])
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    assert (outs[1].argmax(-1) == outs[0].argmax(-1)).all()
