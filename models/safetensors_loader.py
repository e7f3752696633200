"""Load Hugging Face safetensors checkpoints (Llama / Qwen2 / Mistral) into the params tree.

Also finds checkpoints in the local Hugging Face hub cache. Nothing here ever
downloads weights: a preset whose snapshot is not on disk is an error that says
where we looked and how to provide the weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from models.config import ModelConfig, config_from_hf_dict
from models.errors import WeightsFormatError, WeightsNotFoundError
from models.params import Params, check_params

INDEX_FILE = "model.safetensors.index.json"

# Fields that decide the parameter shapes; a preset and a config.json that
# disagree on any of these describe different models.
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias")
# Numerics the weights were trained with; the checkpoint's values win over a preset's.
NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "rms_norm_eps")

# safetensors dtype codes -> numpy dtypes, for the raw-bytes fallback.
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}

# Tensors that HF checkpoints sometimes carry but the model recomputes.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# HF per-layer tensor -> (params path under "layers", is a Linear weight to transpose).
_LAYER_TENSORS: dict[str, tuple[tuple[str, ...], bool]] = {
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "self_attn.q_proj.weight": (("attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("attn", "o_proj", "kernel"), True),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
}
_BIAS_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attn.q_proj.bias": ("attn", "q_proj", "bias"),
    "self_attn.k_proj.bias": ("attn", "k_proj", "bias"),
    "self_attn.v_proj.bias": ("attn", "v_proj", "bias"),
}


# --------------------------------------------------------------------------- reading


class _Shard:
    """One open safetensors file.

    Tensors are read with ``safe_open(framework="numpy")``; when the installed
    safetensors cannot represent a dtype in numpy (bf16 in old releases), the
    bytes are read straight from the file using the header's offsets.
    """

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        self.path = path
        try:
            self._f = stack.enter_context(safe_open(str(path), framework="numpy"))
            self.keys = set(self._f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise WeightsFormatError(f"{path}: not a readable safetensors file ({e})") from None
        self._header: dict[str, Any] | None = None

    def get(self, name: str) -> np.ndarray:
        try:
            return self._f.get_tensor(name)
        except (TypeError, ValueError):
            return self._get_raw(name)

    def _get_raw(self, name: str) -> np.ndarray:
        with open(self.path, "rb") as fh:
            if self._header is None:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._header = json.loads(fh.read(n))
                self._data_start = 8 + n
            info = self._header[name]
            dt = _ST_DTYPES.get(info["dtype"])
            if dt is None:
                raise WeightsFormatError(
                    f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            fh.seek(self._data_start + start)
            buf = fh.read(end - start)
        return np.frombuffer(buf, dtype=dt).reshape(info["shape"])


def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightsFormatError(f"{index}: unreadable index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsFormatError(
                f"{path}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsFormatError(f"{path}: no *.safetensors files in the directory")
    return files


def read_hf_config(path: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """Parse ``<path>/config.json`` into a :class:`ModelConfig` (name defaults to the dir name)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise WeightsFormatError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return config_from_hf_dict(json.loads(cfg_file.read_text()), name=name or dir_label(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsFormatError(f"{cfg_file}: cannot use this config ({e})") from None


def dir_label(path: Path) -> str:
    """A readable model name for a directory; hub snapshots are named after their repo."""
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return path.name


def arch_mismatches(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Architecture fields on which two configs disagree, as ``field: a != b`` strings."""
    return [f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}"
            for f in ARCH_FIELDS if getattr(a, f) != getattr(b, f)]


# --------------------------------------------------------------------------- loading


def load_safetensors_dir(path: str | os.PathLike, cfg: ModelConfig | None = None,
                         dtype=jnp.bfloat16, name: str | None = None
                         ) -> tuple[ModelConfig, Params]:
    """Load a Hugging Face model directory (``config.json`` + ``*.safetensors``).

    If ``cfg`` is given (e.g. a preset) its architecture must match the
    directory's ``config.json``; the returned config keeps ``cfg``'s name and
    token ids but takes RoPE / norm numerics from the checkpoint. Returns
    ``(config, params)`` with every leaf a ``dtype`` array on the default device.
    Raises :class:`WeightsFormatError` for anything missing or mis-shaped.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise WeightsFormatError(f"{path}: not a directory")
    file_cfg = read_hf_config(path, name=name)
    if cfg is None:
        cfg = file_cfg
    else:
        bad = arch_mismatches(cfg, file_cfg)
        if bad:
            raise WeightsFormatError(
                f"{path}: config.json does not match {cfg.name} ({'; '.join(bad)})")
        cfg = cfg.replace(**{f: getattr(file_cfg, f) for f in NUMERIC_FIELDS})
        if name:
            cfg = cfg.replace(name=name)
    np_dtype = np.dtype(jnp.dtype(dtype))

    with contextlib.ExitStack() as stack:
        shards = [_Shard(f, stack) for f in _shard_files(path)]
        where = {k: s for s in shards for k in s.keys}
        params = _build_params(cfg, path, where, np_dtype)
        consumed = _consumed(cfg)
        unused = [k for k in where if k not in consumed and not _IGNORED.search(k)]
        if unused:
            more = f" (+{len(unused) - 3} more)" if len(unused) > 3 else ""
            raise WeightsFormatError(
                f"{path}: unexpected tensors not supported by {cfg.name}: "
                f"{', '.join(sorted(unused)[:3])}{more}")

    try:
        check_params(params, cfg)
    except ValueError as e:
        raise WeightsFormatError(f"{path}: {e}") from None
    return cfg, params


def _consumed(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    per_layer = list(_LAYER_TENSORS) + (list(_BIAS_TENSORS) if cfg.qkv_bias else [])
    names.update(f"model.layers.{i}.{t}" for i in range(cfg.num_layers) for t in per_layer)
    return names


def _build_params(cfg: ModelConfig, path: Path, where: dict[str, _Shard],
                  np_dtype: np.dtype) -> Params:
    def read(hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
        shard = where.get(hf_name)
        if shard is None:
            raise WeightsFormatError(f"{path}: missing tensor {hf_name}")
        t = shard.get(hf_name)
        if tuple(t.shape) != shape:
            raise WeightsFormatError(
                f"{path}: tensor {hf_name} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def to_device(a: np.ndarray) -> jax.Array:
        return jax.device_put(a)

    H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hf_shapes = {  # HF Linear weights are [out, in]
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (qd, H), "self_attn.k_proj.weight": (kvd, H),
        "self_attn.v_proj.weight": (kvd, H), "self_attn.o_proj.weight": (H, qd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
        "self_attn.q_proj.bias": (qd,), "self_attn.k_proj.bias": (kvd,),
        "self_attn.v_proj.bias": (kvd,),
    }

    layers: Params = {}
    entries = [(t, p, tr) for t, (p, tr) in _LAYER_TENSORS.items()]
    if cfg.qkv_bias:
        entries += [(t, p, False) for t, p in _BIAS_TENSORS.items()]
    for tensor, ppath, transpose in entries:
        shape = hf_shapes[tensor]
        # One stacked host buffer at a time, filled layer by layer, keeps peak
        # host memory near one copy of the weights plus one stacked tensor.
        out = np.empty((L,) + (shape[::-1] if transpose else shape), dtype=np_dtype)
        for i in range(L):
            t = read(f"model.layers.{i}.{tensor}", shape)
            out[i] = t.T if transpose else t
            del t
        node = layers
        for k in ppath[:-1]:
            node = node.setdefault(k, {})
        node[ppath[-1]] = to_device(out)
        del out

    params: Params = {
        "embed": {"embedding": to_device(
            read("model.embed_tokens.weight", (V, H)).astype(np_dtype, copy=False))},
        "layers": layers,
        "final_norm": {"scale": to_device(
            read("model.norm.weight", (H,)).astype(np_dtype, copy=False))},
    }
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in where:
            raise WeightsFormatError(
                f"{path}: missing tensor lm_head.weight (config has tie_word_embeddings=false)")
        head = np.empty((H, V), dtype=np_dtype)
        head[...] = read("lm_head.weight", (V, H)).T
        params["lm_head"] = {"kernel": to_device(head)}
    return params


# --------------------------------------------------------------------------- hub cache


def hf_cache_roots() -> list[Path]:
    """Hugging Face hub cache directories to search, in priority order, deduplicated.

    ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``.
    """
    roots: list[Path] = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path("~/.cache/huggingface/hub"))
    out: list[Path] = []
    for r in roots:
        r = r.expanduser()
        if r not in out:
            out.append(r)
    return out


def _is_complete_snapshot(d: Path) -> bool:
    # is_file() follows the hub's blob symlinks, so half-downloaded snapshots
    # with dangling links are skipped.
    return (d / "config.json").is_file() and any(p.is_file() for p in d.glob("*.safetensors"))


def pick_snapshot(repo_dir: Path) -> Path | None:
    """The usable snapshot of a hub repo dir: the one ``refs/main`` names, else the newest."""
    snaps = repo_dir / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        d = snaps / ref.read_text().strip()
        if _is_complete_snapshot(d):
            return d
    candidates = [d for d in snaps.iterdir() if d.is_dir() and _is_complete_snapshot(d)]
    if not candidates:
        return None
    return max(candidates, key=lambda d: d.stat().st_mtime)


def find_hf_snapshot(cfg: ModelConfig, extra_roots: Iterable[str | os.PathLike] = ()) -> Path:
    """Find a local snapshot of ``cfg.hf_repo`` in the hub cache (never downloads).

    Looks in ``extra_roots`` then :func:`hf_cache_roots` for
    ``models--ORG--NAME/snapshots/<rev>/`` with ``config.json`` and safetensors.
    Raises :class:`WeightsNotFoundError` with a one-line explanation otherwise.
    """
    roots = [Path(r).expanduser() for r in extra_roots] + hf_cache_roots()
    if not cfg.hf_repo:
        raise WeightsNotFoundError(
            f"preset {cfg.name!r} has no Hugging Face repo to look for; pass "
            "--model-path /path/to/hf_dir (weights are never downloaded)")
    repo_dir_name = "models--" + cfg.hf_repo.replace("/", "--")
    searched = []
    for root in roots:
        repo_dir = root / repo_dir_name
        searched.append(str(repo_dir / "snapshots"))
        snap = pick_snapshot(repo_dir)
        if snap is not None:
            return snap
    raise WeightsNotFoundError(
        f"no local weights for preset {cfg.name!r} ({cfg.hf_repo}); searched "
        f"{', '.join(searched)} for a snapshot with config.json and *.safetensors; "
        f"pass --model-path /path/to/hf_dir, or put the Hugging Face snapshot in the hub "
        f"cache (e.g. run `huggingface-cli download {cfg.hf_repo}` where there is network "
        f"access, or set HF_HUB_CACHE); weights are never downloaded")
