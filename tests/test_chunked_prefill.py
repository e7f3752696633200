"""Chunked prefill: a prompt prefilled in pieces leaves the same cache and logits as
one whole-prompt prefill (uncompressed and FP8 caches), and the engine serves long
prompts in chunks between decode steps."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import attention as attn
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.engine import Engine
from diffkv_jax.generation import SamplingParams, page_width
from diffkv_jax.methods import make_method
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.steps import CompiledSteps


def test_prefix_causal_attention_equals_causal_attention_on_the_chunk_rows():
    rng = np.random.default_rng(0)
    B, T, nq, nkv, D = 2, 24, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32) for h in (nq, nkv, nkv))
    lengths = jnp.asarray([24, 17], jnp.int32)
    whole = np.asarray(attn.causal_attention(q, k, v, lengths))
    start = jnp.asarray([8, 5], jnp.int32)
    chunk = jnp.asarray([10, 12], jnp.int32)  # rows end at 18 and 17
    idx = start[:, None] + jnp.arange(12)[None]
    qc = jnp.take_along_axis(q, jnp.minimum(idx, T - 1)[:, :, None, None], axis=1)
    got = np.asarray(attn.prefix_causal_attention(qc, k, v, start, chunk))
    for b in range(B):
        n, s0 = int(chunk[b]), int(start[b])
        np.testing.assert_allclose(got[b, :n], whole[b, s0:s0 + n], rtol=1e-5, atol=1e-5)


def _methods(cfg):
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=3,
                     max_context=128, page_size=8)
    fp8 = make_method("fp8", cfg, max_seqs=3, max_context=128, dtype=jnp.float32,
                      k_scale=0.02, v_scale=0.02)
    return [full, fp8]


@pytest.mark.parametrize("which", [0, 1], ids=["full", "fp8"])
def test_chunks_leave_the_cache_and_logits_of_a_whole_prefill(tiny_model, which):
    cfg, params = tiny_model
    method = _methods(cfg)[which]
    assert method.supports_chunked_prefill
    steps = CompiledSteps(cfg, method, jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in (37, 21)]
    pages = 3 * method.pages_for_tokens(128)

    # One whole-prompt prefill of both rows.
    whole = method.init_state(pages)
    toks = np.zeros((2, 64), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    whole, logits_whole = steps.prefill(params, whole, PrefillBatch(
        jnp.asarray(toks), jnp.asarray([37, 21], jnp.int32), jnp.asarray([0, 1], jnp.int32)))

    # The same prompts in chunks of 16 (the second row ends a chunk earlier),
    # with a fresh row admitted whole-prompt style alongside a later chunk.
    chunked = method.init_state(pages)
    logits = {}
    for start in (0, 16, 32):
        rows = [i for i, p in enumerate(prompts) if len(p) > start]
        ct = np.zeros((2, 16), np.int32)
        cl = np.zeros(2, np.int32)
        st = np.zeros(2, np.int32)
        tot = np.zeros(2, np.int32)
        slots = np.full(2, method.max_seqs, np.int32)
        for j, i in enumerate(rows):
            piece = prompts[i][start:start + 16]
            ct[j, :len(piece)], cl[j], st[j], tot[j], slots[j] = piece, len(piece), start, \
                len(prompts[i]), i
        width = page_width(method, 37)
        chunked, out = steps.prefill(params, chunked, PrefillBatch(
            jnp.asarray(ct), jnp.asarray(cl), jnp.asarray(slots), jnp.asarray(st),
            jnp.asarray(tot), width))
        for j, i in enumerate(rows):
            if start + cl[j] == len(prompts[i]):
                logits[i] = np.asarray(out[j])
    # A quantized cache's later chunks attend to the stored (quantized) prefix, as its
    # decode steps do, where a whole prefill attends to exact values: close, not equal.
    tol = 2e-4 if which == 0 else 0.35
    for i in range(2):
        np.testing.assert_allclose(logits[i], np.asarray(logits_whole[i]), rtol=tol, atol=tol)
        if which:
            assert np.corrcoef(logits[i], np.asarray(logits_whole[i]))[0, 1] > 0.97
    assert int(chunked.free.num_free) == int(whole.free.num_free)
    np.testing.assert_array_equal(np.asarray(chunked.lengths), np.asarray(whole.lengths))

    # Decoding continues identically from either cache.
    batch = DecodeBatch(jnp.asarray([5, 9, 0], jnp.int32), jnp.asarray([True, True, False]), 8)
    _, a = steps.decode(params, whole, batch)
    _, b = steps.decode(params, chunked, batch)
    np.testing.assert_allclose(np.asarray(b[:2]), np.asarray(a[:2]), rtol=tol, atol=tol)


def test_engine_chunks_long_prompts_between_decode_steps(tiny_model):
    """Greedy outputs with 16-token chunks equal each request served alone with whole
    prompts; while the long prompt is prefilled chunk by chunk, the running request
    keeps receiving tokens; nothing leaks."""
    cfg, params = tiny_model
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (5, 70, 33, 9)]
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=())

    def method():
        return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=3,
                         max_context=128, page_size=8)

    pages = 3 * method().pages_for_tokens(128)
    alone = []
    for p in prompts:
        eng = Engine(cfg, params, method(), pages)
        alone.append(eng.generate([p], sampling)[0].output)

    eng = Engine(cfg, params, method(), pages, max_prefill_batch=2, prefill_chunk=16)
    first = eng.add_request(prompts[0], sampling)
    for _ in range(3):  # the short request is decoding before the long ones arrive
        eng.step()
    ids = [first] + [eng.add_request(p, sampling) for p in prompts[1:]]
    grew_while_chunking = False
    while eng.has_unfinished():
        before = len(eng.requests[first].output)
        chunking = bool(eng._chunking)
        eng.step()
        if chunking and len(eng.requests[first].output) > before:
            grew_while_chunking = True
    assert grew_while_chunking
    assert [eng.requests[i].output for i in ids] == alone
    # 70 tokens in chunks of 16: more prompt tokens prefilled than whole-prompt rows only.
    assert eng.prefill_tokens == sum(len(p) for p in prompts)
    assert eng.free_pages == eng.num_pages and not eng._chunking
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


def test_chunked_prefill_is_refused_where_the_method_cannot_chunk(tiny_model):
    cfg, params = tiny_model
    method = make_method("diffkv", cfg, max_seqs=2, max_context=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="whole prompts"):
        Engine(cfg, params, method, 2 * method.pages_for_tokens(64), prefill_chunk=16)
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                     max_context=64, page_size=8)
    with pytest.raises(ValueError, match=">= 1"):
        Engine(cfg, params, full, 2 * full.pages_for_tokens(64), prefill_chunk=0)
