"""Plain-jnp attention: dense causal attention for prompts and paged decode attention.

These are the references the Pallas kernels are tested against. All math runs
in float32 whatever the storage dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[..., nq, D] -> [..., nkv, G, D]``: query heads grouped by the KV head they share."""
    *lead, nq, d = q.shape
    return q.reshape(*lead, num_kv_heads, nq // num_kv_heads, d)


def _chunk_probs(q: jax.Array, k: jax.Array, q_start: jax.Array | None,
                 lengths: jax.Array) -> jax.Array:
    """Softmax ``[B, nkv, G, T, S]`` of queries at positions ``q_start + t`` over keys at
    ``0 .. S-1``: causal, and keys past ``q_start + lengths`` masked (``q_start`` None: 0)."""
    _, T, _, D = q.shape
    qg = _group(q.astype(jnp.float32), k.shape[2])  # [B,T,KVH,G,D]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(D))
    start = jnp.zeros_like(lengths) if q_start is None else q_start
    q_pos = start[:, None] + jnp.arange(T)[None]  # [B, T]
    k_pos = jnp.arange(k.shape[1])
    mask = ((k_pos[None, None, :] <= q_pos[:, :, None])
            & (k_pos[None, None, :] < (start + lengths)[:, None, None]))
    return jax.nn.softmax(jnp.where(mask[:, None, None], s, _NEG), axis=-1)


def _attend(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p [B, nkv, G, T, S]`` applied to ``v [B, S, nkv, D]``: ``[B, T, nq, D]`` float32."""
    B, K, G, T, _ = p.shape
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(B, T, K * G, v.shape[-1])


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Causal GQA self-attention over a padded prompt chunk.

    Args:
      q: ``[B, T, nq, D]``; k, v: ``[B, T, nkv, D]``.
      lengths: ``[B]`` valid tokens per row (positions >= length are padding).
    Returns:
      ``[B, T, nq, D]`` float32 (rows of padding positions are finite garbage).
    """
    return _attend(_chunk_probs(q, k, None, lengths), v)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """:func:`causal_attention` through the fastest path the backend has.

    On the GPU with 16-bit inputs this is cuDNN's fused flash attention
    (``jax.nn.dot_product_attention``), which never materializes the ``T x T``
    scores (ten times faster than the dense reference at 4,096 tokens on an
    H200); elsewhere, or where cuDNN refuses the shapes, the reference. Rows of
    length 0 (bucket padding) attend to their first token, so their garbage
    stays finite. Returns ``[B, T, nq, D]`` float32.
    """
    if (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and k.dtype == q.dtype and v.dtype == q.dtype):
        seq = jnp.maximum(lengths, 1).astype(jnp.int32)
        try:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                               query_seq_lengths=seq, key_value_seq_lengths=seq,
                                               implementation="cudnn")
            return out.astype(jnp.float32)
        except (NotImplementedError, ValueError, RuntimeError):
            pass  # shapes or build cuDNN does not take: the reference below
    return causal_attention(q, k, v, lengths)


def _cudnn_attention_and_lse(q, k, v, seq):
    """cuDNN's fused causal attention and its float32 softmax statistics
    ``[B, nq, T]`` (natural-log log-sum-exp of each query's scaled logits), which
    its forward pass computes anyway. ``jax.nn.dot_product_attention`` exposes
    them only cast to the output's 16-bit dtype and transposed, so this calls the
    function beneath it (private API: any failure means "not available")."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    out, lse = cudnn.dot_product_attention(
        q, k, v, None, None, seq, seq, scale=1.0 / float(q.shape[-1]) ** 0.5,
        mask_type=cudnn.MaskType.PADDING_CAUSAL, return_residual=True)
    return out, lse


def prefill_attention_lse(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array):
    """:func:`prefill_attention`, plus each query's softmax log-normalizer when the
    fused kernel gives it for free.

    Returns ``(out, lse)``: ``out`` as :func:`prefill_attention`; ``lse`` the
    ``[B, nq, T]`` float32 natural-log log-sum-exp of each query's scaled causal
    logits (``log sum_j exp(q.k_j / sqrt(D))``; rows past a prompt's length
    undefined) from cuDNN on the GPU, else None. The observation-window scores
    (:func:`pallas_kernels.window_scores.window_scores`) use it to skip their
    own pass over the keys for the normalizers.
    """
    if (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and k.dtype == q.dtype and v.dtype == q.dtype):
        seq = jnp.maximum(lengths, 1).astype(jnp.int32)
        try:
            out, lse = _cudnn_attention_and_lse(q, k, v, seq)
            if lse.shape == (q.shape[0], q.shape[2], q.shape[1]):
                return out.astype(jnp.float32), lse.astype(jnp.float32)
        except (ImportError, AttributeError, TypeError, NotImplementedError, ValueError,
                RuntimeError):
            pass  # this JAX's private API differs, or cuDNN refuses: no statistics
    return prefill_attention(q, k, v, lengths), None


def prefix_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array,
                            lengths: jax.Array, block: int = 128) -> jax.Array:
    """A prompt chunk's attention over everything before it and itself (chunked prefill).

    Args:
      q: ``[B, T, nq, D]``, the chunk's queries at positions ``q_start + t``.
      k, v: ``[B, S, nkv, D]``, keys and values of positions ``0 .. S-1`` (the cached
        prefix and the chunk; positions past ``q_start + lengths`` are ignored).
      q_start, lengths: ``[B]`` the chunk's first position and its valid tokens.
      block: queries per step of :func:`blocked_prefix_attention`.
    Returns:
      ``[B, T, nq, D]`` float32; equals :func:`causal_attention` over the whole
      prompt, restricted to the chunk's rows.
    """
    return blocked_prefix_attention(q, k, v, q_start, lengths, block)[0]


def blocked_prefix_attention(q, k, v, q_start, lengths, block: int = 128, reduce=None):
    """:func:`prefix_causal_attention` a block of queries at a time, so only
    ``block x S`` probabilities per head exist at once (a chunk attends to its whole
    prefix: ``S`` grows with the context).

    ``reduce(p, start, n)``, if given, maps each block's probabilities
    ``[B, nkv, G, block, S]`` (its queries at ``start + t``, ``n`` of them valid) to an
    array; the blocks' arrays are summed. Returns ``(out, summed)`` (``summed`` None
    without ``reduce``).
    """
    B, T = q.shape[:2]
    blk = min(block, T)
    nb = -(-T // blk)
    qp = jnp.pad(q, ((0, 0), (0, nb * blk - T), (0, 0), (0, 0)))

    def one(acc, i):
        qb = jax.lax.dynamic_slice_in_dim(qp, i * blk, blk, axis=1)
        start = q_start + i * blk
        n = jnp.clip(lengths - i * blk, 0, blk)
        p = _chunk_probs(qb, k, start, n)
        acc = None if reduce is None else acc + reduce(p, start, n)
        return acc, _attend(p, v)

    init = None
    if reduce is not None:
        shape = jax.eval_shape(lambda: reduce(
            jnp.zeros((B, k.shape[2], q.shape[2] // k.shape[2], blk, k.shape[1]), jnp.float32),
            q_start, lengths))
        init = jnp.zeros(shape.shape, shape.dtype)
    summed, outs = jax.lax.scan(one, init, jnp.arange(nb))  # outs [nb, B, blk, nq, D]
    out = outs.transpose(1, 0, 2, 3, 4).reshape(B, nb * blk, *outs.shape[3:])[:, :T]
    return out, summed


def prefix_causal_probs(q: jax.Array, k: jax.Array, q_start: jax.Array,
                        lengths: jax.Array) -> jax.Array:
    """The probabilities ``[B, nkv, G, T, S]`` of :func:`prefix_causal_attention`."""
    return _chunk_probs(q, k, q_start, lengths)


def causal_attention_probs(q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """Attention probabilities ``[B, nkv, G, Tq, Tk]`` of :func:`causal_attention` (for scoring)."""
    return _chunk_probs(q, k, None, lengths)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """One query token per sequence against K/V stored in pages.

    Args:
      q: ``[B, nq, D]``.
      k_pages, v_pages: ``[P, page_size, D]`` pools; a page holds one (layer, KV head).
      page_ids: ``[B, nkv, n_pages]`` pages of each (sequence, KV head) in token order.
      lengths: ``[B]`` tokens to attend to (entries beyond are masked). Must be >= 1.
    Returns:
      ``[B, nq, D]`` float32.
    """
    B, nq, D = q.shape
    _, nkv, n_pages = page_ids.shape
    ps = k_pages.shape[1]
    k = k_pages[page_ids].reshape(B, nkv, n_pages * ps, D).astype(jnp.float32)
    v = v_pages[page_ids].reshape(B, nkv, n_pages * ps, D).astype(jnp.float32)
    qg = _group(q.astype(jnp.float32), nkv)  # [B,KVH,G,D]
    s = jnp.einsum("bkgd,bktd->bkgt", qg, k) / jnp.sqrt(jnp.float32(D))
    valid = jnp.arange(n_pages * ps)[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgt,bktd->bkgd", p, v).reshape(B, nq, D)
