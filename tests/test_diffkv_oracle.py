"""The DiffKV cache's prefill classification and decode tiering match a plain-Python oracle.

No model: the cache is driven with random keys/values and random (but persistent per
token) attention score streams. After prefill and after every decode step, each
(row, KV head)'s high and low position sets, their scores (bitwise), the token
counters and the stored keys/values (within quantization error) are compared with
:mod:`tests.diffkv_oracle`, which implements the rules independently of
``diffkv_policy``. Inactive rows must not change at all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.diffkv_policy import DiffKVPolicy
from tests.diffkv_oracle import HIGH, LOW, RowOracle

S, H, D = 3, 2, 16
T_PAD = 32  # prefill bucket
TPP = 4  # high-tier tokens per page
WINDOW = 4


def make_cache(policy: DiffKVPolicy, steps: int) -> DiffKVCache:
    return DiffKVCache(num_layers=1, num_kv_heads=H, head_dim=D, max_seqs=S,
                       max_context=T_PAD + steps + 1, policy=policy, tokens_per_page=TPP)


@functools.lru_cache(maxsize=None)
def compiled(m: DiffKVCache):
    """Jitted prefill / view / decode step for one cache method (static via closure)."""
    W = m.row_len  # gather every page column of each tier

    def view(state):
        return m.gather_rows(state, 0, 0, W), m.gather_rows(state, 0, 1, W)

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
        """pfull [S, H, max_context]: this step's probability of every position."""
        hi, lo = view(state)
        mc = pfull.shape[-1]
        take = lambda rv: jnp.where(  # noqa: E731
            rv.valid, jnp.take_along_axis(pfull, jnp.clip(rv.positions, 0, mc - 1), axis=-1), 0.0)
        state = m.decode_update(state, 0, k_new, v_new, hi, lo, take(hi), take(lo), p_new, active)
        state = m.end_decode(state, DecodeBatch(jnp.zeros((S,), jnp.int32), active, W))
        return state, view(state)

    return prefill, step


def quant_tol(x: np.ndarray, bits_hi: int, bits_lo: int | None) -> float:
    """Max dequantization error of vector ``x`` stored at bits_hi (then re-quantized to bits_lo)."""
    r = float(x.max() - x.min())
    eps = 1e-5 * float(np.abs(x).max()) + 1e-6
    step_h = r / (2 ** bits_hi - 1)
    if bits_lo is None:
        return 0.51 * step_h + eps
    return 0.51 * step_h + 0.51 * (r + step_h) / (2 ** bits_lo - 1) + eps


class Harness:
    """Drives one cache method and its oracles; compares after every call."""

    def __init__(self, policy: DiffKVPolicy, steps: int, prompt_lens, seed: int,
                 check_kv: bool = True):
        self.policy, self.steps, self.seed = policy, steps, seed
        self.m = make_cache(policy, steps)
        self.prefill_fn, self.step_fn = compiled(self.m)
        self.rng = np.random.default_rng(seed)
        self.plens = list(prompt_lens)
        self.mc = self.m.max_context
        # Persistent per-token "attention weight" (lognormal, mean 1) that fades to a tenth
        # some random time after the token arrives, so tokens drift down the tiers.
        self.w = (self.rng.lognormal(0.0, 1.0, size=(S, H, self.mc)) / np.exp(0.5))
        self.fade_at = np.arange(self.mc) + self.rng.geometric(1 / 25, size=(S, H, self.mc))
        self.kv: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.check_kv = check_kv
        self.events: dict[str, int] = {}
        pargs = dict(alpha_high=policy.alpha_high, alpha_low=policy.alpha_low,
                     window=policy.window, obs_window=policy.obs_window,
                     low_tier=policy.low_tier, normalizer=policy.normalizer)
        self.oracles = [[RowOracle(prompt_len=pl, **pargs) for _ in range(H)] for pl in self.plens]
        num_pages = S * self.m.pages_for_tokens(self.mc) + 8
        self.state = self.m.init_state(num_pages)
        self.num_pages = num_pages

    # ---- driving ----------------------------------------------------------------------
    def prefill(self):
        B = S + 1  # one padding row into the scratch slot
        k = self.rng.standard_normal((B, T_PAD, H, D)).astype(np.float32)
        v = self.rng.standard_normal((B, T_PAD, H, D)).astype(np.float32)
        lengths = np.array(self.plens + [0], np.int32)
        slots = np.arange(B, dtype=np.int32)  # slot S is the scratch slot
        score_sum = np.zeros((B, H, T_PAD), np.float32)
        for s, pl in enumerate(self.plens):
            o = self.oracles[s][0]
            counts = np.array([o.count(p, pl - 1) for p in range(pl)], np.float32)
            noise = self.rng.gamma(4.0, 0.25, size=(H, pl))
            u = self.w[s, :, :pl] * noise
            score_sum[s, :, :pl] = (counts * u / pl).astype(np.float32)
            score_sum[s, :, pl:] = self.rng.uniform(0, 1, size=(H, T_PAD - pl))  # padding junk
            for h in range(H):
                for p in range(pl):
                    self.kv[s, h, p] = (k[s, p, h], v[s, p, h])
        self.state, views = self.prefill_fn(self.state, jnp.asarray(lengths), jnp.asarray(slots),
                                            jnp.asarray(k), jnp.asarray(v),
                                            jnp.asarray(score_sum))
        for s in range(S):
            for h in range(H):
                self.oracles[s][h].prefill(score_sum[s, h])
        self.compare(views, "after prefill")

    def decode(self, step: int, active: np.ndarray):
        pfull = np.zeros((S, H, self.mc), np.float32)
        p_new = np.zeros((S, H), np.float32)
        k_new = self.rng.standard_normal((S, H, D)).astype(np.float32)
        v_new = self.rng.standard_normal((S, H, D)).astype(np.float32)
        for s in range(S):
            cur = self.oracles[s][0].next_pos
            for h in range(H):
                fade = np.where(self.fade_at[s, h, :cur + 1] <= cur, 0.1, 1.0)
                x = self.w[s, h, :cur + 1] * fade * self.rng.gamma(4.0, 0.25, size=cur + 1)
                p = (x / x.sum()).astype(np.float32)
                pfull[s, h, :cur + 1] = p
                p_new[s, h] = p[cur]
            if not active[s]:
                # Junk the inactive rows' inputs: they must be ignored.
                pfull[s] = self.rng.uniform(0.5, 1.0, size=pfull[s].shape)
                p_new[s] = 7.0
        before = jax.device_get(self.state)
        self.state, views = self.step_fn(self.state, jnp.asarray(pfull), jnp.asarray(p_new),
                                         jnp.asarray(k_new), jnp.asarray(v_new),
                                         jnp.asarray(active))
        for s in range(S):
            if not active[s]:
                continue
            for h in range(H):
                o = self.oracles[s][h]
                ev = o.decode(pfull[s, h], p_new[s, h])
                self.events[ev["action"]] = self.events.get(ev["action"], 0) + 1
                self.kv[s, h, ev["cur"]] = (k_new[s, h], v_new[s, h])
        self.check_inactive_unchanged(before, active, step)
        self.compare(views, f"after decode step {step} (active={active.tolist()})")

    # ---- checks -----------------------------------------------------------------------
    def check_inactive_unchanged(self, before, active, step):
        after = jax.device_get(self.state)
        for s in np.flatnonzero(~active):
            for name in ("page_table", "n_tok", "n_pages"):
                np.testing.assert_array_equal(getattr(after, name)[s], getattr(before, name)[s],
                                              err_msg=f"step {step}: inactive row {s} {name}")
            assert after.seq_len[s] == before.seq_len[s]
            assert after.prompt_len[s] == before.prompt_len[s]
            # Every slot of every page the row owns is untouched.
            R = self.m.row_len
            j = np.arange(R)
            npg = before.n_pages[s, 0]  # [H, 2]
            owned = (j < npg[:, :1]) | (j >= R - npg[:, 1:])
            pages = before.page_table[s, 0][owned]
            for name in ("data", "scores", "positions", "k_meta", "v_meta"):
                np.testing.assert_array_equal(
                    getattr(after, name)[pages], getattr(before, name)[pages],
                    err_msg=f"step {step}: page data of inactive row {s} changed ({name})")

    def compare(self, views, where):
        hi, lo = jax.device_get(views)
        self.last_views = (hi, lo)
        st = jax.device_get(self.state)
        assert not bool(st.alloc_failed), where
        m = self.m
        for s in range(S):
            assert int(st.seq_len[s]) == self.oracles[s][0].next_pos, where
            for h in range(H):
                o = self.oracles[s][h]
                assert not (o.positions(HIGH) & o.positions(LOW))
                for t, rv, name in ((0, hi, HIGH), (1, lo, LOW)):
                    ok = rv.valid[s, h]
                    pos = rv.positions[s, h][ok]
                    got = set(pos.tolist())
                    exp = o.positions(name)
                    msg = self._mismatch_msg(where, s, h, name, got, exp, o)
                    assert len(got) == len(pos), f"{where}: duplicate positions in {name}: {msg}"
                    assert got == exp, msg
                    assert not (got & o.pruned), f"{where}: pruned token came back: {msg}"
                    assert int(st.n_tok[s, 0, h, t]) == len(exp), msg
                    sc = rv.scores[s, h][ok]
                    exp_sc = np.array([o.score[p] for p in pos.tolist()], np.float32)
                    bad = sc != exp_sc
                    assert not bad.any(), (
                        f"{where}: row {s} head {h} {name} score mismatch at positions "
                        f"{pos[bad].tolist()}: cache {sc[bad].tolist()} "
                        f"oracle {exp_sc[bad].tolist()}")
                    # Headroom: the next token of each used tier has an allocated slot.
                    if t == 0 or self.policy.low_tier:
                        assert len(exp) + 1 <= int(st.n_pages[s, 0, h, t]) * m.cap(t), where
                    if self.check_kv:
                        self._check_kv(rv, s, h, ok, pos, t, where)

    def _check_kv(self, rv, s, h, ok, pos, t, where):
        m = self.m
        keys, vals = rv.keys[s, h][ok], rv.values[s, h][ok]
        o = self.oracles[s][h]
        for i, p in enumerate(pos.tolist()):
            k0, v0 = self.kv[s, h, p]
            if t == 0:
                tk, tv = quant_tol(k0, m.high.k_bits, None), quant_tol(v0, m.high.v_bits, None)
            else:
                tk = quant_tol(k0, m.high.k_bits, m.low.k_bits)
                tv = quant_tol(v0, m.high.v_bits, m.low.v_bits)
            ek, ev = np.abs(keys[i] - k0).max(), np.abs(vals[i] - v0).max()
            assert ek <= tk and ev <= tv, (
                f"{where}: row {s} head {h} tier {t} pos {p}: stored K/V off by {ek:.4g}/{ev:.4g} "
                f"(tolerance {tk:.4g}/{tv:.4g}); plen {o.plen}")

    @staticmethod
    def _mismatch_msg(where, s, h, name, got, exp, o):
        ties = o.near_ties[-10:]
        tie_note = ("\nNEAR FLOAT TIES recorded by the oracle (mismatch may be a tie, not a "
                    "logic bug):\n  " + "\n  ".join(ties)) if ties else ""
        return (f"{where}: row {s} head {h} {name} tier differs (plen {o.plen}, next pos "
                f"{o.next_pos}):\n  only in cache: {sorted(got - exp)}\n  only in oracle: "
                f"{sorted(exp - got)}{tie_note}")


POLICIES = [
    # (alpha_high, alpha_low, low_tier, normalizer, obs_window)
    (1.0, 0.3, True, "length", 8),
    (2.0, 0.6, True, "token", None),
    (1.0, 0.0, True, "token", 8),
    (2.0, 0.3, True, "length", None),
    (1.0, 0.6, True, "token", 8),
    (1.0, 0.3, False, "length", 8),
    (2.0, 0.6, False, "token", None),
    (2.0, 0.3, False, "token", 8),
]


@pytest.mark.parametrize("alpha_high,alpha_low,low_tier,normalizer,obs_window", POLICIES)
def test_cache_matches_oracle(alpha_high, alpha_low, low_tier, normalizer, obs_window):
    steps = 120
    policy = DiffKVPolicy(alpha_high=alpha_high, alpha_low=alpha_low, window=WINDOW,
                          obs_window=obs_window, low_tier=low_tier, normalizer=normalizer)
    seed = POLICIES.index((alpha_high, alpha_low, low_tier, normalizer, obs_window))
    rng = np.random.default_rng(1000 + seed)
    plens = [3, int(rng.integers(9, 17)), int(rng.integers(20, T_PAD + 1))]
    hz = Harness(policy, steps, plens, seed)
    hz.prefill()
    for i in range(steps):
        active = rng.random(S) < 0.75
        hz.decode(i, active)
    # The random streams exercise the interesting actions.
    ev = hz.events
    if alpha_low > 0:
        assert ev.get("prune_victim", 0) > 0, ev
    if low_tier:
        assert ev.get("demote_append", 0) + ev.get("demote_into_pruned_low", 0) > 0, ev
        if alpha_low > 0:
            assert ev.get("demote_into_pruned_low", 0) > 0, ev


def test_no_low_tier_and_zero_alpha_low_never_evicts():
    """alpha_low = 0 without a low tier: every token stays high forever."""
    steps = 150
    policy = DiffKVPolicy(alpha_high=1.0, alpha_low=0.0, window=WINDOW, obs_window=8,
                          low_tier=False, normalizer="length")
    hz = Harness(policy, steps, [5, 17, 30], seed=77, check_kv=False)
    hz.prefill()
    rng = np.random.default_rng(78)
    for i in range(steps):
        hz.decode(i, rng.random(S) < 0.8)
        hi, _ = hz.last_views
        st = jax.device_get(hz.state)
        for s in range(S):
            n = int(st.seq_len[s])
            for h in range(H):
                got = sorted(hi.positions[s, h][hi.valid[s, h]].tolist())
                assert got == list(range(n)), (i, s, h)
                assert int(st.n_tok[s, 0, h, 1]) == 0 and int(st.n_pages[s, 0, h, 1]) == 0
    assert set(hz.events) == {"append"}, hz.events
