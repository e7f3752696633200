#!/usr/bin/env python
"""Where a decode step's time goes: attention, cache write, compaction, the rest.

For each cache method, ``--batch`` sequences of ``--context`` random tokens are
prefilled (random weights of the model's real architecture), then decode steps
are timed in three builds of the same jitted step that leave parts out:

* ``step``: the real step (``decode_and_sample``, as the engine runs it);
* ``no-attention`` (uncompressed cache only): the attention kernel left out
  (zero output), the cache write kept; DiffKV without its kernel would be no
  ablation (zero probabilities change every decision of the policy), so its
  split comes from the kernel trace (``--profile``);
* ``model-only``: no attention and no cache write (projections, MLP, norms,
  logits, sampling, and the per-step page allocation).

Each build is timed with steps queued back to back (as the engine runs
them; the split below uses these) and blocking on each call. Compaction
(``end_decode``: the per-step page allocation, one prefix sum over the free
list, and the page-table update) is timed alone, queued back to back too. So attention = step
- no-attention, write (quantize + scatter, and DiffKV's score update and
demotion) = no-attention - model-only, model = model-only - compaction. The same run times prompt scoring at ``--prompt``
tokens against prefill attention (the reference, and cuDNN's fused attention
where the backend has it) and checks the cuDNN output against the reference.

    python scripts/step_breakdown.py --model llama3-8b --methods full,diffkv \\
        --batch 64 --context 4096
    python scripts/step_breakdown.py --methods none     # prompt scoring only
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Ablated:
    """A cache method with parts of its decode step left out (for timing only)."""

    def __init__(self, method, drop: str):
        self._m, self._drop = method, drop

    def __getattr__(self, name):
        return getattr(self._m, name)

    def decode_attention(self, state, layer, q, k, v, batch):
        import jax.numpy as jnp

        m = self._m
        if self._drop == "step":
            return m.decode_attention(state, layer, q, k, v, batch)
        zero = jnp.zeros(q.shape, jnp.float32)
        if self._drop == "model-only":
            return state, zero
        # no-attention (the uncompressed cache only): keep the write without the kernel.
        from diffkv_jax.pool_writes import scatter_set

        S = m.max_seqs
        pos = state.lengths[:S]
        rows = state.page_table[:S, layer]
        page = jnp.take_along_axis(rows, (pos // m.page_size)[:, None, None], axis=2)[..., 0]
        page = jnp.where(batch.active[:, None], page, state.k_pages.shape[0])
        off = jnp.broadcast_to((pos % m.page_size)[:, None], page.shape)
        return state.replace(k_pages=scatter_set(state.k_pages, (page, off), k[:, 0]),
                             v_pages=scatter_set(state.v_pages, (page, off), v[:, 0])), zero


VARIANTS = ("step", "no-attention", "model-only")


def time_steps(fn, params, state, batch, smp, iters):
    """Median seconds of ``iters`` chained calls (state donated); returns (t, state)."""
    import jax

    state, tok, _ = fn(params, state, batch, smp)  # warm-up (compiled already)
    jax.block_until_ready(tok)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state, tok, _ = fn(params, state, batch, smp)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], state


def time_pipelined(fn, params, state, batch, smp, iters):
    """Seconds per step of ``iters`` steps queued back to back (as the engine runs
    them: the host queues a step while the previous one executes)."""
    import jax

    t0 = time.perf_counter()
    for _ in range(iters):
        state, tok, _ = fn(params, state, batch, smp)
    jax.block_until_ready(tok)
    return (time.perf_counter() - t0) / iters, state


def breakdown(name, cfg, params, args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.batch import DecodeBatch, PrefillBatch
    from diffkv_jax.generation import Generator, decode_width
    from diffkv_jax.methods import make_method
    from diffkv_jax.steps import CompiledSteps

    B, C = args.batch, args.context
    # Steps each variant and the compaction timing add to every row's context.
    budget = (len(VARIANTS) + 2) * (3 * args.iters + 2) + 2 * (args.profile + 1) + 8
    from scripts.bench_throughput import parse_options

    options = {"attention_impl": args.attention}
    if name == "diffkv":
        options.update(alpha_high=args.alpha_high, alpha_low=args.alpha_low,
                       **parse_options(args.diffkv_options))
    elif name == "full":
        options.update(parse_options(args.full_options))
    method = make_method(name, cfg, max_seqs=B, max_context=C + budget, dtype=jnp.bfloat16,
                         **options)
    num_pages = B * (method.pages_for_tokens(C + budget) + method.num_layers
                     * method.num_kv_heads * method.max_new_pages_per_row)
    steps = CompiledSteps(cfg, method, jnp.bfloat16)
    state = method.init_state(num_pages)
    rng = np.random.default_rng(args.seed)
    pb = args.prefill_batch
    batches = [PrefillBatch(jnp.asarray(rng.integers(0, cfg.vocab_size, size=(pb, C)),
                                        jnp.int32),
                            jnp.full((pb,), C, jnp.int32),
                            jnp.arange(s0, s0 + pb, dtype=jnp.int32)) for s0 in range(0, B, pb)]
    # The last calls are traced (--profile: one warm call, then the traced ones).
    n_trace = min(args.profile, len(batches) - 3) if args.profile else 0
    box = [state]

    def prefill_next():
        box[0], logits = steps.prefill(params, box[0], batches.pop(0))
        jax.block_until_ready(logits)

    t0 = time.perf_counter()
    call_s = []
    while len(batches) > (n_trace + 1 if n_trace > 0 else 0):
        t1 = time.perf_counter()
        prefill_next()
        call_s.append(time.perf_counter() - t1)
    prefill_call_ms = float(np.median(call_s[1:])) * 1e3 if len(call_s) > 1 else float("nan")
    print(f"  {name} prefill: {prefill_call_ms:.1f} ms per call of {pb} x {C} tokens "
          f"({pb * C / prefill_call_ms:.1f} k tokens/s; first call, compilation included: "
          f"{call_s[0]:.1f} s)", flush=True)
    prefill_profile = None
    if n_trace > 0:
        from scripts.device_profile import kernel_times, print_kernel_times

        kt, busy, wall = kernel_times(prefill_next, n_trace)
        print_kernel_times(f"  {name} prefill kernels", kt, busy, wall, top=args.top)
        prefill_profile = dict(kernels=kt[:60], busy_ms=busy, wall_ms=wall)
    state = box[0]
    prefill_s = time.perf_counter() - t0
    stats = method.memory_stats(state)
    width = decode_width(method, C + budget)  # the engine's decode bucket
    dbatch = DecodeBatch(jnp.asarray(rng.integers(0, cfg.vocab_size, size=B), jnp.int32),
                         jnp.ones((B,), bool), width)
    smp = Generator._sampling_arrays([], B, steps=np.zeros(B, np.int32))
    row = dict(method=name, batch=B, context=C, prefill_s=prefill_s,
               prefill_call_ms=prefill_call_ms, prefill_profile=prefill_profile,
               frac_high=stats.get("frac_high"), frac_low=stats.get("frac_low"),
               frac_pruned=stats.get("frac_pruned"),
               kv_ratio=(stats["page_bytes"] + stats["table_bytes"])
               / stats["bytes_16bit_same_tokens"])
    if args.prefill_only:
        return row
    # DiffKV without its kernel is no ablation: zero probabilities change every
    # decision of the policy. Its split comes from the kernel trace (--profile).
    variants = VARIANTS if name == "full" else ("step", "model-only")
    if args.only_step:
        variants = ("step",)
    for v in variants:
        vsteps = CompiledSteps(cfg, Ablated(method, v), jnp.bfloat16)
        fn = vsteps.decode_and_sample.lower(params, state, dbatch, smp).compile()
        t, state = time_steps(fn, params, state, dbatch, smp, args.iters)
        tq, state = time_pipelined(fn, params, state, dbatch, smp, 2 * args.iters)
        # The split uses steps queued back to back, as the engine runs them (a
        # blocking call adds the host's launch time to every step).
        row[v], row[f"{v}_blocking"] = tq * 1e3, t * 1e3
        print(f"  {name} {v}: {tq * 1e3:.2f} ms queued back to back, {t * 1e3:.2f} ms "
              "blocking on each call", flush=True)
        hlo = fn.as_text() if v == "step" and args.hlo_dir else None
        if hlo:  # the optimized HLO, to name the profile's fusions
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"{name}_step.hlo.txt"), "w") as fh:
                fh.write(hlo)
        if v == "step" and args.profile:
            from scripts.device_profile import kernel_times, print_kernel_times

            box = [state]

            def run():
                box[0], tok, _ = fn(params, box[0], dbatch, smp)
                jax.block_until_ready(tok)

            kt, busy, wall = kernel_times(run, args.profile)
            state = box[0]
            print_kernel_times(f"  {name} step kernels", kt, busy, wall, top=args.top)
            print(f"  (trace lines: {kernel_times.last_lines})")
            row["profile"] = dict(kernels=kt, busy_ms=busy, wall_ms=wall,
                                  launches=kernel_times.launches,
                                  idle_before=kernel_times.gaps[:40])
            if hlo:  # each traced kernel's lines of our code
                from scripts.hlo_sources import kernel_sources

                ours = ("diffkv_jax/", "pallas_kernels/", "models/")
                src = kernel_sources(hlo, keep=lambda p: any(k in p for k in ours))
                row["profile"]["sources"] = {k[0]: src.get(k[0], []) for k in kt}
                print(f"  {name}: the top kernels' source lines")
                for k in kt[:args.top]:
                    print(f"     {k[0]:36s} {'; '.join(src.get(k[0], ['?']))}")
    end = jax.jit(method.end_decode, donate_argnums=(0,))
    jax.block_until_ready(state := end(state, dbatch))
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(state := end(state, dbatch))
        times.append(time.perf_counter() - t0)
    row["compaction_blocking_ms"] = sorted(times)[len(times) // 2] * 1e3
    t0 = time.perf_counter()
    for _ in range(2 * args.iters):
        state = end(state, dbatch)
    jax.block_until_ready(state)
    row["compaction_ms"] = (time.perf_counter() - t0) / (2 * args.iters) * 1e3
    if args.profile:  # its kernels' device time: separate calls' wall time includes dispatch
        from scripts.device_profile import kernel_times

        box = [state]

        def run_end():
            box[0] = end(box[0], dbatch)
            jax.block_until_ready(box[0])

        _, busy, _ = kernel_times(run_end, args.profile)
        state = box[0]
        row["compaction_device_ms"] = busy
        print(f"  {name} compaction (end_decode): {row['compaction_ms']:.3f} ms per queued "
              f"call, {busy:.3f} ms of kernels", flush=True)
    if "model-only" not in row:  # --only-step: no split
        row["attention_ms"] = row["write_ms"] = row["model-only"] = float("nan")
    elif "no-attention" in row:
        row["attention_ms"] = row["step"] - row["no-attention"]
        row["write_ms"] = row["no-attention"] - row["model-only"]
    else:  # attention, policy and writes together
        row["attention_ms"], row["write_ms"] = row["step"] - row["model-only"], 0.0
    row["model_ms"] = row["model-only"] - row["compaction_ms"]
    return row


def prompt_scoring_cost(cfg, args):
    """Prefill attention vs prompt scoring for one layer at ``args.prompt`` tokens."""
    import jax
    import jax.numpy as jnp

    from diffkv_jax import attention as attn
    from diffkv_jax import prompt_scoring as ps

    T, nq, H, D = args.prompt, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (1, T, nq, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, H, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, H, D), jnp.bfloat16)
    lengths = jnp.asarray([T], jnp.int32)

    def bench(f):
        """Median ms of a call, and ms per call of calls queued back to back (as a
        prefill's layers run: no host round trip between them)."""
        f = jax.jit(f)  # inputs as arguments: closed-over arrays would be constant-folded
        jax.block_until_ready(f(q, k, v))
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            ts.append(time.perf_counter() - t0)
        n = 4 * args.iters
        t0 = time.perf_counter()
        outs = [f(q, k, v) for _ in range(n)]
        jax.block_until_ready(outs)
        bench.queued = (time.perf_counter() - t0) / n * 1e3
        return sorted(ts)[len(ts) // 2] * 1e3

    out = dict(prompt=T)
    reference = lambda q, k, v: attn.causal_attention(q, k, v, lengths)  # noqa: E731
    out["attention_reference_ms"] = bench(reference)
    try:
        fused = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation="cudnn")
        out["attention_cudnn_ms"] = bench(fused)
        out["attention_cudnn_queued_ms"] = bench.queued
        err = jnp.abs(jax.jit(fused)(q, k, v).astype(jnp.float32)
                      - jax.jit(reference)(q, k, v)).max()
        out["cudnn_max_abs_err"] = float(err)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the backend may lack it
        out["attention_cudnn_error"] = f"{type(e).__name__}: {e}"[:300]
    out["window_scores_ms"] = bench(lambda q, k, v: ps.window_scores(q, k, lengths,
                                                                     args.obs_window))
    out["window_scores_queued_ms"] = bench.queued
    try:  # the Pallas kernel with its own normalizers: two launches
        from pallas_kernels.window_scores import window_scores as window_kernel

        kernel = lambda q, k, v: window_kernel(q, k, lengths, args.obs_window)  # noqa: E731
        out["window_scores_kernel_ms"] = bench(kernel)
        out["window_scores_kernel_queued_ms"] = bench.queued
        if "attention_cudnn_ms" in out:  # what scoring adds to the prefill's attention
            both = lambda q, k, v: (fused(q, k, v), kernel(q, k, v))  # noqa: E731
            out["attention_cudnn_with_window_kernel_ms"] = bench(both)
            out["attention_cudnn_with_window_kernel_queued_ms"] = bench.queued
            out["window_kernel_adds"] = (bench.queued / out["attention_cudnn_queued_ms"]
                                         - 1.0)
        want = jax.jit(lambda q, k, v: ps.window_scores(q, k, lengths, args.obs_window))(q, k, v)
        got = jax.jit(kernel)(q, k, v)
        out["window_kernel_max_rel_err"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
        # As the DiffKV prefill runs it on the GPU: cuDNN's attention with the padding
        # mask and its softmax statistics, the kernel given them (one launch); the
        # baseline is the same attention without the statistics.
        padded = lambda q, k, v: attn.prefill_attention(q, k, v, lengths)  # noqa: E731

        def stats_scored(q, k, v):
            o, lse = attn.prefill_attention_lse(q, k, v, lengths)
            return o, window_kernel(q, k, lengths, args.obs_window, lse=lse)
        if attn.prefill_attention_lse(q, k, v, lengths)[1] is not None:
            bench(padded)
            out["attention_padded_queued_ms"] = bench.queued
            bench(stats_scored)
            out["attention_with_stats_window_kernel_queued_ms"] = bench.queued
            out["window_kernel_with_stats_adds"] = (bench.queued
                                                    / out["attention_padded_queued_ms"] - 1.0)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["window_scores_kernel_error"] = f"{type(e).__name__}: {e}"[:300]
    out["all_query_scores_ms"] = bench(lambda q, k, v: ps.all_query_scores(q, k, lengths))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="preset name (random weights)")
    p.add_argument("--methods", default="full,diffkv")
    p.add_argument("--attention", default="pallas", choices=("reference", "pallas"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--alpha-high", type=float, default=1.0)
    p.add_argument("--alpha-low", type=float, default=0.02)
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens for the scoring "
                   "cost (0 skips it)")
    p.add_argument("--obs-window", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, help="trace this many real steps and "
                   "list the kernels they spend their time in")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--prefill-only", action="store_true",
                   help="time (and with --profile trace) the prefill calls only")
    p.add_argument("--only-step", action="store_true",
                   help="time (and trace) the real step only, no ablations")
    p.add_argument("--json", default=None)
    p.add_argument("--diffkv-options", default="",
                   help="more DiffKV options as key=value;key=value (e.g. decide_impl=pallas)")
    p.add_argument("--full-options", default="",
                   help="more options of the uncompressed cache, as --diffkv-options (e.g. "
                        "early_row_loads=true)")
    p.add_argument("--hlo-dir", default=None, help="write each method's optimized step HLO "
                   "here")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from models.config import get_preset
    from models.loading import random_params

    cfg = get_preset(args.model)
    params = random_params(cfg, args.seed, jnp.bfloat16)
    print(f"device {jax.devices()[0].device_kind}; model {cfg.name}; batch {args.batch} x "
          f"{args.context} tokens", flush=True)
    # (--methods none: the prompt-scoring timings only)
    rows = [breakdown(m, cfg, params, args) for m in args.methods.split(",") if m != "none"]
    scoring = prompt_scoring_cost(cfg, args) if args.prompt else None
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), rows=rows,
                           scoring=scoring), fh, indent=1)
    if scoring:
        print("\nprompt scoring, one layer, "
              + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in scoring.items()))
    if args.prefill_only:  # (each method's prefill line is printed above)
        return 0
    print(f"\n{'method':8s} {'blocking':>8s} {'queued':>7s} {'attention':>10s} {'write':>8s} "
          f"{'compaction':>11s} "
          f"{'model':>8s} {'KV/16bit':>9s} {'tiers h/l/p':>14s}")
    for r in rows:
        tiers = ("-" if r["frac_high"] is None else
                 f"{r['frac_high']:.0%}/{r['frac_low']:.0%}/{r['frac_pruned']:.0%}")
        print(f"{r['method']:8s} {r['step_blocking']:8.2f} {r['step']:7.2f} "
              f"{r['attention_ms']:10.2f} {r['write_ms']:8.2f} {r['compaction_ms']:11.2f} {r['model_ms']:8.2f} {r['kv_ratio']:9.1%} {tiers:>14s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
