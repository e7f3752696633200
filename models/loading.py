"""Resolve a model name or path to ``(config, params, tokenizer)``.

Sources, in order: an explicit ``model_path`` (safetensors directory or .gguf
file); ``model`` itself when it is such a path; otherwise ``model`` is a preset
whose weights are the embedded SmolLM2 GGUF (``smollm2-135m``) or a snapshot in
the local Hugging Face hub cache. Weights are never downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.checkpoint import cached_convert, source_key
from models.config import DEFAULT_MODEL, PRESETS, ModelConfig, get_preset
from models.errors import WeightsFormatError, WeightsNotFoundError
from models.params import Params, check_params, param_shapes
from models.safetensors_loader import (
    arch_mismatches, find_hf_snapshot, load_safetensors_dir, pick_snapshot, read_hf_config)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A ready-to-run model: its config, parameter tree and tokenizer."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any


@dataclasses.dataclass(frozen=True)
class _Source:
    kind: str  # "gguf" or "hf"
    path: Path
    preset: ModelConfig | None  # config to label the weights with, if known
    embedded: bool = False


def _as_path_source(p: str | os.PathLike, preset: ModelConfig | None) -> _Source:
    path = Path(p).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise WeightsFormatError(
                f"{path}: unsupported weights file (expected a .gguf file or a directory "
                "with config.json and *.safetensors)")
        return _Source("gguf", path, preset)
    if path.is_dir():
        if not (path / "config.json").exists() and (path / "snapshots").is_dir():
            # A hub repo folder (models--ORG--NAME) rather than one of its snapshots.
            snap = pick_snapshot(path)
            if snap is None:
                raise WeightsNotFoundError(f"{path}: no complete snapshot under snapshots/")
            path = snap
        return _Source("hf", path, preset)
    raise WeightsNotFoundError(f"model path {path} does not exist")


def _looks_like_path(s: str) -> bool:
    return s.lower().endswith(".gguf") or s.startswith(("/", "./", "../", "~"))


def _resolve(model: str, model_path: str | os.PathLike | None) -> _Source:
    preset = PRESETS.get(model.lower()) if model else None
    if model_path is not None:
        # The default name was probably not chosen by the user, so it only
        # labels the weights when it matches them (checked later).
        return _as_path_source(model_path, preset)
    if Path(model).expanduser().exists():
        return _as_path_source(model, None)
    if preset is None:
        by_repo = {p.hf_repo.lower(): p for p in PRESETS.values() if p.hf_repo}
        preset = by_repo.get(model.lower())
    if preset is None:
        if _looks_like_path(model):
            raise WeightsNotFoundError(f"model path {model} does not exist")
        get_preset(model)  # raises UnknownModelError listing the presets
    if preset.name == DEFAULT_MODEL:
        from models.gguf_loader import embedded_gguf_path
        return _Source("gguf", Path(embedded_gguf_path()), preset, embedded=True)
    return _Source("hf", find_hf_snapshot(preset), preset)


def _default_dtype(src: _Source):
    if jax.default_backend() == "cpu" or src.embedded:
        return jnp.float32
    return jnp.bfloat16


_Loader = Callable[[], tuple[ModelConfig, Params]]


def _hf_loader(src: _Source, model: str, dtype) -> tuple[_Loader, str]:
    """The loader and a label for the config it will produce (part of the cache key)."""
    cfg = None
    if src.preset is not None:
        bad = arch_mismatches(src.preset, read_hf_config(src.path))
        if not bad:
            cfg = src.preset
        elif model.lower() != DEFAULT_MODEL:
            raise WeightsFormatError(
                f"{src.path}: weights do not match preset {src.preset.name} ({'; '.join(bad)})")
    label = cfg.name if cfg is not None else "auto"
    return (lambda: load_safetensors_dir(src.path, cfg=cfg, dtype=dtype)), label


def _gguf_loader(src: _Source, dtype) -> tuple[_Loader, str]:
    from models.gguf_loader import load_gguf
    # Explicit GGUF files are matched to presets by the GGUF loader itself.
    name = src.preset.name if src.embedded else None
    return (lambda: load_gguf(src.path, dtype, name=name)), name or "auto"


def load_model(model: str = DEFAULT_MODEL, model_path: str | os.PathLike | None = None,
               dtype=None, use_cache: bool = True,
               cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load a model by preset name or path; see the module docstring for resolution.

    ``dtype`` defaults to float32 on CPU and for the embedded SmolLM2 GGUF, else
    bfloat16. With ``use_cache`` the converted params are kept as an orbax
    checkpoint under ``cache_dir`` (see :func:`models.checkpoint.cached_convert`)
    so the next start skips the conversion.

    Raises :class:`~models.config.UnknownModelError` for an unknown name and
    :class:`~models.errors.ModelLoadError` subclasses for missing or bad weights.
    """
    src = _resolve(model, model_path)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(_default_dtype(src))
    loader, label = (_gguf_loader(src, dtype) if src.kind == "gguf"
                     else _hf_loader(src, model, dtype))

    def load_on_device():
        cfg, params = loader()
        return cfg, jax.device_put(params)

    if use_cache:
        key = f"{source_key(src.path, dtype)}-{label}"
        cfg, params = cached_convert(key, load_on_device, cache_dir=cache_dir)
    else:
        cfg, params = load_on_device()

    from models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(src.path) if src.kind == "gguf" else Tokenizer.from_hf_dir(src.path)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tok)


def _flat_shapes(tree: Params, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], tuple]]:
    out = []
    for k in sorted(tree):
        v = tree[k]
        out += _flat_shapes(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]
    return out


def random_params(cfg: ModelConfig, key, dtype=jnp.bfloat16,
                  shardings: Params | None = None) -> Params:
    """Random weights with ``cfg``'s real shapes: normal * 0.02, norm scales = 1.

    Each leaf is generated by its own jitted call directly on the device (or
    with the matching leaf of ``shardings``, a tree like the params), so even
    large models never pass through host memory. ``key`` is a PRNG key or an int.
    """
    if isinstance(key, int):
        key = jax.random.key(key)
    dtype = jnp.dtype(dtype)
    params: Params = {}
    for i, (path, shape) in enumerate(_flat_shapes(param_shapes(cfg))):
        sharding = None
        if shardings is not None:
            sharding = shardings
            for k in path:
                sharding = sharding[k]
        ones = path[-1] == "scale"
        leaf = _init_leaf(shape, dtype, ones, sharding)(jax.random.fold_in(key, i))
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    check_params(params, cfg)
    return params


@functools.lru_cache(maxsize=None)
def _init_leaf(shape: tuple, dtype, ones: bool, sharding):
    def init(k):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(k, shape, dtype) * jnp.asarray(0.02, dtype)).astype(dtype)
    return jax.jit(init, out_shardings=sharding)
