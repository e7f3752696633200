"""Scatters into page pools that stay in place on every backend.

XLA has no native scatter for 16-bit floats on the CPU (and treats them
specially elsewhere): ``pool.at[i].set(x)`` on a bfloat16 or float16 pool
becomes a float32 conversion of the whole pool, a scatter and a conversion
back, i.e. several full-pool passes per written token; a float8 pool goes
through float16 the same way. Scattering the same bits as an unsigned
integer of the same width is exact and touches only the written rows.
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
