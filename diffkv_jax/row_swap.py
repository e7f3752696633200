"""One slot's cache moved to host memory and back: preemption by swapping.

Recomputing a preempted request re-prefills its whole context; swapping copies
out only the pages it owns (compressed, for DiffKV) and the slot's few
bookkeeping entries, and puts them back into fresh pages of any free slot
later. The restored slot is bit-for-bit the one that left, so the request
continues exactly as if it had never been preempted.

A cache method supports swapping when it names, as class attributes,
``swap_pool_fields`` (state arrays indexed by page ID, one row per page) and
``swap_row_fields`` (state arrays indexed by slot), and gives
``owned_columns(state) -> [S + 1, L, KVH, R]`` bool (which page-table columns
hold a slot's pages: a function of its ``swap_row_fields`` only, so that the
same columns are found again after they are restored).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffkv_jax import free_list as fl


@struct.dataclass
class SwappedRow:
    """A slot's cache, on the host once read: ``pages[f]`` ``[N, ...]`` the rows of
    pool array ``f`` for its owned pages (row-major page-table order, then
    padding), ``rows[f]`` its entries of slot array ``f``, ``count`` the pages it
    owns (the first ``count`` of ``N``)."""

    pages: dict
    rows: dict
    count: jax.Array

    @property
    def nbytes(self) -> int:
        """Bytes of the copy (from the shapes: reading it does not wait for it)."""
        leaves = jax.tree_util.tree_leaves((self.pages, self.rows))
        return int(sum(x.nbytes for x in leaves))


def row_pages_bucket(pages: int, limit: int) -> int:
    """Static page count of a copy of ``pages`` pages: the next multiple of a quarter
    of the power of two at or below it (four sizes per octave: at most a quarter
    more than needed, where a power of two would move up to twice the bytes),
    capped at ``limit``."""
    quarter = max(1, 1 << max(0, pages.bit_length() - 3))
    return min(-(-pages // quarter) * quarter, limit)


def host_memory(device) -> str | None:
    """The page-locked host memory kind of ``device`` (``None`` if it has none)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def to_host(row: SwappedRow) -> SwappedRow:
    """Start copying ``row`` (on the device) to host memory; returns at once.

    Into page-locked host memory where the device has it: a DMA that overlaps
    the decode steps dispatched after it (the device copy is freed once it is
    done), and the fast way back (:func:`to_device`). Otherwise a blocking read
    into numpy arrays.
    """
    leaf = jax.tree_util.tree_leaves(row)[0]
    (device,) = leaf.devices()
    kind = host_memory(device)
    if kind is None:
        return jax.device_get(row)
    return jax.device_put(row, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))


def grow_host_pool(device, nbytes: int) -> bool:
    """Have ``nbytes`` of ``device``'s page-locked host memory allocated now, once.

    Page-locked copies come out of a pool that grows by locking fresh host
    memory, about 0.7 ms per MB on the H200 (a 256 MB copy then runs at 1.4 GB/s
    where one reusing the pool runs at 48 GB/s); freed copies stay in the pool.
    Growing it by one large block before serving keeps that cost off the
    preemptions. True if it did (GPU devices with page-locked memory only: on
    the CPU "page-locked" memory is the host's own).
    """
    kind = host_memory(device)
    if kind is None or device.platform == "cpu" or nbytes <= 0:
        return False
    block = jax.device_put(np.zeros(nbytes, np.uint8),
                           jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    block.block_until_ready()
    block.delete()
    return True


def to_device(row: SwappedRow, device) -> SwappedRow:
    """``row`` (from :func:`to_host`) back in ``device``'s default memory, for
    :func:`import_row`."""
    return jax.device_put(row, jax.sharding.SingleDeviceSharding(device))


def supports_swap(method) -> bool:
    return bool(getattr(method, "swap_pool_fields", None))


def max_row_pages(method) -> int:
    """Pages one slot can own at most (every page-table column)."""
    return method.num_layers * method.num_kv_heads * method.row_len


def export_row(method, state, slot: jax.Array, max_pages: int) -> SwappedRow:
    """Copy out slot ``slot``'s pages (at most ``max_pages``, static) and entries.

    The state is not changed (release the slot afterwards). ``count > max_pages``
    means the copy is incomplete: the caller must use a larger ``max_pages``.
    """
    owned = method.owned_columns(state)[slot].reshape(-1)
    count = owned.sum(dtype=jnp.int32)
    # Owned columns first, in row-major order (stable), as import_row finds them.
    cols = jnp.argsort(~owned, stable=True)
    cols = jnp.pad(cols, (0, max(0, max_pages - cols.shape[0])))[:max_pages]
    ids = state.page_table[slot].reshape(-1)[cols]
    ids = jnp.where(jnp.arange(max_pages) < count, ids, method.trash_page(state))
    pages = {f: getattr(state, f)[ids] for f in method.swap_pool_fields}
    rows = {f: getattr(state, f)[slot] for f in method.swap_row_fields}
    return SwappedRow(pages=pages, rows=rows, count=count)


def import_row(method, state, slot: jax.Array, row: SwappedRow):
    """Put ``row`` (from :func:`export_row`) into the empty slot ``slot``: fresh
    pages for its ``count`` pages, its entries restored. Fewer free pages than
    ``count`` allocates nothing and sets ``alloc_failed`` (the engine checks the
    free count before)."""
    max_pages = next(iter(row.pages.values())).shape[0]
    free, ids, ok = fl.allocate(state.free, row.count.reshape(1), max_pages)
    ids = ids[0]
    state = state.replace(**{
        f: getattr(state, f).at[slot].set(jnp.where(ok, row.rows[f], getattr(state, f)[slot]))
        for f in method.swap_row_fields})
    owned = method.owned_columns(state)[slot]
    shape = owned.shape
    owned = owned.reshape(-1)
    trash = method.trash_page(state)
    nth = jnp.clip(jnp.cumsum(owned) - 1, 0, max_pages - 1)
    table = jnp.where(owned & ok, ids[nth], trash).reshape(shape)
    dest = jnp.where(ids >= 0, ids, trash)
    pools = {f: getattr(state, f).at[dest].set(row.pages[f].astype(getattr(state, f).dtype))
             for f in method.swap_pool_fields}
    return state.replace(page_table=state.page_table.at[slot].set(table), free=free,
                         alloc_failed=state.alloc_failed | ~ok, **pools)
