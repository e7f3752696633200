#!/usr/bin/env python
"""End-to-end serving throughput of the engine, one cache method after another.

Every method gets the same KV memory budget and the same requests: prompts
with the token-length distribution of MATH-500 problems
(``scripts/workloads/math500_prompt_tokens.json``), random token ids, and a
fixed number of generated tokens with EOS ignored (as DiffKV's own benchmark
does). Weights are random with the model's real architecture, generated on
the device, unless ``--model-path`` gives a checkpoint.

    python scripts/bench_throughput.py --model llama3-8b --methods full,diffkv \\
        --kv-budget-gb 8 --num-requests 384 --output-len 4096 --time-limit 300

``--natural-eos`` serves a real model instead (``--model-path``, or the
embedded default model by name): MATH-500 problems as chat prompts (the
model's template, when it has one), each request ending at the model's EOS
tokens or after ``--output-len`` tokens, whichever comes first. It reports the
response lengths too, since a compressed cache can change them:

    python scripts/bench_throughput.py --model smollm2-135m --natural-eos \\
        --methods full,diffkv --num-requests 64 --output-len 1024 --kv-budget-gb 0.05

Methods take options after a colon, ``;``-separated: e.g.
``"diffkv:high_frac=0.3;low_frac=0.4"`` runs DiffKV at a fixed tier mix (30% of
tokens K8V4, 40% K4V2, the rest pruned: a sweep point, since random weights
attend almost uniformly and the thresholds then prune nothing), and
``diffkv:write_impl=pallas`` the token-writes kernel.

Per method it reports generated tokens/s (decode and overall, compilation
excluded), finished requests/s, the running batch over time (achieved batch),
time to first token and per-token latency percentiles, the host share of the
step (engine wall time outside the jitted decode call), and the cache's tier
mix and bytes at its peak. With ``--profile-steps N``, N steps are traced once
``--profile-at`` seconds have run and their device time is split by kind of
kernel (attention, policy, matmuls, cache writes, other); those steps and
their time are left out of the throughput and latency figures. A compact
table is printed last; JSON and plots go to ``--out``.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads",
                        "math500_prompt_tokens.json")


def parse_options(text: str) -> dict:
    """``alpha_high=1.5;low=off`` -> ``{"alpha_high": 1.5, "low": "off"}`` (JSON values,
    else strings)."""
    options = {}
    for kv in filter(None, text.split(";")):
        k, _, v = kv.partition("=")
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    return options


def parse_methods(text: str):
    """``full,diffkv:alpha_high=1.5;low=off`` -> [(label, name, options)]."""
    out = []
    for item in text.split(","):
        name, _, opts = item.partition(":")
        out.append((item, name, parse_options(opts)))
    return out


def percentile(xs, q):
    import numpy as np

    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else float("nan")


def math_chat_prompts(tokenizer, count: int, rng) -> list[list[int]]:
    """``count`` MATH-500 problems (shuffled, repeated past 500) as prompt ids, through
    the tokenizer's chat template when it has one."""
    from diffkv_jax.evaluation.datasets import load_math500

    problems = load_math500()
    order = rng.permutation(len(problems))
    prompts = []
    for i in range(count):
        text = (f"{problems[order[i % len(problems)]].problem}\n\nPlease reason step by "
                "step, and put your final answer within \\boxed{}.")
        if tokenizer.chat_template:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            prompts.append(tokenizer.encode(chat, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(text))
    return prompts


def run_method(label, name, options, cfg, params, args, prompts, stop_ids=()):
    import jax.numpy as jnp

    from diffkv_jax.engine import Engine
    from diffkv_jax.memory_budget import pages_for_memory
    from diffkv_jax.generation import SamplingParams
    from diffkv_jax.methods import make_method

    dtype = jnp.bfloat16
    max_context = max(len(p) for p in prompts) + args.output_len + 1
    options = dict(options)
    options.setdefault("attention_impl", args.attention)
    method = make_method(name, cfg, max_seqs=args.max_batch, max_context=max_context,
                         dtype=dtype, **options)
    # The same budget for every method: the whole cache state, page tables included.
    num_pages = pages_for_memory(method, int(args.kv_budget_gb * 2**30))
    chunk = args.prefill_chunk if getattr(method, "supports_chunked_prefill", False) else None
    engine = Engine(cfg, params, method, num_pages, dtype=dtype,
                    max_prefill_batch=args.prefill_batch,
                    admit_headroom_tokens=args.admit_headroom, prefill_chunk=chunk,
                    preemption=args.preemption,
                    swap_pool_bytes=int(args.swap_pool_gb * 2**30))
    engine.READ_BEFORE_PREEMPTING = not args.preempt_on_bound
    sampling = SamplingParams(max_new_tokens=args.output_len, stop_token_ids=stop_ids)
    submitted = time.perf_counter()
    ids = [engine.add_request(p, sampling) for p in prompts]
    first_token = {}
    batch_trace, steps, decode_walls = [], [], []
    t_start = time.perf_counter()
    if args.warm_up:  # counted in the wall limit, excluded (as compilation) from the rates
        engine.warm_up()
    profile, profile_s, profile_tokens = None, 0.0, 0
    generated = 0  # tokens returned by the steps counted (the traced ones left out)
    cut = False  # whether the wall limit ended the run before the time limit
    while engine.has_unfinished():
        if (args.profile_steps and profile is None
                and time.perf_counter() - t_start - engine.compile_seconds - profile_s
                > args.profile_at):
            before = sum(len(engine.requests[i].output) for i in ids)
            profile, spent = profile_steps(engine, args.profile_steps)
            profile_s += spent
            profile_tokens = sum(len(engine.requests[i].output) for i in ids) - before
            continue
        pre0 = engine.prefill_seconds
        new = engine.step()
        t1 = time.perf_counter()
        running = sum(s is not None for s in engine.slots)
        wall, wait, calls = engine.last_step
        steps.append((wall, wait, calls))
        if engine.prefill_seconds == pre0:
            decode_walls.append(wall)
        generated += sum(len(v) for v in new.values())
        # (seconds served, running requests, tokens generated so far): rates over any
        # window, e.g. the one two methods share (scripts/compare_throughput.py).
        batch_trace.append((t1 - t_start - engine.compile_seconds - profile_s, running,
                            generated))
        for rid in new:
            # Seconds since submission, compilation so far excluded.
            first_token.setdefault(rid, t1 - submitted - engine.compile_seconds)
        if t1 - t_start - engine.compile_seconds - profile_s > args.time_limit:
            break
        if t1 - t_start > args.wall_limit:
            cut = True
            break
    wall = time.perf_counter() - t_start - engine.compile_seconds - profile_s
    gen_tokens = sum(len(engine.requests[i].output) for i in ids) - profile_tokens
    done = [i for i in ids if engine.requests[i].status == "finished"]
    walls = [w for w, _, _ in steps]
    stats = engine.peak_memory or method.memory_stats(engine.state)
    ttft = [first_token[i] for i in ids if i in first_token]
    # Tokens of the finished requests' answers (EOS included): with --natural-eos
    # the model decides them, and a compressed cache can make them longer.
    lengths = [len(engine.requests[i].output) for i in done]
    return dict(
        response_tokens_mean=sum(lengths) / len(lengths) if lengths else float("nan"),
        response_tokens_p50=percentile(lengths, 50),
        response_tokens_p90=percentile(lengths, 90),
        stopped_at_eos=sum(engine.requests[i].finish_reason == "stop" for i in done),
        stop_token_ids=list(stop_ids),
        method=label, num_pages=num_pages, page_bytes=method.page_bytes,
        wall_s=wall, compile_s=engine.compile_seconds,
        # True when the wall limit (compilation included) ended the run before
        # --time-limit seconds were served: rates are then over a shorter window
        # than other runs', and this workload's rate changes with the window.
        window_cut=cut,
        generated_tokens=gen_tokens, tokens_per_s=gen_tokens / wall,
        decode_tokens_per_s=engine.decode_tokens / max(engine.decode_seconds, 1e-9),
        finished=len(done), requests_per_s=len(done) / wall,
        mean_batch=sum(b for _, b, _ in batch_trace) / max(1, len(batch_trace)),
        max_batch=max((b for _, b, _ in batch_trace), default=0),
        preemptions=sum(engine.requests[i].preemptions for i in ids),
        # Steps that read every result in flight before preempting (the exact free
        # count), and the caches swapped out / in (--preemption swap).
        preemption_syncs=engine.preemption_syncs,
        # Recoveries from a device allocation that found the pool too short (0 unless
        # the host's page reserve is wrong; every running request recomputed).
        allocation_recoveries=engine.allocation_recoveries,
        swap_outs=engine.swap_outs, swap_ins=engine.swap_ins,
        swap_moved_gb=engine.swap_moved_bytes / 2**30,
        # Prompt tokens prefilled, recomputation after preemption included.
        prefill_tokens=engine.prefill_tokens,
        # Rows x tokens of the prefill buckets run (padding included).
        prefill_padded_tokens=engine.prefill_padded_tokens,
        prompt_tokens=sum(len(p) for p in prompts),
        prefill_steps=len(walls) - len(decode_walls),
        prefill_share=engine.prefill_seconds / max(sum(walls), 1e-9),
        executables=engine.num_compiled,
        steps=len(batch_trace), step_ms_p50=percentile(walls, 50) * 1e3,
        step_ms_p90=percentile(walls, 90) * 1e3, step_ms_p99=percentile(walls, 99) * 1e3,
        # Python scheduling and bookkeeping (outside device calls and waits) per
        # step: an upper bound on the host overhead, whether or not it overlaps.
        host_share=engine.host_seconds / max(sum(walls), 1e-9),
        host_ms_p50=percentile([max(w - d - c, 0.0) for w, d, c in steps], 50) * 1e3,
        call_share=engine.call_seconds / max(sum(walls), 1e-9),
        # The most the device can have idled waiting for the host (Engine docstring).
        exposed_host_share=engine.exposed_host_seconds / max(sum(walls), 1e-9),
        wait_share=engine.wait_seconds / max(sum(walls), 1e-9),
        ttft_s_p50=percentile(ttft, 50), ttft_s_p90=percentile(ttft, 90),
        # Wall time of a step that only decoded: the time between a request's tokens.
        per_token_ms_p50=percentile(decode_walls, 50) * 1e3,
        per_token_ms_p90=percentile(decode_walls, 90) * 1e3,
        batch_trace=batch_trace,
        step_profile=profile,
        memory={k: (float(v) if isinstance(v, (int, float)) else v) for k, v in stats.items()
                if isinstance(v, (int, float, str))},
    ), engine


def profile_steps(engine, n):
    """Trace ``n`` engine steps (each waited for) and split their device time by kind
    of kernel (``scripts/device_profile.py``). Returns (profile, seconds spent);
    the caller leaves those seconds out of the throughput."""
    import jax

    from scripts.device_profile import kernel_times, step_parts

    t0 = time.perf_counter()
    c0 = engine.compile_seconds
    running = sum(s is not None for s in engine.slots)

    def run():
        engine.step()
        jax.block_until_ready(engine.state)

    with engine.unaccounted():  # traced steps block on the device and are left out
        rows, busy, wall = kernel_times(run, n)
    spent = time.perf_counter() - t0 - (engine.compile_seconds - c0)
    return dict(steps=n, running=running, wall_ms=wall, busy_ms=busy,
                launches=kernel_times.launches, parts_ms=step_parts(rows),
                kernels=rows), spent  # every kernel, so "other" can be read launch by launch


def plots(results, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        t = [row[0] for row in r["batch_trace"]]
        b = [row[1] for row in r["batch_trace"]]
        ax.plot(t, b, label=f"{r['method']} ({r['tokens_per_s']:.0f} tok/s)")
    ax.set_xlabel("seconds (compilation excluded)")
    ax.set_ylabel("running requests")
    ax.set_title("achieved batch size")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "batch_over_time.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="preset name (random weights)")
    p.add_argument("--model-path", default=None, help="real checkpoint instead of random")
    p.add_argument("--natural-eos", action="store_true",
                   help="a real model (--model-path, or the embedded model by name) on "
                        "MATH-500 chat prompts, each request ending at the model's EOS "
                        "(--output-len caps it)")
    p.add_argument("--methods", default="full,diffkv",
                   help="comma list; options as name:key=value;key=value")
    p.add_argument("--attention", default="pallas", choices=("reference", "pallas"))
    p.add_argument("--kv-budget-gb", type=float, default=8.0,
                   help="the cache's memory in GiB, page tables included (same for every method)")
    p.add_argument("--num-requests", type=int, default=384)
    p.add_argument("--output-len", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill prompts in chunks of this many tokens (methods that can)")
    p.add_argument("--preemption", default="recompute", choices=("recompute", "swap"),
                   help="what a preempted request's cache becomes: recomputed later, or "
                        "swapped to host memory and back (Engine(preemption=...))")
    p.add_argument("--swap-pool-gb", type=float, default=0.0,
                   help="with --preemption swap: page-locked host memory allocated before "
                        "serving (Engine(swap_pool_bytes=...))")
    p.add_argument("--preempt-on-bound", action="store_true",
                   help="preempt on the free-page bound alone, without reading the results "
                        "in flight first (Engine.READ_BEFORE_PREEMPTING = False)")
    p.add_argument("--admit-headroom", type=int, default=0,
                   help="tokens of growth per running request kept free at admission")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="stop a method after this many seconds (compilation excluded)")
    p.add_argument("--wall-limit", type=float, default=float("inf"),
                   help="stop a method after this many seconds, compilation included")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="trace this many steps once --profile-at seconds have run and "
                        "split their device time: attention, policy, matmuls, cache "
                        "writes, other (left out of the throughput)")
    p.add_argument("--profile-at", type=float, default=60.0)
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="compile decode buckets when first used instead of before serving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/throughput")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.config import get_preset
    from models.loading import load_model, random_params

    rng = np.random.default_rng(args.seed)
    stop_ids = ()
    if args.model_path or args.natural_eos:
        loaded = load_model(args.model, args.model_path, dtype=jnp.bfloat16)
        cfg, params = loaded.cfg, loaded.params
    else:
        cfg = get_preset(args.model)
        params = random_params(cfg, args.seed, jnp.bfloat16)
    if args.natural_eos:
        stop_ids = tuple(loaded.tokenizer.eos_token_ids)
        if not stop_ids:
            raise SystemExit(f"{args.model}: the tokenizer names no EOS token; "
                             "--natural-eos needs one")
        prompts = math_chat_prompts(loaded.tokenizer, args.num_requests, rng)
        lens = [len(p) for p in prompts]
    else:
        with open(WORKLOAD) as fh:
            lengths = json.load(fh)["lengths"]
        lens = rng.choice(lengths, size=args.num_requests)
        prompts = [list(rng.integers(0, cfg.vocab_size, size=int(n))) for n in lens]
    print(f"device {jax.devices()[0].device_kind}; model {cfg.name}; {args.num_requests} "
          f"requests, prompt tokens mean {np.mean(lens):.0f}, output "
          f"{'up to ' if args.natural_eos else ''}{args.output_len}; "
          f"KV budget {args.kv_budget_gb} GiB", flush=True)
    results = []
    for label, name, options in parse_methods(args.methods):
        res, engine = run_method(label, name, options, cfg, params, args, prompts, stop_ids)
        results.append(res)
        print(f"{label}: {res['tokens_per_s']:.0f} tok/s, mean batch {res['mean_batch']:.1f}, "
              f"max {res['max_batch']}, {res['finished']} finished, step p50 "
              f"{res['step_ms_p50']:.1f} ms (decode-only p50 {res['per_token_ms_p50']:.1f} ms), "
              f"host {res['host_share']:.1%} (device calls {res['call_share']:.1%}, waiting "
              f"{res['wait_share']:.1%}, device idle for the host at most "
              f"{res['exposed_host_share']:.1%}); {res['steps']} steps, {res['prefill_steps']} with "
              f"prefill ({res['prefill_share']:.1%} of the time), prefilled "
              f"{res['prefill_tokens']} tokens ({res['prefill_padded_tokens']} padded) for "
              f"{res['prompt_tokens']} prompt tokens, "
              f"{res['preemptions']} preemptions ({res['swap_outs']} swapped out, "
              f"{res['swap_moved_gb']:.1f} GiB moved; {res['preemption_syncs']} steps read "
              f"everything before preempting, {res['allocation_recoveries']} allocation "
              f"recoveries); compile {res['compile_s']:.0f} s for "
              f"{res['executables']} executables", flush=True)
        if res["step_profile"]:
            prof = res["step_profile"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["parts_ms"].items(),
                                                              key=lambda kv: -kv[1]))
            print(f"  {prof['steps']} traced steps at {prof['running']} running: wall "
                  f"{prof['wall_ms']:.2f} ms, kernels {prof['busy_ms']:.2f} ms ({parts}); "
                  f"{prof['launches']:.0f} launches", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"throughput_{len(results)}.json"), "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), result=res),
                      fh, indent=1)
        del engine
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "throughput.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), results=results),
                  fh, indent=1)
    plots(results, args.out)
    base = results[0]["tokens_per_s"]
    for r in results:
        if r["window_cut"]:
            print(f"WARNING: {r['method']} served {r['wall_s']:.1f} s, not the "
                  f"{args.time_limit:.0f} s of --time-limit: the wall limit ended it. "
                  f"Compare runs over the window they share "
                  f"(scripts/compare_throughput.py).", flush=True)
    if len(results) > 1:
        from scripts.compare_throughput import compare_lines

        try:
            print("\n" + "\n".join(compare_lines(results)))
        except ValueError as e:  # a run that served no step
            print(f"\nno window every run served: {e}")
    print(f"\n{'method':28s} {'tok/s':>8s} {'vs first':>8s} {'req/s':>6s} {'mean B':>7s} "
          f"{'max B':>6s} {'step p50':>9s} {'p90':>7s} {'host':>6s} {'TTFT p50':>9s} "
          f"{'preempt':>7s} {'KV/16bit':>8s}")
    for r in results:
        m = r["memory"]
        ratio = ((m.get("page_bytes", 0) + m.get("table_bytes", 0))
                 / m["bytes_16bit_same_tokens"] if m.get("bytes_16bit_same_tokens")
                 else float("nan"))
        print(f"{r['method']:28s} {r['tokens_per_s']:8.0f} {r['tokens_per_s'] / base:7.2f}x "
              f"{r['requests_per_s']:6.2f} {r['mean_batch']:7.1f} {r['max_batch']:6d} "
              f"{r['step_ms_p50']:8.1f}ms {r['step_ms_p90']:6.1f} {r['host_share']:6.1%} "
              f"{r['ttft_s_p50']:8.2f}s {r['preemptions']:7d} {ratio:8.1%}")
    if args.natural_eos:
        print(f"\n{'method':28s} {'finished':>8s} {'at EOS':>7s} {'answer tokens mean':>19s} "
              f"{'p50':>6s} {'p90':>6s}")
        for r in results:
            print(f"{r['method']:28s} {r['finished']:8d} {r['stopped_at_eos']:7d} "
                  f"{r['response_tokens_mean']:19.1f} {r['response_tokens_p50']:6.0f} "
                  f"{r['response_tokens_p90']:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
