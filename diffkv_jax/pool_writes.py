"""Scatters into page pools that stay in place on every backend.

XLA has no native scatter for 16-bit floats on the CPU (and treats them
specially elsewhere): ``pool.at[i].set(x)`` on a bfloat16 or float16 pool
becomes a float32 conversion of the whole pool, a scatter and a conversion
back, i.e. several full-pool passes per written token. Scattering the same
bits as ``uint16`` is exact and touches only the written rows.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_SIXTEEN_BIT_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def scatter_set(pool, index, values, mode: str = "drop"):
    """``pool.at[index].set(values, mode=mode)`` without converting the pool."""
    values = jnp.asarray(values).astype(pool.dtype)
    if pool.dtype in _SIXTEEN_BIT_FLOATS:
        bits = lax.bitcast_convert_type(pool, jnp.uint16)
        bits = bits.at[index].set(lax.bitcast_convert_type(values, jnp.uint16), mode=mode)
        return lax.bitcast_convert_type(bits, pool.dtype)
    return pool.at[index].set(values, mode=mode)
