"""Scatters into page pools that stay in place on every backend.

XLA has no native scatter for 16-bit floats on the CPU (and treats them
specially elsewhere): ``pool.at[i].set(x)`` on a bfloat16 or float16 pool
becomes a float32 conversion of the whole pool, a scatter and a conversion
back, i.e. several full-pool passes per written token; a float8 pool goes
through float16 the same way. Scattering the same bits as an unsigned
integer of the same width is exact and touches only the written rows.

:func:`scatter_rows` and :func:`scatter_columns` write a token's key row and
value column of a unified page (:mod:`pallas_kernels.paged_decode`'s layout).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_AS_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16,
            jnp.dtype(jnp.float8_e4m3fn): jnp.uint8}


def scatter_set(pool, index, values, mode: str = "drop"):
    """``pool.at[index].set(values, mode=mode)`` without converting the pool."""
    values = jnp.asarray(values).astype(pool.dtype)
    as_bits = _AS_BITS.get(pool.dtype)
    if as_bits is not None:
        bits = lax.bitcast_convert_type(pool, as_bits)
        bits = bits.at[index].set(lax.bitcast_convert_type(values, as_bits), mode=mode)
        return lax.bitcast_convert_type(bits, pool.dtype)
    return pool.at[index].set(values, mode=mode)


def scatter_rows(data, page, start, rows):
    """``data[page, start : start + w] = rows`` for every index (``rows [..., w]``).

    A windowed scatter (one index pair per row, not per byte); rows whose page
    is out of range are dropped.
    """
    w = rows.shape[-1]
    idx = jnp.stack([page, start], axis=-1).reshape(-1, 2).astype(jnp.int32)
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0, 1))
    return lax.scatter(data, idx, rows.reshape(-1, w).astype(data.dtype), dnums,
                           mode=lax.GatherScatterMode.FILL_OR_DROP)


def scatter_columns(data, cap: int, page, row, col, cols):
    """Seen as rows of ``cap`` bytes: ``data[page, (row + r) * cap + col] = cols[..., r]``
    for every index (``cols [..., w]``: a column of the value rows); out-of-range
    pages are dropped."""
    w = cols.shape[-1]
    offsets = (row + jnp.arange(w)) * cap + col[..., None]
    return scatter_set(data, (page[..., None], offsets), cols.astype(data.dtype))
