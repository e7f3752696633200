"""The GPU benchmark scripts run end to end on tiny shapes (kernels in interpret mode on
the CPU), and their own checks of every launch setting against the caches' pass."""

import json
import os
import subprocess
import sys

import pytest

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
               "--launches", "2", "--reps", "1",
               "--variants", "block=256;splits=2;merge=0;lanes=1,block=64", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["caches", "block=256", "splits=2", "merge=0",
                                            "lanes=1,block=64"]
    for r in rows:  # the same scores, outputs and victims as the caches' settings
        assert r["victims_agree"] == 1.0 and r["max_diff"] < 1e-5 and r["ms"] > 0


@pytest.mark.parametrize("plan", ["launch", "step"])
def test_ragged_attention_benchmark_checks_its_launches(tmp_path, plan):
    out = tmp_path / "ragged.json"
    run_script("bench_ragged_attention.py", "--slots", "4", "--active", "2", "--min-len", "40",
               "--max-len", "200", "--methods", "diffkv,bf16", "--splits", "1",
               "--variants", "min_pages=4;tokens=1;merge=4;merge=2,merge_dims=4;wave=6;merge=last",
               "--chain", "2", "--plan", plan,
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    launches = {(r["method"], r["launch"]) for r in rows}
    assert launches == {(m, n) for m in ("diffkv", "bf16")
                        for n in ("even-1", "work", "min_pages=4", "tokens=1", "merge=4",
                                  "merge=2,merge_dims=4", "wave=6", "merge=last")}
    for r in rows:
        # Against the first launch (even splits): the same attention; on the CPU the
        # caches' launch takes float32 dots, the even-split one float16 codes (~1e-3).
        assert r["diff_vs_first"] < 3e-3 and r["bytes"] > 0


def test_attention_benchmark_checks_and_chains_its_launches(tmp_path):
    out = tmp_path / "attention.json"
    # (JAX's own kernel runs on the GPU only.)
    run_script("bench_attention.py", "--models", "smollm2-135m", "--batches", "2",
               "--contexts", "256", "--variants", "ours-bf16,diffkv-high,diffkv-50/50",
               "--kernel-tiles", "queries,tokens", "--chain", "3", "--copy-gib", "0.05",
               "--json", str(out))
    res = json.loads(out.read_text())
    assert res["args"]["chain"] == 3 and res["args"]["plan"] == "step"
    assert res["args"]["merge"] == "rows"  # the items merged by one launch
    assert [r["variant"] for r in res["rows"]] == [
        "ours-bf16", "diffkv-high", "diffkv-50/50", "diffkv-high/tokens", "diffkv-50/50/tokens"]
    for r in res["rows"]:  # each checked against the plain-jnp reference first
        assert r["rel_err"] < 5e-3 and r["ms"] > 0 and r["bytes"] > 0
        assert r["kernel_ms"] is None  # no GPU kernels in a CPU trace


def test_attention_benchmark_times_launch_settings(tmp_path):
    out = tmp_path / "tuned.json"
    run_script("bench_attention.py", "--models", "llama3-8b", "--batches", "2",
               "--contexts", "512", "--variants", "diffkv-50/50", "--kernel-tiles", "tokens",
               "--tune", "w=1-2;ls=64,w=1-3;n=40;wave=12;lg=32;m=last;m=last,el=1;"
               "m=last,pl=4,pr=16;m=last,kc=32;m=last,w=8-15,gp=12;m=last,rc=2;rc=3,rs=60;"
               "m=last,i8=2;m=last,ka=1",
               "--chain", "2",
               "--copy-gib", "0.05",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "diffkv-50/50/tokens", "diffkv-50/50/tokens[w=1-2]",
        "diffkv-50/50/tokens[ls=64,w=1-3]", "diffkv-50/50/tokens[n=40]",
        "diffkv-50/50/tokens[wave=12]", "diffkv-50/50/tokens[lg=32]",
        "diffkv-50/50/tokens[m=last]", "diffkv-50/50/tokens[m=last,el=1]",
        "diffkv-50/50/tokens[m=last,pl=4,pr=16]", "diffkv-50/50/tokens[m=last,kc=32]",
        "diffkv-50/50/tokens[m=last,w=8-15,gp=12]", "diffkv-50/50/tokens[m=last,rc=2]",
        "diffkv-50/50/tokens[rc=3,rs=60]", "diffkv-50/50/tokens[m=last,i8=2]",
        "diffkv-50/50/tokens[m=last,ka=1]"]
    for r in rows:  # every setting checked against the plain-jnp reference
        assert r["rel_err"] < 5e-3 and r["ms"] > 0


def test_chained_timing_runs_every_launch():
    import jax
    import jax.numpy as jnp

    from scripts.decode_cases import time_chained_ms

    runs = []

    def fn(q, w):
        jax.debug.callback(lambda: runs.append(1))  # once per executed launch
        return jnp.tanh(q @ w), None

    q, w = jnp.ones((8, 16)), jnp.full((16, 16), 0.01)
    assert time_chained_ms(fn, q, w, launches=4, reps=1, rounds=1) > 0
    jax.effects_barrier()
    assert len(runs) == 4 * 3  # two warm-up calls and one timed call of 4 launches

    # What a decode step computes once for its layers (the work list) runs once per
    # chained call, and every launch gets it.
    plans, runs[:] = [], []

    def prepare(w):
        jax.debug.callback(lambda: plans.append(1))
        return w * 2

    def launch(q, prepared, w):
        jax.debug.callback(lambda: runs.append(1))
        return jnp.tanh(q @ prepared), None

    assert time_chained_ms(launch, q, w, launches=4, reps=1, rounds=1, prepare=prepare) > 0
    jax.effects_barrier()
    assert len(plans) == 3 and len(runs) == 4 * 3


def test_chained_call_is_unrolled_like_the_decode_step():
    # No loop in the chain: XLA's GPU loops wait for the host every step.
    import jax.numpy as jnp

    from scripts.decode_cases import chained_call

    fn = lambda q, w: jnp.tanh(q @ w)  # noqa: E731
    q, w = jnp.ones((8, 16)), jnp.full((16, 16), 0.01)
    chain = chained_call(fn, 3)
    text = chain.lower(q, jnp.float32(0), w).compile().as_text()
    assert "while" not in text and text.count("tanh") >= 3


def _run_result(method, wall, trace):
    return dict(method=method, wall_s=wall, tokens_per_s=trace[-1][-1] / wall,
                batch_trace=trace)


def test_throughput_runs_compare_over_the_window_they_share(tmp_path):
    from scripts.compare_throughput import window_rate

    # A run whose rate falls over time (as the all-at-once workload's does) and a
    # steady one: over the shared 10 s the first is 2x, over its own 20 s 1.5x.
    falling = _run_result("falling", 20.0, [(t, 4, 20 * t if t <= 10 else 200 + 10 * (t - 10))
                                            for t in range(1, 21)])
    steady = _run_result("steady", 10.0, [(t, 2, 10 * t) for t in range(1, 11)])
    assert window_rate(falling, 10.0) == (20.0, True)
    assert window_rate(falling, 20.0, start=10.0) == (10.0, True)  # after the ramp
    assert falling["tokens_per_s"] == 15.0
    # (seconds, running) traces: running counts scaled to the run's counted rate
    older = dict(method="older", wall_s=4.0, tokens_per_s=2.0,
                 batch_trace=[(1, 4), (2, 4), (3, 2), (4, 2)])
    assert window_rate(older, 4.0) == (2.0, False)
    assert window_rate(older, 2.0) == (8 / 2 * 2.0 / 3.0, False)
    assert window_rate(older, 4.0, start=2.0) == (4 / 2 * 2.0 / 3.0, False)
    try:
        window_rate(steady, 15.0)
        raise AssertionError("a window past the run's end must be refused")
    except ValueError as e:
        assert "served 10.0 s" in str(e)
    for name, runs in (("a.json", dict(results=[steady])), ("b.json", dict(result=falling))):
        (tmp_path / name).write_text(json.dumps(runs))
    out = run_script("compare_throughput.py", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert "first 10.0 s" in out
    falling_row = [ln for ln in out.splitlines() if ln.startswith("falling")][0]
    assert "2.00x" in falling_row and "15" in falling_row.split()[-1]


def test_kernel_resources_writes_the_policy_launch_ir(tmp_path):
    # The policy launch lowered through Pallas' Triton lowering for sm_90 on any
    # machine, once per lane_victims value (compiled only where the triton package is).
    out = run_script("kernel_resources.py", "--policy", "--lane-victims", "0,1",
                     "--out", str(tmp_path))
    assert "lane_victims" in out
    for lanes in (0, 1):
        ir = (tmp_path / f"policy_scores_lanes{lanes}.ttir").read_text()
        assert "tt.func" in ir and "scf.for" in ir


def test_loop_bodies_of_nested_loops():
    # A loop over chunks around a page loop: all loops, or the page loop alone.
    from scripts.kernel_resources import loop_bodies

    sass = "\n".join([
        ".L_x_1:", "        /*0010*/                   IADD3 R1, R1, 0x1 ;",
        ".L_x_2:", "        /*0020*/                   HMMA R2, R3, R4, R2 ;",
        "        /*0030*/              @P0 BRA `(.L_x_2) ;",
        "        /*0040*/                   ATOMG R5, [R6] ;",
        "        /*0050*/              @P1 BRA `(.L_x_1) ;",
        ".L_x_3:", "        /*0060*/                   FMUL R7, R7, R8 ;",
        "        /*0070*/              @P2 BRA `(.L_x_3) ;"])
    assert [len(b) for b in loop_bodies(sass)] == [2, 5, 2]
    inner = loop_bodies(sass, innermost=True)
    assert [b[0].split()[0] for b in inner] == ["HMMA", "FMUL"]


def test_throughput_benchmark_serves_a_real_model_to_its_eos(tmp_path):
    # --natural-eos: the embedded model on MATH-500 chat prompts, stopped by its EOS
    # tokens or the --output-len cap; the answers' lengths reported.
    out = tmp_path / "natural"
    stdout = run_script("bench_throughput.py", "--model", "smollm2-135m", "--natural-eos",
                        "--methods", "full", "--num-requests", "2", "--output-len", "6",
                        "--kv-budget-gb", "0.01", "--max-batch", "2", "--attention",
                        "reference", "--out", str(out))
    res = json.loads((out / "throughput.json").read_text())["results"][0]
    from models.loading import load_model

    tok = load_model("smollm2-135m").tokenizer
    assert res["stop_token_ids"] == list(tok.eos_token_ids) and res["stop_token_ids"]
    assert res["finished"] == 2 and 1 <= res["response_tokens_mean"] <= 6
    assert 0 <= res["stopped_at_eos"] <= 2 and res["prompt_tokens"] > 2 * 20
    assert "answer tokens mean" in stdout


def test_window_scores_benchmark_checks_its_variants(tmp_path):
    out = tmp_path / "window.json"
    run_script("bench_window_scores.py", "--models", "smollm2-135m", "--prompts", "96",
               "--batch", "2", "--window", "16", "--layers", "2", "--iters", "1",
               "--attention", "xla", "--variants", "block=32;block=64,warps=4,lse=1",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["xla", "kernel block=32",
                                         "kernel block=64,num_warps=4,lse=True"]
    for r in rows:  # every kernel setting gives the reference's scores
        assert r["rel_err"] < 1e-3 and r["attention_ms"] > 0 and r["scores_ms"] > 0


def test_kernel_time_sums_the_attention_kernels_of_a_trace(monkeypatch):
    """``kernel_ms`` keeps the attention kernels of the traced chain (ours and JAX's)
    and leaves out the chain's own reductions and adds."""
    import jax.numpy as jnp

    from scripts import decode_cases, device_profile

    traced = [("paged_decode_k8v4_k4v2", 1.60, 32), ("loop_add_fusion", 0.06, 32),
              ("merge_rows", 0.10, 32), ("input_reduce_fusion", 0.04, 32)]
    monkeypatch.setattr(device_profile, "kernel_times", lambda run, calls: (traced, 1.8, 2.0))
    ms, kernels = decode_cases.kernel_ms(lambda q: q * 2, jnp.ones((4, 4)), launches=32)
    assert abs(ms - 1.70 / 32) < 1e-12
    assert [n for n, _ in kernels] == [n for n, _, _ in traced]
    traced[:] = [("loop_add_fusion", 0.06, 32)]  # no attention kernel: no figure
    assert decode_cases.kernel_ms(lambda q: q * 2, jnp.ones((4, 4)), launches=32)[0] is None


def test_attention_time_split_runs_every_setting(tmp_path):
    out = tmp_path / "split.json"
    run_script("attention_time_split.py", "--batch", "2", "--contexts", "256",
               "--mixes", "diffkv-50/50", "--wave", "12", "--chain", "2", "--copy-gib", "0.05",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["wave"], r["logits"]) for r in rows] == [
        (None, True), (None, False), (12, True), (12, False)]
    assert all(r["kern_ms"] > 0 and r["full_ms"] > 0 and r["bytes"] > 0 for r in rows)


def test_float16_dot_serving_holds_the_compiled_tolerance(tmp_path):
    # The compiled engine comparisons' score tolerance (rtol 5e-3, atol 2e-3), with
    # the launch forced to the GPU's float16 dot operands here: the same greedy
    # tokens and every score within it, with the value codes in place or not.
    out = tmp_path / "f16.json"
    run_script("float16_dot_serving.py", "--pair", "tiles", "--rtol", "5e-3", "--atol", "2e-3",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["options"] for r in rows] == ["off", "on"]
    for r in rows:
        assert r["same_tokens"] and r["max_err_over_allowed"] < 1 and r["over"] == 0
        assert 0 < r["max_abs_err"] < 5e-3 and r["scores"] > 1000


def test_kernel_resources_counts_programs_as_the_device_launches_them():
    # The launch records XLA compiled on the device (docs/benchmarks.md 3.0.0m, 3.0.0w,
    # 3.0.0x): one warp at 196 - 201 registers 12.5% occupancy (8 programs), two warps
    # at 128 25% (8), at 143 18.75% (6); shared memory past 28,160 bytes a program
    # leaves room for 7.
    from scripts.kernel_resources import resident_programs

    assert resident_programs(196, 1, 15380) == 8
    assert resident_programs(201, 1, 15380) == 8
    assert resident_programs(168, 1, 15380) == 12
    assert resident_programs(128, 2, 15380) == 8
    assert resident_programs(143, 2, 15380) == 6
    assert resident_programs(128, 2, 28160) == 8
    assert resident_programs(128, 2, 28184) == 7
    assert resident_programs(32, 1, 0) == 32
