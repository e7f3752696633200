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

Bad requests (empty prompt, prompt over the context, invalid sampling values,
stop strings on an engine without a detokenizer) are refused by
:meth:`Engine.add_request` with :class:`GenerationInputError`; the engine keeps
serving everything else.

Stop strings (``SamplingParams.stop_strings``) need the engine's
``detokenizer``. After every accepted token the request's text is extended
incrementally (:class:`TextTracker`) and only its last
``len(longest stop) - 1`` characters plus the new ones are searched, so the
cost per token does not grow with the output. On a match the request finishes
with ``finish_reason == "stop"``; :attr:`Request.text` is the text before the
stop string and :attr:`Request.stop_string` the string that matched, while
:attr:`Request.output` keeps every sampled token, up to and including the one
whose text completed the stop string (its text may run past it).
:meth:`Engine.stream_text` / :meth:`Engine.run_text` hand out text that can no
longer become part of a stop string.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import GenerationInputError, Generator, SamplingParams, next_pow2


Detokenizer = Callable[[list[int]], str]


def as_detokenizer(obj) -> Detokenizer | None:
    """``obj.decode`` for an object with a ``decode`` method (e.g.
    :class:`models.tokenizer.Tokenizer`, whose ``decode(ids)`` keeps special tokens),
    ``obj`` itself for any other callable ``list[int] -> str``; None stays None."""
    if obj is None:
        return None
    decode = getattr(obj, "decode", None)
    if callable(decode):
        return decode
    if callable(obj):
        return obj
    raise TypeError(f"detokenizer must be callable (list[int] -> str) or have a decode "
                    f"method, got {type(obj).__name__}")


class TextTracker:
    """The text of one request's generated tokens, grown a token at a time.

    Decoding is incremental, as :class:`models.tokenizer.IncrementalDetokenizer`
    does it: each token decodes only the ids not yet turned into complete
    characters, with the previous chunk as context, so the text equals decoding
    all ids at once. Ids in ``stop_token_ids`` are not part of the text.

    Text of ids that may still be an incomplete UTF-8 character is *pending*:
    it is searched for stop strings (as a full decode would show it) but never
    streamed before the request ends. A stop string can only complete in the
    new characters, so each token searches ``len(longest stop) - 1`` old
    characters plus the new ones. :meth:`take` returns text that can no longer
    be part of a stop string: while the request runs, the committed text but
    its longest end that is the beginning of a stop string (at most
    ``len(longest stop) - 1`` characters); once it has ended, everything before
    the stop string (or everything, pending included).
    """

    def __init__(self, decode: Detokenizer, stop_strings: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()):
        self._decode = decode
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._skip = frozenset(int(t) for t in stop_token_ids)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read]: context; ids[read:]: pending
        self._pieces: list[str] = []   # committed text, in pieces
        self._committed = 0            # its length in characters
        self._tail = ""                # its last `hold` characters
        self._pending = ""             # text of ids[read:], still provisional
        self._unsent = ""              # committed text not yet returned by take()
        self._sent = 0                 # characters returned by take()
        self._closed = False           # take() has returned the end of the text
        self.consumed = 0              # output tokens fed (stop token ids included)
        self.stop_at: int | None = None    # where the matched stop string begins
        self.stop_string: str | None = None

    def feed(self, token: int) -> bool:
        """Add the next output token; True if it completed a stop string."""
        self.consumed += 1
        if self.stop_at is not None or int(token) in self._skip:
            return False
        self._ids.append(int(token))
        done = self._decode(self._ids[self._prefix:self._read]) if self._read > self._prefix \
            else ""
        full = self._decode(self._ids[self._prefix:])
        new = full[len(done):] if len(full) > len(done) else ""
        base = self._committed - len(self._tail)
        window = self._tail + new
        if new and not new.endswith("\ufffd"):  # complete characters: commit them
            self._pieces.append(new)
            self._committed += len(new)
            self._unsent += new
            self._tail = window[-self.hold:] if self.hold else ""
            self._pending = ""
            self._prefix, self._read = self._read, len(self._ids)
        else:
            self._pending = new
        for s in self.stop_strings:
            i = window.find(s)
            if i >= 0 and (self.stop_at is None or base + i < self.stop_at):
                self.stop_at, self.stop_string = base + i, s
        return self.stop_at is not None

    def catch_up(self, output: Sequence[int]) -> bool:
        """Feed the tokens of ``output`` not fed yet; True if a stop string has matched."""
        for t in output[self.consumed:]:
            self.feed(t)
        return self.stop_at is not None

    @property
    def text(self) -> str:
        """Everything decoded so far, cut before a matched stop string."""
        text = "".join(self._pieces) + self._pending
        return text if self.stop_at is None else text[:self.stop_at]

    def take(self, final: bool) -> str:
        """Text not returned before that is safe to show (``final``: the request has ended)."""
        if self._closed:
            return ""
        if self.stop_at is not None or final:  # the end: up to the stop string, or all
            out = self._unsent + self._pending
            if self.stop_at is not None:
                out = out[:max(self.stop_at - self._sent, 0)]
            self._closed, self._unsent = True, ""
        else:
            out = self._unsent[:max(len(self._unsent) - self._overlap(), 0)]
            self._unsent = self._unsent[len(out):]
        self._sent += len(out)
        return out

    def _overlap(self) -> int:
        """Length of the longest end of the committed text that begins a stop string
        (at most ``hold``): only those characters can still become part of one."""
        best = 0
        for s in self.stop_strings:
            for j in range(min(len(s) - 1, len(self._tail)), best, -1):
                if self._tail.endswith(s[:j]):
                    best = j
                    break
        return best


@dataclasses.dataclass
class Request:
    """One request and its progress.

    ``output`` holds every sampled token: a stop token id that ended the request
    is its last entry; when a stop string ended it, the last entry is the token
    whose text completed the stop string (its text may continue past it), and
    :attr:`text` is cut before the stop string.
    """

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
    # Text of ``output`` (None when the engine has no detokenizer); fed every step
    # for requests with stop strings, on demand for the others.
    text_tracker: TextTracker | None = dataclasses.field(default=None, repr=False,
                                                         compare=False)

    @property
    def text(self) -> str | None:
        """The generated text: ``output`` decoded without a stop token id ending it,
        cut before the stop string that ended the request, if one did. None when the
        engine has no detokenizer."""
        if self.text_tracker is None:
            return None
        self.text_tracker.catch_up(self.output)
        return self.text_tracker.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request (None if none did)."""
        return None if self.text_tracker is None else self.text_tracker.stop_string

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
      detokenizer: turns token ids into text, for stop strings, :attr:`Request.text`
        and :meth:`stream_text`: either a callable ``list[int] -> str`` or an object
        with a ``decode(ids)`` method, such as the project's
        :class:`models.tokenizer.Tokenizer` (``decode(ids)``, special tokens kept).
        Without one, requests with ``stop_strings`` are refused.
    """

    def __init__(self, cfg, params, method, num_pages: int, dtype=jnp.float32,
                 max_prefill_batch: int = 4, detokenizer=None):
        super().__init__(cfg, params, method, num_pages, dtype)
        self.max_prefill_batch = max_prefill_batch
        self.detokenizer = as_detokenizer(detokenizer)
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
        if sampling.stop_strings and self.detokenizer is None:
            raise GenerationInputError(
                "stop_strings need an Engine built with a detokenizer (Engine(..., "
                "detokenizer=tokenizer))")
        worst = self.method.pages_for_tokens(min(len(prompt) + 1, self.method.max_context))
        if worst + self._reserve(1) > self.num_pages:
            raise GenerationInputError(
                f"prompt of {len(prompt)} tokens needs up to {worst} pages; the pool has "
                f"{self.num_pages}")
        rid = next(self._ids)
        tracker = None if self.detokenizer is None else TextTracker(
            self.detokenizer, sampling.stop_strings, sampling.stop_token_ids)
        self.requests[rid] = Request(rid, prompt, sampling, text_tracker=tracker)
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

    def stream_text(self, rid: int) -> str:
        """Text of request ``rid`` that is new since the last call and safe to show.

        While the request runs, the end of its text that could still begin a stop
        string (at most ``len(longest stop string) - 1`` characters) and any
        incomplete UTF-8 character are held back, so nothing returned can turn out
        to be part of a stop string; once it has finished or was cancelled, the
        rest up to the stop string is returned. The pieces returned add up to
        :attr:`Request.text`. Needs a detokenizer.
        """
        req = self.requests[rid]
        if req.text_tracker is None:
            raise GenerationInputError("stream_text needs an Engine built with a detokenizer")
        req.text_tracker.catch_up(req.output)
        return req.text_tracker.take(final=req.status in ("finished", "cancelled"))

    def run_text(self) -> Iterator[dict[int, str]]:
        """:meth:`run` that yields, per step, the new safe text of each request that
        produced tokens (see :meth:`stream_text`); requests with no new text are left
        out."""
        if self.detokenizer is None:
            raise GenerationInputError("run_text needs an Engine built with a detokenizer")
        for new in self.run():
            out = {rid: self.stream_text(rid) for rid in new}
            yield {rid: t for rid, t in out.items() if t}

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
        elif r.sampling.stop_strings and r.text_tracker.catch_up(r.output):
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
