"""Decode attention of the cache methods through the Pallas kernels.

:func:`kernel_decode_step` is one layer of a DiffKV decode step on the GPU
path: one attention launch over both tiers straight from the packed pages
(:func:`kernel_decode_attention`, then an exact merge with the token being
decoded, kept in full precision), one launch of the policy's score update and
victim search (:mod:`pallas_kernels.policy_scores`), then the decision and the
writes of :meth:`~diffkv_jax.diffkv_cache.DiffKVCache.apply_decision`; the
plain-jnp path it must match is ``compressed_decode_attention`` +
``decode_update``. :func:`full_decode_attention` is the uncompressed cache's
counterpart (16-bit pages, no probabilities), so both methods run on equally
good kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import backend
from pallas_kernels import paged_decode as pdk

HI, LO = 0, 1
#: Work items of an attention launch on the GPU: about two waves of the eight
#: one-warp K8V4 programs each of an H200's 132 multiprocessors holds.
WORK_ITEMS = 2048


#: Decode programs a GPU multiprocessor holds at once, for :func:`pdk.plan_work`'s
#: ``wave`` (:func:`plan_wave`; None: off). The timings of the one-warp decode
#: programs fit 8 to a multiprocessor (1,056 on an H200; the ``triton`` package's
#: sm_90 compile of the two-tier launch reports 219 registers, room for 9; the
#: two-warp programs of :data:`QUANTIZED_WARPS` take 127, 8 again). With
#: items planned to fill one wave, uniform Llama3-8B batches of 32 rows take 0.207
#: instead of 0.241 ms at 16K (50/50 mix) and 0.068 instead of 0.085 ms at 4K, and
#: ragged engine-like batches 6 - 8% less (DiffKV) and 13 - 14% less (16-bit
#: pages) (docs/benchmarks.md 3.0.0f).
RESIDENT_PROGRAMS = 8


def plan_wave() -> int | None:
    """Work items the GPU runs at once: :data:`RESIDENT_PROGRAMS` per multiprocessor
    where the kernels run compiled on a GPU that reports its multiprocessors, else
    None (no wave: interpret mode runs one program at a time)."""
    if RESIDENT_PROGRAMS is None or not backend.on_gpu():
        return None
    cores = getattr(jax.devices()[0], "core_count", None)
    return RESIDENT_PROGRAMS * int(cores) if cores else None


def work_items(S: int, H: int) -> int:
    """Static work items of a launch over ``S x H`` rows (:func:`pdk.plan_work`).

    On the GPU enough that rows of any length mix split into items of about equal
    size that fill the multiprocessors; in interpret mode (programs run one after
    the other) one more than the rows, i.e. about one item per active row.
    """
    if backend.on_gpu():
        return max(WORK_ITEMS, 2 * S * H)
    return S * H + 1


#: Page lanes of the quantized launches by head dim (``LaunchConfig.page_lanes``),
#: as measured on the H200 (docs/benchmarks.md 3.0.0a): two lanes take a
#: Llama3-8B batch of 128 x 4K from 0.300 to 0.263 ms at the 50/50 tier mix; at
#: head dim 64 (SmolLM2) lanes slow the K4V2 pages down more than they speed the
#: K8V4 ones up.
PAGE_LANES = {128: 2}


def page_lanes(head_dim: int) -> int:
    """Page lanes of the quantized launches at ``head_dim`` (1 off the GPU)."""
    return PAGE_LANES.get(head_dim, 1) if backend.on_gpu() else 1


#: Warps per program of the quantized launches by head dim (``LaunchConfig.num_warps``;
#: 1 for the rest). At head dim 128 two warps hold 127 registers a thread instead
#: of about 200, the same 8 programs per multiprocessor, and a program with its
#: multiprocessor to itself walks its item in 16% less time: the launch's last
#: programs, which run with few others, end sooner (docs/benchmarks.md 3.0.0t).
QUANTIZED_WARPS = {128: 2}


def quantized_warps(head_dim: int) -> int:
    """Warps per program of the quantized launches at ``head_dim``."""
    return QUANTIZED_WARPS.get(head_dim, 1)


#: Work units per page of the high and low tiers in a DiffKV launch's work items
#: (``LaunchConfig.tier_weights``): the plan cuts rows into items of equal units,
#: so a tier whose pages take longer to walk counts them more. A K4V2 page (64
#: tokens) takes about twice a K8V4 page's time; counted once, the items holding
#: low pages ran longest and the launch waited for them. On the H200 (Llama3-8B
#: heads, docs/benchmarks.md 3.0.0e) weights 1 : 2 take the 50/50 mix at
#: 32 x 16K from 0.300 to 0.240 ms and at 32 x 4K from 0.095 to 0.084 ms
#: (1 : 1.5 and 1 : 2.5 in between; 128 x 4K unchanged).
TIER_WEIGHTS = {HI: 1, LO: 2}


#: Share of an item within which the plan moves a row's cut onto its tier boundary
#: (``pdk.plan_work(snap=)``; 0: off): under weights whose units do not split a row
#: at its boundary, the item across it walks a few pages of one tier and pays its
#: second loop's start for them.
TIER_SNAP = 0.0
#: Work units the plan counts for the second loop's start of an item that holds
#: both tiers of its row (``pdk.plan_work(gap=)``; 0: off): that item then holds
#: fewer pages. Below :func:`min_item_units` of the weights. Off: with 8 : 15
#: weights it gains the realistic mix about a point and costs the 50/50 mix as
#: much (docs/benchmarks.md 3.0.0v).
TIER_GAP = 0


def tier_weights(tiers=(HI, LO)) -> tuple:
    """:data:`TIER_WEIGHTS` of a launch's ``tiers`` in their order."""
    return tuple(TIER_WEIGHTS[t] for t in tiers)


def min_item_units(weights=(), pages: int = 2) -> int:
    """Work units a planned item holds at least (``pdk.plan_work``'s ``min_pages``):
    ``pages`` pages of the launch's lightest tier and one of its heaviest (``pages``
    pages where pages count once), so that an item of that many units holds a page (a
    page is the item's that holds its first unit) whatever the units per page."""
    return max(pages * min(weights, default=1), max(weights, default=1))


#: The value codes' slices left at their bit offsets in the quantized launches
#: (``LaunchConfig.values_in_place``: fewer instructions per token; with
#: :data:`LANE_META_SELECT` about 2 µs off a 32 x 4K launch on the H200).
VALUES_IN_PLACE = True
#: K4V2's 64-slot pages walked a page per step, half a page per lane
#: (``LaunchConfig.split_pages``; measured no faster, so off).
SPLIT_PAGES = False
#: Page lanes' metadata loaded once per lane and chosen per query column
#: (``LaunchConfig.lane_meta_select``).
LANE_META_SELECT = True


#: Work units a quantized launch's program takes at a time from its row's cursor once
#: it has walked its fixed share of the row (``LaunchConfig.row_chunk``; 0: off), and
#: the percent of each row handed out that way (``LaunchConfig.row_share``). The
#: cursors follow the merge counters in the caches' state (:func:`merge_counters`).
#: Off: 30% slower at 32 x 4K on an H100, its two-warp programs at 143 registers,
#: 6 per multiprocessor (docs/benchmarks.md 3.0.0w); planned for 6, or at one warp,
#: within a microsecond of the launch without cursors (3.0.0x).
ROW_CHUNK = 0
ROW_SHARE = 25


def row_chunk(early_row_loads: bool = False) -> int:
    """The quantized launches' ``LaunchConfig.row_chunk``: :data:`ROW_CHUNK`, or 0 with
    ``early_row_loads`` (the two do not combine)."""
    return 0 if early_row_loads else ROW_CHUNK


def merge_counters(S: int, H: int, early_row_loads: bool = False):
    """Zeroed merge counters (and :func:`row_chunk`'s cursors) of the caches' quantized
    launches over ``S x H`` rows, kept in the cache state from launch to launch."""
    return pdk.merge_counters(S, H, pdk.LaunchConfig(row_chunk=row_chunk(early_row_loads),
                                                     row_share=ROW_SHARE))


def _launch(emit_logits: bool, head_dim: int = 0, transposed: bool = False,
            weights: tuple = (), logits_dtype: str = "float16",
            early_row_loads: bool = False) -> pdk.LaunchConfig:
    """The caches' launch settings; ``head_dim`` 0: 16-bit pages (without page lanes
    or more warps); ``transposed``: the quantized pages' tokens as the dot tiles' rows
    (``LaunchConfig.transposed``; query rows padded by :func:`_tile_rows`);
    ``weights``: work units per page of each tier (:data:`TIER_WEIGHTS`);
    ``logits_dtype``: the policy's logits as stored; ``early_row_loads``: see
    :class:`pdk.LaunchConfig`."""
    gpu = backend.on_gpu()
    return pdk.LaunchConfig(dot_dtype="float16" if gpu else "float32", emit_logits=emit_logits,
                            num_warps=quantized_warps(head_dim) if head_dim else 1,
                            page_lanes=page_lanes(head_dim), transposed=transposed,
                            tier_weights=tuple(weights), logits_dtype=logits_dtype,
                            early_row_loads=early_row_loads,
                            values_in_place=VALUES_IN_PLACE, split_pages=SPLIT_PAGES,
                            lane_meta_select=LANE_META_SELECT,
                            row_chunk=row_chunk(early_row_loads) if head_dim else 0,
                            row_share=ROW_SHARE)


def _grouped_query(q, H: int):
    """``q [S, nq, D]`` as ``[S, H, G, D]`` (a view: the kernel converts it and pads
    the group to its tile rows in registers, :func:`_tile_rows`)."""
    S, nq, D = q.shape
    return q.reshape(S, H, nq // H, D)


def _tile_rows(G: int, transposed: bool = False) -> int | None:
    """Query rows of the decode kernel's tiles for a group of ``G``: the GPU dot needs
    16 rows, or 8 columns where the queries are the columns (``transposed``)."""
    if not backend.on_gpu():
        return pdk.padded_group(G, 8) if transposed else None
    return pdk.tile_rows(G, transposed)


def plan_full_work(lengths, active, page_size: int, H: int) -> pdk.WorkList:
    """Work list of the uncompressed cache's attention launches in a decode step: every
    layer's rows hold ``lengths [S]`` tokens, so one plan serves all layers
    (rows not ``active [S]`` get no item)."""
    S = lengths.shape[0]
    pages = jnp.broadcast_to((lengths.astype(jnp.int32) + page_size - 1) // page_size
                             * active, (H, S)).T
    return pdk.plan_work(pages, work_items(S, H), wave=plan_wave())


def full_decode_attention(q, k_pages, v_pages, page_ids, lengths, work: pdk.WorkList,
                          merge_in_launch: bool = False, counters=None,
                          early_row_loads: bool = False):
    """:func:`diffkv_jax.attention.paged_decode_attention` through the kernel.

    ``q [S, nq, D]``; ``k_pages, v_pages [P, page_size, D]``; ``page_ids [S, H, n]``;
    ``lengths [S]`` tokens to attend to; ``work``: :func:`plan_full_work` of the step
    (rows without items come out as zeros). ``merge_in_launch``: the work items
    merged by one launch (:func:`pallas_kernels.row_merge.merge_rows`), which writes
    the output in ``q``'s dtype, instead of XLA's segment reductions. Returns
    ``[S, nq, D]``, float32 (or ``q``'s dtype with ``merge_in_launch``).

    ``counters`` (``[S * H]`` int32 zeros): the attention launch merges its own rows
    instead (:func:`pdk.paged_decode_merged`, output in ``q``'s dtype), and
    ``(out, counters)`` is returned, the counters zero again for the next launch.
    ``early_row_loads``: :attr:`pdk.LaunchConfig.early_row_loads` (the same results).
    """
    S, nq, D = q.shape
    H = page_ids.shape[1]
    G = nq // H
    cfg = _launch(False, early_row_loads=early_row_loads)
    fmt = pdk.TierFormat(16, 16, D, k_pages.shape[1])
    ntok = jnp.broadcast_to(lengths[:, None], (S, H)).astype(jnp.int32)
    tier = pdk.TierInput(fmt, k_pages, v_pages, None, page_ids, ntok)
    if counters is not None:
        out, _, _, _, counters = pdk.paged_decode_merged(
            _grouped_query(q, H), [tier], work=work, counters=counters, group=G,
            cfg=cfg, out_dtype=q.dtype, padded_rows=_tile_rows(G))
        return out.reshape(S, nq, D), counters
    o, m, l, _ = pdk.paged_decode_partials(_grouped_query(q, H), [tier], group=G,
                                           cfg=cfg, work=work,
                                           padded_rows=_tile_rows(G))
    if merge_in_launch:
        from pallas_kernels.row_merge import merge_rows

        out = merge_rows(o, m, l, work, S, H, out_dtype=q.dtype)[0]
    else:
        out = pdk.merge_work(o, m, l, work, S, H)[0]
    return out.reshape(S, nq, D)


def plan_decode_work(method, state, active) -> pdk.WorkList:
    """Work lists of every layer's attention launch in a DiffKV decode step, from the
    rows' tier counts at the step's start (a layer's counts change only after its
    own attention): one computation for the whole step instead of one per layer.

    Returns a :class:`pdk.WorkList` whose arrays have a leading layer axis.
    """
    S, H = method.max_seqs, method.num_kv_heads
    n_tok = state.n_tok[:S].astype(jnp.int32)  # [S, L, H, 2]
    tiers = (HI, LO) if method.policy.low_tier else (HI,)
    units = [(n_tok[..., t] + method.cap(t) - 1) // method.cap(t) * TIER_WEIGHTS[t]
             for t in tiers]
    pages = jnp.where(active[:, None, None], sum(units), 0).transpose(1, 0, 2)  # [L, S, H]
    bounds = units[0].transpose(1, 0, 2)  # where each row's low pages start, in units
    N = work_items(S, H)
    weights = tier_weights(tiers)
    snap = TIER_SNAP if len(tiers) > 1 else 0.0
    gap = TIER_GAP if len(tiers) > 1 and not snap else 0

    def plan(p, b):
        w = pdk.plan_work(p, N, min_pages=min_item_units(weights), wave=plan_wave(),
                          bounds=b, snap=snap, max_weight=max(weights), gap=gap)
        return w.items, w.seg, w.ranges

    items, seg, ranges = jax.vmap(plan)(pages, bounds)
    return pdk.WorkList(items, seg, S * H, ranges)


def layer_work(work: pdk.WorkList, layer) -> pdk.WorkList:
    """One layer's work list from :func:`plan_decode_work`."""
    return pdk.WorkList(work.items[layer], work.seg[layer], work.num_rows,
                        None if work.ranges is None else work.ranges[layer])


def kernel_decode_attention(method, state, layer, q, k_new, v_new, n_hi: int, n_lo: int,
                            work: pdk.WorkList):
    """Attention of ``q [S, nq, D]`` over the layer's cached tiers plus ``k_new, v_new [S, H, D]``.

    ``n_hi`` / ``n_lo`` are the static numbers of pages read per row and tier;
    ``work`` the launch's work items (:func:`plan_decode_work` of this layer).
    Returns ``(out [S, nq, D], logits, pages, M, L, p_new)``: per tier present the
    kernel's logits (log2 units) and the page IDs it read, the merged softmax
    statistics ``[S, H, G]`` and the newcomer's own probability ``[S, H]``.
    """
    qg, (o, m, l, logits), pages = _tier_partials(method, state, layer, q, n_hi, n_lo, work)
    S, nq, D = q.shape
    H = method.num_kv_heads
    G = nq // H
    qr = qg[:, :, :G].astype(jnp.float32)
    s_new = jnp.einsum("shgd,shd->shg", qr, k_new.astype(jnp.float32)) / math.sqrt(D)
    v_ext = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, None], (S, H, G, D))
    out, M, L = pdk.merge_work(o, m, l, work, S, H, (v_ext, s_new, jnp.ones_like(s_new)))
    p_new = jnp.max(jnp.exp(s_new - M) / L, axis=-1)
    return out.reshape(S, nq, D), logits, pages, M, L, p_new


def _tier_partials(method, state, layer, q, n_hi: int, n_lo: int, work: pdk.WorkList,
                   padded_stats: bool = False, merged: bool = False):
    """The attention launch over the layer's cached tiers: ``(grouped queries,
    (o, m, l, logits), page IDs per tier)`` (:func:`pdk.paged_decode_partials`), or
    with ``merged`` ``(grouped queries, (o, m, l, logits, counters), page IDs)``:
    one unnormalized partial per row ``o [S, H, G, D]``, ``m, l [S, H, G]`` (rows
    without items unwritten) from the launch that merges its rows
    (:func:`pdk.paged_decode_merged`, counting on ``state.merge_counters``)."""
    S, nq, D = q.shape
    H = method.num_kv_heads
    G = nq // H
    lay = method.layout
    qg = _grouped_query(q, H)
    rows = state.page_table[:S, layer]  # [S, H, R]
    R = rows.shape[-1]
    tiers, pages, present = [], [], []
    for tier, width in ((HI, n_hi), (LO, n_lo)):
        if width == 0:
            continue
        present.append(tier)
        t = lay.tiers[tier]
        j = jnp.arange(width)
        cols = jnp.minimum(j, R - 1) if tier == HI else jnp.maximum(R - 1 - j, 0)
        fmt = pdk.TierFormat(t.k_bits, t.v_bits, D, lay.capacity(tier))
        keys, values = pdk.page_views(state.data, fmt)
        pages.append(rows[:, :, cols])
        tiers.append(pdk.TierInput(fmt, keys, values, (state.k_meta, state.v_meta), pages[-1],
                                   state.n_tok[:S, layer, :, tier]))
    tokens = method.token_tiles
    cfg = _launch(True, D, tokens, tier_weights(present), method.logits_dtype,
                  method.early_row_loads)
    if merged:
        parts = pdk.paged_decode_merged(qg, tiers, work=work, counters=state.merge_counters,
                                        group=G, cfg=cfg, padded_rows=_tile_rows(G, tokens),
                                        normalize=False, zero_empty=False)
        return qg, parts, pages
    parts = pdk.paged_decode_partials(qg, tiers, group=G, cfg=cfg, work=work,
                                      padded_stats=padded_stats,
                                      padded_rows=_tile_rows(G, tokens))
    return qg, parts, pages


def kernel_decode_step(method, state, layer, q, k_new, v_new, n_hi: int, n_lo: int, active,
                       work: pdk.WorkList):
    """One layer of a DiffKV decode step on the kernels: attention, then the policy's
    score accumulation and victim search (:mod:`pallas_kernels.policy_scores`), then
    the decision and the writes (:meth:`DiffKVCache.apply_decision`).

    Returns ``(state, out [S, nq, D])``.
    """
    from diffkv_jax import diffkv_policy as pol
    from pallas_kernels.policy_scores import RowPartials, no_victims, score_victims

    S, nq, D = q.shape
    H = method.num_kv_heads
    G = nq // H
    fused = method.merges_in_policy
    if fused and method.merges_in_attention:  # each row one partial, merged by the launch
        qg, (o, m, l, logits, counters), pages = _tier_partials(
            method, state, layer, q, n_hi, n_lo, work, merged=True)
        state = state.replace(merge_counters=counters)
        R = S * H
        # The policy launch folds each row's partial (none for rows without items)
        # with the newcomer.
        has = (work.ranges[:, 1] > 0).astype(jnp.int32)
        ranges = jnp.stack([jnp.arange(R, dtype=jnp.int32), has], axis=-1).reshape(S, H, 2)
        partials = RowPartials(o.reshape(R, G, D), m.reshape(R, G), l.reshape(R, G), ranges,
                               qg, k_new, v_new)
        M = L = None
    elif fused:  # the policy launch merges the partials (and the newcomer) itself
        qg, (o, m, l, logits), pages = _tier_partials(method, state, layer, q, n_hi, n_lo,
                                                      work, padded_stats=True)
        partials = RowPartials(o, m, l, work.ranges.reshape(S, H, 2), qg, k_new, v_new)
        M = L = None
    else:
        out, logits, pages, M, L, p_new = kernel_decode_attention(
            method, state, layer, q, k_new, v_new, n_hi, n_lo, work)
        partials = None
    caps = [method.cap(HI), method.cap(LO)][:len(pages)]
    n_tok = method.scoring_rows(state, layer, active)[:len(pages)]
    in_kernel = method.decides_in_kernel and len(pages) == 2
    scores, victims, *merged = score_victims(
        logits, M, L, pages, n_tok, state.seq_len[:S], state.prompt_len[:S], state.scores,
        state.positions, caps=caps, group=G, rule=pol.victim_rule(method.policy),
        merge=not in_kernel, partials=partials, lane_victims=method.lane_victims)
    if fused:
        out, _, _, p_new = merged[0]
        out = out.reshape(S, nq, D)
    if in_kernel:  # merge, decide and write in the token-writes launch
        state = method.decide_and_write(state.replace(scores=scores), layer, k_new, v_new,
                                        victims, p_new, active)
        return state, out
    if len(victims) == 1:  # no low tier: no low victim
        victims.append(no_victims(S, method.num_kv_heads))
    state = method.apply_decision(state.replace(scores=scores), layer, k_new, v_new, victims,
                                  p_new, active)
    return state, out
