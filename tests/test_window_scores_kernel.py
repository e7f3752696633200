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


def reference_lse(q, k, lengths):
    """``[B, nq, T]`` natural-log log-sum-exp of each query's scaled causal logits;
    rows past a prompt's length NaN (the kernel must never read them into a score)."""
    B, T, nq, D = q.shape
    G = nq // k.shape[2]
    kk = np.repeat(np.asarray(k, np.float64), G, axis=2)
    s = np.einsum("btnd,bsnd->bnts", np.asarray(q, np.float64), kk) / np.sqrt(D)
    pos = np.arange(T)
    seen = pos[None, :] <= pos[:, None]
    out = np.full((B, nq, T), np.nan, np.float32)
    for b, n in enumerate(np.asarray(lengths)):
        sb = np.where(seen[None, :n, :n], s[b, :, :n, :n], -np.inf)
        top = sb.max(-1)
        out[b, :, :n] = top + np.log(np.exp(sb - top[..., None]).sum(-1))
    return jnp.asarray(out)


@pytest.mark.parametrize("T,lengths,window,block", [
    (200, [200, 77, 10], 64, 64),   # ragged, a prompt shorter than the window
    (96, [96, 50], 16, 128),        # one block
    (12, [12, 5], 64, 16),          # a bucket shorter than the window's rows
])
def test_kernel_with_the_attentions_normalizers_matches_the_reference(T, lengths, window,
                                                                     block):
    # The scoring launch alone, given each query's log-sum-exp; rows past a
    # prompt's end hold NaN there and must not reach any score.
    q, k = case(3, len(lengths), T, 8, 2, 16)
    lens = jnp.asarray(lengths, jnp.int32)
    want = np.asarray(ps.window_scores(q, k, lens, window))
    got = np.asarray(window_scores(q, k, lens, window, lse=reference_lse(q, k, lens),
                                   block=block, interpret=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_given_normalizers_of_the_wrong_shape_are_refused():
    q, k = case(4, 1, 64, 4, 2, 16)
    with pytest.raises(ValueError, match="lse must be"):
        window_scores(q, k, jnp.asarray([64]), 16, lse=jnp.zeros((1, 64, 4)), interpret=True)


@pytest.mark.gpu
def test_cudnn_statistics_feed_the_kernel_on_gpu():
    # The prefill attention's own softmax statistics (cuDNN) against the exact
    # log-sum-exp, and the scores computed from them against the reference.
    from diffkv_jax import attention

    q, k = case(5, 2, 1024, 32, 8, 128, jnp.bfloat16)
    v = k * 0.5
    lens = jnp.asarray([1024, 700], jnp.int32)
    out, lse = attention.prefill_attention_lse(q, k, v, lens)
    assert lse is not None, "cuDNN gave no softmax statistics"
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention.prefill_attention(
        q, k, v, lens)), atol=1e-2)
    want_lse = np.asarray(reference_lse(q, k, lens))
    valid = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[valid], want_lse[valid], atol=2e-3, rtol=1e-4)
    want = np.asarray(ps.window_scores(q, k, lens, 64))
    got = np.asarray(window_scores(q, k, lens, 64, lse=lse))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3 * np.abs(want).max())
