#!/usr/bin/env python
"""Where one decode launch's time goes: when each program starts and ends, on which
multiprocessor, on one GPU.

Runs the caches' decode launch (the same case, settings and work plan as
``scripts/bench_attention.py``) with :attr:`LaunchConfig.trace_programs`, for
each of ``--settings``, ``--repeats`` times after a warm-up, and summarizes
each trace (:func:`summarize`):

* ``span``: first program start to last program end (the launch's own time,
  less the gap before its first program);
* ``last start``: when the last program began (a one-wave launch starts every
  program at once; later starts are a second wave or a slow ramp);
* ``prolog``, ``loops``, ``epilog``: the median program's time before its
  first tier's loop (its row, range and query loaded), in its loops, and after
  them (its stores and, in the launch that merges its rows, the merge), from the
  multiprocessor's cycle counter;
* ``fixed``, ``per unit``: a least-squares fit of each program's time to the
  work units it walked (``LaunchConfig.tier_weights``): the cost of a work item
  that does not grow with its pages, and the cost of a page (NaN where every
  item has the same units);
* ``tail``: from the median program end to the last;
* ``merge``: in the launch that merges its own rows (``m=last``), the mean
  epilogue of the programs that merged a row less the others';
* ``busy``: the programs' summed time over ``span`` x the most programs that ran
  at once (1: every slot busy from the first start to the last end);
* ``early``, ``late``: the mean time of the programs placed in the first and the
  second half of their multiprocessor's programs (in index order);
* ``SM end``: each multiprocessor's last program end, mean and max over the
  multiprocessors (the max is the span);
* ``balanced``: the span if every multiprocessor kept the rate at which it did
  its own work (its items' units over its time, first start to its last end)
  and the units were shared so that all of them ended together: the most that
  sharing the work out as the launch runs could win, with no cost for moving
  it (:func:`balanced_span`);
* last, the programs running at each whole microsecond of the first launch of
  each setting (the ramp and the tail at a glance).

    python scripts/program_timeline.py --batch 32 --context 4096 --variant diffkv-mix
    python scripts/program_timeline.py --settings "m=rows;m=last;m=last,el=1;m=last,wave=528"
    python scripts/program_timeline.py --stored docs/results/program_timeline_mix_32x4k_2026-12-05.json.gz

Compiled launches only (the clocks are the GPU's special registers); ``--stored``
prints the table again from a results file (gzipped or not), on any machine,
with the figures an older file lacks computed from its programs' times. Both
print how much the multiprocessors' ends repeat between a setting's launches
(:func:`sm_end_agreement`): a multiprocessor that ends late in every launch is
slow by itself or by the kind of items the GPU keeps giving it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.paged_decode import TRACE_COLUMNS  # noqa: E402


def _since(x, ref):
    """``x - ref`` for 32-bit clock readings (int64, the wrap undone; within +-2 s)."""
    return (x.astype(np.int64) - int(ref) + 2**31) % 2**32 - 2**31


def summarize(trace, units, used) -> dict:
    """The figures of one traced launch.

    Args:
      trace: ``[N, C]`` int32 (:data:`pallas_kernels.paged_decode.TRACE_COLUMNS`).
      units: ``[N]`` work units each item walked (``end - begin`` of its work item).
      used: ``[N]`` bool, the items with work (unused items end at once).
    Returns:
      A dict of times in microseconds (see the module's docstring): the launch's
      ``span_us`` and the like from the global timer; each program's phases from
      its multiprocessor's cycle counter at the clock rate measured against the
      timer (``clock_ghz``): ``prologue`` (start to the first loop), ``loops``
      (first loop's start to the last loop's end), ``epilogue`` (to the end:
      stores, the row's merge), their medians as ``*_us`` and per item as
      ``items_us``; the fit ``fixed_us + per_unit_us x units`` of the programs'
      times (NaN where every item has the same units); per-multiprocessor program
      counts; per item ``start_us`` / ``end_us`` / ``sm``.
    """
    trace, units, used = np.asarray(trace), np.asarray(units, np.float64), np.asarray(used)
    if trace.shape[1] != len(TRACE_COLUMNS) or not used.any():
        raise ValueError(f"need a [N, {len(TRACE_COLUMNS)}] trace with at least one used item")
    col = {name: trace[:, i] for i, name in enumerate(TRACE_COLUMNS)}
    ref = col["start_ns"][used][0]
    start, end = _since(col["start_ns"], ref), _since(col["end_ns"], ref)
    t0 = start[used].min()
    start, end = (start - t0) / 1e3, (end - t0) / 1e3  # microseconds from the first start
    dur = end - start

    def cycles(a, b):
        return (col[f"{b}_cycles"].astype(np.int64) - col[f"{a}_cycles"]) % 2**32

    s, e, d, u, sm = start[used], end[used], dur[used], units[used], col["sm"][used]
    busy_ns = float(np.sum(d)) * 1e3
    ghz = float(np.sum(cycles("start", "end")[used])) / busy_ns if busy_ns > 0 else float("nan")
    phases = {"prologue": cycles("start", "loop") / ghz / 1e3,
              "loops": cycles("loop", "loop_end") / ghz / 1e3,
              "epilogue": cycles("loop_end", "end") / ghz / 1e3}
    span = float(e.max())
    # Programs running at once, sampled at every start (the most is reached at one).
    at_once = int(max(np.sum((s <= t) & (e > t)) for t in s))
    design = np.stack([np.ones_like(u), u], axis=1)
    (fixed, per_unit), *_ = np.linalg.lstsq(design, d, rcond=None)
    if np.ptp(u) == 0:  # equal items: the split into fixed and per-unit is unknown
        fixed, per_unit = float("nan"), float("nan")
    ids, counts = np.unique(sm, return_counts=True)
    # Each program's place among its multiprocessor's programs (the GPU places them
    # in index order): the first half against the second half of its resident ones.
    place = np.zeros(len(sm), int)
    for i in ids:
        place[sm == i] = np.arange(int(np.sum(sm == i)))
    late = place >= int(counts.max()) // 2
    out = {
        "items": int(used.sum()),
        "multiprocessors": int(ids.size),
        "programs_per_sm": {"min": int(counts.min()), "max": int(counts.max())},
        "most_at_once": at_once,
        "span_us": span,
        "last_start_us": float(s.max()),
        "first_end_us": float(e.min()),
        "median_end_us": float(np.median(e)),
        "tail_us": float(e.max() - np.median(e)),
        "duration_us": {"min": float(d.min()), "median": float(np.median(d)),
                        "max": float(d.max())},
        "fixed_us": float(fixed),
        "per_unit_us": float(per_unit),
        "busy": busy_ns / 1e3 / (span * at_once) if span > 0 else float("nan"),
        "clock_ghz": ghz,
        "early_us": float(np.mean(d[~late])) if (~late).any() else float("nan"),
        "late_us": float(np.mean(d[late])) if late.any() else float("nan"),
    }
    # Programs running at each whole microsecond of the span: the ramp and the tail.
    marks = np.arange(int(np.ceil(span)) + 1)
    out["running_per_us"] = [int(np.sum((s <= t) & (e > t))) for t in marks]
    out.update({f"{k}_us": float(np.median(v[used])) for k, v in phases.items()})
    out["items_us"] = {k: v.tolist() for k, v in phases.items()}
    out.update({"start_us": start.tolist(), "end_us": end.tolist(), "sm": col["sm"].tolist()})
    out.update(sm_balance(start, end, col["sm"], units, used))
    return out


def sm_ends(end, sm, used) -> dict:
    """Each multiprocessor's last program end (us), by multiprocessor ID."""
    end, sm, used = np.asarray(end, np.float64), np.asarray(sm), np.asarray(used, bool)
    return {int(i): float(end[used & (sm == i)].max()) for i in np.unique(sm[used])}


def balanced_span(start, end, sm, units, used) -> float:
    """The span (us, from the first start) had every multiprocessor kept its own rate,
    its items' units over its time (first start to its last end), and the units
    been shared so that all of them ended together: ``sum(units) / sum(rates)``
    (NaN without units). A bound on what sharing the work out as the launch runs
    can win: moving work costs nothing here."""
    start, sm = np.asarray(start, np.float64), np.asarray(sm)
    units, used = np.asarray(units, np.float64), np.asarray(used, bool)
    t0, total, rate = start[used].min(), 0.0, 0.0
    for i, last_end in sm_ends(end, sm, used).items():
        mine = units[used & (sm == i)].sum()
        total += mine
        rate += mine / max(last_end - t0, 1e-9)
    return float(total / rate) if rate > 0 else float("nan")


def sm_balance(start, end, sm, units, used) -> dict:
    """The multiprocessors' last ends (``sm_end_us``: mean, min and max over them)
    and :func:`balanced_span` (``balanced_us``)."""
    ends = np.array(list(sm_ends(end, sm, used).values()))
    return {"sm_end_us": {"min": float(ends.min()), "mean": float(ends.mean()),
                          "max": float(ends.max())},
            "balanced_us": balanced_span(start, end, sm, units, used)}


def sm_end_agreement(runs, used) -> float:
    """The mean correlation, over pairs of launches of one setting (:func:`summarize`'s
    dicts; ``used [N]`` their work list's used items), of the multiprocessors' last
    ends (the multiprocessors both ran programs on); NaN with fewer than two
    launches. Near 1: the same multiprocessors end last in every launch, slow by
    themselves or by the kind of items the GPU keeps giving them (it places the
    programs differently in every launch, but may keep their mix)."""
    ends = [sm_ends(r["end_us"], r["sm"], used) for r in runs]
    corr = []
    for a in range(len(ends)):
        for b in range(a + 1, len(ends)):
            ids = sorted(set(ends[a]) & set(ends[b]))
            x = np.array([ends[a][i] for i in ids])
            y = np.array([ends[b][i] for i in ids])
            if len(ids) > 2 and np.std(x) > 0 and np.std(y) > 0:
                corr.append(float(np.corrcoef(x, y)[0, 1]))
    return float(np.mean(corr)) if corr else float("nan")


def merge_excess(summary: dict, used, seg) -> float:
    """The mean epilogue (us) of the items that merged their rows (each row of several
    items: its last to end) less that of the other used items: in the launch that
    merges its own rows, the cost of folding a row (NaN without such rows)."""
    used, seg = np.asarray(used), np.asarray(seg)
    end = np.asarray(summary["end_us"])
    epilogue = np.asarray(summary["items_us"]["epilogue"])
    merging = np.zeros(len(used), bool)
    for row in np.unique(seg[used]):
        idx = np.flatnonzero(used & (seg == row))
        if idx.size > 1:
            merging[idx[np.argmax(end[idx])]] = True
    other = used & ~merging
    if not merging.any() or not other.any():
        return float("nan")
    return float(np.mean(epilogue[merging]) - np.mean(epilogue[other]))


def tail_split(items, seg, num_rows: int, percent: int):
    """A work list's used items each cut in two, the last ``percent`` of its units
    apart: every item's first part, then every item's last part, then the unused
    items (``(items, seg)``, numpy). The GPU starts programs in order, so the last
    parts run in the slots the first parts free, whichever end first. A row's items
    are then not consecutive: a launch of partials only (``m=rows``), whose merge
    this order does not fit (a timing of the launch, not its outputs)."""
    items, seg = np.asarray(items), np.asarray(seg)
    used = seg < num_rows
    head, tail = items[used].copy(), items[used].copy()
    cut = head[:, 3] - (head[:, 3] - head[:, 2]) * percent // 100
    head[:, 3], tail[:, 2] = cut, cut
    keep = tail[:, 3] > tail[:, 2]
    new_items = np.concatenate([head, tail[keep], items[~used]])
    new_seg = np.concatenate([seg[used], seg[used][keep], seg[~used]])
    return new_items.astype(np.int32), new_seg.astype(np.int32)


#: ``ord=`` settings: the order the launch runs a work list's used items in.
ORDERS = ("row", "index", "mixed")


def reorder_items(items, seg, num_rows: int, order: str, high_units):
    """A work list's used items in another order, the unused ones after them
    (``(items, seg)``, numpy). The GPU starts programs in order and places program
    ``i`` on multiprocessor ``i mod SMs``, so with rows of four items and 132
    multiprocessors each multiprocessor gets items of one kind (3.0.0i):

    * ``row``: as planned (every row's items together);
    * ``index``: every row's first item, then every row's second, ... (each
      multiprocessor then gets items from several places in their rows);
    * ``mixed``: items holding both tiers first, then those of high pages only,
      then those of low pages only (the kinds that took longest first), each kind
      in row order.

    ``high_units [num_rows]``: the high tier's units of each row (the items' units
    below it are high pages). A launch of partials only (``m=rows``): the row
    merge after it needs a row's items together."""
    items, seg = np.asarray(items), np.asarray(seg)
    used = np.flatnonzero(seg < num_rows)
    if order == "row":
        key = np.zeros(len(used))
    elif order == "index":
        rows = seg[used]  # a row's items are together: index = position - row's first
        if (np.diff(rows) < 0).any():
            raise ValueError("ord=index needs the planned order (rows in order)")
        key = np.arange(len(used)) - np.searchsorted(rows, rows)
    elif order == "mixed":
        hi = np.asarray(high_units)[seg[used]]
        begin, end = items[used, 2], items[used, 3]
        key = np.where((begin < hi) & (end > hi), 0, np.where(end <= hi, 1, 2))
    else:
        raise ValueError(f"unknown order {order!r}; one of {ORDERS}")
    new = np.concatenate([used[np.argsort(key, kind="stable")],
                          np.flatnonzero(seg >= num_rows)])
    return items[new].astype(np.int32), seg[new].astype(np.int32)


def grade_items(items, seg, num_rows: int, percent: int):
    """A work list whose rows' odd items (second, fourth, ...) hold ``percent``% fewer
    units than their even ones, the even items first and the odd after them (the
    unused last; ``(items, seg)``, numpy).

    The GPU places program ``i`` on multiprocessor ``i mod SMs`` in index order, and
    a one-warp program placed in the second half of a multiprocessor's resident
    programs ran 8% longer on the H200 than one in the first half, at every shape
    (3.0.0k: the multiprocessor's schedulers each hold one program of each half and
    favour the older). This tries lighter items there. Each row's units are cut in
    proportion (an even item 100, an odd one ``100 - percent``), so every page is
    still in one item of its row. On an H100 it did not pay (3.0.0k): the heavier
    items took longer, and the lighter ones about as long as before. A launch of
    partials only (``m=rows``): the row merge after it needs a row's items together."""
    items, seg = np.asarray(items).copy(), np.asarray(seg)
    used = np.flatnonzero(seg < num_rows)
    rows = seg[used]
    if (np.diff(rows) < 0).any():
        raise ValueError("grading needs the planned order (rows in order)")
    first = np.searchsorted(rows, rows)
    k = np.arange(len(used)) - first  # the item's place in its row
    odd = k % 2 == 1
    share = np.where(odd, 100 - percent, 100).astype(np.int64)
    done = np.cumsum(share) - share  # shares before the item, over all rows
    row_done = done - done[first]  # ... within its row
    total = np.zeros(num_rows, np.int64)
    np.add.at(total, rows, share)
    begin_row = items[used[first], 2].astype(np.int64)  # the row's first unit (0)
    end_row = np.zeros(num_rows, np.int64)
    np.maximum.at(end_row, rows, items[used, 3])
    units = end_row[rows] - begin_row
    b = begin_row + units * row_done // total[rows]
    e = begin_row + units * (row_done + share) // total[rows]
    items[used, 2], items[used, 3] = b, e
    new = np.concatenate([used[~odd], used[odd], np.flatnonzero(seg >= num_rows)])
    return items[new].astype(np.int32), seg[new].astype(np.int32)


def parse_settings(text: str) -> list[dict]:
    """``"m=rows,el=0;m=last,wave=528"`` -> one dict per launch setting: ``merge``
    ("rows" or "last"), ``early`` (0 or 1), ``wave`` (-1: the caches' plan_wave(),
    0: off), ``items`` (0: the caches' count), ``stages`` / ``warps`` (0: the
    caches'), ``tail`` (0: no split, :func:`tail_split`), ``low_weight`` (0: the
    caches' weights), ``order`` ("row": as planned, :func:`reorder_items`), ``snap``
    (percent of an item within which a row's cut moves onto its tier boundary,
    ``plan_work(snap=)``; 0: off), ``gap`` (units the item across a row's tier
    boundary holds fewer, ``plan_work(gap=)``; 0: the caches'), ``grade`` (percent
    fewer units of the rows' odd items, run after the even ones:
    :func:`grade_items`; 0: off), ``row_chunk`` / ``row_share`` (units per chunk a
    row's cursor hands out as the launch runs, and the percent of the row it hands
    out: ``LaunchConfig.row_chunk`` / ``row_share``; 0: off / 25)."""
    keys = {"m": "merge", "el": "early", "wave": "wave", "n": "items", "st": "stages",
            "nw": "warps", "tail": "tail", "tw": "low_weight", "ord": "order", "sn": "snap",
            "gp": "gap", "yg": "grade", "rc": "row_chunk", "rs": "row_share"}
    words = {"m": ("rows", "last"), "el": ("0", "1"), "ord": ORDERS}
    out = []
    for part in text.split(";"):
        setting = {"merge": "rows", "early": 0, "wave": -1, "items": 0, "stages": 0,
                   "warps": 0, "tail": 0, "low_weight": 0, "order": "row", "snap": 0,
                   "gap": 0, "grade": 0, "row_chunk": 0, "row_share": 25}
        for item in filter(None, part.split(",")):
            k, _, val = item.partition("=")
            if k not in keys or (val not in words[k] if k in words else not val.isdigit()):
                raise SystemExit(f"--settings: unknown setting {item!r} (m=rows|last, "
                                 "el=0|1, wave=N, n=N, st=N, nw=N, tail=P, tw=N, "
                                 "ord=row|index|mixed, sn=P, gp=N, yg=P, rc=N, rs=P)")
            setting[keys[k]] = val if k in ("m", "ord") else int(val)
        if setting["tail"] and (setting["merge"] != "rows" or setting["tail"] >= 100):
            raise SystemExit(f"--settings: tail={setting['tail']} needs m=rows and a "
                             "percentage under 100")
        if setting["order"] != "row" and (setting["merge"] != "rows" or setting["tail"]):
            raise SystemExit(f"--settings: ord={setting['order']} needs m=rows (and no "
                             "tail=)")
        if setting["grade"] and (setting["merge"] != "rows" or setting["tail"]
                                 or setting["order"] != "row" or setting["grade"] >= 50):
            raise SystemExit(f"--settings: yg={setting['grade']} needs m=rows (no tail= or "
                             "ord=) and a percentage under 50")
        if setting["snap"] >= 50:
            raise SystemExit(f"--settings: sn={setting['snap']} must be a percentage under 50")
        if setting["snap"] and setting["gap"]:
            raise SystemExit("--settings: sn= and gp= cannot be combined")
        if setting["row_chunk"] and (setting["tail"] or setting["order"] != "row"
                                     or setting["grade"] or setting["early"]):
            raise SystemExit(f"--settings: rc={setting['row_chunk']} walks the plan's rows "
                             "(no tail=, ord=, yg= or el=1)")
        if setting["row_share"] > 100:
            raise SystemExit(f"--settings: rs={setting['row_share']} must be a percentage")
        out.append(setting)
    return out


def label(setting: dict) -> str:
    """The setting as ``--settings`` names it (defaults left out, but the merge and
    early loads)."""
    wave = {-1: "", 0: ",wave=off"}.get(setting["wave"], f",wave={setting['wave']}")
    rest = "".join(f",{k}={setting[name]}" for k, name in
                   (("n", "items"), ("st", "stages"), ("nw", "warps"), ("tail", "tail"),
                    ("tw", "low_weight"), ("sn", "snap"), ("gp", "gap"), ("yg", "grade"),
                    ("rc", "row_chunk"))
                   if setting[name])
    if setting["row_chunk"]:
        rest += f",rs={setting['row_share']}"
    if setting["order"] != "row":
        rest += f",ord={setting['order']}"
    return f"m={setting['merge']},el={setting['early']}{wave}{rest}"


def print_table(device: str, args: dict, nbytes: int, results: list) -> None:
    """The summary table of ``results`` (main's, or a stored file's), then the programs
    running at each microsecond of each setting's first launch."""
    print(f"device {device}; {args['model']} B={args['batch']} N={args['context']} "
          f"{args['variant']}/{args['tiles']}; {nbytes / 1e6:.1f} MB read; times in us; "
          "merge: the epilogue of the items that merged a row beyond the others'; SM end: "
          "the multiprocessors' last ends, mean / max; balanced: the span with the work "
          "shared out at each multiprocessor's own rate; agreement: the correlation of "
          "the multiprocessors' ends between a setting's launches")
    width = max(len(r["setting"]) for r in results)
    print(f"{'setting':{width}s} {'items':>5s} {'span':>7s} {'last st':>7s} {'1st end':>7s} "
          f"{'med end':>7s} {'tail':>6s} {'prolog':>6s} {'loops':>6s} {'epilog':>6s} "
          f"{'fixed':>6s} {'/unit':>6s} {'busy':>5s} {'at once':>7s} {'per SM':>7s} "
          f"{'GHz':>5s} {'early':>6s} {'late':>6s} {'SM end':>11s} {'balanced':>8s} "
          f"{'merge':>6s}")
    for res in results:
        for r in res["runs"]:
            per_sm = f"{r['programs_per_sm']['min']}-{r['programs_per_sm']['max']}"
            merge = r.get("merge_excess_us")
            sm_end = f"{r['sm_end_us']['mean']:5.1f}/{r['sm_end_us']['max']:5.1f}"
            print(f"{res['setting']:{width}s} {r['items']:5d} {r['span_us']:7.2f} "
                  f"{r['last_start_us']:7.2f} {r['first_end_us']:7.2f} "
                  f"{r['median_end_us']:7.2f} {r['tail_us']:6.2f} {r['prologue_us']:6.2f} "
                  f"{r['loops_us']:6.2f} {r['epilogue_us']:6.2f} {r['fixed_us']:6.2f} "
                  f"{r['per_unit_us']:6.3f} {r['busy']:5.2f} {r['most_at_once']:7d} "
                  f"{per_sm:>7s} {r['clock_ghz']:5.2f} {r.get('early_us', float('nan')):6.2f} "
                  f"{r.get('late_us', float('nan')):6.2f} {sm_end:>11s} "
                  f"{r['balanced_us']:8.2f} " + ("" if merge is None else f"{merge:6.2f}"))
    if any("kinds" in res for res in results):
        print("programs' times by what their items hold (" + " / ".join(KINDS)
              + "; items, mean us):")
        for res in results:
            for times in (kind_times(res) if "kinds" in res else []):
                print(f"{res['setting']:{width}s} "
                      + "  ".join(f"{n:4d} {t:6.2f}" for n, t in times))
    print("multiprocessors' ends, agreement between launches (mean pairwise correlation):")
    for res in results:
        print(f"{res['setting']:{width}s} {res['sm_end_agreement']:5.2f}")
    print("programs running at each microsecond (each setting's first launch):")
    for res in results:
        print(f"{res['setting']:{width}s} "
              + " ".join(str(n) for n in res["runs"][0]["running_per_us"]))


#: What an item holds of its row's tiers (:func:`item_kinds`), by code.
KINDS = ("high only", "both tiers", "low only")


def item_kinds(items, high_units, H: int) -> list:
    """Per work item ``(s, h, begin, end)``, what it holds of its row's two tiers
    (``high_units [S * H]``: where each row's low pages start): 0 its high pages
    only, 1 both tiers, 2 its low pages only; -1 for an unused item."""
    items = np.asarray(items)
    b = np.asarray(high_units).reshape(-1)[items[:, 0] * H + items[:, 1]]
    begin, end = items[:, 2], items[:, 3]
    kind = np.where(end <= b, 0, np.where(begin >= b, 2, 1))
    return np.where(end > begin, kind, -1).tolist()


def kind_times(result: dict) -> list:
    """Per launch of a stored setting with :func:`item_kinds`, each kind's
    ``(items, mean time from start to end in us)``."""
    kinds = np.asarray(result["kinds"])
    out = []
    for r in result["runs"]:
        d = np.asarray(r["end_us"]) - np.asarray(r["start_us"])
        out.append([(int(np.sum(kinds == k)),
                     float(np.mean(d[kinds == k])) if np.any(kinds == k) else float("nan"))
                    for k in range(len(KINDS))])
    return out


def used_items(result: dict):
    """A stored setting's ``(used, units)`` per item. Files that lack the work items
    (the earliest) count each launch's first ``items`` items used (a plan's used
    items come first) and one unit each (a one-wave plan's items are within a unit
    or two of each other)."""
    if "items" in result:
        items = np.asarray(result["items"])
        return items[:, 3] > items[:, 2], items[:, 3] - items[:, 2]
    n, used_count = len(result["runs"][0]["end_us"]), result["runs"][0]["items"]
    return np.arange(n) < used_count, np.ones(n)


def read_results(path: str) -> dict:
    """A results file of this script as written (gzipped or not)."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def load_stored(path: str) -> dict:
    """A results file of this script (gzipped or not), each setting's launches given
    the figures an older file lacks (:func:`sm_balance`) and the setting its
    ``sm_end_agreement``."""
    data = read_results(path)
    for res in data["results"]:
        used, units = used_items(res)
        for r in res["runs"]:
            if "balanced_us" not in r:
                r.update(sm_balance(r["start_us"], r["end_us"], r["sm"], units, used))
        res["sm_end_agreement"] = sm_end_agreement(res["runs"], used)
    stored_kinds(data)
    return data


def stored_kinds(data: dict) -> None:
    """:func:`item_kinds` for a stored file's settings that hold their work items but
    not their kinds (files from before kinds were recorded), from the case rebuilt
    on this machine: the same random pages as on the GPU, whose token counts set
    the rows' tier boundaries. Settings whose programs took chunks of their rows
    (``row_chunk``) have none: what a program walked is not its item's range."""
    a = data["args"]
    todo = [res for res in data["results"]
            if "kinds" not in res and "items" in res and "launch" in res
            and not res["launch"].get("row_chunk")]
    if a["variant"] not in ("diffkv-50/50", "diffkv-mix") or not todo:
        return
    import jax

    from pallas_kernels import paged_decode as pdk
    from scripts.decode_cases import SHAPES, random_case

    _, H, D = SHAPES[a["model"]]
    tiers, _ = random_case(jax.random.fold_in(jax.random.PRNGKey(0), 1), a["variant"],
                           a["batch"], H, D, a["context"])
    for res in todo:
        weights = tuple(res["launch"].get("tier_weights") or ())
        res["kinds"] = item_kinds(res["items"], np.asarray(pdk.tier_bounds(tiers, weights)), H)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", choices=("llama3-8b", "smollm2-135m"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--variant", default="diffkv-mix",
                   choices=("ours-bf16", "int8", "diffkv-high", "diffkv-50/50", "diffkv-mix"))
    p.add_argument("--tiles", default="tokens", choices=("queries", "tokens"),
                   help="the quantized pages' dot tiling (LaunchConfig.transposed for tokens)")
    p.add_argument("--settings", default="m=rows",
                   help="';'-separated launch settings, each a ','-list of m=rows|last (the "
                        "launch of partials, its merge launch not traced, or the launch that "
                        "merges its own rows), el=0|1 (LaunchConfig.early_row_loads), wave=N "
                        "(items planned to run at once; 0: off; default the caches' "
                        "plan_wave()), n=N (work items; default the caches' count), st=N / "
                        "nw=N (pipeline stages / warps; default the caches'), tail=P (every "
                        "item's last P%% as a second item, m=rows), tw=N (low pages N units, "
                        "high 8), ord=row|index|mixed (the order the items run in, m=rows: "
                        "reorder_items), sn=P (a row's cut within P%% of an item of its tier "
                        "boundary moves onto it), gp=N (units the item across a row's tier "
                        "boundary holds fewer), yg=P (the rows' odd items P%% lighter, run "
                        "after the even ones, m=rows: grade_items)")
    p.add_argument("--repeats", type=int, default=5, help="traced launches after a warm-up")
    p.add_argument("--json", default="results/program_timeline.json")
    p.add_argument("--stored", metavar="FILE",
                   help="print the table of a results file of this script instead (no GPU)")
    args = p.parse_args()
    if args.stored:
        data = load_stored(args.stored)
        print_table(data["device"], data["args"], data["bytes"], data["results"])
        return 0
    settings = parse_settings(args.settings)

    import jax
    import jax.numpy as jnp

    from diffkv_jax.diffkv_kernel_attention import (HI, LO, TIER_GAP, _launch, min_item_units,
                                                    plan_wave, tier_weights, work_items)
    from pallas_kernels import backend
    from pallas_kernels import paged_decode as pdk
    from scripts.decode_cases import SHAPES, random_case

    nq, H, D = SHAPES[args.model]
    G, S = nq // H, args.batch
    mix = "bf16" if args.variant == "ours-bf16" else args.variant
    key = jax.random.PRNGKey(0)
    tiers, nbytes = random_case(jax.random.fold_in(key, 1), mix, S, H, D, args.context)
    q = jax.random.normal(jax.random.fold_in(key, 2), (S, H, G, D), jnp.bfloat16)
    transposed = args.tiles == "tokens" and mix != "bf16"
    base_weights = tier_weights((HI, LO)[:len(tiers)])
    device = jax.devices()[0].device_kind

    def plan(setting):
        """(cfg, wave, n_items, high, work) of one setting."""
        weights = base_weights
        if setting["low_weight"]:  # the high tier's pages count 8
            if len(weights) != 2:
                raise SystemExit(f"--settings: tw= weighs the low tier's pages; "
                                 f"{args.variant} has one tier")
            weights = (8, setting["low_weight"])
        cfg = _launch(emit_logits=mix.startswith("diffkv"),
                      head_dim=0 if mix == "bf16" else D, transposed=transposed,
                      weights=weights, early_row_loads=bool(setting["early"]))
        cfg = dataclasses.replace(cfg, num_stages=setting["stages"] or cfg.num_stages,
                                  num_warps=setting["warps"] or cfg.num_warps,
                                  row_chunk=setting["row_chunk"],
                                  row_share=setting["row_share"])
        wave = plan_wave() if setting["wave"] < 0 else (setting["wave"] or None)
        n_items = setting["items"] or work_items(S, H)
        high = pdk.tier_bounds(tiers, weights)  # each row's high units
        work = pdk.plan_work(pdk.row_pages(tiers, weights=weights), n_items,
                             min_pages=min_item_units(weights), wave=wave, bounds=high,
                             snap=setting["snap"] / 100 if len(tiers) > 1 else 0.0,
                             max_weight=max(weights),
                             gap=(setting["gap"] or (0 if setting["snap"] else TIER_GAP))
                             if len(tiers) > 1 else 0)

        def relisted(new, rows=work.num_rows):  # (items, seg) as numpy -> a work list
            return pdk.WorkList(jnp.asarray(new[0]), jnp.asarray(new[1]), rows)

        if setting["tail"]:
            work = relisted(tail_split(work.items, work.seg, work.num_rows, setting["tail"]))
        if setting["order"] != "row":
            work = relisted(reorder_items(work.items, work.seg, work.num_rows,
                                          setting["order"], high.reshape(-1)))
        if setting["grade"]:
            work = relisted(grade_items(work.items, work.seg, work.num_rows, setting["grade"]))
        return cfg, wave, n_items, high, work

    # every setting planned before the first launch: one the planner refuses stops the
    # run before any GPU time is spent on the others
    plans = []
    for setting in settings:
        try:
            plans.append(plan(setting))
        except ValueError as err:
            raise SystemExit(f"--settings {label(setting)}: {err}") from None
    if not backend.on_gpu():
        print("program_timeline.py reads the GPU's clocks: it needs a GPU", file=sys.stderr)
        return 2
    results = []
    for setting, (cfg, wave, n_items, high, work) in zip(settings, plans):
        merged = setting["merge"] == "last"
        traced = jax.jit(lambda q, tiers, work, cfg=cfg, merged=merged: pdk.program_trace(
            q, tiers, work=work, group=G, cfg=cfg, padded_rows=pdk.tile_rows(G, transposed),
            merged=merged))
        items = np.asarray(work.items)
        seg = np.asarray(work.seg)
        units, used = items[:, 3] - items[:, 2], seg < work.num_rows
        np.asarray(traced(q, tiers, work))  # compile and warm up
        runs = []
        for _ in range(args.repeats):
            summary = summarize(np.asarray(traced(q, tiers, work)), units, used)
            if cfg.row_chunk:  # the programs walked what they took, not their items' units
                summary.update(fixed_us=float("nan"), per_unit_us=float("nan"),
                               balanced_us=float("nan"))
            if merged:
                summary["merge_excess_us"] = merge_excess(summary, used, seg)
            runs.append(summary)
        results.append({"setting": label(setting), "wave": wave, "work_items": n_items,
                        "launch": dataclasses.asdict(cfg), "items": items.tolist(),
                        **({"kinds": item_kinds(items, high, H)}
                           if len(tiers) == 2 and not cfg.row_chunk else {}),
                        "runs": runs, "sm_end_agreement": sm_end_agreement(runs, used)})
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:  # after every setting: a run cut short keeps them
            json.dump({"device": device, "args": vars(args), "bytes": nbytes,
                       "results": results}, fh)
    print_table(device, vars(args), nbytes, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
