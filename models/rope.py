"""Rotary position embeddings (Hugging Face ``rotate_half`` convention)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies ``[head_dim // 2]`` (float64 on the host)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_scaling is not None:
        inv = _llama3_scale(inv, cfg.rope_scaling)
    return inv


def _llama3_scale(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    return np.where(wavelen > low_wavelen, inv / s.factor,
                    np.where(wavelen < high_wavelen, inv, mid))


def rope_tables(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``cos, sin`` of shape ``positions.shape + (head_dim // 2,)`` in float32."""
    inv = jnp.asarray(inverse_frequencies(cfg), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x [B, T, heads, D]`` with tables ``[B, T, D/2]``; computed in float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
