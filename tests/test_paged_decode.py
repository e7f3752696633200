"""Paged prefill + token-by-token decode reproduces a cache-free full forward."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.steps import CompiledSteps, forward_no_cache

TEXTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, "
    "even after the ships had stopped coming to the harbour.",
    "Photosynthesis converts light energy into chemical energy stored in sugars.",
    "In 1969, two astronauts walked on the Moon while a third orbited above them, "
    "waiting to bring them home.",
]


def run_paged(cfg, params, seqs, prompt_lens, page_size, max_seqs=4):
    """Prefill each row's prompt, then feed the rest token by token; collect logits."""
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                       max_context=128, page_size=page_size)
    steps = CompiledSteps(cfg, method, jnp.float32)
    state = method.init_state(max_seqs * method.pages_for_tokens(128))
    n = len(seqs)
    T = 64
    toks = np.zeros((max_seqs, T), np.int32)
    lens = np.zeros(max_seqs, np.int32)
    slots = np.full(max_seqs, max_seqs, np.int32)
    for i, (s, pl) in enumerate(zip(seqs, prompt_lens)):
        toks[i, :pl] = s[:pl]
        lens[i], slots[i] = pl, i
    state, logits = steps.prefill(params, state, PrefillBatch(jnp.asarray(toks),
                                                              jnp.asarray(lens),
                                                              jnp.asarray(slots)))
    got = {(i, prompt_lens[i] - 1): np.asarray(logits[i]) for i in range(n)}
    pos = np.array(prompt_lens + [0] * (max_seqs - n))
    total = np.array([len(s) for s in seqs] + [0] * (max_seqs - n))
    while (pos < total).any():
        active = pos < total
        tk = np.array([seqs[i][pos[i]] if active[i] else 0 for i in range(n)]
                      + [0] * (max_seqs - n), np.int32)
        state, logits = steps.decode(params, state, DecodeBatch(jnp.asarray(tk),
                                                                jnp.asarray(active), method.row_len))
        for i in np.flatnonzero(active):
            got[(i, pos[i])] = np.asarray(logits[i])
        pos = pos + active
    assert not bool(state.alloc_failed)
    return got


def check_against_full(cfg, params, seqs, prompt_lens, page_size, tol):
    got = run_paged(cfg, params, seqs, prompt_lens, page_size)
    for i, s in enumerate(seqs):
        ref = np.asarray(forward_no_cache(cfg, params, jnp.asarray([s]),
                                          jnp.asarray([len(s)]))[0])
        for p in range(prompt_lens[i] - 1, len(s)):
            err = np.abs(got[(i, p)] - ref[p]).max()
            assert err < tol, (i, p, err)
            assert got[(i, p)].argmax() == ref[p].argmax() or \
                np.sort(ref[p])[-1] - np.sort(ref[p])[-2] < tol


@pytest.mark.parametrize("page_size", [4, 16])
def test_tiny_model_paged_matches_full(tiny_model, page_size):
    cfg, params = tiny_model
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (37, 21, 50)]
    # float32 throughout; only summation order differs between the two paths.
    check_against_full(cfg, params, seqs, [5, 16, 9], page_size, tol=1e-4)


def test_smollm_paged_matches_full(smollm):
    tok = smollm.tokenizer
    seqs = [tok.encode(t) for t in TEXTS]
    # Logits of this model reach ~30 in magnitude; 30 layers of float32 with a
    # different reduction order (paged gather vs dense causal attention) leave
    # differences around 1e-4, far below any token decision.
    check_against_full(smollm.cfg, smollm.params, seqs, [3, 10, 6], 16, tol=2e-3)
