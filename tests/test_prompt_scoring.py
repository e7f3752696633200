"""Prompt importance scores without the T x T matrix match the materializing reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import attention as attn_ref
from diffkv_jax import prompt_scoring as ps


def reference(q, k, lengths, obs_window):
    T = q.shape[1]
    p = attn_ref.causal_attention_probs(q, k, lengths).max(axis=2)  # [B, H, Tq, Tk]
    tq = jnp.arange(T)
    counted = tq[None, :] < lengths[:, None]
    if obs_window is not None:
        counted = counted & (tq[None, :] >= lengths[:, None] - obs_window)
    return jnp.einsum("bhqk,bq->bhk", p, counted.astype(jnp.float32))


@pytest.mark.parametrize("obs_window", [None, 1, 8, 64])
@pytest.mark.parametrize("groups", [1, 3])
def test_scores_match_reference(obs_window, groups):
    rng = np.random.default_rng(groups * 100 + (obs_window or 0))
    B, T, H, D = 3, 40, 2, 16
    q = jnp.asarray(rng.normal(size=(B, T, H * groups, D)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, H, D)) * 2, jnp.float32)
    lengths = jnp.asarray([40, 17, 5], jnp.int32)  # ragged, shorter than the window too
    want = reference(q, k, lengths, obs_window)
    got = (ps.all_query_scores(q, k, lengths, block=16) if obs_window is None
           else ps.window_scores(q, k, lengths, obs_window))
    assert np.allclose(got, want, atol=1e-5), float(jnp.abs(got - want).max())
    # Each counted query gives its keys at least probability 1 in total (the max over
    # a group of distributions sums to >= 1).
    counted = np.minimum(np.asarray(lengths), obs_window or T)
    assert np.all(np.asarray(got).sum(-1) >= counted[:, None] - 1e-4)
