"""16-bit pools are scattered as their bits: same values, no whole-pool conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.pool_writes import scatter_set


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.uint8])
def test_scatter_set_matches_at_set(dtype):
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.normal(size=(50, 4, 8)) * 10, dtype)
    page = jnp.asarray([3, 7, 50, 3, 49])  # 50 is past the pool: dropped
    slot = jnp.asarray([0, 2, 1, 1, 3])
    vals = jnp.asarray(rng.normal(size=(5, 8)) * 10, jnp.float32)
    got = scatter_set(pool, (page, slot), vals)
    want = pool.at[page, slot].set(vals.astype(dtype), mode="drop")
    assert got.dtype == pool.dtype
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(pool, np.float32))


def test_bf16_scatter_does_not_convert_the_pool():
    pool = jnp.zeros((100_000, 16, 8), jnp.bfloat16)
    f = jax.jit(lambda p, v: scatter_set(p, (jnp.asarray([1, 2]), jnp.asarray([0, 3])), v),
                donate_argnums=0)
    hlo = f.lower(pool, jnp.ones((2, 8), jnp.bfloat16)).compile().as_text()
    # A float conversion of the pool would show as an f32 array of the pool's shape.
    assert "f32[100000,16,8]" not in hlo
