"""How many pool pages a memory budget in bytes buys, for any cache method.

A cache state costs a fixed part (page tables, per-slot counters: they grow
with ``max_seqs`` and the context, not with the pool) plus the same number of
bytes per pool page. Both are read off the state's shapes
(``jax.eval_shape`` of ``method.init_state``, nothing allocated), so the
count is exact for every method, whatever side arrays it keeps.
"""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np

#: Share of the device's free memory the cache takes when no budget is given;
#: the rest is left to the steps' activations and workspace.
DEFAULT_MEMORY_FRACTION = 0.9


def state_bytes(method, num_pages: int) -> int:
    """Bytes of ``method.init_state(num_pages)``, from its shapes alone."""
    shapes = jax.eval_shape(lambda: method.init_state(num_pages))
    return sum(int(np.prod(s.shape)) * s.dtype.itemsize
               for s in jax.tree_util.tree_leaves(shapes))


def device_free_bytes(device=None) -> int:
    """Memory the device can still allocate: the allocator's limit minus what is in
    use (weights included) on an accelerator; the host's available RAM on the CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return max(0, int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_memory_bytes(fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """The default cache budget: ``fraction`` of :func:`device_free_bytes`."""
    return int(device_free_bytes() * fraction)


def pages_for_memory(method, memory_bytes: int) -> int:
    """The most pool pages whose whole cache state fits ``memory_bytes``.

    Raises ValueError when the budget does not cover the state's fixed part and
    one page. Methods whose kernels cannot address some pool sizes (DiffKV's
    32-bit offsets, 2 - 4 GiB of codes, where the backend cannot widen them) get the largest count they can use, with a
    warning that says how much of the budget stays unused and which budgets avoid it.
    """
    memory_bytes = int(memory_bytes)
    one, two = state_bytes(method, 1), state_bytes(method, 2)
    per_page, fixed = two - one, 2 * one - two
    pages = (memory_bytes - fixed) // per_page if per_page > 0 else 0
    fit = getattr(method, "addressable_pages", None)
    usable = fit(pages) if pages >= 1 and fit is not None else pages
    if usable != pages:
        above = _next_addressable(fit, pages)
        warnings.warn(
            f"{type(method).__name__}: a budget of {memory_bytes / 2**30:.2f} GiB buys {pages} "
            f"pages, a pool its GPU kernel cannot address; it gets {usable} "
            f"({1 - usable / pages:.0%} of the pages unused). Budgets up to "
            f"{(fixed + usable * per_page) / 2**30:.2f} GiB or from "
            f"{(fixed + above * per_page) / 2**30:.2f} GiB use all their memory.",
            stacklevel=2)
        pages = usable
    if pages < 1:
        raise ValueError(
            f"a cache budget of {memory_bytes} bytes holds no page: {type(method).__name__} "
            f"needs {fixed} bytes of tables for {method.max_seqs} slots plus {per_page} per page")
    return int(pages)


def _next_addressable(fit, pages: int) -> int:
    """The smallest page count above ``pages`` that ``fit`` keeps whole."""
    hi = pages
    while fit(hi) != hi:
        hi *= 2
    lo = pages  # fit(lo) != lo <= ... fit(hi) == hi: the first whole count is in (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fit(mid) == mid else (mid, hi)
    return hi
