#!/usr/bin/env python
"""What observation-window prompt scoring adds to prefill attention, on one GPU.

For each model's head shapes and prompt length, ``--layers`` layers run in one
jitted call (unrolled over per-layer random q / k / v, each its own buffer, as
a prefill's layers hand the attention their projections; a scan over stacked
inputs would add a copy of every slice), so the host's dispatch stays out of
the figures:

* ``attention``: cuDNN's fused causal attention (``jax.nn.dot_product_attention``,
  the prefill's attention on the GPU; ``--attention xla`` on a CPU) alone;
* ``attention + scores``: the same with the window's scores of every layer, by
  the Pallas kernel (:func:`pallas_kernels.window_scores.window_scores`, one
  row per ``--variants`` entry) and by XLA
  (:func:`diffkv_jax.prompt_scoring.window_scores`, the reference);
* ``scores``: the scoring alone.

A variant with ``lse=1`` takes the window's softmax normalizers from the
attention itself (cuDNN's softmax statistics, :func:`diffkv_jax.attention.
prefill_attention_lse`): its ``attention + scores`` runs that attention, and
its ``scores`` the scoring launch alone, given them.

``adds`` is ``attention + scores`` over ``attention``, minus one, in wall time;
with ``--profile``, ``dev.adds`` is the same ratio of the GPU's summed kernel
time (from a profiler trace; host gaps left out). Every variant
is first checked against the reference on one layer (``rel.err``: largest
absolute difference over the largest score). Prints a table last, and the
results as JSON with ``--json``.

    python scripts/bench_window_scores.py
    python scripts/bench_window_scores.py --models llama3-8b --prompts 4096,16384 \\
        --variants "block=128,warps=8,lse=1;block=64,warps=4,lse=1"
"""

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_variants(text: str) -> list[dict]:
    """``"block=128,warps=8;block=64"`` -> keyword arguments of the kernel."""
    names = {"block": "block", "warps": "num_warps"}
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        kw = {}
        for pair in filter(None, item.split(",")):
            key, _, value = pair.partition("=")
            if key.strip() == "lse":  # normalizers from the attention's statistics
                kw["lse"] = bool(int(value))
                continue
            if key.strip() not in names:
                raise SystemExit(f"unknown variant setting {key!r}; known: {', '.join(names)}")
            kw[names[key.strip()]] = int(value)
        out.append(kw)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,smollm2-135m")
    p.add_argument("--prompts", default="4096", help="comma list of prompt lengths")
    p.add_argument("--batch", type=int, default=1, help="prompts per prefill call")
    p.add_argument("--window", type=int, default=64, help="observation window (queries)")
    p.add_argument("--layers", type=int, default=32, help="layers chained per timed call")
    p.add_argument("--iters", type=int, default=10, help="timed calls (the median is kept)")
    p.add_argument("--variants", default="block=128,warps=8;block=128,warps=8,lse=1",
                   help="kernel settings, ';'-separated: block=N,warps=N,lse=0|1 (the "
                        "normalizers from cuDNN's softmax statistics)")
    p.add_argument("--profile", action="store_true",
                   help="also print each kernel's device time in attention + scores")
    p.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"),
                   help="the prefill attention's implementation (xla runs on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from diffkv_jax import attention as attn_lib
    from diffkv_jax import prompt_scoring as ps
    from models.config import get_preset
    from pallas_kernels.window_scores import window_scores as window_kernel

    variants = parse_variants(args.variants)
    L, B, W = args.layers, args.batch, args.window

    def attention(q, k, v, lengths):
        """The prefill's causal attention over ragged prompts (cuDNN's padding mask)."""
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                            key_value_seq_lengths=lengths,
                                            implementation=args.attention)

    def attention_lse(q, k, v, lengths):
        """The same with its softmax statistics, where cuDNN gives them."""
        if args.attention == "cudnn":
            return attn_lib._cudnn_attention_and_lse(q, k, v, lengths)
        return attention(q, k, v, lengths), None

    def layers(layer_fn):
        """One jitted call running ``layer_fn`` on each layer's inputs. The layers'
        scores leave as one stacked array (as many outputs as the attention alone
        has, or one: returning an array per layer costs the host more than the
        scores cost the GPU)."""
        def run(xs):
            results = [layer_fn(*x) for x in zip(*xs)]
            if isinstance(results[0], tuple):  # (attention, scores) per layer
                return [r[0] for r in results], jnp.stack([r[1] for r in results])
            return results if results[0] is None or results[0].ndim == 4 else jnp.stack(results)
        return jax.jit(run)

    def per_layer_ms(layer_fn, xs):
        """Median ms per layer of ``layer_fn`` over the ``L`` layers of ``xs``."""
        f = layers(layer_fn)
        jax.block_until_ready(f(xs))
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(xs))
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1e3 / L

    rows = []
    for model in args.models.split(","):
        cfg = get_preset(model)
        nq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for T in (int(t) for t in args.prompts.split(",")):
            kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
            xs = tuple([jax.random.normal(jax.random.fold_in(key, i), (B, T, n, D), jnp.bfloat16)
                        for i in range(L)] for key, n in ((kq, nq), (kk, H), (kv, H)))
            # Ragged prompts in a batch: the first fills the bucket, the others are shorter.
            lengths = jnp.asarray([T - (T // 3) * (i % 3) for i in range(B)], jnp.int32)
            base = dict(model=model, prompt=T, batch=B, window=W, layers=L)
            attend = functools.partial(attention, lengths=lengths)
            attn_ms = per_layer_ms(attend, xs)
            print(f"{model} T={T}: attention {attn_ms:.4f} ms/layer", flush=True)
            if args.profile:
                from scripts.device_profile import kernel_times, print_kernel_times
                f = layers(attend)
                attn_prof = kernel_times(lambda x=xs: jax.block_until_ready(f(x)), calls=3)
                print_kernel_times(f"  attention ({L} layers)", *attn_prof, top=4)
            # Each layer's softmax statistics, for timing the scores alone from them.
            lses = list(layers(lambda q, k, v: attention_lse(q, k, v, lengths)[1])(xs))

            def impl(kw):
                """(layer with the scores -> (attention, scores), scores alone from
                (q, k, lse)) for kernel settings ``kw`` (``lse``: from the attention)."""
                kw = dict(kw)
                if not kw.pop("lse", False):
                    fn = lambda q, k: window_kernel(q, k, lengths, W, **kw)  # noqa: E731
                    return (lambda q, k, v: (attend(q, k, v), fn(q, k)),
                            lambda q, k, lse: fn(q, k))

                def both(q, k, v):
                    out, lse = attention_lse(q, k, v, lengths)
                    return out, window_kernel(q, k, lengths, W, lse=lse, **kw)
                return both, lambda q, k, lse: window_kernel(q, k, lengths, W, lse=lse, **kw)

            xla = lambda q, k: ps.window_scores(q, k, lengths, W)  # noqa: E731
            want = jax.jit(xla)(xs[0][0], xs[1][0])
            scale = float(jnp.abs(want).max())
            impls = [("xla", {}, (lambda q, k, v: (attend(q, k, v), xla(q, k)),
                                  lambda q, k, lse: xla(q, k)))]
            impls += [("kernel " + ",".join(f"{k}={v}" for k, v in kw.items()), kw, impl(kw))
                      for kw in variants]
            for name, kw, (layer, alone_fn) in impls:
                got = jax.jit(alone_fn)(xs[0][0], xs[1][0], lses[0])
                err = float(jnp.abs(got - want).max()) / scale
                alone = per_layer_ms(alone_fn, (xs[0], xs[1], lses))
                both = per_layer_ms(layer, xs)
                row = dict(base, impl=name, settings=kw, attention_ms=attn_ms, scores_ms=alone,
                           attention_and_scores_ms=both, adds=both / attn_ms - 1.0, rel_err=err)
                rows.append(row)
                if args.profile:
                    # Device time only: the kernels' busy time with the scores over
                    # the attention's alone (host gaps left out).
                    f = layers(layer)
                    prof = kernel_times(lambda x=xs: jax.block_until_ready(f(x)), calls=3)
                    print_kernel_times(f"  {name} (attention + scores, {L} layers)", *prof,
                                       top=6)
                    if attn_prof[1]:
                        row.update(attention_busy_ms=attn_prof[1] / L, busy_ms=prof[1] / L,
                                   busy_adds=prof[1] / attn_prof[1] - 1.0)
                        print(f"  {name}: device time adds {row['busy_adds']:.1%} "
                              f"({row['busy_ms']:.4f} over {row['attention_busy_ms']:.4f} "
                              "ms/layer)", flush=True)
                    else:
                        print("  (no GPU kernels in the trace: device time left out)")
                print(f"  {name}: scores {alone:.4f}, with attention {both:.4f} ms/layer "
                      f"(+{row['adds']:.1%}), rel.err {err:.1e}", flush=True)
            del xs
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                               "rows": rows}, fh, indent=1)

    print(f"\ndevice {jax.devices()[0].device_kind}; {L} layers per call, "
          f"batch {B}, window {W}; ms per layer")
    print(f"{'model':14s} {'T':>6s} {'impl':28s} {'attn':>8s} {'scores':>8s} {'both':>8s} "
          f"{'adds':>7s} {'dev.adds':>8s} {'rel.err':>8s}")
    for r in rows:
        busy = f"{r['busy_adds']:8.1%}" if "busy_adds" in r else f"{'-':>8s}"
        print(f"{r['model']:14s} {r['prompt']:6d} {r['impl']:28s} {r['attention_ms']:8.4f} "
              f"{r['scores_ms']:8.4f} {r['attention_and_scores_ms']:8.4f} {r['adds']:7.1%} "
              f"{busy} {r['rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
