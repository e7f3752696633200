"""The jitted device steps: prefill and decode over a cache method.

``prefill(params, state, batch) -> (state, logits)`` and
``decode(params, state, batch) -> (state, logits)`` are pure functions of
their inputs with the cache state donated, so XLA updates the page pool in
place. Shapes are bucketed by the caller; a bucket compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from diffkv_jax import attention as attn_ref
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.sampling import SamplingArrays, sample
from models.config import ModelConfig
from models.llama import LlamaForCausalLM


def _model(cfg: ModelConfig, attention_fn, dtype, unroll_layers=None) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, attention_fn=attention_fn, dtype=dtype, param_dtype=dtype,
                            unroll_layers=unroll_layers)


def prefill(method, cfg: ModelConfig, dtype, params, state, batch: PrefillBatch):
    """Run the prompts, fill their pages; return next-token logits ``[B, V]``."""
    state, ctx = method.begin_prefill(state, batch)
    B, T = batch.tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    if batch.start is not None:  # a chunk continues its prompt
        positions = positions + batch.start[:, None]
    # Rolled: a prefill step is long enough that the per-layer loop condition the
    # GPU reads back costs nothing, and each prompt bucket compiles one layer
    # instead of all of them (decode, where it matters, is unrolled).
    model = _model(cfg, method.prefill_attention, dtype, unroll_layers=False)
    hidden, state = model.apply({"params": params}, batch.tokens, positions, state, ctx)
    last = jnp.take_along_axis(hidden, jnp.maximum(batch.lengths - 1, 0)[:, None, None],
                               axis=1)[:, 0]
    logits = model.apply({"params": params}, last, method=LlamaForCausalLM.logits)
    return method.end_prefill(state, ctx), logits


def decode(method, cfg: ModelConfig, dtype, params, state, batch: DecodeBatch):
    """One token for every active slot; return logits ``[S, V]``."""
    state, ctx = method.begin_decode(state, batch)
    positions = method.decode_positions(state)[:, None]
    model = _model(cfg, method.decode_attention, dtype)
    hidden, state = model.apply({"params": params}, batch.tokens[:, None], positions, state, ctx)
    logits = model.apply({"params": params}, hidden[:, 0], method=LlamaForCausalLM.logits)
    return method.end_decode(state, batch), logits


#: Decode steps ahead that :func:`pool_counts` bounds the page growth of.
GROWTH_STEPS = 4


def pool_counts(method, state) -> jax.Array:
    """``[2 + GROWTH_STEPS]`` int32: the free pages, then for ``m = 1 ..
    GROWTH_STEPS`` the most pages the next ``m`` decode steps can allocate
    (``method.growth_bound``; -1 where the method gives no bound), then 1 if an
    allocation has found the pool too short since the flag was last cleared
    (``state.alloc_failed``), else 0. The engine reserves the growth bound instead
    of a worst case per running row, and recovers when the flag is set."""
    bound = getattr(method, "growth_bound", None)
    growth = (bound(state, GROWTH_STEPS) if bound is not None
              else jnp.full((GROWTH_STEPS,), -1, jnp.int32))
    failed = getattr(state, "alloc_failed", jnp.zeros((), bool))
    return jnp.concatenate([state.free.num_free.reshape(1), growth,
                            failed.reshape(1)]).astype(jnp.int32)


def decode_and_sample(method, cfg, dtype, params, state, batch: DecodeBatch,
                      sampling: SamplingArrays):
    """:func:`decode` fused with sampling.

    Returns ``(state, tokens [S], counts)``, ``counts`` as :func:`pool_counts`
    (``counts[0]``: the free pages): they travel with the sampled tokens, so the
    host learns them (for admission) from the transfer it makes anyway, without
    an extra synchronization.
    """
    state, logits = decode(method, cfg, dtype, params, state, batch)
    return state, sample(logits, sampling), pool_counts(method, state)


def forward_no_cache(cfg: ModelConfig, params, tokens: jax.Array, lengths: jax.Array,
                     dtype=jnp.float32) -> jax.Array:
    """Full-sequence forward with no cache at all: logits ``[B, T, V]`` (a reference)."""
    B, T = tokens.shape

    def attend(state, layer, q, k, v, ctx):
        return state, attn_ref.causal_attention(q, k, v, ctx)

    model = _model(cfg, attend, dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    hidden, _ = model.apply({"params": params}, tokens, positions, None, lengths)
    return model.apply({"params": params}, hidden, method=LlamaForCausalLM.logits)


@dataclasses.dataclass
class CompiledSteps:
    """Jitted steps for one (model, cache method, dtype). State arguments are donated."""

    cfg: ModelConfig
    method: Any
    dtype: Any

    def __post_init__(self):
        m, c, d = self.method, self.cfg, self.dtype
        self.prefill = jax.jit(lambda p, s, b: prefill(m, c, d, p, s, b), donate_argnums=(1,))
        self.decode = jax.jit(lambda p, s, b: decode(m, c, d, p, s, b), donate_argnums=(1,))
        self.decode_and_sample = jax.jit(
            lambda p, s, b, smp: decode_and_sample(m, c, d, p, s, b, smp), donate_argnums=(1,))
        self.release = jax.jit(m.release, donate_argnums=(0,))
