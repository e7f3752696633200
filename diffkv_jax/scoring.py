"""Teacher-forced scoring through the cache: prefill a prefix, then decode the rest.

Every scored token goes through the decode path, so a compressing cache method
compresses while the text is read (generation-phase compression is exercised,
not only the prompt phase).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import next_pow2
from diffkv_jax.steps import CompiledSteps


@dataclasses.dataclass
class ScoreResult:
    """Per-token negative log-likelihood and argmax of the scored positions ``[B, n]``."""

    nll: np.ndarray
    argmax: np.ndarray
    memory: dict
    decode_seconds: float

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


def score_teacher_forced(cfg, params, method, docs, prefix_len: int, dtype=jnp.float32,
                         progress: bool = True) -> ScoreResult:
    """Score ``docs`` (equal-length token lists, at most ``method.max_seqs``).

    Positions ``prefix_len .. len - 1`` are predicted; the prefix is prefilled
    and the rest fed token by token through the decode step.
    """
    B, N = len(docs), len(docs[0])
    S = method.max_seqs
    if not 0 < B <= S or any(len(d) != N for d in docs):
        raise ValueError("need 1..max_seqs documents of equal length")
    if not 0 < prefix_len < N or N > method.max_context:
        raise ValueError("prefix must be shorter than the documents, which must fit the context")
    steps = CompiledSteps(cfg, method, dtype)
    state = method.init_state(S * method.pages_for_tokens(method.max_context))
    toks = np.zeros((S, next_pow2(prefix_len, 16)), np.int32)
    lens = np.zeros(S, np.int32)
    slots = np.full(S, S, np.int32)
    arr = np.asarray(docs, np.int32)
    toks[:B, :prefix_len] = arr[:, :prefix_len]
    lens[:B] = prefix_len
    slots[:B] = np.arange(B)
    state, logits = steps.prefill(params, state, PrefillBatch(
        jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots)))

    @jax.jit
    def pick(logits, target):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0], logits.argmax(-1)

    nll = np.zeros((B, N - prefix_len), np.float32)
    top = np.zeros((B, N - prefix_len), np.int32)
    active = np.zeros(S, bool)
    active[:B] = True
    t0 = time.perf_counter()
    for j, pos in enumerate(tqdm(range(prefix_len, N), disable=not progress,
                                 desc=f"scoring ({method.name})", unit="tok")):
        tgt = np.zeros(S, np.int32)
        tgt[:B] = arr[:, pos]
        n, a = pick(logits, jnp.asarray(tgt))
        nll[:, j], top[:, j] = np.asarray(n)[:B], np.asarray(a)[:B]
        if pos == N - 1:
            break
        width = min(next_pow2((pos + 1) // method.page_size + 1), method.row_len)
        state, logits = steps.decode(params, state, DecodeBatch(jnp.asarray(tgt),
                                                                jnp.asarray(active), width))
    jax.block_until_ready(logits)
    elapsed = time.perf_counter() - t0
    memory = method.memory_stats(state)
    if bool(jax.device_get(state.alloc_failed)):
        raise RuntimeError("page pool exhausted while scoring")
    return ScoreResult(nll, top, memory, elapsed)
