"""The decode step's token-writes kernel against the XLA scatters it replaces."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.token_writes import (TokenFormat, TokenWrite, write_tokens,
                                         write_tokens_reference)

# (key bytes, value bytes, slots) of DiffKV's K8V4 and K4V2 tiers at head dims 64 and 128
FORMATS = {64: (TokenFormat(64, 32, 32), TokenFormat(32, 16, 64)),
           128: (TokenFormat(128, 64, 32), TokenFormat(64, 32, 64))}


def case(rng, D, S=3, H=2, P=12):
    fmts = FORMATS[D]
    data_bytes = fmts[0].slots * (fmts[0].key_width + fmts[0].value_width)
    pools = (jnp.asarray(rng.integers(0, 256, size=(P + 1, data_bytes)), jnp.uint8),
             jnp.asarray(rng.integers(0, 2**32, size=(P + 1, 64), dtype=np.uint64), jnp.uint32),
             jnp.asarray(rng.integers(0, 2**32, size=(P + 1, 64), dtype=np.uint64), jnp.uint32),
             jnp.asarray(rng.normal(size=(P + 1, 64)), jnp.float32),
             jnp.asarray(rng.integers(0, 1000, size=(P + 1, 64)), jnp.int32))
    # Distinct pages per row and write (as the cache's tiers are); some dropped (page P + 1).
    pages = rng.permutation(P).reshape(2, -1)[:, :S * H].reshape(2, S, H)
    writes = []
    for i, fmt in enumerate(fmts):
        page = np.where(rng.random((S, H)) < 0.25, P + 1, pages[i])
        writes.append(TokenWrite(
            fmt, jnp.asarray(page, jnp.int32),
            jnp.asarray(rng.integers(0, fmt.slots, size=(S, H)), jnp.int32),
            jnp.asarray(rng.integers(0, 256, size=(S, H, fmt.key_width)), jnp.uint8),
            jnp.asarray(rng.integers(0, 256, size=(S, H, fmt.value_width)), jnp.uint8),
            jnp.asarray(rng.integers(0, 2**32, size=(S, H), dtype=np.uint64), jnp.uint32),
            jnp.asarray(rng.integers(0, 2**32, size=(S, H), dtype=np.uint64), jnp.uint32),
            jnp.asarray(rng.normal(size=(S, H)), jnp.float32),
            jnp.asarray(rng.integers(0, 5000, size=(S, H)), jnp.int32)))
    return pools, writes


def check(D, seed, interpret):
    rng = np.random.default_rng(seed)
    pools, writes = case(rng, D)
    ref = write_tokens_reference(*pools, writes)
    got = write_tokens(*pools, writes, interpret=interpret)
    for g, r, before in zip(got, ref, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        assert not np.array_equal(np.asarray(r), np.asarray(before))  # something was written


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_the_scatters(D, seed):
    check(D, seed, interpret=True)


def test_dropped_writes_leave_the_pool_alone():
    rng = np.random.default_rng(5)
    pools, writes = case(rng, 64)
    P = pools[0].shape[0]
    writes = [TokenWrite(w.fmt, jnp.full_like(w.page, P), w.slot, w.keys, w.values, w.k_meta,
                         w.v_meta, w.score, w.position) for w in writes]
    got = write_tokens(*pools, writes, interpret=True)
    for g, before in zip(got, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(before))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_compiled_kernel_matches_the_scatters_on_gpu(D):
    check(D, 3, interpret=False)
