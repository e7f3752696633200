"""Importance of prompt tokens without the ``T x T`` probability matrix.

The score of a prompt token is the attention probability it receives, summed
over the counted queries, each query's probability taken as the maximum over
the query heads of its GQA group (as in :func:`diffkv_jax.attention.causal_attention_probs`).

* :func:`window_scores`: only the last ``W`` queries of each prompt count
  (the observation window); costs ``W x T`` logits per head.
* :func:`all_query_scores`: every query counts, exactly, computed over blocks
  of queries so only ``block x T`` probabilities exist at a time.
* :func:`chunk_scores`: one prompt chunk's share of either (chunked prefill),
  from the chunk's attention probabilities over the prefix and itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def _group_probs(qb, k, q_pos, lengths):
    """Max-over-group probabilities ``[B, H, n, T]`` of queries ``qb [B, n, nq, D]`` at
    absolute positions ``q_pos [B, n]``; keys ``k [B, T, H, D]``, causal and ragged."""
    B, n, nq, D = qb.shape
    T, H = k.shape[1], k.shape[2]
    qg = qb.astype(jnp.float32).reshape(B, n, H, nq // H, D)
    s = jnp.einsum("bnhgd,bthd->bhgnt", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(D))
    t = jnp.arange(T)
    ok = (t[None, None, :] <= q_pos[:, :, None]) & (t[None, None, :] < lengths[:, None, None])
    s = jnp.where(ok[:, None, None], s, _NEG)
    return jax.nn.softmax(s, axis=-1).max(axis=2)


def window_scores(q, k, lengths, window: int):
    """Scores from the last ``window`` queries of each prompt: ``[B, H, T]`` float32.

    ``q [B, T, nq, D]``, ``k [B, T, H, D]``, ``lengths [B]``.
    """
    B, T = q.shape[:2]
    W = min(window, T)
    pos = lengths[:, None] - W + jnp.arange(W)[None, :]  # [B, W], may start below 0
    counted = (pos >= 0) & (pos < lengths[:, None])
    qb = jnp.take_along_axis(q, jnp.clip(pos, 0, T - 1)[:, :, None, None], axis=1)
    p = _group_probs(qb, k, pos, lengths)
    return jnp.einsum("bhnt,bn->bht", p, counted.astype(jnp.float32))


def all_query_scores(q, k, lengths, block: int = 256):
    """Scores from every prompt query, exact: ``[B, H, T]`` float32."""
    B, T = q.shape[:2]
    nb = -(-T // block)
    qp = jnp.pad(q, ((0, 0), (0, nb * block - T), (0, 0), (0, 0)))

    def one(carry, i):
        pos = i * block + jnp.arange(block)
        qb = jax.lax.dynamic_slice_in_dim(qp, i * block, block, axis=1)
        posb = jnp.broadcast_to(pos[None], (B, block))
        p = _group_probs(qb, k, posb, lengths)
        counted = (posb < lengths[:, None]).astype(jnp.float32)
        return carry + jnp.einsum("bhnt,bn->bht", p, counted), None

    init = jnp.zeros((B, k.shape[2], T), jnp.float32)
    return jax.lax.scan(one, init, jnp.arange(nb))[0]


def prompt_scores(q, k, lengths, obs_window: int | None, *, window_kernel: bool = False,
                  lse=None):
    """:func:`window_scores` when ``obs_window`` is set, else :func:`all_query_scores`.

    ``window_kernel``: the window's scores by the Pallas kernel
    (:func:`pallas_kernels.window_scores.window_scores`, same results), with
    ``lse`` (the prefill attention's softmax statistics,
    :func:`diffkv_jax.attention.prefill_attention_lse`) when there are any; the
    measured cost beside cuDNN's prefill attention is in docs/benchmarks.md.
    """
    if obs_window is None:
        return all_query_scores(q, k, lengths)
    if window_kernel:
        from pallas_kernels.window_scores import window_scores as kernel

        return kernel(q, k, lengths, obs_window, lse=lse)
    return window_scores(q, k, lengths, obs_window)


def chunk_scores(probs, q_start, lengths, counted_from):
    """What one prompt chunk's queries add to every key's score: ``[B, H, S]`` float32.

    Args:
      probs: ``[B, H, G, T, S]`` the chunk's attention probabilities
        (:func:`diffkv_jax.attention.prefix_causal_probs`).
      q_start, lengths: ``[B]`` the chunk's first position and its tokens.
      counted_from: ``[B]`` first counted query position (``prompt_len - W`` for an
        observation window of ``W``, 0 when every query counts).

    Summed over a prompt's chunks this equals :func:`window_scores` /
    :func:`all_query_scores` of the whole prompt.
    """
    T = probs.shape[3]
    pos = q_start[:, None] + jnp.arange(T)[None]
    counted = (jnp.arange(T)[None] < lengths[:, None]) & (pos >= counted_from[:, None])
    return jnp.einsum("bhts,bt->bhs", probs.max(axis=2), counted.astype(jnp.float32))
