"""KIVI baseline (``--kv kivi4`` / ``kivi2``): keys per channel, values per token, exact tail.

KIVI (Liu et al., 2024) quantizes keys per *channel* and values per *token*
with asymmetric min/max integer codes, and prunes nothing. Key outliers sit in
a few fixed channels, so a per-token key scale would be set by those channels
and crush the others; a per-channel scale needs a group of tokens to take its
min/max over, so the newest tokens stay at full precision (the *residual*)
until a whole group of ``G`` exists, which is then quantized at once.

Layout (the page management mirrors :class:`diffkv_jax.paged_cache.FullCache`):

* one page = one quantized group of ``G = page_size`` consecutive tokens of
  one (sequence, layer, KV head), in six pools indexed by page id:
  ``k_codes, v_codes [P + 1, G, D * b / 8]`` uint8 (packed along ``D`` by
  :func:`diffkv_jax.quantization.pack`), ``k_scale, k_zero [P + 1, D]``
  float16 (per channel over the group), ``v_scale, v_zero [P + 1, G]``
  float16 (per token over ``D``). Page ``P`` is never written: unallocated
  table entries point at it, so gathers always read finite zeros;
* ``res_k, res_v [S + 1, L, KVH, G, D]`` in the cache dtype: each row's tokens
  of the group not yet complete;
* ``page_table [S + 1, L, KVH, R]``, ``num_pages``, ``lengths``, the free list
  and ``alloc_failed`` as in ``FullCache``.

Invariant (while ``alloc_failed`` is unset): between steps a slot of length
``n`` owns ``n // G`` pages per row (page ``j`` holds tokens ``[j G, (j + 1) G)``)
and its other ``n % G`` tokens are residual slots ``0 .. n % G - 1``. There is
no headroom page: a decode step writes its token into the residual, so the
step that completes a group attends to all ``G`` of its tokens at full
precision; ``end_decode`` then allocates a page for every row whose residual
filled (one allocation for all rows, as in ``FullCache``), quantizes the
residual into it, and the new length empties the residual.
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
from diffkv_jax import quantization as quant
from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.paged_cache import SlotPages
from diffkv_jax.pool_writes import scatter_set

_NEG = -1e30

#: State fields of one quantized group, in the order of :func:`quantize_group`.
POOLS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


def quantize_group(k: jax.Array, v: jax.Array, bits: int) -> tuple[jax.Array, ...]:
    """Quantize groups of tokens KIVI's way: keys per channel, values per token.

    Args:
      k, v: ``[..., G, D]``, one group of ``G`` tokens per leading index.
      bits: 8, 4 or 2.
    Returns:
      ``(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)``: codes
      ``uint8 [..., G, D * bits / 8]`` packed along ``D``; key metadata
      float16 ``[..., D]`` (min/max over the group's tokens), value metadata
      float16 ``[..., G]`` (min/max over each token's dims). Every element
      dequantizes within half its scale (see :mod:`diffkv_jax.quantization`).
    """
    kc, ks, kz = quant.quantize(jnp.swapaxes(k, -1, -2), bits)
    vc, vs, vz = quant.quantize(v, bits)
    return quant.pack(jnp.swapaxes(kc, -1, -2), bits), ks, kz, quant.pack(vc, bits), vs, vz


def dequantize_group(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits: int,
                     D: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`quantize_group`: float32 ``k, v [..., G, D]``."""
    k_codes = jnp.swapaxes(quant.unpack(k_codes, bits, D), -1, -2)
    k = jnp.swapaxes(quant.dequantize(k_codes, k_scale, k_zero), -1, -2)
    return k, quant.dequantize_packed(v_codes, v_scale, v_zero, bits, D)


def masked_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                            valid: jax.Array) -> jax.Array:
    """One GQA query token per sequence over explicit keys: ``q [B, nq, D]``,
    ``k, v [B, KVH, N, D]``, ``valid [B, N]`` (at least one True per row).
    Returns ``[B, nq, D]`` float32."""
    B, nq, D = q.shape
    H = k.shape[1]
    qg = q.astype(jnp.float32).reshape(B, H, nq // H, D)
    s = jnp.einsum("bkgd,bktd->bkgt", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(D))
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgt,bktd->bkgd", p, v.astype(jnp.float32)).reshape(B, nq, D)


def build_kivi(cfg, *, max_seqs: int, max_context: int, dtype: Any, page_size: int | None,
               bits: int, **options) -> KiviCache:
    """The registry's builder (``kivi4`` / ``kivi2`` fix ``bits``).

    Options: ``page_size`` (the group size ``G``, default 32), ``attention_impl``
    ("reference" only); ``dtype`` is the residual's storage dtype, as for the full cache.
    """
    impl = options.pop("attention_impl", "reference")
    if options:
        raise ValueError(f"options {sorted(options)} do not apply to kivi{bits} "
                         f"(it takes page_size and attention_impl)")
    return KiviCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                     max_context=max_context, bits=bits, page_size=page_size or 32,
                     dtype=jnp.dtype(dtype).name, attention_impl=impl)


@struct.dataclass
class KiviState:
    """Device state of the KIVI cache (an immutable pytree)."""

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    res_k: jax.Array
    res_v: jax.Array
    page_table: jax.Array
    num_pages: jax.Array
    lengths: jax.Array
    free: fl.FreeList
    alloc_failed: jax.Array  # [] bool, sticky: some allocation found the ring too short


@dataclasses.dataclass(frozen=True)
class KiviCache(SlotPages):
    """The KIVI cache method, with the interface of ``FullCache``. Hashable (a jit key).

    Attributes:
      num_layers, num_kv_heads, head_dim: model geometry.
      max_seqs: slots (sequences decoded together).
      max_context: longest sequence a slot may hold (prompt + generated).
      bits: code width of keys and values (4 for ``kivi4``, 2 for ``kivi2``; 8 works too).
      page_size: the group size ``G``: tokens quantized together, one page per group,
        and the most tokens the full-precision residual holds.
      dtype: storage dtype of the residual ("float32", "bfloat16").
      attention_impl: "reference" only (plain jnp).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    max_context: int
    bits: int = 4
    page_size: int = 32
    dtype: str = "float32"
    attention_impl: str = "reference"

    #: Pages a row can gain in one decode step (the group its residual completes).
    max_new_pages_per_row = 1

    def __post_init__(self):
        if self.attention_impl != "reference":
            raise ValueError(f"the KIVI cache has only the plain-jnp attention "
                             f"(attention_impl='reference'), got {self.attention_impl!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size (the KIVI group size) must be >= 1, got {self.page_size}")
        quant.packed_width(self.head_dim, self.bits)  # raises on bits or head_dim

    @property
    def name(self) -> str:
        return f"kivi{self.bits}"

    # ---- geometry -------------------------------------------------------------
    @property
    def row_len(self) -> int:
        return self.max_context // self.page_size + 1

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: packed K and V codes of ``G`` tokens plus their float16
        scales and zeros (``2 D`` for the keys' channels, ``2 G`` for the values' tokens)."""
        G, D = self.page_size, self.head_dim
        return 2 * G * quant.packed_width(D, self.bits) + 2 * 2 * (D + G)

    @property
    def residual_token_bytes(self) -> int:
        """Bytes of one residual token of one row (K and V at the storage dtype)."""
        return 2 * self.head_dim * np.dtype(self.dtype).itemsize

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages one sequence of ``n_tokens`` may hold (all layers and heads).

        Conservative: its ``n // G`` groups plus the one its residual completes next.
        """
        per_row = min(n_tokens // self.page_size + 1, self.row_len)
        return per_row * self.num_layers * self.num_kv_heads

    # ---- state ----------------------------------------------------------------
    def init_state(self, num_pages: int) -> KiviState:
        """Empty cache with ``num_pages`` usable pages."""
        S, L, H, R = self.max_seqs, self.num_layers, self.num_kv_heads, self.row_len
        G, D = self.page_size, self.head_dim
        P, w = num_pages + 1, quant.packed_width(D, self.bits)
        res = (S + 1, L, H, G, D)
        return KiviState(
            k_codes=jnp.zeros((P, G, w), jnp.uint8),
            k_scale=jnp.zeros((P, D), jnp.float16), k_zero=jnp.zeros((P, D), jnp.float16),
            v_codes=jnp.zeros((P, G, w), jnp.uint8),
            v_scale=jnp.zeros((P, G), jnp.float16), v_zero=jnp.zeros((P, G), jnp.float16),
            res_k=jnp.zeros(res, jnp.dtype(self.dtype)),
            res_v=jnp.zeros(res, jnp.dtype(self.dtype)),
            page_table=jnp.full((S + 1, L, H, R), num_pages, jnp.int32),
            num_pages=jnp.zeros((S + 1, L, H), jnp.int32),
            lengths=jnp.zeros((S + 1,), jnp.int32),
            free=fl.new_free_list(num_pages),
            alloc_failed=jnp.zeros((), bool),
        )

    @staticmethod
    def trash_page(state: KiviState) -> int:
        return state.k_scale.shape[0] - 1

    def _store(self, state: KiviState, page: jax.Array, k: jax.Array, v: jax.Array) -> KiviState:
        """Quantize groups ``k, v [*page.shape, G, D]`` into ``page``; ids past the
        trash page are dropped."""
        parts = quantize_group(k, v, self.bits)
        return state.replace(**{f: scatter_set(getattr(state, f), page, x)
                                for f, x in zip(POOLS, parts)})

    # ---- prefill ----------------------------------------------------------------
    def begin_prefill(self, state: KiviState, batch: PrefillBatch):
        """Allocate a page for every complete group of the prompts, in one prefix sum."""
        B, T = batch.tokens.shape
        L, H = self.num_layers, self.num_kv_heads
        counts = jnp.broadcast_to((batch.lengths // self.page_size)[:, None, None], (B, L, H))
        max_count = max(1, min(T // self.page_size, self.row_len))
        free, ids, ok = fl.allocate(state.free, counts.reshape(-1), max_count)
        ids = jnp.where(ids >= 0, ids, self.trash_page(state)).reshape(B, L, H, max_count)
        table = state.page_table.at[batch.slots, :, :, :max_count].set(ids)
        num_pages = state.num_pages.at[batch.slots].set(jnp.where(ok, counts, 0))
        state = state.replace(free=free, page_table=table, num_pages=num_pages,
                              alloc_failed=state.alloc_failed | ~ok)
        return state, batch

    def prefill_attention(self, state: KiviState, layer, q, k, v, batch: PrefillBatch):
        # As in KIVI, the prompt attends to itself at full precision; only what is
        # cached for later tokens is quantized.
        out = attn_ref.prefill_attention(q, k, v, batch.lengths)
        return self._write_prompt(state, layer, k, v, batch), out

    def _write_prompt(self, state: KiviState, layer, k, v, batch: PrefillBatch) -> KiviState:
        B, T, H, D = k.shape
        G = self.page_size
        full = batch.lengths // G
        n_g = min(T // G, self.row_len)
        if n_g:
            def groups(x):  # [B, T, H, D] -> [B, H, n_g, G, D]
                return x[:, :n_g * G].reshape(B, n_g, G, H, D).transpose(0, 3, 1, 2, 4)

            rows = state.page_table[batch.slots, layer][:, :, :n_g]  # [B, H, n_g]
            done = jnp.arange(n_g)[None, None, :] < full[:, None, None]
            page = jnp.where(done, rows, self.trash_page(state) + 1)
            state = self._store(state, page, groups(k), groups(v))
        # The incomplete last group goes to the residual, whole rows at once.
        t = full[:, None] * G + jnp.arange(G)[None, :]  # [B, G]
        keep = (t < batch.lengths[:, None])[:, None, :, None]

        def tail(x):  # [B, T, H, D] -> [B, H, G, D]
            x = jnp.take_along_axis(x, jnp.minimum(t, T - 1)[:, :, None, None], axis=1)
            return jnp.where(keep, x.transpose(0, 2, 1, 3), 0)

        slot = jnp.where(batch.lengths > 0, batch.slots, self.max_seqs + 1)  # padding: dropped
        return state.replace(res_k=scatter_set(state.res_k, (slot, layer), tail(k)),
                             res_v=scatter_set(state.res_v, (slot, layer), tail(v)))

    def end_prefill(self, state: KiviState, batch: PrefillBatch) -> KiviState:
        lengths = state.lengths.at[batch.slots].set(batch.lengths)
        return state.replace(lengths=lengths.at[self.max_seqs].set(0))

    # ---- decode -----------------------------------------------------------------
    def begin_decode(self, state: KiviState, batch: DecodeBatch):
        return state, batch

    def decode_positions(self, state: KiviState) -> jax.Array:
        """Absolute position of each slot's next token ``[S]``."""
        return state.lengths[: self.max_seqs]

    def decode_attention(self, state: KiviState, layer, q, k, v, batch: DecodeBatch):
        S, H, D, G = self.max_seqs, self.num_kv_heads, self.head_dim, self.page_size
        pos = state.lengths[:S]
        off = pos % G
        slot = jnp.where(batch.active, jnp.arange(S), S + 1)  # inactive: dropped
        idx = (slot[:, None], layer, jnp.arange(H)[None, :], off[:, None])
        state = state.replace(res_k=scatter_set(state.res_k, idx, k[:, 0]),
                              res_v=scatter_set(state.res_v, idx, v[:, 0]))
        ids = state.page_table[:S, layer, :, :batch.num_page_slots]  # [S, H, W]
        W = ids.shape[-1]
        k_old, v_old = dequantize_group(*(getattr(state, f)[ids] for f in POOLS), self.bits, D)
        keys = jnp.concatenate([k_old.reshape(S, H, W * G, D), state.res_k[:S, layer]], axis=2)
        vals = jnp.concatenate([v_old.reshape(S, H, W * G, D), state.res_v[:S, layer]], axis=2)
        valid = jnp.concatenate([jnp.arange(W * G)[None, :] < (pos - off)[:, None],
                                 jnp.arange(G)[None, :] <= off[:, None]], axis=1)
        return state, masked_decode_attention(q[:, 0], keys, vals, valid)[:, None]

    def end_decode(self, state: KiviState, batch: DecodeBatch) -> KiviState:
        """Advance lengths; rows whose residual filled get a page and it is quantized there."""
        S, L, H = self.max_seqs, self.num_layers, self.num_kv_heads
        new_len = state.lengths[:S] + batch.active.astype(jnp.int32)
        need = batch.active & (new_len % self.page_size == 0)
        counts = jnp.broadcast_to(need[:, None, None], (S, L, H)).astype(jnp.int32)
        free, ids, ok = fl.allocate(state.free, counts.reshape(-1), 1)
        ids = ids.reshape(S, L, H)
        got = ids >= 0
        # Every residual is quantized (static shapes); rows without a new page
        # write past the pool, which the scatter drops.
        state = self._store(state, jnp.where(got, ids, self.trash_page(state) + 1),
                            state.res_k[:S], state.res_v[:S])
        s_i, l_i, h_i = jnp.meshgrid(jnp.arange(S), jnp.arange(L), jnp.arange(H), indexing="ij")
        col = jnp.where(got, state.num_pages[:S], self.row_len)
        table = state.page_table.at[s_i, l_i, h_i, col].set(ids, mode="drop")
        return state.replace(lengths=state.lengths.at[:S].set(new_len), page_table=table,
                             num_pages=state.num_pages.at[:S].add(got.astype(jnp.int32)),
                             free=free, alloc_failed=state.alloc_failed | ~ok)

    # ---- accounting (release and the rest: SlotPages) ------------------------
    def _stats(self, lengths: np.ndarray, num_pages: np.ndarray) -> dict[str, Any]:
        """Accounting of the slots given: ``lengths [n]``, ``num_pages [n, L, KVH]``.

        The keys of ``FullCache``'s, plus ``residual_bytes``: the residual tokens in
        use at the storage dtype, already counted in ``page_bytes`` (and in
        ``data_bytes``, which equals ``page_bytes``: a page is only ever a full
        group). Residuals need no clearing on release: a zero length marks every
        slot unused.
        """
        rows = self.num_layers * self.num_kv_heads
        pages = int(num_pages.sum())
        tokens = int(lengths.sum())
        residual = int((lengths % self.page_size).sum()) * rows * self.residual_token_bytes
        held = pages * self.page_bytes + residual
        return {
            "tokens": tokens,
            "pages": pages,
            "page_bytes": held,
            "data_bytes": held,
            "table_bytes": int(np.count_nonzero(lengths)) * rows * self.row_len * 4,
            "bytes_16bit_same_tokens": tokens * rows * 2 * self.head_dim * 2,
            "residual_bytes": residual,
        }
