"""Cache methods by name: the one place that turns user options into a cache method.

Every method is one entry of :data:`METHOD_SPECS`: a builder (the cache class it
configures) and the options that define it. ``int8`` and ``k8v4`` are
configurations of :class:`DiffKVCache` that keep every token at one precision
and prune nothing; a new baseline is one more entry here. ``h2o``,
``streamingllm`` and ``snapkv`` are token-eviction baselines on the same
cache, pages and kernels (a :class:`DiffKVPolicy` ``rule``): kept tokens are
stored K8V8, evicted ones really free their slots (and pages).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.diffkv_policy import EVICTION_RULES, DiffKVPolicy
from diffkv_jax.fp8_cache import build_fp8
from diffkv_jax.kivi_cache import build_kivi
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
    merge = options.pop("merge_impl", "auto")
    early = bool(options.pop("early_row_loads", False))
    if options:
        raise ValueError(f"options {sorted(options)} do not apply to the full cache")
    return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                     max_context=max_context, page_size=page_size or 16,
                     dtype=jnp.dtype(dtype).name, attention_impl=impl, merge_impl=merge,
                     early_row_loads=early)


def _build_diffkv(cfg: ModelConfig, *, max_seqs: int, max_context: int, dtype: Any,
                  page_size: int | None, **options) -> DiffKVCache:
    if "rule" in options:
        raise ValueError("a token-eviction rule is chosen by method name: "
                         + ", ".join(EVICTION_RULES))
    return _diffkv_cache(cfg, max_seqs=max_seqs, max_context=max_context,
                         page_size=page_size, **options)


def _diffkv_cache(cfg: ModelConfig, *, max_seqs: int, max_context: int, page_size: int | None,
                  **options) -> DiffKVCache:
    tiers = {k: (parse_tier(options.pop(k)) if isinstance(options.get(k), str)
                 else options.pop(k)) for k in ("high", "low") if k in options}
    impl = options.pop("attention_impl", "reference")
    writes = options.pop("write_impl", "auto")
    decide = options.pop("decide_impl", "auto")
    merge = options.pop("merge_impl", "auto")
    tiles = options.pop("kernel_tiles", "auto")
    lanes = bool(options.pop("lane_victims", False))
    logits = options.pop("logits_dtype", "float16")
    early = bool(options.pop("early_row_loads", False))
    policy = DiffKVPolicy(**options)
    return DiffKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                       max_context=max_context, policy=policy,
                       tokens_per_page=page_size or 32, attention_impl=impl,
                       write_impl=writes, decide_impl=decide, merge_impl=merge,
                       kernel_tiles=tiles, lane_victims=lanes, logits_dtype=logits,
                       early_row_loads=early, **tiers)


#: Budget (tokens per (sequence, layer, KV head)) of the eviction baselines when neither
#: ``budget`` nor ``budget_ratio`` is given: the "512" of H2O-512 / StreamingLLM-512 in the
#: evaluation paper (docs: shared/spec/evaluation.md).
DEFAULT_EVICTION_BUDGET = 512


def _build_eviction(cfg: ModelConfig, *, max_seqs: int, max_context: int, dtype: Any,
                    page_size: int | None, **options) -> DiffKVCache:
    """A token-eviction baseline (``rule`` fixed by the registry) on the DiffKV cache.

    Options: ``budget`` or ``budget_ratio`` (default ``budget=512``), ``window``,
    ``obs_window``, and per rule ``sinks`` (streamingllm), ``pool_kernel`` /
    ``pooling`` (snapkv); ``page_size``, ``attention_impl``. The storage tier is
    fixed: every kept token K8V8 (the cache's tiers are 8/4/2-bit only).
    Defaults: h2o counts every prompt query (``obs_window=None``; H2O accumulates
    over all queries); streamingllm takes ``window`` as ``budget - sinks``, so
    ``window`` may replace the budget but not join it; snapkv's observation
    window follows ``window`` unless ``obs_window`` is given (SnapKV uses one
    window for both).
    """
    rule = options["rule"]
    bad = sorted(set(options) & {"alpha_high", "normalizer"})
    if bad:
        raise ValueError(f"option(s) {', '.join(bad)} do not apply to {rule} "
                         f"(DiffKV thresholds)")
    if rule != "streamingllm" and "sinks" in options:
        raise ValueError(f"option sinks applies to streamingllm only, not {rule}")
    if rule != "snapkv" and ({"pool_kernel", "pooling"} & set(options)):
        raise ValueError(f"options pool_kernel / pooling apply to snapkv only, not {rule}")
    has_budget = "budget" in options or "budget_ratio" in options
    if rule == "streamingllm":
        if "window" in options and has_budget:
            raise ValueError("streamingllm keeps sinks + window tokens: give window or "
                             "budget / budget_ratio, not both")
        if "window" not in options and not has_budget:
            options["budget"] = DEFAULT_EVICTION_BUDGET
    elif not has_budget:
        options["budget"] = DEFAULT_EVICTION_BUDGET
    if rule == "h2o":
        options.setdefault("obs_window", None)
    if rule == "snapkv" and "window" in options:
        options.setdefault("obs_window", options["window"])
    return _diffkv_cache(cfg, max_seqs=max_seqs, max_context=max_context,
                         page_size=page_size, **options)


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


def _eviction(rule: str) -> dict:
    # Kept tokens are stored K8V8 (the closest to 16-bit the 8/4/2-bit tiers allow);
    # one tier, pruning only by the rule's victims.
    return dict(rule=rule, **_uniform(Tier(8, 8)))


METHOD_SPECS: dict[str, MethodSpec] = {
    "diffkv": MethodSpec(_build_diffkv, {}, "DiffKV: K8V4 high / K4V2 low tiers, pruning"),
    "full": MethodSpec(_build_full, {}, "uncompressed paged cache (the baseline)"),
    "int8": MethodSpec(_build_diffkv, _uniform(Tier(8, 8)), "every token K8V8, none pruned"),
    "k8v4": MethodSpec(_build_diffkv, _uniform(Tier(8, 4)), "every token K8V4, none pruned"),
    "fp8": MethodSpec(build_fp8, {}, "every token FP8 e4m3, calibrated per-(layer, KV head) "
                      "scales for K and V, none pruned"),
    "h2o": MethodSpec(_build_eviction, _eviction("h2o"),
                      "h2o (K8V8 storage): heavy hitters by accumulated attention + recent "
                      "window, fixed token budget"),
    "streamingllm": MethodSpec(_build_eviction, _eviction("streamingllm"),
                               "streamingllm (K8V8 storage): attention sinks + recent window"),
    "snapkv": MethodSpec(_build_eviction, _eviction("snapkv"),
                         "snapkv (K8V8 storage): prompt tokens by pooled observation-window "
                         "votes + window, no eviction at decode"),
    "kivi4": MethodSpec(build_kivi, dict(bits=4), "KIVI: 4-bit keys per channel, values "
                        "per token, the newest tokens unquantized until a group fills"),
    "kivi2": MethodSpec(build_kivi, dict(bits=2), "KIVI: 2-bit keys per channel, values "
                        "per token, the newest tokens unquantized until a group fills"),
}
"""Cache methods by name. Options a user gives go to the builder after ``fixed``."""

METHODS = tuple(METHOD_SPECS)


def make_method(name: str, cfg: ModelConfig, *, max_seqs: int, max_context: int,
                dtype: Any = jnp.float32, page_size: int | None = None,
                **options) -> FullCache | DiffKVCache:
    """Build the cache method ``name`` for ``cfg``.

    ``full`` options: ``page_size`` (tokens per page, default 16), ``attention_impl``,
    ``merge_impl`` ("auto", "xla", "pallas" or "launch": the kernel path's work items
    merged by XLA segment reductions, by one launch, or inside the attention launch
    itself; "auto" is "pallas" where the kernels run compiled on a GPU),
    ``early_row_loads`` (as diffkv's).
    ``diffkv`` options: ``page_size`` (high-tier tokens per page, default 32),
    ``alpha_high``, ``alpha_low``, ``window``, ``obs_window``, ``low_tier``,
    ``normalizer``, ``high_frac`` / ``low_frac`` (a fixed tier mix; see
    :class:`DiffKVPolicy`), ``high``, ``low`` (tiers such as
    "K8V4" or :class:`Tier`), ``attention_impl`` ("reference" or "pallas"),
    ``write_impl`` ("auto", "xla" or "pallas": how decode writes its tokens; "auto"
    is the kernel on the GPU kernel path), ``decide_impl`` ("auto", "xla" or "pallas":
    the decode decision as XLA ops or inside the token-writes launch; "auto" is the
    launch where the fused writes run compiled on a GPU), ``merge_impl`` ("auto", "xla",
    "pallas" or "launch": the merge of the attention kernel's partials as XLA segment
    reductions, inside the policy kernel's launch, or inside the attention launch
    itself (the policy launch then folds one partial per row); "auto" is "pallas"
    where the kernels run compiled on a GPU), ``kernel_tiles`` ("auto", "queries" or "tokens": the decode
    kernel's dot tiles with the query rows or a page's tokens as their rows; "auto" is
    "tokens" where the kernels run compiled on a GPU), ``lane_victims`` (the policy
    launch's victim search reduced once after its walk instead of in every step),
    ``logits_dtype`` ("float16" or "float32": the decode kernel's logits for the
    policy as stored), ``early_row_loads`` (the decode launch's token counts and first
    page-table entries loaded before its first loop; the same results).
    ``int8`` / ``k8v4``: the diffkv options except the ones that define them
    (``high``, ``low``, ``low_tier``, ``alpha_low``).
    ``h2o`` / ``streamingllm`` / ``snapkv`` (token eviction, every kept token K8V8):
    ``budget`` (tokens per (sequence, layer, KV head), window and sinks included) or
    ``budget_ratio`` (of each prompt), default ``budget=512``; ``window``,
    ``obs_window``; ``sinks`` (streamingllm, default 4); ``pool_kernel`` (default 7)
    and ``pooling`` ("max" or "avg", snapkv); ``page_size``, ``attention_impl``.
    See :func:`_build_eviction` and :mod:`diffkv_jax.diffkv_policy`.
    ``kivi4`` / ``kivi2`` (KIVI, every token kept): ``page_size`` (the group size, default
    32), ``attention_impl`` ("reference" only); see :mod:`diffkv_jax.kivi_cache`.
    ``fp8``: ``k_scale`` and ``v_scale`` (required; from
    :func:`diffkv_jax.fp8_cache.calibrate_fp8_scales`), ``page_size``.
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
