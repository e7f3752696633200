"""The decode step's token-writes kernel (quantize, demote, write) against the
plain-jnp quantization and scatters it replaces."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import quantization as qz
from pallas_kernels.paged_decode import pack_meta
from pallas_kernels.token_writes import (MovedToken, NewToken, TokenFormat,
                                         read_token_reference, write_tokens,
                                         write_tokens_reference)


def formats(D, high=(8, 4), low=(4, 2)):
    """DiffKV's two tiers in pages of the same bytes (K8V4 / K4V2 by default)."""
    hi_bytes = D * (high[0] + high[1]) // 8
    lo_bytes = D * (low[0] + low[1]) // 8
    hi = TokenFormat(*high, 32, D)
    return hi, TokenFormat(*low, 32 * hi_bytes // lo_bytes, D), 32 * hi_bytes


def case(rng, D, S=3, H=2, P=12, high=(8, 4), low=(4, 2)):
    hi, lo, data_bytes = formats(D, high, low)
    f16 = lambda a: jnp.asarray(a, jnp.float16)  # noqa: E731
    meta = lambda: pack_meta(f16(rng.uniform(0.01, 0.1, (P + 1, 64))),  # noqa: E731
                             f16(rng.normal(size=(P + 1, 64))))
    pools = (jnp.asarray(rng.integers(0, 256, size=(P + 1, data_bytes)), jnp.uint8),
             meta(), meta(),
             jnp.asarray(rng.normal(size=(P + 1, 64)), jnp.float32),
             jnp.asarray(rng.integers(0, 1000, size=(P + 1, 64)), jnp.int32))
    # Each row owns a high page and a low page (as the cache's rows do).
    hi_page, lo_page = rng.permutation(P)[:2 * S * H].reshape(2, S, H)
    src_slot = rng.integers(0, hi.slots, size=(S, H))
    dropped = lambda: rng.random((S, H)) < 0.25  # noqa: E731  (page P + 1: past the pool)
    moved = MovedToken(
        hi, lo, jnp.asarray(hi_page, jnp.int32), jnp.asarray(src_slot, jnp.int32),
        jnp.asarray(np.where(dropped(), P + 1, lo_page), jnp.int32),
        jnp.asarray(rng.integers(0, lo.slots, size=(S, H)), jnp.int32),
        jnp.asarray(rng.normal(size=(S, H)), jnp.float32),
        jnp.asarray(rng.integers(0, 5000, size=(S, H)), jnp.int32))
    # Half the newcomers take the victim's slot (read first, then overwritten).
    new_slot = np.where(rng.random((S, H)) < 0.5, src_slot, rng.integers(0, hi.slots, (S, H)))
    scale = rng.choice([0.01, 1.0, 40.0], size=(S, H, 1))
    new = NewToken(
        hi, jnp.asarray(np.where(dropped(), P + 1, hi_page), jnp.int32),
        jnp.asarray(new_slot, jnp.int32),
        jnp.asarray(rng.normal(size=(S, H, D)) * scale, jnp.float32),
        jnp.asarray(rng.normal(size=(S, H, D)) * scale, jnp.float32),
        jnp.asarray(rng.normal(size=(S, H)), jnp.float32),
        jnp.asarray(rng.integers(0, 5000, size=(S, H)), jnp.int32))
    return pools, [moved, new]


def check(D, seed, interpret, **tiers):
    rng = np.random.default_rng(seed)
    pools, writes = case(rng, D, **tiers)
    ref = write_tokens_reference(*pools, writes)
    got = write_tokens(*pools, writes, interpret=interpret)
    for g, r, before in zip(got, ref, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        assert not np.array_equal(np.asarray(r), np.asarray(before))  # something was written
    return pools, writes, got


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_the_quantization_and_scatters(D, seed):
    check(D, seed, interpret=True)


@pytest.mark.parametrize("high,low", [((8, 8), (4, 4)), ((4, 4), (2, 2)), ((8, 4), (2, 2))])
def test_other_tier_pairs(high, low):
    check(64, 7, interpret=True, high=high, low=low)


def test_written_tokens_read_back_within_half_a_step():
    """What the kernel stores dequantizes to the newcomer within scale / 2, and the
    moved token to the victim's stored (dequantized) value within the low tier's
    scale / 2."""
    pools, writes, got = check(64, 3, interpret=True)
    moved, new = writes
    P = pools[0].shape[0]
    ok = np.asarray(new.page) < P
    k, v = read_token_reference(*got[:3], new.fmt, jnp.minimum(new.page, P - 1), new.slot)
    for x, stored, bits in ((new.keys, k, 8), (new.values, v, 4)):
        _, scale, _ = qz.quantize(x, bits)
        err = np.abs(np.asarray(stored) - np.asarray(x)).max(-1)
        assert (err[ok] <= np.asarray(scale, np.float32)[ok] * 0.5001 + 1e-6).all()
    src = read_token_reference(*pools[:3], moved.src_fmt, moved.src_page, moved.src_slot)
    ok = np.asarray(moved.page) < P
    dst = read_token_reference(*got[:3], moved.fmt, jnp.minimum(moved.page, P - 1), moved.slot)
    for x, stored, bits in zip(src, dst, (4, 2)):
        _, scale, _ = qz.quantize(x, bits)
        err = np.abs(np.asarray(stored) - np.asarray(x)).max(-1)
        assert (err[ok] <= np.asarray(scale, np.float32)[ok] * 0.5001 + 1e-6).all()


def test_dropped_writes_leave_the_pool_alone():
    rng = np.random.default_rng(5)
    pools, (moved, new) = case(rng, 64)
    P = pools[0].shape[0]
    none = jnp.full_like(new.page, P)
    writes = [MovedToken(moved.src_fmt, moved.fmt, moved.src_page, moved.src_slot, none,
                         moved.slot, moved.score, moved.position),
              NewToken(new.fmt, none, new.slot, new.keys, new.values, new.score, new.position)]
    got = write_tokens(*pools, writes, interpret=True)
    for g, before in zip(got, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(before))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_compiled_kernel_matches_the_quantization_and_scatters_on_gpu(D):
    check(D, 3, interpret=False)


def test_gpu_kernel_refuses_head_dims_whose_quarters_are_not_powers_of_two():
    rng = np.random.default_rng(2)
    pools, (moved, new) = case(rng, 64)
    fmt = TokenFormat(8, 4, 32, 80)
    bad = NewToken(fmt, new.page, new.slot, jnp.zeros(new.keys.shape[:2] + (80,)),
                   jnp.zeros(new.keys.shape[:2] + (80,)), new.score, new.position)
    with pytest.raises(ValueError, match="power of two"):
        write_tokens(*pools, [bad], interpret=False)
