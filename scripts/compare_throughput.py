#!/usr/bin/env python
"""Serving runs compared over the window they share.

In ``bench_throughput.py``'s workload every request arrives at once, so the
achieved batch, and with it the rate, changes over a run: a run that served 70 s
and one that served 100 s do not measure the same thing. This compares runs
(each ``bench_throughput.py`` JSON file, one run or several) over the first
``--window`` seconds (default: the shortest run's), from each run's
``batch_trace``; the first run is the baseline.

    python scripts/compare_throughput.py results/full/throughput.json \\
        results/diffkv/throughput.json

Traces of ``(seconds, running, tokens so far)`` give the exact tokens in the
window; older traces of ``(seconds, running)`` give an estimate (one token per
running request and step, scaled to the run's counted rate; marked ``~``).
"""

import argparse
import json
import sys


def window_rate(result: dict, seconds: float) -> tuple[float, bool]:
    """Generated tokens per second over the first ``seconds`` served of ``result``
    (a ``bench_throughput`` result), and whether that is exact (else estimated
    from the running counts). Raises ValueError if the run served less."""
    trace = result["batch_trace"]
    if not trace or result["wall_s"] < seconds - 1e-6:
        raise ValueError(f"{result['method']} served {result['wall_s']:.1f} s, "
                         f"less than the {seconds:.1f} s window")
    inside = [row for row in trace if row[0] <= seconds]
    if not inside:
        return 0.0, len(trace[0]) > 2
    if len(inside[-1]) > 2:
        return inside[-1][2] / seconds, True

    def running_rate(rows):
        return sum(row[1] for row in rows) / rows[-1][0]

    # One token per running request and step, scaled so that the whole run gives
    # its counted rate (rows still prefilling make no token; old traces' clocks
    # also ran through the profiled steps).
    return running_rate(inside) * result["tokens_per_s"] / running_rate(trace), False


def load(paths):
    runs = []
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        runs += data["results"] if "results" in data else [data["result"]]
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="bench_throughput.py JSON files")
    p.add_argument("--window", type=float, default=None,
                   help="seconds served to compare over (default: the shortest run's)")
    args = p.parse_args()
    runs = load(args.files)
    window = args.window or min(r["wall_s"] for r in runs)
    rates = [window_rate(r, window) for r in runs]
    base = rates[0][0]
    print(f"over the first {window:.1f} s served of each run:")
    print(f"{'method':28s} {'served':>7s} {'tok/s':>8s} {'vs first':>8s} "
          f"{'tok/s whole run':>16s}")
    for r, (rate, exact) in zip(runs, rates):
        mark = " " if exact else "~"
        print(f"{r['method']:28s} {r['wall_s']:6.1f}s {mark}{rate:7.0f} {rate / base:7.2f}x "
              f"{r['tokens_per_s']:16.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
