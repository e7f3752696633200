"""Unrolling the scan over layers changes neither parameters nor results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import LlamaForCausalLM


def _attend(state, layer, q, k, v, ctx):
    from diffkv_jax.attention import causal_attention

    return state, causal_attention(q, k, v, ctx)


def test_unrolled_layers_match_the_rolled_scan(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32)[None], (2, 12))
    lengths = jnp.asarray([12, 7], jnp.int32)
    outs = []
    for unroll in (False, True):
        model = LlamaForCausalLM(cfg, attention_fn=_attend, unroll_layers=unroll)
        # Same parameter tree either way: checkpoints and converted weights serve both.
        shapes = jax.eval_shape(model.init, jax.random.key(0), tokens, positions, None, lengths)
        same = jax.tree_util.tree_map(lambda a, b: a.shape == b.shape,
                                      shapes["params"]["layers"], params["layers"])
        assert all(jax.tree_util.tree_leaves(same))
        hidden, _ = jax.jit(model.apply)({"params": params}, tokens, positions, None, lengths)
        outs.append(np.asarray(hidden))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_prefill_attention_matches_the_reference_on_the_gpu():
    """cuDNN's fused path (bf16) against the dense float32 reference: ragged lengths,
    GQA at both model shapes; padded positions are not compared."""
    from diffkv_jax.attention import causal_attention, prefill_attention

    for nq, nkv, d in ((32, 8, 128), (9, 3, 64)):
        kq, kk, kv = jax.random.split(jax.random.key(nq), 3)
        T = 256
        q = jax.random.normal(kq, (3, T, nq, d), jnp.bfloat16)
        k = jax.random.normal(kk, (3, T, nkv, d), jnp.bfloat16)
        v = jax.random.normal(kv, (3, T, nkv, d), jnp.bfloat16)
        lengths = jnp.asarray([T, 77, 0], jnp.int32)
        got = np.asarray(jax.jit(prefill_attention)(q, k, v, lengths))
        want = np.asarray(jax.jit(causal_attention)(q, k, v, lengths))
        assert np.isfinite(got).all()
        for b, n in enumerate([T, 77]):
            np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-2, rtol=2e-2)
