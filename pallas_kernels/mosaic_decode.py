"""Paged decode attention on Pallas' Mosaic GPU backend: 16-bit pages, and K8V4.

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

:func:`mosaic_k8v4` walks K8V4 pages (the DiffKV high tier) with token tiles
instead (the comment above it says how); its reference is
:func:`pallas_kernels.paged_decode.tier_attention_reference` on the dequantized
tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_decode import LOG2E, unpack_meta_f32

#: Query rows of a ``wgmma`` tile (the group padded to them).
TILE_ROWS = 64
#: Group rows whose partials are stored (a tile of 8 rows).
OUT_ROWS = 8
PAGES_PER_STEP = 4


def _copy_pages(table_ref, table_smem, table_bar, first_page, fetch, free, steps: int,
                stages: int):
    """The copying warpgroup of both launches: the row's whole page table into shared
    memory (a TMA moves multiples of 128 bytes), then ``fetch(first, j, slot)`` for
    every step ``j`` (``first = first_page()``, the split's first table entry), a
    slot again once the computing warpgroup has arrived on each of its ``free``
    barriers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.copy_gmem_to_smem(table_ref, table_smem, table_bar)
    plgpu.barrier_wait(table_bar)
    first = first_page()
    for j in range(stages):
        fetch(first, j, j)

    @pl.loop(stages, steps)
    def _(j):
        slot = lax.rem(j, stages)
        for bars in free:
            plgpu.barrier_wait(bars.at[slot])
        fetch(first, j, slot)


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

    def fetch(first, j, slot):
        for i in range(PAGES_PER_STEP):
            pid = table_smem[first + j * PAGES_PER_STEP + i]
            rows = pl.ds(i * page, page)
            plgpu.copy_gmem_to_smem(k_ref.at[pid], k_smem.at[slot, rows], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[pid], v_smem.at[slot, rows], v_bars.at[slot])

    pl.when(wg == 1)(lambda: _copy_pages(tables_ref.at[seq, head], table_smem, table_bar,
                                         lambda: split * pages_per_split, fetch,
                                         (k_free, v_free), steps, stages))


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


# K8V4 pages (8-bit keys, 4-bit values, 32 slots): the quantized launch on Mosaic GPU.
# Token tiles: a step's two pages (64 tokens) are the rows of a ``wgmma`` tile, their
# key codes upcast in registers as its A operand against the query as a transposed B
# operand; the group is padded to 32 columns (the probabilities' tile, a page's 32
# tokens by the columns, is one K group of a 64-byte swizzle). The probabilities,
# weighted by the values' scales, go through shared memory as the B operand of the
# value dots, whose A operands are each page's value codes unpacked in registers
# (low nibbles: dims 0 - 63, high: 64 - 127).
# The operands' 16-bit type is ``operands``: codes to 255 are exact in either;
# bfloat16 keeps 7 mantissa bits of the query and of the weighted probabilities, hence
# an error of ~7.5e-3 of the output scale, float16 keeps 10.
K8V4_SLOTS = 32
TILE_COLS = 32


def _k8v4_body(q_ref, qsum_ref, kv_ref, vv_ref, km_ref, vm_ref, tables_ref,
               o_ref, st_ref, scoped, *, steps: int, stages: int, pages_per_split: int,
               operands):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (q_smem, qsum_smem, kc_smem, vc_smem, km_smem, vm_smem, p_smem, o_smem, st_smem,
     table_smem), (q_bar, table_bar, page_bars, free_bars) = scoped
    split, head, seq = (lax.axis_index(n) for n in ("split", "head", "seq"))
    wg = lax.axis_index("wg")
    D = q_smem.shape[-1]
    half = D // 2

    @pl.when(wg == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(qsum_ref.at[seq, head], qsum_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        qsum = qsum_smem[...]
        cols = jnp.full((TILE_COLS,), 0, jnp.float32)
        m, l, z = cols - jnp.inf, cols, cols
        acc_lo = jnp.full((half, TILE_COLS), 0, jnp.float32)
        acc_hi = acc_lo

        def step(j, carry):
            acc_lo, acc_hi, m, l, z = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(page_bars.at[slot])
            codes = kc_smem[slot].astype(operands)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, codes, q_smem.transpose((1, 0)))
                return acc_ref[...]
            dots = pl.run_scoped(qk, plgpu.ACC((2 * K8V4_SLOTS, TILE_COLS), jnp.float32))
            ks, kz = unpack_meta_f32(km_smem[slot])
            s = (dots * lax.broadcast_in_dim(ks, dots.shape, [0])
                 + lax.broadcast_in_dim(kz, dots.shape, [0])
                 * lax.broadcast_in_dim(qsum, dots.shape, [1]))
            m_new = jnp.maximum(m, s.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            vs, vz = unpack_meta_f32(vm_smem[slot])
            l = l * alpha + p.sum(axis=0)
            z = z * alpha + (p * lax.broadcast_in_dim(vz, p.shape, [0])).sum(axis=0)
            p_smem[...] = (p * lax.broadcast_in_dim(vs, p.shape, [0])).astype(operands)
            plgpu.commit_smem()
            acc_lo = acc_lo * lax.broadcast_in_dim(alpha, acc_lo.shape, [1])
            acc_hi = acc_hi * lax.broadcast_in_dim(alpha, acc_hi.shape, [1])
            for i in range(2):
                vc = vc_smem[slot, i].astype(jnp.uint16)
                lo = (vc & jnp.uint16(15)).astype(operands)
                hi = (vc >> jnp.uint16(4)).astype(operands)
                pb = p_smem.at[pl.ds(i * K8V4_SLOTS, K8V4_SLOTS)]

                def pv(acc_ref, codes):
                    plgpu.wgmma(acc_ref, codes, pb)
                    return acc_ref[...]
                acc_lo = acc_lo + pl.run_scoped(lambda r: pv(r, lo),
                                                plgpu.ACC((half, TILE_COLS), jnp.float32))
                acc_hi = acc_hi + pl.run_scoped(lambda r: pv(r, hi),
                                                plgpu.ACC((half, TILE_COLS), jnp.float32))
            plgpu.barrier_arrive(free_bars.at[slot])
            return acc_lo, acc_hi, m_new, l, z

        acc_lo, acc_hi, m, l, z = lax.fori_loop(0, steps, step, (acc_lo, acc_hi, m, l, z))
        o_smem[0] = acc_lo
        o_smem[1] = acc_hi
        st_smem[0] = m
        st_smem[1] = l
        st_smem[2] = z
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[seq, head, split])
        plgpu.copy_smem_to_gmem(st_smem, st_ref.at[seq, head, split])
        plgpu.wait_smem_to_gmem(0)

    def fetch(first, j, slot):
        for i in range(2):
            pid = table_smem[first + 2 * j + i]
            bar = page_bars.at[slot]
            rows = pl.ds(i * K8V4_SLOTS, K8V4_SLOTS)
            plgpu.copy_gmem_to_smem(kv_ref.at[pid, pl.ds(0, K8V4_SLOTS)],
                                    kc_smem.at[slot, rows], bar)
            plgpu.copy_gmem_to_smem(vv_ref.at[pid, pl.ds(D, half)], vc_smem.at[slot, i], bar)
            plgpu.copy_gmem_to_smem(km_ref.at[pid], km_smem.at[slot, rows], bar)
            plgpu.copy_gmem_to_smem(vm_ref.at[pid], vm_smem.at[slot, rows], bar)

    pl.when(wg == 1)(lambda: _copy_pages(tables_ref.at[seq, head], table_smem, table_bar,
                                         lambda: split * pages_per_split, fetch,
                                         (free_bars,), steps, stages))


@functools.partial(jax.jit, static_argnames=("splits", "stages", "operands"))
def mosaic_k8v4_partials(q, keys, values, meta, tables, *, splits: int, stages: int = 2,
                         operands=jnp.bfloat16):
    """Partials of every (sequence, KV head, split) over K8V4 pages.

    ``q``: [S, H, G, D] in log2 units (``q / sqrt(D) * log2(e)``); ``keys``,
    ``values``: :func:`pallas_kernels.paged_decode.page_views` of the pool;
    ``meta``: the (key, value) packed words [P, 32]; ``tables``: [S, H, NP], every
    row ``32 NP`` tokens. Returns ``o`` [S, H, splits, 2, D/2, 64] float32 (the
    dims' halves by query column, unnormalized, before the values' zero term) and
    ``stats`` [S, H, splits, 3, 64]: the running max, the sum and the zero term's
    weight per column (columns past G are padding). ``operands``: the dots' 16-bit
    operand type, ``jnp.bfloat16`` or ``jnp.float16``.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    S, H, G, D = q.shape
    NP = tables.shape[-1]
    if G > TILE_COLS or D != 128:
        raise ValueError(f"group {G} must be at most {TILE_COLS}, head dim {D} 128")
    if NP % 32 or NP % (2 * splits):
        raise ValueError(f"{NP} pages per row: a multiple of 32 and of 2 x {splits} needed")
    operands = jnp.dtype(operands)
    if operands not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"operands {operands}: bfloat16 or float16")
    pages_per_split = NP // splits
    steps = pages_per_split // 2
    if steps < stages:
        raise ValueError(f"{steps} steps per split, fewer than {stages} stages")
    qb = q.astype(operands)
    q_pad = jnp.zeros((S, H, TILE_COLS, D), operands).at[:, :, :G].set(qb)
    qsum = jnp.zeros((S, H, TILE_COLS), jnp.float32).at[:, :, :G].set(
        qb.astype(jnp.float32).sum(-1))
    km, vm = meta

    def swizzled(bits, row_bytes):
        return (plgpu.TilingTransform((8, row_bytes * 8 // bits)),
                plgpu.SwizzleTransform(row_bytes))
    tile = 2 * K8V4_SLOTS
    scratch = (
        (plgpu.SMEM((TILE_COLS, D), operands, transforms=swizzled(16, 128)),
         plgpu.SMEM((TILE_COLS,), jnp.float32),
         plgpu.SMEM((stages, tile, D), jnp.uint8, transforms=swizzled(8, 128)),
         plgpu.SMEM((stages, 2, D // 2, K8V4_SLOTS), jnp.uint8, transforms=swizzled(8, 32)),
         plgpu.SMEM((stages, tile), jnp.uint32),
         plgpu.SMEM((stages, tile), jnp.uint32),
         # rows of 64 bytes: a 64-byte swizzle, so a page's 32 tokens are one K group
         plgpu.SMEM((tile, TILE_COLS), operands, transforms=swizzled(16, 64)),
         plgpu.SMEM((2, D // 2, TILE_COLS), jnp.float32),
         plgpu.SMEM((3, TILE_COLS), jnp.float32),
         plgpu.SMEM((NP,), jnp.int32)),
        (plgpu.Barrier(num_arrivals=2), plgpu.Barrier(),
         plgpu.Barrier(num_arrivals=8, num_barriers=stages),
         plgpu.Barrier(num_barriers=stages)),
    )
    body = functools.partial(_k8v4_body, steps=steps, stages=stages,
                             pages_per_split=pages_per_split, operands=operands)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((S, H, splits, 2, D // 2, TILE_COLS), jnp.float32),
                jax.ShapeDtypeStruct((S, H, splits, 3, TILE_COLS), jnp.float32))
    return plgpu.kernel(entry, out_type=out_type, grid=(splits, H, S),
                        grid_names=("split", "head", "seq"), num_threads=2,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(
                            approx_math=True,
                            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        )(q_pad, qsum, keys, values, km, vm, tables)


def mosaic_k8v4(q, keys, values, meta, tables, *, splits: int, stages: int = 2,
                operands=jnp.bfloat16):
    """Decode attention over K8V4 pages: [S, H, G, D] float32 (``q`` in log2 units)."""
    o, st = mosaic_k8v4_partials(q, keys, values, meta, tables, splits=splits,
                                 stages=stages, operands=operands)
    return _merge_k8v4(o, st, q.shape[2])


def _merge_k8v4(o, st, group: int):
    """:func:`mosaic_k8v4_partials`' splits merged: the dims' halves joined, the
    values' zero term added, then :func:`merge_splits`."""
    o = jnp.concatenate([o[:, :, :, 0], o[:, :, :, 1]], axis=3)  # [S, H, K, D, columns]
    o = (o + st[:, :, :, None, 2]).swapaxes(-1, -2)
    return merge_splits(o, st[:, :, :, 0], st[:, :, :, 1], group)
