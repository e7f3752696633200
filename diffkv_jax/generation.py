"""Batch generation over a paged cache: prefill, then decode until every row stops.

:class:`Generator` drives the jitted steps of :mod:`diffkv_jax.steps` from the
host. Shapes are bucketed (prompt batch to powers of two, prompt length by
:func:`prompt_bucket`, decoded page-table width to powers of two), so a warm generator never recompiles
while the buckets it has seen suffice. The only host transfer per decode step
is the sampled token ids (needed for stop conditions and streaming).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.sampling import SamplingArrays, sample
from diffkv_jax.steps import CompiledSteps
from models.config import ModelConfig


class GenerationInputError(ValueError):
    """A request that cannot be served as given (the message says why)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy.

    ``stop_token_ids`` end a request when sampled (the id is kept as the last
    token of the output). ``stop_strings`` end it when the generated text
    contains one of them; only :class:`diffkv_jax.engine.Engine` honours them,
    and only when it was built with a ``detokenizer`` (see there for what is
    kept). A list is stored as a tuple.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.stop_strings, list):  # keep the dataclass hashable
            object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise GenerationInputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise GenerationInputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationInputError(f"top_k must be >= 0, got {self.top_k}")
        if not isinstance(self.stop_strings, tuple):
            raise GenerationInputError(
                f"stop_strings must be a tuple of strings, got {type(self.stop_strings).__name__}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise GenerationInputError(f"stop strings must be non-empty strings, got {s!r}")


@dataclasses.dataclass
class GenerationResult:
    """Tokens generated per prompt plus timing and cache measurements."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    memory: dict

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def page_width(method, tokens: int) -> int:
    """Page-table columns covering ``tokens`` per row, in power-of-two buckets."""
    return min(next_pow2(tokens // method.page_size + 1), method.row_len)


def prompt_page_width(method, tokens: int) -> int:
    """Page-table columns a chunked prefill passes for prompts of up to ``tokens``: what
    a first chunk allocates for its whole prompt (the method's ``prompt_pages``, else
    one page more than the tokens fill), in power-of-two buckets."""
    pages = getattr(method, "prompt_pages", None)
    need = pages(tokens) if pages else tokens // method.page_size + 1
    return min(next_pow2(need), method.row_len)


def decode_width(method, tokens: int) -> int:
    """Page-table columns a decode step passes its attention (a shape bucket).

    The Pallas kernels walk each row's actual pages (the width only caps them),
    so one bucket, the whole row, serves every length and a server compiles its
    decode step once per sampling mode; the plain-jnp reference gathers every
    column it is given, so it gets the power-of-two buckets of :func:`page_width`.
    """
    if getattr(method, "attention_impl", "reference") == "pallas":
        return method.row_len
    return page_width(method, tokens)


def decode_buckets(method) -> list[int]:
    """Every ``num_page_slots`` a decode step of ``method`` can be given by
    :func:`decode_width`: the shapes to compile at warm-up."""
    return sorted({decode_width(method, t) for t in range(0, method.max_context + 1,
                                                          method.page_size)})


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(int(n), 1) - 1).bit_length())


#: Prompts longer than this are padded to one of :data:`PROMPT_BUCKETS_PER_OCTAVE`
#: evenly spaced lengths per octave instead of the next power of two.
FINE_PROMPT_BUCKETS_FROM = 512
PROMPT_BUCKETS_PER_OCTAVE = 4


def prompt_bucket(n: int, minimum: int = 16) -> int:
    """Tokens a prefill of an ``n``-token prompt is padded to: the next power of two
    (at least ``minimum``) up to :data:`FINE_PROMPT_BUCKETS_FROM`, then the next of
    :data:`PROMPT_BUCKETS_PER_OCTAVE` evenly spaced lengths per octave (1280, 1536,
    1792, 2048, 2560, ...). A prefill costs about its padded tokens, and a long one
    (a preempted request's whole context, recomputed) padded to a power of two
    wastes 39% of its work on average against 9% here; each bucket compiles once.
    """
    p = next_pow2(n, minimum)
    if p <= FINE_PROMPT_BUCKETS_FROM:
        return p
    step = p // (2 * PROMPT_BUCKETS_PER_OCTAVE)
    return -(-int(n) // step) * step


class Generator:
    """Generates for batches of prompts through one cache method.

    Args:
      cfg: model architecture; params: its parameter tree.
      method: a cache method (e.g. :class:`diffkv_jax.paged_cache.FullCache`).
      num_pages: usable pages in the pool.
      dtype: compute dtype.
    """

    def __init__(self, cfg: ModelConfig, params, method, num_pages: int, dtype=jnp.float32):
        self.cfg, self.params, self.method, self.dtype = cfg, params, method, dtype
        self.num_pages = num_pages
        self.steps = CompiledSteps(cfg, method, dtype)
        self._sample = jax.jit(sample)
        self.state = method.init_state(num_pages)
        self._executables: dict = {}
        self.compile_seconds = 0.0
        # Time spent inside device calls (dispatch; the whole step where the
        # runtime executes synchronously), compilation excluded.
        self.call_seconds = 0.0
        self.free_pages = num_pages  # as of the last completed step

    def _run(self, name: str, key, fn, *args):
        """Call ``fn`` through an executable compiled once per (name, shape bucket).

        Compiling ahead of time keeps compilation out of the measured step times
        and makes "no recompilation after warm-up" a property of this dict.
        """
        exe = self._compiled(name, key, fn, *args)
        t0 = time.perf_counter()
        out = exe(*args)
        self.call_seconds += time.perf_counter() - t0
        return out

    def _compiled(self, name: str, key, fn, *args):
        """The executable of ``fn`` for (name, shape bucket), compiled on first use
        (nothing runs: ``args`` only give shapes)."""
        exe = self._executables.get((name, key))
        if exe is None:
            # Finish queued device work first, so it is not counted as compilation.
            t0 = time.perf_counter()
            jax.block_until_ready(args)
            t1 = time.perf_counter()
            self.call_seconds += t1 - t0
            self._drained(t1 - t0, t1)
            t0 = time.perf_counter()
            exe = fn.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._executables[(name, key)] = exe
        return exe

    def _drained(self, seconds: float, until: float) -> None:
        """Hook: queued device work was waited for (``seconds``, ending at ``until``)
        before a compilation."""

    def warm_up(self, sampled: bool = False, progress: bool = False) -> int:
        """Compile the decode step for every shape bucket now (:func:`decode_buckets`),
        so that serving never stops to compile one when the batch or the contexts
        change. Greedy decoding always; with ``sampled`` the sampling variant too.
        Returns the number of executables compiled (already compiled ones are skipped).
        Prefill buckets still compile on first use.
        """
        S = self.method.max_seqs
        modes = [SamplingParams()] + ([SamplingParams(temperature=1.0)] if sampled else [])
        todo = [(w, m) for w in decode_buckets(self.method) for m in modes]
        before = len(self._executables)
        last = jnp.zeros(S, jnp.int32)
        active = jnp.zeros(S, bool)
        steps = np.zeros(S, np.int32)
        for width, mode in tqdm(todo, disable=not progress, desc="compiling decode buckets"):
            smp = self._sampling_arrays([mode] * S, S, steps)
            batch = DecodeBatch(last, active, width)
            self._compiled("decode", (width, smp.greedy_only),
                           self.steps.decode_and_sample, self.params, self.state, batch, smp)
        return len(self._executables) - before

    @property
    def num_compiled(self) -> int:
        """Executables compiled so far (one per step kind and shape bucket)."""
        return len(self._executables)

    # -- validation -------------------------------------------------------------------
    def check_prompt(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """Raise :class:`GenerationInputError` if the request cannot be served."""
        if len(prompt) == 0:
            raise GenerationInputError("empty prompt")
        limit = self.method.max_context
        if len(prompt) >= limit:
            raise GenerationInputError(
                f"prompt has {len(prompt)} tokens; the context holds {limit} "
                f"(prompt + at least one new token)")
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise GenerationInputError("prompt contains token ids outside the vocabulary")
        sampling.validate()

    # -- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Generate for all prompts (at most ``method.max_seqs`` at once).

        ``on_token(row, token_id)`` is called for every generated token as soon as
        the host has it (streaming).
        """
        S = self.method.max_seqs
        if len(prompts) != len(sampling):
            raise GenerationInputError("one SamplingParams per prompt is required")
        if not 0 < len(prompts) <= S:
            raise GenerationInputError(f"between 1 and {S} prompts per call, got {len(prompts)}")
        for p, s in zip(prompts, sampling):
            self.check_prompt(p, s)
            if s.stop_strings:
                raise GenerationInputError("stop strings need text: serve through "
                                           "diffkv_jax.engine.Engine with a detokenizer")
        need = sum(self.method.pages_for_tokens(min(len(p) + s.max_new_tokens,
                                                    self.method.max_context))
                   for p, s in zip(prompts, sampling))
        free = int(jax.device_get(self.state.free.num_free))
        if need > free:
            raise GenerationInputError(
                f"the cache has {free} free pages; these prompts may need {need}")

        n = len(prompts)
        max_new = [min(s.max_new_tokens, self.method.max_context - len(p))
                   for p, s in zip(prompts, sampling)]
        stops = [set(s.stop_token_ids) for s in sampling]
        out: list[list[int]] = [[] for _ in range(n)]
        reasons = ["length"] * n

        # ---- prefill (slots 0..n-1) -------------------------------------------------
        B = next_pow2(n)
        T = prompt_bucket(max(len(p) for p in prompts))
        toks = np.zeros((B, T), np.int32)
        lens = np.zeros((B,), np.int32)
        slots = np.full((B,), S, np.int32)  # padding rows -> scratch slot
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
            lens[i] = len(p)
            slots[i] = i
        smp = self._sampling_arrays(sampling, S, steps=np.zeros(S, np.int32))
        pbatch = PrefillBatch(jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots))
        c0 = self.compile_seconds
        t0 = time.perf_counter()
        self.state, logits = self._run("prefill", (B, T), self.steps.prefill,
                                       self.params, self.state, pbatch)
        first = np.asarray(self._run("sample", (B, smp.greedy_only), self._sample, logits,
                                    self._pad(smp, B)))[:n]
        t_prefill = time.perf_counter() - t0 - (self.compile_seconds - c0)

        # ---- decode ---------------------------------------------------------------
        seq_len = np.zeros(S, np.int64)
        seq_len[:n] = [len(p) for p in prompts]
        active = np.zeros(S, bool)
        last = np.zeros(S, np.int32)
        for i in range(n):
            self._emit(i, int(first[i]), out, stops, max_new, reasons, active, on_token)
            last[i] = first[i]
        c1 = self.compile_seconds
        t1 = time.perf_counter()
        n_decode = 0
        step = np.zeros(S, np.int32)
        step[:n] = 1
        while active.any():
            width = decode_width(self.method, int(seq_len[active].max()) + 1)
            batch = DecodeBatch(jnp.asarray(last), jnp.asarray(active), width)
            smp = self._sampling_arrays(sampling, S, steps=step)
            self.state, new, counts = self._run("decode", (width, smp.greedy_only),
                                                self.steps.decode_and_sample,
                                                self.params, self.state, batch, smp)
            new, counts = jax.device_get((new, counts))
            self.free_pages = int(counts[0])
            new = np.asarray(new)
            was_active = active.copy()
            seq_len[was_active] += 1
            step[was_active] += 1
            n_decode += int(was_active.sum())
            for i in np.flatnonzero(was_active):
                self._emit(int(i), int(new[i]), out, stops, max_new, reasons, active, on_token)
                last[i] = new[i]
        t_decode = time.perf_counter() - t1 - (self.compile_seconds - c1)

        memory = self.method.memory_stats(self.state)
        memory["pool_bytes"] = self.num_pages * self.method.page_bytes
        failed = bool(jax.device_get(self.state.alloc_failed))
        mask = np.zeros(S + 1, bool)
        mask[:n] = True
        self.state = self._run("release", None, self.steps.release, self.state,
                               jnp.asarray(mask))
        if failed:
            raise RuntimeError("the device page allocator ran out of pages during generation")
        return GenerationResult(out, reasons, int(sum(len(p) for p in prompts)), t_prefill,
                                n_decode, t_decode, memory)

    # -- helpers -------------------------------------------------------------------------
    def _emit(self, i, token, out, stops, max_new, reasons, active, on_token):
        out[i].append(token)
        if on_token is not None:
            on_token(i, token)
        if token in stops[i]:
            reasons[i] = "stop"
            active[i] = False
        elif len(out[i]) >= max_new[i]:
            reasons[i] = "length"
            active[i] = False
        else:
            active[i] = True

    @staticmethod
    def _pad(smp: SamplingArrays, n: int) -> SamplingArrays:
        """Sampling arrays for ``n`` rows (prefill rows are padded to a bucket)."""
        def fit(x):
            x = np.asarray(x)
            return jnp.asarray(x[:n] if x.shape[0] >= n else
                               np.concatenate([x, np.zeros(n - x.shape[0], x.dtype)]))
        return jax.tree_util.tree_map(fit, smp)

    @staticmethod
    def _sampling_arrays(sampling: Sequence[SamplingParams], size: int,
                         steps: np.ndarray) -> SamplingArrays:
        def col(attr, dtype, fill):
            a = np.full(size, fill, dtype)
            a[: len(sampling)] = [getattr(s, attr) for s in sampling]
            return jnp.asarray(a)

        return SamplingArrays(temperature=col("temperature", np.float32, 0.0),
                              top_p=col("top_p", np.float32, 1.0),
                              top_k=col("top_k", np.int32, 0),
                              seed=col("seed", np.uint32, 0),
                              step=jnp.asarray(steps.astype(np.int32)),
                              greedy_only=all(s.temperature <= 0 for s in sampling))
