"""Everything that depends on the Pallas GPU backend lives here.

The kernels are written against Pallas' Triton lowering (see README.md in
this folder for why and what it risks). On a machine without a GPU they run
in Pallas interpret mode, which executes the same kernel body with jnp.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as _triton


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def runs_compiled(attention_impl: str) -> bool:
    """Whether a cache with this ``attention_impl`` runs the Pallas kernels compiled
    (the kernel path on a GPU): what the caches' "auto" settings choose by."""
    return attention_impl == "pallas" and on_gpu()


def default_interpret() -> bool:
    """Interpret mode unless a GPU is present."""
    return not on_gpu()


def compiler_params(num_warps: int, num_stages: int):
    """Launch parameters for the Triton lowering."""
    return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, trans_b: bool = False):
    """Matrix product inside a kernel, float32 accumulation."""
    return _triton.dot(a, b, trans_b=trans_b)


# ``acc + dot(a, b)`` as one MMA that accumulates into ``acc``. Pallas' own dot
# starts every product from a zero accumulator, and the Triton compiler does not
# fold the add that follows into it: in the decode kernel's page loop that add
# was a separate FADD per output element per page. This primitive lowers to a
# Triton dot with the accumulator as its operand; everywhere else (interpret
# mode, the CPU) it is the plain sum.
def _dot_acc_reference(acc, a, b, *, trans_b):
    prod = jnp.dot(a.astype(jnp.float32), (b.T if trans_b else b).astype(jnp.float32))
    return acc + prod.astype(acc.dtype)


dot_acc_p = jex_core.Primitive("pallas_dot_accumulate")
dot_acc_p.def_impl(_dot_acc_reference)
dot_acc_p.def_abstract_eval(lambda acc, a, b, *, trans_b: acc)  # the accumulator's aval
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_dot_acc_reference, multiple_results=False))


def _register_triton_dot_acc() -> bool:
    """Teach the Triton lowering the accumulating dot; False (and the plain sum) when
    this JAX's private lowering API is not the one written against, or when the
    environment sets ``DIFFKV_JAX_PLAIN_DOT=1``."""
    if os.environ.get("DIFFKV_JAX_PLAIN_DOT", "0") not in ("", "0"):
        return False
    try:
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tl
    except ImportError:
        return False
    if not hasattr(tl, "triton_lowering_rules") or not hasattr(tt_dialect, "dot"):
        return False

    def rule(ctx, acc, a, b, *, trans_b):
        del ctx
        if trans_b:
            b = tt_dialect.trans(b, (1, 0))
        return tt_dialect.dot(a, b, acc)

    tl.triton_lowering_rules[dot_acc_p] = rule
    return True


#: Whether :func:`dot_acc` lowers to one accumulating MMA on the GPU.
FUSED_DOT_ACC = _register_triton_dot_acc()


def dot_acc(acc, a, b, trans_b: bool = False):
    """``acc + dot(a, b)`` inside a kernel (``acc`` float32; ``a``, ``b`` the dot's
    operand dtype), accumulated by the MMA itself on the GPU."""
    if not FUSED_DOT_ACC:
        return acc + dot(a, b, trans_b=trans_b)
    return dot_acc_p.bind(acc, a, b, trans_b=trans_b)


def _register_wide_offsets() -> bool:
    """Give every ref of more than 2^31 bytes 64-bit element offsets.

    The Triton lowering indexes a ref with 32-bit offsets unless it holds more than
    2^32 bytes, and the pointer arithmetic sign-extends them: a one-byte pool of
    2 - 4 GiB overflows. The lowering chooses the width from the ref's size alone
    (``_compute_offsets_from_indices``), so this hands it, for refs of that range,
    a block description whose dtype claims 8 bytes per element: the width flips to
    64 bits and nothing else changes (offsets and strides stay in elements of the
    real dtype). False (and the narrow offsets) when this JAX's private lowering is
    not the one written against, or when ``DIFFKV_JAX_NARROW_OFFSETS=1``.
    """
    if os.environ.get("DIFFKV_JAX_NARROW_OFFSETS", "0") not in ("", "0"):
        return False
    try:
        import dataclasses
        import math

        from jax._src.pallas.triton import lowering as tl
    except ImportError:
        return False
    narrow = getattr(tl, "_compute_offsets_from_indices", None)
    if narrow is None or getattr(narrow, "_wide", False) or not hasattr(tl, "BlockInfo"):
        return False
    if "full_shape_dtype" not in {f.name for f in dataclasses.fields(tl.BlockInfo)}:
        return False

    def wide(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if 2**31 < math.prod(full.shape) * jnp.dtype(full.dtype).itemsize <= 2**32:
            block_info = dataclasses.replace(
                block_info, full_shape_dtype=jax.ShapeDtypeStruct(full.shape, jnp.uint64))
        return narrow(block_info, nd_indexer)

    wide._wide = True
    tl._compute_offsets_from_indices = wide
    return True


_WIDE_PATCHED = _register_wide_offsets()


def _probe_kernel(ids_ref, pool_ref, out_ref):
    out_ref[...] = pool_ref[ids_ref[0], :].astype(jnp.int32)


@functools.cache
def wide_offsets() -> bool:
    """Whether refs of 2 - 4 GiB get 64-bit offsets: the patch is in place and a probe
    kernel over a 3 GiB byte ref, lowered for CUDA (no GPU needed), shows them."""
    if not _WIDE_PATCHED:
        return False
    import contextlib
    import io

    from jax.experimental import pallas as pl

    def probe(ids, pool):
        return pl.pallas_call(
            _probe_kernel, out_shape=jax.ShapeDtypeStruct((256,), jnp.int32),
            in_specs=[pl.BlockSpec((1,), lambda: (0,)), pl.BlockSpec(pool.shape, lambda: (0, 0))],
            out_specs=pl.BlockSpec((256,), lambda: (0,)), debug=True,
            compiler_params=compiler_params(1, 1))(ids, pool)

    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):  # debug=True prints the Triton module
            jax.jit(probe).trace(jax.ShapeDtypeStruct((1,), jnp.int32),
                                 jax.ShapeDtypeStruct((3 * 2**22, 256), jnp.uint8)
                                 ).lower(lowering_platforms=("cuda",))
    except Exception:  # noqa: BLE001 - any failure: the narrow offsets, refused pools
        return False
    return "i64" in text.getvalue()


#: The special registers a program trace reads (PTX): the global nanosecond timer's
#: low 32 bits (comparable across multiprocessors), the multiprocessor's cycle
#: counter (finer, but its own per multiprocessor) and the multiprocessor's index.
CLOCK_REGISTERS = {"ns": "%globaltimer_lo", "cycles": "%clock", "sm": "%smid"}


def read_clock(dep, which: str):
    """One of :data:`CLOCK_REGISTERS` inside a compiled kernel, as an int32 ``[1]``
    (the 32-bit registers wrap: compare readings by their difference modulo 2^32).

    ``dep`` (an int32 scalar) orders the read: the inline assembly is pure, so it
    runs after ``dep`` is known and two reads with different ``dep`` stay apart.
    """
    dep = jnp.broadcast_to(jnp.asarray(dep, jnp.int32), (1,))
    return _triton.elementwise_inline_asm(
        f"mov.u32 $0, {CLOCK_REGISTERS[which]};", args=[dep], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])[0]


# Asking the L2 cache to fetch a page ahead of the loop step that reads it. A decode
# program is one warp whose loop waits on its own loads: the pipeline's stages in
# shared memory hold two or three steps, and more stages would cost programs per
# multiprocessor. A prefetch into L2 costs no register or shared memory (one
# bulk-prefetch instruction of one thread per page part, sm_90), so the pages a few steps
# ahead are on their way while the loop works, and its own loads find them in L2.
# Pallas has no such operation, so this primitive lowers, in the Triton lowering
# only, to inline PTX on the address of ``ref[index, 0, ...]``; it reads nothing
# back and changes no result.
def _kernel_effect(name: str):
    """An effect of its own (a class named ``name``), allowed in loops and kept inside
    the kernel, so that a primitive carrying it survives dead-code elimination and
    keeps its place (None where this JAX's private API differs)."""
    try:
        from jax._src import effects
        from jax._src.pallas import core as pallas_core
    except ImportError:
        return None

    effect_type = type(name, (effects.Effect,), {})
    effects.control_flow_allowed_effects.add_type(effect_type)
    pallas_core.kernel_local_effects.add_type(effect_type)
    return effect_type()


# (a read of a ref whose value is unused would not survive)
_PREFETCH_EFFECT = _kernel_effect("PrefetchEffect")


def _prefetch_abstract_eval(ref, index, when, *, elements):
    del ref, index, when, elements
    return [], {_PREFETCH_EFFECT}


prefetch_l2_p = jex_core.Primitive("pallas_prefetch_l2")
prefetch_l2_p.multiple_results = True
prefetch_l2_p.def_effectful_abstract_eval(_prefetch_abstract_eval)


def prefetch_asm(nbytes: int) -> str:
    """PTX of one page's L2 prefetch: lane 0 of the warp asks for ``nbytes`` (a
    multiple of 16) from the address operand ``$1`` where ``$2`` is not zero (``$0``
    is a dummy result: an inline-assembly op of Pallas' lowering has one)."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"a bulk L2 prefetch takes a positive multiple of 16 bytes, got {nbytes}")
    return ("{ .reg .pred p, q; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "setp.ne.u32 q, $2, 0; and.pred p, p, q; "
            f"@p cp.async.bulk.prefetch.L2.global [$1], {nbytes}; mov.u32 $0, 0; }}")


def _register_triton_prefetch() -> bool:
    """Teach the Triton lowering :data:`prefetch_l2_p`; False when this JAX's private
    lowering API is not the one written against, or when the environment sets
    ``DIFFKV_JAX_NO_PREFETCH=1`` (then :func:`prefetch_l2` does nothing)."""
    if os.environ.get("DIFFKV_JAX_NO_PREFETCH", "0") not in ("", "0"):
        return False
    try:
        import numpy as np

        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith as arith_dialect
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tl
    except ImportError:
        return False
    if _PREFETCH_EFFECT is None or not (
            hasattr(tl, "triton_lowering_rules") and hasattr(tt_dialect, "addptr")
            and hasattr(tt_dialect, "elementwise_inline_asm")):
        return False

    def rule(ctx, ptr, index, when, *, elements):
        ref_aval = ctx.avals_in[0]
        itemsize = np.dtype(ref_aval.dtype).itemsize
        stride = int(np.prod(ref_aval.shape[1:]))  # elements per page of the ref
        i64 = ir.IntegerType.get_signless(64)
        index = arith_dialect.extsi(i64, index)  # 64-bit: pools past 2 GiB
        offset = arith_dialect.muli(index, arith_dialect.constant(i64, stride))
        address = tt_dialect.addptr(ptr.type, ptr, offset)
        nbytes = elements * itemsize // 16 * 16  # whole 16-byte units inside the page
        tt_dialect.elementwise_inline_asm([ir.IntegerType.get_signless(32)],
                                          prefetch_asm(nbytes), constraints="=r,l,r",
                                          pure=False, packed_element=1,
                                          args=[address, arith_dialect.extui(
                                              ir.IntegerType.get_signless(32), when)])
        return []

    tl.triton_lowering_rules[prefetch_l2_p] = rule
    return True


#: Whether :func:`prefetch_l2` lowers to an L2 prefetch (else it does nothing).
L2_PREFETCH = _register_triton_prefetch()


def prefetch_l2(ref, index, elements: int, when=True) -> None:
    """Ask the L2 cache for ``elements`` elements of ``ref`` from ``ref[index, 0, ...]``
    (``index`` an int32 scalar, in bounds; the address a multiple of 16 bytes, and
    at least 16 bytes asked: the bulk prefetch's rules) inside a compiled Triton
    kernel, where ``when`` (a bool scalar) holds. A hint: it returns nothing, and outside a compiled
    GPU kernel (interpret mode) the caller leaves it out."""
    if L2_PREFETCH:
        prefetch_l2_p.bind(ref, jnp.asarray(index, jnp.int32), jnp.asarray(when, jnp.bool_),
                           elements=int(elements))


# An atomic add without memory ordering. Pallas' own atomics lower to acquire-release
# at GPU scope: the add then waits for the program's earlier stores to be visible, and
# its later loads wait for the add. A counter that hands out work publishes no data, so
# its take needs atomicity alone; this primitive lowers, in the Triton lowering only,
# to a relaxed atomic add on ``ref[index]`` (a 1-D int32 ref), under ``mask``.
_ATOMIC_EFFECT = _kernel_effect("RelaxedAtomicEffect")


def _relaxed_add_abstract_eval(ref, index, value, mask):
    del ref, index, mask
    return value, {_ATOMIC_EFFECT}  # the value's aval: an int32 scalar


relaxed_add_p = jex_core.Primitive("pallas_relaxed_atomic_add")
relaxed_add_p.def_effectful_abstract_eval(_relaxed_add_abstract_eval)


def _register_triton_relaxed_add() -> bool:
    """Teach the Triton lowering :data:`relaxed_add_p`; False when this JAX's private
    lowering API is not the one written against (:func:`relaxed_atomic_add` then
    falls back to Pallas' acquire-release atomic)."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering as tl
    except ImportError:
        return False
    if _ATOMIC_EFFECT is None or not (
            hasattr(tl, "triton_lowering_rules") and hasattr(tt_dialect, "addptr")
            and hasattr(tt_dialect, "atomic_rmw") and hasattr(tt_dialect, "MemSemantic")
            and hasattr(tl, "_ensure_ir_value")):
        return False

    def rule(ctx, ptr, index, value, mask):
        # constants come in as Python values: IR constants of their avals
        index, value, mask = (tl._ensure_ir_value(x, aval)
                              for x, aval in zip((index, value, mask), ctx.avals_in[1:]))
        address = tt_dialect.addptr(ptr.type, ptr, index)
        return tt_dialect.atomic_rmw(ir.IntegerType.get_signless(32), tt_dialect.RMWOp.ADD,
                                     address, value, mask=mask,
                                     sem=tt_dialect.MemSemantic.RELAXED,
                                     scope=tt_dialect.MemSyncScope.GPU)

    tl.triton_lowering_rules[relaxed_add_p] = rule
    return True


#: Whether :func:`relaxed_atomic_add` lowers to a relaxed atomic.
RELAXED_ATOMICS = _register_triton_relaxed_add()


def relaxed_atomic_add(ref, index, value: int, mask=True):
    """``ref[index] += value`` as one atomic without memory ordering inside a compiled
    Triton kernel, where ``mask`` (a bool scalar) holds; the value before the add
    (meaningless where ``mask`` is False). ``ref``: a 1-D int32 ref; ``index``: an
    int32 scalar in bounds. Acquire-release (Pallas' atomic) where this JAX's
    lowering is not the one written against; outside a compiled GPU kernel the
    caller emulates it."""
    index, mask = jnp.asarray(index, jnp.int32), jnp.asarray(mask, jnp.bool_)
    value = jnp.full((), value, jnp.int32)
    if not RELAXED_ATOMICS:
        from jax.experimental.pallas import triton as plgpu

        return plgpu.atomic_add(ref, index, value, mask=mask)
    return relaxed_add_p.bind(ref, index, value, mask)
