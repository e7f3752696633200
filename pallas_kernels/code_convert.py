"""Integer codes to float16 dot operands, inside a Pallas kernel.

A code ``c < 1024`` ORed into the mantissa of float16 1024.0 (bits ``0x6400 | c``)
is exactly ``1024 + c``, so codes become dot operands with integer bit
operations only; the kernels fold the 1024 into their offset terms. Int-to-float
conversions, by contrast, run at a fraction of the integer rate on Hopper.

On the GPU one inline-assembly instance handles four packed bytes at once
(one 32-bit register): a shift and a mask per code slice, then two byte
permutes (``prmt``) that interleave the codes with the 0x64 exponent byte.
That is about one instruction per code, where the compiler's own lowering of
the same jnp expression spends four (it moves every byte through its own
register). In interpret mode the same function is computed with jnp.

**Codes left in place** (``in_place=True``): every byte becomes float16
``1024 + b`` once (the two byte permutes), and slice ``i`` is that with the
other slices' bits masked off (one AND per two codes), so it holds
``1024 + c * 2^(bits * i)``: 2 + 2n instructions per word of n slices
instead of 4n - 1. The caller undoes the power of two after its dots (a
kernel's value accumulators, once per program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

MAGIC = 1024.0
MAGIC_BITS = 0x6400


def _asm(bits: int, i: int) -> str:
    """PTX for one 32-bit word of packed codes -> slice ``i`` as 4 float16 ``1024 + c``.

    One instance per slice: Pallas lowers an inline-assembly call with a single result.
    """
    mask = ((1 << bits) - 1) * 0x01010101
    lines = ["{", ".reg .b32 f, c;", "mov.b32 f, 0x64646464;"]
    if bits == 8:
        lines.append("mov.b32 c, $2;")
    elif i == 0:
        lines.append(f"and.b32 c, $2, {mask:#010x};")
    else:
        lines.append(f"shr.b32 c, $2, {bits * i};")
        lines.append(f"and.b32 c, c, {mask:#010x};")
    # Output bytes [c0, 0x64, c1, 0x64] and [c2, 0x64, c3, 0x64]: float16 1024 + c.
    lines += ["prmt.b32 $0, c, f, 0x4140;", "prmt.b32 $1, c, f, 0x4342;", "}"]
    return "\n".join(lines)


def slice_mask(bits: int, i: int) -> int:
    """The bits of slice ``i`` of a byte of ``bits``-bit codes, in place."""
    return ((1 << bits) - 1) << (bits * i)


def magic_slices(packed: jax.Array, bits: int, *, interpret: bool,
                 in_place: bool = False) -> list[jax.Array]:
    """Float16 ``1024 + code`` for every code slice of ``packed`` (uint8, any shape).

    Slice ``i`` holds the codes at bit offset ``i * bits`` of each byte (see
    :mod:`diffkv_jax.quantization`); 8-bit codes are one slice. With
    ``in_place`` slice ``i`` is ``1024 + code * 2^(bits * i)`` (the code left at
    its bit offset; fewer instructions on the GPU).
    """
    n = 8 // bits
    if in_place and n > 1:
        whole = magic_slices(packed, 8, interpret=interpret)[0]
        return [_masked(whole, slice_mask(bits, i), interpret) for i in range(n)]
    if interpret:
        mask = jnp.uint8((1 << bits) - 1)
        out = []
        for i in range(n):
            c = (packed >> jnp.uint8(bits * i)) & mask if bits < 8 else packed
            out.append(lax.bitcast_convert_type(c.astype(jnp.uint16) | jnp.uint16(MAGIC_BITS),
                                                jnp.float16))
        return out
    from jax.experimental.pallas import triton as plgpu

    shape = jax.ShapeDtypeStruct(packed.shape, jnp.float16)
    return [plgpu.elementwise_inline_asm(_asm(bits, i), args=[packed], constraints="=r,=r,r",
                                         pack=4, result_shape_dtypes=[shape])[0]
            for i in range(n)]


def _masked(whole: jax.Array, mask: int, interpret: bool) -> jax.Array:
    """Float16 ``1024 + b`` (``whole``) with the byte's bits outside ``mask`` cleared:
    ``1024 + (b & mask)``."""
    keep = MAGIC_BITS | mask
    if interpret:
        bits16 = lax.bitcast_convert_type(whole, jnp.uint16) & jnp.uint16(keep)
        return lax.bitcast_convert_type(bits16, jnp.float16)
    from jax.experimental.pallas import triton as plgpu

    pair = keep * 0x10001  # both float16 of a 32-bit register
    return plgpu.elementwise_inline_asm(f"and.b32 $0, $1, {pair:#010x};", args=[whole],
                                        constraints="=r,r", pack=2,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(
                                            whole.shape, jnp.float16)])[0]


def exact_slices(packed: jax.Array, bits: int, dtype) -> list[jax.Array]:
    """The code slices of ``packed`` converted to ``dtype`` exactly (no magic offset)."""
    n = 8 // bits
    if bits == 8:
        return [packed.astype(jnp.float32).astype(dtype)]
    mask = jnp.uint8((1 << bits) - 1)
    return [((packed >> jnp.uint8(bits * i)) & mask).astype(jnp.float32).astype(dtype)
            for i in range(n)]


def int8_slices(packed: jax.Array, bits: int, *, interpret: bool) -> list[jax.Array]:
    """Every code slice of ``packed`` (uint8) as int8 dot operands ``c * 2^(8 - bits) - 128``.

    Slice ``i`` (the codes at bit offset ``i * bits``) is shifted to the byte's top
    bits, masked and its sign bit flipped: an unsigned byte ``u`` with its top bit
    flipped is the int8 ``u - 128``. One word of four bytes costs a shift (none for
    the top slice) and one logic op per slice, against two byte permutes per two
    codes for float16 operands, and the int8 tensor-core dot takes twice the depth
    of a float16 one. The caller adds ``128 * sum(q)`` back and divides by
    ``2^(8 - bits)`` (exact in int32).
    """
    n = 8 // bits
    top = (0xFF << (8 - bits)) & 0xFF
    shifts = [8 - bits * (i + 1) for i in range(n)]
    if interpret:
        out = []
        for s in shifts:
            u = (packed << jnp.uint8(s)) & jnp.uint8(top) if s else packed & jnp.uint8(top)
            out.append(lax.bitcast_convert_type(u ^ jnp.uint8(0x80), jnp.int8))
        return out
    from jax.experimental.pallas import triton as plgpu

    shape = jax.ShapeDtypeStruct(packed.shape, jnp.int8)
    mask, flip = top * 0x01010101, 0x80808080
    out = []
    for s in shifts:
        # Bits shifted in from the byte below land under the mask's top bits: cut.
        src = f"shl.b32 t, $1, {s};" if s else "mov.b32 t, $1;"
        asm = "\n".join(["{", ".reg .b32 t;", src, f"and.b32 t, t, {mask:#010x};",
                         f"xor.b32 $0, t, {flip:#010x};", "}"])
        out.append(plgpu.elementwise_inline_asm(asm, args=[packed], constraints="=r,r", pack=4,
                                                result_shape_dtypes=[shape])[0])
    return out
