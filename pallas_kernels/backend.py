"""Everything that depends on the Pallas GPU backend lives here.

The kernels are written against Pallas' Triton lowering (see README.md in
this folder for why and what it risks). On a machine without a GPU they run
in Pallas interpret mode, which executes the same kernel body with jnp.
"""

from __future__ import annotations

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
