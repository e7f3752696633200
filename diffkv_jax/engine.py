"""Continuous-batching engine over a paged (compressed or not) KV cache.

The device side is the jitted prefill / decode steps of :mod:`diffkv_jax.steps`
over a fixed set of slots; the host side here decides every step which
waiting requests to prefill into free slots and which running requests decode.

Admission and preemption use the free-page count that each decode step returns
with its sampled tokens (no extra device synchronization):

* a waiting request is admitted when a slot is free and the pool can hold its
  prompt (conservatively: every prompt token in the high tier) while keeping
  the per-step reserve for everyone running;
* before a decode step the pool must hold the worst case one step can
  allocate (one page per tier for every running row); if it cannot, the most
  recently admitted request is preempted: its pages are freed and it goes back
  to the front of the queue, to be recomputed from its prompt plus the tokens
  it has produced (its output so far is kept).

Bad requests (empty prompt, prompt over the context, invalid sampling values)
are refused by :meth:`Engine.add_request` with :class:`GenerationInputError`;
the engine keeps serving everything else.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import GenerationInputError, Generator, SamplingParams, next_pow2


@dataclasses.dataclass
class Request:
    """One request and its progress."""

    id: int
    prompt: list[int]
    sampling: SamplingParams
    output: list[int] = dataclasses.field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished | cancelled
    finish_reason: str | None = None
    slot: int | None = None
    preemptions: int = 0
    admitted_at: int = -1  # scheduling order, newest admitted is preempted first
    # The cache's accounting (``method.slot_memory_stats``) of this request's pages
    # when it left its slot for good (finished or cancelled); None before. A row's
    # pages never shrink while it decodes, so this is also the most it held.
    kv_stats: dict | None = None

    @property
    def kv_bytes(self) -> int | None:
        """Measured cache bytes this request held: its pages (data + per-token
        metadata) plus its page-table rows; None until it has finished."""
        if self.kv_stats is None:
            return None
        return self.kv_stats["page_bytes"] + self.kv_stats["table_bytes"]

    @property
    def context(self) -> list[int]:
        """Tokens the cache must hold before the next one is generated."""
        return self.prompt + self.output


class Engine(Generator):
    """Serve many requests through ``method.max_seqs`` decode slots.

    Args:
      cfg, params, method, num_pages, dtype: as for :class:`Generator`.
      max_prefill_batch: prompts prefilled together in one step.
    """

    def __init__(self, cfg, params, method, num_pages: int, dtype=jnp.float32,
                 max_prefill_batch: int = 4):
        super().__init__(cfg, params, method, num_pages, dtype)
        self.max_prefill_batch = max_prefill_batch
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.slots: list[int | None] = [None] * method.max_seqs
        self.steps_run = 0
        # Throughput counters (compilation excluded) and the largest cache footprint seen.
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        self.peak_memory: dict = {}

    # -- public API ----------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises :class:`GenerationInputError` if invalid."""
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.check_prompt(prompt, sampling)
        worst = self.method.pages_for_tokens(min(len(prompt) + 1, self.method.max_context))
        if worst + self._reserve(1) > self.num_pages:
            raise GenerationInputError(
                f"prompt of {len(prompt)} tokens needs up to {worst} pages; the pool has "
                f"{self.num_pages}")
        rid = next(self._ids)
        self.requests[rid] = Request(rid, prompt, sampling)
        self.waiting.append(rid)
        return rid

    def cancel(self, rid: int) -> None:
        """Stop a request; its pages return to the pool. Unknown ids raise ``KeyError``."""
        if rid not in self.requests:
            raise KeyError(f"unknown request id {rid}")
        req = self.requests[rid]
        if req.status == "waiting":
            self.waiting.remove(rid)
        elif req.status == "running":
            self._free_slots([req.slot])
        if req.status in ("waiting", "running"):
            req.status, req.finish_reason = "cancelled", "cancelled"

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def step(self) -> dict[int, list[int]]:
        """Run one scheduling iteration; returns the new tokens of each request."""
        new: dict[int, list[int]] = collections.defaultdict(list)
        self._admit(new)
        self._preempt_if_needed()
        running = [i for i, r in enumerate(self.slots) if r is not None]
        if running:
            self._decode(running, new)
        self.steps_run += 1
        return dict(new)

    def run(self) -> Iterator[dict[int, list[int]]]:
        """Step until every request is finished, yielding each step's new tokens."""
        while self.has_unfinished():
            yield self.step()

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: Sequence[SamplingParams] | SamplingParams | None = None
                 ) -> list[Request]:
        """Convenience: serve ``prompts`` to completion and return their requests in order."""
        if not isinstance(sampling, (list, tuple)):
            sampling = [sampling] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling)]
        for _ in self.run():
            pass
        return [self.requests[i] for i in ids]

    # -- scheduling ----------------------------------------------------------------------
    def _reserve(self, rows: int) -> int:
        """Pages one decode step may allocate for ``rows`` running sequences."""
        per_row = self.method.num_layers * self.method.num_kv_heads
        return rows * per_row * self.method.max_new_pages_per_row

    def _admit(self, new) -> None:
        free_slots = [i for i, r in enumerate(self.slots) if r is None]
        running = len(self.slots) - len(free_slots)
        batch: list[Request] = []
        free = int(self.free_pages)
        while self.waiting and free_slots and len(batch) < self.max_prefill_batch:
            req = self.requests[self.waiting[0]]
            need = self.method.pages_for_tokens(len(req.context))
            if free - need < self._reserve(running + len(batch) + 1):
                break
            self.waiting.popleft()
            req.slot = free_slots.pop(0)
            req.status = "running"
            req.admitted_at = next(self._admissions)
            self.slots[req.slot] = req.id
            batch.append(req)
            free -= need
        if batch:
            self._prefill(batch, new)

    def _prefill(self, batch: list[Request], new) -> None:
        S = self.method.max_seqs
        B = next_pow2(len(batch))
        T = next_pow2(max(len(r.context) for r in batch), 16)
        toks = np.zeros((B, T), np.int32)
        lens = np.zeros(B, np.int32)
        slots = np.full(B, S, np.int32)
        for i, r in enumerate(batch):
            ctx = r.context
            toks[i, : len(ctx)] = ctx
            lens[i], slots[i] = len(ctx), r.slot
        pbatch = PrefillBatch(jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots))
        t0, c0 = time.perf_counter(), self.compile_seconds
        self.state, logits = self._run("prefill", (B, T), self.steps.prefill, self.params,
                                       self.state, pbatch)
        smp = self._sampling_arrays([r.sampling for r in batch], B,
                                    steps=np.asarray([len(r.output) for r in batch]
                                                     + [0] * (B - len(batch)), np.int32))
        first = np.asarray(self._run("sample", B, self._sample, logits, smp))
        self.free_pages = int(jax.device_get(self.state.free.num_free))
        self.prefill_seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)
        self.prefill_tokens += int(lens.sum())
        done = []
        for i, r in enumerate(batch):
            if self._accept(r, int(first[i]), new):
                done.append(r.slot)
        self._free_slots(done)

    def _preempt_if_needed(self) -> None:
        running = sorted((r for r in self.slots if r is not None),
                         key=lambda rid: self.requests[rid].admitted_at)
        while running and int(self.free_pages) < self._reserve(len(running)):
            victim = self.requests[running.pop()]
            victim.preemptions += 1
            self._free_slots([victim.slot], requeue=True)

    def _decode(self, running: list[int], new) -> None:
        S = self.method.max_seqs
        active = np.zeros(S, bool)
        active[running] = True
        last = np.zeros(S, np.int32)
        steps = np.zeros(S, np.int32)
        sampling = [SamplingParams()] * S
        longest = 0
        for i in running:
            r = self.requests[self.slots[i]]
            last[i] = r.output[-1]
            steps[i] = len(r.output)
            sampling[i] = r.sampling
            longest = max(longest, len(r.context))
        width = self._page_width(longest + 1)
        batch = DecodeBatch(jnp.asarray(last), jnp.asarray(active), width)
        smp = self._sampling_arrays(sampling, S, steps=steps)
        t0, c0 = time.perf_counter(), self.compile_seconds
        self.state, tok, free = self._run("decode", width, self.steps.decode_and_sample,
                                          self.params, self.state, batch, smp)
        tok, self.free_pages = jax.device_get((tok, free))
        self.decode_seconds += time.perf_counter() - t0 - (self.compile_seconds - c0)
        self.decode_tokens += len(running)
        done = []
        for i in running:
            r = self.requests[self.slots[i]]
            if self._accept(r, int(tok[i]), new):
                done.append(i)
        self._free_slots(done)

    def _accept(self, r: Request, token: int, new) -> bool:
        """Record a sampled token; True when the request has finished."""
        r.output.append(token)
        new[r.id].append(token)
        if token in r.sampling.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output) >= r.sampling.max_new_tokens:
            r.finish_reason = "length"
        elif len(r.context) >= self.method.max_context:
            r.finish_reason = "context"
        else:
            return False
        r.status = "finished"
        return True

    def _free_slots(self, slots: list[int], requeue: bool = False) -> None:
        if not slots:
            return
        if not requeue:
            stats = self.method.memory_stats(self.state)
            if stats["page_bytes"] >= self.peak_memory.get("page_bytes", -1):
                self.peak_memory = stats
            # Read once per finishing step, before the pages go back to the pool.
            for s, st in zip(slots, self.method.slot_memory_stats(self.state, slots)):
                self.requests[self.slots[s]].kv_stats = st
        mask = np.zeros(self.method.max_seqs + 1, bool)
        mask[slots] = True
        self.state = self._run("release", None, self.steps.release, self.state,
                               jnp.asarray(mask))
        self.free_pages = int(jax.device_get(self.state.free.num_free))
        for s in slots:
            rid = self.slots[s]
            self.slots[s] = None
            req = self.requests[rid]
            req.slot = None
            if requeue:
                req.status = "waiting"
                self.waiting.appendleft(rid)
