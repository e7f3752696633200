"""The DiffKV tiering policy as pure, vectorized array functions.

Importance of a token = accumulated attention probability it received (max
over the query heads of its GQA group) divided by the number of counted
queries that could see it. It is compared with thresholds ``alpha / n``:

* ``normalizer="length"`` (default): ``n`` is the sequence length (the prompt
  length at prefill, the current length at decode), as in DiffKV's own code;
* ``normalizer="token"``: ``n = i + 1`` for the token at position ``i`` (the
  summary's "1/i" reading; kept selectable for calibration to decide).

Prompt phase: the newest ``window`` tokens are high; others go high if
importance > alpha_high/n, low if >= alpha_low/n, and are pruned below. With
the low tier off the middle band stays high.

Generation phase (one decision per step per (sequence, layer, KV head), the
four actions of DiffKV's code): the new token always enters the high tier.
The *high victim* is the least important high token outside the recent
window. If its importance is <= alpha_high/n it leaves the high tier: into the
low tier when >= alpha_low/n (reusing the slot of the *low victim*, the least
important low token, when that one is below alpha_low/n and is thereby
pruned; else appended), or pruned otherwise. The newcomer takes the victim's
high slot; when the victim stays, the newcomer is appended. Tiers therefore
stay dense and each grows by at most one token per step.

A *fixed mix* (``high_frac``, ``low_frac``; for throughput sweeps at a chosen
tier mix, e.g. a real model's where only random weights can be run) replaces
the thresholds by quotas of the sequence length N: the prompt keeps its
window plus its most important tokens high up to ``ceil(high_frac * N)``,
the next ``ceil(low_frac * N)`` low and prunes the rest; at decode the high
victim leaves when the newcomer would put the high tier over its quota, and
the low victim is pruned (its slot reused) when the demoted token would put
the low tier over its quota. The victims are the same least important
tokens as with the thresholds.

Token-eviction baselines (``rule`` other than "diffkv") reuse the same machinery
with the low tier off: every kept token is high, an eviction is
PRUNE_HIGH_VICTIM with the victim chosen by the rule (the newcomer takes its
slot), otherwise APPEND. Each (sequence, layer, KV head) row keeps at most a
*budget* of tokens (:func:`row_budget`):

* ``"h2o"`` (Heavy-Hitter Oracle): prefill keeps the newest ``window`` prompt
  tokens plus the ``budget - window`` others with the highest *raw* accumulated
  score (summed probability, max over the GQA group: the scores DiffKV
  computes, over all prompt queries by default, ``obs_window=None``); decode,
  once a row would hold more than ``budget``, evicts the token outside the
  newest ``window`` with the lowest raw accumulated score. Raw, not DiffKV's
  importance (score / counted queries), because H2O ranks by accumulated
  attention; older tokens are seen by more queries and are favoured, as in H2O.
* ``"streamingllm"``: the first ``sinks`` tokens plus the newest
  ``budget - sinks``; decode evicts the oldest non-sink token once over budget.
  Scores are still accumulated but never consulted.
* ``"snapkv"``: prefill keeps the newest ``window`` prompt tokens plus the
  ``budget - window`` others with the most *votes*: the probability summed over
  the last ``obs_window`` prompt queries (SnapKV's observation window),
  smoothed by a 1-D max (or average) pool of ``pool_kernel`` over the candidate
  prefix (SnapKV's ``F.max_pool1d`` / ``F.avg_pool1d`` with padding
  ``kernel // 2``, stride 1); decode appends only (no eviction).

The budget counts every kept token, the window included (SnapKV's
``max_capacity_prompt``, the "512" of H2O-512). Ties are broken towards keeping
the newer token. A ``budget_ratio`` budget is computed from the row's prompt
length (a preempted request is re-prefilled from prompt + output, so its budget
is recomputed from that longer "prompt", and H2O's decode-time scores restart
from the prefill scores). The registry (:mod:`diffkv_jax.methods`) stores every
kept token K8V8.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

HIGH, LOW, PRUNED, EMPTY = 0, 1, 2, 3
APPEND, PRUNE_HIGH_VICTIM, DEMOTE_INTO_PRUNED_LOW, DEMOTE_INTO_NEW_LOW = 0, 1, 2, 3
#: Policy rules: DiffKV's tiering, then the token-eviction baselines.
RULES = ("diffkv", "h2o", "streamingllm", "snapkv")
EVICTION_RULES = RULES[1:]


@dataclasses.dataclass(frozen=True)
class DiffKVPolicy:
    """Thresholds and windows (static; part of the jit cache key).

    Attributes:
      alpha_high, alpha_low: thresholds relative to the uniform-attention mean.
      window: newest tokens that always stay high.
      obs_window: prompt queries whose probabilities are counted at prefill (the
        last ``obs_window``); ``None`` counts every prompt query.
      low_tier: False keeps everything that is not pruned in the high tier.
      normalizer: "length" or "token" (see module docstring).
      rule: "diffkv" (the thresholds above) or a token-eviction baseline, "h2o",
        "streamingllm" or "snapkv" (module docstring); the baselines ignore the
        alphas and the normalizer and need ``low_tier=False``.
      budget: tokens a row keeps (baselines only), window and sinks included.
      budget_ratio: instead of ``budget``, ``round(budget_ratio * prompt_len)`` per
        sequence (fixed at prefill), raised to :meth:`min_budget`.
        "streamingllm" with neither uses ``sinks + window``.
      sinks: "streamingllm": first tokens always kept (attention sinks).
      pool_kernel, pooling: "snapkv": odd kernel size and "max" or "avg" pooling of
        the votes.
      high_frac, low_frac: a fixed tier mix instead of the alphas ("diffkv" only;
        see the module docstring): fractions of the sequence kept high and low.
    """

    alpha_high: float = 1.0
    alpha_low: float = 0.02
    window: int = 64
    obs_window: int | None = 64
    low_tier: bool = True
    normalizer: str = "length"
    rule: str = "diffkv"
    budget: int | None = None
    budget_ratio: float | None = None
    sinks: int = 4
    pool_kernel: int = 7
    pooling: str = "max"
    high_frac: float | None = None
    low_frac: float | None = None

    @property
    def fixed_mix(self) -> bool:
        return self.high_frac is not None

    def __post_init__(self):
        if not self.alpha_high > self.alpha_low >= 0:
            raise ValueError(f"need alpha_high > alpha_low >= 0, got {self.alpha_high}, "
                             f"{self.alpha_low}")
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if self.obs_window is not None and self.obs_window < 1:
            raise ValueError("obs_window must be >= 1 or None")
        if self.normalizer not in ("length", "token"):
            raise ValueError(f"normalizer must be 'length' or 'token', got {self.normalizer!r}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if (self.high_frac is None) != (self.low_frac is None):
            raise ValueError("a fixed mix needs both high_frac and low_frac")
        if self.fixed_mix:
            if self.rule != "diffkv":
                raise ValueError("high_frac / low_frac apply to the diffkv rule only")
            if not (0 < self.high_frac <= 1 and 0 <= self.low_frac
                    and self.high_frac + self.low_frac <= 1):
                raise ValueError(f"need 0 < high_frac, 0 <= low_frac, high_frac + low_frac "
                                 f"<= 1; got {self.high_frac}, {self.low_frac}")
            if self.low_frac > 0 and not self.low_tier:
                raise ValueError("low_frac > 0 needs the low tier")
        if self.rule == "diffkv":
            if self.budget is not None or self.budget_ratio is not None:
                raise ValueError("budget / budget_ratio apply to the token-eviction rules only")
            return
        if self.low_tier:
            raise ValueError(f"rule {self.rule!r} keeps one tier: it needs low_tier=False")
        if self.budget is not None and self.budget_ratio is not None:
            raise ValueError("give budget or budget_ratio, not both")
        if self.budget is None and self.budget_ratio is None and self.rule != "streamingllm":
            raise ValueError(f"rule {self.rule!r} needs budget= or budget_ratio=")
        if self.budget_ratio is not None and not 0 < self.budget_ratio <= 1:
            raise ValueError(f"budget_ratio must be in (0, 1], got {self.budget_ratio}")
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.budget is not None and self.budget < self.min_budget:
            raise ValueError(f"rule {self.rule!r}: budget {self.budget} is below "
                             f"{self.min_budget} ({self._min_budget_why})")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be odd and >= 1, got {self.pool_kernel}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be 'max' or 'avg', got {self.pooling!r}")

    @property
    def min_budget(self) -> int:
        """Smallest per-row budget of an eviction rule (a ratio budget is raised to it)."""
        return self.sinks + 1 if self.rule == "streamingllm" else self.window

    @property
    def static_budget(self) -> int | None:
        """The per-row budget when it does not depend on the prompt (None for DiffKV or a
        ``budget_ratio``)."""
        if self.rule == "diffkv" or self.budget_ratio is not None:
            return None
        return self.budget if self.budget is not None else self.sinks + self.window

    @property
    def _min_budget_why(self) -> str:
        return ("sinks + one recent token" if self.rule == "streamingllm"
                else "the recent window is always kept")


def query_counts(policy: DiffKVPolicy, token_pos, prompt_len, cur_pos):
    """How many counted queries have seen each token (float32, >= 1 for real tokens).

    Counted queries: prompt positions in ``[prompt_len - obs_window, prompt_len)``
    (all prompt positions when ``obs_window`` is None) and every decode position
    ``prompt_len .. cur_pos``. A query at position j sees tokens at positions <= j.
    """
    token_pos = token_pos.astype(jnp.int32)
    obs_start = 0 if policy.obs_window is None else prompt_len - policy.obs_window
    prompt_part = jnp.maximum(0, prompt_len - jnp.maximum(token_pos, obs_start))
    decode_part = jnp.maximum(0, cur_pos + 1 - jnp.maximum(token_pos, prompt_len))
    return jnp.maximum(prompt_part + decode_part, 1).astype(jnp.float32)


def _norm(policy: DiffKVPolicy, seq_len, token_pos):
    n = token_pos + 1 if policy.normalizer == "token" else seq_len
    return jnp.asarray(n, jnp.float32)


def classify_prompt(policy: DiffKVPolicy, importance, prompt_len):
    """Tier of every prompt token.

    Args:
      importance: ``[..., T]`` float32.
      prompt_len: ``[...]`` int32 (positions >= prompt_len are padding).
    Returns:
      ``[..., T]`` int32 in {HIGH, LOW, PRUNED, EMPTY}.
    """
    T = importance.shape[-1]
    pos = jnp.arange(T, dtype=jnp.int32)
    L = prompt_len[..., None]
    if policy.fixed_mix:
        return _classify_by_quota(policy, importance, pos, L)
    n = _norm(policy, L, pos)
    th_h, th_l = policy.alpha_high / n, policy.alpha_low / n
    recent = pos >= L - policy.window
    high = recent | (importance > th_h)
    keep = high | (importance >= th_l)
    low = keep & ~high
    if not policy.low_tier:
        high, low = keep, jnp.zeros_like(low)
    tier = jnp.where(high, HIGH, jnp.where(low, LOW, PRUNED))
    return jnp.where(pos < L, tier, EMPTY).astype(jnp.int32)


def _quota(frac: float, n):
    """Tokens a tier may hold at sequence length ``n`` under a fixed mix."""
    return jnp.ceil(frac * jnp.asarray(n, jnp.float32) - 1e-6).astype(jnp.int32)


def _classify_by_quota(policy: DiffKVPolicy, importance, pos, L):
    """:func:`classify_prompt` under a fixed mix: the window, then the most important
    tokens, high up to the high quota; the next ones low up to the low quota."""
    real = pos < L
    recent = real & (pos >= L - policy.window)
    # Rank of each token among the candidates (real, outside the window), most
    # important first; ties go to the newer token.
    key = jnp.where(real & ~recent, importance, -jnp.inf)
    newer = jnp.broadcast_to(-pos, key.shape)
    order = jnp.lexsort((newer, -key), axis=-1)
    rank = jnp.argsort(order, axis=-1)
    n_recent = jnp.sum(recent, axis=-1, keepdims=True)
    high_room = jnp.maximum(_quota(policy.high_frac, L) - n_recent, 0)
    low_room = _quota(policy.low_frac, L)
    cand = real & ~recent
    high = recent | (cand & (rank < high_room))
    low = cand & ~high & (rank < high_room + low_room)
    tier = jnp.where(high, HIGH, jnp.where(low, LOW, PRUNED))
    return jnp.where(real, tier, EMPTY).astype(jnp.int32)


def decode_decision(policy: DiffKVPolicy, vh, imp_vh, pos_vh, vl, imp_vl, pos_vl, n_high,
                    n_low, cur_pos):
    """One generation-phase decision per row, from the rows' victims.

    Args:
      vh, imp_vh, pos_vh: ``[...]`` the high victim (the least important high token
        outside the recent window; slot -1 when there is none), its importance and
        position (:func:`pallas_kernels.policy_scores.score_victims` finds them).
      vl, imp_vl, pos_vl: the same for the low victim (the least important low token).
      n_high, n_low: ``[...]`` occupied slots per tier.
      cur_pos: ``[...]`` position of the newcomer (sequence length after it is N = cur_pos + 1).
    Returns:
      dict of ``[...]`` int32 arrays: ``action`` (APPEND, PRUNE_HIGH_VICTIM,
      DEMOTE_INTO_PRUNED_LOW, DEMOTE_INTO_NEW_LOW), ``victim_high``, ``victim_low``,
      ``new_slot`` (high slot the newcomer takes), ``low_slot`` (low slot the
      demoted victim takes, -1 if none), ``n_high``, ``n_low`` (after the step).
    """
    N = cur_pos + 1
    has_vh, has_vl = vh >= 0, vl >= 0
    if policy.fixed_mix:  # quotas of the sequence length instead of thresholds
        leaves = has_vh & (n_high + 1 > _quota(policy.high_frac, N))
        demote = leaves & (policy.low_frac > 0)
        reuse_low = demote & has_vl & (n_low + 1 > _quota(policy.low_frac, N))
    else:
        n_vh = _norm(policy, N, pos_vh)
        th_h, th_l = policy.alpha_high / n_vh, policy.alpha_low / n_vh
        if policy.low_tier:
            leaves = has_vh & (imp_vh <= th_h)
            demote = leaves & (imp_vh >= th_l)
        else:
            leaves = has_vh & (imp_vh < th_l)
            demote = jnp.zeros_like(leaves)
        # The low victim is pruned (its slot reused) only below its own alpha_low / n.
        reuse_low = demote & has_vl & (imp_vl < policy.alpha_low
                                       / _norm(policy, N, pos_vl))
    action = jnp.where(~leaves, APPEND,
                       jnp.where(~demote, PRUNE_HIGH_VICTIM,
                                 jnp.where(reuse_low, DEMOTE_INTO_PRUNED_LOW,
                                           DEMOTE_INTO_NEW_LOW)))
    new_slot = jnp.where(leaves, vh, n_high)
    low_slot = jnp.where(reuse_low, vl, jnp.where(demote, n_low, -1))
    return {
        "action": action.astype(jnp.int32),
        "victim_high": jnp.where(leaves, vh, -1).astype(jnp.int32),
        "victim_low": jnp.where(reuse_low, vl, -1).astype(jnp.int32),
        "new_slot": new_slot.astype(jnp.int32),
        "low_slot": low_slot.astype(jnp.int32),
        "n_high": (n_high + (~leaves)).astype(jnp.int32),
        "n_low": (n_low + (demote & ~reuse_low)).astype(jnp.int32),
    }


# ---- token-eviction baselines --------------------------------------------------------------


def row_budget(policy: DiffKVPolicy, prompt_len):
    """Tokens each row may keep under an eviction rule: ``[...]`` int32 from ``prompt_len [...]``.

    ``budget`` when given; else ``round(budget_ratio * prompt_len)`` (half up), at least
    :attr:`DiffKVPolicy.min_budget`; "streamingllm" with neither keeps ``sinks + window``.
    """
    prompt_len = jnp.asarray(prompt_len, jnp.int32)
    if policy.static_budget is not None:
        return jnp.full(prompt_len.shape, policy.static_budget, jnp.int32)
    b = jnp.floor(jnp.float32(policy.budget_ratio) * prompt_len.astype(jnp.float32) + 0.5)
    return jnp.maximum(b.astype(jnp.int32), policy.min_budget)


def snapkv_votes(policy: DiffKVPolicy, score_sum, candidate):
    """SnapKV's pooled votes over the candidate prefix.

    Args:
      score_sum: ``[..., T]`` probability summed over the observation window.
      candidate: ``[..., T]`` bool, a prefix ``[0, n)`` of each row (the tokens before
        the kept window).
    Returns:
      ``[..., T]`` float32: a ``pool_kernel``-wide, stride-1 max (or average) pool over
      the candidates, padded by ``pool_kernel // 2`` on both sides (max: the padding
      never wins; avg: padding counts as zeros and the sum is divided by the kernel
      size, as ``F.avg_pool1d``'s default); ``-inf`` outside the candidates.
    """
    r = policy.pool_kernel // 2
    fill = -jnp.inf if policy.pooling == "max" else 0.0
    x = jnp.where(candidate, score_sum.astype(jnp.float32), fill)
    T = x.shape[-1]
    pad = [(0, 0)] * (x.ndim - 1) + [(r, r)]
    xp = jnp.pad(x, pad, constant_values=fill)
    shifted = [xp[..., o:o + T] for o in range(2 * r + 1)]
    if policy.pooling == "max":
        pooled = functools.reduce(jnp.maximum, shifted)
    else:
        pooled = functools.reduce(jnp.add, shifted) / jnp.float32(policy.pool_kernel)
    return jnp.where(candidate, pooled, -jnp.inf)


def _rank_desc(key, pos):
    """Rank of every entry by ``key`` descending, ties to the larger ``pos`` (0 = best)."""
    order = jnp.lexsort((-pos, -key), axis=-1)
    ranks = jnp.broadcast_to(jnp.arange(key.shape[-1], dtype=jnp.int32), key.shape)
    return jnp.put_along_axis(jnp.zeros(key.shape, jnp.int32), order, ranks, axis=-1,
                              inplace=False)


def select_prompt(policy: DiffKVPolicy, score_sum, prompt_len):
    """Prompt tokens an eviction rule keeps: ``[..., T]`` int32 in {HIGH, PRUNED, EMPTY}.

    Args:
      score_sum: ``[..., T]`` float32 summed probabilities (raw, not normalized), over the
        prompt queries the policy counts (``obs_window``).
      prompt_len: ``[...]`` int32 (positions >= prompt_len are padding).
    """
    T = score_sum.shape[-1]
    pos = jnp.arange(T, dtype=jnp.int32)
    L = prompt_len[..., None]
    B = row_budget(policy, prompt_len)[..., None]
    real = pos < L
    if policy.rule == "streamingllm":
        keep = (pos < policy.sinks) | (pos >= L - (B - policy.sinks))
    else:
        recent = pos >= L - policy.window
        cand = real & ~recent
        if policy.rule == "snapkv":
            key = snapkv_votes(policy, score_sum, cand)
        else:
            key = jnp.where(cand, score_sum.astype(jnp.float32), -jnp.inf)
        rank = _rank_desc(key, jnp.broadcast_to(pos, key.shape))
        keep = recent | (cand & (rank < B - policy.window))
    tier = jnp.where(keep, HIGH, PRUNED)
    return jnp.where(real, tier, EMPTY).astype(jnp.int32)


def evict_decision(policy: DiffKVPolicy, vh, n_high, n_low, prompt_len):
    """One decode decision per row under an eviction rule (same outputs as :func:`decode_decision`).

    The newcomer joins the row; if the row would then hold more than its
    :func:`row_budget`, the rule's victim ``vh`` (slot, -1 when none is eligible) is
    pruned (PRUNE_HIGH_VICTIM, the newcomer takes its slot), else the newcomer is
    appended (APPEND). Victims (:func:`pallas_kernels.policy_scores.score_victims`):
    "h2o" the lowest raw accumulated score outside the newest ``window`` positions
    (ties: the older token); "streamingllm" the oldest token at position >= ``sinks``;
    "snapkv" never evicts.

    Args:
      vh, n_high, n_low, prompt_len: ``[...]`` int32.
    """
    over = n_high + 1 > row_budget(policy, prompt_len)
    leaves = over & (vh >= 0)
    action = jnp.where(leaves, PRUNE_HIGH_VICTIM, APPEND)
    return {
        "action": action.astype(jnp.int32),
        "victim_high": jnp.where(leaves, vh, -1).astype(jnp.int32),
        "victim_low": jnp.full(n_high.shape, -1, jnp.int32),
        "new_slot": jnp.where(leaves, vh, n_high).astype(jnp.int32),
        "low_slot": jnp.full(n_high.shape, -1, jnp.int32),
        "n_high": (n_high + (~leaves)).astype(jnp.int32),
        "n_low": jnp.asarray(n_low, jnp.int32),
    }


def victim_rule(policy: DiffKVPolicy):
    """The victim search settings of ``policy`` (:class:`~pallas_kernels.policy_scores.VictimRule`)."""
    from pallas_kernels.policy_scores import VictimRule

    return VictimRule(rule=policy.rule, window=policy.window, sinks=policy.sinks,
                      obs_window=policy.obs_window)
