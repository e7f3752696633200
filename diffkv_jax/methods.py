"""Cache methods by name: the one place that turns user options into a cache method.

Every method is one entry of :data:`METHOD_SPECS`: a builder (the cache class it
configures) and the options that define it. ``int8`` and ``k8v4`` are
configurations of :class:`DiffKVCache` that keep every token at one precision
and prune nothing; a new baseline is one more entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.diffkv_policy import DiffKVPolicy
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.unified_page import Tier
from models.config import ModelConfig

DEFAULT_METHOD = "diffkv"


def parse_tier(text: str) -> Tier:
    """``"K8V4"`` -> ``Tier(8, 4)``."""
    t = text.strip().upper()
    if not (t.startswith("K") and "V" in t):
        raise ValueError(f"tier must look like K8V4, got {text!r}")
    k, v = t[1:].split("V", 1)
    return Tier(int(k), int(v))


def _build_full(cfg: ModelConfig, *, max_seqs: int, max_context: int, dtype: Any,
                page_size: int | None, **options) -> FullCache:
    impl = options.pop("attention_impl", "reference")
    if options:
        raise ValueError(f"options {sorted(options)} do not apply to the full cache")
    return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                     max_context=max_context, page_size=page_size or 16,
                     dtype=jnp.dtype(dtype).name, attention_impl=impl)


def _build_diffkv(cfg: ModelConfig, *, max_seqs: int, max_context: int, dtype: Any,
                  page_size: int | None, **options) -> DiffKVCache:
    tiers = {k: (parse_tier(options.pop(k)) if isinstance(options.get(k), str)
                 else options.pop(k)) for k in ("high", "low") if k in options}
    impl = options.pop("attention_impl", "reference")
    policy = DiffKVPolicy(**options)
    return DiffKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                       max_context=max_context, policy=policy,
                       tokens_per_page=page_size or 32, attention_impl=impl, **tiers)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A named cache method: ``build(cfg, max_seqs=, max_context=, dtype=, page_size=,
    **options)`` with ``fixed`` options that define it (a user may not override them)."""

    build: Callable[..., Any]
    fixed: dict = dataclasses.field(default_factory=dict)
    description: str = ""


def _uniform(tier: Tier) -> dict:
    # One tier for every token, nothing pruned: with the low tier off only
    # importance < alpha_low / n is pruned, which alpha_low = 0 makes impossible.
    # The (unused) low tier is set to the high one so that page metadata is sized
    # for the high tier's slots, not for a denser tier that never holds a token.
    return dict(high=tier, low=tier, low_tier=False, alpha_low=0.0)


METHOD_SPECS: dict[str, MethodSpec] = {
    "diffkv": MethodSpec(_build_diffkv, {}, "DiffKV: K8V4 high / K4V2 low tiers, pruning"),
    "full": MethodSpec(_build_full, {}, "uncompressed paged cache (the baseline)"),
    "int8": MethodSpec(_build_diffkv, _uniform(Tier(8, 8)), "every token K8V8, none pruned"),
    "k8v4": MethodSpec(_build_diffkv, _uniform(Tier(8, 4)), "every token K8V4, none pruned"),
}
"""Cache methods by name. Options a user gives go to the builder after ``fixed``."""

METHODS = tuple(METHOD_SPECS)


def make_method(name: str, cfg: ModelConfig, *, max_seqs: int, max_context: int,
                dtype: Any = jnp.float32, page_size: int | None = None,
                **options) -> FullCache | DiffKVCache:
    """Build the cache method ``name`` for ``cfg``.

    ``full`` options: ``page_size`` (tokens per page, default 16), ``attention_impl``.
    ``diffkv`` options: ``page_size`` (high-tier tokens per page, default 32),
    ``alpha_high``, ``alpha_low``, ``window``, ``obs_window``, ``low_tier``,
    ``normalizer`` (see :class:`DiffKVPolicy`), ``high``, ``low`` (tiers such as
    "K8V4" or :class:`Tier`), ``attention_impl`` ("reference" or "pallas").
    ``int8`` / ``k8v4``: the diffkv options except the ones that define them
    (``high``, ``low``, ``low_tier``, ``alpha_low``).
    """
    spec = METHOD_SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown KV cache method {name!r}; available: {', '.join(METHODS)}")
    clash = sorted(set(options) & set(spec.fixed))
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} are fixed by method {name!r} "
                         f"({spec.description})")
    return spec.build(cfg, max_seqs=max_seqs, max_context=max_context, dtype=dtype,
                      page_size=page_size, **spec.fixed, **options)
