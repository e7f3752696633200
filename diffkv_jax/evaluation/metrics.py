"""Per-sample evaluation records and the metrics computed from them.

Follows `spec/evaluation.md`: every compressed run is compared sample by sample
with the uncompressed ("full") run of the same engine, because averages hide
the samples that compression breaks. Per sample we record the task score, the
output tokens, the measured KV bytes and the latency; from a (method, full)
pair we derive the response-length change D, token agreement, the negative
flag and the memory ratio; `summarize` aggregates them per (method, dataset).

Pure Python + numpy, so results can be analysed on a machine without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

FULL_METHOD = "full"
"""Name of the uncompressed baseline method that every other method is paired with."""

PERCENTILE_METHOD = "linear"
"""numpy percentile interpolation used everywhere: `linear` (numpy's default,
Hyndman-Fan type 7): the q-th percentile of n sorted values sits at position
(n - 1) * q / 100, interpolating linearly between the two neighbours."""

Key = tuple[str, str, str]


def result_key(method: str, dataset: str, sample_id: Any) -> Key:
    """The (method, dataset, sample_id) key used for pairing and resume.

    sample_id is stringified so that ids given as ints by one caller and as
    strings after a JSON round trip still compare equal.
    """
    return (str(method), str(dataset), str(sample_id))


def _nan_if_none(x: Any) -> float:
    return math.nan if x is None else float(x)


def _none_if_nan(x: float) -> float | None:
    # Strict JSON (jq, JavaScript) has no NaN, so files store null instead.
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# --------------------------------------------------------------------------- records


@dataclass
class SampleResult:
    """One generated answer of one method on one dataset sample.

    score: task score in [0, 1], or NaN when the task has no score for it.
    output_tokens / output_len: the generated tokens (prompt excluded); at least
        one should be given for length metrics; output_len is filled in from
        the tokens when omitted, and must agree with them when both are given.
    kv_bytes: measured bytes of the sequence's KV cache, data plus metadata.
    kv_bytes_16bit: bytes that 16-bit K and V would take for the same tokens.
    latency_s: end-to-end seconds for the request, when measured.
    task_type: coarse task family ("qa", "summarization", "code", ...), used to
        break negative samples down by task; empty when unknown.
    extra: free-form JSON-serializable data (prompt text, decoded answer, ...).
    """

    method: str
    dataset: str
    sample_id: str
    score: float = math.nan
    output_tokens: list[int] | None = None
    output_len: int | None = None
    kv_bytes: int | None = None
    kv_bytes_16bit: int | None = None
    latency_s: float | None = None
    task_type: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.sample_id = str(self.sample_id)
        self.score = _nan_if_none(self.score)
        if not math.isnan(self.score) and not 0.0 <= self.score <= 1.0:
            raise ValueError(f"score must be in [0, 1] or NaN, got {self.score}")
        if self.output_tokens is not None:
            self.output_tokens = [int(t) for t in self.output_tokens]
            n = len(self.output_tokens)
            if self.output_len is None:
                self.output_len = n
            elif int(self.output_len) != n:
                raise ValueError(f"output_len {self.output_len} != len(output_tokens) {n}")
        if self.output_len is not None:
            self.output_len = int(self.output_len)
            if self.output_len < 0:
                raise ValueError(f"output_len must be >= 0, got {self.output_len}")
        for name in ("kv_bytes", "kv_bytes_16bit"):
            v = getattr(self, name)
            if v is not None:
                v = int(v)
                if v < 0:
                    raise ValueError(f"{name} must be >= 0, got {v}")
                setattr(self, name, v)

    @property
    def key(self) -> Key:
        """(method, dataset, sample_id)."""
        return result_key(self.method, self.dataset, self.sample_id)

    def to_dict(self) -> dict:
        """A JSON-ready dict (NaN score stored as null)."""
        d = dataclasses.asdict(self)
        d["score"] = _none_if_nan(self.score)
        return d

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | dict) -> "SampleResult":
        """Inverse of `to_json` / `to_dict`; unknown keys are an error, not ignored."""
        d = json.loads(data) if isinstance(data, str) else dict(data)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown SampleResult fields: {sorted(unknown)}")
        return cls(**d)


# --------------------------------------------------------------------------- per-sample metrics


def length_change(L_full: int, L_method: int) -> float:
    """Relative response-length change D = (L_full - L_method) / L_full.

    D > 0: the method answered shorter; D < 0: longer (D = -0.5 is 1.5x longer).
    When L_full == 0: D = 0.0 if L_method == 0 too (nothing changed), else NaN,
    because a relative change from zero is undefined; summaries skip NaN D.
    """
    if L_full < 0 or L_method < 0:
        raise ValueError(f"lengths must be >= 0, got {L_full}, {L_method}")
    if L_full == 0:
        return 0.0 if L_method == 0 else math.nan
    return (L_full - L_method) / L_full


def agreement(full_tokens: Sequence[int], method_tokens: Sequence[int]) -> tuple[bool, int | None]:
    """(exact_match, first_divergence) of two token sequences.

    first_divergence is the first index where they differ; when one is a strict
    prefix of the other it is the shorter length; None when they are identical.
    """
    a, b = list(full_tokens), list(method_tokens)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return False, i
    if len(a) == len(b):
        return True, None
    return False, n


def is_negative(full_score: float, method_score: float, *, threshold: float = 0.9,
                full_ok: float = 0.0) -> bool:
    """Whether compression made this sample a negative sample.

    Negative: the uncompressed run does well on it (full_score > full_ok; the
    default 0.0 means "full scored anything at all", i.e. solved it on 0/1
    tasks) and the method scores below threshold x full_score (default: lost
    more than 10% of the uncompressed score; exactly 10% is not negative).
    NaN scores (not applicable) are never negative.
    """
    if math.isnan(full_score) or math.isnan(method_score):
        return False
    return full_score > full_ok and method_score < threshold * full_score


def memory_ratio(kv_bytes: int | None, kv_bytes_16bit: int | None) -> float:
    """Measured KV bytes over 16-bit KV bytes for the same tokens (lower is better).

    NaN when either is missing or the 16-bit size is 0 (no tokens).
    """
    if kv_bytes is None or kv_bytes_16bit is None:
        return math.nan
    if kv_bytes < 0 or kv_bytes_16bit < 0:
        raise ValueError(f"byte counts must be >= 0, got {kv_bytes}, {kv_bytes_16bit}")
    if kv_bytes_16bit == 0:
        return math.nan
    return kv_bytes / kv_bytes_16bit


# --------------------------------------------------------------------------- pairing


@dataclass
class PairRecord:
    """One method's sample compared with the full run's answer to the same sample.

    D is NaN when a length is missing; exact_match / first_divergence are None
    when either side stored no tokens; negative is None when a score is NaN.
    """

    method: str
    dataset: str
    sample_id: str
    task_type: str
    score: float
    full_score: float
    len_full: int | None
    len_method: int | None
    D: float
    exact_match: bool | None
    first_divergence: int | None
    negative: bool | None
    memory_ratio: float
    latency_s: float | None
    full_latency_s: float | None

    def to_dict(self) -> dict:
        """A JSON-ready dict (NaN floats stored as null)."""
        return {k: _none_if_nan(v) for k, v in dataclasses.asdict(self).items()}


def _pair(r: SampleResult, f: SampleResult, threshold: float, full_ok: float) -> PairRecord:
    if r.output_len is not None and f.output_len is not None:
        D = length_change(f.output_len, r.output_len)
    else:
        D = math.nan
    if r.output_tokens is not None and f.output_tokens is not None:
        exact, div = agreement(f.output_tokens, r.output_tokens)
    else:
        exact, div = None, None
    scored = not (math.isnan(r.score) or math.isnan(f.score))
    neg = is_negative(f.score, r.score, threshold=threshold, full_ok=full_ok) if scored else None
    return PairRecord(
        method=r.method, dataset=r.dataset, sample_id=r.sample_id,
        task_type=r.task_type or f.task_type,
        score=r.score, full_score=f.score,
        len_full=f.output_len, len_method=r.output_len, D=D,
        exact_match=exact, first_divergence=div, negative=neg,
        memory_ratio=memory_ratio(r.kv_bytes, r.kv_bytes_16bit),
        latency_s=r.latency_s, full_latency_s=f.latency_s)


def _latest_by_key(results: Iterable[SampleResult]) -> dict[Key, SampleResult]:
    # A rerun appends a newer record for the same key; the newest one wins.
    out: dict[Key, SampleResult] = {}
    for r in results:
        out[r.key] = r
    return out


def pair_with_full(results: Iterable[SampleResult], *, full_method: str = FULL_METHOD,
                   threshold: float = 0.9, full_ok: float = 0.0,
                   include_full: bool = True) -> list[PairRecord]:
    """Join every method's results with the full run's on (dataset, sample_id).

    include_full: also pair the full run with itself, so that the baseline's own
    score, memory and latency appear next to the methods in the same summary.
    Samples whose full counterpart is missing are left out (see `missing_full`).
    When a key occurs more than once, the last record wins. Order follows the
    input order of first appearance.
    """
    latest = _latest_by_key(results)
    full = {(d, s): r for (m, d, s), r in latest.items() if m == full_method}
    pairs = []
    for (m, d, s), r in latest.items():
        if m == full_method and not include_full:
            continue
        f = full.get((d, s))
        if f is not None:
            pairs.append(_pair(r, f, threshold, full_ok))
    return pairs


def missing_full(results: Iterable[SampleResult], *, full_method: str = FULL_METHOD) -> list[Key]:
    """Keys of non-full results that have no full result to compare with."""
    latest = _latest_by_key(results)
    have = {(d, s) for (m, d, s) in latest if m == full_method}
    return [k for k in latest if k[0] != full_method and (k[1], k[2]) not in have]


# --------------------------------------------------------------------------- aggregation


@dataclass
class Summary:
    """Aggregate of the pairs of one (method, dataset); NaN where nothing applies.

    count: pairs in the group. Score means skip NaN scores. negative_rate =
    n_negative / pairs with both scores present. exact_match_rate over pairs
    with tokens on both sides. D statistics skip NaN D; p10_D is the
    lengthening tail (D < 0 is longer), longer_1_5x_rate the share of samples at
    least 1.5x longer than full (D <= -0.5). Latency percentiles are over the
    method's own latency_s. Percentiles use `PERCENTILE_METHOD`.
    """

    method: str
    dataset: str
    count: int
    mean_score: float
    mean_full_score: float
    n_negative: int
    negative_rate: float
    exact_match_rate: float
    mean_memory_ratio: float
    mean_D: float
    p10_D: float
    p90_D: float
    mean_abs_D: float
    p90_abs_D: float
    longer_1_5x_rate: float
    latency_p50: float
    latency_p90: float
    latency_p99: float

    def to_dict(self) -> dict:
        """A JSON-ready dict (NaN floats stored as null)."""
        return {k: _none_if_nan(v) for k, v in dataclasses.asdict(self).items()}


def _finite(values: Iterable[Any]) -> np.ndarray:
    a = np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    return a[~np.isnan(a)]


def _mean(values: Iterable[Any]) -> float:
    a = _finite(values)
    return float(a.mean()) if a.size else math.nan


def _pct(values: Iterable[Any], q: float) -> float:
    a = _finite(values)
    return float(np.percentile(a, q, method=PERCENTILE_METHOD)) if a.size else math.nan


def _rate(flags: Iterable[bool | None]) -> float:
    a = [bool(x) for x in flags if x is not None]
    return sum(a) / len(a) if a else math.nan


def _summarize_group(method: str, dataset: str, ps: list[PairRecord]) -> Summary:
    Ds = _finite(p.D for p in ps)
    return Summary(
        method=method, dataset=dataset, count=len(ps),
        mean_score=_mean(p.score for p in ps),
        mean_full_score=_mean(p.full_score for p in ps),
        n_negative=sum(1 for p in ps if p.negative),
        negative_rate=_rate(p.negative for p in ps),
        exact_match_rate=_rate(p.exact_match for p in ps),
        mean_memory_ratio=_mean(p.memory_ratio for p in ps),
        mean_D=_mean(Ds), p10_D=_pct(Ds, 10), p90_D=_pct(Ds, 90),
        mean_abs_D=_mean(np.abs(Ds)), p90_abs_D=_pct(np.abs(Ds), 90),
        longer_1_5x_rate=float(np.mean(Ds <= -0.5)) if Ds.size else math.nan,
        latency_p50=_pct((p.latency_s for p in ps), 50),
        latency_p90=_pct((p.latency_s for p in ps), 90),
        latency_p99=_pct((p.latency_s for p in ps), 99))


ALL_DATASETS = "ALL"
"""Dataset name of the rows that `summarize(..., per_dataset=False)` returns."""


def summarize(pairs: Iterable[PairRecord], *, per_dataset: bool = True,
              full_method: str = FULL_METHOD) -> list[Summary]:
    """Aggregate pairs per (method, dataset), or per method over all datasets.

    Rows are sorted by dataset, then the full method first, then method name,
    so tables and files come out in the same order on every run.
    """
    groups: dict[tuple[str, str], list[PairRecord]] = {}
    for p in pairs:
        groups.setdefault((p.method, p.dataset if per_dataset else ALL_DATASETS), []).append(p)
    order = sorted(groups, key=lambda md: (md[1], md[0] != full_method, md[0]))
    return [_summarize_group(m, d, groups[(m, d)]) for m, d in order]


# --------------------------------------------------------------------------- JSON lines


def _record_dict(record: Any) -> dict:
    if isinstance(record, dict):
        return record
    if hasattr(record, "to_dict"):
        return record.to_dict()
    raise TypeError(f"cannot write {type(record).__name__} as a JSON line")


def _drop_partial_tail(path: str) -> None:
    # A crash mid-write leaves a last line without its newline; appending after
    # it would glue the next record onto the fragment and lose both, so cut the
    # fragment off first (it cannot be parsed anyway).
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def append_jsonl(path: str | os.PathLike, record: Any, *, fsync: bool = True) -> None:
    """Append one record (dict, or an object with `to_dict`) as one JSON line.

    The line is written with a single write call and flushed (and fsync'ed by
    default, which is cheap next to generating a sample), so after a crash at
    most the line being written is lost; a partial line left by an earlier
    crash is removed before appending.
    """
    path = os.fspath(path)
    line = json.dumps(_record_dict(record), separators=(",", ":")) + "\n"
    if os.path.exists(path):
        _drop_partial_tail(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a JSON-lines file; [] when the file does not exist.

    A malformed last line (a crash mid-write) is dropped; a malformed line
    anywhere else means real corruption and raises ValueError. Blank lines are
    skipped.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return []
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # Index of the last non-blank line: the only one allowed to be cut short.
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    out = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError as e:
            if i == last:
                break
            raise ValueError(f"{path}:{i + 1}: malformed JSON line: {e}") from e
    return out


def read_results(path: str | os.PathLike) -> list[SampleResult]:
    """`read_jsonl` parsed into SampleResult records."""
    return [SampleResult.from_json(d) for d in read_jsonl(path)]


def done_keys(path: str | os.PathLike) -> set[Key]:
    """The (method, dataset, sample_id) keys already written, for resuming a run.

    Ids are strings (see `result_key`); test membership with
    `result_key(method, dataset, sample_id) in done`.
    """
    return {result_key(d["method"], d["dataset"], d["sample_id"]) for d in read_jsonl(path)}
