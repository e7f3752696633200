"""Token-eviction baselines (h2o, streamingllm, snapkv) on the DiffKV cache.

Three levels:

* the policy functions on constructed score patterns with known answers
  (:func:`select_prompt`: H2O's top-k plus window, StreamingLLM's sinks plus
  window, SnapKV's pooled votes) and against small NumPy references written
  from the methods' definitions;
* the cache driven directly (``prefill_write`` / ``decode_update`` /
  ``end_decode`` with constructed probabilities, no model): hand scenarios with
  the retained set spelled out step by step, plus random rows compared with a
  plain-Python reference of each rule (retained positions, scores bit for bit,
  stored K/V), the budget never exceeded, pages freed and not growing;
* ``Engine.generate`` on the tiny model for every method: the measured bytes
  match the budget and every page is back in the free list at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import diffkv_policy as pol
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.diffkv_policy import DiffKVPolicy
from diffkv_jax.engine import Engine
from diffkv_jax.generation import SamplingParams
from diffkv_jax.methods import METHOD_SPECS, make_method
from diffkv_jax.unified_page import Tier

f32 = np.float32


def baseline(rule: str, **kw) -> DiffKVPolicy:
    return DiffKVPolicy(rule=rule, low_tier=False, alpha_low=0.0, **kw)


def kept(tier_row, L=None) -> set[int]:
    t = np.asarray(tier_row)
    if L is not None:
        assert (t[L:] == pol.EMPTY).all() and (t[:L] != pol.EMPTY).all()
    assert set(np.unique(t).tolist()) <= {pol.HIGH, pol.PRUNED, pol.EMPTY}  # never LOW
    return set(np.flatnonzero(t == pol.HIGH).tolist())


# --------------------------------------------------------------------------- NumPy references


def ref_h2o_prompt(score, L, budget, window) -> set[int]:
    """Newest ``window`` + the ``budget - window`` highest raw scores before them."""
    if L <= budget:
        return set(range(L))
    cands = sorted(range(L - window), key=lambda i: (-float(score[i]), -i))
    return set(cands[:budget - window]) | set(range(L - window, L))


def ref_pool(votes, n, kernel, pooling) -> np.ndarray:
    """torch ``F.max_pool1d`` / ``F.avg_pool1d(count_include_pad=True)`` of ``votes[:n]``
    (kernel ``kernel``, stride 1, padding ``kernel // 2``), element by element."""
    r = kernel // 2
    out = np.zeros(n, np.float64)
    for i in range(n):
        window = [float(votes[j]) for j in range(i - r, i + r + 1) if 0 <= j < n]
        out[i] = max(window) if pooling == "max" else sum(window) / kernel
    return out


def ref_snapkv_prompt(votes, L, budget, window, kernel, pooling) -> set[int]:
    if L <= budget:
        return set(range(L))
    n = L - window
    pooled = ref_pool(votes, n, kernel, pooling)
    cands = sorted(range(n), key=lambda i: (-pooled[i], -i))
    return set(cands[:budget - window]) | set(range(n, L))


class RowRef:
    """One (sequence, KV head) row under an eviction rule, in plain Python.

    Scores accumulate by float32 addition in the cache's order, so they match bit for bit.
    """

    def __init__(self, rule, budget, window, sinks, plen, keep, score_sum):
        self.rule, self.budget, self.window, self.sinks = rule, budget, window, sinks
        self.next_pos = plen
        self.score = {p: f32(score_sum[p]) for p in keep}
        self.evicted: list[int] = []

    def step(self, p, p_new):
        cur = self.next_pos
        for q in self.score:
            self.score[q] = f32(self.score[q] + f32(p[q]))
        victim = None
        if len(self.score) + 1 > self.budget:
            if self.rule == "h2o":
                cands = [q for q in self.score if q <= cur - self.window]
                victim = min(cands, key=lambda q: (self.score[q], q))
            elif self.rule == "streamingllm":
                victim = min(q for q in self.score if q >= self.sinks)
        if victim is not None:
            del self.score[victim]
            self.evicted.append(victim)
        self.score[cur] = f32(p_new)
        self.next_pos = cur + 1
        return victim


# --------------------------------------------------------------------------- policy: prefill


def test_policy_validation_and_budgets():
    assert DiffKVPolicy().rule == "diffkv"
    with pytest.raises(ValueError, match="eviction rules only"):
        DiffKVPolicy(budget=10)
    with pytest.raises(ValueError, match="low_tier=False"):
        DiffKVPolicy(rule="h2o", budget=100)
    with pytest.raises(ValueError, match="needs budget"):
        baseline("h2o")
    with pytest.raises(ValueError, match="not both"):
        baseline("snapkv", budget=100, budget_ratio=0.5)
    with pytest.raises(ValueError, match="below 64"):
        baseline("h2o", budget=63)  # the window (64) is always kept
    with pytest.raises(ValueError, match="below 5"):
        baseline("streamingllm", budget=4, sinks=4)
    with pytest.raises(ValueError, match="odd"):
        baseline("snapkv", budget=100, pool_kernel=4)
    with pytest.raises(ValueError, match="rule must be"):
        baseline("quest", budget=100)
    # Ratio budgets: round half up, raised to the rule's minimum.
    lens = jnp.asarray([0, 9, 10, 11, 100, 101], jnp.int32)
    b = np.asarray(pol.row_budget(baseline("h2o", budget_ratio=0.5, window=5), lens))
    assert b.tolist() == [5, 5, 5, 6, 50, 51]
    b = np.asarray(pol.row_budget(baseline("streamingllm", budget_ratio=0.25, sinks=2), lens))
    assert b.tolist() == [3, 3, 3, 3, 25, 25]
    assert np.asarray(pol.row_budget(baseline("streamingllm", sinks=3, window=7), lens)).tolist() \
        == [10] * 6
    assert baseline("streamingllm", sinks=3, window=7).static_budget == 10
    assert baseline("h2o", budget_ratio=0.3).static_budget is None


def test_h2o_prompt_keeps_top_scores_plus_window():
    T = 16
    p = baseline("h2o", budget=6, window=3)
    s = np.zeros((3, T), np.float32)
    # Row 0 (L = 12): candidates 0..8; the top 3 are 7, 1, 4. The window tokens 9..11
    # score lowest of all and are kept anyway; padding junk beyond L is ignored.
    s[0, :12] = [0.3, 0.9, 0.1, 0.2, 0.8, 0.15, 0.25, 1.0, 0.05, 0.0, 0.01, 0.02]
    s[0, 12:] = 5.0
    # Row 1 (L = 6 = budget): everything kept whatever the scores.
    s[1, :6] = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # Row 2 (L = 10): a tie at 0.5 between 0 and 5 for the last heavy slot: the newer wins.
    s[2, :10] = [0.5, 0.1, 0.9, 0.2, 0.7, 0.5, 0.3, 0.0, 0.0, 0.0]
    lens = jnp.asarray([12, 6, 10], jnp.int32)
    tier = np.asarray(pol.select_prompt(p, jnp.asarray(s), lens))
    assert kept(tier[0], 12) == {1, 4, 7, 9, 10, 11}
    assert kept(tier[1], 6) == set(range(6))
    assert kept(tier[2], 10) == {2, 4, 5, 7, 8, 9}
    # Random rows against the reference, fixed budget and ratio budget.
    rng = np.random.default_rng(0)
    T = 48
    s = rng.lognormal(size=(8, T)).astype(np.float32)
    lens = rng.integers(1, T + 1, size=8).astype(np.int32)
    for pp in (baseline("h2o", budget=13, window=4), baseline("h2o", budget_ratio=0.4, window=4)):
        tier = np.asarray(pol.select_prompt(pp, jnp.asarray(s), jnp.asarray(lens)))
        budgets = np.asarray(pol.row_budget(pp, jnp.asarray(lens)))
        for i, L in enumerate(lens.tolist()):
            exp = ref_h2o_prompt(s[i], L, int(budgets[i]), 4)
            assert kept(tier[i], L) == exp, (pp, i, L)
            assert len(exp) == min(L, int(budgets[i]))


def test_streamingllm_prompt_keeps_sinks_and_window_whatever_the_scores():
    p = baseline("streamingllm", budget=7, sinks=3)  # window 4
    T = 32
    rng = np.random.default_rng(1)
    s = rng.lognormal(size=(4, T)).astype(np.float32)
    s[0, 3:10] = 100.0  # the middle is the most attended: still dropped
    s[0, :3] = 0.0
    lens = jnp.asarray([20, 7, 5, 32], jnp.int32)
    tier = np.asarray(pol.select_prompt(p, jnp.asarray(s), lens))
    assert kept(tier[0], 20) == {0, 1, 2, 16, 17, 18, 19}
    assert kept(tier[1], 7) == set(range(7))
    assert kept(tier[2], 5) == set(range(5))
    assert kept(tier[3], 32) == {0, 1, 2, 28, 29, 30, 31}


def test_snapkv_pooling_and_topk_on_constructed_votes():
    T = 24
    # L = 20, window 4, budget 7: three of the candidates 0..15 survive.
    # Max pool (kernel 3): a spike at 10 lifts 9 and 11 too; raw top-3 would keep 10, 15, 14.
    v = np.array([0.01 * (i + 1) for i in range(T)], np.float32)
    v[10], v[15] = 1.0, 0.2
    v[16:20] = 9.0  # window tokens: kept, and never pooled into the candidates
    v[20:] = 50.0  # padding junk
    p = baseline("snapkv", budget=7, window=4, pool_kernel=3, pooling="max")
    tier = np.asarray(pol.select_prompt(p, jnp.asarray(v)[None], jnp.asarray([20], jnp.int32)))
    assert kept(tier[0], 20) == {9, 10, 11, 16, 17, 18, 19}
    pooled = np.asarray(pol.snapkv_votes(p, jnp.asarray(v), jnp.arange(T) < 16))
    np.testing.assert_allclose(pooled[13:16], [0.15, 0.2, 0.2])  # the window's 9.0 stays out
    assert np.isneginf(pooled[16:]).all()
    # Average pool (kernel 3, zero padding counted): a cluster beats a taller lone spike,
    # which the max pool prefers.
    v = np.zeros(T, np.float32)
    v[2], v[10:13] = 0.9, 0.5
    for pooling, exp in (("avg", {10, 11, 12}), ("max", {1, 2, 3})):
        p = baseline("snapkv", budget=7, window=4, pool_kernel=3, pooling=pooling)
        tier = np.asarray(pol.select_prompt(p, jnp.asarray(v)[None], jnp.asarray([20], jnp.int32)))
        assert kept(tier[0], 20) == exp | {16, 17, 18, 19}, pooling
    # Edge padding of the average pool: position 0 averages (0 + v0 + v1) / 3.
    p = baseline("snapkv", budget=7, window=4, pool_kernel=3, pooling="avg")
    v = np.arange(1, T + 1, dtype=np.float32)
    pooled = np.asarray(pol.snapkv_votes(p, jnp.asarray(v), jnp.arange(T) < 16))
    np.testing.assert_allclose(pooled[0], (1 + 2) / 3, rtol=1e-6)
    np.testing.assert_allclose(pooled[15], (15 + 16) / 3, rtol=1e-6)
    # Kernel 7 (the default), both poolings, random votes against the reference.
    rng = np.random.default_rng(2)
    T = 64
    v = rng.lognormal(sigma=1.5, size=(10, T)).astype(np.float32)
    lens = rng.integers(1, T + 1, size=10).astype(np.int32)
    for pooling in ("max", "avg"):
        p = baseline("snapkv", budget=20, window=5, pooling=pooling)
        assert p.pool_kernel == 7
        tier = np.asarray(pol.select_prompt(p, jnp.asarray(v), jnp.asarray(lens)))
        for i, L in enumerate(lens.tolist()):
            assert kept(tier[i], L) == ref_snapkv_prompt(v[i], L, 20, 5, 7, pooling), (pooling, i)


def test_snapkv_votes_are_the_observation_window_scores():
    """The prefill path scores SnapKV candidates from the last obs_window queries only."""
    from diffkv_jax.attention import causal_attention_probs
    from diffkv_jax.prompt_scoring import prompt_scores

    rng = np.random.default_rng(3)
    B, T, nq, H, D = 1, 20, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, nq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    lengths = jnp.asarray([18], jnp.int32)
    votes = np.asarray(prompt_scores(q, k, lengths, 5))[0]  # [H, T]
    probs = np.asarray(causal_attention_probs(q, k, lengths)).max(axis=2)[0]  # [H, Tq, Tk]
    np.testing.assert_allclose(votes, probs[:, 13:18].sum(axis=1), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- cache-level driving

S, H, D = 2, 2, 16
T_PAD = 32
TPP = 4  # K8V8 tokens per page


def make_cache(policy: DiffKVPolicy, max_context: int = 80) -> DiffKVCache:
    return DiffKVCache(num_layers=1, num_kv_heads=H, head_dim=D, max_seqs=S,
                       max_context=max_context, policy=policy, high=Tier(8, 8), low=Tier(8, 8),
                       tokens_per_page=TPP)


@functools.lru_cache(maxsize=None)
def compiled(m: DiffKVCache):
    W = m.row_len

    def view(state):
        return m.gather_rows(state, 0, 0, W)

    @jax.jit
    def prefill(state, lengths, slots, k, v, score_sum):
        batch = PrefillBatch(jnp.zeros(lengths.shape + (k.shape[1],), jnp.int32), lengths, slots)
        state, ctx = m.begin_prefill(state, batch)
        batch, ids, per_row = ctx
        state = m.prefill_write(state, 0, k, v, score_sum, batch, ids, per_row)
        state = m.end_prefill(state, ctx)
        return state, view(state)

    @jax.jit
    def step(state, pfull, p_new, k_new, v_new, active):
        hi = view(state)
        lo = m.gather_rows(state, 0, 1, 0)
        mc = pfull.shape[-1]
        p_hi = jnp.where(hi.valid, jnp.take_along_axis(
            pfull, jnp.clip(hi.positions, 0, mc - 1), axis=-1), 0.0)
        state = m.decode_update(state, 0, k_new, v_new, hi, lo, p_hi,
                                jnp.zeros((S, H, 0), jnp.float32), p_new, active)
        state = m.end_decode(state, DecodeBatch(jnp.zeros((S,), jnp.int32), active, W))
        return state, view(state)

    return prefill, step


class Driver:
    """Drives a one-layer cache with given or random scores and checks it against RowRef."""

    def __init__(self, policy: DiffKVPolicy, plens, seed: int):
        self.p = policy
        self.m = make_cache(policy)
        self.prefill_fn, self.step_fn = compiled(self.m)
        self.rng = np.random.default_rng(seed)
        self.plens = list(plens)
        self.mc = self.m.max_context
        self.w = self.rng.lognormal(0.0, 1.0, size=(S, H, self.mc))  # per-token attention weight
        self.P = S * self.m.pages_for_tokens(self.mc) + 4
        self.state = self.m.init_state(self.P)
        self.kv: dict = {}
        self.budgets = np.asarray(pol.row_budget(policy, jnp.asarray(self.plens, jnp.int32)))

    def prefill(self, score_sum=None):
        B = S
        k = self.rng.standard_normal((B, T_PAD, H, D)).astype(np.float32)
        v = self.rng.standard_normal((B, T_PAD, H, D)).astype(np.float32)
        if score_sum is None:
            score_sum = (self.w[:, :, :T_PAD] * self.rng.gamma(4.0, 0.25, (S, H, T_PAD)))
        score_sum = np.asarray(score_sum, np.float32)
        lengths = np.asarray(self.plens, np.int32)
        self.state, view = self.prefill_fn(self.state, jnp.asarray(lengths),
                                           jnp.arange(S, dtype=jnp.int32), jnp.asarray(k),
                                           jnp.asarray(v), jnp.asarray(score_sum))
        tiers = np.asarray(pol.select_prompt(self.p, jnp.asarray(score_sum),
                                             jnp.broadcast_to(jnp.asarray(lengths)[:, None],
                                                              (S, H))))
        self.refs = [[RowRef(self.p.rule, int(self.budgets[s]), self.p.window, self.p.sinks,
                             self.plens[s], kept(tiers[s, h], self.plens[s]), score_sum[s, h])
                      for h in range(H)] for s in range(S)]
        for s in range(S):
            for h in range(H):
                for q in range(self.plens[s]):
                    self.kv[s, h, q] = (k[s, q, h], v[s, q, h])
        self.check(view, "prefill")
        return view

    def step(self, i, p=None, p_new=None, active=None):
        """One decode step; ``p [S, H, mc]`` (default: random softmax-like scores)."""
        if p is None:
            p = np.zeros((S, H, self.mc), np.float32)
            for s in range(S):
                cur = self.refs[s][0].next_pos
                x = self.w[s, :, :cur + 1] * self.rng.gamma(4.0, 0.25, size=(H, cur + 1))
                p[s, :, :cur + 1] = x / x.sum(-1, keepdims=True)
            p_new = np.array([[p[s, h, self.refs[s][h].next_pos] for h in range(H)]
                              for s in range(S)], np.float32)
        active = np.ones(S, bool) if active is None else np.asarray(active)
        k = self.rng.standard_normal((S, H, D)).astype(np.float32)
        v = self.rng.standard_normal((S, H, D)).astype(np.float32)
        self.state, view = self.step_fn(self.state, jnp.asarray(p, jnp.float32),
                                        jnp.asarray(p_new, jnp.float32), jnp.asarray(k),
                                        jnp.asarray(v), jnp.asarray(active))
        for s in np.flatnonzero(active):
            for h in range(H):
                ref = self.refs[s][h]
                self.kv[s, h, ref.next_pos] = (k[s, h], v[s, h])
                ref.step(p[s, h], p_new[s, h])
        self.check(view, f"step {i}")
        return view

    def retained(self, view, s, h) -> set[int]:
        return set(np.asarray(view.positions)[s, h][np.asarray(view.valid)[s, h]].tolist())

    def check(self, view, where):
        view = jax.device_get(view)
        st = jax.device_get(self.state)
        assert not bool(st.alloc_failed), where
        cap = self.m.cap(0)
        for s in range(S):
            for h in range(H):
                ref = self.refs[s][h]
                ok = view.valid[s, h]
                pos = view.positions[s, h][ok]
                assert len(set(pos.tolist())) == len(pos), f"{where}: duplicate positions"
                assert set(pos.tolist()) == set(ref.score), (
                    f"{where}: row {s} head {h}: cache {sorted(pos.tolist())} "
                    f"reference {sorted(ref.score)}")
                exp_sc = np.array([ref.score[q] for q in pos.tolist()], np.float32)
                np.testing.assert_array_equal(view.scores[s, h][ok], exp_sc, err_msg=where)
                n = int(st.n_tok[s, 0, h, 0])
                assert n == len(ref.score) and int(st.n_tok[s, 0, h, 1]) == 0, where
                assert int(st.n_pages[s, 0, h, 1]) == 0, where
                assert n + 1 <= int(st.n_pages[s, 0, h, 0]) * cap, f"{where}: no headroom"
                if self.p.rule != "snapkv":
                    assert n <= int(self.budgets[s]), f"{where}: row over budget"
                    assert int(st.n_pages[s, 0, h, 0]) <= int(self.budgets[s]) // cap + 1
                # Stored K/V of every kept token (K8V8): the newcomer went into the freed slot.
                for i, q in enumerate(pos.tolist()):
                    k0, v0 = self.kv[s, h, q]
                    for got, x in ((view.keys[s, h][ok][i], k0), (view.values[s, h][ok][i], v0)):
                        tol = (0.51 * float(x.max() - x.min()) / 255
                               + 1e-5 * float(np.abs(x).max()) + 1e-6)
                        assert np.abs(got - x).max() <= tol, f"{where}: K/V of {q} in row {s}"
        # Owned pages and the free ring partition the pool.
        R = self.m.row_len
        j = np.arange(R)
        npg = st.n_pages
        owned = st.page_table[(j < npg[..., 0:1]) | (j >= R - npg[..., 1:2])]
        nf, start = int(st.free.num_free), int(st.free.start)
        free = st.free.pages[(start + np.arange(nf)) % self.P]
        assert np.array_equal(np.sort(np.concatenate([owned, free])), np.arange(self.P)), where


H2O_HAND = baseline("h2o", budget=5, window=2, obs_window=None)
SNAP_HAND = baseline("snapkv", budget=7, window=4, obs_window=4, pool_kernel=3)


def test_h2o_decode_evicts_the_lowest_accumulated_score_outside_the_window():
    d = Driver(H2O_HAND, plens=[8, 29], seed=10)
    score_sum = d.w[:, :, :T_PAD] * 0.1
    score_sum[0, 0, :8] = [0.9, 0.1, 0.5, 0.2, 0.7, 0.3, 0.05, 0.4]
    view = d.prefill(score_sum)
    assert d.retained(view, 0, 0) == {0, 2, 4, 6, 7}  # top 3 of 0..5 + window {6, 7}
    # Per step: this step's probability of each cached position in row (0, 0), and the
    # retained set afterwards.
    script = [
        # 6 (0.05 + 0.01) is the lowest outside the window {7, 8}: it goes.
        ({0: 0.0, 2: 0.6, 4: 0.05, 6: 0.01, 7: 0.1}, 0.24, {0, 2, 4, 7, 8}),
        # Scores 0 .9, 2 1.1, 4 .75, 7 .9 + ...: 4 is now the lowest accumulated score.
        ({0: 0.0, 2: 0.0, 4: 0.0, 7: 0.5, 8: 0.3}, 0.2, {0, 2, 7, 8, 9}),
        # 9 (0.2) is the lowest of all but inside the window {9, 10}: 8 (0.54) goes.
        ({}, 1.0, {0, 2, 7, 9, 10}),
        # Now 9 has left the window: it goes.
        ({}, 0.5, {0, 2, 7, 10, 11}),
    ]
    for i, (probs, p_new, exp) in enumerate(script):
        p = np.zeros((S, H, d.mc), np.float32)
        pn = np.full((S, H), 0.3, np.float32)
        for q, x in probs.items():
            p[0, 0, q] = x
        pn[0, 0] = p_new
        p[1] = d.rng.uniform(0, 0.1, size=(H, d.mc))
        view = d.step(i, p, pn)
        assert d.retained(view, 0, 0) == exp, (i, d.retained(view, 0, 0))
    # Random continuation (rows of both budgets, some inactive steps) against the reference.
    rng = np.random.default_rng(11)
    for i in range(4, 40):
        d.step(i, active=rng.random(S) < 0.8)
    assert sum(len(r.evicted) for row in d.refs for r in row) > 40


def test_streamingllm_decode_evicts_the_oldest_non_sink():
    # budget = round(0.625 * L): 5 for the 8-token prompt (sinks 2 + window 3), 18 for 29.
    p = baseline("streamingllm", budget_ratio=0.625, sinks=2)
    d = Driver(p, plens=[8, 29], seed=20)
    assert d.budgets.tolist() == [5, 18]
    score_sum = d.w[:, :, :T_PAD].copy()
    score_sum[0, 0, :8] = [0.0, 0.0, 9.0, 9.0, 9.0, 0.1, 0.1, 0.1]  # scores do not matter
    view = d.prefill(score_sum)
    assert d.retained(view, 0, 0) == {0, 1, 5, 6, 7}
    assert d.retained(view, 1, 0) == {0, 1} | set(range(13, 29))
    for i, exp in enumerate([{0, 1, 6, 7, 8}, {0, 1, 7, 8, 9}, {0, 1, 8, 9, 10}]):
        probs = np.zeros((S, H, d.mc), np.float32)
        probs[:, :, 5:8] = 1.0  # the oldest non-sinks are the most attended: evicted anyway
        view = d.step(i, probs, np.zeros((S, H), np.float32))
        assert d.retained(view, 0, 0) == exp
        assert d.retained(view, 1, 1) == {0, 1} | set(range(14 + i, 30 + i))
    rng = np.random.default_rng(21)
    for i in range(3, 40):
        d.step(i, active=rng.random(S) < 0.8)
    assert all(r.evicted == sorted(r.evicted) for row in d.refs for r in row)


def test_snapkv_prefill_selects_by_pooled_votes_then_decode_only_appends():
    d = Driver(SNAP_HAND, plens=[20, 30], seed=30)
    score_sum = d.w[:, :, :T_PAD] * 0.01
    v = np.array([0.01 * (i + 1) for i in range(T_PAD)], np.float32)
    v[10], v[15] = 1.0, 0.2
    score_sum[0, 0] = v
    view = d.prefill(score_sum)
    assert d.retained(view, 0, 0) == {9, 10, 11, 16, 17, 18, 19}
    for i in range(30):
        d.step(i)
    for s in range(S):
        for h in range(H):
            ref = d.refs[s][h]
            assert not ref.evicted
            assert len(ref.score) == 7 + 30
            assert set(range(d.plens[s], d.plens[s] + 30)) <= set(ref.score)


def test_pages_are_freed_and_do_not_grow_with_the_sequence():
    """Evicting rows own budget // cap + 1 pages from prefill on, however long they run."""
    d = Driver(H2O_HAND, plens=[30, 25], seed=40)  # budget 5
    d.prefill()
    m = d.m
    rows = m.num_layers * m.num_kv_heads
    budget_pages = 5 // m.cap(0) + 1
    full_pages = m.pages_for_tokens(30) + m.pages_for_tokens(25)  # the conservative prompt set
    st0 = m.memory_stats(d.state)
    assert st0["pages"] == S * rows * budget_pages < full_pages
    assert st0["page_bytes"] == S * rows * budget_pages * m.page_bytes
    assert int(d.state.free.num_free) == d.P - S * rows * budget_pages
    for i in range(40):
        d.step(i)
        st = m.memory_stats(d.state)
        assert st["page_bytes"] == st0["page_bytes"], i
        assert st["data_bytes"] == S * rows * 5 * (2 * D + 16)
        assert st["tokens"] == 55 + 2 * (i + 1)
    assert st["frac_pruned"] > 0.9
    # The contrast: without eviction (snapkv at decode) the pages grow with the sequence.
    d2 = Driver(SNAP_HAND, plens=[30, 25], seed=41)  # 7 prompt tokens kept: 2 pages a row
    d2.prefill()
    before = d2.m.memory_stats(d2.state)["pages"]
    assert before == S * rows * 2
    for i in range(12):
        d2.step(i)
    assert d2.m.memory_stats(d2.state)["pages"] == S * rows * 5  # 19 tokens + headroom


def test_decode_reads_only_the_budgets_pages():
    d = Driver(H2O_HAND, plens=[8, 29], seed=12)
    assert d.m._widths(DecodeBatch(jnp.zeros((S,), jnp.int32), jnp.ones((S,), bool), 16)) \
        == (5 // TPP + 1, 0)
    snap = make_cache(baseline("snapkv", budget=5, window=2))
    assert snap._widths(DecodeBatch(jnp.zeros((S,), jnp.int32), jnp.ones((S,), bool), 16)) \
        == (16, 0)


# --------------------------------------------------------------------------- registry + engine


def test_registry_entries_store_kept_tokens_k8v8(tiny_model):
    cfg, _ = tiny_model
    for name in ("h2o", "streamingllm", "snapkv"):
        assert "(K8V8 storage)" in METHOD_SPECS[name].description
        m = make_method(name, cfg, max_seqs=2, max_context=128)
        assert m.high == Tier(8, 8) and m.low == Tier(8, 8) and not m.policy.low_tier
        assert m.policy.rule == name and m.policy.budget == 512
        with pytest.raises(ValueError, match="fixed by method"):
            make_method(name, cfg, max_seqs=2, max_context=128, high="K8V4")
        with pytest.raises(ValueError, match="do not apply"):
            make_method(name, cfg, max_seqs=2, max_context=128, alpha_high=2.0)
    assert make_method("h2o", cfg, max_seqs=1, max_context=64, budget_ratio=0.2).policy \
        .budget is None
    assert make_method("h2o", cfg, max_seqs=1, max_context=64, budget=100).policy.obs_window \
        is None
    m = make_method("streamingllm", cfg, max_seqs=1, max_context=64, window=20, sinks=2)
    assert m.policy.static_budget == 22
    with pytest.raises(ValueError, match="not both"):
        make_method("streamingllm", cfg, max_seqs=1, max_context=64, window=20, budget=30)
    m = make_method("snapkv", cfg, max_seqs=1, max_context=64, window=16, budget=100)
    assert m.policy.obs_window == 16 and m.policy.pooling == "max"
    with pytest.raises(ValueError, match="snapkv only"):
        make_method("h2o", cfg, max_seqs=1, max_context=64, pool_kernel=5)
    with pytest.raises(ValueError, match="chosen by method name"):
        make_method("diffkv", cfg, max_seqs=1, max_context=64, rule="h2o", low_tier=False)


@pytest.mark.parametrize("name,opts", [
    ("h2o", dict(budget=20, window=8)),
    ("streamingllm", dict(budget=20, sinks=4)),
    ("snapkv", dict(budget=20, window=8)),
])
def test_engine_generate_end_to_end(tiny_model, name, opts):
    cfg, params = tiny_model
    rng = np.random.default_rng(5)
    lens = (34, 40)  # one prefill bucket; with 20 new tokens one decode width
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in lens]
    m = make_method(name, cfg, max_seqs=2, max_context=64, page_size=16, **opts)
    num_pages = 2 * m.pages_for_tokens(64) + 16
    eng = Engine(cfg, params, m, num_pages=num_pages)
    reqs = eng.generate(prompts, SamplingParams(max_new_tokens=20))
    rows = cfg.num_layers * cfg.num_kv_heads
    tok_bytes = 2 * cfg.head_dim + 16  # K8V8 plus metadata
    for r, L in zip(reqs, lens):
        assert r.status == "finished" and len(r.output) == 20
        st = r.kv_stats
        n = L + 20 - 1
        assert st["tokens"] == n
        kept_tokens = n - L + 20 if name == "snapkv" else 20  # snapkv: budget + every new one
        assert st["data_bytes"] == rows * kept_tokens * tok_bytes, st
        assert st["frac_pruned"] == pytest.approx(1 - kept_tokens / n)
        if name != "snapkv":
            assert st["pages"] <= rows * (20 // m.cap(0) + 1)
    # No page leaks: every page is back in the free list.
    st = jax.device_get(eng.state)
    assert int(st.free.num_free) == num_pages
    assert (st.n_pages == 0).all() and (st.n_tok == 0).all()
    assert sorted(st.free.pages.tolist()) == list(range(num_pages))
