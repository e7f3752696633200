"""Paged decode attention over quantized (or 16-bit) pages, one tier per launch.

One program per (sequence, KV head, split) covers the whole GQA group: it
walks its share of the row's pages in blocks, computes ``q . k`` straight from
the packed codes with the scale/zero identity

    q . k_hat = scale_k * (q . codes_k) + zero_k * sum(q)
    sum_t p_t v_hat_t = sum_t (p_t scale_t) codes_t + sum_t p_t zero_t

(dequantized vectors never exist in memory), keeps an online softmax, and
writes unnormalized partial results ``(o, m, l)`` per split plus the scaled
logits of every slot. :func:`merge_partials` combines the splits of all tiers
and the token being decoded exactly (flash-decoding), and
:func:`group_max_probabilities` turns the logits into the per-token
probabilities (max over the group) that the tiering policy accumulates.

Packed layouts come from :mod:`diffkv_jax.quantization`: a 4-bit byte holds
dims ``j`` and ``j + D/2``, a 2-bit byte dims ``j + i*D/4``. Since the Triton
lowering has no in-kernel concatenate, the kernel splits ``q`` into the
matching slices and keeps the output as one accumulator per packed value
slice (``D``, two ``D/2`` or four ``D/4`` dims for 8/16, 4 and 2 bits).

The pool of one tier is seen as ``[pages, slots, token_width]``: each token's
key bytes start at ``k_offset`` and its value bytes at ``v_offset`` (for the
unified pages both live in the same array; the 16-bit cache passes separate
key and value pools).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend

NEG_INF = -1e30
MAGIC_BITS = 0x6400  # float16 1024.0: its 10 mantissa bits hold an integer code exactly
MAGIC = 1024.0


@dataclasses.dataclass(frozen=True)
class TierFormat:
    """How one tier's tokens are stored.

    ``k_bits``/``v_bits``: 8, 4 or 2 for quantized codes with per-token fp16
    scale/zero; 16 for raw 16/32-bit floats (no metadata).
    """

    k_bits: int
    v_bits: int
    head_dim: int
    slots: int  # tokens per page
    k_offset: int = 0  # element offset of the key inside a token row
    v_offset: int = 0

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs (static)."""

    pages_per_block: int = 2
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dot_dtype: str = "bfloat16"
    emit_logits: bool = True  # off when the caller needs no per-token probabilities
    logits_dtype: str = "float32"
    prefetch: bool = False  # load block i + 1 while computing block i
    # True: scale/shift the codes per token in registers before the dots; False:
    # apply scale/zero to the logits and probabilities (the identities above).
    dequant_in_registers: bool = False
    # How integer codes become dot operands (quantized tiers, identities path):
    # "magic" ORs the code into the mantissa of float16 1024.0 (bits 0x6400 | c is
    # exactly 1024 + c) and folds the 1024 into the zero terms: integer ALU work
    # only. "cvt" uses int-to-float conversions, which run at 1/8 of the integer
    # rate on Hopper and bound the kernel at well under copy bandwidth.
    code_convert: str = "magic"
    # Diagnostics only (results are wrong): leave stages out to time what they cost.
    # Any of "v" (value loads and dots), "softmax", "meta" (metadata loads), "k_dot".
    skip: tuple[str, ...] = ()

    def __post_init__(self):
        if self.code_convert not in ("magic", "cvt"):
            raise ValueError(f"code_convert must be 'magic' or 'cvt', got {self.code_convert!r}")


def _cast(x, dtype):
    return x.astype(jnp.dtype(dtype))


def _kernel(q_ref, k_ref, v_ref, ks_ref, kz_ref, vs_ref, vz_ref, pages_ref, ntok_ref,
            o_ref, m_ref, l_ref, s_ref, *, fmt: TierFormat, cfg: LaunchConfig,
            pages_per_split: int):
    D, cap, npb = fmt.head_dim, fmt.slots, cfg.pages_per_block
    n = npb * cap
    # The output is kept as `parts` accumulators of D/parts dims, one per packed
    # slice of the value codes (no in-kernel concatenate on this backend).
    parts = 1 if fmt.v_bits == 16 else 8 // fmt.v_bits
    w = D // parts
    G = q_ref.shape[0]
    # float32 dots keep exact conversions: with the 2^23 float32 magic the offset
    # terms would cancel catastrophically.
    magic = (fmt.quantized and cfg.code_convert == "magic" and not cfg.dequant_in_registers
             and cfg.dot_dtype != "float32")
    # The magic operands are float16 (exact for codes < 1024); q goes to float16 too.
    dt = "float16" if magic else cfg.dot_dtype
    split = pl.program_id(2)
    n_tok = ntok_ref[0]
    row_pages = (n_tok + cap - 1) // cap
    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, row_pages)
    n_blocks = jnp.maximum(last_page - first_page + npb - 1, 0) // npb

    q = q_ref[...].astype(jnp.float32) * (1.0 / math.sqrt(D))
    q_dt = _cast(q, dt)
    # Sum of the rounded q, so the offset terms cancel exactly against the dots.
    q_sum = jnp.sum(q_dt.astype(jnp.float32), axis=1)

    def q_slice(i, width):
        return _cast(q_ref[:, pl.ds(i * width, width)].astype(jnp.float32)
                     * (1.0 / math.sqrt(D)), dt)

    def rows(ref, ids, start, width):
        return ref[ids, :, pl.ds(start, width)].reshape(n, width)

    def meta(ref, ids):
        return ref[ids, pl.ds(0, cap)].reshape(n).astype(jnp.float32)

    def load_block(blk):
        """Raw bytes (or 16-bit values) and metadata of one block of pages.

        Loads are issued one block ahead of the math (software prefetch): the
        unpacking between load and dot keeps the compiler from pipelining them.
        """
        ids = pages_ref[pl.ds(first_page + blk * npb, npb)]
        kb, ko, vb, vo = fmt.k_bits, fmt.k_offset, fmt.v_bits, fmt.v_offset
        kwidth = D if kb in (16, 8) else D * kb // 8
        k = rows(k_ref, ids, ko, kwidth)
        v = None if "v" in cfg.skip else rows(v_ref, ids, vo, D if vb in (16, 8) else D * vb // 8)
        if "meta" in cfg.skip:
            metas = tuple(jnp.full((n,), 0.5, jnp.float32) for _ in range(4)) \
                if fmt.quantized else ()
        else:
            metas = tuple(meta(r, ids) for r in (ks_ref, kz_ref, vs_ref, vz_ref)) \
                if fmt.quantized else ()
        return k, v, metas

    def operand(c):
        """Codes or 16-bit values as dot operands (codes become ``1024 + c`` under the
        magic conversion, which only quantized tiers use)."""
        if magic:
            return lax.bitcast_convert_type(c.astype(jnp.uint16) | jnp.uint16(MAGIC_BITS),
                                            jnp.float16)
        return _cast(c, dt)

    def deq(codes, scale, zero):
        return _cast(codes.astype(jnp.float32) * scale[:, None] + zero[:, None], dt)

    def logits_of(k, metas):
        kb = fmt.k_bits
        if "k_dot" in cfg.skip:
            return jnp.broadcast_to(jnp.sum(k.astype(jnp.float32), axis=1)[None, :], (G, n))
        if fmt.quantized and cfg.dequant_in_registers:
            ks, kz = metas[0], metas[1]
            if kb == 8:
                return backend.dot(q_dt, deq(k, ks, kz), trans_b=True)
            if kb == 4:
                return (backend.dot(q_slice(0, D // 2), deq(k & 0xF, ks, kz), trans_b=True)
                        + backend.dot(q_slice(1, D // 2), deq(k >> 4, ks, kz), trans_b=True))
            acc = backend.dot(q_slice(0, w), deq(k & 0x3, ks, kz), trans_b=True)
            for i in range(1, 4):
                acc += backend.dot(q_slice(i, w), deq((k >> (2 * i)) & 0x3, ks, kz),
                                   trans_b=True)
            return acc
        if kb in (16, 8):
            acc = backend.dot(q_dt, operand(k), trans_b=True)
        elif kb == 4:
            acc = backend.dot(q_slice(0, D // 2), operand(k & 0xF), trans_b=True)
            acc += backend.dot(q_slice(1, D // 2), operand(k >> 4), trans_b=True)
        else:  # 2 bits
            acc = backend.dot(q_slice(0, w), operand(k & 0x3), trans_b=True)
            for i in range(1, 4):
                acc += backend.dot(q_slice(i, w), operand((k >> (2 * i)) & 0x3), trans_b=True)
        if fmt.quantized:
            ks, kz = metas[0], metas[1]
            if magic:  # q . (c + 1024) = q . c + 1024 sum(q)
                kz = kz - MAGIC * ks
            acc = acc * ks[None, :] + q_sum[:, None] * kz[None, :]
        return acc

    def value_parts(v):
        vb = fmt.v_bits
        if vb in (16, 8):
            return [v]
        mask = (1 << vb) - 1
        return [v & mask] + [(v >> (vb * i)) & mask for i in range(1, parts)]

    def body(blk, carry):
        *accs, m_prev, l_prev, pre = carry
        if cfg.prefetch:
            k, v, metas = pre
            nxt = load_block(jnp.minimum(blk + 1, jnp.maximum(n_blocks - 1, 0)))
        else:
            (k, v, metas), nxt = load_block(blk), pre
        page0 = first_page + blk * npb
        s = logits_of(k, metas)
        slot = page0 * cap + lax.broadcasted_iota(jnp.int32, (G, n), 1)
        s = jnp.where(slot < n_tok, s, NEG_INF)
        if cfg.emit_logits:
            s_ref[:, pl.ds(blk * n, n)] = s.astype(s_ref.dtype)
        if "softmax" in cfg.skip:
            m_next, corr, p, l_next = m_prev, jnp.ones_like(m_prev), s, l_prev
        else:
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            corr = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, None])
            l_next = l_prev * corr + jnp.sum(p, axis=1)
        if v is None:
            return (*[o + jnp.sum(p, axis=1)[:, None] for o in accs], m_next, l_next, nxt)
        vparts = value_parts(v)
        if fmt.quantized and cfg.dequant_in_registers:
            pv, zero_term = p, 0.0
            vparts = [deq(vp, metas[2], metas[3]) for vp in vparts]
        elif fmt.quantized:
            pv = _cast(p * metas[2][None, :], dt)
            zero_term = jnp.sum(p * metas[3][None, :], axis=1)[:, None]
            if magic:  # (p s) . (c + 1024): remove 1024 sum(p s) with the rounded weights
                zero_term = zero_term - MAGIC * jnp.sum(pv.astype(jnp.float32), axis=1)[:, None]
        else:
            pv, zero_term = p, 0.0
        pv = _cast(pv, dt)
        outs = [o * corr[:, None] + backend.dot(pv, operand(vp)) + zero_term
                for o, vp in zip(accs, vparts)]
        return (*outs, m_next, l_next, nxt)

    zeros = jnp.zeros((G, w), jnp.float32)
    pre = load_block(0) if cfg.prefetch else jnp.zeros((), jnp.int32)
    init = (*([zeros] * parts), jnp.full((G,), NEG_INF, jnp.float32),
            jnp.zeros((G,), jnp.float32), pre)
    *accs, m, l, _ = lax.fori_loop(0, n_blocks, body, init)
    for i, o in enumerate(accs):
        o_ref[:, pl.ds(i * w, w)] = o
    m_ref[...] = m
    l_ref[...] = l


def paged_decode_partials(q, k_pool, v_pool, k_scale, k_zero, v_scale, v_zero, pages, n_tok, *,
                          fmt: TierFormat, cfg: LaunchConfig = LaunchConfig(),
                          interpret: bool | None = None):
    """Partial attention of one tier.

    Args:
      q: ``[S, H, G, D]`` queries grouped by KV head (``G`` padded to a multiple of 16
        on the GPU by the caller, see :func:`pad_group`).
      k_pool, v_pool: ``[P, slots, width]`` token rows (may be the same array).
      k_scale, k_zero, v_scale, v_zero: ``[P, >= slots]`` float16 metadata, or None
        for 16-bit tiers.
      pages: ``[S, H, NP]`` int32 page IDs of each row in token order (``NP`` a
        multiple of ``num_splits * pages_per_block``; entries past the row's pages
        must still be valid page IDs, e.g. a trash page).
      n_tok: ``[S, H]`` int32 tokens stored in each row's pages of this tier.
    Returns:
      ``o [S, H, K, G, D]``, ``m, l [S, H, K, G]`` (float32, K = num_splits) and
      ``logits [S, H, G, NP * slots]`` (scaled by 1/sqrt(D); slots >=
      n_tok hold garbage and must be masked by the caller; None when
      ``cfg.emit_logits`` is False).
    """
    if interpret is None:
        interpret = backend.default_interpret()
    S, H, G, D = q.shape
    NP = pages.shape[-1]
    K, npb = cfg.num_splits, cfg.pages_per_block
    if NP % (K * npb):
        raise ValueError(f"pages per row ({NP}) must be a multiple of splits x pages_per_block "
                         f"({K} x {npb})")
    if D % 16:
        raise ValueError("head_dim must be a multiple of 16")
    pps = NP // K
    cap = fmt.slots
    rows_out = G
    for pool in (k_pool, v_pool):
        # The Triton lowering indexes a ref with 32-bit signed element offsets unless
        # it holds more than 2^32 bytes; in between, offsets would overflow.
        if pool.size >= 2**31 and pool.size * pool.dtype.itemsize <= 2**32:
            raise ValueError(f"a pool of {pool.size} elements of {pool.dtype.itemsize} bytes "
                             "cannot be addressed by one kernel launch (32-bit offsets); "
                             "use a pool under 2^31 elements or over 4 GiB")
    s_cols = pps * cap if cfg.emit_logits else 1
    quant = fmt.quantized
    dummy = jnp.zeros((1, 1), jnp.float16)
    metas = [k_scale, k_zero, v_scale, v_zero] if quant else [dummy] * 4
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h, k: (0,) * a.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, fmt=fmt, cfg=cfg, pages_per_split=pps)
    o, m, l, s = pl.pallas_call(
        kernel,
        grid=(S, H, K),
        in_specs=[
            pl.BlockSpec((None, None, G, D), lambda s, h, k: (s, h, 0, 0)),
            whole(k_pool), whole(v_pool),
            *[whole(a) for a in metas],
            pl.BlockSpec((None, None, NP), lambda s, h, k: (s, h, 0)),
            pl.BlockSpec((None, None, 1), lambda s, h, k: (s, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, G, D), lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, G), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, G), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, rows_out, s_cols), lambda s, h, k: (s, h, k, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, H, K, G, D), jnp.float32),
            jax.ShapeDtypeStruct((S, H, K, G), jnp.float32),
            jax.ShapeDtypeStruct((S, H, K, G), jnp.float32),
            jax.ShapeDtypeStruct((S, H, K, rows_out, s_cols), jnp.dtype(cfg.logits_dtype)),
        ],
        interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(cfg.num_warps,
                                                                       cfg.num_stages),
        name=f"paged_decode_k{fmt.k_bits}v{fmt.v_bits}",
    )(q, k_pool, v_pool, *metas, pages, n_tok[..., None])
    if not cfg.emit_logits:
        return o, m, l, None
    logits = s.transpose(0, 1, 3, 2, 4).reshape(S, H, rows_out, NP * cap)
    return o, m, l, logits.astype(jnp.float32)


def pad_group(q, multiple: int):
    """Pad the group axis of ``q [S, H, G, D]`` to a multiple (the GPU dot needs >= 16 rows)."""
    G = q.shape[2]
    target = -(-G // multiple) * multiple
    if target == G:
        return q
    return jnp.pad(q, ((0, 0), (0, 0), (0, target - G), (0, 0)))


def merge_partials(parts, extra=None):
    """Exact merge of split partials (flash-decoding).

    Args:
      parts: list of ``(o [S,H,K,G,D], m [S,H,K,G], l [S,H,K,G])``.
      extra: optional ``(o [S,H,G,D], m [S,H,G], l [S,H,G])`` for one more source
        (e.g. the token being decoded, with ``l = 1``).
    Returns:
      ``(out [S,H,G,D], M [S,H,G], L [S,H,G])``: normalized output and the global
      softmax max and normalizer (so ``p = exp(logit - M) / L``).
    """
    os = [p[0] for p in parts]
    ms = [p[1] for p in parts]
    ls = [p[2] for p in parts]
    if extra is not None:
        os.append(extra[0][:, :, None])
        ms.append(extra[1][:, :, None])
        ls.append(extra[2][:, :, None])
    o = jnp.concatenate(os, axis=2)
    m = jnp.concatenate(ms, axis=2)
    l = jnp.concatenate(ls, axis=2)
    M = jnp.max(m, axis=2)
    c = jnp.exp(m - M[:, :, None])
    L = jnp.sum(l * c, axis=2)
    out = jnp.sum(o * c[..., None], axis=2) / L[..., None]
    return out, M, L


def group_max_probabilities(logits, M, L, group: int):
    """``max_g exp(logit - M_g) / L_g`` over the first ``group`` rows: ``[S, H, n]``."""
    p = jnp.exp(logits[:, :, :group] - M[:, :, :group, None]) / L[:, :, :group, None]
    return jnp.max(p, axis=2)


def tier_attention_reference(q, k_hat, v_hat, n_tok):
    """Plain-jnp reference of one tier: partials with a single split.

    Args:
      q: ``[S, H, G, D]``; k_hat, v_hat: ``[S, H, n, D]`` dequantized tokens in slot order;
      n_tok: ``[S, H]``.
    Returns:
      ``(o [S,H,1,G,D], m, l [S,H,1,G], logits [S,H,G,n])`` with the same meaning
      as :func:`paged_decode_partials`.
    """
    D = q.shape[-1]
    s = jnp.einsum("shgd,shnd->shgn", q.astype(jnp.float32), k_hat.astype(jnp.float32))
    s = s / math.sqrt(D)
    valid = jnp.arange(k_hat.shape[2])[None, None, None, :] < n_tok[:, :, None, None]
    s = jnp.where(valid, s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("shgn,shnd->shgd", p, v_hat.astype(jnp.float32))
    return o[:, :, None], m[:, :, None], l[:, :, None], s
