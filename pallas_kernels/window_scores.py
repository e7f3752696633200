"""Observation-window prompt scores without the window's probabilities in memory.

A prompt token's prefill score (DiffKV, SnapKV) is the sum, over the last ``W``
prompt queries, of the attention probability it receives, each taken as the
maximum over the query heads of its KV head's group
(:func:`diffkv_jax.prompt_scoring.window_scores`, the reference). XLA
materializes the ``W x T`` logits and probabilities of every query head; here
only a ``W x block`` tile per head exists at a time, in registers.

Every launch has grid ``(B, H, T / block)``: a walk over the whole prompt per
query head would leave most of the GPU idle and wait on every block in turn.

* ``_score_kernel`` takes one key block's logits under every head of the group
  (one dot each), normalizes them with each query's log-sum-exp, and sums the
  maximum over the heads of the probabilities over the counted queries. As
  exp2 is monotonic, that maximum is exp2 of the maximum of the normalized
  logits: one exp2 per query and key, not one per head.
* The normalizers come from the prefill attention when it has them (cuDNN's
  softmax statistics, :func:`diffkv_jax.attention.prefill_attention_lse`):
  the scores are then one launch. Otherwise ``_partial_normalizer_kernel``
  runs first: per key block, each query's maximum and sum of exponentials
  (``[B, blocks, nq, Wp]``, small), which every scoring program folds into
  its queries' log-sum-exps (a few kilobytes of reads: cheaper than a launch).

The window's queries are read straight from ``q`` at a row offset computed
from the prompt's length: no gather, no transposed copy, nothing between the
launches. Logits are kept in log2 units (the scale folded into one multiply),
so each softmax is a bare exp2, and masks are added rather than selected.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels.paged_decode import LOG2E, logit_scale

_NEG = -1e30


def _window_rows(len_ref, W: int, Wp: int, T: int):
    """(prompt length, first counted position, first row read, positions ``[Wp]``).

    The ``Wp`` rows read start at the window's first position, moved back to stay
    inside the ``T`` rows of ``q`` (and forward to 0 for a prompt shorter than the
    window); they always cover the window.
    """
    length = len_ref[0]
    first = length - W
    start = jnp.maximum(jnp.minimum(first, T - Wp), 0)
    return length, first, start, start + lax.broadcasted_iota(jnp.int32, (Wp,), 0)


def _mask(q_pos, k_pos, length, fill, counted_from=None):
    """``[rows, block]`` additive mask: 0 where a query row sees the key, ``fill``
    elsewhere (and on rows outside the window when ``counted_from`` is given)."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < length)
    if counted_from is not None:  # the window: rows from counted_from to the prompt's end
        seen = seen & (q_pos[:, None] >= counted_from) & (q_pos[:, None] < length)
    return jnp.where(seen, 0.0, fill).astype(jnp.float32)


def _partial_normalizer_kernel(len_ref, q_ref, k_ref, m_ref, l_ref, *, group: int, W: int,
                                Wp: int, T: int, block: int, scale: float):
    h, j = pl.program_id(1), pl.program_id(2)
    length, _, start, q_pos = _window_rows(len_ref, W, Wp, T)
    k_pos = j * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    # Finite fill: a row that sees no key of this block gets m = _NEG and a junk
    # sum, which the fold weighs by exp2(_NEG - top) = 0.
    bias = _mask(q_pos, k_pos, length, _NEG)
    keys = k_ref[...]  # [block, D]
    for g in range(group):
        q = q_ref[pl.ds(start, Wp), h * group + g, :]
        s = backend.dot(q, keys, trans_b=True) * scale + bias  # log2 units
        m = jnp.max(s, axis=1)
        m_ref[g, :] = m
        l_ref[g, :] = jnp.sum(jnp.exp2(s - m[:, None]), axis=1)


def _log_normalizers(m, l, blocks: int):
    """Per-block maxima and sums ``[blocks', Wp]`` (log2 units) -> their log2-sum-exp2
    ``[Wp]`` over the first ``blocks`` (the written ones; the rest are masked with a
    select, so whatever they hold cannot leak in)."""
    written = lax.broadcasted_iota(jnp.int32, m.shape, 0) < blocks
    m = jnp.where(written, m, _NEG)
    top = jnp.max(m, axis=0)
    total = jnp.sum(jnp.where(written, l * jnp.exp2(m - top[None]), 0.0), axis=0)
    return top + jnp.log2(jnp.maximum(total, 1e-30))


def _score_kernel(len_ref, q_ref, m_ref, l_ref, k_ref, out_ref, *, group: int, W: int,
                  Wp: int, T: int, blocks: int, block: int, scale: float, given: bool):
    h, j = pl.program_id(1), pl.program_id(2)
    length, first, start, q_pos = _window_rows(len_ref, W, Wp, T)
    k_pos = j * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    counted = (q_pos >= first) & (q_pos < length)
    keys = k_ref[...]  # [block, D]
    best = jnp.full((Wp, block), _NEG, jnp.float32)
    for g in range(group):
        if given:
            # m_ref: the attention's statistics for every row (natural log); rows
            # outside the window may hold anything, NaN included.
            lse = jnp.where(counted, m_ref[g, pl.ds(start, Wp)] * LOG2E, 0.0)
        else:
            lse = _log_normalizers(m_ref[:, g, :], l_ref[:, g, :], blocks)
        q = q_ref[pl.ds(start, Wp), h * group + g, :]
        best = jnp.maximum(best, backend.dot(q, keys, trans_b=True) * scale - lse[:, None])
    # An infinite fill: rows outside the window (padding past the prompt) may hold
    # normalizers of no key at all, and must still give exactly 0.
    p = jnp.exp2(best + _mask(q_pos, k_pos, length, -jnp.inf, counted_from=first))
    out_ref[...] = jnp.sum(p, axis=0)


def window_scores(q, k, lengths, window: int, *, lse=None, block: int = 128,
                  num_warps: int = 8, interpret: bool | None = None):
    """:func:`diffkv_jax.prompt_scoring.window_scores` in one Pallas launch (two
    without ``lse``).

    Args:
      q: ``[B, T, nq, D]`` prompt queries; k: ``[B, T, H, D]`` keys (any float dtype:
        16-bit on the GPU, where the dots accumulate in float32).
      lengths: ``[B]`` prompt lengths (at most ``T``); window: counted queries (the
        last ``window`` of each prompt).
      lse: optional ``[B, nq, T]`` float32 log-sum-exp (natural log) of each
        query's scaled causal logits over its prompt, as the prefill attention
        computes it anyway (:func:`diffkv_jax.attention.prefill_attention_lse`;
        rows outside the window are never used). Given, the normalizers' launch
        is skipped.
      block: keys per program (a power of two of at least 16).
      num_warps: warps per program on the GPU.
    Returns:
      ``[B, H, T]`` float32.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    B, T, nq, D = q.shape
    H = k.shape[2]
    if nq % H:
        raise ValueError(f"{nq} query heads do not split into groups over {H} KV heads")
    if lse is not None and lse.shape != (B, nq, T):
        raise ValueError(f"lse must be [B, nq, T] = {(B, nq, T)}, got {lse.shape}")
    G = nq // H
    W = min(window, T)
    # Window rows read per query head: a power of two of at least 16 (the smallest
    # dot tile). A prompt bucket shorter than that is padded (tiny inputs only).
    Wp = max(16, pl.next_power_of_2(W))
    if T < Wp:
        q = jnp.pad(q, ((0, 0), (0, Wp - T), (0, 0), (0, 0)))
    Tq = q.shape[1]
    bt = min(block, max(16, pl.next_power_of_2(T)))
    nT = -(-T // bt)
    kp = k if nT * bt == T else jnp.pad(k, ((0, 0), (0, nT * bt - T), (0, 0), (0, 0)))
    lens = lengths.astype(jnp.int32).reshape(B, 1)
    scale = logit_scale(D)
    params = None if interpret else backend.compiler_params(num_warps, 2)
    statics = dict(group=G, W=W, Wp=Wp, T=Tq, block=bt, scale=scale)

    grid = (B, H, nT)
    len_spec = pl.BlockSpec((None, 1), lambda b, h, j: (b, 0))
    q_spec = pl.BlockSpec((None, Tq, nq, D), lambda b, h, j: (b, 0, 0, 0))
    k_spec = pl.BlockSpec((None, bt, None, D), lambda b, h, j: (b, j, h, 0))
    if lse is not None:
        m = l = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, Tq - T)))
        stats_spec = pl.BlockSpec((None, G, Tq), lambda b, h, j: (b, h, 0))
    else:
        # The statistics' block axis is a power of two so the scoring launch loads
        # it whole; entries past nT stay unwritten and are masked there.
        nTp = pl.next_power_of_2(nT)
        part = jax.ShapeDtypeStruct((B, nTp, nq, Wp), jnp.float32)
        m, l = pl.pallas_call(
            functools.partial(_partial_normalizer_kernel, **statics),
            grid=grid,
            in_specs=[len_spec, q_spec, k_spec],
            out_specs=[pl.BlockSpec((None, None, G, Wp), lambda b, h, j: (b, j, h, 0))] * 2,
            out_shape=[part, part],
            interpret=interpret, compiler_params=params, name="window_normalizers",
        )(lens, q, kp)
        stats_spec = pl.BlockSpec((None, nTp, G, Wp), lambda b, h, j: (b, 0, h, 0))
    scores = pl.pallas_call(
        functools.partial(_score_kernel, blocks=nT, given=lse is not None, **statics),
        grid=grid,
        in_specs=[len_spec, q_spec, stats_spec, stats_spec, k_spec],
        out_specs=pl.BlockSpec((None, None, bt), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, H, nT * bt), jnp.float32),
        interpret=interpret, compiler_params=params, name="window_scores",
    )(lens, q, m, l, kp)
    return scores if nT * bt == T else scores[:, :, :T]
