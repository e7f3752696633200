"""Save / restore converted parameters with orbax, and a conversion cache on top.

Converting a GGUF or safetensors checkpoint (dequantising, transposing,
stacking layers) is slow; the converted tree is saved once with orbax so later
starts only restore it.

Layout of a checkpoint directory::

    <dir>/params/               orbax StandardCheckpointer output
    <dir>/diffkv_config.json    {"format": N, "config": {...}, "dtypes": {leaf: dtype}}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models.config import ModelConfig, RopeScaling
from models.errors import WeightsFormatError
from models.params import Params, check_params, param_shapes

# Bump when the params layout or the conversion changes, so stale caches are not used.
FORMAT_VERSION = 1
META_FILE = "diffkv_config.json"
PARAMS_SUBDIR = "params"


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able dict of a config (``RopeScaling`` nested as a dict)."""
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Inverse of :func:`config_to_dict`; unknown keys are ignored."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in d.items() if k in known}
    if kw.get("rope_scaling") is not None:
        kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    kw["eos_token_ids"] = tuple(kw.get("eos_token_ids", ()))
    return ModelConfig(**kw)


def _flat(tree: Params, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        out.update(_flat(v, p) if isinstance(v, dict) else {p: v})
    return out


def save_params(params: Params, directory: str | os.PathLike, cfg: ModelConfig) -> None:
    """Save ``params`` (orbax) and ``cfg`` (JSON) under ``directory``; blocks until written.

    ``directory`` must not already contain a checkpoint.
    """
    directory = Path(directory).expanduser().absolute()  # orbax wants absolute paths
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / PARAMS_SUBDIR, params)
        ckptr.wait_until_finished()
    meta = {
        "format": FORMAT_VERSION,
        "config": config_to_dict(cfg),
        "dtypes": {k: np.dtype(v.dtype).name for k, v in _flat(params).items()},
    }
    # Written last: its presence marks the checkpoint as complete.
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))


def restore_params(directory: str | os.PathLike, device: jax.Device | None = None
                   ) -> tuple[ModelConfig, Params]:
    """Restore ``(config, params)`` saved by :func:`save_params`.

    Arrays come back with their saved shapes and dtypes on ``device``
    (default: JAX's default device). Raises :class:`WeightsFormatError`.
    """
    directory = Path(directory).expanduser().absolute()
    meta_file = directory / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {meta.get('format')} != {FORMAT_VERSION}")
        cfg = config_from_dict(meta["config"])
        dtypes = meta["dtypes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsFormatError(f"{directory}: not a usable params checkpoint ({e})") from None

    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])

    def abstract(tree: Params, prefix: str = "") -> Params:
        out = {}
        for k, v in tree.items():
            p = f"{prefix}/{k}" if prefix else k
            if isinstance(v, dict):
                out[k] = abstract(v, p)
            else:
                if p not in dtypes:
                    raise WeightsFormatError(f"{directory}: checkpoint lacks {p}")
                out[k] = jax.ShapeDtypeStruct(tuple(v), jnp.dtype(dtypes[p]), sharding=sharding)
        return out

    target = abstract(param_shapes(cfg))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(directory / PARAMS_SUBDIR, target)
        check_params(params, cfg)
    except WeightsFormatError:
        raise
    except Exception as e:  # orbax / tensorstore raise many types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsFormatError(f"{directory}: cannot restore params ({msg})") from None
    return cfg, params


def source_key(path: str | os.PathLike, dtype) -> str:
    """Short cache key for converting ``path`` (file or directory) to ``dtype``.

    Changes when any source file's size or mtime changes, or the dtype or the
    conversion format changes.
    """
    path = Path(path).expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{path}|{jnp.dtype(dtype).name}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:48]
    return f"{stem}-{jnp.dtype(dtype).name}-{h.hexdigest()[:16]}"


def default_cache_dir() -> Path:
    """``$DIFFKV_CACHE_DIR/params`` or ``~/.cache/diffkv_jax/params``."""
    base = os.environ.get("DIFFKV_CACHE_DIR")
    return (Path(base) if base else Path("~/.cache/diffkv_jax")).expanduser() / "params"


def cached_convert(key: str, loader: Callable[[], tuple[ModelConfig, Params]],
                   cache_dir: str | os.PathLike | None = None) -> tuple[ModelConfig, Params]:
    """Return ``loader()``'s result, cached as an orbax checkpoint at ``<cache_dir>/<key>``.

    A complete entry is restored instead of calling ``loader``. New entries are
    written to a temporary sibling and renamed into place, so an interrupted
    save never looks complete. ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / key
    if (entry / META_FILE).is_file():
        try:
            return restore_params(entry)
        except WeightsFormatError as e:
            warnings.warn(f"ignoring broken params cache entry: {e}")
            shutil.rmtree(entry, ignore_errors=True)

    elif entry.exists():
        # Not written by us (we rename complete entries into place); clear it.
        shutil.rmtree(entry, ignore_errors=True)

    cfg, params = loader()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_params(params, tmp, cfg)
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process finished the same entry first; theirs is as good.
            pass
    except Exception as e:  # a cache that cannot be written must not stop the load
        warnings.warn(f"could not write params cache {entry}: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cfg, params
