"""DiffKV at a fixed tier mix (quotas of the sequence length instead of thresholds)."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.diffkv_policy import (APPEND, DEMOTE_INTO_NEW_LOW, DEMOTE_INTO_PRUNED_LOW,
                                      EMPTY, HIGH, LOW, PRUNE_HIGH_VICTIM, PRUNED, DiffKVPolicy,
                                      classify_prompt, decode_decision)
from diffkv_jax.methods import make_method
from diffkv_jax.scoring import score_teacher_forced


def test_prompt_keeps_the_window_then_the_most_important_up_to_the_quotas():
    p = DiffKVPolicy(window=2, high_frac=0.4, low_frac=0.3)
    imp = jnp.asarray([[0.5, 0.1, 0.9, 0.2, 0.3, 0.05, 0.7, 0.6, 0.0, 0.0],
                       [0.1] * 10])
    tiers = np.asarray(classify_prompt(p, imp, jnp.asarray([8, 10])))
    H, L, X, E = HIGH, LOW, PRUNED, EMPTY
    # Row 0, 8 tokens: window {6, 7} + the two most important (2, 0) high (ceil(3.2) = 4),
    # the next three (4, 3, 1) low (ceil(2.4) = 3), the last one pruned.
    assert tiers[0].tolist() == [H, L, H, L, L, X, H, H, E, E]
    # Row 1, all tied: the newer tokens win.
    assert tiers[1].tolist() == [X, X, X, L, L, L, H, H, H, H]


def test_decode_decisions_follow_the_quotas():
    p = DiffKVPolicy(window=2, high_frac=0.5, low_frac=0.25)
    one = lambda x: jnp.asarray([x])  # noqa: E731
    # N = 10: quotas 5 high, 3 low (ceil(2.5)); (n_high, n_low, has a low victim) -> action
    cases = [
        (4, 2, True, APPEND),                   # the newcomer fits the high quota
        (5, 2, True, DEMOTE_INTO_NEW_LOW),      # it does not: the victim moves to low
        (5, 3, True, DEMOTE_INTO_PRUNED_LOW),   # low is full too: its victim is pruned
        (5, 3, False, DEMOTE_INTO_NEW_LOW),     # ... unless it has none
    ]
    for n_high, n_low, has_vl, action in cases:
        d = decode_decision(p, one(0), one(0.1), one(0), one(0 if has_vl else -1), one(0.0),
                            one(1), one(n_high), one(n_low), one(9))
        assert int(d["action"][0]) == action, (n_high, n_low, has_vl)
    no_low = DiffKVPolicy(window=2, high_frac=0.5, low_frac=0.0)
    d = decode_decision(no_low, one(0), one(0.1), one(0), one(-1), one(0.0), one(1), one(5),
                        one(0), one(9))
    assert int(d["action"][0]) == PRUNE_HIGH_VICTIM


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_cache_holds_the_fixed_mix(tiny_model, impl):
    cfg, params = tiny_model
    rng = np.random.default_rng(2)
    docs = [list(rng.integers(0, cfg.vocab_size, size=110)) for _ in range(2)]
    m = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=8, window=4,
                    high_frac=0.35, low_frac=0.3, attention_impl=impl)
    res = score_teacher_forced(cfg, params, m, docs, 40, progress=False)
    mem = res.memory
    assert abs(mem["frac_high"] - 0.35) < 0.02
    assert abs(mem["frac_low"] - 0.3) < 0.02
    assert abs(mem["frac_pruned"] - 0.35) < 0.03


def test_fixed_mix_validation():
    with pytest.raises(ValueError, match="both"):
        DiffKVPolicy(high_frac=0.5)
    with pytest.raises(ValueError, match="<= 1"):
        DiffKVPolicy(high_frac=0.8, low_frac=0.3)
    with pytest.raises(ValueError, match="low tier"):
        DiffKVPolicy(high_frac=0.5, low_frac=0.2, low_tier=False)
