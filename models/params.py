"""The parameter pytree of :class:`models.llama.LlamaForCausalLM`.

Every loader (safetensors, GGUF, orbax, random init) produces exactly this tree
(the Flax ``params`` collection). Layer weights are stacked along a leading
``num_layers`` axis because the decoder runs its layers with ``nn.scan``.
Dense kernels are stored ``[in, out]`` (Hugging Face ``Linear`` weights are
``[out, in]`` and are transposed on load). Q/K columns follow the Hugging Face
head layout (RoPE rotates the two halves of each head).

::

    embed/embedding                    [V, H]
    layers/attn_norm/scale             [L, H]
    layers/attn/q_proj/kernel          [L, H, nq*D]   (+ bias [L, nq*D] if qkv_bias)
    layers/attn/k_proj/kernel          [L, H, nkv*D]  (+ bias [L, nkv*D])
    layers/attn/v_proj/kernel          [L, H, nkv*D]  (+ bias [L, nkv*D])
    layers/attn/o_proj/kernel          [L, nq*D, H]
    layers/mlp_norm/scale              [L, H]
    layers/mlp/gate_proj/kernel        [L, H, I]
    layers/mlp/up_proj/kernel          [L, H, I]
    layers/mlp/down_proj/kernel        [L, I, H]
    final_norm/scale                   [H]
    lm_head/kernel                     [H, V]         (absent if tie_word_embeddings)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from models.config import ModelConfig

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> Params:
    """Nested dict of the shapes every parameter must have for ``cfg``."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def proj(out_dim):
        p = {"kernel": (L, H, out_dim)}
        if cfg.qkv_bias:
            p["bias"] = (L, out_dim)
        return p

    tree: Params = {
        "embed": {"embedding": (V, H)},
        "layers": {
            "attn_norm": {"scale": (L, H)},
            "attn": {
                "q_proj": proj(qd),
                "k_proj": proj(kvd),
                "v_proj": proj(kvd),
                "o_proj": {"kernel": (L, qd, H)},
            },
            "mlp_norm": {"scale": (L, H)},
            "mlp": {
                "gate_proj": {"kernel": (L, H, I)},
                "up_proj": {"kernel": (L, H, I)},
                "down_proj": {"kernel": (L, I, H)},
            },
        },
        "final_norm": {"scale": (H,)},
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": (H, V)}
    return tree


def _flatten(tree: Params, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flatten(v, path))
        else:
            out[path] = v
    return out


def check_params(params: Params, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming every missing, extra or mis-shaped parameter."""
    want = _flatten(param_shapes(cfg))
    have = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
    problems = [f"missing {k} {s}" for k, s in want.items() if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    problems += [f"{k}: shape {have[k]} != expected {s}"
                 for k, s in want.items() if k in have and have[k] != tuple(s)]
    if problems:
        raise ValueError(f"parameters do not match {cfg.name}: " + "; ".join(problems))


def param_bytes(params: Params) -> int:
    """Total bytes of all parameter arrays."""
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(params))
