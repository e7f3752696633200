"""The observation-window scoring kernel against prompt_scoring.window_scores."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import prompt_scoring as ps
from pallas_kernels.window_scores import window_scores


def case(seed, B, T, nq, H, D, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, nq, D)) * 1.5, dtype)
    k = jnp.asarray(rng.normal(size=(B, T, H, D)) * 1.5, dtype)
    return q, k


@pytest.mark.parametrize("T,nq,H,window,lengths,block", [
    (200, 4, 2, 64, [200, 77, 10], 64),   # ragged, a prompt shorter than the window
    (96, 9, 3, 16, [96, 50, 33], 32),     # SmolLM2's group of 3, window of 16
    (64, 4, 4, 64, [64, 1, 40], 128),     # group of 1, one block, a one-token prompt
])
def test_kernel_matches_the_reference(T, nq, H, window, lengths, block):
    q, k = case(0, len(lengths), T, nq, H, 16)
    lens = jnp.asarray(lengths, jnp.int32)
    want = np.asarray(ps.window_scores(q, k, lens, window))
    got = np.asarray(window_scores(q, k, lens, window, block=block, interpret=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    G = nq // H
    for b, n in enumerate(lengths):
        # Each counted query's probabilities sum to one per head, so their maximum over
        # the group's heads sums to between 1 and G.
        sums, c = got[b].sum(-1), min(window, n)
        assert (sums >= c * (1 - 1e-5)).all() and (sums <= G * c * (1 + 1e-5)).all()
        assert (got[b, :, n:] == 0).all() and got[b, :, :n].max() > 0


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_gpu():
    # Llama3-8B heads at 4,096 tokens in bf16 (float32 accumulation in the kernel's
    # dots; the reference upcasts the same bf16 values).
    q, k = case(1, 2, 4096, 32, 8, 128, jnp.bfloat16)
    lens = jnp.asarray([4096, 1500], jnp.int32)
    want = np.asarray(ps.window_scores(q, k, lens, 64))
    got = np.asarray(window_scores(q, k, lens, 64))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3 * scale)
