"""Observation-window prompt scores without the window's probabilities in memory.

A prompt token's prefill score (DiffKV, SnapKV) is the sum, over the last ``W``
prompt queries, of the attention probability it receives, each taken as the
maximum over the query heads of its KV head's group
(:func:`diffkv_jax.prompt_scoring.window_scores`, the reference). XLA
materializes the ``W x T`` logits and probabilities of every query head; here
only a ``W x block`` tile per head exists at a time, in registers:

1. ``_partial_normalizer_kernel``, grid ``(B, H, T / block)``: one key block's
   logits under every head of the group, reduced to a per-query maximum and sum
   of exponentials; a log-sum-exp over the blocks (``[B, nq, W, T / block]``,
   small) gives each query's log-normalizer. The grid is as wide as the
   second launch's: a walk over the whole prompt per query head would leave
   most of the GPU idle and wait on every block in turn.
2. ``_score_kernel``, grid ``(B, H, T / block)``: one key block's probabilities
   under every head of the group (one dot each), their maximum over the heads,
   summed over the counted queries.

Each launch reads the keys once, so the cost is about two reads of the prompt's
keys per layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend

_NEG = -1e30


def _row_positions(row_ref, W: int, block: int, first):
    """(prompt length, query positions ``[W]``, key positions ``[block]`` from ``first``)."""
    length, q0 = row_ref[0], row_ref[1]
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, (W,), 0)
    k_pos = first + lax.broadcasted_iota(jnp.int32, (block,), 0)
    return length, q_pos, k_pos


def _logits(q, keys, q_pos, k_pos, length, scale):
    s = backend.dot(q, keys, trans_b=True) * scale  # [W, block], float32
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < length)
    return jnp.where(seen, s, _NEG), seen


def _partial_normalizer_kernel(row_ref, q_ref, k_ref, m_ref, l_ref, *, group: int,
                                W: int, block: int, scale: float):
    j = pl.program_id(2)
    length, q_pos, k_pos = _row_positions(row_ref, W, block, j * block)
    keys = k_ref[...]  # [block, D]
    for g in range(group):
        s, seen = _logits(q_ref[g], keys, q_pos, k_pos, length, scale)
        m = jnp.max(s, axis=1)
        m_ref[g, :] = m
        l_ref[g, :] = jnp.sum(jnp.where(seen, jnp.exp(s - m[:, None]), 0.0), axis=1)


def _score_kernel(row_ref, counted_ref, q_ref, lse_ref, k_ref, out_ref, *, group: int, W: int,
                  block: int, scale: float):
    j = pl.program_id(2)
    length, q_pos, k_pos = _row_positions(row_ref, W, block, j * block)
    keys = k_ref[...]  # [block, D]
    best = jnp.zeros((W, block), jnp.float32)
    for g in range(group):  # q_ref, lse_ref: this KV head's group of query heads
        s, seen = _logits(q_ref[g], keys, q_pos, k_pos, length, scale)
        p = jnp.where(seen, jnp.exp(s - lse_ref[g][:, None]), 0.0)
        best = jnp.maximum(best, p)
    out_ref[...] = jnp.sum(best * counted_ref[...][:, None], axis=0)


def window_scores(q, k, lengths, window: int, *, block: int = 128,
                  interpret: bool | None = None):
    """:func:`diffkv_jax.prompt_scoring.window_scores` in two Pallas launches.

    Args:
      q: ``[B, T, nq, D]`` prompt queries; k: ``[B, T, H, D]`` keys (any float dtype:
        16-bit on the GPU, where the dots accumulate in float32).
      lengths: ``[B]`` prompt lengths; window: counted queries (the last ``window``).
      block: keys per program (a power of two).
    Returns:
      ``[B, H, T]`` float32.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    B, T, nq, D = q.shape
    H = k.shape[2]
    G = nq // H
    W = min(window, T)
    # Window rows padded to a power of two of at least 16 (the smallest dot tile);
    # rows past the window sit past the prompt's end and are not counted.
    Wp = max(16, pl.next_power_of_2(W))
    bt = min(block, max(16, pl.next_power_of_2(T)))
    nT = -(-T // bt)
    lengths = lengths.astype(jnp.int32)
    q0 = lengths - W
    pos = q0[:, None] + jnp.arange(Wp, dtype=jnp.int32)[None]
    counted = ((pos >= 0) & (pos < lengths[:, None])).astype(jnp.float32)
    qw = jnp.take_along_axis(q, jnp.clip(pos, 0, T - 1)[:, :, None, None], axis=1)
    qw = qw.transpose(0, 2, 1, 3)  # [B, nq, Wp, D]
    kp = k if nT * bt == T else jnp.pad(k, ((0, 0), (0, nT * bt - T), (0, 0), (0, 0)))
    rows = jnp.stack([lengths, q0], axis=1)  # [B, 2]
    scale = 1.0 / math.sqrt(D)
    params = None if interpret else backend.compiler_params(4, 2)

    part = jax.ShapeDtypeStruct((B, nT, nq, Wp), jnp.float32)
    part_spec = pl.BlockSpec((None, None, G, Wp), lambda b, h, j: (b, j, h, 0))
    m, l = pl.pallas_call(
        functools.partial(_partial_normalizer_kernel, group=G, W=Wp, block=bt, scale=scale),
        grid=(B, H, nT),
        in_specs=[pl.BlockSpec((None, 2), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, G, Wp, D), lambda b, h, j: (b, h, 0, 0)),
                  pl.BlockSpec((None, bt, None, D), lambda b, h, j: (b, j, h, 0))],
        out_specs=[part_spec, part_spec],
        out_shape=[part, part],
        interpret=interpret, compiler_params=params, name="window_normalizers",
    )(rows, qw, kp)
    # A block no counted key reaches has m = -1e30 and l = 0: it adds nothing.
    lse = jax.nn.logsumexp(m + jnp.log(jnp.maximum(l, 1e-30)), axis=1)  # [B, nq, Wp]

    scores = pl.pallas_call(
        functools.partial(_score_kernel, group=G, W=Wp, block=bt, scale=scale),
        grid=(B, H, nT),
        in_specs=[pl.BlockSpec((None, 2), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, Wp), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, G, Wp, D), lambda b, h, j: (b, h, 0, 0)),
                  pl.BlockSpec((None, G, Wp), lambda b, h, j: (b, h, 0)),
                  pl.BlockSpec((None, bt, None, D), lambda b, h, j: (b, j, h, 0))],
        out_specs=pl.BlockSpec((None, None, bt), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, H, nT * bt), jnp.float32),
        interpret=interpret, compiler_params=params, name="window_scores",
    )(rows, counted, qw, lse, kp)
    return scores[:, :, :T]
