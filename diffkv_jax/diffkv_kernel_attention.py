"""Decode attention of the cache methods through the Pallas paged decode kernel.

:func:`kernel_decode_attention` has the contract of
:func:`diffkv_jax.diffkv_cache.compressed_decode_attention` (output plus
per-token group-max probabilities for both tiers and the new token), computed
by one kernel launch per tier straight from the packed pages, then an exact
merge with the token being decoded (kept in full precision).
:func:`full_decode_attention` is the uncompressed cache's counterpart (16-bit
pages, no probabilities), so both methods run on equally good kernels.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import backend
from pallas_kernels import paged_decode as pdk

HI, LO = 0, 1


def _splits(S: int, H: int, n_pages: int, npb: int, target: int = 264) -> int:
    """Enough splits along the sequence to give the GPU ~2 programs per SM."""
    k = 1
    while S * H * k < target and n_pages % (2 * k * npb) == 0:
        k *= 2
    return k


def full_decode_attention(q, k_pages, v_pages, page_ids, lengths):
    """:func:`diffkv_jax.attention.paged_decode_attention` through the kernel.

    ``q [S, nq, D]``; ``k_pages, v_pages [P, page_size, D]``; ``page_ids [S, H, n]``;
    ``lengths [S]`` tokens to attend to (>= 1). Returns ``[S, nq, D]`` float32.
    """
    S, nq, D = q.shape
    H, n = page_ids.shape[1], page_ids.shape[2]
    G = nq // H
    gpu = backend.on_gpu()
    ps = k_pages.shape[1]
    qf = q.astype(jnp.float32).reshape(S, H, G, D)
    qg = pdk.pad_group(qf, 16) if gpu else qf
    npb = max(1, 64 // ps)
    npad = -(-n // npb) * npb
    if npad != n:  # extra columns read the last page; masked by the token count
        page_ids = jnp.concatenate(
            [page_ids, jnp.broadcast_to(page_ids[..., -1:], (S, H, npad - n))], axis=-1)
    fmt = pdk.TierFormat(16, 16, D, ps)
    cfg = pdk.LaunchConfig(pages_per_block=npb, num_splits=_splits(S, H, npad, npb),
                           dot_dtype="bfloat16" if gpu else "float32", emit_logits=False,
                           prefetch=gpu)
    ntok = jnp.broadcast_to(lengths[:, None], (S, H)).astype(jnp.int32)
    o, m, l, _ = pdk.paged_decode_partials(qg, k_pages, v_pages, None, None, None, None,
                                           page_ids, ntok, fmt=fmt, cfg=cfg)
    out, _, _ = pdk.merge_partials([(o, m, l)])
    return out[:, :, :G].reshape(S, nq, D)


def kernel_decode_attention(method, state, layer, q, k_new, v_new, n_hi: int, n_lo: int):
    """Attention of ``q [S, nq, D]`` over the layer's cached tiers plus ``k_new, v_new [S, H, D]``.

    ``n_hi`` / ``n_lo`` are the static numbers of pages read per row and tier.
    Returns ``(out [S, nq, D], p_hi [S, H, n_hi * cap_hi], p_lo [S, H, n_lo * cap_lo],
    p_new [S, H])``.
    """
    S, nq, D = q.shape
    H = method.num_kv_heads
    G = nq // H
    gpu = backend.on_gpu()
    lay = method.layout
    qf = q.astype(jnp.float32).reshape(S, H, G, D)
    qg = pdk.pad_group(qf, 16) if gpu else qf
    rows = state.page_table[:S, layer]  # [S, H, R]
    R = rows.shape[-1]
    P1 = state.data.shape[0]
    parts, logits = [], []
    for tier, width in ((HI, n_hi), (LO, n_lo)):
        if width == 0:
            continue
        cap, tb, kw = lay.capacity(tier), lay.token_bytes(tier), lay.key_width(tier)
        t = lay.tiers[tier]
        npb = max(1, 64 // cap)
        npad = -(-width // npb) * npb
        j = jnp.arange(npad)
        cols = jnp.minimum(j, R - 1) if tier == HI else jnp.maximum(R - 1 - j, 0)
        pages = rows[:, :, cols]
        view = state.data.reshape(P1, cap, tb)  # a free reshape: tokens fill the page exactly
        fmt = pdk.TierFormat(t.k_bits, t.v_bits, D, cap, 0, kw)
        cfg = pdk.LaunchConfig(pages_per_block=npb, num_splits=_splits(S, H, npad, npb),
                               dot_dtype="bfloat16" if gpu else "float32")
        o, m, l, lg = pdk.paged_decode_partials(
            qg, view, view, state.k_scale, state.k_zero, state.v_scale, state.v_zero,
            pages, state.n_tok[:S, layer, :, tier], fmt=fmt, cfg=cfg)
        parts.append((o, m, l))
        logits.append(lg[..., : width * cap])
    Gp = qg.shape[2]
    s_new = jnp.einsum("shgd,shd->shg", qg, k_new.astype(jnp.float32)) / math.sqrt(D)
    v_ext = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, None], (S, H, Gp, D))
    out, M, L = pdk.merge_partials(parts, (v_ext, s_new, jnp.ones_like(s_new)))
    probs = [pdk.group_max_probabilities(lg, M, L, G) for lg in logits]
    p_hi = probs[0] if n_hi else jnp.zeros((S, H, 0), jnp.float32)
    p_lo = probs[-1] if n_lo else jnp.zeros((S, H, 0), jnp.float32)
    p_new = jnp.max(jnp.exp(s_new[..., :G] - M[..., :G]) / L[..., :G], axis=-1)
    return out[:, :, :G].reshape(S, nq, D), p_hi, p_lo, p_new
