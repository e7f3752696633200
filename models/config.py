"""Model configurations for the Llama family (Llama 3 / 3.1, Qwen2 / 2.5, Mistral).

A :class:`ModelConfig` is static (hashable) so it can be part of a jit cache key.
Named presets carry the real published configurations; a Hugging Face
``config.json`` can be turned into a config with :func:`config_from_hf_dict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama-family decoder.

    Q/K projection weights follow the Hugging Face convention (RoPE rotates the
    two halves of each head, ``rotate_half``); loaders convert other layouts.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Where the weights usually come from (used only to search local caches).
    hf_repo: str | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.num_heads // self.num_kv_heads

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


_LLAMA31_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,), hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct"),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009), hf_repo="meta-llama/Meta-Llama-3-8B-Instruct"),
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING, rms_norm_eps=1e-5, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        hf_repo="meta-llama/Llama-3.1-8B-Instruct"),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001, 128009), hf_repo="meta-llama/Meta-Llama-3-70B-Instruct"),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_ids=(151645, 151643), hf_repo="Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-32b": ModelConfig(
        name="qwen2.5-32b", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
        num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_ids=(151645, 151643), hf_repo="Qwen/Qwen2.5-32B-Instruct"),
    "qwq-32b": ModelConfig(
        name="qwq-32b", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
        num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-5, qkv_bias=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645, 151643), hf_repo="Qwen/QwQ-32B"),
    "r1-distill-llama-8b": ModelConfig(
        name="r1-distill-llama-8b", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING, rms_norm_eps=1e-5,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,),
        hf_repo="deepseek-ai/DeepSeek-R1-Distill-Llama-8B"),
    "r1-distill-qwen-14b": ModelConfig(
        name="r1-distill-qwen-14b", vocab_size=152064, hidden_size=5120,
        intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-5, qkv_bias=True,
        max_position_embeddings=131072, bos_token_id=151646, eos_token_ids=(151643,),
        hf_repo="deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"),
}

DEFAULT_MODEL = "smollm2-135m"


class UnknownModelError(ValueError):
    """Raised for a model name that is neither a preset nor a path."""


def get_preset(name: str) -> ModelConfig:
    """Return the preset called ``name`` or raise :class:`UnknownModelError`."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownModelError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))} "
            "(or pass a path to a safetensors directory or a .gguf file)") from None


def config_from_hf_dict(cfg: Mapping[str, Any], name: str = "custom") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face ``config.json`` mapping."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported model_type {model_type!r} (llama, qwen2, mistral)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    scaling = None
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                  float(rs["high_freq_factor"]),
                                  int(rs["original_max_position_embeddings"]))
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(
        name=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
