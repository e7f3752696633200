"""Kernels of an optimized XLA module mapped back to the lines that traced their ops."""

import inspect

import jax
import jax.numpy as jnp

from scripts.hlo_sources import kernel_sources


def _step(x, y):
    a = jnp.exp(x) * y
    b = jnp.sort(a, axis=0)
    return jnp.sum(b, axis=0) + x[0]


def test_every_kernel_maps_to_the_lines_of_its_ops():
    text = jax.jit(_step).lower(jnp.ones((8, 4)), jnp.ones((8, 4))).compile().as_text()
    first = inspect.getsourcelines(_step)[1]
    here = lambda path: path.endswith("test_hlo_sources.py")  # noqa: E731
    src = kernel_sources(text, keep=lambda p: here(p.rsplit(":", 1)[0]))
    lines = {name: {int(s.split(" ")[0].rsplit(":", 1)[1]) for s in v} for name, v in src.items()}
    # The sort is its own kernel; exp * y fuse into one; the sum and the add into another.
    sorts = [n for n in lines if n.startswith("sort")]
    assert len(sorts) == 1 and lines[sorts[0]] == {first + 2}
    assert {first + 1} in lines.values()
    assert any(first + 3 in v for n, v in lines.items() if n not in sorts)
    # Keys are the names a trace gives the kernels: no dots.
    assert not any("." in n for n in lines)
    # Lines outside the kept files are left out.
    assert kernel_sources(text, keep=lambda p: False) == {}
