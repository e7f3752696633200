"""A decode step's token writes into the unified page pool, one launch per layer.

A DiffKV decode step writes up to two tokens per (sequence, KV head) row: the
demoted victim, read from its high-tier slot and re-quantized into a low-tier
slot, then the newcomer, quantized into a high-tier slot (possibly the one the
victim left). Each token is a key row of its page (``kw`` bytes at
``slot * kw``), a value column (``vw`` bytes, one per value row, ``cap``
apart from byte ``cap * kw``) and one entry in each side array (key and value
metadata, score, position).

In XLA that is a gather and a dequantization of the victim, two quantizations
(min/max reductions, packing, metadata packing) and the scatters: about twenty
small kernels per layer. Here one program per row does all of it: the
quantization runs on the tokens' four quarters (:func:`quantize_parts`, the
same arithmetic as :func:`diffkv_jax.quantization.quantize_packed`, so the bytes
are the same), and the pool and side arrays are aliased, so updated in place
under donation. Writes aimed past the pool (the caller's "no page") are
dropped.

:func:`write_tokens_reference` is the plain-jnp version (what the cache's XLA
path does) it is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from diffkv_jax import quantization as qz
from diffkv_jax.pool_writes import scatter_columns, scatter_rows, scatter_set
from pallas_kernels import backend
from pallas_kernels.paged_decode import pack_meta, unpack_meta, unpack_meta_f32


@dataclasses.dataclass(frozen=True)
class TokenFormat:
    """How one tier stores a token: bits per key and value code, slots per page."""

    key_bits: int
    value_bits: int
    slots: int
    head_dim: int

    @property
    def key_width(self) -> int:
        return self.head_dim * self.key_bits // 8

    @property
    def value_width(self) -> int:
        return self.head_dim * self.value_bits // 8


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["page", "slot", "keys", "values", "score", "position"],
                   meta_fields=["fmt"])
@dataclasses.dataclass(frozen=True)
class NewToken:
    """One token per row ``[S, H]`` quantized into ``fmt``: its page (past the pool:
    dropped) and slot there, ``keys, values [S, H, D]`` (float), score (float32)
    and position (int32)."""

    fmt: TokenFormat
    page: jax.Array
    slot: jax.Array
    keys: jax.Array
    values: jax.Array
    score: jax.Array
    position: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["src_page", "src_slot", "page", "slot", "score", "position"],
                   meta_fields=["src_fmt", "fmt"])
@dataclasses.dataclass(frozen=True)
class MovedToken:
    """One stored token per row ``[S, H]``, read (dequantized) from ``src_page,
    src_slot`` as ``src_fmt`` and re-quantized into ``page, slot`` as ``fmt``
    (past the pool: nothing written), with the given score and position."""

    src_fmt: TokenFormat
    fmt: TokenFormat
    src_page: jax.Array
    src_slot: jax.Array
    page: jax.Array
    slot: jax.Array
    score: jax.Array
    position: jax.Array


TokenWrite = Union[NewToken, MovedToken]


def _meta_word(scale16, zero16):
    """:func:`pallas_kernels.paged_decode.pack_meta` of scalars, without a stack."""
    bits = lambda x: lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)  # noqa: E731
    return bits(scale16) | (bits(zero16) << jnp.uint32(16))


def _kernel(*refs, writes: tuple, interpret: bool):
    """``writes``: per token ``("new" | "moved", src_fmt, fmt)``, in write order."""
    n_in = 6 * len(writes)
    # The pools' outputs alias their inputs, and the kernel reads the outputs: a
    # read of the inputs would make XLA keep them apart (copy them) off the GPU.
    ins, pools_out = refs[:n_in], refs[n_in + 5:]
    data_ref, km_ref, vm_ref, sc_ref, pos_ref = pools_out
    P = data_ref.shape[0]

    def put(ref, page, cols, x):
        """``ref[page, cols] = x``, dropped when the page is past the pool."""
        n = cols.shape[0]
        if interpret:  # an index past the pool is dropped by the scatter
            ref[jnp.full((n,), jnp.where(page < P, page, P)), cols] = x
        else:
            from jax.experimental.pallas import triton as plgpu

            rows = jnp.full((n,), jnp.minimum(page, P - 1))
            plgpu.store(ref.at[rows, cols], x, mask=jnp.full((n,), page < P))

    def get(ref, page, cols):
        """``ref[page, cols]`` (a page past the pool reads the last page)."""
        rows = jnp.full(cols.shape, jnp.minimum(page, P - 1))
        if interpret:
            return ref[rows, cols]
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(ref.at[rows, cols])

    def key_cols(fmt, slot, m):
        q = fmt.head_dim // 4
        return slot * fmt.key_width + m * q + lax.broadcasted_iota(jnp.int32, (q,), 0)

    def value_cols(fmt, slot, m):
        q = fmt.head_dim // 4
        rows = fmt.key_width + m * q + lax.broadcasted_iota(jnp.int32, (q,), 0)
        return rows * fmt.slots + slot

    def read(fmt, page, slot):
        """The stored token's key and value quarters, dequantized (float32)."""
        out = []
        for cols, meta in ((key_cols, km_ref), (value_cols, vm_ref)):
            bits = fmt.key_bits if cols is key_cols else fmt.value_bits
            blocks = [get(data_ref, page, cols(fmt, slot, m)) for m in range(bits // 2)]
            scale, zero = unpack_meta_f32(get(meta, page, jnp.full((1,), slot)))
            out.append([c.astype(jnp.float32) * scale + zero
                        for c in qz.unpack_parts(blocks, bits)])
        return out

    def write(fmt, page, slot, k_parts, v_parts, score, pos):
        for parts, bits, cols, meta in ((k_parts, fmt.key_bits, key_cols, km_ref),
                                        (v_parts, fmt.value_bits, value_cols, vm_ref)):
            blocks, scale16, zero16 = qz.quantize_parts(parts, bits)
            for m, block in enumerate(blocks):
                put(data_ref, page, cols(fmt, slot, m), block)
            put(meta, page, jnp.full((1,), slot), jnp.full((1,), _meta_word(scale16, zero16)))
        put(sc_ref, page, jnp.full((1,), slot), score)
        put(pos_ref, page, jnp.full((1,), slot), pos)

    for i, (kind, src_fmt, fmt) in enumerate(writes):
        a, b, c, d, score_r, pos_r = ins[6 * i:6 * i + 6]
        if kind == "new":  # a, b: page, slot; c, d: the token's keys and values
            q = fmt.head_dim // 4
            k_parts = [c[pl.ds(j * q, q)] for j in range(4)]
            v_parts = [d[pl.ds(j * q, q)] for j in range(4)]
            write(fmt, a[0], b[0], k_parts, v_parts, score_r[...], pos_r[...])
        else:  # a, b: source page, slot; c, d: destination page, slot
            k_parts, v_parts = read(src_fmt, a[0], b[0])
            write(fmt, c[0], d[0], k_parts, v_parts, score_r[...], pos_r[...])


def _operands(w: TokenWrite):
    if isinstance(w, NewToken):
        return ("new", None, w.fmt), (w.page, w.slot, w.keys.astype(jnp.float32),
                                      w.values.astype(jnp.float32))
    return ("moved", w.src_fmt, w.fmt), (w.src_page, w.src_slot, w.page, w.slot)


def write_tokens(data, k_meta, v_meta, scores, positions, writes: Sequence[TokenWrite], *,
                 interpret: bool | None = None):
    """Write every row's tokens of ``writes`` (in order) into the pool and side arrays.

    Args:
      data: ``[P, data_bytes]`` uint8 page pool; k_meta, v_meta, scores, positions:
        ``[P, slots]`` side arrays (all updated in place when donated).
      writes: the tokens, :class:`NewToken` or :class:`MovedToken` per token of a
        row; writes of a row must target distinct slots (a later write to the same
        place wins), and a moved token is read before any later write of its row.
        Rows write only their own pages.
    Returns:
      ``(data, k_meta, v_meta, scores, positions)``.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    q = writes[0].fmt.head_dim // 4
    if not interpret and q & (q - 1):
        raise ValueError(f"head_dim {4 * q}: the GPU kernel loads quarters of a head, "
                         "which need head_dim / 4 to be a power of two")
    S, H = writes[0].page.shape
    args, in_specs, kinds = [], [], []
    row = lambda a: pl.BlockSpec((None, None, a.shape[2]), lambda s, h: (s, h, 0))  # noqa: E731
    for w in writes:
        kind, arrays = _operands(w)
        if w.fmt.head_dim % 4 or (kind[1] and kind[1].head_dim != w.fmt.head_dim):
            raise ValueError("head_dim must be a multiple of 4 and the same for every format")
        kinds.append(kind)
        for a in (*arrays, w.score.astype(jnp.float32), w.position.astype(jnp.int32)):
            a = a[..., None] if a.ndim == 2 else a  # per-row scalars as [S, H, 1]
            args.append(a.astype(jnp.int32) if a.dtype.kind in "iu" else a)
            in_specs.append(row(a))
    pools = [data, k_meta, v_meta, scores, positions]
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h: (0,) * a.ndim)  # noqa: E731
    n_in = len(args)
    kernel = functools.partial(_kernel, writes=tuple(kinds), interpret=interpret)
    return tuple(pl.pallas_call(
        kernel, grid=(S, H), in_specs=in_specs + [whole(a) for a in pools],
        out_specs=[whole(a) for a in pools],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pools],
        input_output_aliases={n_in + i: i for i in range(len(pools))}, interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(1, 1),
        name="token_writes",
    )(*args, *pools))


def read_token_reference(data, k_meta, v_meta, fmt: TokenFormat, page, slot):
    """Dequantized ``(keys, values)`` float32 ``[..., D]`` stored at ``(page, slot)``."""
    kw, vw, cap = fmt.key_width, fmt.value_width, fmt.slots
    # One gather of the token's own bytes (its key row and value column): every
    # later write to the pool then depends on this read, so XLA can update the
    # pool in place (two reads let it copy the pool instead).
    s = slot[..., None]
    cols = jnp.concatenate([s * kw + jnp.arange(kw), cap * kw + cap * jnp.arange(vw) + s],
                           axis=-1)
    tok = data[page[..., None], cols]
    ks, kz = unpack_meta(k_meta[page, slot])
    vs, vz = unpack_meta(v_meta[page, slot])
    return (qz.dequantize_packed(tok[..., :kw], ks, kz, fmt.key_bits, fmt.head_dim),
            qz.dequantize_packed(tok[..., kw:], vs, vz, fmt.value_bits, fmt.head_dim))


def write_tokens_reference(data, k_meta, v_meta, scores, positions,
                           writes: Sequence[TokenWrite]):
    """Plain-jnp :func:`write_tokens`: quantization and scatters as the cache's XLA
    path does them (out-of-range pages dropped)."""
    for w in writes:
        if isinstance(w, NewToken):
            k, v = w.keys, w.values
        else:
            P = data.shape[0]
            k, v = read_token_reference(data, k_meta, v_meta, w.src_fmt,
                                        jnp.minimum(w.src_page, P - 1), w.src_slot)
        kp, ks, kz = qz.quantize_packed(k, w.fmt.key_bits)
        vp, vs, vz = qz.quantize_packed(v, w.fmt.value_bits)
        kw = w.fmt.key_width
        data = scatter_rows(data, w.page, w.slot * kw, kp)
        data = scatter_columns(data, w.fmt.slots, w.page, kw, w.slot, vp)
        at = (w.page, w.slot)
        k_meta = scatter_set(k_meta, at, pack_meta(ks, kz))
        v_meta = scatter_set(v_meta, at, pack_meta(vs, vz))
        scores = scatter_set(scores, at, w.score)
        positions = scatter_set(positions, at, w.position)
    return data, k_meta, v_meta, scores, positions
