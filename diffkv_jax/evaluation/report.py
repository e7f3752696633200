"""Human-readable outputs of an evaluation: markdown tables, the Pareto front, plots.

Inputs are the `Summary` / `PairRecord` records of `metrics` (or their
`to_dict()` dicts, e.g. read back from a JSON file). Plots are drawn on
matplotlib `Figure` objects with the Agg canvas directly instead of through
pyplot, so importing this module never switches the process-wide backend and
works on machines without a display.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .metrics import FULL_METHOD

DEFAULT_COLUMNS: tuple[str, ...] = (
    "method", "dataset", "count", "mean_score", "n_negative", "negative_rate",
    "mean_memory_ratio", "mean_D", "p90_abs_D", "longer_1_5x_rate",
    "exact_match_rate", "latency_p50", "latency_p99")
"""Columns of `markdown_table` by default: the spec asks for the negative-sample
count next to every average, and for measured memory."""

HEADERS: dict[str, str] = {
    "count": "n",
    "mean_score": "score",
    "mean_full_score": "full score",
    "n_negative": "negative",
    "negative_rate": "negative %",
    "exact_match_rate": "exact match",
    "mean_memory_ratio": "memory vs 16-bit",
    "mean_D": "mean D",
    "p10_D": "p10 D",
    "p90_D": "p90 D",
    "mean_abs_D": "mean abs D",
    "p90_abs_D": "p90 abs D",
    "longer_1_5x_rate": ">=1.5x longer",
    "latency_p50": "latency p50 (s)",
    "latency_p90": "latency p90 (s)",
    "latency_p99": "latency p99 (s)",
}
"""Display names of summary fields; unknown columns use their field name."""


def _get(row: Any, name: str) -> Any:
    if isinstance(row, dict):
        return row.get(name)
    return getattr(row, name, None)


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_value(name: str, value: Any) -> str:
    """Format one cell by its column name: rates, ratios and scores as percentages,
    D as a signed percentage, latencies in seconds, NaN/None as `n/a`."""
    if _is_missing(value):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if name == "D" or name.endswith("_D"):
            # D's sign says longer (-) or shorter (+); |D| has none to show.
            return f"{100 * v:.1f}%" if "abs" in name else f"{100 * v:+.1f}%"
        if name.endswith(("_rate", "ratio", "score")):
            return f"{100 * v:.1f}%"
        if name.startswith("latency") or name.endswith("_s"):
            return f"{v:.3f}"
        return f"{v:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(summary_rows: Iterable[Any],
                   columns: Sequence[str | tuple[str, str]] = DEFAULT_COLUMNS) -> str:
    """A GitHub markdown table of the rows, in the given column order.

    columns: field names, or (field, header) pairs to override `HEADERS`.
    Text columns are left-aligned, numbers right-aligned.
    """
    cols = [(c, HEADERS.get(c, c)) if isinstance(c, str) else (c[0], c[1]) for c in columns]
    rows = list(summary_rows)
    header = "| " + " | ".join(h.replace("|", "\\|") for _, h in cols) + " |"

    def numeric(name: str) -> bool:
        vals = [_get(r, name) for r in rows if not _is_missing(_get(r, name))]
        return bool(vals) and all(isinstance(v, (int, float, np.number)) for v in vals)

    align = "|" + "|".join("---:" if numeric(n) else ":---" for n, _ in cols) + "|"
    body = ["| " + " | ".join(format_value(n, _get(r, n)) for n, _ in cols) + " |" for r in rows]
    return "\n".join([header, align, *body]) + "\n"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated (memory_ratio, quality) points, ascending.

    Lower memory and higher quality are better. A point is dominated when
    another is at least as good on both and strictly better on one; equal
    points do not dominate each other, so duplicates on the front all stay.
    Points with a NaN coordinate are never on the front.
    """
    pts = [(float(m), float(q)) for m, q in points]
    ok = [not (math.isnan(m) or math.isnan(q)) for m, q in pts]
    front = []
    for i, (m, q) in enumerate(pts):
        if not ok[i]:
            continue
        dominated = any(ok[j] and m2 <= m and q2 >= q and (m2 < m or q2 > q)
                        for j, (m2, q2) in enumerate(pts) if j != i)
        if not dominated:
            front.append(i)
    return front


# --------------------------------------------------------------------------- plots


def _new_figure(title: str, xlabel: str, ylabel: str):
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _no_data(ax) -> None:
    # An empty plot still gets written, so a report never has a dangling image link.
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    return path


def _methods(records: Iterable[Any]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        seen.setdefault(_get(r, "method"), None)
    return list(seen)


def plot_accuracy_vs_memory(summary_rows: Iterable[Any], path: str | os.PathLike, *,
                            quality: str = "mean_score") -> str:
    """Scatter of quality against memory ratio, one labelled point per row.

    With several datasets each point is labelled "method (dataset)" and each
    dataset's Pareto front is drawn as a dashed line.
    """
    rows = [r for r in summary_rows
            if not (_is_missing(_get(r, "mean_memory_ratio")) or _is_missing(_get(r, quality)))]
    fig, ax = _new_figure("Quality vs KV memory", "KV memory / 16-bit KV", quality)
    datasets = list(dict.fromkeys(_get(r, "dataset") for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(_methods(rows))}
    for ds in datasets:
        group = [r for r in rows if _get(r, "dataset") == ds]
        pts = [(_get(r, "mean_memory_ratio"), _get(r, quality)) for r in group]
        for r, (x, y) in zip(group, pts):
            method = _get(r, "method")
            label = f"{method} ({ds})" if len(datasets) > 1 else method
            ax.scatter([x], [y], color=colors[method])
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = sorted((pts[i] for i in pareto_front(pts)), key=lambda p: p[0])
        if len(front) > 1:
            ax.plot(*zip(*front), linestyle="--", color="gray", linewidth=1)
    if not rows:
        _no_data(ax)
    return _save(fig, path)


def plot_length_change_hist(pairs: Iterable[Any], path: str | os.PathLike, *,
                            full_method: str = FULL_METHOD, bins: int = 30) -> str:
    """Histogram of the response-length change D per method (full left out: D = 0).

    All methods share the same bins; D < 0 (left of the line at 0) is longer.
    """
    pairs = [p for p in pairs if _get(p, "method") != full_method]
    fig, ax = _new_figure("Response-length change D = (L_full - L) / L_full",
                          "D  (< 0: longer than uncompressed)", "samples")
    per_method = {m: np.asarray([_get(p, "D") for p in pairs if _get(p, "method") == m
                                 and not _is_missing(_get(p, "D"))], dtype=np.float64)
                  for m in _methods(pairs)}
    per_method = {m: d for m, d in per_method.items() if d.size}
    if per_method:
        allD = np.concatenate(list(per_method.values()))
        lo, hi = float(allD.min()), float(allD.max())
        if lo == hi:  # a single value still needs a bin of non-zero width
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, bins + 1)
        for i, (m, d) in enumerate(per_method.items()):
            ax.hist(d, bins=edges, histtype="step", linewidth=1.5, color=f"C{i % 10}", label=m)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.legend()
    else:
        _no_data(ax)
    return _save(fig, path)


def plot_latency_cdf(pairs: Iterable[Any], path: str | os.PathLike) -> str:
    """Empirical CDF of end-to-end request latency per method (full included)."""
    pairs = list(pairs)
    fig, ax = _new_figure("End-to-end latency", "latency (s)", "fraction of requests")
    drawn = 0
    for i, m in enumerate(_methods(pairs)):
        lat = np.sort(np.asarray([_get(p, "latency_s") for p in pairs if _get(p, "method") == m
                                  and not _is_missing(_get(p, "latency_s"))], dtype=np.float64))
        if lat.size == 0:
            continue
        frac = np.arange(1, lat.size + 1) / lat.size
        ax.step(lat, frac, where="post", color=f"C{i % 10}", label=m)
        drawn += 1
    if drawn:
        ax.set_ylim(0.0, 1.02)
        ax.legend()
    else:
        _no_data(ax)
    return _save(fig, path)


def negative_rates_by_task(pairs: Iterable[Any], *, full_method: str = FULL_METHOD
                           ) -> dict[str, dict[str, float]]:
    """{task: {method: negative rate}} over pairs with both scores present.

    A pair's task is its task_type, or its dataset when no task type is set.
    The full method is left out (it is never negative against itself).
    """
    counts: dict[str, dict[str, list[int]]] = {}
    for p in pairs:
        m, neg = _get(p, "method"), _get(p, "negative")
        if m == full_method or neg is None:
            continue
        task = _get(p, "task_type") or _get(p, "dataset")
        c = counts.setdefault(task, {}).setdefault(m, [0, 0])
        c[0] += bool(neg)
        c[1] += 1
    return {t: {m: n / tot for m, (n, tot) in ms.items()} for t, ms in counts.items()}


def plot_negative_rate_by_task(pairs: Iterable[Any], path: str | os.PathLike, *,
                               full_method: str = FULL_METHOD) -> str:
    """Grouped bars: negative-sample rate per task type, one bar per method."""
    rates = negative_rates_by_task(pairs, full_method=full_method)
    fig, ax = _new_figure("Negative samples by task", "task", "negative-sample rate")
    tasks = sorted(rates)
    methods = list(dict.fromkeys(m for t in tasks for m in rates[t]))
    if tasks and methods:
        width = 0.8 / len(methods)
        x = np.arange(len(tasks))
        for i, m in enumerate(methods):
            ys = [rates[t].get(m, math.nan) for t in tasks]
            ax.bar(x + (i - (len(methods) - 1) / 2) * width, ys, width, label=m, color=f"C{i % 10}")
        ax.set_xticks(x, tasks)
        ax.set_ylim(0.0, 1.0)
        ax.legend()
    else:
        _no_data(ax)
    return _save(fig, path)


def summary_records(rows: Iterable[Any]) -> list[dict]:
    """Rows as plain dicts (dataclasses converted), e.g. for json.dump."""
    out = []
    for r in rows:
        if isinstance(r, dict):
            out.append(dict(r))
        elif hasattr(r, "to_dict"):
            out.append(r.to_dict())
        else:
            out.append(dataclasses.asdict(r))
    return out
