"""Evaluation metrics and reports on constructed cases whose answers are known by hand."""

import json
import math

import numpy as np
import pytest

from diffkv_jax.evaluation import metrics as M
from diffkv_jax.evaluation import report as R

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _res(method, sid, tokens, score, *, dataset="ds", kv=None, kv16=None, lat=None, task=""):
    return M.SampleResult(method=method, dataset=dataset, sample_id=sid, score=score,
                          output_tokens=tokens, kv_bytes=kv, kv_bytes_16bit=kv16,
                          latency_s=lat, task_type=task)


def _pair(D=0.0, negative=False, exact=True, score=1.0, lat=None, ratio=0.5,
          method="m", dataset="ds", task=""):
    return M.PairRecord(method=method, dataset=dataset, sample_id="0", task_type=task,
                        score=score, full_score=1.0, len_full=None, len_method=None, D=D,
                        exact_match=exact, first_divergence=None, negative=negative,
                        memory_ratio=ratio, latency_s=lat, full_latency_s=None)


# --------------------------------------------------------------------------- per-sample metrics


def test_identity_method_changes_nothing():
    toks = [5, 6, 7, 8]
    full = _res("full", 1, toks, 1.0)
    same = _res("same", 1, list(toks), 1.0)
    [p] = M.pair_with_full([full, same], include_full=False)
    assert p.D == 0.0
    assert p.exact_match is True and p.first_divergence is None
    assert p.negative is False


def test_half_truncation_gives_half_D_and_divergence_at_cut():
    toks = list(range(10))
    [p] = M.pair_with_full([_res("full", 0, toks, 1.0), _res("cut", 0, toks[:5], 1.0)],
                           include_full=False)
    assert p.D == 0.5
    assert p.exact_match is False and p.first_divergence == 5
    assert (p.len_full, p.len_method) == (10, 5)


def test_agreement_cases():
    assert M.agreement([1, 2, 3], [1, 2, 3]) == (True, None)
    assert M.agreement([1, 2, 3], [1, 9, 3]) == (False, 1)
    assert M.agreement([1, 2], [1, 2, 3, 4]) == (False, 2)  # full is a prefix of the method
    assert M.agreement([], [7]) == (False, 0)
    assert M.agreement([], []) == (True, None)


def test_length_change_values_and_zero_full():
    assert M.length_change(10, 15) == -0.5  # 1.5x longer
    assert M.length_change(4, 1) == 0.75
    assert M.length_change(0, 0) == 0.0
    assert math.isnan(M.length_change(0, 3))
    with pytest.raises(ValueError):
        M.length_change(-1, 2)


def test_is_negative_threshold():
    assert M.is_negative(1.0, 0.0)
    assert not M.is_negative(1.0, 0.95)
    assert not M.is_negative(1.0, 0.9)  # losing exactly 10% is not more than 10%
    assert M.is_negative(1.0, 0.89)
    assert M.is_negative(1.0, 0.95, threshold=0.99)
    assert not M.is_negative(0.0, 0.0)  # full did not solve it: nothing to lose
    assert not M.is_negative(0.4, 0.0, full_ok=0.5)
    assert M.is_negative(0.6, 0.0, full_ok=0.5)
    assert not M.is_negative(math.nan, 0.0) and not M.is_negative(1.0, math.nan)


def test_memory_ratio_of_known_bytes():
    assert M.memory_ratio(250, 1000) == 0.25
    assert M.memory_ratio(1000, 1000) == 1.0
    assert math.isnan(M.memory_ratio(10, 0))
    assert math.isnan(M.memory_ratio(None, 100))
    with pytest.raises(ValueError):
        M.memory_ratio(-1, 100)


# --------------------------------------------------------------------------- records and pairing


def test_sample_result_json_round_trip():
    r = M.SampleResult(method="diffkv", dataset="gsm8k", sample_id=12, score=math.nan,
                       output_tokens=[3, 4], kv_bytes=100, kv_bytes_16bit=400,
                       latency_s=0.5, task_type="math", extra={"text": "hi"})
    assert r.sample_id == "12" and r.output_len == 2
    line = r.to_json()
    assert json.loads(line)["score"] is None  # strict JSON: no NaN literal
    back = M.SampleResult.from_json(line)
    assert math.isnan(back.score)
    back.score = r.score = 0.0
    assert back == r
    assert M.SampleResult.from_json(r.to_dict()) == r


def test_sample_result_validation():
    with pytest.raises(ValueError):
        M.SampleResult("m", "d", 0, score=1.5)
    with pytest.raises(ValueError):
        M.SampleResult("m", "d", 0, output_tokens=[1, 2], output_len=3)
    with pytest.raises(ValueError):
        M.SampleResult.from_json({"method": "m", "dataset": "d", "sample_id": 0, "bogus": 1})
    assert M.SampleResult("m", "d", 0, output_len=7).output_len == 7


def test_pair_with_full_joins_on_dataset_and_sample():
    rs = [
        _res("full", 0, [1, 2, 3, 4], 1.0, kv16=1000, kv=1000, lat=1.0),
        _res("full", 1, [1, 2], 1.0, kv16=500, kv=500),
        _res("full", 0, [9], 0.0, dataset="other"),
        _res("q", 0, [1, 2, 3, 4, 5, 6], 0.0, kv16=1500, kv=300, lat=2.0),  # longer, wrong
        _res("q", 1, [1, 2], 1.0, kv16=500, kv=100),
        _res("q", 0, [9], 0.0, dataset="other"),
        _res("q", 7, [1], 1.0),  # no full counterpart
    ]
    pairs = M.pair_with_full(rs, include_full=False)
    by = {(p.dataset, p.sample_id): p for p in pairs}
    assert set(by) == {("ds", "0"), ("ds", "1"), ("other", "0")}
    p = by[("ds", "0")]
    assert p.D == -0.5 and p.first_divergence == 4 and p.negative is True
    assert p.memory_ratio == 0.2 and (p.latency_s, p.full_latency_s) == (2.0, 1.0)
    assert by[("ds", "1")].negative is False and by[("ds", "1")].exact_match is True
    assert by[("other", "0")].negative is False  # full scored 0: not eligible
    assert M.missing_full(rs) == [("q", "ds", "7")]
    with_full = M.pair_with_full(rs)
    assert sum(p.method == "full" for p in with_full) == 3
    assert all(p.D == 0.0 and p.negative is False for p in with_full if p.method == "full")


def test_pair_with_full_last_record_wins_and_nan_score_is_not_applicable():
    rs = [_res("full", 0, [1, 2], 1.0), _res("m", 0, [1, 2], 0.0), _res("m", 0, [1, 2], 1.0),
          _res("full", 1, [1], math.nan), _res("m", 1, [1], 0.0)]
    by = {p.sample_id: p for p in M.pair_with_full(rs, include_full=False)}
    assert by["0"].score == 1.0 and by["0"].negative is False
    assert by["1"].negative is None


# --------------------------------------------------------------------------- summarize


def test_summarize_matches_hand_computed_statistics():
    Ds = [0.0, -0.5, 0.25, -1.0, 0.5]
    negs = [True, False, False, None, False]
    exact = [True, False, None, False, False]
    scores = [0.0, 1.0, 1.0, math.nan, 0.5]
    lats = [1.0, 2.0, 3.0, 4.0, 5.0]
    ratios = [0.25, 0.25, 0.5, 0.5, math.nan]
    pairs = [_pair(D=d, negative=n, exact=e, score=s, lat=t, ratio=r)
             for d, n, e, s, t, r in zip(Ds, negs, exact, scores, lats, ratios)]
    [s] = M.summarize(pairs)
    assert (s.method, s.dataset, s.count) == ("m", "ds", 5)
    assert s.mean_score == pytest.approx(2.5 / 4)
    assert s.mean_memory_ratio == pytest.approx(0.375)
    assert s.n_negative == 1 and s.negative_rate == pytest.approx(1 / 4)
    assert s.exact_match_rate == pytest.approx(1 / 4)
    # sorted D: [-1, -0.5, 0, 0.25, 0.5]; p90 at position 0.9*4 = 3.6: 0.25 + 0.6*0.25
    assert s.mean_D == pytest.approx(-0.15)
    assert s.p90_D == pytest.approx(0.4)
    # p10 at position 0.4: -1 + 0.4*0.5
    assert s.p10_D == pytest.approx(-0.8)
    # sorted |D|: [0, 0.25, 0.5, 0.5, 1]; p90: 0.5 + 0.6*0.5
    assert s.mean_abs_D == pytest.approx(0.45)
    assert s.p90_abs_D == pytest.approx(0.8)
    assert s.longer_1_5x_rate == pytest.approx(0.4)
    assert s.latency_p50 == pytest.approx(3.0)
    assert s.latency_p90 == pytest.approx(4.6)
    assert s.latency_p99 == pytest.approx(4.96)


def test_summarize_groups_orders_and_handles_missing():
    pairs = [_pair(method="z", dataset="b"), _pair(method="full", dataset="b"),
             _pair(method="a", dataset="a"), _pair(method="z", dataset="a", D=math.nan)]
    rows = M.summarize(pairs)
    assert [(r.dataset, r.method) for r in rows] == [("a", "a"), ("a", "z"), ("b", "full"),
                                                     ("b", "z")]
    za = rows[1]
    assert math.isnan(za.mean_D) and math.isnan(za.p90_D) and math.isnan(za.latency_p50)
    allrows = M.summarize(pairs, per_dataset=False)
    assert [(r.method, r.count) for r in allrows] == [("full", 1), ("a", 1), ("z", 2)]
    assert all(r.dataset == M.ALL_DATASETS for r in allrows)
    assert za.to_dict()["mean_D"] is None


# --------------------------------------------------------------------------- JSON lines


def test_jsonl_survives_truncated_last_line_and_resumes(tmp_path):
    path = tmp_path / "results.jsonl"
    assert M.read_jsonl(path) == [] and M.done_keys(path) == set()
    for sid in range(3):
        M.append_jsonl(path, _res("m", sid, [1, 2], 1.0))
    with open(path, "a") as f:  # a crash mid-write
        f.write('{"method": "m", "dataset": "ds", "sample_id": "3", "sc')
    recs = M.read_jsonl(path)
    assert [r["sample_id"] for r in recs] == ["0", "1", "2"]
    done = M.done_keys(path)
    assert done == {("m", "ds", "0"), ("m", "ds", "1"), ("m", "ds", "2")}
    assert M.result_key("m", "ds", 1) in done and M.result_key("m", "ds", 3) not in done
    # Resuming appends after the fragment is cut off, not glued onto it.
    M.append_jsonl(path, _res("m", 3, [1], 0.0))
    back = M.read_results(path)
    assert [r.sample_id for r in back] == ["0", "1", "2", "3"]
    assert back[3].output_tokens == [1]
    assert path.read_text().endswith("}\n")


def test_jsonl_corruption_before_the_last_line_raises(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        M.read_jsonl(path)


def test_jsonl_accepts_plain_dicts(tmp_path):
    path = tmp_path / "d.jsonl"
    M.append_jsonl(path, {"x": 1}, fsync=False)
    M.append_jsonl(path, {"x": 2})
    assert M.read_jsonl(path) == [{"x": 1}, {"x": 2}]


# --------------------------------------------------------------------------- report


def test_pareto_front_constructed_points():
    pts = [(0.25, 0.8), (0.5, 0.9), (0.5, 0.7), (1.0, 0.9), (1.0, 1.0),
           (math.nan, 1.0), (0.25, 0.8), (0.2, 0.1)]
    # 2 is dominated by 1 (same memory, lower quality); 3 by 1 (more memory, same quality);
    # 6 duplicates 0 and stays; 7 uses least memory so stays; 5 has NaN memory.
    assert R.pareto_front(pts) == [0, 1, 4, 6, 7]
    assert R.pareto_front([]) == []


def test_markdown_table_layout_and_formatting():
    rows = M.summarize([_pair(method="full", D=0.0, ratio=1.0, score=1.0),
                        _pair(method="k|v", D=-0.5, ratio=0.25, score=0.5, negative=True)])
    text = R.markdown_table(rows, columns=["method", "count", "mean_score",
                                           ("mean_memory_ratio", "mem"), "mean_D",
                                           "negative_rate", "latency_p50"])
    lines = text.strip().split("\n")
    assert lines[0] == "| method | n | score | mem | mean D | negative % | latency p50 (s) |"
    assert lines[1] == "|:---|---:|---:|---:|---:|---:|:---|"
    assert lines[2] == "| full | 1 | 100.0% | 100.0% | +0.0% | 0.0% | n/a |"
    assert lines[3] == "| k\\|v | 1 | 50.0% | 25.0% | -50.0% | 100.0% | n/a |"
    # default columns and dict rows give one line per row plus two header lines
    dict_rows = [r.to_dict() for r in rows]
    assert len(R.markdown_table(dict_rows).strip().split("\n")) == 4
    assert R.format_value("latency_p99", 0.12345) == "0.123"
    assert R.format_value("p90_abs_D", 0.5) == "50.0%" and R.format_value("p90_D", 0.5) == "+50.0%"


def test_negative_rates_by_task():
    pairs = [_pair(method="q", task="qa", negative=True), _pair(method="q", task="qa"),
             _pair(method="q", task="code"), _pair(method="q", dataset="sum", negative=None),
             _pair(method="full", task="qa")]
    assert R.negative_rates_by_task(pairs) == {"qa": {"q": 0.5}, "code": {"q": 0.0}}


def _plot_data():
    rs = []
    rng = np.random.default_rng(0)
    for sid in range(12):
        n = int(rng.integers(4, 20))
        task = ["qa", "code", "summarization"][sid % 3]
        rs.append(_res("full", sid, list(range(n)), 1.0, kv=2000, kv16=2000,
                       lat=float(rng.uniform(1, 2)), task=task))
        for m, keep, ratio in (("kivi", 1.5, 0.3), ("h2o", 0.5, 0.5)):
            m_n = max(1, int(n * keep))
            rs.append(_res(m, sid, list(range(m_n)), float(rng.random() > 0.3), kv=int(2000 * ratio),
                           kv16=2000, lat=float(rng.uniform(1, 3)), task=task))
    pairs = M.pair_with_full(rs)
    return pairs, M.summarize(pairs)


@pytest.mark.parametrize("name", ["accuracy", "length", "latency", "negative"])
def test_plots_write_png(tmp_path, name):
    pairs, rows = _plot_data()
    fn = {"accuracy": lambda p: R.plot_accuracy_vs_memory(rows, p),
          "length": lambda p: R.plot_length_change_hist(pairs, p),
          "latency": lambda p: R.plot_latency_cdf(pairs, p),
          "negative": lambda p: R.plot_negative_rate_by_task(pairs, p)}[name]
    out = fn(tmp_path / "sub" / f"{name}.png")
    data = open(out, "rb").read()
    assert out == str(tmp_path / "sub" / f"{name}.png")
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    # no data still gives an image rather than an exception
    empty = {"accuracy": lambda p: R.plot_accuracy_vs_memory([], p),
             "length": lambda p: R.plot_length_change_hist([], p),
             "latency": lambda p: R.plot_latency_cdf([], p),
             "negative": lambda p: R.plot_negative_rate_by_task([], p)}[name]
    assert open(empty(tmp_path / f"empty_{name}.png"), "rb").read().startswith(PNG_MAGIC)


def test_report_module_leaves_pyplot_backend_alone(tmp_path):
    import matplotlib
    before = matplotlib.get_backend()
    R.plot_latency_cdf([], tmp_path / "x.png")
    assert matplotlib.get_backend() == before
