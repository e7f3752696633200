"""Plain-Python reference for the DiffKV tiering rules, one (sequence, layer, KV head) row.

Written from the rules alone (not from ``diffkv_policy``): a dict ``position -> tier``
and ``position -> score`` per row, with float32 arithmetic in the cache's order
(scores accumulated by float32 addition, importance = float32 score / float32 count,
threshold = float32 alpha / float32 n), so decisions match bit for bit.

Every comparison whose two sides are within ``TIE_RTOL`` of each other (an argmin
between two nearly equal importances, an importance nearly equal to a threshold) is
recorded in ``near_ties`` so a mismatch there can be reported as a float tie rather
than a logic error.
"""

from __future__ import annotations

import numpy as np

HIGH, LOW = "high", "low"
TIE_RTOL = 1e-6

f32 = np.float32


def _near(a, b) -> bool:
    a, b = float(a), float(b)
    return abs(a - b) <= TIE_RTOL * max(abs(a), abs(b), 1e-30)


class RowOracle:
    """One row's tiers under the DiffKV rules.

    Args:
      alpha_high, alpha_low, window, obs_window, low_tier, normalizer: the policy.
      prompt_len: the row's prompt length.
    """

    def __init__(self, *, alpha_high, alpha_low, window, obs_window, low_tier, normalizer,
                 prompt_len):
        self.alpha_high, self.alpha_low = alpha_high, alpha_low
        self.window, self.obs_window = window, obs_window
        self.low_tier, self.normalizer = low_tier, normalizer
        self.plen = int(prompt_len)
        self.next_pos = self.plen  # position of the next decoded token
        self.tier: dict[int, str] = {}
        self.score: dict[int, np.float32] = {}
        self.pruned: set[int] = set()
        self.near_ties: list[str] = []
        self.step = 0

    # ---- rules ----------------------------------------------------------------------
    def count(self, pos: int, cur_pos: int) -> int:
        """Counted queries that saw token ``pos`` once the query at ``cur_pos`` has run."""
        if self.obs_window is None:
            prompt_queries = range(0, self.plen)
        else:
            prompt_queries = range(max(0, self.plen - self.obs_window), self.plen)
        n_prompt = sum(1 for j in prompt_queries if j >= pos)
        n_decode = sum(1 for j in range(self.plen, cur_pos + 1) if j >= pos)
        return max(1, n_prompt + n_decode)

    def importance(self, pos: int, cur_pos: int) -> np.float32:
        return f32(f32(self.score[pos]) / f32(self.count(pos, cur_pos)))

    def threshold(self, alpha: float, pos: int, seq_len: int) -> np.float32:
        n = seq_len if self.normalizer == "length" else pos + 1
        return f32(f32(alpha) / f32(n))

    def _tie(self, what: str, a, b) -> None:
        if _near(a, b):
            self.near_ties.append(f"step {self.step}: {what}: {float(a)!r} vs {float(b)!r}")

    def _argmin(self, positions, cur_pos, what):
        """Least important of ``positions`` (None if empty); records near ties."""
        if not positions:
            return None
        imps = sorted((self.importance(p, cur_pos), p) for p in positions)
        if len(imps) > 1:
            self._tie(f"{what} argmin between {imps[0][1]} and {imps[1][1]}",
                      imps[0][0], imps[1][0])
        return imps[0][1]

    # ---- phases -----------------------------------------------------------------------
    def prefill(self, score_sum) -> None:
        """Classify the prompt from ``score_sum [>= prompt_len]`` (float32)."""
        L = self.plen
        cur = L - 1  # prefill counts no decode query
        for pos in range(L):
            self.score[pos] = f32(score_sum[pos])
            if pos >= L - self.window:
                self.tier[pos] = HIGH
                continue
            imp = self.importance(pos, cur)
            th_h = self.threshold(self.alpha_high, pos, L)
            th_l = self.threshold(self.alpha_low, pos, L)
            self._tie(f"prefill pos {pos} vs th_h", imp, th_h)
            self._tie(f"prefill pos {pos} vs th_l", imp, th_l)
            if imp > th_h:
                self.tier[pos] = HIGH
            elif imp >= th_l:
                self.tier[pos] = LOW if self.low_tier else HIGH
            else:
                self._prune(pos)

    def _prune(self, pos: int) -> None:
        self.tier.pop(pos, None)
        self.score.pop(pos, None)
        self.pruned.add(pos)

    def decode(self, p, p_new) -> dict:
        """One decode step; ``p[pos]`` (float32) is this step's probability of cached ``pos``.

        Returns a description of what happened (for diagnostics).
        """
        self.step += 1
        cur = self.next_pos
        n = cur + 1
        for pos in self.tier:
            self.score[pos] = f32(f32(self.score[pos]) + f32(p[pos]))
        event = {"cur": cur, "victim": None, "action": "append", "low_victim": None}
        cands = [q for q, t in self.tier.items() if t == HIGH and q <= cur - self.window]
        victim = self._argmin(cands, cur, "high victim")
        if victim is not None:
            imp = self.importance(victim, cur)
            th_h = self.threshold(self.alpha_high, victim, n)
            th_l = self.threshold(self.alpha_low, victim, n)
            event["victim"] = victim
            if self.low_tier:
                self._tie(f"victim {victim} vs th_h", imp, th_h)
                leaves = imp <= th_h
            else:
                self._tie(f"victim {victim} vs th_l", imp, th_l)
                leaves = imp < th_l
            if leaves:
                if self.low_tier:
                    self._tie(f"victim {victim} vs th_l", imp, th_l)
                if self.low_tier and imp >= th_l:
                    lows = [q for q, t in self.tier.items() if t == LOW]
                    lv = self._argmin(lows, cur, "low victim")
                    event["action"] = "demote_append"
                    if lv is not None:
                        imp_lv = self.importance(lv, cur)
                        th_l_lv = self.threshold(self.alpha_low, lv, n)
                        self._tie(f"low victim {lv} vs its th_l", imp_lv, th_l_lv)
                        if imp_lv < th_l_lv:
                            self._prune(lv)
                            event["action"] = "demote_into_pruned_low"
                            event["low_victim"] = lv
                    self.tier[victim] = LOW
                else:
                    self._prune(victim)
                    event["action"] = "prune_victim"
        self.tier[cur] = HIGH
        self.score[cur] = f32(p_new)
        self.next_pos = cur + 1
        return event

    # ---- views ------------------------------------------------------------------------
    def positions(self, tier: str) -> set[int]:
        return {q for q, t in self.tier.items() if t == tier}
