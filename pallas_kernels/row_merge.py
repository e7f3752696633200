"""The exact merge of a decode launch's work items, one Pallas launch.

The attention launch over a :class:`~pallas_kernels.paged_decode.WorkList`
leaves partial results per work item (``o, m, l``: the item's normalized
output, its softmax max and normalizer); a row's items must be merged
(flash-decoding) before the layer goes on. As XLA ops
(:func:`~pallas_kernels.paged_decode.merge_work`) that is a segment max, two
segment sums over scatters and the divisions: several small kernels per layer.
Here one program per (sequence, KV head) row walks the row's consecutive
items (``WorkList.ranges``) a block of ``items_per_step`` at a time: each step
loads the block's statistics and outputs together, folds them with their own
maximum and rescales the running sums once, then the program writes the row's
output and statistics: one launch per layer. Walking item by item made the
walk a chain of dependent loads, which is what a batch of few long rows
costs (a few rows hold every item of the step's work list).

:func:`~pallas_kernels.paged_decode.merge_work` is the reference it is tested
against (same results up to summation order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend, partial_fold
from pallas_kernels.paged_decode import WorkList


def _kernel(*refs, group: int, items_per_step: int, with_extra: bool, interpret: bool):
    rng_ref, o_ref, m_ref, l_ref = refs[:4]
    extra_refs = refs[4:7] if with_extra else ()
    out_ref, M_ref, L_ref = refs[4 + len(extra_refs):]
    D = out_ref.shape[-1]  # D: this program's block of the head dim
    # The GPU loads power-of-two shapes: rows past the group repeat the last real
    # row, and only the real rows are stored.
    Gq = group if interpret else pl.next_power_of_2(group)
    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (Gq,), 0), group - 1)
    dloc = lax.broadcasted_iota(jnp.int32, (D,), 0)
    dcol = pl.program_id(2) * D + dloc  # the columns of o (whole) this program merges

    load = partial_fold.item_loader(o_ref, m_ref, l_ref, rows, dcol)
    carry = partial_fold.fold_items(load, rng_ref[0], rng_ref[1], Gq, D, items_per_step)
    if with_extra:
        eo, em, el = extra_refs
        carry = partial_fold.combine(carry, em[rows][None], el[rows][None],
                                     eo[rows[:, None], dloc[None, :]][None],
                                     jnp.ones((1,), jnp.bool_))
    # Rows without items (or extra) come out as zeros, as merge_work leaves them.
    out = partial_fold.normalized(carry)
    mx, lx, _ = carry
    if interpret:
        out_ref[...] = out.astype(out_ref.dtype)
        M_ref[...] = mx
        L_ref[...] = lx
    else:
        from jax.experimental.pallas import triton as plgpu

        real = lax.broadcasted_iota(jnp.int32, (Gq,), 0) < group
        plgpu.store(out_ref.at[rows[:, None], dloc[None, :]], out.astype(out_ref.dtype),
                    mask=real[:, None])
        plgpu.store(M_ref.at[rows], mx, mask=real)
        plgpu.store(L_ref.at[rows], lx, mask=real)


def merge_rows(o, m, l, work: WorkList, S: int, H: int, extra=None, *,
               out_dtype=jnp.float32, items_per_step: int = 8, dim_blocks: int = 1,
               num_warps: int = 4, interpret: bool | None = None):
    """Exact per-row merge of a work list's items, as one launch.

    Args:
      o, m, l: ``[N, G, D]``, ``[N, G]``, ``[N, G]`` from
        :func:`~pallas_kernels.paged_decode.paged_decode_partials` over ``work``.
      work: the :class:`WorkList` with ``ranges`` (:func:`plan_work`'s).
      extra: optional ``(o [S,H,G,D], m [S,H,G], l [S,H,G])`` for one more source
        (e.g. the token being decoded, with ``l = 1``).
      out_dtype: dtype of ``out`` (float32, or the model's, saving a conversion).
      items_per_step: items a program loads and folds together (a power of two).
      dim_blocks: programs per row, each merging a block of the head dim (a row's
        walk reads ``1 / dim_blocks`` of its items' outputs; every program reads the
        statistics and writes the same ``M, L``).
    Returns:
      ``(out [S,H,G,D], M [S,H,G], L [S,H,G])`` as
      :func:`~pallas_kernels.paged_decode.merge_work`.
    """
    if work.ranges is None:
        raise ValueError("merge_rows needs the work list's ranges (plan_work's)")
    if interpret is None:
        interpret = backend.default_interpret()
    G, D = o.shape[1], o.shape[2]
    ranges = work.ranges.reshape(S, H, 2).astype(jnp.int32)
    if D % dim_blocks or (D // dim_blocks) & (D // dim_blocks - 1):
        raise ValueError(f"dim_blocks must split the head dim {D} into powers of two, "
                         f"got {dim_blocks}")
    if items_per_step < 1 or items_per_step & (items_per_step - 1):
        raise ValueError(f"items_per_step must be a power of two, got {items_per_step}")
    Dc = D // dim_blocks
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h, c: (0,) * a.ndim)  # noqa: E731
    per_row = lambda a: pl.BlockSpec((None, None) + a.shape[2:],  # noqa: E731
                                     lambda s, h, c: (s, h) + (0,) * (a.ndim - 2))
    # [S, H, G, D] arrays: this program's block of the head dim.
    per_cols = lambda a: pl.BlockSpec((None, None, G, Dc),  # noqa: E731
                                      lambda s, h, c: (s, h, 0, c))
    args = [ranges, o, m.astype(jnp.float32), l.astype(jnp.float32)]
    specs = [per_row(ranges), whole(o), whole(args[2]), whole(args[3])]
    if extra is not None:
        ex = [extra[0], extra[1].astype(jnp.float32), extra[2].astype(jnp.float32)]
        args += ex
        specs += [per_cols(ex[0]), per_row(ex[1]), per_row(ex[2])]
    out_shape = [jax.ShapeDtypeStruct((S, H, G, D), out_dtype),
                 jax.ShapeDtypeStruct((S, H, G), jnp.float32),
                 jax.ShapeDtypeStruct((S, H, G), jnp.float32)]
    kernel = functools.partial(_kernel, group=G, items_per_step=items_per_step,
                               with_extra=extra is not None, interpret=interpret)
    return tuple(pl.pallas_call(
        kernel, grid=(S, H, dim_blocks), in_specs=specs,
        out_specs=[per_cols(out_shape[0]), per_row(out_shape[1]), per_row(out_shape[2])],
        out_shape=out_shape, interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(num_warps, 1),
        name="merge_rows",
    )(*args))
