"""Per-token asymmetric min/max quantization of KV vectors, and its bit packing.

Every vector (the last axis, one head of one token) is quantized on its own::

    zero  = min(x)                      (stored float16, rounded down)
    scale = (max(x) - zero) / (2^b - 1) (stored float16, rounded up)
    codes = clip(round((x - zero) / scale), 0, 2^b - 1)   (uint8)
    x_hat = codes * scale + zero        (float32)

The codes are computed from the float16-rounded metadata, not from the float32
min/max, so the error bound holds for what is actually stored: ``zero16 <= min``
and ``zero16 + scale16 * (2^b - 1) >= max``, hence every element dequantizes
within ``scale16 / 2`` of its input, plus float32 rounding (a few ulps of
``max|x|``).

Packed layout (``b`` bits, ``n = 8 / b`` codes per byte, ``D % n == 0``): the
vector is cut into ``n`` contiguous slices of ``D / n`` dims, and byte ``j``
holds dim ``j + i * D / n`` at bit offset ``i * b``. So

* 8-bit: ``[..., D]``, the codes themselves;
* 4-bit: ``[..., D/2]``, ``byte[j] = c[j] | c[j + D/2] << 4``;
* 2-bit: ``[..., D/4]``, dims ``j, j + D/4, j + D/2, j + 3D/4`` at bits 0, 2, 4, 6.

Slices rather than interleaved neighbours because a kernel can then unpack
with one shift and mask per slice and take one dot product per slice against
the matching contiguous slice of the query; Pallas' Triton lowering rejects
``jnp.concatenate`` inside kernels, so rebuilding the full vector is not an
option there. :func:`qk_dot` is the plain-jnp reference for that scheme.

Limits: inputs are saturated to the float16 range ``[-65504, 65504]`` before
quantizing (the metadata could not represent more; real keys and values stay
far inside it), so the bound only holds for inputs within that range.
Non-finite inputs (NaN, inf) give undefined codes and metadata.

All functions are pure ``jnp`` and jit-compatible with ``bits`` and ``D``
static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUPPORTED_BITS = (8, 4, 2)

_F16_MAX = float(np.finfo(np.float16).max)
# Used for vectors whose range is exactly zero: any positive scale is exact
# there (all codes are 0), and a normal number keeps kernels away from
# subnormal float16 arithmetic.
_F16_TINY = float(np.finfo(np.float16).tiny)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _per_byte(bits: int) -> int:
    return 8 // bits


def packed_width(D: int, bits: int) -> int:
    """Bytes per packed vector of ``D`` dims at ``bits`` bits (``D * bits / 8``).

    Raises:
      ValueError: if ``bits`` is unsupported or ``D`` is not a positive
        multiple of ``8 // bits``.
    """
    _check_bits(bits)
    n = _per_byte(bits)
    if D <= 0 or D % n:
        raise ValueError(f"{bits}-bit packing needs D to be a positive multiple of {n}, got D={D}")
    return D // n


def _f16_round_down(v: jax.Array) -> jax.Array:
    """Largest float16 ``<= v`` (float32 ``v``), for ``v`` within float16 range."""
    h = v.astype(jnp.float16)
    return jnp.where(h.astype(jnp.float32) > v, _f16_step(h, up=False), h)


def _f16_round_up(v: jax.Array) -> jax.Array:
    """Smallest float16 ``>= v`` (float32 ``v``), for ``v`` within float16 range."""
    h = v.astype(jnp.float16)
    return jnp.where(h.astype(jnp.float32) < v, _f16_step(h, up=True), h)


def _f16_step(h: jax.Array, up: bool) -> jax.Array:
    """The float16 next to ``h`` towards +inf (``up``) or -inf, for finite ``h``:
    ``jnp.nextafter`` by integer arithmetic on the bits (GPU kernels lack a float16
    nextafter). Zeros of either sign step to the smallest subnormal of the
    direction; the one difference, ``-tiny`` up giving +0 rather than -0, is never
    reached by the quantizer (it steps down from a minimum or up from a range)."""
    b = lax.bitcast_convert_type(h, jnp.int16).astype(jnp.int32)
    ordered = jnp.where(b >= 0, b, -(b & 0x7FFF))  # both zeros -> 0, monotone in h
    ordered = ordered + (1 if up else -1)
    b = jnp.where(ordered >= 0, ordered, (-ordered) | 0x8000)
    return lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16)


def _metadata(mn: jax.Array, mx: jax.Array, levels: int):
    """Float16 ``(scale16, zero16)`` of vectors with float32 minimum ``mn`` and
    maximum ``mx`` (within float16 range), such that ``zero16 <= mn`` and
    ``zero16 + scale16 * levels >= mx``."""
    zero16 = _f16_round_down(mn)
    rng = mx - zero16.astype(jnp.float32)  # >= 0 since zero <= mn <= mx
    scale16 = _f16_round_up(rng / levels)
    # rng and rng / levels are float32-rounded, so the rounded-up scale can
    # still leave the top level a float32 ulp short of max. scale16 * levels
    # is exact in float32 (11 + 8 significant bits) and rng is within half an
    # ulp of the true max - zero, so a strict ">" proves the bound in exact
    # arithmetic; otherwise one float16 ulp more covers it by a wide margin.
    short = scale16.astype(jnp.float32) * levels <= rng
    scale16 = jnp.where(short, _f16_step(scale16, up=True), scale16)
    scale16 = jnp.where(rng == 0, jnp.float16(_F16_TINY), scale16)
    return scale16, zero16


def quantize(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize each vector along the last axis with its own min/max.

    Args:
      x: ``[..., D]`` floating array (any float dtype; math runs in float32).
        Values beyond the float16 range are saturated to it; non-finite
        values are undefined behaviour.
      bits: 8, 4 or 2.

    Returns:
      ``(codes, scale, zero)``: codes ``uint8 [..., D]`` in ``[0, 2^bits - 1]``,
      scale and zero ``float16 [...]``, such that ``zero <= min(x)``,
      ``zero + scale * (2^bits - 1) >= max(x)`` and
      ``|dequantize(codes, scale, zero) - x| <= scale / 2`` up to float32
      rounding.
    """
    _check_bits(bits)
    levels = (1 << bits) - 1
    x = jnp.clip(jnp.asarray(x).astype(jnp.float32), -_F16_MAX, _F16_MAX)
    mn = jnp.min(x, axis=-1)
    mx = jnp.max(x, axis=-1)

    scale16, zero16 = _metadata(mn, mx, levels)
    zero, scale = zero16.astype(jnp.float32), scale16.astype(jnp.float32)

    codes = jnp.round((x - zero[..., None]) / scale[..., None])
    codes = jnp.clip(codes, 0, levels).astype(jnp.uint8)
    return codes, scale16, zero16


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """``codes * scale + zero`` in float32: ``[..., D]`` codes, ``[...]`` metadata."""
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
            + zero.astype(jnp.float32)[..., None])


def _slices(packed: jax.Array, bits: int) -> list[jax.Array]:
    """The ``8 // bits`` code slices of a packed array, each uint8 ``[..., D / n]``.

    Slice ``i`` holds dims ``[i * D/n, (i + 1) * D/n)``.
    """
    if bits == 8:
        return [packed]
    mask = jnp.uint8((1 << bits) - 1)
    return [(packed >> jnp.uint8(i * bits)) & mask for i in range(_per_byte(bits))]


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack uint8 codes ``[..., D]`` into ``uint8 [..., D * bits / 8]``.

    See the module docstring for the byte layout. Codes must be below
    ``2^bits``; higher bits are discarded.

    Raises:
      ValueError: on unsupported ``bits`` or a ``D`` that does not divide.
    """
    D = codes.shape[-1]
    w = packed_width(D, bits)
    codes = codes.astype(jnp.uint8)
    if bits == 8:
        return codes
    mask = jnp.uint8((1 << bits) - 1)
    out = jnp.zeros(codes.shape[:-1] + (w,), jnp.uint8)
    for i in range(_per_byte(bits)):  # over the 2 or 4 slices, not over data
        out = out | ((codes[..., i * w:(i + 1) * w] & mask) << jnp.uint8(i * bits))
    return out


def unpack(packed: jax.Array, bits: int, D: int) -> jax.Array:
    """Inverse of :func:`pack`: ``uint8 [..., D * bits / 8] -> uint8 codes [..., D]``.

    Raises:
      ValueError: on unsupported ``bits``, a ``D`` that does not divide, or a
        packed width that does not match ``D``.
    """
    w = packed_width(D, bits)
    if packed.shape[-1] != w:
        raise ValueError(f"packed width {packed.shape[-1]} does not match D={D} at {bits} bits")
    packed = packed.astype(jnp.uint8)
    if bits == 8:
        return packed
    # Slice-major stacking then a reshape puts slice i at dims [i*w, (i+1)*w).
    parts = jnp.stack(_slices(packed, bits), axis=-2)
    return parts.reshape(packed.shape[:-1] + (D,))


def quantize_packed(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`quantize` then :func:`pack`: ``(packed uint8 [..., D*bits/8], scale, zero)``."""
    packed_width(x.shape[-1], bits)  # fail before doing the work
    codes, scale, zero = quantize(x, bits)
    return pack(codes, bits), scale, zero


def _round_half_even(y: jax.Array) -> jax.Array:
    """``jnp.round`` of ``0 <= y < 2^31`` as int32, from its integer part and the
    (exact) remainder: GPU kernels lack a rounding instruction, and the
    ``(y + 2^23) - 2^23`` trick is folded away by XLA's simplifier."""
    whole = y.astype(jnp.int32)  # truncation = floor for y >= 0
    frac = y - whole.astype(jnp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    return whole + up.astype(jnp.int32)


def quantize_parts(parts, bits: int):
    """:func:`quantize_packed` of vectors given as their four quarters, without
    slicing or concatenating (so it runs inside Pallas GPU kernels too).

    Args:
      parts: four arrays ``[..., D/4]``, dims ``[i D/4, (i+1) D/4)`` of the vectors.
      bits: 8, 4 or 2.
    Returns:
      ``(blocks, scale, zero)``: the packed bytes as ``bits / 2`` uint8 blocks
      ``[..., D/4]`` (block ``m`` is bytes ``[m D/4, (m+1) D/4)`` of
      :func:`pack`'s layout) and float16 ``scale, zero [...]``, equal to
      :func:`quantize_packed`'s.
    """
    _check_bits(bits)
    if len(parts) != 4:
        raise ValueError(f"expected the 4 quarters of each vector, got {len(parts)} parts")
    levels = (1 << bits) - 1
    parts = [jnp.clip(p.astype(jnp.float32), -_F16_MAX, _F16_MAX) for p in parts]
    mn = functools.reduce(jnp.minimum, [jnp.min(p, axis=-1) for p in parts])
    mx = functools.reduce(jnp.maximum, [jnp.max(p, axis=-1) for p in parts])
    scale16, zero16 = _metadata(mn, mx, levels)
    zero, scale = zero16.astype(jnp.float32), scale16.astype(jnp.float32)
    codes = [jnp.clip(_round_half_even((p - zero[..., None]) / scale[..., None]), 0, levels)
             for p in parts]
    step = bits // 2  # blocks of D/4 bytes; byte m*D/4 + t holds quarters m + i*step
    blocks = []
    for m in range(step):
        word = codes[m]
        for i in range(1, 8 // bits):
            word = word | (codes[m + i * step] << (i * bits))
        blocks.append(word.astype(jnp.uint8))
    return blocks, scale16, zero16


def unpack_parts(blocks, bits: int):
    """Inverse of :func:`quantize_parts`' packing: the four quarters' codes (int32)
    from the ``bits / 2`` byte blocks."""
    step, mask = bits // 2, (1 << bits) - 1
    return [(blocks[q % step].astype(jnp.int32) >> ((q // step) * bits)) & mask
            for q in range(4)]


def dequantize_packed(packed: jax.Array, scale: jax.Array, zero: jax.Array,
                      bits: int, D: int) -> jax.Array:
    """:func:`unpack` then :func:`dequantize`: float32 ``[..., D]``."""
    return dequantize(unpack(packed, bits, D), scale, zero)


def qk_dot(q: jax.Array, packed_k: jax.Array, k_scale: jax.Array, k_zero: jax.Array,
           bits: int, D: int) -> jax.Array:
    """``q . k_hat`` against packed quantized keys, without dequantizing them.

    Uses ``q . k_hat = scale * (q . codes) + zero * sum(q)`` and splits
    ``q . codes`` into one dot per packed slice (``q[..., i*D/n:(i+1)*D/n]``
    against slice ``i`` of the bytes), the form a kernel can compute without
    rebuilding the full code vector.

    Args:
      q: ``[..., D]`` queries (cast to float32).
      packed_k: ``[..., D * bits / 8]`` uint8 packed key codes.
      k_scale, k_zero: ``[...]`` key metadata (float16 or float32).
      bits, D: bit width and unpacked head dim.

    Returns:
      float32 ``[...]``, the leading shapes of all inputs broadcast together.
    """
    w = packed_width(D, bits)
    if q.shape[-1] != D or packed_k.shape[-1] != w:
        raise ValueError(f"expected q [..., {D}] and packed_k [..., {w}], "
                         f"got {q.shape} and {packed_k.shape}")
    q = q.astype(jnp.float32)
    qc = None
    for i, c in enumerate(_slices(packed_k.astype(jnp.uint8), bits)):
        part = jnp.sum(q[..., i * w:(i + 1) * w] * c.astype(jnp.float32), axis=-1)
        qc = part if qc is None else qc + part
    return (k_scale.astype(jnp.float32) * qc
            + k_zero.astype(jnp.float32) * jnp.sum(q, axis=-1))
