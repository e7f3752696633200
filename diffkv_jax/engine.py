"""Continuous-batching engine over a paged (compressed or not) KV cache.

The device side is the jitted prefill / decode steps of :mod:`diffkv_jax.steps`
over a fixed set of slots; the host side here decides every step which
waiting requests to prefill into free slots and which running requests decode.

Admission and preemption use the free-page count that each decode step returns
with its sampled tokens (no extra device synchronization), together with the
cache's bound on how many pages the next few decode steps can allocate
(:func:`diffkv_jax.steps.pool_counts`; a tier region only gets a page when it
is full, so only regions within a few tokens of a page boundary can):

* a waiting request is admitted when a slot is free and the pool can hold its
  prompt (conservatively: every prompt token in the high tier) while keeping
  the reserve of the next decode step for everyone running;
* before a decode step the pool must hold what the steps not yet read back
  and this one can allocate: the bound for rows the last read result covers,
  the worst case (every layer and head gaining a page per tier) for rows
  admitted since. If it cannot, the host first reads every result in flight
  (the exact free count: most shortages are only the bound's), and if it still
  cannot, the most recently admitted request is preempted: its pages are
  freed and it goes back to the front of the queue, to be recomputed from its
  prompt plus the tokens it has produced (its output so far is kept). With
  ``preemption="swap"`` its pages are copied to host memory first
  (:mod:`diffkv_jax.row_swap`) and put back into fresh pages when it is
  admitted again, so it resumes exactly where it stopped, without a prefill.

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
import contextlib
import dataclasses
import functools
import itertools
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax import memory_budget, row_swap
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import (GenerationInputError, Generator, SamplingParams,
                                   decode_width, next_pow2,
                                   prompt_bucket, prompt_page_width)
from diffkv_jax.steps import GROWTH_STEPS, pool_counts


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
    # Tokens sampled by steps whose results the host had not read yet when it last
    # read results (or when the request left its slot); the admission they belong
    # to (a preempted request's in-flight tokens are dropped).
    in_flight: int = 0
    epoch: int = 0
    prefilled: int = 0  # context tokens in the cache (chunked prefill's progress)
    # Its cache in host memory while it waits, preempted by swapping
    # (:class:`row_swap.SwappedRow`), and the pages that cache holds.
    swapped: Any = dataclasses.field(default=None, repr=False, compare=False)
    swapped_pages: int = 0
    # Text of ``output`` (None when the engine has no detokenizer); fed every step
    # for requests with stop strings, on demand for the others.
    text_tracker: TextTracker | None = dataclasses.field(default=None, repr=False,
                                                         compare=False)
    _kv_stats: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    _kv_read: Callable[[], None] | None = dataclasses.field(default=None, repr=False,
                                                            compare=False)

    @property
    def kv_stats(self) -> dict | None:
        """The cache's accounting (``method.slot_memory_stats``) of this request's
        pages when it left its slot for good (finished or cancelled); None before.
        A row's pages never shrink while it decodes, so this is also the most it
        held. Read from the device on first access."""
        if self._kv_stats is None and self._kv_read is not None:
            self._kv_read()
        return self._kv_stats

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
        stats = self.kv_stats
        if stats is None:
            return None
        return stats["page_bytes"] + stats["table_bytes"]

    @property
    def context(self) -> list[int]:
        """Tokens the cache must hold before the next one is generated."""
        return self.prompt + self.output

    @property
    def context_len(self) -> int:
        """``len(context)`` without building the list (read for every token)."""
        return len(self.prompt) + len(self.output)



@dataclasses.dataclass
class _Dispatch:
    """A device call whose results the host has not read yet.

    ``tokens``: sampled tokens ``[n]`` with ``rows`` = (index, request id, epoch)
    of the rows that count; ``counts``: the pool's free-page count right after the
    call (exact at that point of the device's queue) and the bound on the next
    decode steps' page growth (:func:`diffkv_jax.steps.pool_counts`); ``accounting``: copies of
    the cache's accounting arrays taken before a release, with the (request id,
    slot) pairs they describe.
    """

    order: int
    counts: jax.Array
    tokens: jax.Array | None = None
    rows: list = dataclasses.field(default_factory=list)
    accounting: tuple | None = None
    released: list = dataclasses.field(default_factory=list)
    read: bool = False


def pages_to_serve(method, tokens: int) -> int:
    """Pool pages one request needs to reach ``tokens`` of context in an otherwise
    empty :class:`Engine`: its pages plus what two decode steps may allocate (the
    step in flight, whose allocation the host has not read yet, and the next)."""
    step = method.num_layers * method.num_kv_heads * method.max_new_pages_per_row
    return method.pages_for_tokens(min(tokens, method.max_context)) + 2 * step


def prefill_shape(lengths: Sequence[int]) -> tuple[int, int]:
    """The ``(rows, tokens)`` bucket that a prefill of rows of ``lengths`` tokens
    is padded to (a power of two of rows; tokens: :func:`prompt_bucket`)."""
    return next_pow2(len(lengths)), prompt_bucket(max(lengths))


def prefill_cost(lengths: Sequence[int], call_tokens: int) -> int:
    """Work of one prefill call, in padded tokens: its bucket's rows x tokens plus
    ``call_tokens``, the fixed cost of a call (the weights read once)."""
    rows, tokens = prefill_shape(lengths)
    return call_tokens + rows * tokens


class Engine(Generator):
    """Serve many requests through ``method.max_seqs`` decode slots.

    Args:
      cfg, params, method, dtype: as for :class:`Generator`; ``method.max_seqs`` is the
        most requests decoded together (the max batch).
      num_pages: pool pages. None: as many as ``memory_bytes`` holds
        (:func:`memory_budget.pages_for_memory`, page tables included).
      memory_bytes: the cache's memory budget in bytes, when ``num_pages`` is None.
        None: :data:`memory_budget.DEFAULT_MEMORY_FRACTION` of what the device has
        free once the weights are on it.
      max_prefill_batch: prompts (or prompt chunks) prefilled together in one step.
        A waiting prompt joins the step's prefill only if that costs no more
        padded work (:func:`prefill_cost`) than prefilling it in a call of its own:
        a short prompt does not ride in a long prompt's bucket, nor a third row
        double the bucket's rows; it waits for the next step instead.
      admit_headroom_tokens: growth, in tokens per running request, kept free when
        admitting (fewer preemptions, a smaller batch); 0 admits while pages last.
      preemption: "recompute" (a preempted request is prefilled again from its
        prompt and output) or "swap" (its pages wait in page-locked host memory
        and come back as they were; methods with ``swap_pool_fields``: the
        uncompressed, FP8 and DiffKV caches and the token-eviction baselines).
        Recompute is the default: it was the faster of the two on the H200.
      swap_bytes: host memory the swapped caches may take together; a preemption
        that would exceed it recomputes instead.
      swap_pool_bytes: page-locked host memory to allocate at construction, so that
        swaps reuse it instead of locking fresh memory (:func:`row_swap.grow_host_pool`;
        GPU only, ``preemption="swap"`` only; 0: grow as swaps come).
      prefill_chunk: prefill long prompts this many tokens per step, between
        decode steps, so running requests keep generating while a long prompt
        arrives (methods with ``supports_chunked_prefill``: the uncompressed, FP8
        and DiffKV caches and the token-eviction baselines). None: whole prompts.
      detokenizer: turns token ids into text, for stop strings, :attr:`Request.text`
        and :meth:`stream_text`: either a callable ``list[int] -> str`` or an object
        with a ``decode(ids)`` method, such as the project's
        :class:`models.tokenizer.Tokenizer` (``decode(ids)``, special tokens kept).
        Without one, requests with ``stop_strings`` are refused.

    The host admits and preempts so that no device allocation can find the pool
    too short. Should one ever do (a defect in that accounting), the engine
    learns it with the step's results, preempts every running request and
    recomputes it from the tokens sampled before the failing call
    (:attr:`allocation_recoveries` counts it, with a ``RuntimeWarning``): no
    request continues from a cache that missed a page.

    Timing counters (compilation excluded): ``wait_seconds`` is the time
    :meth:`step` spent blocked on device results, ``call_seconds`` the time
    inside device calls (where the runtime dispatches asynchronously, only the
    launch), ``host_seconds`` the rest: Python scheduling and bookkeeping. Host
    time can only delay the device where it is not overlapped, so
    ``host_seconds`` bounds the host overhead from above.
    ``exposed_host_seconds`` is a tighter bound on the time the device idled
    for the host: it counts only iterations that found the previous step's
    results already finished (a read under :attr:`READY_WAIT_S`), the time from
    that step's queueing (or the end of the host's last real wait for any
    result, if later: a read before preempting, a release, a swap, the wait
    before a compilation) to this step's queueing, compilation in between left
    out. Steps run inside :meth:`unaccounted` change none of these counters.
    ``prefill_seconds`` / ``decode_seconds`` split the steps' wall time: a step
    that prefilled counts as prefill, any other as decode.
    """

    #: A results read shorter than this found the results ready (no real wait).
    READY_WAIT_S = 2e-4
    #: The fixed cost of a prefill call in tokens of padded work, for grouping
    #: prompts (:func:`prefill_cost`): an 8B model's weights take about as long to
    #: read as 200 - 250 tokens take to prefill on an H200.
    PREFILL_CALL_TOKENS = 256
    #: Read every result in flight before preempting (the exact free count); False
    #: preempts on the bound alone, as measured in scripts/bench_preemption.py.
    READ_BEFORE_PREEMPTING = True

    def __init__(self, cfg, params, method, num_pages: int | None = None, dtype=jnp.float32,
                 max_prefill_batch: int = 4, detokenizer=None,
                 admit_headroom_tokens: int = 0, prefill_chunk: int | None = None,
                 memory_bytes: int | None = None, preemption: str = "recompute",
                 swap_bytes: int = 16 * 2**30, swap_pool_bytes: int = 0):
        if num_pages is None:
            if memory_bytes is None:
                memory_bytes = memory_budget.default_memory_bytes()
            num_pages = memory_budget.pages_for_memory(method, memory_bytes)
        elif memory_bytes is not None:
            raise ValueError("give num_pages or memory_bytes, not both")
        super().__init__(cfg, params, method, num_pages, dtype)
        self.max_prefill_batch = max_prefill_batch
        if prefill_chunk is not None:
            if prefill_chunk < 1:
                raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
            if not getattr(method, "supports_chunked_prefill", False):
                raise ValueError(f"{type(method).__name__} prefills whole prompts only; "
                                 "pass prefill_chunk=None")
        self.prefill_chunk = prefill_chunk
        self._chunking: list[int] = []  # request ids mid-prefill, oldest first
        self._pick = jax.jit(lambda x, i: x[i])
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        if preemption == "swap" and not row_swap.supports_swap(method):
            raise ValueError(f"{type(method).__name__} cannot swap a slot's cache out; "
                             "use preemption='recompute'")
        self.preemption, self.swap_bytes = preemption, swap_bytes
        if preemption == "swap" and swap_pool_bytes > 0:
            (device,) = self.state.page_table.devices()
            row_swap.grow_host_pool(device, min(swap_pool_bytes, swap_bytes))
        self._swap_fns: dict = {}
        self.swapped_bytes = 0  # host bytes the waiting swapped caches hold now
        self.swap_outs = self.swap_ins = 0
        self.preemption_syncs = 0  # steps that read every result before preempting
        self.swap_moved_bytes = 0  # copied out and back, in total
        # Pages kept free per running row at admission, so that requests admitted
        # now can grow for ``admit_headroom_tokens`` before anyone is preempted.
        self.admit_headroom_tokens = admit_headroom_tokens
        self._headroom_per_row = (method.pages_for_tokens(admit_headroom_tokens)
                                  - method.pages_for_tokens(0)) if admit_headroom_tokens else 0
        self.detokenizer = as_detokenizer(detokenizer)
        self._ids = itertools.count()
        self._orders = itertools.count()
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.slots: list[int | None] = [None] * method.max_seqs
        self.steps_run = 0
        # Throughput counters (compilation excluded) and the largest cache footprint seen.
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_padded_tokens = 0  # rows x tokens of the prefill buckets run
        self.prefill_seconds = self.decode_seconds = 0.0
        self.wait_seconds = self.host_seconds = 0.0
        self.exposed_host_seconds = 0.0
        self._queued_at, self._busy_until = None, 0.0
        # compile_seconds when the last step was queued / the last real wait ended
        self._compile_at_queue = self._compile_at_busy = 0.0
        self.peak_memory: dict = {}
        S = method.max_seqs
        # Last sampled token of every slot, kept on the device: a decode step feeds
        # the previous step's samples straight back, before the host has read them.
        self._last = jnp.zeros(S, jnp.int32)
        # Not donated: a dispatch record may still hold the previous array.
        self._set_last = jax.jit(lambda last, slots, tok: last.at[slots].set(tok, mode="drop"))
        # The free count and growth bound (a copy: the state's own buffers are
        # donated by the next step).
        self._pool_counts = jax.jit(lambda st: pool_counts(method, st))
        self._snapshot = jax.jit(lambda st: jax.tree_util.tree_map(
            jnp.copy, method.accounting_arrays(st)))
        self._pending: list[_Dispatch] = []
        self._last_order = -1  # the latest dispatch recorded
        # A device allocation that found the pool too short (the host's reserve fell
        # short: a defect, never a workload): the first dispatch that reported it, and
        # the last dispatch before the flag was cleared (their reports are stale).
        self.allocation_recoveries = 0
        self._alloc_failed_at: int | None = None
        self._flags_cleared_at = -1
        self._clear_alloc_failed = jax.jit(
            lambda st: st.replace(alloc_failed=jnp.zeros((), bool)), donate_argnums=0)
        # Free pages: exact after dispatch `_base_order`, minus the most each later
        # dispatch may have allocated (releases count 0 until read): prompt pages
        # in `_costs`, decode growth from `_growth_log` and the base's growth bound.
        self._base_order, self._base_free = -1, num_pages
        self._costs: dict[int, int] = {}
        self._init_growth()
        self._sampling_static = None  # device sampling columns of the current slot map
        # Per-slot bookkeeping as arrays, so a step's scheduling does not loop over
        # rows in Python: tokens generated (in flight included), the most a slot's
        # request may generate, its prompt length, request id, admission epoch and
        # order, and whether it is running.
        self._gen = np.zeros(S, np.int64)
        self._limit = np.zeros(S, np.int64)
        self._plen = np.zeros(S, np.int64)
        self._rid = np.full(S, -1, np.int64)
        self._epoch = np.zeros(S, np.int64)
        self._order = np.zeros(S, np.int64)
        self._live = np.zeros(S, bool)

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
        # Refuse what could not finish even alone: its longest context, plus the
        # pages a step may take while the previous one is still in flight.
        worst = pages_to_serve(self.method, len(prompt) + sampling.max_new_tokens)
        if worst > self.num_pages:
            raise GenerationInputError(
                f"a request of {len(prompt)} prompt tokens and up to "
                f"{sampling.max_new_tokens} new ones needs up to {worst} pages; the pool has "
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
            self._drop_swapped(req)
        elif req.status == "running":
            self._free_slots([req.slot])
        if req.status in ("waiting", "running"):
            req.status, req.finish_reason = "cancelled", "cancelled"

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, or device results are still unread."""
        return bool(self.waiting) or bool(self._pending) or any(
            s is not None for s in self.slots)

    @property
    def free_pages(self) -> int:
        """Free pages in the pool: exact once every dispatched step has been read
        (e.g. when the engine is idle), otherwise a lower bound."""
        fixed = sum(c for o, c in self._costs.items() if o > self._base_order)
        return self._base_free - fixed - self._growth(0, 0)

    @free_pages.setter
    def free_pages(self, value: int) -> None:
        # Only the base class sets it, before any dispatch: the pool is all free.
        self._base_order, self._base_free, self._costs = -1, int(value), {}
        self._init_growth()

    def _init_growth(self) -> None:
        # Growth bound of the base (None: unknown), and the unread dispatches that
        # grow the cache: order -> ("decode", rows) or ("admit", new decoding rows).
        self._base_growth: np.ndarray | None = None
        self._growth_log: dict[int, tuple[str, int]] = {}

    def _growth(self, extra_steps: int, rows: int, new: int = 0) -> int:
        """Most pages the unread decode steps, then ``extra_steps`` more steps of
        ``rows`` running rows (``new`` of them admitted but not yet dispatched),
        can allocate.

        Rows live at the base are bounded by its ``growth_bound`` (a cumulative
        bound over the next steps); rows admitted since count the worst case,
        every layer and head gaining ``max_new_pages_per_row`` pages a step.
        Without a bound (or beyond its steps) everyone counts the worst case.
        """
        m = self.method
        worst = m.num_layers * m.num_kv_heads * m.max_new_pages_per_row
        later = sorted((o, e) for o, e in self._growth_log.items() if o > self._base_order)
        decode_rows = [n for _, (kind, n) in later if kind == "decode"]
        everyone = worst * (sum(decode_rows) + extra_steps * rows)
        steps = len(decode_rows) + extra_steps
        if self._base_growth is None or steps > len(self._base_growth):
            return everyone
        bound = int(self._base_growth[steps - 1]) if steps else 0
        decodes_after = len(decode_rows)
        for _, (kind, n) in later:
            if kind == "decode":
                decodes_after -= 1
            else:  # admitted after the base: worst case for every step they may decode
                bound += worst * n * (decodes_after + extra_steps)
        bound += worst * new * extra_steps
        return min(bound, everyone)

    def _step_reserve(self, rows: int, new: int = 0) -> int:
        """Pages to keep free so that one more decode step of ``rows`` rows (``new``
        of them not yet dispatched) cannot run out."""
        return self._growth(1, rows, new) - self._growth(0, 0)

    def step(self) -> dict[int, list[int]]:
        """Run one scheduling iteration; returns the new tokens of each request.

        The iteration queues this step's prefill and decode on the device, then
        reads the results of the previous iteration while they run, so the host's
        bookkeeping overlaps the device's work. Tokens are therefore returned one
        iteration after the step that sampled them; a request that ends on a stop
        token has had one more token computed, which is dropped.
        """
        t0, c0, k0 = time.perf_counter(), self.compile_seconds, self.call_seconds
        w0 = self.wait_seconds
        new: dict[int, list[int]] = collections.defaultdict(list)
        if self._alloc_failed_at is not None:
            self._recover_allocation(new)
        unread = len(self._pending)
        prefilled = self._admit()
        self._preempt_if_needed(new)
        self._dispatch_decode()
        queued = time.perf_counter()
        wait = self._collect([d for d in self._pending[:unread] if not d.read], new)
        self._expose(queued, wait, time.perf_counter())
        self.steps_run += 1
        wall = time.perf_counter() - t0 - (self.compile_seconds - c0)
        calls = self.call_seconds - k0
        self.wait_seconds += wait
        wait = self.wait_seconds - w0  # preemption's out-of-turn reads included
        self.host_seconds += max(wall - wait - calls, 0.0)
        if prefilled:
            self.prefill_seconds += wall
        else:
            self.decode_seconds += wall
        self.last_step = (wall, wait, calls)
        return dict(new)

    def _expose(self, queued: float, wait: float, read_at: float) -> None:
        """Bound the device's idle time before this step's work (see class docstring).

        The previous step's work was still running when this step's was queued
        if reading its results took a real wait; then the host delayed nothing.
        Otherwise the device may have idled from the end of the previous step's
        work to ``queued``: that work ended no earlier than its own queueing, nor
        than the host's last wait, if that wait was real.
        """
        if self._queued_at is not None and wait < self.READY_WAIT_S:
            if self._busy_until > self._queued_at:
                since, compiled_before = self._busy_until, self._compile_at_busy
            else:
                since, compiled_before = self._queued_at, self._compile_at_queue
            # Compilation since then is left out, as from every other rate.
            compiling = self.compile_seconds - compiled_before
            self.exposed_host_seconds += max(queued - since - compiling, 0.0)
        self._queued_at, self._compile_at_queue = queued, self.compile_seconds
        self._waited(wait, read_at)

    def _waited(self, seconds: float, until: float) -> None:
        """A read that blocked ``seconds`` until ``until``: if that was a real wait,
        the device was busy until then, whatever read it was."""
        if seconds >= self.READY_WAIT_S and until > self._busy_until:
            self._busy_until, self._compile_at_busy = until, self.compile_seconds

    def _drained(self, seconds: float, until: float) -> None:
        # The wait before compiling a new shape: the device was busy until then too.
        self._waited(seconds, until)

    @contextlib.contextmanager
    def unaccounted(self):
        """Steps run inside are left out of the timing counters (host, wait, call,
        exposed host, prefill and decode seconds, decode tokens), as compilation is.
        For work around :meth:`step` that blocks on the device or pauses the host,
        such as tracing a few steps: the first step after it does not count that
        pause as time the device idled for the host."""
        names = ("host_seconds", "wait_seconds", "call_seconds", "exposed_host_seconds",
                 "prefill_seconds", "decode_seconds", "decode_tokens")
        saved = {n: getattr(self, n) for n in names}
        try:
            yield self
        finally:
            for n, v in saved.items():
                setattr(self, n, v)
            self._queued_at = None

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
    def _decodable(self) -> np.ndarray:
        """Slots whose request still needs a token once its in-flight ones are
        counted (length and context limits are known ahead; a stop token is not)."""
        return np.flatnonzero(self._live & (self._gen < self._limit))

    def _new_dispatch(self, counts: jax.Array, cost: int, growth: tuple[str, int] | None = None,
                      **fields) -> _Dispatch:
        """Record a device call: ``cost`` pages it allocates at most besides decode
        growth; ``growth``: ("decode", rows) or ("admit", rows that will decode)."""
        d = _Dispatch(order=next(self._orders), counts=counts, **fields)
        self._last_order = d.order
        self._costs[d.order] = cost
        if growth is not None:
            self._growth_log[d.order] = growth
        self._pending.append(d)
        return d

    def _admit(self) -> bool:
        """Queue this step's prefill: the next chunk of every prompt mid-prefill, then
        waiting requests while their pages fit; True if anything was queued."""
        free_slots = [i for i, r in enumerate(self.slots) if r is None]
        running = len(self.slots) - len(free_slots)
        rows: list[tuple[Request, int]] = [
            (self.requests[rid], self.requests[rid].prefilled)
            for rid in self._chunking[: self.max_prefill_batch]]
        chunk = self.prefill_chunk
        lengths = [min(chunk or r.context_len, r.context_len - start) for r, start in rows]
        # A lower bound: the step in flight may still allocate (see free_pages).
        free = self.free_pages
        while self.waiting and free_slots and len(rows) < self.max_prefill_batch:
            req = self.requests[self.waiting[0]]
            if req.swapped is not None:  # its cache comes back from host memory
                if not self._fits(free, req.swapped_pages, running + len(rows) + 1,
                                  len(rows) + 1):
                    break
                self.waiting.popleft()
                free -= req.swapped_pages
                self._swap_in(req, free_slots.pop(0))
                running += 1
                continue
            n_tok = min(chunk or req.context_len, req.context_len)
            if lengths and (prefill_cost(lengths + [n_tok], self.PREFILL_CALL_TOKENS)
                            > prefill_cost(lengths, self.PREFILL_CALL_TOKENS)
                            + prefill_cost([n_tok], self.PREFILL_CALL_TOKENS)):
                break  # cheaper in a call of its own, next step (first come, first served)
            need = self.method.pages_for_tokens(req.context_len)
            if not self._fits(free, need, running + len(rows) + 1, len(rows) + 1):
                break
            self.waiting.popleft()
            self._occupy(req, free_slots.pop(0))
            req.prefilled = 0
            rows.append((req, 0))
            lengths.append(n_tok)
            free -= need
        if rows:
            self._sampling_static = None
            self._prefill(rows)
        return bool(rows)

    def _fits(self, free: int, need: int, rows: int, new: int) -> bool:
        """Whether ``need`` pages can go to an admission, leaving the reserve of the
        next decode step of ``rows`` rows: every row admitted now (``new``) counts
        the worst case for its first step (a prompt's last chunk moves its length
        past what the bound saw), plus the headroom per row."""
        return free - need >= self._step_reserve(rows, new) + rows * self._headroom_per_row

    def _occupy(self, req: Request, slot: int) -> None:
        """``req`` takes ``slot`` in a new admission (epoch)."""
        req.slot, req.status = slot, "running"
        req.epoch += 1
        req.in_flight = 0
        self.slots[slot] = req.id

    def _start_decoding(self, req: Request, generated: int) -> None:
        """``req``'s slot decodes from the next step, ``generated`` tokens sampled so
        far (those in flight included)."""
        s = req.slot
        self._gen[s] = generated
        self._limit[s] = min(req.sampling.max_new_tokens,
                             self.method.max_context - len(req.prompt))
        self._plen[s], self._rid[s], self._epoch[s] = len(req.prompt), req.id, req.epoch
        # Priority is arrival: the newest arrival is preempted first, and a
        # preempted request keeps its place (preempting it again would throw
        # away the recomputation it has just paid for).
        self._order[s], self._live[s] = req.id, True

    def _prefill(self, rows: list[tuple[Request, int]]) -> None:
        """Prefill ``(request, start)`` rows: each row's context from ``start``, whole
        or (with ``prefill_chunk``) its next chunk. Rows whose prompt is complete
        sample their first token; the others stay in ``_chunking``."""
        S = self.method.max_seqs
        chunk = self.prefill_chunk or max(r.context_len for r, _ in rows)
        pieces = [(r, start, min(chunk, r.context_len - start)) for r, start in rows]
        chunked = any(start > 0 or n < r.context_len for r, start, n in pieces)
        B, T = prefill_shape([n for _, _, n in pieces])
        toks = np.zeros((B, T), np.int32)
        lens, starts, totals = (np.zeros(B, np.int32) for _ in range(3))
        slots = np.full(B, S, np.int32)
        for i, (r, start, n) in enumerate(pieces):
            ctx = r.context
            toks[i, :n] = ctx[start:start + n]
            lens[i], starts[i], totals[i], slots[i] = n, start, len(ctx), r.slot
        if chunked:
            width = prompt_page_width(self.method, int(totals.max()))
            pbatch = PrefillBatch(jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots),
                                  jnp.asarray(starts), jnp.asarray(totals), width)
        else:
            width = 0
            pbatch = PrefillBatch(jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots))
        self.state, logits = self._run("prefill", (B, T, width), self.steps.prefill,
                                       self.params, self.state, pbatch)
        done = [(i, r) for i, (r, start, n) in enumerate(pieces) if start + n == r.context_len]
        for r, start, n in pieces:
            if start == 0:  # a new admission: no tokens in flight until its prompt is in
                self._gen[r.slot], self._rid[r.slot] = len(r.output), r.id
                self._live[r.slot] = False
            r.prefilled = start + n
            if r.prefilled < r.context_len and r.id not in self._chunking:
                self._chunking.append(r.id)
            elif r.prefilled == r.context_len and r.id in self._chunking:
                self._chunking.remove(r.id)
        self.prefill_tokens += int(lens.sum())
        self.prefill_padded_tokens += B * T
        # First chunks allocate their whole prompt's pages (see begin_prefill).
        need = sum(self.method.pages_for_tokens(r.context_len)
                   for r, start, _ in pieces if start == 0)
        if not done:
            self._new_dispatch(self._run("count", None, self._pool_counts, self.state), need)
            return
        smp = self._sampling_arrays([r.sampling for _, r in done], B,
                                    steps=np.asarray([len(r.output) for _, r in done]
                                                     + [0] * (B - len(done)), np.int32))
        order = np.full(B, S, np.int32)  # row i of `first` belongs to done[i]'s slot
        picks = np.zeros(B, np.int32)
        for j, (i, r) in enumerate(done):
            order[j], picks[j] = r.slot, i
        if [i for i, _ in done] != list(range(len(done))):
            logits = self._run("pick", B, self._pick, logits, jnp.asarray(picks))
        first = self._run("sample", (B, smp.greedy_only), self._sample, logits, smp)
        self._last = self._run("set_last", B, self._set_last, self._last, jnp.asarray(order),
                               first)
        for _, r in done:
            r.in_flight = 1
            self._start_decoding(r, len(r.output) + 1)
        self._new_dispatch(self._run("count", None, self._pool_counts, self.state), need,
                           growth=("admit", len(done)), tokens=first,
                           rows=[(j, r.id, r.epoch) for j, (_, r) in enumerate(done)])

    def _preempt_if_needed(self, new) -> None:
        def by_priority():
            rows = self._decodable()
            return list(rows[np.argsort(self._order[rows])])

        rows = by_priority()
        # (a swapped row needs every token on the host, so swapping always reads)
        synced = not (self.READ_BEFORE_PREEMPTING or self.preemption == "swap")
        while rows and self.free_pages < self._step_reserve(len(rows)):
            if not synced:
                # The free count is a lower bound while results are unread (the steps
                # in flight count their most growth, releases nothing): read them all
                # first. Most shortages vanish with it (requests finished, growth
                # smaller than its bound), and a preemption, costlier than the wait,
                # happens only for a real one. (A swapped row also needs every token
                # sampled so far on the host: it resumes from its cache.)
                self.wait_seconds += self._collect([d for d in self._pending if not d.read],
                                                   new)
                for d in list(self._pending):
                    self._read_dispatch(d)
                synced, rows = True, by_priority()
                self.preemption_syncs += 1
                continue
            victim = self.requests[int(self._rid[rows.pop()])]
            victim.preemptions += 1
            if self.preemption == "swap" and self._swap_out(victim):
                continue
            # Preemption is rare: wait for the release to learn the exact free count.
            self._read_dispatch(self._free_slots([victim.slot], requeue=True))

    def _swap_fn(self, kind: str, max_pages: int):
        key = (kind, max_pages)
        if key not in self._swap_fns:
            if kind == "out":
                fn = jax.jit(functools.partial(row_swap.export_row, self.method,
                                               max_pages=max_pages))
            else:
                fn = jax.jit(functools.partial(row_swap.import_row, self.method),
                             donate_argnums=(0,))
            self._swap_fns[key] = fn
        return self._swap_fns[key]

    def _swap_out(self, victim: Request) -> bool:
        """Start copying the victim's cache to host memory and free its slot; False
        (nothing done) where the copy would not fit ``swap_bytes``."""
        bound = self.method.pages_for_tokens(victim.context_len + 1)  # >= the pages it owns
        n = row_swap.row_pages_bucket(bound, row_swap.max_row_pages(self.method))
        slot = jnp.asarray(victim.slot, jnp.int32)
        row = self._run("swap_out", n, self._swap_fn("out", n), self.state, slot)
        t0 = time.perf_counter()
        # One scalar: the steps in flight were all read before preempting, so this
        # waits for the copy-out kernel alone, not for the transfer to the host.
        count = int(row.count)
        t1 = time.perf_counter()
        self.wait_seconds += t1 - t0
        self._waited(t1 - t0, t1)
        size = row.nbytes
        if count > n or self.swapped_bytes + size > self.swap_bytes:
            return False
        victim.swapped, victim.swapped_pages = row_swap.to_host(row), count
        self.swapped_bytes += size
        self.swap_outs += 1
        self.swap_moved_bytes += size
        self._read_dispatch(self._free_slots([victim.slot], requeue=True))
        return True

    def _swap_in(self, req: Request, slot: int) -> None:
        """Put a swapped request's cache into ``slot``; it decodes from the next step."""
        host, need = req.swapped, req.swapped_pages
        self._drop_swapped(req)
        n = next(iter(host.pages.values())).shape[0]
        (device,) = self.state.page_table.devices()
        self.state = self._run("swap_in", n, self._swap_fn("in", n), self.state,
                               jnp.asarray(slot, jnp.int32), row_swap.to_device(host, device))
        self.swap_ins += 1
        self.swap_moved_bytes += host.nbytes
        self._occupy(req, slot)
        req.prefilled = req.context_len
        self._start_decoding(req, len(req.output))  # the next step samples token len(output)
        self._last = self._run("set_last", 1, self._set_last, self._last,
                               jnp.asarray([slot], jnp.int32),
                               jnp.asarray([req.output[-1]], jnp.int32))
        self._sampling_static = None
        self._new_dispatch(self._run("count", None, self._pool_counts, self.state), need,
                           growth=("admit", 1))

    def _drop_swapped(self, req: Request) -> None:
        if req.swapped is not None:
            self.swapped_bytes -= req.swapped.nbytes
            req.swapped, req.swapped_pages = None, 0

    def _dispatch_decode(self) -> None:
        S = self.method.max_seqs
        rows = self._decodable()
        if not len(rows):
            return
        active = np.zeros(S, bool)
        active[rows] = True
        steps = np.where(active, self._gen, 0).astype(np.int32)
        width = decode_width(self.method, int((self._plen[rows] + self._gen[rows]).max()))
        batch = DecodeBatch(self._last, jnp.asarray(active), width)
        if self._sampling_static is None:
            sampling = [SamplingParams() if rid is None else self.requests[rid].sampling
                        for rid in self.slots]
            self._sampling_static = self._sampling_arrays(sampling, S, steps)
        smp = self._sampling_static.replace(step=jnp.asarray(steps))
        self.state, tok, counts = self._run("decode", (width, smp.greedy_only),
                                            self.steps.decode_and_sample, self.params,
                                            self.state, batch, smp)
        self._last = tok
        self._gen[rows] += 1
        rec_rows = list(zip(rows.tolist(), self._rid[rows].tolist(), self._epoch[rows].tolist()))
        self.decode_tokens += len(rows)
        self._new_dispatch(counts, 0, growth=("decode", len(rows)), tokens=tok, rows=rec_rows)

    def _collect(self, dispatches: list[_Dispatch], new) -> float:
        """Read ``dispatches`` (in order), accept their tokens; returns seconds waited."""
        if not dispatches:
            return 0.0
        t0 = time.perf_counter()
        host = jax.device_get([(d.counts, d.tokens) for d in dispatches])
        t1 = time.perf_counter()
        waited = t1 - t0
        self._waited(waited, t1)
        done = []
        for d, (counts, tokens) in zip(dispatches, host):
            self._mark_read(d, counts)
            if self._alloc_failed_at is not None and d.order > self._alloc_failed_at:
                continue  # sampled after a failed allocation: recomputed after the recovery
            for i, rid, epoch in d.rows:
                r = self.requests[rid]
                if r.epoch != epoch or r.status != "running":
                    continue  # preempted, cancelled or ended since: the token is dropped
                done_now = self._accept(r, int(tokens[i]), new)
                r.in_flight = int(self._gen[r.slot]) - len(r.output)
                if done_now:
                    done.append(r.slot)
        self._pending = [d for d in self._pending if not d.read]
        self._free_slots(done)
        return waited

    def _mark_read(self, d: _Dispatch, counts) -> None:
        d.read = True
        counts = np.asarray(counts)
        if (counts[1 + GROWTH_STEPS] and d.order > self._flags_cleared_at
                and self._alloc_failed_at is None):
            self._alloc_failed_at = d.order
        if d.order > self._base_order:
            self._base_order, self._base_free = d.order, int(counts[0])
            growth = counts[1:1 + GROWTH_STEPS]
            # The bound holds for its leading non-negative entries (-1: no bound).
            valid = int(np.argmin(growth >= 0)) if (growth < 0).any() else len(growth)
            self._base_growth = growth[:valid] if valid else None
            self._costs = {o: c for o, c in self._costs.items() if o > d.order}
            self._growth_log = {o: e for o, e in self._growth_log.items() if o > d.order}
        if d.accounting is not None:
            self._read_accounting(d)

    def _recover_allocation(self, new) -> None:
        """Recover from an allocation that found the pool too short on the device.

        A row whose allocation failed misses a page, so its later steps would attend
        to (and write) less than its tokens. Every result is read; tokens sampled
        after the failing call are dropped; every running request is preempted and
        recomputed from the tokens before (all of them: the host cannot tell which
        rows the failed allocation served), so no request continues from a cache
        that missed a page; then the flag is cleared. Counted in
        :attr:`allocation_recoveries`.
        """
        failed_at = self._alloc_failed_at
        self.wait_seconds += self._collect([d for d in self._pending if not d.read], new)
        # Newest first, so that the oldest request ends at the front of the queue.
        slots = sorted((s for s, rid in enumerate(self.slots) if rid is not None),
                       key=lambda s: -self.slots[s])
        for s in slots:
            self.requests[self.slots[s]].preemptions += 1
        release = self._free_slots(slots, requeue=True)
        self.state = self._run("clear_alloc_failed", None, self._clear_alloc_failed,
                               self.state)
        self._flags_cleared_at = self._last_order
        if release is not None:
            self._read_dispatch(release)  # the exact free count again
        self._alloc_failed_at = None
        self.allocation_recoveries += 1
        warnings.warn(f"a device allocation found the page pool too short (dispatch "
                      f"{failed_at}); {len(slots)} running requests were preempted and "
                      "will be recomputed", RuntimeWarning, stacklevel=3)

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
        elif r.context_len >= self.method.max_context:
            r.finish_reason = "context"
        else:
            return False
        r.status = "finished"
        return True

    def _free_slots(self, slots: list[int], requeue: bool = False) -> _Dispatch | None:
        if not slots:
            return None
        accounting, released = None, []
        if not requeue:
            # Copies of the accounting arrays before the pages go back to the pool,
            # read (with the free count) when the host next reads results.
            accounting = self._run("snapshot", None, self._snapshot, self.state)
            released = [(self.slots[s], s) for s in slots]
        mask = np.zeros(self.method.max_seqs + 1, bool)
        mask[slots] = True
        self.state = self._run("release", None, self.steps.release, self.state,
                               jnp.asarray(mask))
        d = self._new_dispatch(self._run("count", None, self._pool_counts, self.state), 0,
                               accounting=accounting,
                               released=released)
        for rid, _ in released:
            self.requests[rid]._kv_read = lambda d=d: self._read_dispatch(d)
        self._sampling_static = None
        self._live[slots] = False
        for s in slots:
            rid = self.slots[s]
            if rid in self._chunking:
                self._chunking.remove(rid)
            self.slots[s] = None
            req = self.requests[rid]
            req.in_flight = int(self._gen[s]) - len(req.output)
            req.slot = None
            if requeue:
                req.status = "waiting"
                req.epoch += 1
                req.in_flight = 0
                self.waiting.appendleft(rid)
        return d

    def _read_dispatch(self, d: _Dispatch) -> None:
        """Read one release out of turn (someone asked for a request's bytes)."""
        if not d.read:
            t0 = time.perf_counter()
            counts = jax.device_get(d.counts)
            t1 = time.perf_counter()
            self.wait_seconds += t1 - t0
            self._waited(t1 - t0, t1)
            self._mark_read(d, counts)
            self._pending = [p for p in self._pending if not p.read]

    def _read_accounting(self, d: _Dispatch) -> None:
        arrays = jax.device_get(d.accounting)
        stats = self.method.stats_from_arrays(arrays)
        if stats["page_bytes"] >= self.peak_memory.get("page_bytes", -1):
            self.peak_memory = stats
        slots = [s for _, s in d.released]
        for (rid, _), st in zip(d.released, self.method.stats_from_arrays(arrays, slots)):
            self.requests[rid]._kv_stats = st
            self.requests[rid]._kv_read = None
        d.accounting = None
