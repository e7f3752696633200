"""Uncompressed paged KV cache (``--kv full``): the baseline every method is compared to.

Layout (shared with the compressed caches so the engine treats them alike):

* one page pool for all layers and KV heads: ``k_pages, v_pages [P + 1, page_size, D]``
  in the cache dtype; page ``P`` is a write-only *trash* page that padding and
  inactive slots write to, so they can never touch a page somebody owns;
* a page table with one row per (slot, layer, KV head):
  ``page_table [S + 1, L, KVH, R]``, ``R = max_context // page_size + 1``;
  slot ``S`` is a scratch slot that padded prefill rows point at;
* ``lengths [S + 1]`` tokens cached per slot, ``num_pages [S + 1, L, KVH]``;
* the circular free list (:mod:`diffkv_jax.free_list`).

Headroom invariant: after every prefill or decode step a live row has a page for
its next token, so the layer loop never allocates. The one allocation of a
step happens after the layers, for all rows at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffkv_jax import attention as attn_ref
from diffkv_jax import free_list as fl
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.pool_writes import scatter_set


@struct.dataclass
class PagedKVState:
    """Device state of the uncompressed paged cache (an immutable pytree)."""

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    num_pages: jax.Array
    lengths: jax.Array
    free: fl.FreeList
    alloc_failed: jax.Array  # [] bool, sticky: some allocation found the ring too short
    merge_counters: jax.Array  # [S * H] int32, zero between launches (merge_impl="launch")


class SlotAccounting:
    """``memory_stats`` / ``slot_memory_stats`` of a cache method, read through its
    ``accounting_arrays`` (small device arrays) and ``stats_from_arrays`` (host side)."""

    def memory_stats(self, state) -> dict[str, Any]:
        """Measured bytes of the cache held by live sequences (host-side numbers)."""
        return self.stats_from_arrays(jax.device_get(self.accounting_arrays(state)))

    def slot_memory_stats(self, state, slots) -> list[dict[str, Any]]:
        """:meth:`memory_stats` of each slot in ``slots`` alone (one host transfer).

        Summed over the live slots, these are :meth:`memory_stats`.
        """
        return self.stats_from_arrays(jax.device_get(self.accounting_arrays(state)), slots)


class SlotPages(SlotAccounting):
    """Release and accounting of a cache whose state holds ``page_table [S + 1, L,
    KVH, R]``, ``num_pages [S + 1, L, KVH]`` (a row's pages are its first
    ``num_pages`` columns), ``lengths [S + 1]`` and a free list; ``_stats(lengths,
    num_pages)`` turns host copies into bytes."""

    #: Swapping (:mod:`diffkv_jax.row_swap`): the pool arrays indexed by page ID and
    #: the slot arrays a slot's cache is restored from (None: no swapping).
    swap_pool_fields = None
    swap_row_fields = ("num_pages", "lengths")

    def owned_columns(self, state) -> jax.Array:
        """``[S + 1, L, KVH, R]`` bool: the page-table columns holding a slot's pages."""
        return jnp.arange(self.row_len) < state.num_pages[..., None]

    def release(self, state, slot_mask: jax.Array):
        """Return every page of the masked slots (``[S + 1]`` bool) to the free list."""
        owned = slot_mask[:, None, None, None] & self.owned_columns(state)
        ids = jnp.where(owned, state.page_table, -1)
        free = fl.release(state.free, ids.reshape(-1, self.row_len))
        table = jnp.where(slot_mask[:, None, None, None], self.trash_page(state), state.page_table)
        return state.replace(
            free=free, page_table=table,
            num_pages=jnp.where(slot_mask[:, None, None], 0, state.num_pages),
            lengths=jnp.where(slot_mask, 0, state.lengths))

    def accounting_arrays(self, state) -> tuple[jax.Array, ...]:
        """The small device arrays the accounting reads (copy them to keep a snapshot)."""
        return state.lengths, state.num_pages

    def stats_from_arrays(self, arrays, slots=None):
        """Accounting from host copies of :meth:`accounting_arrays`: the live slots'
        totals, or (with ``slots``) one dict per slot."""
        lengths, num_pages = map(np.asarray, arrays)
        if slots is None:
            return self._stats(lengths[: self.max_seqs], num_pages[: self.max_seqs])
        return [self._stats(lengths[s:s + 1], num_pages[s:s + 1]) for s in slots]


@dataclasses.dataclass(frozen=True)
class FullCache(SlotPages):
    """The uncompressed cache method. Hashable: it is part of the jit cache key.

    Attributes:
      num_layers, num_kv_heads, head_dim: model geometry.
      max_seqs: slots (sequences decoded together).
      max_context: longest sequence a slot may hold (prompt + generated).
      page_size: tokens per page.
      dtype: storage dtype name ("float32", "bfloat16").
      attention_impl: "reference" (plain jnp: gathers the pages) or "pallas" (the
        paged decode kernel of pallas_kernels/paged_decode.py; interpret mode
        off the GPU).
      merge_impl: how the kernel path merges its work items: "xla" (segment
        reductions, :func:`pallas_kernels.paged_decode.merge_work`), "pallas" (one
        launch, :func:`pallas_kernels.row_merge.merge_rows`, the output written in
        the query's dtype), "launch" (inside the attention launch, by each row's
        last item: :func:`pallas_kernels.paged_decode.paged_decode_merged`, its
        counters in the state; timed on the H200 only over quantized
        tiers, 1 µs faster per launch at 32 x 4K), or "auto": "pallas" where
        the kernels run compiled on a GPU, "xla" otherwise.
      early_row_loads: the attention launch loads each row's token count and the
        page-table entries of its first pages as soon as its work item is known
        (:attr:`pallas_kernels.paged_decode.LaunchConfig.early_row_loads`); the same
        results. The kernel path only.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    max_context: int
    page_size: int = 16
    dtype: str = "float32"
    attention_impl: str = "reference"
    merge_impl: str = "auto"
    early_row_loads: bool = False

    name = "full"
    swap_pool_fields = ("k_pages", "v_pages")

    def __post_init__(self):
        if self.attention_impl not in ("reference", "pallas"):
            raise ValueError(f"attention_impl must be 'reference' or 'pallas', "
                             f"got {self.attention_impl!r}")
        if self.attention_impl == "pallas" and self.head_dim % 16:
            raise ValueError("the Pallas kernel needs head_dim % 16 == 0")
        if self.merge_impl not in ("auto", "xla", "pallas", "launch"):
            raise ValueError(f"merge_impl must be 'auto', 'xla', 'pallas' or 'launch', "
                             f"got {self.merge_impl!r}")
        if self.merge_impl == "launch" and self.attention_impl != "pallas":
            raise ValueError("merge_impl='launch' needs attention_impl='pallas': the "
                             "attention kernel merges its own rows")

    @property
    def merges_in_launch(self) -> bool:
        """Whether the kernel path merges its work items with one Pallas launch."""
        if self.merge_impl == "auto":
            from pallas_kernels import backend
            return backend.runs_compiled(self.attention_impl)
        return self.merge_impl == "pallas"

    @property
    def merges_in_attention(self) -> bool:
        """Whether the attention launch merges its own rows (``merge_impl="launch"``)."""
        return self.merge_impl == "launch"

    # ---- geometry -------------------------------------------------------------
    @property
    def row_len(self) -> int:
        return self.max_context // self.page_size + 1

    @property
    def page_bytes(self) -> int:
        return 2 * self.page_size * self.head_dim * np.dtype(self.dtype).itemsize

    #: Pages a row can gain in one decode step (its region's headroom page).
    max_new_pages_per_row = 1

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages one sequence of ``n_tokens`` holds (all layers and heads, with headroom)."""
        per_row = min(n_tokens // self.page_size + 1, self.row_len)
        return per_row * self.num_layers * self.num_kv_heads

    def growth_bound(self, state: PagedKVState, steps: int) -> jax.Array:
        """``[steps]`` int32: entry ``m - 1`` is the most pages the next ``m`` decode
        steps can allocate, whichever live slots decode (-1 past ``page_size``
        steps, where a slot could grow twice).

        A slot gets a page for every layer and head when its length reaches a
        multiple of the page size (``end_decode``), so within ``m`` steps at most
        once, and only if that multiple is at most ``m`` tokens away.
        """
        S = self.max_seqs
        n = state.lengths[:S]
        away = self.page_size - n % self.page_size  # tokens to the next page boundary
        m = jnp.arange(1, steps + 1)[:, None]
        grows = (n[None] > 0) & (away[None] <= m) & (n[None] + away[None] < self.max_context)
        per_slot = self.num_layers * self.num_kv_heads
        bound = grows.sum(axis=1) * per_slot
        return jnp.where(m[:, 0] <= self.page_size, bound, -1).astype(jnp.int32)

    # ---- state ----------------------------------------------------------------
    def init_state(self, num_pages: int) -> PagedKVState:
        """Empty cache with ``num_pages`` usable pages."""
        S, L, H, R = self.max_seqs, self.num_layers, self.num_kv_heads, self.row_len
        dt = jnp.dtype(self.dtype)
        trash = num_pages
        return PagedKVState(
            k_pages=jnp.zeros((num_pages + 1, self.page_size, self.head_dim), dt),
            v_pages=jnp.zeros((num_pages + 1, self.page_size, self.head_dim), dt),
            page_table=jnp.full((S + 1, L, H, R), trash, jnp.int32),
            num_pages=jnp.zeros((S + 1, L, H), jnp.int32),
            lengths=jnp.zeros((S + 1,), jnp.int32),
            free=fl.new_free_list(num_pages),
            alloc_failed=jnp.zeros((), bool),
            merge_counters=jnp.zeros((S * H,), jnp.int32),
        )

    @staticmethod
    def trash_page(state: PagedKVState) -> int:
        return state.k_pages.shape[0] - 1

    # ---- prefill ----------------------------------------------------------------
    #: Prompts may be prefilled in chunks (``PrefillBatch.start``).
    supports_chunked_prefill = True

    def begin_prefill(self, state: PagedKVState, batch: PrefillBatch):
        """Allocate every page the prompts need (plus headroom) in one prefix sum.

        A chunked batch allocates, for each row's first chunk, the pages of its
        whole prompt (``batch.total``), and nothing for later chunks: a prompt
        admitted never waits for pages halfway.
        """
        B, T = batch.tokens.shape
        L, H = self.num_layers, self.num_kv_heads
        if batch.start is None:
            tokens = batch.lengths
            max_count = min(T // self.page_size + 1, self.row_len)
        else:
            tokens = jnp.where(batch.start == 0, batch.total, 0)
            max_count = min(batch.num_page_slots, self.row_len)
        per_row = jnp.where(tokens > 0, tokens // self.page_size + 1, 0)
        counts = jnp.broadcast_to(per_row[:, None, None], (B, L, H)).reshape(-1)
        free, ids, ok = fl.allocate(state.free, counts, max_count)
        trash = self.trash_page(state)
        ids = jnp.where(ids >= 0, ids, trash).reshape(B, L, H, max_count)
        # Rows of later chunks keep their pages: their writes go out of bounds (dropped).
        first = (batch.slots if batch.start is None
                 else jnp.where(batch.start == 0, batch.slots, self.max_seqs + 1))
        table = state.page_table.at[first, :, :, :max_count].set(ids, mode="drop")
        num_pages = state.num_pages.at[first].set(jnp.where(ok, counts.reshape(B, L, H), 0),
                                                  mode="drop")
        state = state.replace(free=free, page_table=table, num_pages=num_pages,
                              alloc_failed=state.alloc_failed | ~ok)
        return state, batch

    def prefill_attention(self, state: PagedKVState, layer, q, k, v, batch: PrefillBatch):
        state = self._write_prompt(state, layer, k, v, batch)
        if batch.start is None:
            return state, attn_ref.prefill_attention(q, k, v, batch.lengths)
        # A chunk: attend to the row's pages (the prefix and the chunk just written).
        W = batch.num_page_slots
        ids = state.page_table[batch.slots, layer][:, :, :W]  # [B, H, W]
        B, H = ids.shape[:2]
        gather = lambda pages: (  # noqa: E731  [B, W * page_size, H, D]
            pages[ids].reshape(B, H, W * self.page_size, -1).transpose(0, 2, 1, 3))
        keys, values = self._decode_pages(layer, gather(state.k_pages), gather(state.v_pages))
        out = attn_ref.prefix_causal_attention(q, keys, values, batch.start, batch.lengths)
        return state, out

    def _write_prompt(self, state, layer, k, v, batch: PrefillBatch):
        B, T = batch.tokens.shape
        t = jnp.arange(T)
        pos = t[None] if batch.start is None else batch.start[:, None] + t[None]  # [1|B, T]
        rows = state.page_table[batch.slots, layer]  # [B, H, R]
        page = jnp.take_along_axis(
            rows, jnp.broadcast_to((pos // self.page_size)[:, None], (B, rows.shape[1], T)),
            axis=2)
        # Padding goes past the pool and is dropped: piling every padded token onto
        # one page serializes the scatter on the GPU.
        page = jnp.where(t[None, None, :] < batch.lengths[:, None, None], page,
                         state.k_pages.shape[0])
        page = page.transpose(0, 2, 1)  # [B, T, H]
        off = jnp.broadcast_to((pos % self.page_size)[:, :, None], page.shape)
        k, v = self._encode(layer, k, v)
        return state.replace(k_pages=scatter_set(state.k_pages, (page, off), k),
                             v_pages=scatter_set(state.v_pages, (page, off), v))

    def end_prefill(self, state: PagedKVState, batch: PrefillBatch) -> PagedKVState:
        held = batch.lengths if batch.start is None else batch.start + batch.lengths
        lengths = state.lengths.at[batch.slots].set(held)
        return state.replace(lengths=lengths.at[self.max_seqs].set(0))

    # ---- decode -----------------------------------------------------------------
    def begin_decode(self, state: PagedKVState, batch: DecodeBatch):
        if self.attention_impl == "pallas":  # one kernel work list serves every layer
            from diffkv_jax.diffkv_kernel_attention import plan_full_work

            S = self.max_seqs
            batch = batch.replace(work=plan_full_work(state.lengths[:S] + 1, batch.active,
                                                      self.page_size, self.num_kv_heads))
        return state, batch

    def decode_positions(self, state: PagedKVState) -> jax.Array:
        """Absolute position of each slot's next token ``[S]``."""
        return state.lengths[: self.max_seqs]

    def decode_attention(self, state: PagedKVState, layer, q, k, v, batch: DecodeBatch):
        S = self.max_seqs
        pos = state.lengths[:S]
        rows = state.page_table[:S, layer]  # [S, H, R]
        page = jnp.take_along_axis(rows, (pos // self.page_size)[:, None, None], axis=2)[..., 0]
        # Inactive rows write past the pool, which the scatter drops: hundreds of rows
        # aimed at one trash page serialize on the GPU.
        page = jnp.where(batch.active[:, None], page, state.k_pages.shape[0])  # [S, H]
        off = jnp.broadcast_to((pos % self.page_size)[:, None], page.shape)
        k, v = self._encode(layer, k[:, 0], v[:, 0])
        state = state.replace(k_pages=scatter_set(state.k_pages, (page, off), k),
                              v_pages=scatter_set(state.v_pages, (page, off), v))
        ids = rows[:, :, :batch.num_page_slots]
        if self.merges_in_attention:  # the kernel's own launch, counting on the state
            from diffkv_jax.diffkv_kernel_attention import full_decode_attention

            out, counters = full_decode_attention(q[:, 0], state.k_pages, state.v_pages, ids,
                                                  pos + 1, batch.work,
                                                  counters=state.merge_counters,
                                                  early_row_loads=self.early_row_loads)
            return state.replace(merge_counters=counters), out[:, None]
        out = self._paged_attention(layer, q[:, 0], state.k_pages, state.v_pages, ids,
                                    pos + 1, batch.work)
        return state, out[:, None]

    # Storage hooks: a cache that stores K/V in another form (e.g. scaled FP8)
    # overrides these two and reuses the page management above unchanged.
    def _encode(self, layer, k, v):
        """K and V ``[..., KVH, D]`` of ``layer`` as the pages store them."""
        return k, v

    def _decode_pages(self, layer, k, v):
        """Inverse of :meth:`_encode`: gathered page contents ``[..., KVH, D]`` as values."""
        return k, v

    def _paged_attention(self, layer, q, k_pages, v_pages, page_ids, lengths, work):
        """Decode attention of ``q [S, nq, D]`` over the pages ``page_ids [S, KVH, n]``
        (``lengths [S]`` tokens each; ``work``: the kernel path's work list from
        :meth:`begin_decode`, whose inactive rows come out as zeros)."""
        if self.attention_impl == "pallas":
            from diffkv_jax.diffkv_kernel_attention import full_decode_attention

            return full_decode_attention(q, k_pages, v_pages, page_ids, lengths, work,
                                         merge_in_launch=self.merges_in_launch,
                                         early_row_loads=self.early_row_loads)
        return attn_ref.paged_decode_attention(q, k_pages, v_pages, page_ids, lengths)

    def end_decode(self, state: PagedKVState, batch: DecodeBatch) -> PagedKVState:
        """Advance lengths, then give every row that filled its last page a fresh one."""
        S, L, H = self.max_seqs, self.num_layers, self.num_kv_heads
        new_len = state.lengths[:S] + batch.active.astype(jnp.int32)
        need = batch.active & (new_len % self.page_size == 0) & (new_len < self.max_context)
        counts = jnp.broadcast_to(need[:, None, None], (S, L, H)).astype(jnp.int32)
        free, ids, ok = fl.allocate(state.free, counts.reshape(-1), 1)
        ids = ids.reshape(S, L, H)
        col = state.num_pages[:S]
        got = ids >= 0
        s_i, l_i, h_i = jnp.meshgrid(jnp.arange(S), jnp.arange(L), jnp.arange(H), indexing="ij")
        # Rows that got nothing write out of bounds, which the scatter drops.
        col_w = jnp.where(got, col, self.row_len)
        table = state.page_table.at[s_i, l_i, h_i, col_w].set(ids, mode="drop")
        num_pages = state.num_pages.at[:S].add(got.astype(jnp.int32))
        return state.replace(lengths=state.lengths.at[:S].set(new_len), page_table=table,
                             num_pages=num_pages, free=free,
                             alloc_failed=state.alloc_failed | ~ok)

    # ---- accounting -------------------------------------------------------------
    def _stats(self, lengths: np.ndarray, num_pages: np.ndarray) -> dict[str, Any]:
        """Accounting of the slots given: ``lengths [n]``, ``num_pages [n, L, KVH]``."""
        pages = int(num_pages.sum())
        tokens = int(lengths.sum())
        table_bytes = int(np.count_nonzero(lengths)) * self.num_layers * self.num_kv_heads \
            * self.row_len * 4
        per_token_16bit = 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2
        return {
            "tokens": tokens,
            "pages": pages,
            "page_bytes": pages * self.page_bytes,
            "data_bytes": tokens * self.num_layers * self.num_kv_heads * 2 * self.head_dim
            * np.dtype(self.dtype).itemsize,
            "table_bytes": table_bytes,
            "bytes_16bit_same_tokens": tokens * per_token_16bit,
        }
