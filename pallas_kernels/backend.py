"""Everything that depends on the Pallas GPU backend lives here.

The kernels are written against Pallas' Triton lowering (see README.md in
this folder for why and what it risks). On a machine without a GPU they run
in Pallas interpret mode, which executes the same kernel body with jnp.
"""

from __future__ import annotations

import warnings

import jax

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as _triton


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def default_interpret() -> bool:
    """Interpret mode unless a GPU is present."""
    return not on_gpu()


def compiler_params(num_warps: int, num_stages: int):
    """Launch parameters for the Triton lowering."""
    return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, trans_b: bool = False):
    """Matrix product inside a kernel, float32 accumulation."""
    return _triton.dot(a, b, trans_b=trans_b)
