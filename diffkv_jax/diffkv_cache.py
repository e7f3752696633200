"""The DiffKV compressed cache (``--kv diffkv``): tiered, quantized, paged, on the device.

State layout (one pytree, updated in place under donation):

* page pool shared by all layers and heads, unified pages
  (:mod:`diffkv_jax.unified_page`): ``data [P + 1, data_bytes]`` uint8 and
  per-slot side arrays ``k_meta, v_meta`` (uint32: float16 scale and zero,
  :func:`pallas_kernels.paged_decode.pack_meta`), ``scores`` (float32,
  accumulated probability), ``positions`` (int32); page ``P`` is the trash page;
* bidirectional page table ``[S + 1, L, H, R]``: high-tier pages from the left
  (columns ``0, 1, ...``), low-tier pages from the right (``R - 1, R - 2, ...``);
* per row ``n_tok [S + 1, L, H, 2]`` (tokens per tier) and
  ``n_pages [S + 1, L, H, 2]``;
* per slot ``seq_len`` (tokens seen, pruned included) and ``prompt_len``;
* the circular free list;
* per (sequence, KV head) row a merge counter, zero between launches (the
  decode launch that merges its own rows counts its items with them,
  ``merge_impl="launch"``).

Prefill: every row gets a conservative page set (all tokens high) from one
prefix sum; each layer scores, classifies and writes its tokens (high pages
from the left of the set, low pages from its right) and the surplus goes back
to the free list in one more prefix sum after the layer loop.

Decode, per layer: attention over the row's high and low pages plus the new
token (kept in full precision for its own step), then the policy update:
probabilities are added to the scores, one victim decision per row, the
victim demoted (re-quantized from its stored codes) or pruned, the newcomer
written into a high slot. After the layers, rows whose high or low region is
full get one page each (headroom), again by one prefix sum.

Token-eviction baselines (``policy.rule`` "h2o", "streamingllm", "snapkv", low
tier off) take the same steps: prefill keeps the tokens the rule selects
(:func:`~diffkv_jax.diffkv_policy.select_prompt`), decode prunes the rule's
victim or appends (:func:`~diffkv_jax.diffkv_policy.evict_decision`), so pages,
compaction and kernels are shared with DiffKV.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffkv_jax import attention as attn_ref
from diffkv_jax import diffkv_kernel_attention as dka
from diffkv_jax import diffkv_policy as pol
from diffkv_jax import free_list as fl
from diffkv_jax import quantization as qz
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.paged_cache import SlotAccounting
from diffkv_jax import prompt_scoring
from diffkv_jax.pool_writes import scatter_columns, scatter_rows, scatter_set
from diffkv_jax.unified_page import Tier, UnifiedPageLayout
from pallas_kernels import paged_decode as pdk
from pallas_kernels import token_writes as tw

HI, LO = 0, 1


@struct.dataclass
class DiffKVState:
    """Device state of the DiffKV cache (an immutable pytree)."""

    data: jax.Array
    k_meta: jax.Array
    v_meta: jax.Array
    scores: jax.Array
    positions: jax.Array
    page_table: jax.Array
    n_tok: jax.Array
    n_pages: jax.Array
    seq_len: jax.Array
    prompt_len: jax.Array
    free: fl.FreeList
    alloc_failed: jax.Array
    merge_counters: jax.Array  # [S * H] int32 (then the row cursors), zero between launches


@struct.dataclass
class RowView:
    """The cached tokens of one layer's rows, gathered per tier.

    Arrays are ``[S, H, n_slots_tier]`` (``data`` keeps its byte layout); ``ids``
    are the page IDs each slot lives in and ``slot`` its slot within the page.
    """

    ids: jax.Array
    slot: jax.Array
    valid: jax.Array
    scores: jax.Array
    positions: jax.Array
    keys: jax.Array  # float32 [S, H, n, D] dequantized (reference path)
    values: jax.Array


@dataclasses.dataclass(frozen=True)
class DiffKVCache(SlotAccounting):
    """DiffKV cache method (hashable: part of the jit cache key).

    Attributes:
      num_layers, num_kv_heads, head_dim: model geometry.
      max_seqs: decode slots; max_context: longest sequence per slot.
      policy: thresholds and windows.
      high, low: precision tiers (K8V4 / K4V2 by default).
      tokens_per_page: high-tier tokens per page (the low tier holds proportionally more).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    max_context: int
    policy: pol.DiffKVPolicy = pol.DiffKVPolicy()
    high: Tier = Tier(8, 4)
    low: Tier = Tier(4, 2)
    tokens_per_page: int = 32
    # "reference": plain jnp (gathers and dequantizes pages); "pallas": the paged
    # decode kernel of pallas_kernels/paged_decode.py (interpret mode off the GPU).
    attention_impl: str = "reference"
    # How a decode step writes its tokens: "xla" (the victim's gather and
    # dequantization, two quantizations and the scatters: about twenty small
    # kernels per layer), "pallas": one launch per layer that does all of it
    # (pallas_kernels/token_writes.py), or "auto": "pallas" for the two-tier
    # layouts (the ones compiled and timed on the H200) where the attention runs
    # on the kernels on a GPU, "xla" otherwise (in interpret mode the kernel would
    # only be slower).
    write_impl: str = "auto"
    # Where a decode step's decision is taken on the GPU kernel path: "xla" (the
    # victims' merge, the decision and the page lookups as XLA ops between the
    # policy kernel and the token writes) or "pallas" (all of it inside the
    # token-writes launch, pallas_kernels/token_writes.decide_and_write; needs the
    # fused writes and the DiffKV rule with its low tier), or "auto": "pallas"
    # where the fused writes run compiled on a GPU (one launch fewer per layer,
    # 2% of a 64 x 4K step on the H200), "xla" otherwise.
    decide_impl: str = "auto"
    # Who merges the attention launch's partials (and the newcomer) on the GPU
    # kernel path: "xla" (segment reductions, about six small kernels per layer),
    # "pallas" (the policy launch itself, pallas_kernels/policy_scores.py),
    # "launch" (each row's last work item in the attention launch, then the policy
    # launch folds that one partial with the newcomer:
    # pallas_kernels/paged_decode.paged_decode_merged; 0.5% slower per 64 x 4K step
    # on the H200, since the policy launch saves nothing when it already merges),
    # or "auto": "pallas" where the kernels run compiled on a GPU (4.3% of a 64 x 4K
    # step and 191 launches fewer on the H200), "xla" otherwise.
    merge_impl: str = "auto"
    # The decode kernel's dot tiles (pallas_kernels/paged_decode.py): "queries"
    # (the query rows are the tile's rows, padded to 16 on the GPU) or "tokens" (a
    # page's tokens are the rows and the queries the columns, padded to 8:
    # LaunchConfig.transposed, fewer registers and instructions per token), or
    # "auto": "tokens" where the kernels run compiled on a GPU (3 - 15% less time
    # per launch on the H200 at 12 - 128 rows), "queries" otherwise.
    kernel_tiles: str = "auto"
    # The policy launch's victim search (pallas_kernels/policy_scores.py): reduced
    # across a block's lanes in every step of the walk (False) or kept per lane and
    # reduced once after it (True: no barrier in the loop; the same victims, but 64
    # registers instead of 48 and 10 - 26% slower per launch on the H200).
    lane_victims: bool = False
    # The decode kernel's logits for the policy as stored, "float16" or "float32"
    # (pallas_kernels/paged_decode.LaunchConfig.logits_dtype): float16 halves what
    # the launch writes; the probabilities it gives are within 0.034% per unit of
    # the log2-unit logit (0.5% at 16) of float32's.
    logits_dtype: str = "float16"
    # The decode launch loads every tier's token count and the page-table entries of
    # each tier's first pages as soon as its work item is known
    # (LaunchConfig.early_row_loads): the same results, one dependent memory round
    # trip fewer before an item's first pages; not yet timed.
    early_row_loads: bool = False

    name = "diffkv"

    def __post_init__(self):
        # Page-count bounds (conservative prompt sets, row length) rely on a low
        # page holding at least as many tokens as a high page.
        if self.layout.capacity(LO) < self.layout.capacity(HI):
            raise ValueError(f"the low tier ({self.low}) must not use more bits per token "
                             f"than the high tier ({self.high})")
        if self.attention_impl not in ("reference", "pallas"):
            raise ValueError(f"attention_impl must be 'reference' or 'pallas', "
                             f"got {self.attention_impl!r}")
        if self.write_impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"write_impl must be 'auto', 'xla' or 'pallas', "
                             f"got {self.write_impl!r}")
        if self.merge_impl not in ("auto", "xla", "pallas", "launch"):
            raise ValueError(f"merge_impl must be 'auto', 'xla', 'pallas' or 'launch', "
                             f"got {self.merge_impl!r}")
        if self.merge_impl in ("pallas", "launch") and self.attention_impl != "pallas":
            raise ValueError(f"merge_impl={self.merge_impl!r} needs attention_impl='pallas': "
                             "the kernels merge the attention kernel's partials")
        if self.kernel_tiles not in ("auto", "queries", "tokens"):
            raise ValueError(f"kernel_tiles must be 'auto', 'queries' or 'tokens', "
                             f"got {self.kernel_tiles!r}")
        if self.logits_dtype not in ("float16", "float32"):
            raise ValueError(f"logits_dtype must be 'float16' or 'float32', "
                             f"got {self.logits_dtype!r}")
        if self.decide_impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"decide_impl must be 'auto', 'xla' or 'pallas', "
                             f"got {self.decide_impl!r}")
        if self.decide_impl == "pallas" and not (self._decision_fits_kernel
                                                 and self.write_impl != "xla"):
            raise ValueError("decide_impl='pallas' needs attention_impl='pallas', the DiffKV "
                             "rule with its low tier, and the token-writes kernel")
        if self.attention_impl == "pallas" and (
                self.head_dim % 16 or any(self.layout.used_bytes(t) != self.layout.data_bytes
                                          for t in (HI, LO))):
            raise ValueError("the Pallas kernel needs head_dim % 16 == 0 and tiers whose "
                             "tokens fill a page exactly (e.g. K8V4 with K4V2)")

    @property
    def _kernels_compiled(self) -> bool:
        """The kernel path on a GPU, where the "auto" settings choose the launches."""
        from pallas_kernels import backend
        return backend.runs_compiled(self.attention_impl)

    @property
    def fused_writes(self) -> bool:
        """Whether decode writes its tokens with the token-writes kernel."""
        if self.write_impl == "auto":
            return (self._kernels_compiled and self.policy.low_tier
                    and tw.quarters_fit(self.head_dim))
        return self.write_impl == "pallas"

    @property
    def token_tiles(self) -> bool:
        """Whether the decode kernel takes its dots with a page's tokens as the tiles'
        rows (``LaunchConfig.transposed``)."""
        if self.kernel_tiles == "auto":
            return self._kernels_compiled
        return self.kernel_tiles == "tokens"

    @property
    def _decision_fits_kernel(self) -> bool:
        return (self.attention_impl == "pallas" and self.policy.rule == "diffkv"
                and self.policy.low_tier)

    @property
    def merges_in_policy(self) -> bool:
        """Whether the policy launch merges the attention launch's partials itself
        (``merge_impl="pallas"``, or one partial per row with ``"launch"``) instead of
        XLA's segment reductions."""
        if self.merge_impl == "auto":
            return self._kernels_compiled
        return self.merge_impl in ("pallas", "launch")

    @property
    def merges_in_attention(self) -> bool:
        """Whether the attention launch merges its own rows (``merge_impl="launch"``)."""
        return self.merge_impl == "launch"

    @property
    def decides_in_kernel(self) -> bool:
        """Whether decode takes its decision inside the token-writes launch."""
        if self.decide_impl == "auto":
            return self._decision_fits_kernel and self.fused_writes and self._kernels_compiled
        return self.decide_impl == "pallas"

    @property
    def window_kernel(self) -> bool:
        """Whether prefill scores its observation window with the Pallas kernel: on
        the GPU kernel path (in interpret mode it would only be slower)."""
        return self._kernels_compiled

    # ---- geometry ---------------------------------------------------------------
    @property
    def layout(self) -> UnifiedPageLayout:
        return UnifiedPageLayout(self.head_dim, (self.high, self.low), self.tokens_per_page)

    @property
    def page_size(self) -> int:
        """High-tier tokens per page (the engine's unit for sizing decode reads)."""
        return self.tokens_per_page

    def cap(self, tier: int) -> int:
        return self.layout.capacity(tier)

    @property
    def row_len(self) -> int:
        # high pages <= n_high // cap_h + 1, low pages <= n_low // cap_l + 1, and
        # n_high + n_low <= max_context, so this can never overflow.
        return self.max_context // self.cap(HI) + 2

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    #: Pages a row can gain in one decode step: one per tier region (high and low).
    max_new_pages_per_row = 2

    def growth_bound(self, state: DiffKVState, steps: int) -> jax.Array:
        """``[steps]`` int32: entry ``m - 1`` is the most pages the next ``m`` decode
        steps can allocate, whichever live slots decode (-1 past a high page's
        tokens, where a region could grow twice).

        A tier region gains at most one token per step (the newcomer, or the
        demoted victim) and gets a page when it is full (``end_decode``), after
        which it has a page of room again; every region has at least one free
        slot between steps. So within ``m`` steps a region allocates at most once,
        and only if it has at most ``m`` free slots now: the count of those.
        """
        S = self.max_seqs
        caps = jnp.asarray([self.cap(HI), self.cap(LO)], jnp.int32)
        room = state.n_pages[:S] * caps - state.n_tok[:S]  # [S, L, H, 2] free slots
        # (a prompt still arriving in chunks has no prompt length yet and does not decode)
        live = ((state.seq_len[:S] > 0) & (state.prompt_len[:S] > 0))[:, None, None, None]
        if not self.policy.low_tier:
            live = live & (jnp.arange(2) == HI)
        m = jnp.arange(1, steps + 1)
        grows = live[None] & (room[None] <= m[:, None, None, None, None])
        bound = grows.reshape(steps, -1).sum(axis=1)
        return jnp.where(m <= self.cap(HI), bound, -1).astype(jnp.int32)

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages a sequence may hold at most (every token high, both headrooms)."""
        per_row = min(n_tokens // self.cap(HI) + 2, self.row_len)
        return per_row * self.num_layers * self.num_kv_heads

    # ---- state ------------------------------------------------------------------
    def addressable_pages(self, num_pages: int) -> int:
        """The largest pool of at most ``num_pages`` pages the GPU kernel can address.

        Where the Triton lowering's 32-bit offsets would overflow (code pools of
        2 - 4 GiB; the pool keeps one extra sentinel page) and the backend cannot
        widen them (:func:`pallas_kernels.backend.wide_offsets`), a count there
        drops to the largest below 2 GiB.
        """
        lay = self.layout
        if self.attention_impl != "pallas" or pdk.addressable(
                (num_pages + 1) * lay.data_bytes, 1):
            return num_pages
        return 2**31 // lay.data_bytes - 1

    def init_state(self, num_pages: int) -> DiffKVState:
        S, L, H, R = self.max_seqs, self.num_layers, self.num_kv_heads, self.row_len
        lay = self.layout
        below = self.addressable_pages(num_pages)
        if below != num_pages:
            above = 2**32 // lay.data_bytes + 1
            raise ValueError(f"{num_pages} pages ({(num_pages + 1) * lay.data_bytes} bytes of "
                             "codes) fall where the GPU kernel's 32-bit offsets overflow "
                             f"(2 - 4 GiB); use at most {below} or at least {above} pages")
        meta = lambda dt: jnp.zeros((num_pages + 1, lay.slots), dt)  # noqa: E731
        return DiffKVState(
            data=jnp.zeros((num_pages + 1, lay.data_bytes), jnp.uint8),
            k_meta=meta(jnp.uint32), v_meta=meta(jnp.uint32),
            scores=meta(jnp.float32), positions=meta(jnp.int32),
            page_table=jnp.full((S + 1, L, H, R), num_pages, jnp.int32),
            n_tok=jnp.zeros((S + 1, L, H, 2), jnp.int32),
            n_pages=jnp.zeros((S + 1, L, H, 2), jnp.int32),
            seq_len=jnp.zeros((S + 1,), jnp.int32),
            prompt_len=jnp.zeros((S + 1,), jnp.int32),
            free=fl.new_free_list(num_pages),
            alloc_failed=jnp.zeros((), bool),
            merge_counters=dka.merge_counters(S, H, self.early_row_loads),
        )

    @staticmethod
    def trash_page(state: DiffKVState) -> int:
        return state.data.shape[0] - 1

    def decode_positions(self, state: DiffKVState) -> jax.Array:
        return state.seq_len[: self.max_seqs]

    # ---- page I/O -----------------------------------------------------------------
    def _tier(self, t: int) -> Tier:
        return (self.high, self.low)[t]

    def _write_tokens(self, state: DiffKVState, tier: int, page, slot, k, v, score, pos):
        """Quantize ``k, v [..., D]`` to ``tier`` and scatter them to ``(page, slot)``.

        A page ID past the pool (:meth:`no_page`) drops the write: prefill sends
        every token it does not store there, so the dropped writes neither cost
        memory traffic nor pile up on one location.
        """
        codes, side = self._encode_tokens(tier, k, v, score, pos)
        state = self._write_codes(state, tier, page, slot, *codes)
        return self._write_side(state, page, slot, side)

    def _encode_tokens(self, tier: int, k, v, score, pos):
        """Quantized ``(key bytes, value bytes)`` of ``tier`` and the tokens' side entries
        ``(k_meta, v_meta, score, position)``, as the pool stores them."""
        t = self._tier(tier)
        kp, ks, kz = qz.quantize_packed(k, t.k_bits)
        vp, vs, vz = qz.quantize_packed(v, t.v_bits)
        return (kp, vp), (pdk.pack_meta(ks, kz), pdk.pack_meta(vs, vz), score, pos)

    def _write_codes(self, state: DiffKVState, tier: int, page, slot, kp, vp):
        """Scatter tokens' key and value bytes of ``tier`` to ``(page, slot)``."""
        kw, cap = self.layout.key_width(tier), self.cap(tier)
        # Keys are a token-major row of the page, values a column of its value rows.
        data = scatter_rows(state.data, page, slot * kw, kp)
        return state.replace(data=scatter_columns(data, cap, page, kw, slot, vp))

    @staticmethod
    def _write_side(state: DiffKVState, page, slot, side):
        """Scatter tokens' ``(k_meta, v_meta, score, position)`` to ``(page, slot)``: the
        side arrays have one entry per page slot whatever the tier, so writes of both
        tiers can go in one scatter per array."""
        at = (page, slot)
        k_meta, v_meta, score, pos = side
        return state.replace(
            k_meta=scatter_set(state.k_meta, at, k_meta),
            v_meta=scatter_set(state.v_meta, at, v_meta),
            scores=scatter_set(state.scores, at, score),
            positions=scatter_set(state.positions, at, pos))

    @staticmethod
    def no_page(state: DiffKVState) -> int:
        """A page ID past the pool: writes to it are dropped."""
        return state.data.shape[0]

    def _read_tokens(self, state: DiffKVState, tier: int, page, slot):
        """Dequantized ``(k, v)`` float32 ``[..., D]`` stored at ``(page, slot)``."""
        return tw.read_token_reference(state.data, state.k_meta, state.v_meta,
                                       self._token_format(tier), page, slot)

    def _token_format(self, tier: int):
        """How ``tier`` stores a token (:class:`pallas_kernels.token_writes.TokenFormat`)."""
        t = self._tier(tier)
        return tw.TokenFormat(t.k_bits, t.v_bits, self.cap(tier), self.head_dim)

    def gather_rows(self, state: DiffKVState, layer, tier: int, n_pages: int) -> RowView:
        """Gather ``n_pages`` pages of ``tier`` for every decode row of ``layer``.

        Whole pages are gathered and sliced (contiguous reads), then unpacked and
        dequantized; slot ``j * cap + s`` is slot ``s`` of the row's j-th page of the tier.
        """
        S, cap = self.max_seqs, self.cap(tier)
        rows = state.page_table[:S, layer]  # [S, H, R]
        cols = jnp.arange(n_pages) if tier == HI else self.row_len - 1 - jnp.arange(n_pages)
        pids = rows[:, :, cols]  # [S, H, n_pages]
        ids = jnp.repeat(pids, cap, axis=-1)
        slot = jnp.broadcast_to(jnp.tile(jnp.arange(cap, dtype=jnp.int32), n_pages), ids.shape)
        valid = jnp.arange(n_pages * cap) < state.n_tok[:S, layer, :, tier][..., None]
        k, v, scores, positions = self._read_pages(state, tier, pids)
        return RowView(ids=ids, slot=slot, valid=valid, scores=scores, positions=positions,
                       keys=k, values=v)

    def _read_pages(self, state: DiffKVState, tier: int, pids):
        """Every slot of pages ``pids [..., n]`` read as ``tier``: dequantized keys and
        values ``[..., n * cap, D]`` float32, scores and positions ``[..., n * cap]``."""
        cap, D = self.cap(tier), self.head_dim
        lay, t = self.layout, self._tier(tier)
        lead, n_pages = pids.shape[:-1], pids.shape[-1]
        n = n_pages * cap
        meta = lambda a: a[pids][..., :cap].reshape(*lead, n)  # noqa: E731
        blob = state.data[pids]  # [..., n_pages, data_bytes]
        kw, vw = lay.key_width(tier), lay.value_width(tier)
        kb = blob[..., :cap * kw].reshape(*lead, n, kw)
        vb = blob[..., cap * kw:cap * (kw + vw)].reshape(*lead, n_pages, vw, cap)
        vb = vb.swapaxes(-1, -2).reshape(*lead, n, vw)
        ks, kz = pdk.unpack_meta(meta(state.k_meta))
        vs, vz = pdk.unpack_meta(meta(state.v_meta))
        return (qz.dequantize_packed(kb, ks, kz, t.k_bits, D),
                qz.dequantize_packed(vb, vs, vz, t.v_bits, D),
                meta(state.scores), meta(state.positions))

    # ---- prefill ----------------------------------------------------------------------
    #: Prompts may be prefilled in chunks (``PrefillBatch.start``). A prompt's chunks
    #: are held at the high tier, their queries' probabilities added to every earlier
    #: token's score, and the last chunk classifies and compresses the whole prompt
    #: (:meth:`_prefill_chunk`).
    supports_chunked_prefill = True

    def prompt_pages(self, T):
        """Pages of the conservative set a ``T``-token prompt gets in each (layer, head):
        every token high, plus a page of headroom per tier. ``T`` int or int32 array."""
        n = T // self.cap(HI) + (2 if self.policy.low_tier else 1)
        return jnp.minimum(n, self.row_len) if isinstance(n, jax.Array) else min(n, self.row_len)

    def begin_prefill(self, state: DiffKVState, batch: PrefillBatch):
        """Allocate a conservative page set for every (row, layer, head) at once.

        A chunked batch allocates, for each row's first chunk, the set of its whole
        prompt (``batch.total``) and puts it in the high columns of the page table;
        later chunks find it there.
        """
        if batch.start is not None:
            return self._begin_chunks(state, batch)
        B, T = batch.tokens.shape
        L, H = self.num_layers, self.num_kv_heads
        c_max = self.prompt_pages(T)
        per_row = jnp.where(batch.lengths > 0, self.prompt_pages(batch.lengths), 0)
        counts = jnp.broadcast_to(per_row[:, None, None], (B, L, H)).reshape(-1)
        free, ids, ok = fl.allocate(state.free, counts, c_max)
        ids = ids.reshape(B, L, H, c_max)
        state = state.replace(free=free, alloc_failed=state.alloc_failed | ~ok)
        return state, (batch, ids, per_row)

    def _begin_chunks(self, state: DiffKVState, batch: PrefillBatch):
        B = batch.tokens.shape[0]
        S, L, H = self.max_seqs, self.num_layers, self.num_kv_heads
        W = min(batch.num_page_slots, self.row_len)
        per_row = jnp.where(batch.total > 0, self.prompt_pages(batch.total), 0)
        # A width below a prompt's set (``generation.prompt_page_width`` sizes it) would
        # fold its tokens onto its last page: such rows get nothing and fail loudly.
        fits = per_row <= W
        first = batch.start == 0
        counts = jnp.broadcast_to(jnp.where(first & fits, per_row, 0)[:, None, None],
                                  (B, L, H))
        free, ids, ok = fl.allocate(state.free, counts.reshape(-1), W)
        ids = ids.reshape(B, L, H, W)
        dest = jnp.where(first & fits & ok, batch.slots, S + 1)  # S + 1: dropped
        table = state.page_table.at[dest, :, :, :W].set(
            jnp.where(ids >= 0, ids, self.trash_page(state)), mode="drop")
        in_set = (jnp.arange(W) < per_row[:, None, None, None]) & fits[:, None, None, None]
        in_set = in_set & ~(first & ~ok)[:, None, None, None]
        set_ids = jnp.where(in_set, table[batch.slots, :, :, :W], -1)
        state = state.replace(page_table=table, free=free,
                              alloc_failed=state.alloc_failed | ~ok | ~fits.all())
        return state, (batch, set_ids, per_row)

    def prefill_attention(self, state: DiffKVState, layer, q, k, v, ctx):
        batch, ids, per_row = ctx
        if batch.start is not None:
            return self._prefill_chunk(state, layer, q, k, v, ctx)
        lse = None
        if self.window_kernel and self.policy.obs_window is not None:
            # cuDNN's softmax statistics spare the window kernel its normalizers' pass.
            out, lse = attn_ref.prefill_attention_lse(q, k, v, batch.lengths)
        else:
            out = attn_ref.prefill_attention(q, k, v, batch.lengths)
        score_sum = prompt_scoring.prompt_scores(q, k, batch.lengths, self.policy.obs_window,
                                                 window_kernel=self.window_kernel, lse=lse)
        return self.prefill_write(state, layer, k, v, score_sum, batch, ids, per_row), out

    def _prefill_chunk(self, state: DiffKVState, layer, q, k, v, ctx):
        """One layer of a prompt chunk (``batch.start`` tokens already held, at the high
        tier in slot order, i.e. token ``j`` in slot ``j % cap`` of the set's page
        ``j // cap``).

        The chunk's tokens join them; the chunk attends to the prefix as stored
        (dequantized, as decode steps see it) and to itself at full precision; its
        counted queries' probabilities are added to every held token's score. On a
        row's last chunk the whole prompt is classified from those scores and written
        to its tiers by :meth:`prefill_write`, as a whole-prompt prefill does, with
        the prefix re-quantized from its stored codes.
        """
        batch, set_ids, per_row = ctx
        B, T = batch.tokens.shape
        S, H, cap = self.max_seqs, self.num_kv_heads, self.cap(HI)
        row_set = set_ids[:, layer]  # [B, H, W]
        W = row_set.shape[-1]
        N = W * cap
        start, n = batch.start, batch.lengths
        held = start + n
        t = jnp.arange(T)
        pos = start[:, None] + t[None]  # [B, T]
        in_chunk = t[None] < n[:, None]
        skip = self.no_page(state)
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, H, T, D]
        # 1. The chunk's tokens join the held ones (their scores follow in 3).
        col = jnp.broadcast_to(jnp.minimum(pos // cap, W - 1)[:, None], (B, H, T))
        page = jnp.take_along_axis(row_set, col, axis=-1)
        page = jnp.where(in_chunk[:, None] & (page >= 0), page, skip)
        posb = jnp.broadcast_to(pos[:, None], (B, H, T))
        state = self._write_tokens(state, HI, page, posb % cap, kt, vt,
                                   jnp.zeros((B, H, T), jnp.float32), posb)
        # 2. The row as stored, the chunk itself at full precision.
        keys, values, stored, _ = self._read_pages(
            state, HI, jnp.where(row_set >= 0, row_set, self.trash_page(state)))
        at = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None],
              jnp.where(in_chunk, pos, N)[:, None, :])
        keys = keys.at[at].set(kt.astype(jnp.float32), mode="drop").transpose(0, 2, 1, 3)
        values = values.at[at].set(vt.astype(jnp.float32), mode="drop").transpose(0, 2, 1, 3)
        # 3. Scores: the prefix's so far plus what this chunk's counted queries give.
        counted_from = (jnp.zeros_like(start) if self.policy.obs_window is None
                        else batch.total - self.policy.obs_window)
        out, gained = attn_ref.blocked_prefix_attention(  # keys, values [B, N, H, D]
            q, keys, values, start, n,
            reduce=lambda p, s0, m: prompt_scoring.chunk_scores(p, s0, m, counted_from))
        j = jnp.arange(N)
        score = jnp.where(j < start[:, None, None], stored, 0.0) + gained
        final = (held == batch.total) & (batch.total > 0)
        going = (j < held[:, None, None]) & ~final[:, None, None]
        spage = jnp.repeat(row_set, cap, axis=-1)
        spage = jnp.where(going & (spage >= 0), spage, skip)
        state = state.replace(scores=scatter_set(
            state.scores, (spage, jnp.broadcast_to(j % cap, spage.shape)), score))
        # 4. Rows whose prompt is now complete: classify it whole and compress it.
        whole = PrefillBatch(jnp.zeros((B, N), jnp.int32), jnp.where(final, held, 0),
                             jnp.where(final, batch.slots, S + 1))
        state = self.prefill_write(state, layer, keys, values, score, whole,
                                   jnp.where(final[:, None, None, None], set_ids, -1), per_row)
        return state, out

    def prefill_write(self, state: DiffKVState, layer, k, v, score_sum, batch: PrefillBatch,
                      ids, per_row):
        """Classify one layer's prompt tokens and write them to their tiers' pages.

        Args:
          k, v: ``[B, T, H, D]`` full-precision prompt keys/values of ``layer``.
          score_sum: ``[B, H, T]`` summed probabilities (max over each GQA group).
          ids: ``[B, L, H, c]`` the conservative page sets (-1 where none).
          per_row: ``[B]`` pages in each row's set.
        """
        B, T = batch.tokens.shape
        H = self.num_kv_heads
        pos = jnp.arange(T, dtype=jnp.int32)
        L_b = batch.lengths[:, None, None]
        plens = jnp.broadcast_to(batch.lengths[:, None], (B, H))
        if self.policy.rule == "diffkv":
            counts = pol.query_counts(self.policy, pos[None, None, :], L_b, L_b - 1)
            tier = pol.classify_prompt(self.policy, score_sum / counts, plens)
        else:  # token-eviction baseline: rule-selected tokens high, the rest pruned
            tier = pol.select_prompt(self.policy, score_sum, plens)
        is_h, is_l = tier == pol.HIGH, tier == pol.LOW
        slot_h = jnp.cumsum(is_h, axis=-1) - 1
        slot_l = jnp.cumsum(is_l, axis=-1) - 1
        n_h, n_l = is_h.sum(-1).astype(jnp.int32), is_l.sum(-1).astype(jnp.int32)
        cap_h, cap_l = self.cap(HI), self.cap(LO)
        p_h = jnp.where(batch.lengths[:, None] > 0, n_h // cap_h + 1, 0)
        p_l = jnp.where((batch.lengths[:, None] > 0) & self.policy.low_tier, n_l // cap_l + 1, 0)
        row_ids = ids[:, layer]  # [B, H, c]
        c = row_ids.shape[-1]
        set_size = per_row[:, None, None]
        # High page j = set[j]; low page j = set[size - 1 - j].
        hi_page = jnp.take_along_axis(row_ids, jnp.clip(slot_h // cap_h, 0, c - 1), axis=-1)
        lo_idx = jnp.clip(set_size - 1 - slot_l // cap_l, 0, c - 1)
        lo_page = jnp.take_along_axis(row_ids, lo_idx, axis=-1)
        ok = row_ids[..., :1] >= 0  # allocation succeeded for this row
        hi_page = jnp.where(is_h & ok, hi_page, self.no_page(state))
        lo_page = jnp.where(is_l & ok, lo_page, self.no_page(state))
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, H, T, D]
        posb = jnp.broadcast_to(pos, tier.shape)
        state = self._write_tokens(state, HI, hi_page, jnp.maximum(slot_h, 0) % cap_h,
                                   kt, vt, score_sum, posb)
        if self.policy.low_tier:
            state = self._write_tokens(state, LO, lo_page, jnp.maximum(slot_l, 0) % cap_l,
                                       kt, vt, score_sum, posb)
        # Page table for this layer: high from the left, low from the right.
        R = self.row_len
        j = jnp.arange(c)
        hi_cols = jnp.where(j < p_h[..., None], j, R)  # R: dropped
        lo_src = jnp.clip(set_size - 1 - j, 0, c - 1)
        lo_ids = jnp.take_along_axis(row_ids, jnp.broadcast_to(lo_src, row_ids.shape), axis=-1)
        lo_cols = jnp.where(j < p_l[..., None], R - 1 - j, R)
        b_i = batch.slots[:, None, None]
        h_i = jnp.arange(H)[None, :, None]
        table = state.page_table.at[b_i, layer, h_i, hi_cols].set(row_ids, mode="drop")
        table = table.at[b_i, layer, h_i, lo_cols].set(lo_ids, mode="drop")
        okr = ok[..., 0]
        # (slots past the scratch row, i.e. rows a chunked batch does not finish: dropped)
        n_tok = state.n_tok.at[batch.slots, layer].set(
            jnp.stack([jnp.where(okr, n_h, 0), jnp.where(okr, n_l, 0)], -1), mode="drop")
        n_pages = state.n_pages.at[batch.slots, layer].set(
            jnp.stack([jnp.where(okr, p_h, 0), jnp.where(okr, p_l, 0)], -1), mode="drop")
        return state.replace(page_table=table, n_tok=n_tok, n_pages=n_pages)

    def end_prefill(self, state: DiffKVState, ctx) -> DiffKVState:
        """Return the unused middle of every conservative page set to the free list.

        In a chunked batch only rows whose prompt is complete do so; the others keep
        their whole set as high pages holding their tokens so far, and no prompt
        length yet (they do not decode, and their regions do not grow).
        """
        batch, ids, per_row = ctx
        S = self.max_seqs
        if batch.start is None:
            held = total = batch.lengths
            final = jnp.ones(batch.lengths.shape, bool)
        else:
            held, total = batch.start + batch.lengths, batch.total
            final = (held == total) & (total > 0)
        c = ids.shape[-1]
        j = jnp.arange(c)
        np_ = state.n_pages[batch.slots]  # [B, L, H, 2]
        keep_hi = j < np_[..., HI:HI + 1]
        keep_lo = j >= per_row[:, None, None, None] - np_[..., LO:LO + 1]
        keep = keep_hi | keep_lo | ~final[:, None, None, None]
        surplus = jnp.where(keep, -1, ids)
        state = state.replace(free=fl.release(state.free, surplus.reshape(-1, c)))
        if batch.start is not None:
            going = jnp.where(final | (total == 0), S + 1, batch.slots)  # S + 1: dropped
            L, H = self.num_layers, self.num_kv_heads
            as_high = lambda x: jnp.stack(  # noqa: E731
                [jnp.broadcast_to(x[:, None, None], (x.shape[0], L, H)),
                 jnp.zeros((x.shape[0], L, H), jnp.int32)], -1)
            state = state.replace(
                n_tok=state.n_tok.at[going].set(as_high(held), mode="drop"),
                n_pages=state.n_pages.at[going].set(as_high(per_row), mode="drop"))
        seq_len = state.seq_len.at[batch.slots].set(held).at[S].set(0)
        prompt_len = state.prompt_len.at[batch.slots].set(jnp.where(final, total, 0)).at[S].set(0)
        return state.replace(seq_len=seq_len, prompt_len=prompt_len)

    # ---- decode -----------------------------------------------------------------------
    def begin_decode(self, state: DiffKVState, batch: DecodeBatch):
        if self.attention_impl == "pallas":  # every layer's kernel work items, at once
            from diffkv_jax.diffkv_kernel_attention import plan_decode_work

            batch = batch.replace(work=plan_decode_work(self, state, batch.active))
        return state, batch

    def _widths(self, batch: DecodeBatch) -> tuple[int, int]:
        """Pages read per tier: ``num_page_slots`` high pages cover every cached token,
        so the low region can hold at most that many tokens in low pages (+ headroom)."""
        n_hi = min(batch.num_page_slots, self.row_len)
        budget = self.policy.static_budget
        if budget is not None and self.policy.rule != "snapkv":
            # An evicting row never holds more than its budget: budget // cap + 1 pages.
            n_hi = min(n_hi, budget // self.cap(HI) + 1)
        tokens = batch.num_page_slots * self.cap(HI)
        n_lo = min(-(-tokens // self.cap(LO)) + 1, self.row_len) if self.policy.low_tier else 0
        return n_hi, n_lo

    def decode_attention(self, state: DiffKVState, layer, q, k, v, batch: DecodeBatch):
        n_hi, n_lo = self._widths(batch)
        if self.attention_impl == "pallas":
            from diffkv_jax.diffkv_kernel_attention import kernel_decode_step, layer_work

            state, out = kernel_decode_step(self, state, layer, q[:, 0], k[:, 0], v[:, 0],
                                            n_hi, n_lo, batch.active,
                                            layer_work(batch.work, layer))
            return state, out[:, None]
        hi = self.gather_rows(state, layer, HI, n_hi)
        lo = self.gather_rows(state, layer, LO, n_lo)
        out, p_hi, p_lo, p_new = compressed_decode_attention(q[:, 0], k[:, 0], v[:, 0], hi, lo)
        state = self.decode_update(state, layer, k[:, 0], v[:, 0], hi, lo, p_hi, p_lo, p_new,
                                   batch.active)
        return state, out[:, None]

    def scoring_rows(self, state: DiffKVState, layer, active):
        """Per tier the ``n_tok [S, H]`` the policy scores: 0 for inactive rows, which
        must not change."""
        S = self.max_seqs
        return [jnp.where(active[:, None], state.n_tok[:S, layer, :, t], 0) for t in (HI, LO)]

    def decode_update(self, state: DiffKVState, layer, k_new, v_new, hi: RowView, lo: RowView,
                      p_hi, p_lo, p_new, active):
        """Policy step for one layer (plain jnp): accumulate scores, find the victims,
        then :meth:`apply_decision`.

        Args:
          k_new, v_new: ``[S, H, D]`` the new token; hi, lo: gathered rows;
          p_hi, p_lo: ``[S, H, n]`` this step's probabilities (max over the group);
          p_new: ``[S, H]`` the newcomer's own probability; active: ``[S]``.
        """
        from pallas_kernels.policy_scores import score_victims_reference

        S = self.max_seqs
        caps = [self.cap(HI), self.cap(LO)]
        pages = [hi.ids[..., ::caps[0]], lo.ids[..., ::caps[1]]]
        scores, victims = score_victims_reference(
            [p_hi, p_lo], pages, self.scoring_rows(state, layer, active), state.seq_len[:S],
            state.prompt_len[:S], state.scores, state.positions, caps=caps,
            rule=pol.victim_rule(self.policy))
        return self.apply_decision(state.replace(scores=scores), layer, k_new, v_new, victims,
                                   p_new, active)

    def apply_decision(self, state: DiffKVState, layer, k_new, v_new, victims, p_new, active):
        """Decide, demote or prune, and place the newcomer, from the rows' victims.

        Args:
          victims: per tier ``(slot, key, pos, score)`` ``[S, H]`` (see
            :func:`pallas_kernels.policy_scores.score_victims`); the scores already
            hold this step's probabilities.
        """
        S = self.max_seqs
        skip = self.no_page(state)  # writes of inactive rows go nowhere (dropped)
        act = active[:, None]
        cur = state.seq_len[:S]
        n_hi_tok = state.n_tok[:S, layer, :, HI]
        n_lo_tok = state.n_tok[:S, layer, :, LO]
        cur_b = jnp.broadcast_to(cur[:, None], n_hi_tok.shape)
        (vh, key_h, pos_h, score_h), (vl, key_l, pos_l, _) = victims
        if self.policy.rule == "diffkv":
            d = pol.decode_decision(self.policy, vh, key_h, pos_h, vl, key_l, pos_l,
                                    n_hi_tok, n_lo_tok, cur_b)
        else:  # token-eviction baseline: prune the rule's victim or append
            plen = jnp.broadcast_to(state.prompt_len[:S][:, None], cur_b.shape)
            d = pol.evict_decision(self.policy, vh, n_hi_tok, n_lo_tok, plen)
        rows = state.page_table[:S, layer]  # [S, H, R]
        page_at = lambda col: jnp.take_along_axis(rows, col[..., None], axis=-1)[..., 0]  # noqa
        src_page, src_slot, low_page, low_slot, new_page, new_slot = self.placements(
            d, vh, act, page_at, skip)
        demote = None
        if self.policy.low_tier:
            demote = (src_page, src_slot, low_page, low_slot, score_h, pos_h)
        newcomer = (new_page, new_slot, k_new, v_new, p_new, cur_b)
        if self.fused_writes:
            state = self._write_fused(state, demote, newcomer)
        else:
            state = self._write_scatters(state, demote, newcomer)
        n_tok = state.n_tok.at[:S, layer].set(jnp.where(
            act[..., None], jnp.stack([d["n_high"], d["n_low"]], -1), state.n_tok[:S, layer]))
        return state.replace(n_tok=n_tok)

    def placements(self, d, vh, act, page_at, skip):
        """Where a decode step's tokens go, from the decision ``d``
        (:func:`diffkv_policy.decode_decision`), the high victim's slot ``vh`` and whether
        the row decodes (``act``): ``(victim's high page, slot, its low page, slot,
        newcomer's page, slot)``. ``page_at(col)`` reads the row's page-table entry
        (high pages from the left, low from the right); ``skip`` is the page past the
        pool that drops a write. Arrays of rows, or one row's scalars in a kernel."""
        cap_h, cap_l = self.cap(HI), self.cap(LO)
        v_idx, ls, ns = jnp.maximum(vh, 0), jnp.maximum(d["low_slot"], 0), d["new_slot"]
        return (page_at(v_idx // cap_h), v_idx % cap_h,
                jnp.where(act & (d["low_slot"] >= 0), page_at(self.row_len - 1 - ls // cap_l),
                          skip), ls % cap_l,
                jnp.where(act, page_at(ns // cap_h), skip), ns % cap_h)

    def decide_and_write(self, state: DiffKVState, layer, k_new, v_new, partial_victims,
                         p_new, active) -> DiffKVState:
        """:meth:`apply_decision` in one kernel launch from the policy kernel's partial
        victims (``score_victims(..., merge=False)``): the victims' merge, the
        decision, the page lookups and the writes (:attr:`decides_in_kernel`)."""
        S = self.max_seqs
        fmt = self._token_format
        data, k_meta, v_meta, scores, positions, n_tok = tw.decide_and_write(
            state.data, state.k_meta, state.v_meta, state.scores, state.positions,
            state.n_tok, layer=layer, victims=partial_victims, page_table=state.page_table,
            cur=state.seq_len[:S], active=active, k_new=k_new, v_new=v_new, p_new=p_new,
            decide=functools.partial(pol.decode_decision, self.policy),
            place=self.placements, high=fmt(HI), low=fmt(LO))
        return state.replace(data=data, k_meta=k_meta, v_meta=v_meta, scores=scores,
                             positions=positions, n_tok=n_tok)

    def _write_scatters(self, state: DiffKVState, demote, newcomer) -> DiffKVState:
        """The writes of :meth:`apply_decision` as XLA gathers and scatters: the demoted
        victim (re-quantized from its stored high codes) into its low slot, then the
        newcomer into its high slot. The victim is written first: that write depends
        on the victim's read, so every write to the pool comes after the read and
        XLA updates the pool in place."""
        # (tier, page, slot, codes, side entries) of each token written, in write order.
        writes = []
        if demote is not None:
            src_page, src_slot, page, slot, score, pos = demote
            vk, vv = self._read_tokens(state, HI, src_page, src_slot)
            writes.append((LO, page, slot, *self._encode_tokens(LO, vk, vv, score, pos)))
        page, slot, k, v, score, pos = newcomer
        writes.append((HI, page, slot, *self._encode_tokens(HI, k, v, score, pos)))
        for tier, page, slot, codes, _ in writes:
            state = self._write_codes(state, tier, page, slot, *codes)
        # The writes land in different pages (one per tier), so one scatter per
        # side array carries them all: fewer launches per layer.
        _, pages, slots, _, sides = zip(*writes)
        side = [jnp.stack(parts) for parts in zip(*sides)]
        return self._write_side(state, jnp.stack(pages), jnp.stack(slots), side)

    def _write_fused(self, state: DiffKVState, demote, newcomer) -> DiffKVState:
        """The writes of :meth:`apply_decision` in one kernel launch that also reads,
        re-quantizes and quantizes the tokens
        (:func:`pallas_kernels.token_writes.write_tokens`)."""
        fmt = self._token_format
        i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
        writes = []
        if demote is not None:
            src_page, src_slot, page, slot, score, pos = demote
            writes.append(tw.MovedToken(fmt(HI), fmt(LO), i32(src_page), i32(src_slot),
                                        i32(page), i32(slot), score.astype(jnp.float32),
                                        i32(pos)))
        page, slot, k, v, score, pos = newcomer
        writes.append(tw.NewToken(fmt(HI), i32(page), i32(slot), k, v,
                                  score.astype(jnp.float32), i32(pos)))
        data, k_meta, v_meta, scores, positions = tw.write_tokens(
            state.data, state.k_meta, state.v_meta, state.scores, state.positions, writes)
        return state.replace(data=data, k_meta=k_meta, v_meta=v_meta, scores=scores,
                             positions=positions)

    def end_decode(self, state: DiffKVState, batch: DecodeBatch) -> DiffKVState:
        """Advance lengths; give each full tier region one more page (headroom)."""
        S, L, H, R = self.max_seqs, self.num_layers, self.num_kv_heads, self.row_len
        caps = jnp.asarray([self.cap(HI), self.cap(LO)], jnp.int32)
        n_tok, n_pages = state.n_tok[:S], state.n_pages[:S]
        need = batch.active[:, None, None, None] & (n_tok >= n_pages * caps)
        if not self.policy.low_tier:
            need = need.at[..., LO].set(False)
        free, ids, ok = fl.allocate(state.free, need.reshape(-1).astype(jnp.int32), 1)
        ids = ids.reshape(S, L, H, 2)
        got = ids >= 0
        col = jnp.stack([n_pages[..., HI], R - 1 - n_pages[..., LO]], -1)
        col = jnp.where(got, col, R)
        s_i, l_i, h_i = jnp.meshgrid(jnp.arange(S), jnp.arange(L), jnp.arange(H), indexing="ij")
        table = state.page_table
        for t in (HI, LO):
            table = table.at[s_i, l_i, h_i, col[..., t]].set(ids[..., t], mode="drop")
        return state.replace(
            page_table=table, free=free, alloc_failed=state.alloc_failed | ~ok,
            n_pages=state.n_pages.at[:S].add(got.astype(jnp.int32)),
            seq_len=state.seq_len.at[:S].add(batch.active.astype(jnp.int32)))

    # ---- lifecycle --------------------------------------------------------------------
    #: Swapping (:mod:`diffkv_jax.row_swap`): the pool arrays indexed by page ID
    #: and the slot arrays a slot's cache is restored from.
    swap_pool_fields = ("data", "k_meta", "v_meta", "scores", "positions")
    swap_row_fields = ("n_tok", "n_pages", "seq_len", "prompt_len")

    def owned_columns(self, state: DiffKVState) -> jax.Array:
        """``[S + 1, L, KVH, R]`` bool: the page-table columns holding a slot's pages
        (high pages from the left, low pages from the right)."""
        R = self.row_len
        j = jnp.arange(R)
        np_ = state.n_pages
        return (j < np_[..., HI:HI + 1]) | (j >= R - np_[..., LO:LO + 1])

    def release(self, state: DiffKVState, slot_mask: jax.Array) -> DiffKVState:
        """Return every page of the masked slots (``[S + 1]`` bool) to the free list."""
        R = self.row_len
        owned = self.owned_columns(state) & slot_mask[:, None, None, None]
        ids = jnp.where(owned, state.page_table, -1)
        free = fl.release(state.free, ids.reshape(-1, R))
        m4 = slot_mask[:, None, None, None]
        return state.replace(
            free=free,
            page_table=jnp.where(m4, self.trash_page(state), state.page_table),
            n_tok=jnp.where(m4, 0, state.n_tok), n_pages=jnp.where(m4, 0, state.n_pages),
            seq_len=jnp.where(slot_mask, 0, state.seq_len),
            prompt_len=jnp.where(slot_mask, 0, state.prompt_len))

    # ---- accounting -------------------------------------------------------------------
    def accounting_arrays(self, state: DiffKVState) -> tuple[jax.Array, ...]:
        """The small device arrays the accounting reads (copy them to keep a snapshot)."""
        return state.seq_len, state.n_tok, state.n_pages

    def stats_from_arrays(self, arrays, slots=None):
        """Accounting from host copies of :meth:`accounting_arrays`: the live slots'
        totals, or (with ``slots``) one dict per slot."""
        seq_len, n_tok, n_pages = map(np.asarray, arrays)
        if slots is None:
            S = self.max_seqs
            return self._stats(seq_len[:S], n_tok[:S], n_pages[:S])
        return [self._stats(seq_len[s:s + 1], n_tok[s:s + 1], n_pages[s:s + 1]) for s in slots]

    def _stats(self, seq_len: np.ndarray, n_tok: np.ndarray, n_pages: np.ndarray
               ) -> dict[str, Any]:
        """Accounting of the slots given: ``seq_len [n]``, ``n_tok, n_pages [n, L, H, 2]``."""
        rows = self.num_layers * self.num_kv_heads
        total = int(seq_len.sum()) * rows
        high, low = int(n_tok[..., HI].sum()), int(n_tok[..., LO].sum())
        pages = int(n_pages.sum())
        table_bytes = int(np.count_nonzero(seq_len)) * rows * self.row_len * 4
        tok_bytes = lambda t: t.token_bytes(self.head_dim) + 16  # noqa: E731
        return {
            "tokens": int(seq_len.sum()),
            "pages": pages,
            "page_bytes": pages * self.page_bytes,
            "data_bytes": high * tok_bytes(self.high) + low * tok_bytes(self.low),
            "table_bytes": table_bytes,
            "bytes_16bit_same_tokens": total * 2 * self.head_dim * 2,
            "frac_high": high / max(total, 1),
            "frac_low": low / max(total, 1),
            "frac_pruned": 1 - (high + low) / max(total, 1),
        }


def compressed_decode_attention(q, k_new, v_new, hi: RowView, lo: RowView):
    """Attention of one query token over high + low cached tokens plus itself.

    Args:
      q: ``[S, nq, D]``; k_new, v_new: ``[S, H, D]`` the token being decoded (full precision).
      hi, lo: gathered rows with dequantized keys/values ``[S, H, n, D]``.
    Returns:
      ``(out [S, nq, D], p_hi [S, H, n_hi], p_lo [S, H, n_lo], p_new [S, H])``, the
      probabilities max-reduced over each GQA group.
    """
    S, nq, D = q.shape
    H = k_new.shape[1]
    qg = q.astype(jnp.float32).reshape(S, H, nq // H, D)
    keys = jnp.concatenate([hi.keys, lo.keys, k_new[:, :, None].astype(jnp.float32)], axis=2)
    vals = jnp.concatenate([hi.values, lo.values, v_new[:, :, None].astype(jnp.float32)], axis=2)
    valid = jnp.concatenate([hi.valid, lo.valid, jnp.ones((S, H, 1), bool)], axis=2)
    s = jnp.einsum("shgd,shnd->shgn", qg, keys) / jnp.sqrt(jnp.float32(D))
    s = jnp.where(valid[:, :, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("shgn,shnd->shgd", p, vals).reshape(S, nq, D)
    pm = p.max(axis=2)
    n_hi = hi.keys.shape[2]
    n_lo = lo.keys.shape[2]
    return out, pm[..., :n_hi], pm[..., n_hi:n_hi + n_lo], pm[..., -1]
