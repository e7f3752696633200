"""Paged decode attention over 16-bit pages on Pallas' Mosaic GPU backend.

A measurement of the backend, not a path the caches take: the same problem as
the 16-bit launch of :mod:`pallas_kernels.paged_decode` (one program per
(sequence, KV head, split), the whole GQA group at once, pages gathered through
the page table, partials merged exactly), written the way Mosaic GPU builds
Hopper kernels: one warpgroup copies pages into shared memory with the bulk
tensor copy engine (TMA) while another takes the dots on ``wgmma`` and the
softmax in registers, the two synchronized by barriers. The group's query rows
sit in the 64 rows of a ``wgmma`` tile (padded: the tensor cores are idle in
decode anyway), the tokens of ``PAGES_PER_STEP`` pages in its columns.

It runs compiled only: Mosaic GPU's interpreter (jax 0.10.2) has no transposed
shared-memory operand, so on the CPU it is lowered for CUDA, not run.
Limits (checked): every row holds the same number of tokens, a multiple of the
tokens of one step per split, its table a multiple of 32 pages; a group of at
most 8; head dim a multiple of 64.
:func:`mosaic_decode_reference` is the plain-jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_decode import LOG2E

#: Query rows of a ``wgmma`` tile (the group padded to them).
TILE_ROWS = 64
#: Group rows whose partials are stored (a tile of 8 rows).
OUT_ROWS = 8
PAGES_PER_STEP = 4


def _kernel_body(q_ref, k_ref, v_ref, tables_ref, o_ref, m_ref, l_ref, scoped, *,
                 steps: int, stages: int, pages_per_split: int, page: int, dtype):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (q_smem, k_smem, v_smem, o_smem, ml_smem, table_smem), bars = scoped
    q_bar, table_bar, k_bars, v_bars, k_free, v_free = bars
    split, head, seq = (lax.axis_index(n) for n in ("split", "head", "seq"))
    wg = lax.axis_index("wg")
    block = PAGES_PER_STEP * page

    @pl.when(wg == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        rows = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), rows)
        l = plgpu.layout_cast(jnp.full((TILE_ROWS,), 0, jnp.float32), rows)
        acc = plgpu.layout_cast(jnp.full((TILE_ROWS, q_smem.shape[-1]), 0, jnp.float32),
                                plgpu.Layout.WGMMA)

        def step(j, carry):
            acc, m, l = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, block), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            m_new = jnp.maximum(m, s.max(axis=1) * LOG2E)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * LOG2E - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bars.at[slot])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, step, (acc, m, l))
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, OUT_ROWS)], o_ref.at[seq, head, split])
        plgpu.copy_smem_to_gmem(ml_smem.at[0, pl.ds(0, OUT_ROWS)], m_ref.at[seq, head, split])
        plgpu.copy_smem_to_gmem(ml_smem.at[1, pl.ds(0, OUT_ROWS)], l_ref.at[seq, head, split])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        # the row's whole table (a TMA moves multiples of 128 bytes)
        plgpu.copy_gmem_to_smem(tables_ref.at[seq, head], table_smem, table_bar)
        plgpu.barrier_wait(table_bar)
        first = split * pages_per_split

        def fetch(j, slot):
            for i in range(PAGES_PER_STEP):
                pid = table_smem[first + j * PAGES_PER_STEP + i]
                rows = pl.ds(i * page, page)
                plgpu.copy_gmem_to_smem(k_ref.at[pid], k_smem.at[slot, rows], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[pid], v_smem.at[slot, rows], v_bars.at[slot])

        for j in range(stages):
            fetch(j, j)

        @pl.loop(stages, steps)
        def _(j):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(j, slot)


@functools.partial(jax.jit, static_argnames=("splits", "stages"))
def mosaic_decode_partials(q, k_pool, v_pool, tables, *, splits: int, stages: int = 2):
    """Partials ``(o, m, l)`` of every (sequence, KV head, split) over 16-bit pages.

    ``q``: [S, H, G, D] (scaled by the caller), ``k_pool``, ``v_pool``: [P, page, D],
    ``tables``: [S, H, NP] page IDs, every row ``NP * page`` tokens long. ``o``:
    [S, H, splits, 8, D] float32, unnormalized; ``m``, ``l``: [S, H, splits, 8], the
    running max in log2 units and the sum (rows past G are padding).
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    S, H, G, D = q.shape
    P, page, _ = k_pool.shape
    NP = tables.shape[-1]
    block = PAGES_PER_STEP * page
    if G > OUT_ROWS or D % 64:
        raise ValueError(f"group {G} must be at most {OUT_ROWS}, head dim {D} a multiple of 64")
    if NP % 32:
        raise ValueError(f"{NP} pages per row: a multiple of 32 is needed")
    if NP % (splits * PAGES_PER_STEP):
        raise ValueError(f"{NP} pages per row do not split into {splits} x "
                         f"{PAGES_PER_STEP}-page steps")
    pages_per_split = NP // splits
    steps = pages_per_split // PAGES_PER_STEP
    if steps < stages:
        raise ValueError(f"{steps} steps per split, fewer than {stages} stages")
    dtype = k_pool.dtype
    q_pad = jnp.zeros((S, H, TILE_ROWS, D), dtype).at[:, :, :G].set(q.astype(dtype))

    swizzle = 128
    tiled = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
             plgpu.SwizzleTransform(swizzle))
    scratch = (
        (plgpu.SMEM((TILE_ROWS, D), dtype, transforms=tiled),
         plgpu.SMEM((stages, block, D), dtype, transforms=tiled),
         plgpu.SMEM((stages, block, D), dtype, transforms=tiled),
         plgpu.SMEM((TILE_ROWS, D), jnp.float32),
         plgpu.SMEM((2, TILE_ROWS), jnp.float32),
         plgpu.SMEM((NP,), jnp.int32)),
        (plgpu.Barrier(), plgpu.Barrier(),
         plgpu.Barrier(num_arrivals=PAGES_PER_STEP, num_barriers=stages),
         plgpu.Barrier(num_arrivals=PAGES_PER_STEP, num_barriers=stages),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
    )
    body = functools.partial(_kernel_body, steps=steps, stages=stages,
                             pages_per_split=pages_per_split, page=page, dtype=dtype)

    def entry(q_ref, k_ref, v_ref, t_ref, o_ref, m_ref, l_ref):
        pl.run_scoped(lambda *s: body(q_ref, k_ref, v_ref, t_ref, o_ref, m_ref, l_ref, s),
                      *scratch, collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((S, H, splits, OUT_ROWS, D), jnp.float32),
                jax.ShapeDtypeStruct((S, H, splits, OUT_ROWS), jnp.float32),
                jax.ShapeDtypeStruct((S, H, splits, OUT_ROWS), jnp.float32))
    return plgpu.kernel(entry, out_type=out_type, grid=(splits, H, S),
                        grid_names=("split", "head", "seq"), num_threads=2,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True)
                        )(q_pad, k_pool, v_pool, tables)


def merge_splits(o, m, l, group: int):
    """The exact merge of :func:`mosaic_decode_partials`' splits: [S, H, G, D]."""
    o, m, l = o[:, :, :, :group], m[:, :, :, :group], l[:, :, :, :group]
    top = m.max(axis=2, keepdims=True)
    w = jnp.exp2(m - top)
    return (jnp.sum(o * w[..., None], axis=2)
            / jnp.sum(l * w, axis=2)[..., None])


def mosaic_decode(q, k_pool, v_pool, tables, *, splits: int, stages: int = 2):
    """Decode attention ``softmax(q k^T) v`` over the rows' pages: [S, H, G, D] float32."""
    o, m, l = mosaic_decode_partials(q, k_pool, v_pool, tables, splits=splits,
                                     stages=stages)
    return merge_splits(o, m, l, q.shape[2])


def mosaic_decode_reference(q, k_pool, v_pool, tables):
    """Plain-jnp reference: [S, H, G, D] float32."""
    S, H, NP = tables.shape
    k = k_pool[tables].reshape(S, H, -1, k_pool.shape[-1]).astype(jnp.float32)
    v = v_pool[tables].reshape(S, H, -1, v_pool.shape[-1]).astype(jnp.float32)
    s = jnp.einsum("shgd,shtd->shgt", q.astype(jnp.float32), k)
    return jnp.einsum("shgt,shtd->shgd", jax.nn.softmax(s, axis=-1), v)
