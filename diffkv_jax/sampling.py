"""Token sampling on the device: greedy, temperature, top-k and top-p, per row.

Each row carries its own parameters and its own random stream
(``fold_in(PRNGKey(seed), step)``), so a request samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters as device arrays ``[B]``.

    ``temperature <= 0`` means greedy; ``top_k <= 0`` disables top-k;
    ``top_p >= 1`` disables top-p. ``greedy_only`` (static, part of the
    compiled step's signature) promises that every row is greedy, so the step
    compiles without the vocabulary sort. It is static rather than a run-time
    branch because an XLA conditional on the GPU reads its predicate back to the
    host, which stalls the host until the whole forward pass has run and so
    keeps the next step from being queued behind this one.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    step: jax.Array
    greedy_only: bool = struct.field(pytree_node=False, default=False)


def _filtered_logits(logits: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    V = logits.shape[-1]
    sorted_l = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_l, (k - 1)[:, None], axis=-1)
    rank_ok = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(rank_ok, sorted_l, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = rank_ok & (mass_before < top_p[:, None])
    n_keep = jnp.maximum(keep.sum(-1), 1)
    pth = jnp.take_along_axis(sorted_l, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Sample one token per row of ``logits [B, V]`` (float32). Returns ``[B]`` int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    if params.greedy_only:
        return greedy
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = _filtered_logits(logits / temp[:, None], params.top_p, params.top_k)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(
        params.seed.astype(jnp.uint32), params.step)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
