"""KIVI cache (kivi4 / kivi2): group quantization, the full-precision residual, accounting.

The cache is driven directly (prefill / decode with random Q, K, V, no model)
and compared with the uncompressed ``FullCache`` fed the same inputs; then the
Engine serves the tiny model through it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.engine import Engine
from diffkv_jax.generation import SamplingParams
from diffkv_jax.kivi_cache import POOLS, KiviCache, dequantize_group, quantize_group
from diffkv_jax.methods import METHOD_SPECS, make_method
from diffkv_jax.paged_cache import FullCache

L, H, NQ, D, S = 2, 2, 4, 16, 2  # GQA: two query heads per KV head


# --------------------------------------------------------------------------- driver


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(m, state, q, k, v, lengths):
    """``q [L, B, T, NQ, D]``, ``k, v [L, B, T, H, D]``; rows go to slots 0..B-1."""
    B, T = k.shape[1:3]
    batch = PrefillBatch(jnp.zeros((B, T), jnp.int32), lengths, jnp.arange(B, dtype=jnp.int32))
    state, batch = m.begin_prefill(state, batch)
    for layer in range(m.num_layers):
        state, _ = m.prefill_attention(state, layer, q[layer], k[layer], v[layer], batch)
    return m.end_prefill(state, batch)


@functools.partial(jax.jit, static_argnums=(0,))
def _decode(m, state, q, k, v, active):
    """One step: ``q [L, S, 1, NQ, D]``, ``k, v [L, S, 1, H, D]``; outputs ``[L, S, NQ, D]``."""
    batch = DecodeBatch(jnp.zeros((m.max_seqs,), jnp.int32), active, m.row_len)
    state, batch = m.begin_decode(state, batch)
    outs = []
    for layer in range(m.num_layers):
        state, o = m.decode_attention(state, layer, q[layer], k[layer], v[layer], batch)
        outs.append(o[:, 0])
    return m.end_decode(state, batch), jnp.stack(outs)


class Run:
    """Prefill ``plens`` then decode, with the random inputs of ``seed`` (same for any method)."""

    def __init__(self, m, plens, seed=0, pages=None):
        self.m, self.rng = m, np.random.default_rng(seed)
        self.pages = pages or m.max_seqs * m.pages_for_tokens(m.max_context)
        self.state = m.init_state(self.pages)
        T = 16 * -(-max(plens) // 16)
        q, k, v = self.qkv((L, len(plens), T))
        self.prompt_k, self.prompt_v = k, v
        self.state = _prefill(m, self.state, q, k, v, jnp.asarray(plens, jnp.int32))

    def qkv(self, lead):
        f = lambda n: jnp.asarray(self.rng.normal(size=lead + (n, D)), jnp.float32)  # noqa: E731
        return f(NQ), f(H), f(H)

    def step(self, active=None, k=None, v=None, q=None):
        q0, k0, v0 = self.qkv((L, self.m.max_seqs, 1))
        active = jnp.ones((self.m.max_seqs,), bool) if active is None else jnp.asarray(active)
        self.state, out = _decode(self.m, self.state, q0 if q is None else q,
                                  k0 if k is None else k, v0 if v is None else v, active)
        return np.asarray(out)

    def decode(self, n):
        return np.stack([self.step() for _ in range(n)])

    def lengths(self):
        return np.asarray(self.state.lengths)[: self.m.max_seqs]

    def pages_per_row(self):
        return np.asarray(self.state.num_pages)[: self.m.max_seqs]

    def page(self, slot, layer, head, j):
        """The dequantized K, V ``[G, D]`` of a row's ``j``-th page and its scales."""
        pid = int(self.state.page_table[slot, layer, head, j])
        parts = [getattr(self.state, f)[pid] for f in POOLS]
        k, v = dequantize_group(*parts, self.m.bits, D)
        return np.asarray(k), np.asarray(v), np.asarray(parts[1], np.float32), \
            np.asarray(parts[4], np.float32)


def kivi(bits=4, G=8, max_context=128, dtype="float32", head_dim=D):
    return KiviCache(L, H, head_dim, S, max_context, bits=bits, page_size=G, dtype=dtype)


def full(max_context=128, dtype="float32"):
    return FullCache(L, H, D, S, max_context, page_size=8, dtype=dtype)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("bits", [4, 2])
def test_group_quantization_is_per_channel_for_keys_and_per_token_for_values(bits):
    G = 32
    rng = np.random.default_rng(bits)
    # Channel (key) and token (value) magnitudes spanning four decades: a shared
    # scale would leave the small ones with errors of the large ones.
    k = rng.normal(size=(G, D)) * np.logspace(-2, 2, D)[None, :]
    v = rng.normal(size=(G, D)) * np.logspace(-2, 2, G)[:, None]
    parts = quantize_group(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), bits)
    kc, ks, kz, vc, vs, vz = parts
    assert kc.shape == vc.shape == (G, D * bits // 8) and kc.dtype == jnp.uint8
    assert ks.shape == kz.shape == (D,) and vs.shape == vz.shape == (G,)
    k_hat, v_hat = map(np.asarray, dequantize_group(*parts, bits, D))
    levels = 2 ** bits - 1
    ks, vs = np.asarray(ks, np.float64), np.asarray(vs, np.float64)
    # Each channel's scale is its own range over the group's tokens; each token's, over its dims.
    np.testing.assert_allclose(ks, np.ptp(k, axis=0) / levels, rtol=2e-3)
    np.testing.assert_allclose(vs, np.ptp(v, axis=1) / levels, rtol=2e-3)
    k_err = np.abs(k_hat - k).max(axis=0)  # per channel
    v_err = np.abs(v_hat - v).max(axis=1)  # per token
    assert (k_err <= ks / 2 * (1 + 1e-5) + 1e-6).all()
    assert (v_err <= vs / 2 * (1 + 1e-5) + 1e-6).all()
    assert k_err[0] < 1e-3 * k_err[-1] and v_err[0] < 1e-3 * v_err[-1]


def test_prefill_stores_complete_groups_in_pages_and_the_rest_in_the_residual():
    r = Run(kivi(bits=4, G=8), plens=[21, 8])
    assert r.lengths().tolist() == [21, 8]
    assert (r.pages_per_row() == np.array([2, 1])[:, None, None]).all()
    assert int(r.state.free.num_free) == r.pages - 3 * L * H
    k_in, v_in = np.asarray(r.prompt_k), np.asarray(r.prompt_v)
    for slot, n in [(0, 21), (1, 8)]:
        for layer in range(L):
            for head in range(H):
                for j in range(n // 8):
                    k, v, ks, vs = r.page(slot, layer, head, j)
                    tok = slice(8 * j, 8 * j + 8)
                    assert (np.abs(k - k_in[layer, slot, tok, head]) <= ks / 2 + 1e-6).all()
                    assert (np.abs(v - v_in[layer, slot, tok, head])
                            <= vs[:, None] / 2 + 1e-6).all()
    # Slot 0's tokens 16..20 stay unquantized; slot 1's residual is empty.
    np.testing.assert_array_equal(np.asarray(r.state.res_k[0, :, :, :5]),
                                  k_in[:, 0, 16:21].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(r.state.res_v[0, :, :, :5]),
                                  np.asarray(r.prompt_v)[:, 0, 16:21].transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sequences_shorter_than_a_group_are_exactly_the_full_cache(dtype):
    # G = 64 > every length reached (at most 50): nothing is ever quantized.
    ref = Run(full(dtype=dtype), plens=[20, 5], seed=3).decode(30)
    r = Run(kivi(bits=2, G=64, dtype=dtype), plens=[20, 5], seed=3)
    out = r.decode(30)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
    assert r.pages_per_row().sum() == 0
    st = r.m.memory_stats(r.state)
    itemsize = np.dtype(dtype).itemsize
    assert st["page_bytes"] == st["residual_bytes"] == 85 * L * H * 2 * D * itemsize


def test_kivi4_decodes_close_to_the_full_cache_and_kivi2_further():
    plens, steps = [40, 23], 30
    ref = Run(full(), plens, seed=5).decode(steps)
    err = {}
    for bits in (4, 2):
        r = Run(kivi(bits=bits, G=8), plens, seed=5)
        err[bits] = rel_err(r.decode(steps), ref)
        assert r.pages_per_row().sum() == (70 // 8 + 53 // 8) * L * H  # groups did get quantized
    # Random N(0, 1) K/V/Q, head_dim 16, groups of 8: relative L2 error of the outputs.
    assert err[4] < 0.1, err
    assert 2 * err[4] < err[2] < 0.5, err


def test_nothing_is_pruned_every_position_is_attended():
    """With q = 0 attention is uniform, and values that quantize exactly (a constant
    vector per token) make the output the mean over every cached position."""
    r = Run(kivi(bits=2, G=8), plens=[19, 6], seed=7)
    # Replace the prompt values by exactly representable ones: token t holds t + 1.
    T = r.prompt_k.shape[2]
    v = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.float32)[None, None, :, None, None],
                         (L, 2, T, H, D))
    q, _, _ = r.qkv((L, 2, T))
    r.state = _prefill(r.m, r.m.init_state(r.pages), q, r.prompt_k, v,
                       jnp.asarray([19, 6], jnp.int32))
    zero_q = jnp.zeros((L, S, 1, NQ, D), jnp.float32)
    for _ in range(25):
        pos = r.lengths()
        v_new = jnp.broadcast_to(jnp.asarray(pos + 1, jnp.float32)[None, :, None, None, None],
                                 (L, S, 1, H, D))
        out = r.step(q=zero_q, v=v_new)
        expect = (pos + 2) / 2.0  # mean of 1 .. pos + 1
        np.testing.assert_allclose(out, np.broadcast_to(expect[None, :, None, None], out.shape),
                                   rtol=1e-5)
    assert r.lengths().tolist() == [44, 31]
    assert (r.pages_per_row() == np.array([5, 3])[:, None, None]).all()


# --------------------------------------------------------------------------- residual and pages


def test_a_full_residual_moves_into_a_new_page_at_the_step_that_completes_it():
    G = 8
    r = Run(kivi(bits=4, G=G), plens=[5, 8], seed=11)
    rows = L * H
    seen_k = {0: [], 1: []}
    for i in range(12):
        active = np.array([True, i != 4])  # slot 1 sits one step out
        before = r.lengths().copy()
        _, k, _ = r.qkv((L, S, 1))
        r.step(active=active, k=k)
        for s in range(S):
            if active[s]:
                seen_k[s].append(np.asarray(k)[:, s, 0])  # [L, H, D]
        n = r.lengths()
        assert n.tolist() == (before + active).tolist()
        assert (r.pages_per_row() == (n // G)[:, None, None]).all(), i
        assert int(r.state.free.num_free) == r.pages - int((n // G).sum()) * rows
    assert r.lengths().tolist() == [17, 19]
    # Slot 0's second page holds tokens 8..15, fed by decode steps 3..10.
    k_tok = np.stack(seen_k[0][3:11], axis=2)  # [L, H, G, D]
    for layer in range(L):
        for head in range(H):
            k, _, ks, _ = r.page(0, layer, head, 1)
            assert (np.abs(k - k_tok[layer, head]) <= ks / 2 + 1e-6).all()
    # The token after the flush is residual slot 0 again.
    np.testing.assert_array_equal(np.asarray(r.state.res_k[0, :, :, 0]), seen_k[0][11])


def test_release_returns_every_page():
    r = Run(kivi(bits=2, G=8), plens=[30, 17], seed=2)
    r.decode(9)
    assert int(r.state.free.num_free) < r.pages
    r.state = jax.jit(r.m.release)(r.state, jnp.ones((S + 1,), bool))
    assert int(r.state.free.num_free) == r.pages
    assert r.m.memory_stats(r.state)["page_bytes"] == 0


# --------------------------------------------------------------------------- accounting


def test_page_bytes_are_what_the_layout_says():
    m4 = KiviCache(1, 1, 128, 1, 1024, bits=4, page_size=32, dtype="bfloat16")
    m2 = KiviCache(1, 1, 128, 1, 1024, bits=2, page_size=32, dtype="bfloat16")
    # Codes of 32 tokens x 128 dims for K and V, then float16 scale + zero per key
    # channel (128) and per value token (32).
    assert m4.page_bytes == 2 * 32 * 64 + 2 * 2 * (128 + 32) == 4736
    assert m2.page_bytes == 2 * 32 * 32 + 2 * 2 * (128 + 32) == 2688
    for m in (m4, m2):
        st = m.init_state(3)
        assert sum(getattr(st, f).nbytes for f in POOLS) == 4 * m.page_bytes  # 3 + trash
    # Measured on a long sequence: 31 groups + 8 residual tokens of 16-bit K and V.
    m = m4
    rng = np.random.default_rng(0)
    kv = [jnp.asarray(rng.normal(size=(1, 1, 1024, 1, 128)), jnp.float32) for _ in range(2)]
    q = jnp.asarray(rng.normal(size=(1, 1, 1024, 1, 128)), jnp.float32)
    state = _prefill(m, m.init_state(m.pages_for_tokens(1024)), q, *kv,
                     jnp.asarray([1000], jnp.int32))
    st = m.memory_stats(state)
    assert st["pages"] == 31 and st["tokens"] == 1000
    assert st["residual_bytes"] == 8 * 2 * 128 * 2
    assert st["page_bytes"] == st["data_bytes"] == 31 * 4736 + 8 * 512
    assert st["table_bytes"] == m.row_len * 4
    assert st["bytes_16bit_same_tokens"] == 1000 * 512
    ratio = (st["page_bytes"] + st["table_bytes"]) / st["bytes_16bit_same_tokens"]
    assert 0.25 < ratio < 0.30, ratio
    assert m.slot_memory_stats(state, [0]) == [st]


def test_slot_stats_add_up_and_pages_for_tokens_is_conservative():
    r = Run(kivi(bits=4, G=8), plens=[30, 3], seed=4)
    r.decode(7)
    st = r.m.memory_stats(r.state)
    per = r.m.slot_memory_stats(r.state, range(S))
    for key in st:
        assert st[key] == sum(p[key] for p in per), key
    for n, p in zip(r.lengths().tolist(), per):
        # What a row holds now, and after the step that may complete its residual.
        assert p["pages"] == n // 8 * L * H <= r.m.pages_for_tokens(n)
        assert (n + 1) // 8 * L * H <= r.m.pages_for_tokens(n)


# --------------------------------------------------------------------------- registry + engine


def test_make_method_builds_kivi_and_refuses_what_it_cannot_do(tiny_model):
    cfg, _ = tiny_model
    for name, bits in (("kivi4", 4), ("kivi2", 2)):
        assert "KIVI" in METHOD_SPECS[name].description
        m = make_method(name, cfg, max_seqs=2, max_context=128, dtype=jnp.bfloat16)
        assert isinstance(m, KiviCache) and m.name == name and m.bits == bits
        assert m.page_size == 32 and m.dtype == "bfloat16"
        assert make_method(name, cfg, max_seqs=2, max_context=128, page_size=16).page_size == 16
    with pytest.raises(ValueError, match="attention_impl='reference'"):
        make_method("kivi4", cfg, max_seqs=2, max_context=128, attention_impl="pallas")
    with pytest.raises(ValueError, match="do not apply to kivi2"):
        make_method("kivi2", cfg, max_seqs=2, max_context=128, window=8)
    with pytest.raises(ValueError, match="fixed by method 'kivi4'"):
        make_method("kivi4", cfg, max_seqs=2, max_context=128, bits=8)
    with pytest.raises(ValueError, match="group size"):
        make_method("kivi4", cfg, max_seqs=2, max_context=128, page_size=-8)
    with pytest.raises(ValueError, match="multiple of 4"):
        KiviCache(1, 1, 18, 1, 64, bits=2)


def _workload(cfg, n, rng, max_prompt, max_new):
    prompts = [list(rng.integers(0, cfg.vocab_size, size=int(rng.integers(1, max_prompt))))
               for _ in range(n)]
    sampling = [SamplingParams(max_new_tokens=int(rng.integers(1, max_new))) for _ in range(n)]
    return prompts, sampling


def test_engine_serves_random_requests_and_returns_every_page(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(8)
    prompts, sampling = _workload(cfg, 12, rng, max_prompt=60, max_new=24)
    method = make_method("kivi4", cfg, max_seqs=4, max_context=128, page_size=8)
    # Room for two sequences at their longest: the others wait, some are preempted.
    pages = 2 * method.pages_for_tokens(84) + method.max_seqs * cfg.num_layers * cfg.num_kv_heads
    eng = Engine(cfg, params, method, num_pages=pages)
    # Preempt on the free-page bound (not the exact count the engine reads first),
    # so that this small workload preempts.
    eng.READ_BEFORE_PREEMPTING = False
    reqs = eng.generate(prompts, sampling)
    assert all(r.status == "finished" and len(r.output) == s.max_new_tokens
               for r, s in zip(reqs, sampling))
    assert any(r.preemptions for r in reqs), "the pool was meant to force preemption"
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short
    assert int(eng.state.free.num_free) == eng.num_pages
    rows = cfg.num_layers * cfg.num_kv_heads
    for r in reqs:
        cached = len(r.prompt) + len(r.output) - 1  # the last token is never fed back
        st = r.kv_stats
        assert st["tokens"] == cached and st["pages"] == cached // 8 * rows
        assert r.kv_bytes == st["page_bytes"] + st["table_bytes"]
        assert st["residual_bytes"] == cached % 8 * rows * 2 * cfg.head_dim * 4


def test_engine_within_one_group_matches_the_full_cache(tiny_model):
    """Contexts shorter than the group: KIVI never quantizes, so greedy output is the full
    cache's."""
    cfg, params = tiny_model
    rng = np.random.default_rng(9)
    prompts, sampling = _workload(cfg, 6, rng, max_prompt=30, max_new=12)
    out = {}
    for name, ps in (("full", 16), ("kivi2", 64)):
        method = make_method(name, cfg, max_seqs=4, max_context=64, page_size=ps)
        eng = Engine(cfg, params, method, num_pages=4 * method.pages_for_tokens(64) + 8)
        out[name] = [r.output for r in eng.generate(prompts, sampling)]
    assert out["kivi2"] == out["full"]
