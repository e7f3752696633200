"""Writes of a decode step's tokens into the unified page pool, one launch per layer.

A DiffKV decode step writes up to two tokens per (sequence, KV head) row: the
newcomer into a high-tier slot and the demoted victim into a low-tier slot.
Each token is a key row of the page (``kw`` bytes at ``slot * kw``), a value
column (``vw`` bytes, one per value row, ``cap`` apart from byte ``cap * kw``)
and one entry in each side array (key and value metadata, score, position).
As XLA scatters that is four code scatters and four side-array scatters per
layer; this kernel does all of a row's writes in one program (pool and side
arrays aliased, so updated in place under donation). Writes aimed past the
pool (the caller's "no page") are dropped.

:func:`write_tokens_reference` is the plain-jnp version (the scatters the
cache uses) it is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from diffkv_jax.pool_writes import scatter_columns, scatter_rows, scatter_set
from pallas_kernels import backend


@dataclasses.dataclass(frozen=True)
class TokenFormat:
    """Where one tier's token lives in a page: key bytes, value bytes, slots."""

    key_width: int
    value_width: int
    slots: int


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["page", "slot", "keys", "values", "k_meta", "v_meta", "score",
                                "position"], meta_fields=["fmt"])
@dataclasses.dataclass(frozen=True)
class TokenWrite:
    """One token per row ``[S, H]``: its page (past the pool: dropped) and slot
    there, ``keys [S, H, kw]`` / ``values [S, H, vw]`` bytes (uint8), packed
    metadata words (uint32), score (float32) and position (int32)."""

    fmt: TokenFormat
    page: jax.Array
    slot: jax.Array
    keys: jax.Array
    values: jax.Array
    k_meta: jax.Array
    v_meta: jax.Array
    score: jax.Array
    position: jax.Array


_FIELDS = ("page", "slot", "keys", "values", "k_meta", "v_meta", "score", "position")


def _kernel(*refs, fmts: tuple[TokenFormat, ...], interpret: bool):
    n_w = len(fmts)
    ins = refs[:8 * n_w]
    data_ref, km_ref, vm_ref, sc_ref, pos_ref = refs[8 * n_w + 5:]
    P = data_ref.shape[0]
    for i, fmt in enumerate(fmts):
        page_r, slot_r, k_r, v_r, kmw_r, vmw_r, score_r, p_r = ins[8 * i:8 * i + 8]
        page, slot = page_r[0], slot_r[0]
        kw, vw, cap = fmt.key_width, fmt.value_width, fmt.slots
        valid = page < P

        def put(ref, cols, x, page=page, valid=valid):
            """``ref[page, cols] = x``, dropped when the page is past the pool."""
            n = cols.shape[0]
            if interpret:  # an index past the pool is dropped by the scatter
                ref[jnp.full((n,), jnp.where(valid, page, P)), cols] = x
            else:
                from jax.experimental.pallas import triton as plgpu

                rows = jnp.full((n,), jnp.minimum(page, P - 1))
                plgpu.store(ref.at[rows, cols], x, mask=jnp.full((n,), valid))

        put(data_ref, slot * kw + lax.broadcasted_iota(jnp.int32, (kw,), 0), k_r[...])
        put(data_ref, (kw + lax.broadcasted_iota(jnp.int32, (vw,), 0)) * cap + slot, v_r[...])
        one = jnp.full((1,), slot)
        for ref, src in ((km_ref, kmw_r), (vm_ref, vmw_r), (sc_ref, score_r), (pos_ref, p_r)):
            put(ref, one, src[...])


def write_tokens(data, k_meta, v_meta, scores, positions, writes: Sequence[TokenWrite], *,
                 interpret: bool | None = None):
    """Write every row's tokens of ``writes`` (in order) into the pool and side arrays.

    Args:
      data: ``[P, data_bytes]`` uint8 page pool; k_meta, v_meta, scores, positions:
        ``[P, slots]`` side arrays (all updated in place when donated).
      writes: the tokens, one :class:`TokenWrite` per token of a row; writes of a row
        must target distinct slots (a later write to the same place wins).
    Returns:
      ``(data, k_meta, v_meta, scores, positions)``.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    S, H = writes[0].page.shape
    args, in_specs = [], []
    row = lambda a: pl.BlockSpec((None, None, a.shape[2]), lambda s, h: (s, h, 0))  # noqa: E731
    for w in writes:
        for name in _FIELDS:
            a = getattr(w, name)
            a = a[..., None] if a.ndim == 2 else a  # per-row scalars as [S, H, 1]
            args.append(a)
            in_specs.append(row(a))
    pools = [data, k_meta, v_meta, scores, positions]
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h: (0,) * a.ndim)  # noqa: E731
    n_in = len(args)
    kernel = functools.partial(_kernel, fmts=tuple(w.fmt for w in writes), interpret=interpret)
    return tuple(pl.pallas_call(
        kernel, grid=(S, H), in_specs=in_specs + [whole(a) for a in pools],
        out_specs=[whole(a) for a in pools],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pools],
        input_output_aliases={n_in + i: i for i in range(len(pools))}, interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(1, 1),
        name="token_writes",
    )(*args, *pools))


def write_tokens_reference(data, k_meta, v_meta, scores, positions,
                           writes: Sequence[TokenWrite]):
    """Plain-jnp :func:`write_tokens`: the scatters the cache's XLA path uses
    (out-of-range pages dropped)."""
    for w in writes:
        kw = w.fmt.key_width
        data = scatter_rows(data, w.page, w.slot * kw, w.keys)
        data = scatter_columns(data, w.fmt.slots, w.page, kw, w.slot, w.values)
        at = (w.page, w.slot)
        k_meta = scatter_set(k_meta, at, w.k_meta)
        v_meta = scatter_set(v_meta, at, w.v_meta)
        scores = scatter_set(scores, at, w.score)
        positions = scatter_set(positions, at, w.position)
    return data, k_meta, v_meta, scores, positions
