"""Per-token min/max KV quantization: error bound, metadata, packing layout, qk_dot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffkv_jax import quantization as qz

BITS = (8, 4, 2)
F16_MAX = float(np.finfo(np.float16).max)
DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip(x, bits):
    """Everything a round-trip check needs, in one jitted call.

    One compile per (shape, dtype, bits) instead of one per function keeps the
    tests fast, and checks that the public functions trace with static bits / D.
    """
    D = x.shape[-1]
    codes, scale, zero = qz.quantize(x, bits)
    xhat = qz.dequantize(codes, scale, zero)
    packed, ps, pz = qz.quantize_packed(x, bits)
    return (codes, scale, zero, xhat, packed, qz.unpack(packed, bits, D),
            qz.dequantize_packed(packed, ps, pz, bits, D))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pack_unpack(codes, bits, D):
    packed = qz.pack(codes, bits)
    return packed, qz.unpack(packed, bits, D)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _qk_dot(q, packed_k, k_scale, k_zero, bits, D):
    return qz.qk_dot(q, packed_k, k_scale, k_zero, bits, D)


def _sample(rng: np.random.Generator, kind: str, shape, magnitude: float = 1.0) -> np.ndarray:
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "student_t1":
        x = rng.standard_t(1.0, shape)
    elif kind == "student_t2":
        x = rng.standard_t(2.0, shape)
    elif kind == "outlier_channels":
        # Real keys carry a few channels that are ~100x the rest, the same ones every token.
        x = rng.standard_normal(shape)
        chans = rng.choice(shape[-1], size=max(1, shape[-1] // 32), replace=False)
        x[..., chans] *= 100.0
    elif kind == "constant":
        x = np.broadcast_to(rng.standard_normal(shape[:-1] + (1,)), shape).copy()
    else:
        raise ValueError(kind)
    return (x * magnitude).astype(np.float32)


def _check_roundtrip(x, bits: int):
    """Asserts the metadata invariants and the per-element error bound for ``x``.

    Returns ``(codes, scale, zero, xhat)`` as numpy arrays for further checks.
    """
    codes, scale, zero, xhat, packed, unpacked, xhat_packed = _roundtrip(x, bits)
    levels = (1 << bits) - 1
    D = x.shape[-1]
    assert codes.dtype == jnp.uint8 and codes.shape == x.shape
    assert scale.dtype == jnp.float16 and zero.dtype == jnp.float16
    assert scale.shape == x.shape[:-1] and zero.shape == x.shape[:-1]
    assert xhat.dtype == jnp.float32 and xhat.shape == x.shape

    # The reference is the input as float32, saturated to the float16 range as documented.
    xr = np.clip(np.asarray(x).astype(np.float32).astype(np.float64), -F16_MAX, F16_MAX)
    c = np.asarray(codes)
    s = np.asarray(scale).astype(np.float64)
    z = np.asarray(zero).astype(np.float64)
    assert c.max() <= levels
    assert np.all(s > 0) and np.all(np.isfinite(s))
    # Exact in float64: the stored metadata must cover [min, max].
    assert np.all(z <= xr.min(-1))
    assert np.all(z + s * levels >= xr.max(-1))

    xh = np.asarray(xhat).astype(np.float64)
    # Tolerance: half a quantization step with the stored float16 scale, plus
    # 1e-6 * max|x| per vector (~8 float32 ulps) for the float32 rounding of
    # (x - zero) / scale and of codes * scale + zero.
    tol = s[..., None] / 2 + 1e-6 * np.abs(xr).max(-1, keepdims=True)
    err = np.abs(xh - xr)
    assert np.all(err <= tol), float((err - tol).max())

    # The packed path must agree bit for bit.
    assert packed.dtype == jnp.uint8
    assert packed.shape == x.shape[:-1] + (qz.packed_width(D, bits),)
    np.testing.assert_array_equal(np.asarray(unpacked), c)
    np.testing.assert_array_equal(np.asarray(xhat_packed), np.asarray(xhat))
    return c, np.asarray(scale), np.asarray(zero), np.asarray(xhat)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "student_t1", "student_t2", "outlier_channels", "constant"])
@pytest.mark.parametrize("D", [64, 128])
def test_roundtrip_within_half_step(bits, kind, D):
    rng = np.random.default_rng(bits * 1000 + D)
    _check_roundtrip(_sample(rng, kind, (3, 5, D)), bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_roundtrip_input_dtypes(bits, dtype):
    rng = np.random.default_rng(7)
    _check_roundtrip(jnp.asarray(_sample(rng, "outlier_channels", (3, 5, 128)), DTYPES[dtype]), bits)


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1),
       bits=st.sampled_from(BITS),
       D=st.sampled_from([64, 128]),
       lead=st.sampled_from([(), (2, 1, 3)]),
       kind=st.sampled_from(["normal", "student_t1", "student_t2", "outlier_channels", "constant"]),
       log_mag=st.integers(-6, 3),
       offset=st.sampled_from([0.0, 1.0, -300.0]),
       dtype=st.sampled_from(list(DTYPES)))
def test_roundtrip_property(seed, bits, D, lead, kind, log_mag, offset, dtype):
    rng = np.random.default_rng(seed)
    x = _sample(rng, kind, lead + (D,), 10.0 ** log_mag) + np.float32(offset)
    # Saturation is tested on its own; here keep float16 inputs finite.
    x = np.clip(x, -F16_MAX, F16_MAX)
    _check_roundtrip(jnp.asarray(x, DTYPES[dtype]), bits)


def test_constant_vectors():
    # Exactly representable constants dequantize exactly; others within half a (tiny) step.
    vals = np.array([0.0, 1.0, -2.5, 1000.3, 1e-7, -65504.0, 3e-6], np.float32)
    x = np.broadcast_to(vals[:, None], (len(vals), 64)).copy()
    exact = vals.astype(np.float16).astype(np.float32) == vals
    for bits in BITS:
        _, _, _, xhat = _check_roundtrip(jnp.asarray(x), bits)
        np.testing.assert_array_equal(xhat[exact], x[exact])


def test_out_of_float16_range_saturates():
    x = np.array([[-1e6, 0.0, 3.0, 7e4] + [1.0] * 60], np.float32)
    for bits in BITS:
        _, scale, zero, xhat = _check_roundtrip(jnp.asarray(x), bits)
        assert float(zero[0]) == -F16_MAX
        assert np.all(np.isfinite(xhat))
        assert abs(xhat[0, 3] - F16_MAX) <= float(scale[0]) / 2 + 1e-6 * F16_MAX


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("D", [8, 64, 128])
def test_pack_unpack_exact(bits, D):
    rng = np.random.default_rng(D + bits)
    codes = rng.integers(0, 1 << bits, size=(3, 2, D), dtype=np.uint8)
    packed, unpacked = _pack_unpack(jnp.asarray(codes), bits, D)
    assert packed.dtype == jnp.uint8 and unpacked.dtype == jnp.uint8
    assert packed.shape == (3, 2, D * bits // 8) == (3, 2, qz.packed_width(D, bits))
    np.testing.assert_array_equal(np.asarray(unpacked), codes)


def test_pack_layout_4bit():
    c = np.array([1, 2, 3, 4, 10, 11, 12, 15], np.uint8)
    packed = np.asarray(qz.pack(jnp.asarray(c), 4))
    # byte j = dim j (low nibble) | dim j + 4 (high nibble)
    np.testing.assert_array_equal(packed, [0xA1, 0xB2, 0xC3, 0xF4])
    np.testing.assert_array_equal(np.asarray(qz.unpack(jnp.asarray(packed), 4, 8)), c)


def test_pack_layout_2bit():
    c = np.array([0, 1, 2, 3, 3, 2, 1, 0], np.uint8)
    packed = np.asarray(qz.pack(jnp.asarray(c), 2))
    # byte j holds dims j, j+2, j+4, j+6 at bits 0, 2, 4, 6
    b0 = 0 | (2 << 2) | (3 << 4) | (1 << 6)
    b1 = 1 | (3 << 2) | (2 << 4) | (0 << 6)
    np.testing.assert_array_equal(packed, [b0, b1])
    np.testing.assert_array_equal(np.asarray(qz.unpack(jnp.asarray(packed), 2, 8)), c)


def test_pack_layout_8bit_is_identity():
    c = np.arange(0, 256, 32, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(qz.pack(jnp.asarray(c), 8)), c)


def test_pack_is_jittable():
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 4, (5, 16), dtype=np.uint8))
    f = jax.jit(lambda c: qz.unpack(qz.pack(c, 2), 2, 16))
    np.testing.assert_array_equal(np.asarray(f(codes)), np.asarray(codes))


def test_bad_widths_and_bits():
    with pytest.raises(ValueError):
        qz.packed_width(6, 2)
    with pytest.raises(ValueError):
        qz.packed_width(7, 4)
    with pytest.raises(ValueError):
        qz.packed_width(64, 3)
    with pytest.raises(ValueError):
        qz.pack(jnp.zeros((2, 6), jnp.uint8), 2)
    with pytest.raises(ValueError):
        qz.quantize(jnp.zeros((2, 8)), 5)
    with pytest.raises(ValueError):
        qz.unpack(jnp.zeros((2, 8), jnp.uint8), 4, 8)
    assert qz.packed_width(6, 4) == 3 and qz.packed_width(6, 8) == 6


@pytest.mark.parametrize("bits", BITS)
def test_qk_dot_matches_dequantized_dot(bits):
    rng = np.random.default_rng(bits)
    D, T = 128, 33
    k = _sample(rng, "outlier_channels", (2, T, D)) + np.float32(0.5)
    q = rng.standard_normal((2, 1, D)).astype(np.float32)  # broadcast over T
    _, scale, zero, khat, packed, _, _ = _roundtrip(jnp.asarray(k), bits)
    got = np.asarray(_qk_dot(jnp.asarray(q), packed, scale, zero, bits, D))
    assert got.shape == (2, T) and got.dtype == np.float32
    khat = np.asarray(khat, np.float64)
    ref = np.sum(q.astype(np.float64) * khat, axis=-1)
    # Relative to sum |q_i * k_hat_i|, the natural size of the dot's rounding error.
    mag = np.sum(np.abs(q.astype(np.float64) * khat), axis=-1)
    assert np.all(np.abs(got - ref) <= 1e-5 * mag), float((np.abs(got - ref) / mag).max())


def test_qk_dot_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        qz.qk_dot(jnp.zeros((4, 64)), jnp.zeros((4, 64), jnp.uint8),
                  jnp.zeros(4), jnp.zeros(4), 4, 64)


def test_error_decreases_with_bits():
    x = np.random.default_rng(3).standard_normal((3, 5, 128)).astype(np.float32)
    errs = [float(np.mean(np.abs(np.asarray(_roundtrip(jnp.asarray(x), b)[3]) - x))) for b in BITS]
    assert errs[0] < errs[1] < errs[2], errs
    # Roughly a uniform-error model: each halving of bits costs a lot more than 2x.
    assert errs[1] > 4 * errs[0] and errs[2] > 2 * errs[1], errs


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "student_t1", "outlier_channels", "constant"])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_parts_equals_quantize_packed(bits, kind, jit):
    """The kernels' quarter-wise quantizer gives the same bytes and metadata, eagerly
    and under jit (where XLA's simplifier must not change its rounding)."""
    rng = np.random.default_rng(bits)
    D = 64
    mags = rng.choice([1e-6, 1e-3, 1.0, 30.0, 1e4], size=(400, 1))
    x = jnp.asarray(_sample(rng, kind, (400, D)) * mags.astype(np.float32))
    # Values exactly between two codes (ties round to even, as jnp.round does).
    x = x.at[0].set(jnp.arange(D, dtype=jnp.float32) * 0.5).at[1].set(-0.0)
    parts = [x[:, i * D // 4:(i + 1) * D // 4] for i in range(4)]
    fn = functools.partial(qz.quantize_parts, bits=bits)
    blocks, scale, zero = (jax.jit(fn) if jit else fn)(parts)
    want, ws, wz = _roundtrip(x, bits)[4], *qz.quantize_packed(x, bits)[1:]
    assert len(blocks) == bits // 2
    assert np.array_equal(np.concatenate([np.asarray(b) for b in blocks], -1), np.asarray(want))
    assert np.array_equal(np.asarray(scale).view(np.uint16), np.asarray(ws).view(np.uint16))
    assert np.array_equal(np.asarray(zero).view(np.uint16), np.asarray(wz).view(np.uint16))
    codes = np.concatenate([np.asarray(c) for c in qz.unpack_parts(blocks, bits)], -1)
    assert np.array_equal(codes, np.asarray(qz.unpack(want, bits, D), np.int32))


@pytest.mark.parametrize("up", [True, False])
def test_f16_step_is_nextafter(up):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h) & (np.abs(h) < np.float16(65504))]
    got = np.asarray(qz._f16_step(jnp.asarray(h), up)).view(np.uint16)
    want = np.nextafter(h, np.float16(np.inf if up else -np.inf)).view(np.uint16)
    differ = h[got != want]
    # The documented exception: -tiny stepped up gives +0 (nextafter: -0).
    assert (up and list(differ) == [-np.finfo(np.float16).smallest_subnormal]) or not len(differ)
