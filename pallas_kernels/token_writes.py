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


class _Pool:
    """One program's reads and writes of stored tokens in the aliased pool refs.

    The kernels read the pools' outputs, not their inputs: a read of the inputs
    would make XLA keep the two apart (copy the pool) off the GPU.
    """

    def __init__(self, pools_out, interpret: bool):
        self.data_ref, self.km_ref, self.vm_ref, self.sc_ref, self.pos_ref = pools_out
        self.interpret = interpret
        self.P = self.data_ref.shape[0]

    def put(self, ref, page, cols, x):
        """``ref[page, cols] = x``, dropped when the page is past the pool."""
        n, P = cols.shape[0], self.P
        if self.interpret:  # an index past the pool is dropped by the scatter
            ref[jnp.full((n,), jnp.where(page < P, page, P)), cols] = x
        else:
            from jax.experimental.pallas import triton as plgpu

            rows = jnp.full((n,), jnp.minimum(page, P - 1))
            plgpu.store(ref.at[rows, cols], x, mask=jnp.full((n,), page < P))

    def get(self, ref, page, cols):
        """``ref[page, cols]`` (a page past the pool reads the last page)."""
        rows = jnp.full(cols.shape, jnp.minimum(page, self.P - 1))
        if self.interpret:
            return ref[rows, cols]
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(ref.at[rows, cols])

    @staticmethod
    def key_cols(fmt, slot, m):
        q = fmt.head_dim // 4
        return slot * fmt.key_width + m * q + lax.broadcasted_iota(jnp.int32, (q,), 0)

    @staticmethod
    def value_cols(fmt, slot, m):
        q = fmt.head_dim // 4
        rows = fmt.key_width + m * q + lax.broadcasted_iota(jnp.int32, (q,), 0)
        return rows * fmt.slots + slot

    def read(self, fmt, page, slot):
        """The stored token's key and value quarters, dequantized (float32)."""
        out = []
        for cols, meta, bits in ((self.key_cols, self.km_ref, fmt.key_bits),
                                 (self.value_cols, self.vm_ref, fmt.value_bits)):
            blocks = [self.get(self.data_ref, page, cols(fmt, slot, m)) for m in range(bits // 2)]
            scale, zero = unpack_meta_f32(self.get(meta, page, jnp.full((1,), slot)))
            out.append([c.astype(jnp.float32) * scale + zero
                        for c in qz.unpack_parts(blocks, bits)])
        return out

    def write(self, fmt, page, slot, k_parts, v_parts, score, pos):
        """Quantize a token's quarters into ``(page, slot)`` with its side entries."""
        for parts, bits, cols, meta in ((k_parts, fmt.key_bits, self.key_cols, self.km_ref),
                                        (v_parts, fmt.value_bits, self.value_cols, self.vm_ref)):
            blocks, scale16, zero16 = qz.quantize_parts(parts, bits)
            for m, block in enumerate(blocks):
                self.put(self.data_ref, page, cols(fmt, slot, m), block)
            self.put(meta, page, jnp.full((1,), slot),
                     jnp.full((1,), _meta_word(scale16, zero16)))
        one = lambda x: jnp.broadcast_to(x, (1,))  # noqa: E731
        self.put(self.sc_ref, page, jnp.full((1,), slot), one(score).astype(jnp.float32))
        self.put(self.pos_ref, page, jnp.full((1,), slot), one(pos).astype(jnp.int32))


def quarters_fit(head_dim: int) -> bool:
    """Whether the GPU kernels can load a head in quarters (``head_dim / 4`` a power of
    two: the Triton lowering loads power-of-two vectors)."""
    q = head_dim // 4
    return q & (q - 1) == 0


def _check_quarters(head_dim: int) -> None:
    if not quarters_fit(head_dim):
        raise ValueError(f"head_dim {head_dim}: the GPU kernel loads quarters of a head, "
                         "which need head_dim / 4 to be a power of two")


def _quarters(ref, head_dim: int):
    """A ``[D]`` row ref as its four quarters (loaded)."""
    q = head_dim // 4
    return [ref[pl.ds(j * q, q)] for j in range(4)]


def _kernel(*refs, writes: tuple, interpret: bool):
    """``writes``: per token ``("new" | "moved", src_fmt, fmt)``, in write order."""
    n_in = 6 * len(writes)
    ins, pool = refs[:n_in], _Pool(refs[n_in + 5:], interpret)
    for i, (kind, src_fmt, fmt) in enumerate(writes):
        a, b, c, d, score_r, pos_r = ins[6 * i:6 * i + 6]
        if kind == "new":  # a, b: page, slot; c, d: the token's keys and values
            pool.write(fmt, a[0], b[0], _quarters(c, fmt.head_dim), _quarters(d, fmt.head_dim),
                       score_r[...], pos_r[...])
        else:  # a, b: source page, slot; c, d: destination page, slot
            k_parts, v_parts = pool.read(src_fmt, a[0], b[0])
            pool.write(fmt, c[0], d[0], k_parts, v_parts, score_r[...], pos_r[...])


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
    if not interpret:
        _check_quarters(writes[0].fmt.head_dim)
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


def _row_victim(vi_ref, vf_ref, t: int):
    """Tier ``t``'s victim of a row from its splits' partial victims, as
    :func:`policy_scores.merge_victims` (columns read from the refs: the Triton
    lowering slices no loaded values): ``(slot or -1, key, pos, score)``."""
    from pallas_kernels.policy_scores import pick_victim

    return pick_victim(vi_ref[:, 3 * t], vi_ref[:, 3 * t + 1], vi_ref[:, 3 * t + 2],
                       vf_ref[:, 2 * t], vf_ref[:, 2 * t + 1])


def _decide_kernel(vi_ref, vf_ref, info_ref, k_ref, v_ref, p_ref, layer_ref, table_ref, *refs,
                   decide, place, high: TokenFormat, low: TokenFormat, interpret: bool):
    # refs: the pools and the tier counts as inputs (aliased, unread), then as outputs.
    pool, n_ref = _Pool(refs[6:11], interpret), refs[11]
    s_i, h_i, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    (vh, key_h, pos_h, score_h), (vl, key_l, pos_l, _) = (_row_victim(vi_ref, vf_ref, t)
                                                          for t in (0, 1))
    # The row's counts in the whole array (read from the output, as the pools are).
    n_row = n_ref[s_i, layer, h_i, :]
    n_high, n_low = n_ref[s_i, layer, h_i, 0], n_ref[s_i, layer, h_i, 1]
    cur, act = info_ref[0], info_ref[1] > 0
    d = decide(vh, key_h, pos_h, vl, key_l, pos_l, n_high, n_low, cur)
    R = table_ref.shape[-1]
    page_at = lambda col: table_ref[s_i, layer, h_i, jnp.clip(col, 0, R - 1)]  # noqa: E731
    src_page, src_slot, low_page, low_slot, new_page, new_slot = place(
        d, vh, act, page_at, jnp.int32(pool.P))  # a page past the pool drops the write
    # The demoted victim first: it is read from its high slot, which the newcomer may take.
    k_parts, v_parts = pool.read(high, src_page, src_slot)
    pool.write(low, low_page, low_slot, k_parts, v_parts, score_h, pos_h)
    f32 = lambda parts: [x.astype(jnp.float32) for x in parts]  # noqa: E731
    pool.write(high, new_page, new_slot, f32(_quarters(k_ref, high.head_dim)),
               f32(_quarters(v_ref, high.head_dim)), p_ref[...], cur)
    lane = lax.broadcasted_iota(jnp.int32, (2,), 0)
    after = jnp.where(lane == 0, d["n_high"], d["n_low"]).astype(jnp.int32)
    n_ref[s_i, layer, h_i, :] = jnp.where(act, after, n_row)


def decide_and_write(data, k_meta, v_meta, scores, positions, n_tok, *, layer, victims,
                     page_table, cur, active, k_new, v_new, p_new, decide, place,
                     high: TokenFormat, low: TokenFormat, interpret: bool | None = None):
    """One DiffKV decode step's decision and token writes per row, one launch per layer.

    Each row merges its victims from the policy kernel's partial ones, takes the
    decision (``decide``, e.g. ``functools.partial(diffkv_policy.decode_decision,
    policy)``, on the row's scalars), looks its pages up in its page-table row
    (``place``: ``DiffKVCache.placements``, the XLA path's own), and writes: the
    demoted victim re-quantized from its high slot into a low slot (or nowhere),
    then the newcomer into its high slot, as :func:`write_tokens` with a
    :class:`MovedToken` and a :class:`NewToken`. The tier counts and the page
    table are the cache's whole arrays, indexed by ``layer`` in the launch (no
    per-layer slice or update of them outside it); the counts are updated in place.

    Args:
      victims: ``(vi, vf)`` of ``policy_scores.score_victims(..., merge=False)`` over
        the high and the low tier.
      n_tok: ``[S', L, H, 2]`` tokens held per tier by every row (``S' >= S``) and
        layer; layer: the layer (an int32 scalar, traced or not); page_table:
        ``[S', L, H, R]`` (high pages from the left of a row, low pages from the
        right end).
      cur: ``[S]`` the newcomer's position; active: ``[S]`` rows that decode (the
        others write nothing and keep their counts).
      k_new, v_new: ``[S, H, D]`` (any float dtype); p_new: ``[S, H]`` the
        newcomer's score.
    Returns:
      ``(data, k_meta, v_meta, scores, positions, n_tok)``, ``n_tok`` whole, the
      layer's first ``S`` rows after the step.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    if not interpret:
        _check_quarters(high.head_dim)
    vi, vf = victims
    S, H = k_new.shape[:2]
    if n_tok.dtype != jnp.int32 or n_tok.shape[0] < S or n_tok.shape[2] != H:
        raise ValueError(f"n_tok must be int32 [>= {S}, L, {H}, 2], got {n_tok.dtype} "
                         f"{n_tok.shape}")
    info = jnp.stack([jnp.broadcast_to(cur[:, None], (S, H)),
                      jnp.broadcast_to(active[:, None], (S, H))], -1).astype(jnp.int32)
    args = [vi.astype(jnp.int32), vf.astype(jnp.float32), info, k_new, v_new,
            p_new.astype(jnp.float32)[..., None]]
    row = lambda a: pl.BlockSpec((None, None) + a.shape[2:],  # noqa: E731
                                 lambda s, h: (s, h) + (0,) * (a.ndim - 2))
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h: (0,) * a.ndim)  # noqa: E731
    indexed = [jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32)]
    updated = [data, k_meta, v_meta, scores, positions, n_tok]  # in place
    n_in = len(args) + len(indexed)
    kernel = functools.partial(_decide_kernel, decide=decide, place=place, high=high, low=low,
                               interpret=interpret)
    return tuple(pl.pallas_call(
        kernel, grid=(S, H),
        in_specs=[row(a) for a in args] + [whole(a) for a in indexed + updated],
        out_specs=[whole(a) for a in updated],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in updated],
        input_output_aliases={n_in + i: i for i in range(len(updated))},
        interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(1, 1),
        name="decide_and_write",
    )(*args, *indexed, *updated))


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
