#!/usr/bin/env python
"""Whether some multiprocessors are slower by themselves, from stored program traces.

Reads results files of ``scripts/program_timeline.py`` (gzipped or not; any
machine, no GPU) and, over the one-wave launches they hold (every program
started before the first one ended) on the named device, takes for each
launch and multiprocessor:

* ``speed``: the mean time of its programs over the launch's mean (1.05: its
  programs took 5% longer than the launch's average program);
* ``end``: its last program's end less the mean of the multiprocessors' last
  ends (us).

A multiprocessor slow in every launch is slow by itself only if it got other
work each time: the GPU often places a launch's programs as it did the last
time, and then gives each multiprocessor the same kinds of items again. So
per file it prints how often the placement repeated (the median share of the
used programs on the same multiprocessor in two of the file's launches), and
how well the file's per-multiprocessor speeds match the other files' (a
multiprocessor slow by itself is slow in every file, whatever the launch's
items). Then, over all files:

* ``agreement``: the correlation between the per-multiprocessor means over two
  halves of the launches (even and odd), for ``speed`` and for ``end``;
* the mean ``speed`` of every multiprocessor, by ID, 16 to a line;
* per launch, its span and the span had each multiprocessor's usual ``end``
  (the mean over the *other files'* launches, so a launch does not explain
  itself) been taken off its last end: what a plan that weighed its items by
  the multiprocessor they run on could win at most, if a program could know
  where it runs and its multiprocessor's end moved by its work alone.

    python scripts/sm_speeds.py --device H200 docs/results/program_timeline_*.json.gz
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.program_timeline import read_results, used_items  # noqa: E402


def launch_figures(run: dict, used, num_sms: int):
    """``(speed [num_sms], end [num_sms], last ends [num_sms])`` of one launch (NaN
    for a multiprocessor without a used program), or None if the launch was not one
    wave (a program started after another had ended)."""
    sm = np.asarray(run["sm"])
    start = np.asarray(run["start_us"], np.float64)
    end = np.asarray(run["end_us"], np.float64)
    used = np.asarray(used, bool)
    if not used.any() or start[used].max() >= end[used].min():
        return None
    dur = end - start
    speed = np.full(num_sms, np.nan)
    last = np.full(num_sms, np.nan)
    for i in range(num_sms):
        mine = used & (sm == i)
        if mine.any():
            speed[i] = dur[mine].mean()
            last[i] = end[mine].max()
    return speed / np.nanmean(speed), last - np.nanmean(last), last


def collect(paths, device: str, num_sms: int) -> list:
    """Every one-wave launch on ``device`` in ``paths``: dicts of ``file``,
    ``setting``, ``speed``, ``end``, ``last`` and ``sm`` (the used programs'
    multiprocessors, in item order)."""
    out = []
    for path in paths:
        data = read_results(path)
        if device not in data.get("device", ""):
            continue
        for res in data["results"]:
            used, _ = used_items(res)
            for run in res["runs"]:
                fig = launch_figures(run, used, num_sms)
                if fig is not None:
                    out.append({"file": os.path.basename(path), "setting": res["setting"],
                                "speed": fig[0], "end": fig[1], "last": fig[2],
                                "sm": np.asarray(run["sm"])[used]})
    return out


def agreement(values: np.ndarray) -> float:
    """Correlation of the per-column means of the even and the odd rows (NaN-aware;
    NaN with fewer than two rows)."""
    if len(values) < 2:
        return float("nan")
    a, b = np.nanmean(values[::2], 0), np.nanmean(values[1::2], 0)
    ok = ~(np.isnan(a) | np.isnan(b))
    return float(np.corrcoef(a[ok], b[ok])[0, 1]) if ok.sum() > 2 else float("nan")


def file_figures(launches: list) -> dict:
    """Per file: ``(launches, placement repeated, speed correlation with the other
    files, spread of its speeds)``. ``placement repeated``: the median, over pairs of
    the file's launches of one setting, of the share of used programs on the same
    multiprocessor in both (NaN with one launch a setting); the correlation is of
    the file's per-multiprocessor mean speeds with the other files' (NaN alone)."""
    out = {}
    for name in sorted({x["file"] for x in launches}):
        mine = [x for x in launches if x["file"] == name]
        same = [float(np.mean(a["sm"] == b["sm"]))
                for i, a in enumerate(mine) for b in mine[i + 1:]
                if a["setting"] == b["setting"] and a["sm"].shape == b["sm"].shape]
        own = np.nanmean([x["speed"] for x in mine], 0)
        other = [x["speed"] for x in launches if x["file"] != name]
        corr = float("nan")
        if other:
            rest = np.nanmean(other, 0)
            ok = ~(np.isnan(own) | np.isnan(rest))
            if ok.sum() > 2:
                corr = float(np.corrcoef(own[ok], rest[ok])[0, 1])
        out[name] = (len(mine), float(np.median(same)) if same else float("nan"), corr,
                     float(np.nanstd(own)))
    return out


def span_without_usual_ends(launches: list) -> list:
    """Per launch ``(span, span less each multiprocessor's usual end)``; the usual
    end is the mean over the launches of the other files (None where no other file
    has launches)."""
    usual = {}
    for name in {x["file"] for x in launches}:
        others = [x["end"] for x in launches if x["file"] != name]
        usual[name] = np.nan_to_num(np.nanmean(others, 0)) if others else None
    out = []
    for lk in launches:
        span, u = float(np.nanmax(lk["last"])), usual[lk["file"]]
        out.append((span, None if u is None else float(np.nanmax(lk["last"] - u))))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="program_timeline.py results files")
    p.add_argument("--device", default="H200", help="launches of devices whose name holds this")
    p.add_argument("--sms", type=int, default=132, help="the device's multiprocessors")
    a = p.parse_args()
    # a multiprocessor without programs in some launches is NaN there, by design
    warnings.simplefilter("ignore", RuntimeWarning)
    launches = collect(a.files, a.device, a.sms)
    if not launches:
        print(f"no one-wave launches on a device named like {a.device!r} in these files")
        return 1
    speed = np.array([x["speed"] for x in launches])
    ends = np.array([x["end"] for x in launches])
    files = sorted({x["file"] for x in launches})
    print(f"{len(launches)} one-wave launches on {a.device} in {len(files)} files")
    print(f"{'file':56s} {'launches':>8s} {'placement repeated':>18s} "
          f"{'speeds vs other files':>21s} {'spread':>6s}")
    for name, (n, same, corr, spread) in file_figures(launches).items():
        print(f"{name[:56]:56s} {n:8d} {same:18.2f} {corr:21.2f} {spread:6.3f}")
    print(f"agreement between halves of the launches: speed {agreement(speed):.2f}, "
          f"end {agreement(ends):.2f}")
    print(f"multiprocessors' ends (us) less the launch's mean: std "
          f"{np.nanmean(np.nanstd(ends, 1)):.2f} per launch; of their means over the "
          f"launches (the part that repeats) {np.nanstd(np.nanmean(ends, 0)):.2f}")
    mean_speed = np.nanmean(speed, 0)
    print("mean speed by multiprocessor ID (program time over the launch's mean):")
    for i in range(0, a.sms, 16):
        print(f"  {i:3d}  " + " ".join(f"{v:5.3f}" for v in mean_speed[i:i + 16]))
    fast = np.flatnonzero(mean_speed < 1)
    print(f"faster than the mean: {len(fast)} of {a.sms}")
    print(f"{'file':48s} {'setting':28s} {'span':>7s} {'less usual ends':>21s}")
    for x, (span, less) in zip(launches, span_without_usual_ends(launches)):
        less_s = "-" if less is None else f"{less:7.2f} ({span - less:+.2f})"
        print(f"{x['file'][:48]:48s} {x['setting'][:28]:28s} {span:7.2f} {less_s:>21s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
