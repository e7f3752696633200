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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

HIGH, LOW, PRUNED, EMPTY = 0, 1, 2, 3
APPEND, PRUNE_HIGH_VICTIM, DEMOTE_INTO_PRUNED_LOW, DEMOTE_INTO_NEW_LOW = 0, 1, 2, 3


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
    """

    alpha_high: float = 1.0
    alpha_low: float = 0.02
    window: int = 64
    obs_window: int | None = 64
    low_tier: bool = True
    normalizer: str = "length"

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


def decode_decision(policy: DiffKVPolicy, imp_high, pos_high, valid_high, imp_low, pos_low,
                    valid_low, n_high, n_low, cur_pos):
    """One generation-phase decision per row.

    Args:
      imp_high: ``[..., Nh]`` importance of high slots; pos_high their positions;
        valid_high marks occupied slots (the newcomer is not among them).
      imp_low, pos_low, valid_low: ``[..., Nl]`` the same for the low slots.
      n_high, n_low: ``[...]`` occupied slots per tier.
      cur_pos: ``[...]`` position of the newcomer (sequence length after it is N = cur_pos + 1).
    Returns:
      dict of ``[...]`` int32 arrays: ``action`` (APPEND, PRUNE_HIGH_VICTIM,
      DEMOTE_INTO_PRUNED_LOW, DEMOTE_INTO_NEW_LOW), ``victim_high``, ``victim_low``,
      ``new_slot`` (high slot the newcomer takes), ``low_slot`` (low slot the
      demoted victim takes, -1 if none), ``n_high``, ``n_low`` (after the step).
    """
    inf = jnp.float32(jnp.inf)
    N = (cur_pos + 1)[..., None]
    eligible = valid_high & (pos_high <= cur_pos[..., None] - policy.window)
    vh = jnp.argmin(jnp.where(eligible, imp_high, inf), axis=-1).astype(jnp.int32)
    has_vh = eligible.any(-1)
    imp_vh = jnp.take_along_axis(imp_high, vh[..., None], axis=-1)[..., 0]
    pos_vh = jnp.take_along_axis(pos_high, vh[..., None], axis=-1)[..., 0]
    n_vh = _norm(policy, N[..., 0], pos_vh)
    th_h, th_l = policy.alpha_high / n_vh, policy.alpha_low / n_vh

    if valid_low.shape[-1]:
        vl = jnp.argmin(jnp.where(valid_low, imp_low, inf), axis=-1).astype(jnp.int32)
        imp_vl = jnp.take_along_axis(imp_low, vl[..., None], axis=-1)[..., 0]
        pos_vl = jnp.take_along_axis(pos_low, vl[..., None], axis=-1)[..., 0]
        has_vl = valid_low.any(-1)
    else:
        vl = jnp.zeros(n_low.shape, jnp.int32)
        imp_vl = jnp.full(n_low.shape, inf)
        pos_vl = jnp.zeros(n_low.shape, jnp.int32)
        has_vl = jnp.zeros(n_low.shape, bool)

    if policy.low_tier:
        leaves = has_vh & (imp_vh <= th_h)
        demote = leaves & (imp_vh >= th_l)
    else:
        leaves = has_vh & (imp_vh < th_l)
        demote = jnp.zeros_like(leaves)
    # The low victim is pruned (and its slot reused) only below its own alpha_low / n.
    reuse_low = demote & has_vl & (imp_vl < policy.alpha_low / _norm(policy, N[..., 0], pos_vl))
    action = jnp.where(~leaves, APPEND,
                       jnp.where(~demote, PRUNE_HIGH_VICTIM,
                                 jnp.where(reuse_low, DEMOTE_INTO_PRUNED_LOW,
                                           DEMOTE_INTO_NEW_LOW)))
    new_slot = jnp.where(leaves, vh, n_high)
    low_slot = jnp.where(reuse_low, vl, jnp.where(demote, n_low, -1))
    return {
        "action": action.astype(jnp.int32),
        "victim_high": jnp.where(leaves, vh, -1),
        "victim_low": jnp.where(reuse_low, vl, -1),
        "new_slot": new_slot.astype(jnp.int32),
        "low_slot": low_slot.astype(jnp.int32),
        "n_high": (n_high + (~leaves)).astype(jnp.int32),
        "n_low": (n_low + (demote & ~reuse_low)).astype(jnp.int32),
    }
