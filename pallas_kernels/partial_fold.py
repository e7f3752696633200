"""The exact fold of a row's work-item partials inside a kernel (flash-decoding).

A decode launch over a :class:`~pallas_kernels.paged_decode.WorkList` leaves
per item ``(o, m, l)``: the unnormalized output, the softmax max (natural
units) and the normalizer. A row's items are consecutive
(``WorkList.ranges``), so a program merges them by walking them
``items_per_step`` at a time with an online max and sum: each step loads a
block's statistics and outputs together and rescales the running sums once.
Both :mod:`~pallas_kernels.row_merge` (a launch of its own) and the decode
launch's own merge (:func:`~pallas_kernels.paged_decode.paged_decode_merged`,
by the last item of a row to finish) fold this way.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_decode import NEG_INF


def combine(carry, mi, li, oi, live):
    """The running ``(max, sum, output)`` (``[G]``, ``[G]``, ``[G, D]``) with a block of
    sources ``mi, li [I, G]``, ``oi [I, G, D]``; ``live [I]`` masks the sources past
    the row's items."""
    mx, lx, ox = carry
    mi = jnp.where(live[:, None], mi, NEG_INF)
    mn = jnp.maximum(mx, jnp.max(mi, axis=0))
    a = jnp.exp(mx - mn)
    b = jnp.where(live[:, None], jnp.exp(mi - mn[None, :]), 0.0)
    return (mn, lx * a + jnp.sum(b * li, axis=0),
            ox * a[:, None] + jnp.sum(b[:, :, None] * oi.astype(jnp.float32), axis=0))


def empty_carry(rows: int, cols: int):
    """The fold's start: no source yet (max ``NEG_INF``, zero sums)."""
    return (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, cols), jnp.float32))


def item_loader(o_ref, m_ref, l_ref, rows, cols, volatile: bool = False) -> Callable:
    """The ``load`` of :func:`fold_items` over partial refs ``o [N, >= G, D]``,
    ``m, l [N, >= G]``: rows ``rows [G']`` and columns ``cols [D']`` of a block of
    items. ``volatile`` (GPU only): loads that skip the multiprocessor's L1, for
    partials other programs of the same launch stored."""
    def get(ref, idx):
        if not volatile:
            return ref[idx]
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(ref.at[idx], volatile=True)

    def load(items):
        return (get(m_ref, (items[:, None], rows[None, :])),
                get(l_ref, (items[:, None], rows[None, :])),
                get(o_ref, (items[:, None, None], rows[None, :, None], cols[None, None, :])))

    return load


def fold_items(load: Callable, first, count, rows: int, cols: int, items_per_step: int,
               carry=None):
    """Fold items ``[first, first + count)`` into ``carry`` (default: empty).

    ``load(items [I]) -> (m [I, rows], l [I, rows], o [I, rows, cols])`` reads a
    block of items' partials. The lanes past the row read its last item (whose
    partials exist: another row's may never have been written) and are masked.
    """
    lane = lax.broadcasted_iota(jnp.int32, (items_per_step,), 0)

    def step(j, carry):
        pos = j * items_per_step + lane
        item = first + jnp.minimum(pos, count - 1)
        return combine(carry, *load(item), pos < count)

    init = empty_carry(rows, cols) if carry is None else carry
    return lax.fori_loop(0, (count + items_per_step - 1) // items_per_step, step, init)


def normalized(carry):
    """The fold's output divided by its sum (zeros where nothing was folded)."""
    mx, lx, ox = carry
    return ox / jnp.where(lx > 0, lx, 1.0)[:, None]
