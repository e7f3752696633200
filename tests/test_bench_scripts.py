"""The GPU benchmark scripts run end to end on tiny shapes (kernels in interpret mode on
the CPU), and their own checks of every launch setting against the caches' pass."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


def test_policy_launch_benchmark_checks_its_variants(tmp_path):
    out = tmp_path / "policy.json"
    run_script("bench_policy_launch.py", "--slots", "6", "--active", "3", "--max-len", "200",
               "--launches", "2", "--reps", "1", "--variants", "block=256;splits=2",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["caches", "block=256", "splits=2"]
    for r in rows:  # the same scores, outputs and victims as the caches' settings
        assert r["victims_agree"] == 1.0 and r["max_diff"] < 1e-5 and r["ms"] > 0


def test_ragged_attention_benchmark_checks_its_launches(tmp_path):
    out = tmp_path / "ragged.json"
    run_script("bench_ragged_attention.py", "--slots", "4", "--active", "2", "--min-len", "40",
               "--max-len", "200", "--methods", "diffkv,bf16", "--splits", "1",
               "--variants", "min_pages=4", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    launches = {(r["method"], r["launch"]) for r in rows}
    assert launches == {(m, n) for m in ("diffkv", "bf16")
                        for n in ("even-1", "work", "min_pages=4")}
    for r in rows:
        # Against the first launch (even splits): the same attention; on the CPU the
        # caches' launch takes float32 dots, the even-split one float16 codes (~1e-3).
        assert r["diff_vs_first"] < 3e-3 and r["bytes"] > 0
