"""Score accumulation and victim search of the tiering policy, one launch per layer.

After the decode attention of a layer, every cached token's score grows by the
probability it just received (max over the query heads of its GQA group), and
each (sequence, KV head) row needs its *victim* per tier: the token the
policy would demote or evict. One program per row walks the row's pages of
each tier once: it turns the attention kernel's logits into probabilities
(``exp2(logit - M) / L`` with the merged softmax statistics), adds them to
the scores in place, and keeps the lexicographic minimum of ``(key, tie,
slot)`` over the eligible tokens, where by rule

* ``"diffkv"``: key = importance (score / counted queries, as
  :func:`diffkv_jax.diffkv_policy.query_counts`), tie = slot; high tier
  eligible outside the newest ``window`` positions, low tier always;
* ``"h2o"``: key = raw score, tie = position, outside the newest ``window``;
* ``"streamingllm"``: key = 0, tie = position (the oldest), positions >= ``sinks``;
* ``"snapkv"``: no token is eligible (it never evicts at decode).

This replaces a chain of XLA gathers, reductions and scatters over every
slot a row could hold with one pass over the slots it does hold.
:func:`score_victims_reference` is the plain-jnp version it is tested against.
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

from diffkv_jax.diffkv_policy import query_counts
from pallas_kernels import backend
from pallas_kernels.paged_decode import LOG2E, NEG_INF

BIG = 2**30
#: Programs per row on the GPU: a long row's pages are shared by this many, so the
#: launch does not wait for one program to walk the longest row alone.
SPLITS = 4


@dataclasses.dataclass(frozen=True)
class VictimRule:
    """Static policy settings the victim search needs."""

    rule: str = "diffkv"
    window: int = 64
    sinks: int = 4
    obs_window: int | None = 64

    def key_tie_eligible(self, tier: int, score, pos, slot, valid, prompt_len, cur):
        """Per-slot ``(key, tie, eligible)`` of the victim search in ``tier``."""
        if self.rule == "diffkv":
            eligible = valid & ((pos <= cur - self.window) if tier == 0 else True)
            return score / query_counts(self, pos, prompt_len, cur), slot, eligible
        if tier != 0 or self.rule == "snapkv":
            return score, slot, valid & False
        if self.rule == "h2o":
            return score, pos, valid & (pos <= cur - self.window)
        return jnp.zeros_like(score), pos, valid & (pos >= self.sinks)  # streamingllm


def _lexmin(key, tie, slot, eligible, axis=None):
    """Lexicographic minimum of ``(key, tie, slot)`` over the eligible entries along
    ``axis`` (all axes when None): ``(key, tie, slot)`` of it, ``slot == BIG`` when
    nothing is eligible. Kernel and reference share it."""
    key = jnp.where(eligible, key, jnp.inf)
    kmin = jnp.min(key, axis=axis, keepdims=axis is not None)
    is_k = eligible & (key == kmin)
    tmin = jnp.min(jnp.where(is_k, tie, BIG), axis=axis, keepdims=axis is not None)
    smin = jnp.min(jnp.where(is_k & (tie == tmin), slot, BIG), axis=axis)
    return kmin, tmin, smin


def no_victims(S: int, H: int):
    """The victims of a tier a row cannot hold: none (slot -1)."""
    return (jnp.full((S, H), -1, jnp.int32), jnp.full((S, H), jnp.inf),
            jnp.zeros((S, H), jnp.int32), jnp.zeros((S, H), jnp.float32))


def _merge_row(rng_ref, q_ref, kn_ref, vn_ref, o_ref, pm_ref, pl_ref, rows, group: int,
               with_out):
    """The row's exact attention merge (flash-decoding) inside the policy launch: its
    work items' partials ``o, m, l`` (consecutive items ``rng = (first, count)``),
    then the token being decoded (logit ``q . k_new / sqrt(D)``, value ``v_new``).
    Returns ``(out [Gq, D], M [Gq], L [Gq], p_new)`` as :func:`paged_decode.merge_work`
    with its ``extra``, and the newcomer's probability (max over the group).

    Every split of a row needs ``M`` and ``L`` (the max and sum pass reads only
    ``m, l``); only the split with ``with_out`` (traced bool) reads the items'
    outputs, in a second pass at the final max (elsewhere ``out`` is not defined).
    """
    D = q_ref.shape[-1]
    dcol = lax.broadcasted_iota(jnp.int32, (D,), 0)
    first, count = rng_ref[0], rng_ref[1]

    def stats(j, carry):
        mx, lx = carry
        mi, li = pm_ref[first + j, rows], pl_ref[first + j, rows]
        mn = jnp.maximum(mx, mi)
        return mn, lx * jnp.exp(mx - mn) + li * jnp.exp(mi - mn)

    Gq = rows.shape[0]
    mx, lx = lax.fori_loop(0, count, stats, (jnp.full((Gq,), NEG_INF, jnp.float32),
                                             jnp.zeros((Gq,), jnp.float32)))

    def outputs(j, ox):
        w = first + j
        oi = o_ref[w, rows[:, None], dcol[None, :]]
        return ox + oi * jnp.exp(pm_ref[w, rows] - mx)[:, None]

    ox = lax.fori_loop(0, jnp.where(with_out, count, 0), outputs,
                       jnp.zeros((Gq, D), jnp.float32))
    q = q_ref[rows[:, None], dcol[None, :]].astype(jnp.float32)
    s_new = jnp.sum(q * kn_ref[...].astype(jnp.float32)[None, :], axis=1) / math.sqrt(D)
    M = jnp.maximum(mx, s_new)
    a, b = jnp.exp(mx - M), jnp.exp(s_new - M)
    L = lx * a + b
    out = (ox * a[:, None] + vn_ref[...].astype(jnp.float32)[None, :] * b[:, None]) / L[:, None]
    p_new = jnp.max(b / L)
    return out, M, L, p_new


def _kernel(*refs, caps: tuple[int, ...], widths: tuple[int, ...], rule: VictimRule,
            group: int, block: int, splits: int, interpret: bool, fused: bool,
            lane_victims: bool):
    n_t = len(caps)
    n_in = 7 if fused else 2
    stats_refs, (row_ref, pos_ref, sc_in) = refs[:n_in], refs[n_in:n_in + 3]
    lg_refs = refs[n_in + 3:n_in + 3 + n_t]
    page_refs = refs[n_in + 3 + n_t:n_in + 3 + 2 * n_t]
    sc_ref, vi_ref, vf_ref, *merged_refs = refs[n_in + 3 + 2 * n_t:]
    del sc_in  # aliased with sc_ref
    n_tok = [row_ref[t] for t in range(n_t)]
    cur, prompt_len = row_ref[n_t], row_ref[n_t + 1]
    # Row indices of the group (the GPU pads loads to a power of two by repeating the
    # last real row, which leaves the max over rows unchanged).
    Gq = group if interpret else pl.next_power_of_2(group)
    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (Gq,), 0), group - 1)
    split = pl.program_id(2)
    if fused:
        out, M, L, p_new = _merge_row(*stats_refs, rows, group, with_out=split == 0)
        M2 = M * LOG2E
        out_ref, st_ref = merged_refs
        # Every split of the row computes M and L (its probabilities need them) and
        # stores them (the same values); the first split alone merges and stores out.
        if interpret:
            @pl.when(split == 0)
            def _():
                out_ref[...] = out.astype(out_ref.dtype)
        else:
            from jax.experimental.pallas import triton as plgpu

            mask = (lax.broadcasted_iota(jnp.int32, out.shape, 0) < group) & (split == 0)
            plgpu.store(out_ref.at[rows, pl.ds(0, out.shape[1])], out.astype(out_ref.dtype),
                        mask=mask)
        g_iota = lax.broadcasted_iota(jnp.int32, (Gq,), 0)
        pick = lambda x, g: jnp.sum(jnp.where(g_iota == g, x, 0.0))  # noqa: E731
        st_ref[...] = _lanes([pick(M, g) for g in range(group)]
                             + [pick(L, g) for g in range(group)] + [p_new], jnp.float32)
    else:
        m_ref, l_ref = stats_refs
        M2, L = m_ref[rows], l_ref[rows]
    inv_l = 1.0 / L
    ints, floats = [], []
    for t, (cap, width) in enumerate(zip(caps, widths)):
        lg_ref, pages_ref = lg_refs[t], page_refs[t]
        n = min(block, pl.next_power_of_2(width * cap))  # tokens per step, whole pages
        lane = lax.broadcasted_iota(jnp.int32, (n,), 0)
        row_pages = (n_tok[t] + cap - 1) // cap

        def body(j, best, t=t, cap=cap, width=width, n=n, lg_ref=lg_ref, pages_ref=pages_ref,
                 lane=lane, row_pages=row_pages):
            bk, bt, bs, bp, bsc = best
            slot = j * n + lane
            col = jnp.minimum(slot, width * cap - 1)
            page_idx = slot // cap
            # [n] (each page cap times). Lanes past the row's pages may name no page
            # (the table's entry past the pool): their reads stay inside it.
            page = jnp.minimum(pages_ref[jnp.minimum(page_idx, width - 1)],
                               sc_ref.shape[0] - 1)
            within = slot % cap
            lg = lg_ref[rows[:, None], col[None, :]].astype(jnp.float32)  # [Gq, n]
            p = jnp.max(jnp.exp2(lg - M2[:, None]) * inv_l[:, None], axis=0)
            valid = slot < n_tok[t]
            old = sc_ref[page, within]
            score = jnp.where(valid, old + p, old)
            # Only the row's own pages are written (columns past them may name pages
            # that other rows own).
            owned = page_idx < row_pages
            if interpret:  # lanes past the row's pages scatter out of bounds (dropped)
                sc_ref[jnp.where(owned, page, sc_ref.shape[0]), within] = score
            else:
                from jax.experimental.pallas import triton as plgpu

                plgpu.store(sc_ref.at[page, within], score, mask=owned)
            pos = pos_ref[page, within]
            key, tie, elig = rule.key_tie_eligible(t, score, pos, slot, valid, prompt_len, cur)
            if lane_victims:  # each lane keeps its own best; one reduction after the loop
                key = jnp.where(elig, key, jnp.inf)
                tie, slot = jnp.where(elig, tie, BIG), jnp.where(elig, slot, BIG)
                better = (key < bk) | ((key == bk) & ((tie < bt) | ((tie == bt) & (slot < bs))))
                return (jnp.where(better, key, bk), jnp.where(better, tie, bt),
                        jnp.where(better, slot, bs), jnp.where(better, pos, bp),
                        jnp.where(better, score, bsc))
            kmin, tmin, smin = _lexmin(key, tie, slot, elig)
            pick = slot == smin
            pmin = jnp.sum(jnp.where(pick, pos, 0))
            scmin = jnp.sum(jnp.where(pick, score, 0.0))
            better = (kmin < bk) | ((kmin == bk) & ((tmin < bt) | ((tmin == bt) & (smin < bs))))
            better = better & (smin < BIG)
            return (jnp.where(better, kmin, bk), jnp.where(better, tmin, bt),
                    jnp.where(better, smin, bs), jnp.where(better, pmin, bp),
                    jnp.where(better, scmin, bsc))

        # This split's share of the row's steps (splits of a long row run in parallel).
        steps = (n_tok[t] + n - 1) // n
        per = (steps + splits - 1) // splits
        first = jnp.minimum(split * per, steps)
        init = (jnp.float32(jnp.inf), jnp.int32(BIG), jnp.int32(BIG), jnp.int32(0),
                jnp.float32(0.0))
        if lane_victims:
            init = tuple(jnp.full((n,), x) for x in init)
        bk, bt, bs, bp, bsc = lax.fori_loop(first, jnp.minimum(first + per, steps), body, init)
        if lane_victims:  # the lexicographic minimum over the lanes' own
            kmin, tmin, smin = _lexmin(bk, bt, bs, bs < BIG)
            pick = bs == smin
            bk, bt, bs = kmin, tmin, smin
            bp = jnp.sum(jnp.where(pick, bp, 0))
            bsc = jnp.sum(jnp.where(pick, bsc, 0.0))
        ints += [bs, bt, bp]
        floats += [bk, bsc]
    # Partial victims of this split: ints (slot, tie, pos), floats (key, score) per tier.
    vi = _lanes(ints, jnp.int32)
    vf = _lanes(floats, jnp.float32)
    vi_ref[...] = vi
    vf_ref[...] = vf


def _lanes(values, dtype):
    """Scalars as one vector (the Triton lowering stores vectors, not scalars, of a
    power-of-two length: padded with zeros)."""
    n = pl.next_power_of_2(len(values))
    lane = lax.broadcasted_iota(jnp.int32, (n,), 0)
    out = jnp.zeros((n,), dtype)
    for i, v in enumerate(values):
        out = jnp.where(lane == i, v, out)
    return out


@dataclasses.dataclass(frozen=True)
class RowPartials:
    """What the policy launch needs to do the attention merge itself
    (``score_victims(..., partials=...)``): the attention launch's per-item ``o [N,
    >= G, D]``, ``m, l [N, >= G]`` (``paged_decode_partials(..., padded_stats=True)``),
    each row's ``ranges [S, H, 2]`` (first item, item count: ``WorkList.ranges``), and
    the token being decoded: grouped queries ``q [S, H, >= G, D]``, ``k_new, v_new [S,
    H, D]``."""

    o: jax.Array
    m: jax.Array
    l: jax.Array
    ranges: jax.Array
    q: jax.Array
    k_new: jax.Array
    v_new: jax.Array


def score_victims(logits: Sequence[jax.Array], M, L, pages: Sequence[jax.Array],
                  n_tok: Sequence[jax.Array], cur, prompt_len, scores, positions, *,
                  caps: Sequence[int], group: int, rule: VictimRule = VictimRule(),
                  block: int = 512, splits: int | None = None, num_warps: int = 4,
                  num_stages: int = 2, interpret: bool | None = None, merge: bool = True,
                  partials: RowPartials | None = None, lane_victims: bool = False):
    """Add this step's probabilities to the scores and find each row's victims.

    Args:
      logits: per tier ``[S, H, >= group, W_t * cap_t]`` log2-unit logits of the
        attention kernel (float16 or float32; the probabilities are taken in float32).
      M, L: ``[S, H, >= group]`` merged softmax max (natural units) and normalizer.
      pages: per tier ``[S, H, W_t]`` page IDs; n_tok: per tier ``[S, H]`` tokens held
        (0 for rows that must not change).
      cur, prompt_len: ``[S]`` position of the token being decoded and prompt length.
      scores, positions: the ``[P, >= max(caps)]`` side arrays (scores are updated
        in place when donated).
      block: tokens a program handles per step (whole pages, gathered by page ID).
      splits: programs per row, each over an equal share of the row's steps (their
        victims are merged after the launch); default 4 on the GPU, 1 otherwise.
      merge: False returns the splits' partial victims ``(vi, vf)`` instead (for
        :func:`merge_victims`, or a kernel that merges them itself).
      partials: the attention launch's partials (:class:`RowPartials`): the launch
        merges them with the token being decoded itself, one XLA chain of segment
        reductions fewer per layer; ``M`` and ``L`` are then None.
      lane_victims: each of a block's lanes keeps its own best candidate across the
        loop's steps, and the block's lanes are reduced once per tier after it,
        instead of a reduction across the lanes (five of them) in every step. The
        same victims (the lexicographic minimum of the same set).
    Returns:
      ``(scores, victims)``; ``victims`` per tier ``(slot, key, pos, score)``, each
      ``[S, H]``: the victim's slot in the row's tier (-1 when none is eligible),
      its key, position and updated score. With ``partials`` also ``(out [S, H, G,
      D], M, L [S, H, G], p_new [S, H])``: the attention output (in ``q``'s dtype,
      computed in float32), the merged softmax
      statistics and the newcomer's probability, as
      :func:`paged_decode.merge_work` with the newcomer as its ``extra``.
    """
    if interpret is None:
        interpret = backend.default_interpret()
    if splits is None:
        splits = 1 if interpret else SPLITS
    S, H = n_tok[0].shape
    n_t = len(caps)
    K = splits
    row = jnp.stack([*[n.astype(jnp.int32) for n in n_tok],
                     jnp.broadcast_to(cur[:, None], (S, H)).astype(jnp.int32),
                     jnp.broadcast_to(prompt_len[:, None], (S, H)).astype(jnp.int32)], -1)
    whole = lambda a: pl.BlockSpec(a.shape, lambda s, h, k: (0,) * a.ndim)  # noqa: E731
    per_row = lambda a: pl.BlockSpec((None, None) + a.shape[2:],  # noqa: E731
                                     lambda s, h, k: (s, h) + (0,) * (a.ndim - 2))
    if partials is None:
        M2 = (M[:, :, :group] * LOG2E).astype(jnp.float32)
        Lg = L[:, :, :group].astype(jnp.float32)
        stats, stat_specs = [M2, Lg], [per_row(M2), per_row(Lg)]
    else:
        if M is not None or L is not None:
            raise ValueError("with partials the launch merges M and L itself: pass None")
        pt = partials
        stats = [pt.ranges.astype(jnp.int32), pt.q, pt.k_new, pt.v_new, pt.o, pt.m, pt.l]
        stat_specs = [*[per_row(x) for x in stats[:4]], *[whole(x) for x in stats[4:]]]
    args = [*stats, row, positions, scores, *logits, *[p.astype(jnp.int32) for p in pages]]
    in_specs = [*stat_specs, per_row(row), whole(positions), whole(scores),
                *[per_row(x) for x in logits], *[per_row(p) for p in pages]]
    n_int, n_float = pl.next_power_of_2(3 * n_t), pl.next_power_of_2(2 * n_t)
    out_shape = [jax.ShapeDtypeStruct(scores.shape, scores.dtype),
                 jax.ShapeDtypeStruct((S, H, K, n_int), jnp.int32),
                 jax.ShapeDtypeStruct((S, H, K, n_float), jnp.float32)]
    split_out = lambda w: pl.BlockSpec((None, None, None, w), lambda s, h, k: (s, h, k, 0))  # noqa
    out_specs = [whole(scores), split_out(n_int), split_out(n_float)]
    if partials is not None:
        D = partials.q.shape[-1]
        n_stat = pl.next_power_of_2(2 * group + 1)
        # The row outputs in q's dtype: the model's next op takes that dtype (a
        # separate conversion launch per layer otherwise).
        out_shape += [jax.ShapeDtypeStruct((S, H, group, D), partials.q.dtype),
                      jax.ShapeDtypeStruct((S, H, n_stat), jnp.float32)]
        out_specs += [pl.BlockSpec((None, None, group, D), lambda s, h, k: (s, h, 0, 0)),
                      pl.BlockSpec((None, None, n_stat), lambda s, h, k: (s, h, 0))]
    kernel = functools.partial(_kernel, caps=tuple(caps),
                               widths=tuple(p.shape[-1] for p in pages), rule=rule, group=group,
                               block=block, splits=K, interpret=interpret,
                               fused=partials is not None, lane_victims=lane_victims)
    new_scores, vi, vf, *merged = pl.pallas_call(
        kernel, grid=(S, H, K), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={len(stats) + 2: 0}, interpret=interpret,
        compiler_params=None if interpret else backend.compiler_params(num_warps, num_stages),
        name="policy_scores",
    )(*args)
    victims = (vi, vf) if not merge else merge_victims(vi, vf, n_t)
    if partials is None:
        return new_scores, victims
    out, st = merged
    return new_scores, victims, (out, st[..., :group], st[..., group:2 * group],
                                 st[..., 2 * group])


def merge_victims(vi, vf, n_tiers: int):
    """Each row's victims from its splits' partial victims (``score_victims(...,
    merge=False)``): ``vi [S, H, K, >= 3 n]`` ints (slot, tie, pos per tier), ``vf [S, H,
    K, >= 2 n]`` floats (key, score per tier). Returns per tier ``(slot, key, pos,
    score)`` ``[S, H]`` as :func:`score_victims`."""
    return [pick_victim(vi[..., 3 * t], vi[..., 3 * t + 1], vi[..., 3 * t + 2],
                        vf[..., 2 * t], vf[..., 2 * t + 1], axis=-1) for t in range(n_tiers)]


def pick_victim(slot, tie, pos, key, score, axis=None):
    """A row's victim of one tier from its splits' partial victims (``slot == BIG``:
    none in that split), reduced along ``axis`` (all axes when None, as inside a
    kernel): the lexicographic minimum of ``(key, tie, slot)``, as
    ``(slot or -1, key, pos, score)``."""
    kmin, _, smin = _lexmin(key, tie, slot, slot < BIG, axis=axis)
    if axis is not None:
        kmin = jnp.squeeze(kmin, axis)
    pick = slot == (smin if axis is None else jnp.expand_dims(smin, axis))
    return (jnp.where(smin < BIG, smin, -1), kmin, jnp.sum(jnp.where(pick, pos, 0), axis=axis),
            jnp.sum(jnp.where(pick, score, 0.0), axis=axis))


def score_victims_reference(probs: Sequence[jax.Array], pages: Sequence[jax.Array],
                            n_tok: Sequence[jax.Array], cur, prompt_len, scores, positions, *,
                            caps: Sequence[int], rule: VictimRule = VictimRule()):
    """Plain-jnp :func:`score_victims` from per-slot probabilities ``[S, H, W_t * cap_t]``."""
    new_scores, victims = scores, []
    for t, (p, pg, nt, cap) in enumerate(zip(probs, pages, n_tok, caps)):
        S, H, W = pg.shape
        if W == 0:  # a tier the row cannot hold (e.g. the low tier switched off)
            victims.append(no_victims(S, H))
            continue
        slot = jnp.arange(W * cap)
        ids = jnp.repeat(pg, cap, axis=-1)
        within = jnp.broadcast_to(jnp.tile(jnp.arange(cap), W), ids.shape)
        valid = slot < nt[..., None]
        old = scores[ids, within]
        sc = jnp.where(valid, old + p, old)
        pos = positions[ids, within]
        key, tie, elig = rule.key_tie_eligible(t, sc, pos, slot, valid, prompt_len[:, None, None],
                                               cur[:, None, None])
        _, _, idx = _lexmin(key, tie, slot, elig, axis=-1)
        found = idx < BIG
        i = jnp.minimum(idx, W * cap - 1)[..., None]
        take = lambda a: jnp.take_along_axis(a, i, axis=-1)[..., 0]  # noqa: E731
        key = jnp.where(elig, key, jnp.inf)
        victims.append((jnp.where(found, idx, -1), jnp.where(found, take(key), jnp.inf),
                        jnp.where(found, take(pos), 0), jnp.where(found, take(sc), 0.0)))
        # Pages past the row's tokens are left alone (only owned pages are written).
        owned = (jnp.arange(W) < -(-nt // cap)[..., None])
        wpages = jnp.where(owned, pg, scores.shape[0])
        rows = sc.reshape(S, H, W, cap)
        new_scores = new_scores.at[wpages[..., None], jnp.arange(cap)].set(rows, mode="drop")
    return new_scores, victims
