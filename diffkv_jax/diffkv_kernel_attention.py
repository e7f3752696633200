"""Decode attention of the cache methods through the Pallas kernels.

:func:`kernel_decode_step` is one layer of a DiffKV decode step on the GPU
path: one attention launch over both tiers straight from the packed pages
(:func:`kernel_decode_attention`, then an exact merge with the token being
decoded, kept in full precision), one launch of the policy's score update and
victim search (:mod:`pallas_kernels.policy_scores`), then the decision and the
writes of :meth:`~diffkv_jax.diffkv_cache.DiffKVCache.apply_decision`; the
plain-jnp path it must match is ``compressed_decode_attention`` +
``decode_update``. :func:`full_decode_attention` is the uncompressed cache's
counterpart (16-bit pages, no probabilities), so both methods run on equally
good kernels.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import backend
from pallas_kernels import paged_decode as pdk

HI, LO = 0, 1
#: Programs that keep every multiprocessor of an H200 (132) busy a few times over.
TARGET_PROGRAMS = 4 * 132


def _splits(rows: int, H: int, max_pages: int) -> int:
    """Splits along the sequence so that ``rows`` active rows still fill the GPU.

    The grid covers every slot; programs of inactive rows exit at once, so only
    the active rows count towards keeping the multiprocessors busy.
    """
    k = 1
    while rows * H * k < TARGET_PROGRAMS and 2 * k <= max_pages:
        k *= 2
    return k


def _launch(S: int, H: int, max_pages: int, emit_logits: bool,
            max_active: int = 0) -> pdk.LaunchConfig:
    gpu = backend.on_gpu()
    rows = min(S, max_active) if max_active else S
    return pdk.LaunchConfig(num_splits=_splits(rows, H, max_pages) if gpu else 1,
                            dot_dtype="float16" if gpu else "float32",
                            emit_logits=emit_logits)


def _grouped_query(q, H: int):
    S, nq, D = q.shape
    qg = q.astype(jnp.float32).reshape(S, H, nq // H, D)
    return pdk.pad_group(qg, 16) if backend.on_gpu() else qg


def full_decode_attention(q, k_pages, v_pages, page_ids, lengths, max_active: int = 0):
    """:func:`diffkv_jax.attention.paged_decode_attention` through the kernel.

    ``q [S, nq, D]``; ``k_pages, v_pages [P, page_size, D]``; ``page_ids [S, H, n]``;
    ``lengths [S]`` tokens to attend to (>= 1); ``max_active``: static bound on the
    active rows (0: all), which sizes the splits. Returns ``[S, nq, D]`` float32.
    """
    S, nq, D = q.shape
    H, n = page_ids.shape[1], page_ids.shape[2]
    G = nq // H
    fmt = pdk.TierFormat(16, 16, D, k_pages.shape[1])
    ntok = jnp.broadcast_to(lengths[:, None], (S, H)).astype(jnp.int32)
    tier = pdk.TierInput(fmt, k_pages, v_pages, None, page_ids, ntok)
    o, m, l, _ = pdk.paged_decode_partials(_grouped_query(q, H), [tier], group=G,
                                           cfg=_launch(S, H, n, False, max_active))
    out, _, _ = pdk.merge_partials([(o, m, l)])
    return out[:, :, :G].reshape(S, nq, D)


def kernel_decode_attention(method, state, layer, q, k_new, v_new, n_hi: int, n_lo: int,
                            max_active: int = 0):
    """Attention of ``q [S, nq, D]`` over the layer's cached tiers plus ``k_new, v_new [S, H, D]``.

    ``n_hi`` / ``n_lo`` are the static numbers of pages read per row and tier;
    ``max_active`` a static bound on the active rows (0: all), which sizes the splits.
    Returns ``(out [S, nq, D], logits, pages, M, L, p_new)``: per tier present the
    kernel's logits (log2 units) and the page IDs it read, the merged softmax
    statistics ``[S, H, Gp]`` and the newcomer's own probability ``[S, H]``.
    """
    S, nq, D = q.shape
    H = method.num_kv_heads
    G = nq // H
    lay = method.layout
    qg = _grouped_query(q, H)
    rows = state.page_table[:S, layer]  # [S, H, R]
    R = rows.shape[-1]
    tiers, pages = [], []
    for tier, width in ((HI, n_hi), (LO, n_lo)):
        if width == 0:
            continue
        t = lay.tiers[tier]
        j = jnp.arange(width)
        cols = jnp.minimum(j, R - 1) if tier == HI else jnp.maximum(R - 1 - j, 0)
        fmt = pdk.TierFormat(t.k_bits, t.v_bits, D, lay.capacity(tier))
        keys, values = pdk.page_views(state.data, fmt)
        pages.append(rows[:, :, cols])
        tiers.append(pdk.TierInput(fmt, keys, values, (state.k_meta, state.v_meta), pages[-1],
                                   state.n_tok[:S, layer, :, tier]))
    cfg = _launch(S, H, max(n_hi, n_lo), True, max_active)
    o, m, l, logits = pdk.paged_decode_partials(qg, tiers, group=G, cfg=cfg)
    Gp = qg.shape[2]
    s_new = jnp.einsum("shgd,shd->shg", qg, k_new.astype(jnp.float32)) / math.sqrt(D)
    v_ext = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, None], (S, H, Gp, D))
    out, M, L = pdk.merge_partials([(o, m, l)], (v_ext, s_new, jnp.ones_like(s_new)))
    p_new = jnp.max(jnp.exp(s_new[..., :G] - M[..., :G]) / L[..., :G], axis=-1)
    return out[:, :, :G].reshape(S, nq, D), logits, pages, M, L, p_new


def kernel_decode_step(method, state, layer, q, k_new, v_new, n_hi: int, n_lo: int, active,
                       max_active: int = 0):
    """One layer of a DiffKV decode step on the kernels: attention, then the policy's
    score accumulation and victim search (:mod:`pallas_kernels.policy_scores`), then
    the decision and the writes (:meth:`DiffKVCache.apply_decision`).

    Returns ``(state, out [S, nq, D])``.
    """
    from diffkv_jax import diffkv_policy as pol
    from pallas_kernels.policy_scores import no_victims, score_victims

    S, nq, _ = q.shape
    G = nq // method.num_kv_heads
    out, logits, pages, M, L, p_new = kernel_decode_attention(method, state, layer, q, k_new,
                                                              v_new, n_hi, n_lo, max_active)
    caps = [method.cap(HI), method.cap(LO)][:len(pages)]
    n_tok = method.scoring_rows(state, layer, active)[:len(pages)]
    scores, victims = score_victims(logits, M, L, pages, n_tok, state.seq_len[:S],
                                    state.prompt_len[:S], state.scores, state.positions,
                                    caps=caps, group=G, rule=pol.victim_rule(method.policy))
    if len(victims) == 1:  # no low tier: no low victim
        victims.append(no_victims(S, method.num_kv_heads))
    state = method.apply_decision(state.replace(scores=scores), layer, k_new, v_new, victims,
                                  p_new, active)
    return state, out
