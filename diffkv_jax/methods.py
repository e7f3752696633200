"""Cache methods by name: the one place that turns user options into a cache method."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.diffkv_policy import DiffKVPolicy
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.unified_page import Tier
from models.config import ModelConfig

METHODS = ("diffkv", "full")
DEFAULT_METHOD = "diffkv"


def parse_tier(text: str) -> Tier:
    """``"K8V4"`` -> ``Tier(8, 4)``."""
    t = text.strip().upper()
    if not (t.startswith("K") and "V" in t):
        raise ValueError(f"tier must look like K8V4, got {text!r}")
    k, v = t[1:].split("V", 1)
    return Tier(int(k), int(v))


def make_method(name: str, cfg: ModelConfig, *, max_seqs: int, max_context: int,
                dtype: Any = jnp.float32, page_size: int | None = None,
                **options) -> FullCache | DiffKVCache:
    """Build the cache method ``name`` for ``cfg``.

    ``full`` options: ``page_size`` (tokens per page, default 16).
    ``diffkv`` options: ``page_size`` (high-tier tokens per page, default 32),
    ``alpha_high``, ``alpha_low``, ``window``, ``obs_window``, ``low_tier``,
    ``normalizer`` (see :class:`DiffKVPolicy`), ``high``, ``low`` (tiers such as
    "K8V4" or :class:`Tier`), ``attention_impl`` ("reference" or "pallas").
    """
    if name == "full":
        if options:
            raise ValueError(f"options {sorted(options)} do not apply to --kv full")
        return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                         max_context=max_context, page_size=page_size or 16,
                         dtype=jnp.dtype(dtype).name)
    if name == "diffkv":
        tiers = {k: (parse_tier(options.pop(k)) if isinstance(options.get(k), str)
                     else options.pop(k)) for k in ("high", "low") if k in options}
        impl = options.pop("attention_impl", "reference")
        policy = DiffKVPolicy(**options)
        return DiffKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                           max_context=max_context, policy=policy,
                           tokens_per_page=page_size or 32, attention_impl=impl, **tiers)
    raise ValueError(f"unknown KV cache method {name!r}; available: {', '.join(METHODS)}")
