"""The decode attention on Pallas' Mosaic GPU backend, against the reference.

Verifies :mod:`pallas_kernels.mosaic_decode` against its reference on the timed
inputs, then times it chained (as a decode step runs one launch per layer) and
on the kernels' own device time, for each split count and pipeline depth, at
Llama3-8B head shapes (32 q / 8 KV heads, head dim 128) over 16-bit pages of 16
tokens (``--pages bf16``) or K8V4 pages (``k8v4``), in a random order. The same
shapes through `bench_attention.py --variants jax-bf16,ours-bf16,diffkv-high`
give JAX's kernel and the Triton-lowered ones; run both in one device call to
compare.

    python scripts/bench_mosaic_decode.py --batches 32,128 --contexts 4096 \\
        --splits 2,4,8 --stages 2,3 --json results/bench_mosaic_decode.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="32,128")
    p.add_argument("--contexts", default="4096")
    p.add_argument("--splits", default="2,4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--chain", type=int, default=32, help="launches chained per call")
    p.add_argument("--pages", default="bf16",
                   help="comma list of page formats: bf16 (16-token pages), k8v4 (the "
                        "DiffKV high tier: 32-token pages, 8-bit keys, 4-bit values)")
    p.add_argument("--operands", default="bf16",
                   help="comma list of the K8V4 launch's dot operand types: bf16, f16")
    p.add_argument("--json", default="results/bench_mosaic_decode.json")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from pallas_kernels import mosaic_decode as md
    from pallas_kernels import paged_decode as pdk
    from scripts.decode_cases import (case_output, copy_bandwidth, kernel_ms, random_case,
                                      time_chained_ms, write_results)

    OPERAND_TYPES = dict(bf16=jnp.bfloat16, f16=jnp.float16)
    nq, H, D = 32, 8, 128
    G = nq // H
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.2f} TB/s", flush=True)
    rows = []
    for S, N, fmt in itertools.product(map(int, args.batches.split(",")),
                                       map(int, args.contexts.split(",")),
                                       args.pages.split(",")):
        # pages (and metadata) made as bench_attention makes its bf16 / diffkv-high ones
        key = jax.random.PRNGKey(S * 7 + N)
        (tier,), nbytes = random_case(key, "bf16" if fmt == "bf16" else "diffkv-high",
                                      S, H, D, N)
        q = jax.random.normal(jax.random.fold_in(key, 1), (S, H, G, D), jnp.bfloat16)
        if fmt == "bf16":
            q = q / math.sqrt(D)
            ref = jax.jit(md.mosaic_decode_reference)(q, tier.keys, tier.values, tier.pages)
            operands = (q, tier.keys, tier.values, tier.pages)
            launch = md.mosaic_decode
        else:
            ref = case_output(q, [tier])
            operands = ((q.astype(jnp.float32) * pdk.logit_scale(D)), tier.keys,
                        tier.values, tier.meta[0], tier.meta[1], tier.pages)
            launch = lambda q, k, v, km, vm, t, **kw: md.mosaic_k8v4(  # noqa: E731
                q, k, v, (km, vm), t, **kw)
        # the 16-bit launch's operands are its pages' type
        types = ["bf16"] if fmt == "bf16" else args.operands.split(",")
        for K, st, ty in itertools.product(map(int, args.splits.split(",")),
                                           map(int, args.stages.split(",")), types):
            name = f"mosaic-{fmt}[K={K},st={st}" + ("]" if fmt == "bf16" else f",{ty}]")
            kw = {} if fmt == "bf16" else dict(operands=OPERAND_TYPES[ty])
            try:
                fn = jax.jit(lambda *a, K=K, st=st, kw=kw, launch=launch: launch(
                    *a, splits=K, stages=st, **kw))
                got = fn(*operands)
                err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
                ms = time_chained_ms(fn, *operands, launches=args.chain)
                own, kernels = kernel_ms(fn, *operands, launches=args.chain,
                                         names=("mosaic", "entry"))
            except Exception as e:  # a setting that does not build is reported
                print(f"skip {name} B={S} N={N}: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                continue
            row = dict(batch=S, context=N, variant=name, splits=K, stages=st, ms=ms,
                       kernel_ms=own, kernels=kernels, bytes=nbytes, rel_err=err,
                       tbps=nbytes / (ms * 1e-3) / 1e12)
            if own:
                row["kernel_tbps"] = nbytes / (own * 1e-3) / 1e12
            rows.append(row)
            print(f"{name} B={S} N={N}: {ms * 1e3:.1f} us chained, own "
                  f"{(own or 0) * 1e3:.1f} us, err {err:.1e}; kernels "
                  + ", ".join(f"{n[:40]} {t * 1e3:.1f}" for n, t in kernels[:4]),
                  flush=True)
        write_results(args.json, bw, args, rows)  # after every shape

    print(f"\n{'B':>4} {'N':>6} {'variant':<26} {'us':>7} {'own us':>7} {'TB/s':>6} "
          f"{'%copy':>6} {'err':>8}")
    for r in rows:
        own = r.get("kernel_ms") or 0
        print(f"{r['batch']:>4} {r['context']:>6} {r['variant']:<26} {r['ms'] * 1e3:7.1f} "
              f"{own * 1e3:7.1f} {r.get('kernel_tbps', 0):6.2f} "
              f"{100 * r.get('kernel_tbps', 0) / bw:5.1f}% {r['rel_err']:8.1e}")


if __name__ == "__main__":
    main()
