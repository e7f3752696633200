"""Paged decode attention over quantized (or 16-bit) pages, all tiers of a row in one launch.

One program per work item covers the whole GQA group (the query rows of one
KV head, padded to the 16 rows of the smallest dot tile on the GPU) over a
range of the row's pages: the row's tiers are laid end to end (DiffKV's high
pages, then its low pages), walked one page per step with one online softmax
across tiers (with ``LaunchConfig.page_lanes``, several pages per step, one
per copy of the group in the padded rows). :func:`plan_work` cuts the rows
into items of at most the same number of pages on the device, so ragged rows
keep every program equally busy; :func:`even_work` gives each row a fixed
number of equal splits. With ``LaunchConfig.transposed`` the quantized tiers'
dots take a page's tokens as the tiles' rows and the group as their columns
(padded to 8, the narrowest dot tile's columns, instead of 16 rows).

Keys enter the ``q . k`` dot as integer codes and the per-token scale/zero
are applied to the logits; values likewise through the probabilities:

    q . k_hat = scale_k * (q . codes_k) + zero_k * sum(q)
    sum_t p_t v_hat_t = sum_t (p_t scale_t) codes_t + sum_t p_t zero_t

so dequantized vectors never exist, in memory or in registers. Codes become
float16 operands ``1024 + c`` by bit operations (:mod:`code_convert`); the 1024
is folded into the offset terms.

**Page layout of a quantized tier** (``slots`` tokens, head dim ``D``, ``kw``
key bytes and ``vw`` value bytes per token, packed as in
:mod:`diffkv_jax.quantization`): ``[slots, kw]`` keys, token-major, then
``[vw, slots]`` values, byte-dim-major (row ``r`` holds packed byte ``r`` of
every token). Keys are then the column-major B operand of ``q . k^T`` and
values the column-major B operand of ``p . v``, so both load straight into
the dot layout, and any slice of the value dims is a range of rows. Both
regions are the same bytes for every tier that spends ``kw + vw`` bytes per
token, so DiffKV's K8V4 and K4V2 pages share one size. 16-bit tiers (the
uncompressed cache) keep separate ``[P, slots, D]`` key and value pools.

Outputs are unnormalized partials ``(o, m, l)`` per item and, for the
policy, the logits of the real group rows (log2 units: ``log2(e) q.k /
sqrt(D)``; float16 by default, ``LaunchConfig.logits_dtype``).
:func:`merge_work` (or :func:`merge_partials` for even splits) combines them
and the token being decoded exactly (flash-decoding), or
:func:`paged_decode_merged` merges each row inside the launch (its last item to
finish folds the row's partials);
:func:`group_max_probabilities` turns logits into the per-token probabilities
(max over the group) that the tiering policy accumulates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend
from pallas_kernels.code_convert import MAGIC, exact_slices, int8_slices, magic_slices

NEG_INF = -1e30
RESCALE_SLACK = 8.0  # log2 units: probabilities are kept below 2^8 between rescalings
RW = 16  # columns of the offset-sum tile (the narrowest dot)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class TierFormat:
    """How one tier's tokens are stored.

    ``k_bits``/``v_bits``: 8, 4 or 2 for quantized codes with per-token float16
    scale/zero; 16 for raw 16/32-bit floats (no metadata, separate K and V pools).
    """

    k_bits: int
    v_bits: int
    head_dim: int
    slots: int  # tokens per page

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16

    @property
    def key_width(self) -> int:
        return self.head_dim * min(self.k_bits, 8) // 8

    @property
    def value_width(self) -> int:
        return self.head_dim * min(self.v_bits, 8) // 8

    @property
    def data_bytes(self) -> int:
        """Bytes of one quantized page (keys then values)."""
        return self.slots * (self.key_width + self.value_width)

    def check_views(self) -> None:
        if self.data_bytes % self.key_width:
            raise ValueError(f"a page of {self.data_bytes} bytes is not a whole number of "
                             f"{self.key_width}-byte key rows")


def page_views(data: jax.Array, fmt: TierFormat) -> tuple[jax.Array, jax.Array]:
    """Views of a quantized page pool ``[P, >= data_bytes]`` (uint8) the kernel reads.

    Returns ``(keys [P, rows, kw], values [P, rows', slots])``: a page's keys are
    ``keys[p, :slots]`` and its value rows ``values[p, kw : kw + vw]``. Both are
    reshapes of the same buffer (no copy) when the pool is exactly
    ``data_bytes`` wide.
    """
    fmt.check_views()
    P, width = data.shape
    if width != fmt.data_bytes:
        raise ValueError(f"pool pages are {width} bytes; {fmt} needs {fmt.data_bytes}")
    return (data.reshape(P, width // fmt.key_width, fmt.key_width),
            data.reshape(P, width // fmt.slots, fmt.slots))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["keys", "values", "meta", "pages", "n_tok"], meta_fields=["fmt"])
@dataclasses.dataclass(frozen=True)
class TierInput:
    """One tier's operands: ``keys``/``values`` are :func:`page_views` of a quantized
    pool (or ``[P, slots, D]`` 16-bit pools), ``meta`` the ``(k_meta, v_meta)``
    ``[P, >= slots]`` uint32 arrays of packed float16 ``scale | zero << 16``
    (:func:`pack_meta`; None for 16-bit),
    ``pages [S, H, NP]`` page IDs in token order (entries past a row's pages are
    never read), ``n_tok [S, H]`` tokens stored in the row's pages of this tier."""

    fmt: TierFormat
    keys: jax.Array
    values: jax.Array
    meta: tuple | None
    pages: jax.Array
    n_tok: jax.Array


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch settings (static)."""

    num_splits: int = 1  # items per row when no work list is given (even splits)
    num_warps: int = 1
    num_stages: int = 3
    # Quantized tiers: "float16" dots with codes as 1024 + c (the GPU path);
    # "float32" converts codes exactly (interpret-mode checks at float32 accuracy).
    dot_dtype: str = "float16"
    emit_logits: bool = True
    # The policy's logits as stored: "float16" halves the bytes the launch writes
    # (a tenth of what it reads at K8V4/K4V2 in float32). Log2-unit logits keep 11
    # bits: a logit of magnitude |s| is off by at most |s| * 2^-11, so a
    # probability by at most 0.034% per unit of |s| (0.5% at |s| = 16).
    logits_dtype: str = "float16"
    # Slots of a quantized page per loop step (0: the whole page). A half page
    # holds half the key and value tiles in registers, so more programs fit on a
    # multiprocessor, at more loop overhead per token.
    sub_slots: int = 0
    # Rescale the accumulators only when a row's running max grew by more than
    # RESCALE_SLACK (a branch); False rescales on every page (no branch).
    lazy_rescale: bool = True
    # Quantized tiers: pages per loop step, one per lane of query rows. The dot
    # tile has 16 rows and a GQA group fills only a few (4 of Llama3-8B's), so
    # the idle rows take the group again, each copy over its own page: the
    # softmax then runs on real rows only and one step walks several pages.
    # The lanes of a group are merged exactly at the end of the program. The
    # count used is the largest power of two <= this that fits the padded rows.
    page_lanes: int = 1
    # Tiers of longer pages (K4V2's 64 slots) are walked one page per step by the
    # first lane's rows: measured on the H200, their loop slows down with lanes.
    lane_slots: int = 32
    # Quantized tiers of longer pages than lane_slots whose pages split into one part
    # per lane of at most lane_slots slots (K4V2's 64 slots over two lanes): one page
    # per step, lane r over part r, instead of lane 0's rows alone over whole pages.
    # Every query row is then live and the softmax runs on half the elements per
    # token; the step reads one contiguous page as before.
    split_pages: bool = False
    # Quantized values' code slices left at their bit offsets (float16 1024 + c 2^(b i),
    # code_convert's in_place): each byte becomes float16 once and every slice is one
    # AND per two codes, 2 + 2n instructions per word of n slices instead of 4n - 1.
    # The powers of two are undone on the value accumulators, once per tier change
    # and once at the end of the program (float16 dots only).
    values_in_place: bool = False
    # Page lanes: each lane's metadata words loaded once as a vector and chosen per
    # query column, instead of gathered per (slot, column) element.
    lane_meta_select: bool = False
    # Quantized tiers: the dots taken with the page's tokens as the tile's rows and
    # the query rows as its columns (``k . q^T``, ``v^T . p^T``). The GPU's dot tile
    # needs 16 rows but only 8 columns, so a group of up to 8 queries (or two lanes
    # of 4) is padded to 8 instead of 16: half the tensor-core work, accumulator and
    # softmax registers per token. The caller passes ``padded_rows`` (or q) of 8.
    transposed: bool = False
    # Work units per page of each tier, in the launch's tier order (() or a shorter
    # tuple: 1 for the rest). A work list's page ranges count these units, so
    # :func:`plan_work` of :func:`row_pages` with the same weights gives items of
    # about equal cost when a tier's page costs more than another's (K4V2's
    # 64-slot pages take about twice a K8V4 page's time).
    tier_weights: tuple = ()
    # Quantized tiers: bytes of a key row per dot (0: the whole row, one dot per code
    # slice). The key dot taken in column chunks of this many bytes holds one chunk's
    # codes as dot operands at a time instead of the whole page's keys. One setting
    # serves every tier of a launch, whose key rows differ in width: a tier whose
    # row is no wider than the chunk, or not a multiple of it, takes whole rows.
    key_chunk: int = 0
    # Load every tier's token count, and the page-table entries of each tier's
    # first pages (those its loop reads before the pipeline is full: num_stages - 1
    # steps, times the page lanes), as soon as the work item is known. Without it
    # a loop's first pages wait for their table entries, which wait for the token
    # count (it sets the item's first page): two dependent memory round trips per
    # tier and item, a cost that does not shrink with the item. With it the
    # entries are read from the item's range alone, and the loop does not read
    # them again (masked loads), so its first pages wait for one round trip after
    # the item's. The results are the same.
    early_row_loads: bool = False
    # Record when each program starts, starts and ends its loops, and ends, and on
    # which multiprocessor: the launch then has one more output, TRACE_COLUMNS per
    # work item, read from the GPU's clocks (compiled launches only; launch with
    # program_trace, which returns it).
    trace_programs: bool = False
    # Pages ahead of the loop that each program asks the L2 cache for (0: none): at
    # its start the item's first pages, then at every step those this many pages
    # past the step's, across into the next tier's first pages near a tier's end
    # (pages, metadata and 16-bit value pages alike; page walks of one page per
    # step only). A bulk prefetch of one thread per page part (sm_90), compiled
    # launches only: the loop's own loads, two or three steps ahead in shared
    # memory, then find the pages on their way. The results are the same; the
    # launch is slower (the requests cost more than they save: docs/benchmarks.md
    # 3.0.0r), so it is off.
    l2_prefetch: int = 0
    # Without l2_prefetch: the next tier's first pages (this many) asked of the L2
    # cache once, at the step that leaves a tier that many pages or fewer, so that
    # the next tier's loop, which fills its pipeline again, finds them on their way
    # (timed no faster, 3.0.0r: off).
    l2_prefetch_next: int = 0
    # Quantized tiers walked a whole page per step by one lane (not page lanes, not
    # sub_slots): this many consecutive pages of the item per step, each page's dots
    # as before, one running-max check and row sum for them all. A step's fixed work
    # (that check and its branch, the pipeline's wait, the loop's own instructions)
    # is then paid once per this many pages. The results are the same up to
    # rounding; two pages per step are slower (docs/benchmarks.md 3.0.0s): off.
    stack_pages: int = 1
    # Work shared out while the launch runs (0: off). A row's items (its programs)
    # each walk a fixed share of the row's units, then take chunks of this many
    # units of the row's rest, one atomic add on the row's cursor per chunk, until
    # none is left: a program on a busier multiprocessor takes fewer chunks. The
    # planned items' own ranges then only count the row's programs (the work list
    # needs ``ranges``). A program's chunks continue its online softmax, so the
    # partials keep their shape; a program left without work stores an empty one.
    row_chunk: int = 0
    # With row_chunk: the percent of each row's units handed out by its cursor; the
    # rest is split evenly over the row's items before the launch (100: all of it
    # by the cursor).
    row_share: int = 25
    # Quantized tiers: the key dots taken in int8 on the tensor cores, the query
    # rounded to this many int8 digits per row (0: float16 dots). Each row has one
    # scale (its largest magnitude to 127); digit k holds the rounding left by the
    # digits before it, times 256^k. Every key code slice is an int8 operand as
    # loaded (a shift and one logic op per four codes, code_convert.int8_slices): no
    # float16 conversion of the keys, and an int8 dot takes twice a float16 dot's
    # depth, so two digits cost as many tensor-core instructions as float16 keys.
    # The digits' dots and the metadata identities are exact in int32. One digit
    # rounds the query to about 2^-8 of its row's largest component (an error in
    # the logits of the order of K8's own), two digits to about 2^-16 (below
    # float16's 2^-11). The results match the reference given the rounded query
    # (int8_query_rows). Tiers of key rows under 32 bytes (K2 at head dim 64) keep
    # float16 dots. One digit is no faster on an H100, two are slower
    # (docs/benchmarks.md 3.0.0x): off.
    int8_query_digits: int = 0
    # Quantized tiers: each loop step takes the next step's key dots and logits
    # after its own softmax and value dots (the first step's before the loop), so
    # that a step's two halves are independent of each other and the compiler can
    # overlap them. The last step takes one page's key dots past the walk for
    # nothing (its table index clipped to the table). The results are the same up to
    # the float rounding of fused products. Slower on an H100 (docs/benchmarks.md
    # 3.0.0x): off.
    keys_ahead: bool = False

    def __post_init__(self):
        if self.dot_dtype not in ("float16", "float32"):
            raise ValueError(f"dot_dtype must be 'float16' or 'float32', got {self.dot_dtype!r}")
        if self.logits_dtype not in ("float16", "float32"):
            raise ValueError("logits_dtype must be 'float16' or 'float32', got "
                             f"{self.logits_dtype!r}")
        if self.page_lanes < 1:
            raise ValueError(f"page_lanes must be >= 1, got {self.page_lanes}")
        if self.page_lanes > 1 and self.sub_slots:
            raise ValueError("page_lanes and sub_slots cannot be combined")
        if self.transposed and self.sub_slots:
            raise ValueError("transposed and sub_slots cannot be combined")
        if any(int(w) != w or w < 1 for w in self.tier_weights):
            raise ValueError(f"tier_weights must be positive integers, got {self.tier_weights}")
        if self.l2_prefetch < 0 or self.l2_prefetch_next < 0:
            raise ValueError("l2_prefetch and l2_prefetch_next must be >= 0, got "
                             f"{self.l2_prefetch}, {self.l2_prefetch_next}")
        if self.l2_prefetch and self.l2_prefetch_next:
            raise ValueError("l2_prefetch already asks for the next tier's first pages; "
                             "l2_prefetch_next is its alternative")
        if self.stack_pages < 1 or self.stack_pages & (self.stack_pages - 1):
            # (the Triton lowering's tiles are powers of two)
            raise ValueError(f"stack_pages must be a power of two, got {self.stack_pages}")
        if self.stack_pages > 1 and (self.l2_prefetch or self.l2_prefetch_next):
            raise ValueError("stack_pages and the L2 prefetches cannot be combined")
        if self.key_chunk < 0 or (self.key_chunk and self.key_chunk % 16):
            raise ValueError(f"key_chunk must be 0 or a multiple of 16, got {self.key_chunk}")
        if self.keys_ahead and (self.l2_prefetch or self.l2_prefetch_next
                                or self.stack_pages > 1):
            raise ValueError("keys_ahead cannot be combined with the L2 prefetches or "
                             "stack_pages")
        if self.int8_query_digits not in (0, 1, 2):
            raise ValueError(f"int8_query_digits must be 0, 1 or 2, got {self.int8_query_digits}")
        if self.int8_query_digits and self.key_chunk % 32:
            raise ValueError("int8 key dots take key chunks of multiples of 32 bytes (the int8 "
                             f"dot's depth), got key_chunk={self.key_chunk}")
        if self.row_chunk < 0 or not 0 <= self.row_share <= 100:
            raise ValueError(f"row_chunk must be >= 0 and row_share in [0, 100], got "
                             f"{self.row_chunk}, {self.row_share}")
        if self.row_chunk and (self.early_row_loads or self.l2_prefetch
                               or self.l2_prefetch_next or self.stack_pages > 1):
            raise ValueError("row_chunk cannot be combined with early_row_loads, the L2 "
                             "prefetches or stack_pages (they are planned from the item's "
                             "own range)")

    def weight(self, tier: int) -> int:
        """Work units per page of tier ``tier`` (:attr:`tier_weights`)."""
        return int(self.tier_weights[tier]) if tier < len(self.tier_weights) else 1

    def lanes(self, padded_rows: int, group: int) -> int:
        """Page lanes of a launch whose queries have ``padded_rows`` rows of which
        ``group`` are real: the largest power of two <= ``page_lanes`` whose lanes of
        ``padded_rows / lanes`` rows each hold the group."""
        n = 1
        while (2 * n <= self.page_lanes and padded_rows % (2 * n) == 0
               and padded_rows // (2 * n) >= group):
            n *= 2
        return n


def pack_meta(scale: jax.Array, zero: jax.Array) -> jax.Array:
    """Float16 scale and zero as one uint32 per token (scale in the low half).

    One 4-byte word per token lets the kernel fetch metadata with the same
    asynchronous copies as the codes (2-byte loads cannot use them).
    """
    pair = jnp.stack([scale.astype(jnp.float16), zero.astype(jnp.float16)], axis=-1)
    return lax.bitcast_convert_type(pair, jnp.uint32)


def unpack_meta(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_meta` (outside kernels): float16 ``(scale, zero)``."""
    pair = lax.bitcast_convert_type(words, jnp.float16)
    return pair[..., 0], pair[..., 1]


def unpack_meta_f32(word: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_meta` inside a kernel: float32 (scale, zero)."""
    half = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16)  # noqa: E731
    return (half(word & jnp.uint32(0xFFFF)).astype(jnp.float32),
            half(word >> jnp.uint32(16)).astype(jnp.float32))


def _kernel(*refs, tiers: tuple[TierFormat, ...], cfg: LaunchConfig, group: int,
            interpret: bool, merge_items: int = 0, normalize: bool = True):
    n_t = len(tiers)
    items_ref, q_ref, tier_refs = refs[0], refs[1], refs[2:2 + 6 * n_t]
    refs = refs[2 + 6 * n_t:]
    # merge_items > 0 (paged_decode_merged): the rows' item ranges and merge counters
    # come in, the merged rows go out too (and the counters, aliased). cfg.row_chunk:
    # the ranges and the rows' cursors come in, the cursors go out (aliased); in a
    # launch that merges its rows the cursors follow the merge counters in theirs.
    n_merge = 2 if merge_items else 0
    merge_in, refs = refs[:n_merge], refs[n_merge:]
    own_cursors = cfg.row_chunk and not merge_items
    cursor_in, refs = (refs[:2], refs[2:]) if own_cursors else ((), refs)
    (o_ref, m_ref, l_ref), refs = refs[:3], refs[3:]
    merge_out, s_refs = (refs[:4], refs[4:]) if merge_items else ((), refs)
    merge_refs = tuple(merge_in) + tuple(merge_out) if merge_items else None
    trace_ref = cursor_ref = None
    if cfg.trace_programs:
        s_refs, trace_ref = s_refs[:-1], s_refs[-1]
    if own_cursors:
        s_refs, cursor_ref = s_refs[:-1], s_refs[-1]
    elif cfg.row_chunk:
        cursor_in, cursor_ref = merge_in[:1], merge_out[3]
    Gp, D = m_ref.shape[-1], q_ref.shape[-1]
    # The output is kept in one accumulator per slice of the most packed value codes.
    parts = max(8 // f.v_bits if f.quantized else 1 for f in tiers)
    w = D // parts
    # This program's work item: row (s, h) over pages [begin, end) of the row's
    # tiers laid end to end (high pages, then low pages).
    item = pl.program_id(0)

    def stamp(value, *columns):
        """The trace's clocks ``columns`` read once ``value`` (a float32 or int32
        scalar computed by what the mark follows) is known."""
        if value.dtype != jnp.int32:
            value = lax.bitcast_convert_type(value, jnp.int32)
        _stamp(trace_ref, item, value, columns)

    if trace_ref is not None:  # before the item's first load
        stamp(item, "start_ns", "start_cycles", "sm")
    s_i, h_i = items_ref[item, 0], items_ref[item, 1]
    begin, end = items_ref[item, 2], items_ref[item, 3]
    magic = cfg.dot_dtype == "float16"
    qdt = jnp.float16 if magic else jnp.float32
    row_iota = lax.broadcasted_iota(jnp.int32, (Gp,), 0)
    # Page lanes (LaunchConfig.page_lanes): row r * Gl + g holds query g of the
    # group for lane r, which walks its own pages.
    n_lanes = cfg.lanes(Gp, group) if all(f.quantized for f in tiers) else 1
    Gl = Gp // n_lanes
    lane_of_row = row_iota // Gl
    # Tile orientation: [Gp, slots] (query rows first), or with cfg.transposed (all
    # tiers quantized) [slots, Gp], the accumulators then [w, Gp].
    tr = cfg.transposed and all(f.quantized for f in tiers)
    slot_axis = 0 if tr else 1

    def per_row(x):  # [Gp] against the tile
        return x[None, :] if tr else x[:, None]

    def per_slot(x):  # [slots] against the tile ([.., ..] tiles as they are)
        if x.ndim == 2:
            return x
        return x[:, None] if tr else x[None, :]

    qscale = logit_scale(D)

    def q_part(start, width, dtype):
        rows = slice(None) if n_lanes == 1 else row_iota % Gl
        if q_ref.shape[2] < Gp:  # q holds the real rows only: repeat the last
            rows = jnp.minimum(row_iota % Gl, q_ref.shape[2] - 1)
        q = q_ref[s_i, h_i, rows, pl.ds(start, width)]
        return (q.astype(jnp.float32) * qscale).astype(dtype)

    digits = cfg.int8_query_digits
    if digits and any(f.quantized for f in tiers):
        # One int8 scale per query row (cfg.int8_query_digits): its largest magnitude to 127.
        q8_scale = _int8_row_scale(q_part(0, D, jnp.float32))

    def q8_part(start, width):
        """``q_part``'s columns as int8 digits of the row scale (most significant first)."""
        return _int8_digits(q_part(start, width, jnp.float32) / q8_scale[:, None], digits)

    def store_logits(s_ref, col, s):
        s = s.astype(s_ref.dtype)
        if not tr:
            _store_real_rows(s_ref, (s_i, h_i), s, col)
        elif interpret or s_ref.shape[2] == Gp:
            _store_real_rows(s_ref, (s_i, h_i), s.T, col)
        else:  # the [slots, Gp] tile stored as it is held, real rows only
            from jax.experimental.pallas import triton as plgpu

            stored = s_ref.shape[2]
            rows = jnp.broadcast_to(jnp.minimum(row_iota, stored - 1)[None, :], s.shape)
            cols = col + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            plgpu.store(s_ref.at[s_i, h_i, rows, cols], s,
                        mask=jnp.broadcast_to((row_iota < stored)[None, :], s.shape))

    def store_lane_logits(s_ref, s, tok, row_live, lanes):
        """Each lane's rows to its page's columns (``tok`` the tier token of every
        element); lanes past the item's pages (``row_live`` False) and padded group
        rows store nothing. ``lanes``: per lane (live, first token) for interpret mode."""
        stored, cols = s_ref.shape[2], s_ref.shape[3]
        s = s.astype(s_ref.dtype)
        g = row_iota % Gl
        if interpret:  # sequential programs: a read-modify-write per lane
            rows_first = s.T if tr else s
            width = rows_first.shape[1]
            for r, (live, col) in enumerate(lanes):
                win = (s_i, h_i, pl.ds(0, Gl), pl.ds(col, width))
                s_ref[win] = jnp.where(live, rows_first[r * Gl:(r + 1) * Gl], s_ref[win])
            return
        from jax.experimental.pallas import triton as plgpu

        rows = jnp.broadcast_to(per_row(jnp.minimum(g, stored - 1)), s.shape)
        mask = per_row(row_live & (g < stored)) & (tok < cols)
        plgpu.store(s_ref.at[s_i, h_i, rows, jnp.minimum(tok, cols - 1)], s, mask=mask)

    def store_page_logits(s_ref, s, page, last, cap):
        """The logits of the item's page ``page`` (``s``: its ``cap`` slots) to its
        columns, where the page is the item's (``< last``): a stacked step's last pages
        may lie past them, in another item's or past the row's table."""
        stored = s_ref.shape[2]
        s = s.astype(s_ref.dtype)
        col = jnp.minimum(page, last - 1) * cap  # inside the table wherever it is stored
        if interpret:  # sequential programs: a read-modify-write
            win = (s_i, h_i, pl.ds(0, stored), pl.ds(col, cap))
            s_ref[win] = jnp.where(page < last, (s.T if tr else s)[:stored], s_ref[win])
            return
        from jax.experimental.pallas import triton as plgpu

        cols = col + lax.broadcasted_iota(jnp.int32, s.shape, slot_axis)
        rows = jnp.broadcast_to(per_row(jnp.minimum(row_iota, stored - 1)), s.shape)
        mask = jnp.broadcast_to(per_row(row_iota < stored) & (page < last), s.shape)
        plgpu.store(s_ref.at[s_i, h_i, rows, cols], s, mask=mask)

    def rescale(s, carry):
        """Raise the running max to this page's only when it grew by more than
        RESCALE_SLACK (log2 units) in some row: most pages then skip rescaling the
        accumulators, and the probabilities stay below 2^RESCALE_SLACK."""
        accs, m_prev, l_prev, r_prev, z_prev = carry
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=slot_axis))

        def grow(_):
            corr = jnp.exp2(m_prev - m_next)
            return ([a * per_row(corr) for a in accs], m_next, l_prev * corr,
                    r_prev * per_row(corr), z_prev * corr)

        if not cfg.lazy_rescale:
            return grow(None)
        return lax.cond(jnp.max(m_next - m_prev) > RESCALE_SLACK, grow, lambda _: carry, None)

    def page_at(unit, t, offset):
        """The tier-``t`` page holding work unit ``unit`` of the row (units laid end
        to end, this tier's from ``offset``; a page belongs to the item holding its
        first unit), unclipped."""
        return -((offset - unit) // cfg.weight(t))

    def tier_range(t, fmt: TierFormat, n_tok, offset, span=None):
        """The item's first and last (exclusive) page of the tier, and the next
        tier's offset: the units [begin, end) (or ``span``) shifted past the earlier
        tiers."""
        lo, hi = (begin, end) if span is None else span
        row_pages = (n_tok + fmt.slots - 1) // fmt.slots
        first = jnp.clip(page_at(lo, t, offset), 0, row_pages)
        last = jnp.clip(page_at(hi, t, offset), 0, row_pages)
        return first, last, offset + row_pages * cfg.weight(t)

    def split_page(fmt: TierFormat) -> bool:
        """Whether the tier's pages are walked a page per step, a part per lane
        (cfg.split_pages)."""
        part = fmt.slots // n_lanes
        return (cfg.split_pages and n_lanes > 1 and fmt.quantized
                and fmt.slots > cfg.lane_slots and part * n_lanes == fmt.slots
                and part <= cfg.lane_slots and part % 16 == 0)

    def tier_steps(fmt: TierFormat):
        """How a tier's loop walks its pages: ``(cap, n_sub, laned)``, steps over
        ``cap`` slots (whole pages unless cfg.sub_slots, or a lane's part of a page
        with cfg.split_pages), ``n_sub`` parts per page, and whether a step takes one
        part (a page or a page's part) per lane."""
        if split_page(fmt):
            return fmt.slots // n_lanes, n_lanes, True
        cap = fmt.slots
        if fmt.quantized and 0 < cfg.sub_slots < fmt.slots:
            cap = cfg.sub_slots
        return cap, fmt.slots // cap, n_lanes > 1 and cap <= cfg.lane_slots

    def early_entries(fmt: TierFormat) -> int:
        """Table entries the tier's first loop steps read before the loop's pipeline is
        full (``num_stages - 1`` steps ahead): the ones :func:`early_loads` reads."""
        _, n_sub, laned = tier_steps(fmt)
        ahead = max(cfg.num_stages - 1, 1)
        if laned:  # n_lanes parts per step: n_lanes pages, or one split page
            return min(n_lanes * ahead // n_sub, 8)
        return min(-(-ahead // n_sub), 8)

    def early_loads():
        """Per tier: its token count and the table entries of the item's first pages
        (cfg.early_row_loads), at the item's start. The entries are read from the
        item's range alone, clipped to the table, so the first tier's need no token
        count: their loads overlap that of the counts."""
        loads, offset = [], jnp.int32(0)
        for t, fmt in enumerate(tiers):
            pages_ref, ntok_ref = tier_refs[6 * t + 4], tier_refs[6 * t + 5]
            n_tok = ntok_ref[s_i, h_i]
            # The loop's first page where it runs (its range is inside the row).
            base = jnp.maximum(page_at(begin, t, offset), 0)
            top = pages_ref.shape[-1] - 1
            loads.append((n_tok, tuple(pages_ref[s_i, h_i, jnp.minimum(base + r, top)]
                                       for r in range(early_entries(fmt)))))
            offset = tier_range(t, fmt, n_tok, offset)[2]
        return loads

    def page_parts(fmt: TierFormat, refs_t):
        """``(ref, elements)`` of what a page of the tier is read from, by page ID: its
        data (keys and values, or 16-bit keys, then values) and metadata; only the
        parts whose pages start on 16-byte boundaries (a bulk prefetch's alignment)."""
        k_ref, v_ref, km_ref, vm_ref = refs_t[:4]
        whole = lambda ref: math.prod(ref.shape[1:])  # noqa: E731
        parts = ([(k_ref, whole(k_ref)), (km_ref, fmt.slots), (vm_ref, fmt.slots)]
                 if fmt.quantized else [(k_ref, whole(k_ref)), (v_ref, whole(v_ref))])
        return [(ref, n) for ref, n in parts
                if whole(ref) * ref.dtype.itemsize % 16 == 0 and n * ref.dtype.itemsize >= 16]

    def table_page(refs_t, index):
        """The tier's page ID at table index ``index`` (clipped to the table, the ID
        into the pool)."""
        pages_ref = refs_t[4]
        page = pages_ref[s_i, h_i, jnp.clip(index, 0, pages_ref.shape[-1] - 1)]
        return jnp.minimum(page, refs_t[0].shape[0] - 1)

    def prefetch_page(fmt, refs_t, page, when):
        """The L2 prefetch of the tier's page ``page`` where ``when``; left out in
        interpret mode."""
        if not interpret:
            for ref, elements in page_parts(fmt, refs_t):
                backend.prefetch_l2(ref, page, elements, when)

    def tier_loop(t, fmt: TierFormat, refs_t, s_ref, carry, offset, early=None,
                  at_loop=None, nxt=None, span=None):
        """``nxt``: with cfg.l2_prefetch or cfg.l2_prefetch_next, the next tier's
        ``(fmt, refs, first, last)`` (None for the last tier). ``span``: the units
        walked, if not the item's."""
        k_ref, v_ref, km_ref, vm_ref, pages_ref, ntok_ref = refs_t
        n_tok = ntok_ref[s_i, h_i] if early is None else early[0]
        first, last, next_offset = tier_range(t, fmt, n_tok, offset, span)

        def lookup(index):
            """The page IDs the walk's page ``index`` may be: this tier's, and past its
            last page the next tier's (its pages follow)."""
            pages = [table_page(refs_t, index)]
            if nxt is not None:
                _, n_refs, n_first, _ = nxt
                pages.append(table_page(n_refs, n_first + index - last))
            return tuple(pages)

        def prefetch(index, pages):
            """The L2 prefetch of the walk's page ``index`` (``pages`` its
            :func:`lookup`), where the walk has one."""
            prefetch_page(fmt, refs_t, pages[0], (index >= first) & (index < last))
            if nxt is not None:
                n_fmt, n_refs, n_first, n_last = nxt
                prefetch_page(n_fmt, n_refs, pages[1],
                              (index >= last) & (n_first + index - last < n_last))

        def with_next_tier(loop_body, lo, hi):
            """``loop_body`` asking, once, at the step that leaves this tier
            cfg.l2_prefetch_next pages or fewer to walk (its first where it has fewer),
            for the next tier's first that many pages: its loop's first loads then
            find them on their way. Their IDs are read before the loop."""
            if nxt is None:
                return loop_body
            n_fmt, n_refs, n_first, n_last = nxt
            count = cfg.l2_prefetch_next
            ids = [table_page(n_refs, n_first + i) for i in range(count)]
            per_step = n_lanes if laned else 1
            trigger = jnp.maximum(hi - (count + per_step - 1) // per_step, lo)

            def ask():
                for i, page in enumerate(ids):
                    prefetch_page(n_fmt, n_refs, page, n_first + i < n_last)

            def step(j, carry):
                lax.cond(j == trigger, ask, lambda: None)
                return loop_body(j, carry)
            return step

        def with_prefetch(loop_body, targets):
            """``loop_body`` asking for the pages ``targets(j)`` at step ``j``, their IDs
            read a step before (carried), so that the request waits for no table read."""
            def step(j, state):
                carry, pages = state
                for index, ids in zip(targets(j), pages):
                    prefetch(index, ids)
                return loop_body(j, carry), tuple(lookup(i) for i in targets(j + 1))
            return step

        def page_id(index):
            """The table entry ``index`` of the row. Entries ``first + r`` come from the
            early loads (the same entries: a loop step's index is below the row's
            pages, so ``first`` is unclipped), and on the GPU the table is not read
            for them at all (a masked load): the step's page address then waits for
            no second round trip."""
            if early is None:
                return pages_ref[s_i, h_i, index]
            entries = early[1]
            ahead = (index >= first) & (index < first + len(entries))
            if interpret:  # the masked load's value: 0 where it reads nothing
                page = jnp.where(ahead, 0, pages_ref[s_i, h_i, index])
            else:
                from jax.experimental.pallas import triton as plgpu

                page = plgpu.load(pages_ref.at[s_i, h_i, index], mask=~ahead,
                                  other=jnp.zeros((), pages_ref.dtype))
            for r, entry in enumerate(entries):
                page = jnp.where(index == first + r, entry, page)
            return page
        cap, n_sub, laned = tier_steps(fmt)
        # Pages per step of a one-lane walk of whole pages (cfg.stack_pages).
        stack = cfg.stack_pages if fmt.quantized and not laned and n_sub == 1 else 1
        col_iota = lax.broadcasted_iota(jnp.int32, (cap,), 0)

        if fmt.quantized:
            kw = fmt.key_width
            nk = 8 // fmt.k_bits
            # Key bytes per dot (cfg.key_chunk), and per chunk the query slices its codes
            # meet: code slice i of byte column c holds dim i * kw + c.
            kc = cfg.key_chunk if 0 < cfg.key_chunk < kw and kw % cfg.key_chunk == 0 else kw
            int8 = digits and kc >= 32
            if int8:  # per chunk and slice the query's int8 digits
                q_chunks = [[q8_part(i * kw + c, kc) for i in range(nk)]
                            for c in range(0, kw, kc)]
                # Sum of the digits, each weighted by 256^(its place), the last's 1.
                q8_sum = sum(jnp.sum(x.astype(jnp.float32), axis=1)
                             * float(256 ** (digits - 1 - k))
                             for chunk in q_chunks for xs in chunk for k, x in enumerate(xs))
                q8_offset = 128.0 * q8_sum  # the -128 of every operand, back
                # the rounded query's sum; code c of a slice is the operand c 2^(8-bits) - 128
                q_sum = q8_scale * q8_sum / float(256 ** (digits - 1))
                q8_unit = q8_scale / float((1 << (8 - fmt.k_bits)) * 256 ** (digits - 1))
            else:
                q_chunks = [[q_part(i * kw + c, kc, qdt) for i in range(nk)]
                            for c in range(0, kw, kc)]
                # Sum of the rounded query, so the 1024 offsets cancel exactly.
                q_sum = sum(jnp.sum(x.astype(jnp.float32), axis=1)
                            for chunk in q_chunks for x in chunk)
        else:
            pdt = k_ref.dtype
            q_full = q_part(0, D, pdt)

        def key_dot(page, at):
            """``q . codes`` over ``cap`` key slots of a page from ``at`` ([Gp, cap] f32),
            one dot per code slice of each chunk of ``kc`` key bytes."""
            acc = None
            for c, q_slices in zip(range(0, kw, kc), q_chunks):
                cols = slice(None) if kc == kw else pl.ds(c, kc)
                kb = k_ref[page, pl.ds(at, cap), cols]  # [cap, kc] codes
                if int8:  # one int32 accumulator per digit
                    if acc is None:
                        acc = [jnp.zeros((cap, Gp) if tr else (Gp, cap), jnp.int32)] * digits
                    for q_digits, kp in zip(q_slices, int8_slices(kb, fmt.k_bits,
                                                                  interpret=interpret)):
                        for k, qs in enumerate(q_digits):
                            a, b = (kp, qs) if tr else (qs, kp)
                            acc[k] = backend.dot_acc(acc[k], a, b, trans_b=True)
                    continue
                k_parts = (magic_slices(kb, fmt.k_bits, interpret=interpret) if magic
                           else exact_slices(kb, fmt.k_bits, jnp.float32))
                for qs, kp in zip(q_slices, k_parts):
                    a, b = (kp, qs) if tr else (qs, kp)  # [slots, Gp] or [Gp, slots]
                    acc = (backend.dot(a, b, trans_b=True) if acc is None
                           else backend.dot_acc(acc, a, b, trans_b=True))
            if int8:  # the digits' dots in one int32 (exact: below 2^31)
                total = acc[0]
                for a in acc[1:]:
                    total = total * 256 + a
                return total
            return acc

        def value_dots(accs, pv, page, at):
            """``accs`` plus ``pv . codes`` over the same slots' value codes."""
            kw, vw = fmt.key_width, fmt.value_width
            out = list(accs)
            # Value part i holds dims [i w, (i + 1) w): slice i*w // vw, rows (i*w) % vw.
            for rb in range(vw // w):
                vb = v_ref[page, pl.ds(kw + rb * w, w), pl.ds(at, cap)]  # [w, cap] codes
                v_parts = (magic_slices(vb, fmt.v_bits, interpret=interpret,
                                        in_place=cfg.values_in_place) if magic
                           else exact_slices(vb, fmt.v_bits, jnp.float32))
                for sl, vp in enumerate(v_parts):
                    i = (sl * vw + rb * w) // w
                    out[i] = (backend.dot_acc(out[i], vp, pv) if tr  # [w, Gp]
                              else backend.dot_acc(out[i], pv, vp, trans_b=True))
            return out

        def logits(acc, k_words):
            """The step's logits from ``q . codes`` and the keys' metadata words (one
            per slot, or one per row and slot)."""
            ks, kz = unpack_meta_f32(k_words)
            if int8:  # q8 . (c 2^(8-b) - 128) = 2^(8-b) q8 . c - 128 sum(q8), in int32
                dots = acc.astype(jnp.float32) + per_row(q8_offset)
                return dots * (per_slot(ks) * per_row(q8_unit)) + per_row(q_sum) * per_slot(kz)
            if magic:  # q . (c + 1024) = q . c + 1024 sum(q)
                kz = kz - MAGIC * ks
            return acc * per_slot(ks) + per_row(q_sum) * per_slot(kz)

        def softmax(s, live, store, carry):
            """The step's masked logits (stored for the policy) into the online
            softmax: ``(p, carry)`` with the sums updated."""
            s = jnp.where(live, s, NEG_INF)
            if s_ref is not None:
                store(s)
            accs, m, l, r, z = rescale(s, carry)
            p = jnp.exp2(s - per_row(m))
            return p, (accs, m, l + jnp.sum(p, axis=slot_axis), r, z)

        def value_weights(p, v_words, r, z):
            """``p * scale`` (the value dots' operand) and the offset terms, from the
            values' metadata words."""
            vs, vz = unpack_meta_f32(v_words)
            pv = (p * per_slot(vs)).astype(qdt)
            if magic:  # (p s) . (c + 1024): remove 1024 sum(p s) with the rounded weights,
                # summed by the tensor cores (a dot with ones) rather than lane by lane
                ones = jnp.ones((RW, p.shape[slot_axis]), qdt)
                r = (backend.dot_acc(r, ones, pv) if tr
                     else backend.dot_acc(r, pv, ones, trans_b=True))
            return pv, r, z + jnp.sum(p * per_slot(vz), axis=slot_axis)

        # A page ID read from the table stays inside the pool even where the table
        # names no page (its entry past the pool): a corrupt row reads wrong data,
        # never past the pool's end.
        in_pool = lambda page: jnp.minimum(page, k_ref.shape[0] - 1)  # noqa: E731

        # cfg.keys_ahead: a step's key dots are taken in the step before (so they are
        # independent of that step's softmax and value dots), and past the walk's
        # last step for nothing: their table indices are then clipped to the table.
        look_ahead = cfg.keys_ahead and fmt.quantized and stack == 1
        table_width = pages_ref.shape[-1]

        def table_index(index):
            return jnp.clip(index, 0, table_width - 1) if look_ahead else index

        def body_keys(j):
            """Step ``j``'s logits and page."""
            page = in_pool(page_id(table_index(j if n_sub == 1 else j // n_sub)))
            at = 0 if n_sub == 1 else (j % n_sub) * cap
            if fmt.quantized:
                s = logits(key_dot(page, at), km_ref[page, pl.ds(at, cap)])
            else:
                s = backend.dot(q_full, k_ref[page].astype(pdt), trans_b=True)
            return s, page

        def body(j, carry):
            s, page = body_keys(j)
            return body_values(j, s, page, carry)

        def body_values(j, s, page, carry):
            """Step ``j``'s softmax and value dots, from its logits ``s``."""
            at = 0 if n_sub == 1 else (j % n_sub) * cap
            valid = j * cap + col_iota < n_tok
            live = per_slot(valid)
            if n_lanes > 1:  # a tier of longer pages: lane 0's rows alone walk them
                live = live & per_row(lane_of_row == 0)
            p, (accs, m, l, r, z) = softmax(
                s, live, lambda s: store_logits(s_ref, j * cap, s), carry)
            if not fmt.quantized:
                accs = [backend.dot_acc(accs[0], p.astype(pdt), v_ref[page].astype(pdt))]
                return accs, m, l, r, z
            pv, r, z = value_weights(p, vm_ref[page, pl.ds(at, cap)], r, z)
            return value_dots(accs, pv, page, at), m, l, r, z

        def stacked_body(j, carry):
            """One step over the item's pages ``first + j * stack + i`` (``i < stack``):
            each page's dots as in :func:`body`, one running-max check for them all.
            Pages past the item's last are clamped to it and masked off."""
            base = first + j * stack
            pages = [in_pool(page_id(jnp.minimum(base + i, last - 1))) for i in range(stack)]
            end_tok = jnp.minimum(n_tok, last * cap)
            s_all = []
            for i, page in enumerate(pages):
                live = per_slot((base + i) * cap + col_iota < end_tok)
                if n_lanes > 1:
                    live = live & per_row(lane_of_row == 0)
                s = jnp.where(live, logits(key_dot(page, 0), km_ref[page, pl.ds(0, cap)]),
                              NEG_INF)
                if s_ref is not None:
                    store_page_logits(s_ref, s, base + i, last, cap)
                s_all.append(s)
            s_max = s_all[0]
            for s in s_all[1:]:
                s_max = jnp.maximum(s_max, s)
            accs, m, l, r, z = rescale(s_max, carry)
            p_all = [jnp.exp2(s - per_row(m)) for s in s_all]
            p_sum = p_all[0]
            for p in p_all[1:]:
                p_sum = p_sum + p
            l = l + jnp.sum(p_sum, axis=slot_axis)
            for page, p in zip(pages, p_all):
                pv, r, z = value_weights(p, vm_ref[page, pl.ds(0, cap)], r, z)
                accs = value_dots(accs, pv, page, 0)
            return accs, m, l, r, z

        lane_col = per_row(lane_of_row)
        # A lane's part of its page starts here (split pages: a part per lane).
        lane_at = [r * cap for r in range(n_lanes)] if n_sub > 1 else [0] * n_lanes

        def lane_pages(j):
            """Step ``j``'s page per lane: lane r takes part u0 + j * n_lanes + r of the
            tier (parts of ``cap`` slots, ``n_sub`` per page, from the item's first
            page's): page first + j * n_lanes + r, or with split pages part r of page
            first + j."""
            if n_sub > 1:  # one page, a part per lane at a static offset
                return (in_pool(page_id(table_index(first + j))),) * n_lanes
            base = first * n_sub + j * n_lanes  # the step's first part
            return tuple(in_pool(page_id(table_index(jnp.minimum(base + r, last - 1))))
                         for r in range(n_lanes))

        def lane_words(ref, lane_page, shape):
            """Each row's metadata words of ``ref``, from its lane's part."""
            if cfg.lane_meta_select:  # each lane's words once, chosen by column
                tile = None
                for r in range(n_lanes):
                    part = per_slot(ref[lane_page[r], pl.ds(lane_at[r], cap)])
                    tile = (jnp.broadcast_to(part, shape) if tile is None
                            else jnp.where(lane_col == r, part, tile))
                return tile
            if n_sub > 1:
                page_row = jnp.full((Gp,), lane_page[0])
                cols = per_row(lane_of_row * cap) + per_slot(col_iota)
                return ref[jnp.broadcast_to(per_row(page_row), cols.shape), cols]
            page_row = lane_page[0]
            for r in range(1, n_lanes):
                page_row = jnp.where(lane_of_row == r, lane_page[r], page_row)
            if tr:
                return ref[page_row[None, :], col_iota[:, None]]
            return ref[page_row, pl.ds(0, cap)]

        def lane_keys(j):
            """Step ``j``'s logits (each lane's rows over its own part) and pages."""
            lane_page = lane_pages(j)
            acc = None
            for r in range(n_lanes):  # lane r's rows take the dot with its own part
                d = key_dot(lane_page[r], lane_at[r])
                acc = d if acc is None else jnp.where(lane_col == r, d, acc)
            return logits(acc, lane_words(km_ref, lane_page, acc.shape)), lane_page

        def lane_body(j, carry):
            s, lane_page = lane_keys(j)
            return lane_values(j, s, lane_page, carry)

        def lane_values(j, s, lane_page, carry):
            """Step ``j``'s softmax and value dots, from its logits ``s``."""
            base = first * n_sub + j * n_lanes  # the step's first part
            last_part = last * n_sub
            tok = per_row(base + lane_of_row) * cap + per_slot(col_iota)  # tier token index
            valid = tok < jnp.minimum(n_tok, last * fmt.slots)
            lanes = [(base + r < last_part, jnp.minimum(base + r, last_part - 1) * cap)
                     for r in range(n_lanes)]
            p, (accs, m, l, r_acc, z) = softmax(
                s, valid, lambda s: store_lane_logits(s_ref, s, tok,
                                                      base + lane_of_row < last_part,
                                                      lanes), carry)
            pv, r_acc, z = value_weights(p, lane_words(vm_ref, lane_page, s.shape), r_acc, z)
            for r in range(n_lanes):  # the value dots of lane r's rows alone
                accs = value_dots(accs, jnp.where(lane_col == r, pv, jnp.zeros_like(pv)),
                                  lane_page[r], lane_at[r])
            return accs, m, l, r_acc, z

        if at_loop is not None:  # once the loop's operands (its range, the query) are known
            qv = q_sum if fmt.quantized else q_full.astype(jnp.float32)
            at_loop(first + last + lax.bitcast_convert_type(jnp.max(qv), jnp.int32))
        if laned:
            lo, hi = 0, ((last - first) * n_sub + n_lanes - 1) // n_lanes
            loop_body = lane_body
            targets = lambda j: [first + j * n_lanes + cfg.l2_prefetch + r  # noqa: E731
                                 for r in range(n_lanes)]
        elif stack > 1:
            lo, hi, loop_body = 0, (last - first + stack - 1) // stack, stacked_body
        else:
            lo, hi, loop_body = first * n_sub, last * n_sub, body
            targets = lambda j: [j + cfg.l2_prefetch]  # noqa: E731
        if look_ahead:
            keys, values = (lane_keys, lane_values) if laned else (body_keys, body_values)

            def ahead_body(j, state):
                carry, s, pages = state
                return (values(j, s, pages, carry),) + keys(j + 1)

            state = (carry,) + keys(lo)
            return lax.fori_loop(lo, hi, ahead_body, state)[0], next_offset
        if not (cfg.l2_prefetch or cfg.l2_prefetch_next) or n_sub > 1:
            return lax.fori_loop(lo, hi, loop_body, carry), next_offset
        if not cfg.l2_prefetch:  # cfg.l2_prefetch_next alone
            return lax.fori_loop(lo, hi, with_next_tier(loop_body, lo, hi), carry), next_offset
        if t == 0:  # the first tier's loop also asks for the walk's first pages
            for i in range(cfg.l2_prefetch):
                prefetch(first + i, lookup(first + i))
        state = (carry, tuple(lookup(i) for i in targets(lo)))
        return lax.fori_loop(lo, hi, with_prefetch(loop_body, targets), state)[0], next_offset

    def value_exponents(fmt: TierFormat) -> tuple[int, ...]:
        """Per value accumulator, the power of two its codes carry in this tier's dots
        (cfg.values_in_place: slice sl of a byte is c 2^(v_bits sl)); 0 otherwise."""
        exps = [0] * parts
        if magic and cfg.values_in_place and fmt.quantized and fmt.v_bits < 8:
            vw = fmt.value_width
            for rb in range(vw // w):
                for sl in range(8 // fmt.v_bits):
                    exps[(sl * vw + rb * w) // w] = fmt.v_bits * sl
        return tuple(exps)

    def row_offsets(r):
        """The 1024 offsets' row sums (every column of the R tile holds them)."""
        return jnp.max(r, axis=0 if tr else 1)

    def rebase(carry, exps_from, exps_to):
        """The value accumulators from one tier's powers of two to the next's: the
        offsets so far removed (the R tile restarts) and each accumulator rescaled."""
        accs, m, l, r, z = carry
        off = per_row(MAGIC * row_offsets(r))
        accs = [(a - off) * (2.0 ** (e1 - e0)) if e1 != e0 else a - off
                for a, e0, e1 in zip(accs, exps_from, exps_to)]
        return accs, m, l, jnp.zeros_like(r), z

    def walk_tiers(carry, traced=False):
        """Every tier's loop over the item's units, in order."""
        offset = jnp.int32(0)
        for t, fmt in enumerate(tiers):
            if t:
                carry = between_tiers(t - 1, carry)
            at_loop = None
            if traced and t == 0:
                at_loop = lambda value: stamp(value, "loop_ns", "loop_cycles")  # noqa: E731
            carry, offset = tier_loop(t, fmt, tier_refs[6 * t:6 * t + 6],
                                      s_refs[t] if s_refs else None, carry, offset,
                                      early[t], at_loop, next_tier[t])
        return carry

    def tier_walks():
        """Per tier, ``(walk, end)``: ``walk(span, carry)`` its loop over the units
        ``span`` (clipped to the tier) and ``end`` the unit where the tier's pages end;
        then the row's units."""
        walks, offset = [], jnp.int32(0)
        for t, fmt in enumerate(tiers):
            start = offset
            offset = tier_range(t, fmt, tier_refs[6 * t + 5][s_i, h_i], start)[2]

            def walk(span, carry, t=t, fmt=fmt, start=start):
                return tier_loop(t, fmt, tier_refs[6 * t:6 * t + 6],
                                 s_refs[t] if s_refs else None, carry, start, span=span)[0]
            walks.append((walk, offset))
        return walks, offset

    def between_tiers(t, carry):
        """The carry from tier ``t``'s value exponents to tier ``t + 1``'s."""
        a, b = value_exponents(tiers[t]), value_exponents(tiers[t + 1])
        return rebase(carry, a, b) if a != b else carry

    acc_shape, r_shape = ((w, Gp), (RW, Gp)) if tr else ((Gp, w), (Gp, RW))
    carry = ([jnp.zeros(acc_shape, jnp.float32)] * parts,
             jnp.full((Gp,), NEG_INF, jnp.float32), jnp.zeros((Gp,), jnp.float32),
             jnp.zeros(r_shape, jnp.float32), jnp.zeros((Gp,), jnp.float32))
    early = early_loads() if cfg.early_row_loads else [None] * len(tiers)
    next_tier = [None] * len(tiers)  # per tier, the next tier's pages of the item
    if cfg.l2_prefetch or cfg.l2_prefetch_next:
        span_offset = jnp.int32(0)
        for t, fmt in enumerate(tiers):
            first_t, last_t, span_offset = tier_range(t, fmt, tier_refs[6 * t + 5][s_i, h_i],
                                                      span_offset)
            if t:
                next_tier[t - 1] = (fmt, tier_refs[6 * t:6 * t + 6], first_t, last_t)
    if cfg.row_chunk:
        walks, units = tier_walks()
        n_rows = tier_refs[5].shape[0] * tier_refs[5].shape[1]
        carry = _walk_row_chunks(
            walks, between_tiers, carry, cursor_in[0], cursor_ref, item=item,
            row=s_i * tier_refs[5].shape[1] + h_i, used=begin < end, units=units,
            cursor_offset=n_rows if merge_items else 0,
            chunk=cfg.row_chunk, share=cfg.row_share, interpret=interpret,
            on_start=None if trace_ref is None else (
                lambda value: stamp(value, "loop_ns", "loop_cycles")))
    else:
        carry = walk_tiers(carry, trace_ref is not None)
    exps = value_exponents(tiers[-1])  # the accumulators' powers of two after the walk
    accs, m, l, r, z = carry
    if trace_ref is not None:  # after the last tier's loop
        stamp(jnp.max(l), "loop_end_ns", "loop_end_cycles")
    # Every tier's values carry the same offset terms: o = acc - 1024 R + Z (every
    # column of the R tile holds the same row sums).
    corr_o = z - MAGIC * row_offsets(r) if magic else z
    outs = [o + per_row(corr_o) if not e
            else (o - per_row(MAGIC * row_offsets(r))) * (2.0 ** -e) + per_row(z)
            for o, e in zip(accs, exps)]
    if tr:
        outs = [o.T for o in outs]
    if n_lanes > 1:
        m, l, outs = _merge_lanes(m, l, outs, n_lanes)
    if merge_items:
        _store_and_merge(merge_refs, (o_ref, m_ref, l_ref), outs, m * LN2, l, item,
                         (s_i, h_i, begin < end), group=group, width=w,
                         items_per_step=merge_items, normalize=normalize, interpret=interpret)
    else:
        for i, o in enumerate(outs):
            _store_real_rows(o_ref, (), o, i * w)
        m_ref[...] = m * LN2  # natural units outside the kernel
        l_ref[...] = l
    if trace_ref is not None:  # after the stores (and the row's merge)
        stamp(jnp.max(outs[-1]), "end_ns", "end_cycles")


#: The points of a program a trace marks: its start (before its first load), the
#: start of its first tier's loop (the item's row, range and query known), the end
#: of its last tier's loop, and its end (after its stores and its row's merge).
TRACE_POINTS = ("start", "loop", "loop_end", "end")
#: The columns of a program trace (:attr:`LaunchConfig.trace_programs`), int32: at
#: each of :data:`TRACE_POINTS` the global timer (ns, comparable across
#: multiprocessors) and the multiprocessor's cycle counter (finer), both their low
#: 32 bits (compare by differences modulo 2^32), then the multiprocessor that ran it.
TRACE_COLUMNS = (tuple(f"{p}_ns" for p in TRACE_POINTS)
                 + tuple(f"{p}_cycles" for p in TRACE_POINTS) + ("sm",))


def logit_scale(D: int) -> float:
    """The query's factor in the launches' logits (decode, window scores): logits in
    log2 units (times log2(e) / sqrt(D)), so the softmax is a bare exp2."""
    return LOG2E / math.sqrt(D)


def _int8_row_scale(qf: jax.Array) -> jax.Array:
    """Per row of ``qf`` ([rows, D] float32) the int8 step: its largest magnitude / 127."""
    return jnp.maximum(jnp.max(jnp.abs(qf), axis=1), 1e-30) / 127.0


def _int8_digits(x: jax.Array, digits: int) -> list[jax.Array]:
    """``x`` (within [-127, 127]) as ``digits`` int8 digits, each rounded half up:
    ``x ~ sum_k d_k 256^-k`` (a digit after the first holds the rounding left, at
    most 128 steps of its place, clipped to 127)."""
    out = []
    for _ in range(digits):
        d = jnp.clip(jnp.floor(x + 0.5), -127.0, 127.0)
        out.append(d.astype(jnp.int8))
        x = (x - d) * 256.0
    return out


def int8_query_rows(q: jax.Array, digits: int = 1) -> jax.Array:
    """``q`` ([..., D]) as a launch with ``LaunchConfig.int8_query_digits = digits``
    takes it: each row rounded to that many int8 digits of its largest magnitude /
    127, in float32. The kernel rounds the row in its log2 logit units (times
    log2(e) / sqrt(D)), which scales the steps along, so the reference given these
    rows is the launch's."""
    D = q.shape[-1]
    qscale = logit_scale(D)
    rows = q.astype(jnp.float32).reshape(-1, D) * qscale
    scale = _int8_row_scale(rows)
    parts = _int8_digits(rows / scale[:, None], digits)
    value = sum(d.astype(jnp.float32) / 256.0 ** k for k, d in enumerate(parts))
    return (value * scale[:, None] / qscale).reshape(q.shape)


def _stamp(trace_ref, item, dep, columns):
    """The clocks named by ``columns`` (:data:`TRACE_COLUMNS`) into row ``item``,
    read after ``dep`` (an int32 scalar) is known."""
    for name in columns:
        which = "sm" if name == "sm" else name.rsplit("_", 1)[1]
        trace_ref[item, pl.ds(TRACE_COLUMNS.index(name), 1)] = backend.read_clock(dep, which)


def _walk_row_chunks(walks, between, carry, ranges_ref, cursor_ref, *, item, row, used,
                     units, chunk: int, share: int, interpret: bool, cursor_offset=0,
                     on_start=None):
    """The units of row ``row`` (``s * H + h``) that item ``item`` walks when the launch
    shares its rows out as it runs (:attr:`LaunchConfig.row_chunk`): the item's fixed
    share of the row, then chunks of ``chunk`` units taken from the row's cursor until
    the row has none left; the carry after the last.

    The row's ``n`` items (``ranges_ref``) each take a fixed ``k``-th of the row's first
    ``100 - share`` percent of its ``units``; the rest, from ``n`` times that share on,
    is handed out by an atomic add on the row's cursor (``cursor_ref[cursor_offset +
    row]``, zero at the launch's start). Every item ends on a take past the row's
    units; the row's last such take (the ``n``-th) sets the cursor to zero again. Items not
    ``used`` walk and take nothing.

    ``walks``: per tier ``(walk, end)`` (``walk(span, carry)`` the tier's loop over
    the units ``span``, ``end`` where its units end); a loop per tier takes the
    chunks that start in it (a chunk across a tier's end continues in the next
    tier's loop), so a program's tiers come in order: ``between(t, carry)`` once
    after tier ``t``.
    """
    first_item, n = ranges_ref[row, 0], ranges_ref[row, 1]
    at = row + cursor_offset
    k = item - first_item
    fixed = units * (100 - share) // (100 * jnp.maximum(n, 1))
    pool = n * fixed
    taken = -(-(units - pool) // chunk)  # the takes that find units
    lo = jnp.where(used, k * fixed, units)
    if on_start is not None:
        on_start(lo)

    def take(real):
        """The next chunk's first unit (past the row's units when none is left) where
        ``real``; elsewhere the cursor is left as it is and the value is meaningless
        (a masked atomic: no branch around it)."""
        if interpret:  # programs run one after another
            got = cursor_ref[at]
            cursor_ref[at] = got + jnp.where(real, chunk, 0)
        else:  # no memory ordering: the cursor publishes no data
            got = backend.relaxed_atomic_add(cursor_ref, at, chunk, real)

        @pl.when(real & (got == (taken + n - 1) * chunk))
        def _reset():  # the row's last take: every other item has taken its last
            cursor_ref[at] = jnp.int32(0)
        return pool + got

    hi = jnp.where(used, (k + 1) * fixed, units)
    for t, (walk, bound) in enumerate(walks):
        def body(st, walk=walk, bound=bound):
            lo, hi, carry = st
            carry = walk((lo, hi), carry)
            # A chunk across the tier's end goes on in the next tier's loop, from its
            # first unit there.
            crosses = hi > bound
            nxt = take(~crosses)
            return (jnp.where(crosses, bound, nxt),
                    jnp.where(crosses, hi, jnp.minimum(nxt + chunk, units)), carry)

        lo, hi, carry = lax.while_loop(lambda st, bound=bound: st[0] < bound, body,
                                       (lo, hi, carry))
        if t + 1 < len(walks):
            carry = between(t, carry)
    return carry


def _store_and_merge(merge_refs, partial_refs, outs, m, l, item, row_item, *, group: int,
                     width: int, items_per_step: int, normalize: bool, interpret: bool):
    """The end of a :func:`paged_decode_merged` program: a row of one item writes its
    output; otherwise the item stores its partials, counts itself done with an
    atomic add on its row's counter, and the row's last item to finish merges
    every item of the row (:mod:`partial_fold`) and resets the counter. The
    output is divided by the row's sum where ``normalize``.

    ``outs``: the item's unnormalized output, ``[Gp, width]`` column parts; ``m``
    (natural units), ``l [Gp]``; ``row_item``: ``(s, h, used)``, ``used`` False for
    a work list's unused items (they do nothing).
    """
    from pallas_kernels import partial_fold

    ranges_ref, _, out_ref, M_ref, L_ref, cnt_ref = merge_refs
    o_ref, m_ref, l_ref = partial_refs
    s_i, h_i, used = row_item
    H, D = out_ref.shape[1], out_ref.shape[-1]
    row = s_i * H + h_i
    first, count = ranges_ref[row, 0], ranges_ref[row, 1]

    @pl.when(used & (count == 1))
    def _alone():  # the row's only item: its output is the row's
        inv = 1.0 / jnp.where(l > 0, l, 1.0)
        for i, o in enumerate(outs):
            o = o * inv[:, None] if normalize else o
            _store_real_rows(out_ref, (s_i, h_i), o.astype(out_ref.dtype), i * width)
        _store_real_rows(M_ref, (s_i, h_i), m)
        _store_real_rows(L_ref, (s_i, h_i), l)

    @pl.when(used & (count > 1))
    def _shared():
        for i, o in enumerate(outs):
            _store_real_rows(o_ref, (item,), o, i * width)
        _store_real_rows(m_ref, (item,), m)
        _store_real_rows(l_ref, (item,), l)
        if interpret:  # programs run one after another
            done = cnt_ref[row]
            cnt_ref[row] = done + 1
        else:
            from jax.experimental.pallas import triton as plgpu

            # The atomic is one thread's: after the barrier its release covers every
            # thread's partial stores, and its acquire the last item's reads below.
            plgpu.debug_barrier()
            done = plgpu.atomic_add(cnt_ref, row, jnp.ones((), jnp.int32))

        @pl.when(done == count - 1)
        def _last():
            # The real rows (a power of two on the GPU, the last repeated).
            n = m.shape[0] if interpret else pl.next_power_of_2(group)
            rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (n,), 0), group - 1)
            cols = lax.broadcasted_iota(jnp.int32, (D,), 0)

            # Other programs' stores: volatile loads skip this multiprocessor's L1.
            load = partial_fold.item_loader(o_ref, m_ref, l_ref, rows, cols,
                                            volatile=not interpret)
            carry = partial_fold.fold_items(load, first, count, n, D, items_per_step)
            out = partial_fold.normalized(carry) if normalize else carry[2]
            _store_real_rows(out_ref, (s_i, h_i), out.astype(out_ref.dtype))
            _store_real_rows(M_ref, (s_i, h_i), carry[0])
            _store_real_rows(L_ref, (s_i, h_i), carry[1])
            cnt_ref[row] = jnp.int32(0)


def _store_real_rows(ref, lead, x, col=0):
    """``x [n]`` or ``[n, c]`` into ``ref[*lead, :, col:col + c]``. Where ``ref`` holds
    fewer rows than ``x`` (the real group rows, on the GPU) the rest are masked off
    and never reach memory; interpret mode keeps every row."""
    stored, n = ref.shape[len(lead)], x.shape[0]
    cols = () if x.ndim == 1 else (pl.ds(col, x.shape[1]),)
    if stored == n:
        ref[(*lead, slice(None), *cols)] = x
        return
    from jax.experimental.pallas import triton as plgpu

    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (n,), 0), stored - 1)
    plgpu.store(ref.at[(*lead, rows, *cols)], x,
                mask=lax.broadcasted_iota(jnp.int32, x.shape, 0) < stored)


def _merge_lanes(m, l, outs, n_lanes: int):
    """Exact merge of the page lanes of each group row (rows ``r * Gl + g``), the
    result broadcast back to every lane's rows (so rows ``g < Gl`` hold it).

    ``m [Gp]`` row maxima (log2 units), ``l [Gp]`` sums, ``outs`` ``[Gp, w]``
    unnormalized outputs.
    """
    Gp = m.shape[0]
    Gl = Gp // n_lanes

    def spread(x):  # [Gl, ...] -> every lane's rows [Gp, ...]
        return jnp.broadcast_to(x[None], (n_lanes, *x.shape)).reshape(Gp, *x.shape[1:])

    m_all = spread(jnp.max(m.reshape(n_lanes, Gl), axis=0))
    c = jnp.exp2(m - m_all)
    l_all = spread(jnp.sum((l * c).reshape(n_lanes, Gl), axis=0))
    outs = [spread(jnp.sum((o * c[:, None]).reshape(n_lanes, Gl, o.shape[1]), axis=0))
            for o in outs]
    return m_all, l_all, outs


@functools.partial(jax.tree_util.register_dataclass, data_fields=["items", "seg", "ranges"],
                   meta_fields=["num_rows"])
@dataclasses.dataclass(frozen=True)
class WorkList:
    """The work items of one launch: one program per item.

    ``items [N, 4]`` int32 ``(s, h, begin, end)``: item ``w`` attends row ``(s, h)``
    over pages ``[begin, end)`` of the row's tiers laid end to end (its high pages,
    then its low pages), counted in work units where the launch weighs a tier's
    pages (``LaunchConfig.tier_weights``: a page is the item's whose range holds
    its first unit); ``seg [N]`` is ``s * H + h``, or ``num_rows`` (``S * H``) for
    an unused item (``begin == end``), which the merge drops. ``ranges [num_rows, 2]``
    (from :func:`plan_work`; None otherwise): each row's first item and item count
    (a row's items are consecutive), for a merge that walks a row's items itself.
    """

    items: jax.Array
    seg: jax.Array
    num_rows: int
    ranges: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.items.shape[0]


def row_pages(tiers: Sequence[TierInput], active=None, weights: Sequence[int] = ()):
    """Pages of each row, all tiers together ``[S, H]`` (0 where not ``active [S]``),
    each tier's pages counted ``weights[t]`` times (``LaunchConfig.tier_weights``;
    1 where not given)."""
    weights = tuple(weights) + (1,) * (len(tiers) - len(weights))
    total = sum((t.n_tok.astype(jnp.int32) + t.fmt.slots - 1) // t.fmt.slots * w
                for t, w in zip(tiers, weights))
    return total if active is None else jnp.where(active[:, None], total, 0)


def tier_bounds(tiers: Sequence[TierInput], weights: Sequence[int] = ()):
    """Work units of each row's first tier ``[S, H]``: where its second tier's pages
    start in the units :func:`row_pages` counts (``plan_work(bounds=)``)."""
    return row_pages(tiers[:1], weights=tuple(weights)[:1])


def plan_work(pages, num_items: int, *, min_pages: int = 2,
              wave: int | None = None, bounds=None, snap: float = 0.0,
              max_weight: int = 1, gap: int = 0) -> WorkList:
    """Balanced work items over the rows' pages ``[S, H]`` (:func:`row_pages`), on the
    device.

    Every item gets at most ``C`` consecutive pages of one row, where ``C`` is the
    smallest count (>= ``min_pages``) with which the rows' pages fit in
    ``num_items`` items: long and short rows then cost the same per program and
    no program waits for the longest row, whatever the mix of lengths. Rows with
    no pages get no item. Needs ``num_items > S * H``.

    ``wave``: the programs the GPU runs at once. ``C`` is then the smallest count
    whose items number at most ``wave`` (:func:`smallest_fitting_count`), so equal
    rows fill one wave exactly instead of leaving a partial second wave; where the
    active rows alone outnumber ``wave``, the rule above.

    ``bounds [S, H]`` (:func:`tier_bounds`) and ``snap``: a row's cut that lies
    within ``snap * C`` units of the row's tier boundary moves onto it, so that
    no item walks the last few pages of one tier and the first of the next (an
    item holding both tiers pays its second loop's start for them), and the
    row's items on each side of it share their tier's units evenly: at most
    ``C + snap * C / i`` units each, ``i`` the items on that side, and at least
    ``max_weight`` (the heaviest tier's units per page: each still holds a page;
    the cut stays where that would fail).

    ``bounds`` and ``gap``: the second loop's start that an item holding both tiers
    of its row pays, in units. Each row with pages on both sides of its boundary is
    planned as ``gap`` units longer, the extra units at the boundary, so the item
    across it holds that many fewer pages; the cuts are then mapped back (a cut
    inside the extra units falls on the boundary). ``gap < min_pages``, so that
    no item lies inside them; not with ``snap``.
    """
    S, H = pages.shape
    if num_items <= S * H:
        raise ValueError(f"{num_items} work items for {S * H} rows: need more items than rows")
    if gap and (bounds is None or snap > 0):
        raise ValueError("gap needs the rows' bounds and cannot be combined with snap")
    if gap < 0 or (gap and gap >= min_pages):
        # (an item is at least min_pages units long: none then lies inside a gap)
        raise ValueError(f"gap must be in [0, min_pages = {min_pages}), got {gap}")
    flat = pages.reshape(-1).astype(jnp.int32)
    gaps = None
    if gap:
        # Each row's extra units where it holds both tiers, after its first tier's.
        b_all = bounds.reshape(-1).astype(jnp.int32)
        gaps = jnp.where((b_all > 0) & (b_all < flat), jnp.int32(gap), 0)
        flat = flat + gaps
    total, rows = jnp.sum(flat), jnp.sum(flat > 0)
    # sum(ceil(n / C)) <= total / C + rows <= num_items by this choice of C.
    per_item = jnp.maximum(-(-total // jnp.maximum(num_items - rows, 1)), min_pages)
    if wave is not None:
        target = min(wave, num_items)
        in_wave = smallest_fitting_count(flat, target, min_pages)
        per_item = jnp.where(rows <= target, in_wave, per_item)
    count = -(-flat // per_item)
    ends = jnp.cumsum(count)
    w = jnp.arange(num_items, dtype=jnp.int32)
    # Which row item w belongs to: rows whose items end at or before it (a compare
    # of all pairs: one fused kernel, no loop on the GPU).
    seg = jnp.sum((ends[None, :] <= w[:, None]).astype(jnp.int32), axis=1)
    used = seg < S * H
    row = jnp.minimum(seg, S * H - 1)
    k = w - (ends[row] - count[row])  # the item's place in its row
    begin = k * per_item
    end = jnp.minimum(begin + per_item, flat[row])
    if bounds is not None and snap > 0:
        # The row's cut nearest its boundary (cut j starts the row's item j) moves
        # onto it, and the items on each side share their tier's units evenly.
        b, n, u = bounds.reshape(-1).astype(jnp.int32)[row], count[row], flat[row]
        tol = (per_item * snap).astype(jnp.int32)
        j = (b + per_item // 2) // per_item
        jj, rest = jnp.maximum(j, 1), jnp.maximum(n - j, 1)
        moves = ((j >= 1) & (j < n) & (jnp.abs(j * per_item - b) <= tol)
                 & (b // jj >= max_weight) & ((u - b) // rest >= max_weight))

        def cut(i):  # where the row's item i begins once moved (cut(n) = u)
            return jnp.where(i <= j, i * b // jj, b + (i - j) * (u - b) // rest)

        begin = jnp.where(moves, cut(k), begin)
        end = jnp.where(moves, cut(k + 1), end)
    if gaps is not None:  # the planned cuts in the row's units as the launch counts them
        b_row, g_row = b_all[row], gaps[row]
        begin, end = (jnp.where(v <= b_row, v, jnp.maximum(v - g_row, b_row))
                      for v in (begin, end))
    items = jnp.stack([row // H, row % H, jnp.where(used, begin, 0), jnp.where(used, end, 0)],
                      axis=-1).astype(jnp.int32)
    ranges = jnp.stack([ends - count, count], axis=-1).astype(jnp.int32)
    return WorkList(items, jnp.where(used, seg, S * H).astype(jnp.int32), S * H, ranges)


#: Candidate counts per level of :func:`smallest_fitting_count` and its levels:
#: 1,024^2 counts between its brackets are searched exactly (past that the count
#: found still fits, but may not be the smallest).
SEARCH_WIDTH, SEARCH_LEVELS = 1024, 2


def smallest_fitting_count(flat, target: int, min_pages: int = 1):
    """The smallest ``C >= min_pages`` with ``sum(ceil(flat / C)) <= target``
    (``flat`` the rows' page counts; ``max(flat, min_pages)``, one item per row,
    where nothing fits).

    A search between two bounds (``total / target`` and ``total / (target -
    rows)``, often a few counts apart) over a grid of :data:`SEARCH_WIDTH`
    candidates, narrowed :data:`SEARCH_LEVELS` times: a fixed number of
    reductions and no loop, since a loop on the GPU waits for the host at every
    iteration (a 32-step bisection took about 0.19 ms on the H200, as much as
    the attention launch it plans).
    """
    flat = flat.astype(jnp.int32)
    total, rows = jnp.sum(flat), jnp.sum(flat > 0)
    hi = jnp.maximum(jnp.max(flat), min_pages)  # one item per row: the most that can fit
    # Brackets: below total / target the items outnumber target; C with
    # total / C + rows <= target fits (sum(ceil(n / C)) <= total / C + rows).
    spare = target - rows
    hi = jnp.where(spare > 0, jnp.minimum(hi, jnp.maximum(
        -(-total // jnp.maximum(spare, 1)), min_pages)), hi)
    lo = jnp.minimum(jnp.maximum(-(-total // target), min_pages), hi)
    ks = jnp.arange(1, SEARCH_WIDTH + 1, dtype=jnp.int32)
    for _ in range(SEARCH_LEVELS):
        # Blocks of `step` counts from lo; each block's last count is a candidate,
        # and the first that fits ends the block that holds the answer.
        step = -(-(hi - lo + 1) // SEARCH_WIDTH)
        cand = lo + jnp.minimum((ks - 1) * step + (step - 1), hi - lo)  # the last is hi
        items = jnp.sum(-(-flat[None, :] // cand[:, None]), axis=1)
        j = jnp.argmax((items <= target).at[-1].set(True))
        lo = jnp.where(j > 0, cand[jnp.maximum(j - 1, 0)] + 1, lo)
        hi = cand[j]
    return hi


def even_work(tiers: Sequence[TierInput], num_splits: int,
              weights: Sequence[int] = ()) -> WorkList:
    """``num_splits`` items per row, sharing its pages (counted with ``weights``, as
    :func:`row_pages`) evenly (items in ``(s, h, k)`` order)."""
    S, H = tiers[0].n_tok.shape
    K = num_splits
    pages = row_pages(tiers, weights=weights)[..., None]
    per = -(-pages // K)
    begin = jnp.minimum(jnp.arange(K) * per, pages)
    end = jnp.minimum(begin + per, pages)
    s_i, h_i, _ = jnp.meshgrid(jnp.arange(S), jnp.arange(H), jnp.arange(K), indexing="ij")
    items = jnp.stack([s_i, h_i, begin, end], axis=-1).reshape(S * H * K, 4).astype(jnp.int32)
    return WorkList(items, (s_i * H + h_i).reshape(-1).astype(jnp.int32), S * H)


def paged_decode_partials(q, tiers: Sequence[TierInput], *, group: int | None = None,
                          cfg: LaunchConfig = LaunchConfig(), work: WorkList | None = None,
                          interpret: bool | None = None, padded_stats: bool = False,
                          padded_rows: int | None = None):
    """Partial attention of ``q`` over every tier of each row, one launch.

    Args:
      q: ``[S, H, Gq, D]`` queries grouped by KV head (any float dtype): either padded
        to the kernel's rows (a multiple of 16 on the GPU, see :func:`pad_group`), or
        the real rows with ``padded_rows`` given.
      padded_rows: the rows of the kernel's tiles (``Gp``, >= ``Gq``); the rows past
        ``Gq`` repeat its last one, never stored (no padded copy of ``q`` in memory).
        None: ``Gq``.
      tiers: the tiers of each row, in the order their pages are walked.
      group: real query rows per KV head (<= ``Gp``; default ``Gp``); the outputs
        hold these rows only.
      work: the launch's work items (e.g. :func:`plan_work` of :func:`row_pages`
        with ``cfg.tier_weights``);
        None: ``cfg.num_splits`` items per row sharing its pages evenly
        (:func:`even_work`).
    Returns:
      With ``work``: per item ``o [N, G, D]``, ``m, l [N, G]`` (merge them with
      :func:`merge_work`); without: ``o [S, H, K, G, D]``, ``m, l [S, H, K, G]``
      (K = num_splits, merge with :func:`merge_partials`). Float32, m in natural
      units. Then per tier ``logits [S, H, G, NP * slots]`` in log2 units, of
      ``cfg.logits_dtype`` (slots >= n_tok hold garbage and must be masked by the
      caller; None when ``cfg.emit_logits`` is False). ``padded_stats``: ``m, l`` (and, in interpret
      mode, ``o``) keep their ``Gp`` rows, for a consumer that reads the real rows
      itself (no slicing kernels).
    """
    interpret, G, Gp = _check_launch(q, tiers, padded_rows, group, interpret, cfg)
    S, H, _, D = q.shape
    listed = work is not None
    if not listed:
        work = even_work(tiers, cfg.num_splits, cfg.tier_weights)
    outs = _decode_call(q, tiers, G, Gp, cfg, work, interpret)
    o, m, l = outs[:3] if padded_stats else (outs[0][:, :G], outs[1][:, :G], outs[2][:, :G])
    logits = ([x[:, :, :G] for x in outs[3:3 + len(tiers)]] if cfg.emit_logits
              else [None] * len(tiers))
    if not listed:
        K = cfg.num_splits
        o, m, l = o.reshape(S, H, K, G, D), m.reshape(S, H, K, G), l.reshape(S, H, K, G)
    return o, m, l, logits


def _check_launch(q, tiers, padded_rows, group, interpret, cfg=None):
    """``(interpret, G, Gp)`` of a decode launch, after checking its inputs (and that
    ``cfg``, where given, asks for no trace: :func:`program_trace` returns it)."""
    if interpret is None:
        interpret = backend.default_interpret()
    if cfg is not None and cfg.trace_programs:
        raise ValueError("LaunchConfig.trace_programs: launch with program_trace(), which "
                         "returns the trace")
    S, H, Gq, D = q.shape
    Gp = Gq if padded_rows is None else padded_rows
    if Gp < Gq:
        raise ValueError(f"padded_rows {padded_rows} < the {Gq} rows of q")
    G = Gq if group is None else group
    if D % 16:
        raise ValueError("head_dim must be a multiple of 16")
    if any(t.fmt.quantized for t in tiers) and not all(t.fmt.quantized for t in tiers):
        raise ValueError("a launch mixes 16-bit and quantized tiers")
    for t in tiers:
        if not interpret and t.fmt.slots < 16:
            raise ValueError(f"pages of {t.fmt.slots} tokens: the GPU kernel needs >= 16 "
                             "tokens per page (its smallest dot tile)")
        parts = 8 // t.fmt.v_bits if t.fmt.quantized else 1
        if not interpret and D // parts < 16:
            raise ValueError(f"head_dim {D} with {t.fmt.v_bits}-bit values: the GPU kernel "
                             f"needs head_dim >= {16 * parts} (its output slices of "
                             "head_dim * v_bits / 8 columns must fill a 16-wide dot tile)")
        for pool in (t.keys, t.values):
            if not addressable(pool.size, pool.dtype.itemsize):
                raise ValueError(f"a pool of {pool.size} elements of {pool.dtype.itemsize} "
                                 "bytes cannot be addressed by one kernel launch (32-bit "
                                 "offsets); use a pool of at most 2^31 elements or over 4 GiB")
    return interpret, G, Gp


def _decode_call(q, tiers, G: int, Gp: int, cfg: LaunchConfig, work: WorkList,
                 interpret: bool, merge=None):
    """The decode launch's outputs: per item ``o, m, l`` (``Gp`` rows, or ``G`` for
    ``o`` on the GPU), then with ``merge = (counters, out_dtype, items_per_step,
    normalize)`` the merged ``out, M, L`` (the same rows) and the counters, then the
    logits, then with ``cfg.trace_programs`` the trace (:data:`TRACE_COLUMNS`)."""
    S, H, _, D = q.shape
    N = work.size
    whole = lambda a: pl.BlockSpec(a.shape, lambda w: (0,) * a.ndim)  # noqa: E731
    dummy = jnp.zeros((1, 1), jnp.uint32)
    args = [work.items, q]
    for t in tiers:
        meta = list(t.meta) if t.fmt.quantized else [dummy] * 2
        args += [t.keys, t.values, *meta, t.pages.astype(jnp.int32), t.n_tok.astype(jnp.int32)]
    aliases = {}
    if merge is not None:
        args += [work.ranges.astype(jnp.int32), merge[0]]
        aliases[len(args) - 1] = 6
    if cfg.row_chunk and merge is None:  # the rows' cursors, zero, and their items' ranges
        if work.ranges is None:
            raise ValueError("LaunchConfig.row_chunk needs the work list's ranges "
                             "(plan_work's)")
        args += [work.ranges.astype(jnp.int32), jnp.zeros((S * H,), jnp.int32)]
    in_specs = [whole(a) for a in args]
    # Interpret mode stores every row and slices outside (its masked stores need
    # slices only); on the GPU padded rows are masked off in the kernel.
    rows = Gp if interpret else G
    out_shape = [jax.ShapeDtypeStruct((N, rows, D), jnp.float32),
                 jax.ShapeDtypeStruct((N, Gp), jnp.float32),
                 jax.ShapeDtypeStruct((N, Gp), jnp.float32)]
    if merge is None:
        out_specs = [pl.BlockSpec((None, rows, D), lambda w: (w, 0, 0)),
                     pl.BlockSpec((None, Gp), lambda w: (w, 0)),
                     pl.BlockSpec((None, Gp), lambda w: (w, 0))]
    else:  # any program may read any item's partials, and writes its row's output
        out_shape += [jax.ShapeDtypeStruct((S, H, rows, D), jnp.dtype(merge[1])),
                      jax.ShapeDtypeStruct((S, H, rows), jnp.float32),
                      jax.ShapeDtypeStruct((S, H, rows), jnp.float32),
                      jax.ShapeDtypeStruct(merge[0].shape, jnp.int32)]
        out_specs = [whole(a) for a in out_shape]
    if cfg.emit_logits:
        for t in tiers:
            shape = (S, H, rows, t.pages.shape[-1] * t.fmt.slots)
            out_shape.append(jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.logits_dtype)))
            out_specs.append(pl.BlockSpec(shape, lambda w: (0, 0, 0, 0)))
    if cfg.row_chunk and merge is None:  # updated in place: every row's ends at zero again
        aliases[len(args) - 1] = len(out_shape)
        out_shape.append(jax.ShapeDtypeStruct((S * H,), jnp.int32))
        out_specs.append(whole(out_shape[-1]))
    if cfg.trace_programs:
        if interpret:
            raise ValueError("trace_programs reads the GPU's clocks: it needs a compiled "
                             "launch (interpret=False)")
        out_shape.append(jax.ShapeDtypeStruct((N, len(TRACE_COLUMNS)), jnp.int32))
        out_specs.append(whole(out_shape[-1]))
    kernel = functools.partial(_kernel, tiers=tuple(t.fmt for t in tiers), cfg=cfg,
                               group=G, interpret=interpret,
                               merge_items=0 if merge is None else merge[2],
                               normalize=merge is None or merge[3])
    name = "paged_decode_" + "_".join(f"k{t.fmt.k_bits}v{t.fmt.v_bits}" for t in tiers)
    return pl.pallas_call(
        kernel, grid=(N,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret,
        # The merge counters and the cursors are updated in place: every row's ends
        # at zero again.
        input_output_aliases=aliases,
        compiler_params=None if interpret else backend.compiler_params(cfg.num_warps,
                                                                       cfg.num_stages),
        name=name,
    )(*args)


def merge_counters(S: int, H: int, cfg: LaunchConfig = LaunchConfig()) -> jax.Array:
    """Zeroed merge counters for :func:`paged_decode_merged`, one per (sequence, KV
    head) row, then with ``cfg.row_chunk`` the rows' cursors (``[2 * S * H]``);
    every launch leaves them zero again, so a decode step makes them once and
    passes each launch's to the next."""
    return jnp.zeros(_counters_shape(S, H, cfg), jnp.int32)


def _counters_shape(S: int, H: int, cfg: LaunchConfig) -> tuple[int]:
    """Shape of :func:`merge_counters`: a counter per row, then a cursor per row where
    ``cfg.row_chunk``."""
    return (S * H * (2 if cfg.row_chunk else 1),)


def paged_decode_merged(q, tiers: Sequence[TierInput], *, work: WorkList,
                        counters: jax.Array | None = None, group: int | None = None,
                        cfg: LaunchConfig = LaunchConfig(), out_dtype=jnp.float32,
                        padded_rows: int | None = None, items_per_step: int = 4,
                        normalize: bool = True, zero_empty: bool = True,
                        interpret: bool | None = None):
    """Attention of ``q`` over every tier of each row, merged inside the one launch.

    The launch of :func:`paged_decode_partials` over ``work`` (:func:`plan_work`'s,
    with ``ranges``), where each row's last item to finish merges the row's items
    (flash-decoding, exact, as :func:`merge_work`): an item counts itself done on
    its row's counter (an atomic add, after its partials are stored), and the one
    that finds every other item done folds their partials and writes the row. A
    row of one item writes its output directly. No second launch.

    Args:
      q, tiers, group, cfg, padded_rows: as :func:`paged_decode_partials`.
      work: the launch's work items, with ``ranges``.
      counters: int32 zeros, ``[S * H]`` or with ``cfg.row_chunk`` ``[2 * S * H]``
        (:func:`merge_counters`; made here if None), updated in place and returned
        zero again: pass one launch's to the next.
      out_dtype: dtype of ``out``.
      items_per_step: items the merging program loads and folds together (a power
        of two; its loads are registers held at the launch's end).
      normalize: False leaves ``out`` undivided by ``L``: each row's ``(out, M, L)``
        is then one partial of the row, for a consumer that merges more into it
        (the policy launch, with the token being decoded).
      zero_empty: False leaves the rows without items unwritten, for a consumer that
        reads only the rows with items (no select over the output).
    Returns:
      ``(out [S,H,G,D], M [S,H,G], L [S,H,G], logits, counters)``: as
      :func:`merge_work` (rows without items: zeros, ``M = NEG_INF``, ``L = 0``),
      the logits as :func:`paged_decode_partials`'s, and the counters.
    """
    merge = _merge_spec(q, work, counters, out_dtype, items_per_step, normalize, cfg)
    interpret, G, Gp = _check_launch(q, tiers, padded_rows, group, interpret, cfg)
    S, H = q.shape[:2]
    outs = _decode_call(q, tiers, G, Gp, cfg, work, interpret, merge)
    out, M, L = (x[:, :, :G] for x in outs[3:6])
    if zero_empty:
        # Rows without items were never written: zeros, as merge_work leaves them (an
        # elementwise select that XLA fuses into the output's consumer).
        has = (work.ranges[:, 1] > 0).reshape(S, H, 1)
        out = jnp.where(has[..., None], out, jnp.zeros((), out.dtype))
        M, L = jnp.where(has, M, NEG_INF), jnp.where(has, L, 0.0)
    logits = ([x[:, :, :G] for x in outs[7:7 + len(tiers)]] if cfg.emit_logits
              else [None] * len(tiers))
    return out, M, L, logits, outs[6]


def program_trace(q, tiers: Sequence[TierInput], *, work: WorkList, group: int | None = None,
                  cfg: LaunchConfig = LaunchConfig(), padded_rows: int | None = None,
                  merged: bool = False, items_per_step: int = 4) -> jax.Array:
    """When each program of one compiled decode launch started and ended, and where.

    The launch of :func:`paged_decode_partials` over ``work`` (or, ``merged``, of
    :func:`paged_decode_merged`, with zeroed counters) with
    :attr:`LaunchConfig.trace_programs`: every program reads the GPU's clocks
    before its first load, at the start of its first loop and the end of its
    last, and after its last store (and its row's merge).
    Returns ``[N, len(TRACE_COLUMNS)]`` int32, one row per work item
    (:data:`TRACE_COLUMNS`: the clocks at each of :data:`TRACE_POINTS`). The
    clocks cost a few instructions per program; the outputs are the untraced
    launch's.
    """
    merge = (_merge_spec(q, work, None, jnp.float32, items_per_step, True, cfg) if merged
             else None)
    interpret, G, Gp = _check_launch(q, tiers, padded_rows, group, False)
    cfg = dataclasses.replace(cfg, trace_programs=True)
    return _decode_call(q, tiers, G, Gp, cfg, work, interpret, merge)[-1]


def _merge_spec(q, work: WorkList, counters, out_dtype, items_per_step: int,
                normalize: bool, cfg: LaunchConfig):
    """The ``merge`` argument of :func:`_decode_call` for a launch that merges its
    own rows, after checking the work list, ``items_per_step`` and the counters
    (zeroed ones made where None)."""
    if work.ranges is None:
        raise ValueError("a launch that merges its rows needs the work list's ranges "
                         "(plan_work's)")
    if items_per_step < 1 or items_per_step & (items_per_step - 1):
        raise ValueError(f"items_per_step must be a power of two, got {items_per_step}")
    S, H = q.shape[:2]
    if counters is None:
        counters = merge_counters(S, H, cfg)
    size = _counters_shape(S, H, cfg)
    if counters.shape != size or counters.dtype != jnp.int32:
        raise ValueError(f"counters must be int32 {list(size)} (merge_counters(S, H, cfg)), "
                         f"got {counters.dtype} {counters.shape}")
    return counters, out_dtype, items_per_step, normalize


def merge_work(o, m, l, work: WorkList, S: int, H: int, extra=None):
    """Exact merge of the items of a :class:`WorkList` (flash-decoding), per row.

    Args:
      o, m, l: ``[N, G, D]``, ``[N, G]``, ``[N, G]`` from :func:`paged_decode_partials`.
      extra: optional ``(o [S,H,G,D], m [S,H,G], l [S,H,G])`` for one more source
        (e.g. the token being decoded, with ``l = 1``).
    Returns:
      ``(out [S,H,G,D], M [S,H,G], L [S,H,G])`` as :func:`merge_partials`.
    """
    G, D = o.shape[1], o.shape[2]
    R = S * H
    seg = work.seg
    # Unused items fall in segment R, whose max is 0: their weights are exp(-huge) = 0.
    M = jax.ops.segment_max(m, seg, num_segments=R + 1, indices_are_sorted=True)
    M = jnp.maximum(M, NEG_INF).at[R].set(0.0)
    if extra is not None:
        M = M.at[:R].max(extra[1].reshape(R, G))
    c = jnp.exp(m - M[seg])
    L = jax.ops.segment_sum(l * c, seg, num_segments=R + 1, indices_are_sorted=True)[:R]
    O = jax.ops.segment_sum(o * c[..., None], seg, num_segments=R + 1,
                            indices_are_sorted=True)[:R]
    M = M[:R]
    if extra is not None:
        ce = jnp.exp(extra[1].reshape(R, G) - M)
        L = L + extra[2].reshape(R, G) * ce
        O = O + extra[0].reshape(R, G, D) * ce[..., None]
    # Rows without items or extra (inactive rows) come out as zeros.
    out = O / jnp.where(L > 0, L, 1.0)[..., None]
    return out.reshape(S, H, G, D), M.reshape(S, H, G), L.reshape(S, H, G)


def addressable(elements: int, itemsize: int) -> bool:
    """Whether a pool fits the Triton lowering's offsets: it indexes a ref with 32-bit
    signed element offsets unless the ref holds more than 2^32 bytes, so a pool of
    more than 2^31 one-byte elements and at most 4 GiB would overflow them, unless
    :func:`pallas_kernels.backend.wide_offsets` gives those 64-bit offsets too."""
    if elements <= 2**31 or elements * itemsize > 2**32:
        return True
    return backend.wide_offsets()


def padded_group(G: int, multiple: int) -> int:
    """Rows of a group of ``G`` queries padded to a multiple (the GPU dot needs >= 16)."""
    return -(-G // multiple) * multiple


def tile_rows(group: int, transposed: bool = False) -> int:
    """Query rows of the GPU kernel's tiles for a group of ``group``: a multiple of 16
    (the dot tile's rows), or of 8 (its columns) where a quantized launch takes the
    queries as the columns (``LaunchConfig.transposed``) and the group fits 8."""
    return padded_group(group, 8 if transposed and group <= 8 else 16)


def pad_group(q, multiple: int):
    """Pad the group axis of ``q [S, H, G, D]`` to a multiple (the GPU dot needs >= 16 rows)."""
    G = q.shape[2]
    target = padded_group(G, multiple)
    if target == G:
        return q
    return jnp.pad(q, ((0, 0), (0, 0), (0, target - G), (0, 0)))


def merge_partials(parts, extra=None):
    """Exact merge of split partials (flash-decoding).

    Args:
      parts: list of ``(o [S,H,K,G,D], m [S,H,K,G], l [S,H,K,G])``.
      extra: optional ``(o [S,H,G,D], m [S,H,G], l [S,H,G])`` for one more source
        (e.g. the token being decoded, with ``l = 1``).
    Returns:
      ``(out [S,H,G,D], M [S,H,G], L [S,H,G])``: normalized output and the global
      softmax max and normalizer (so ``p = exp(logit - M) / L``).
    """
    os = [p[0] for p in parts]
    ms = [p[1] for p in parts]
    ls = [p[2] for p in parts]
    if extra is not None:
        os.append(extra[0][:, :, None])
        ms.append(extra[1][:, :, None])
        ls.append(extra[2][:, :, None])
    o = jnp.concatenate(os, axis=2)
    m = jnp.concatenate(ms, axis=2)
    l = jnp.concatenate(ls, axis=2)
    M = jnp.max(m, axis=2)
    c = jnp.exp(m - M[:, :, None])
    L = jnp.sum(l * c, axis=2)
    out = jnp.sum(o * c[..., None], axis=2) / L[..., None]
    return out, M, L


def group_max_probabilities(logits2, M, L, group: int):
    """``max_g exp(logit - M_g) / L_g`` over the first ``group`` rows: ``[S, H, n]``.

    ``logits2`` are the kernel's logits in log2 units; ``M`` (natural units) and ``L``
    come from :func:`merge_partials`.
    """
    M2 = M[:, :, :group, None] * LOG2E
    p = jnp.exp2(logits2[:, :, :group].astype(jnp.float32) - M2) / L[:, :, :group, None]
    return jnp.max(p, axis=2)


def tier_attention_reference(q, k_hat, v_hat, n_tok):
    """Plain-jnp reference of one tier: partials with a single split.

    Args:
      q: ``[S, H, G, D]``; k_hat, v_hat: ``[S, H, n, D]`` dequantized tokens in slot order;
      n_tok: ``[S, H]``.
    Returns:
      ``(o [S,H,1,G,D], m, l [S,H,1,G], logits [S,H,G,n])`` with the meaning of
      :func:`paged_decode_partials` (logits in log2 units).
    """
    D = q.shape[-1]
    s = jnp.einsum("shgd,shnd->shgn", q.astype(jnp.float32), k_hat.astype(jnp.float32))
    s = s / math.sqrt(D)
    valid = jnp.arange(k_hat.shape[2])[None, None, None, :] < n_tok[:, :, None, None]
    s = jnp.where(valid, s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("shgn,shnd->shgd", p, v_hat.astype(jnp.float32))
    return o[:, :, None], m[:, :, None], l[:, :, None], jnp.where(valid, s * LOG2E, NEG_INF)
