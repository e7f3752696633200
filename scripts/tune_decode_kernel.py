#!/usr/bin/env python
"""Sweep launch parameters of the paged decode kernel on one shape (GPU).

    python scripts/tune_decode_kernel.py --model llama3-8b --batch 64 --context 4096
"""

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_attention import SHAPES, bench  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tiers", default="8-4-32,4-2-64,16-16-16")
    p.add_argument("--tokens-per-block", default="64,128,256")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--splits", default="1,4")
    p.add_argument("--prefetch", default="0,1")
    p.add_argument("--dequant", default="0,1", help="1 = dequantize codes in registers")
    p.add_argument("--logits", default="f32,bf16,off")
    p.add_argument("--convert", default="magic,cvt", help="code conversion (LaunchConfig)")
    p.add_argument("--skip", default="", help="diagnostics: ';'-separated sets of stages to "
                   "leave out, each '+'-joined (v, softmax, meta, k_dot); '-' = none")
    p.add_argument("--sequential-pages", action="store_true",
                   help="diagnostics: rows own consecutive pages instead of random ones")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_decode as pdk

    nq, H, D = SHAPES[args.model]
    G = nq // H
    S, N = args.batch, args.context
    q = pdk.pad_group(jax.random.normal(jax.random.PRNGKey(0), (S, H, G, D), jnp.bfloat16), 16)
    rows = []
    for tier in args.tiers.split(","):
        kb, vb, cap = (int(x) for x in tier.split("-"))
        npr = N // cap
        P = S * H * npr
        key = jax.random.PRNGKey(kb * 10 + vb)
        if kb == 16:
            kp = jax.random.normal(key, (P, cap, D), jnp.bfloat16)
            vp = jax.random.normal(key, (P, cap, D), jnp.bfloat16)
            metas = (None,) * 4
            nbytes = N * 4 * D
        else:
            kw, vw = D * kb // 8, D * vb // 8
            kp = jax.random.randint(key, (P, cap, kw + vw), 0, 256, jnp.int32).astype(jnp.uint8)
            vp = kp
            metas = tuple(jax.random.uniform(key, (P, cap), jnp.float16, 0.01, 0.1)
                          for _ in range(4))
            nbytes = N * (kw + vw + 8)
        fmt = pdk.TierFormat(kb, vb, D, cap, 0, 0 if kb == 16 else D * kb // 8)
        order = jnp.arange(P) if args.sequential_pages else jax.random.permutation(key, P)
        pages = order.reshape(S, H, npr).astype(jnp.int32)
        ntok = jnp.full((S, H), N, jnp.int32)
        skips = [() if x == "-" else tuple(x.split("+"))
                 for x in (args.skip.split(";") if args.skip else ["-"])]
        for tpb, warps, stages, splits, lg, pf, dq, cv, skip in itertools.product(
                (int(x) for x in args.tokens_per_block.split(",")),
                (int(x) for x in args.warps.split(",")),
                (int(x) for x in args.stages.split(",")),
                (int(x) for x in args.splits.split(",")), args.logits.split(","),
                (int(x) for x in args.prefetch.split(",")),
                (int(x) for x in args.dequant.split(",")), args.convert.split(","), skips):
            npb = max(1, tpb // cap)
            if npr % (npb * splits):
                continue
            cfg = pdk.LaunchConfig(
                pages_per_block=npb, num_splits=splits, num_warps=warps, num_stages=stages,
                emit_logits=lg != "off", logits_dtype="bfloat16" if lg == "bf16" else "float32",
                prefetch=bool(pf), dequant_in_registers=bool(dq), code_convert=cv,
                skip=skip)
            fn = jax.jit(lambda q, kp, vp, pages, ntok, cfg=cfg: pdk.paged_decode_partials(
                q, kp, vp, *metas, pages, ntok, fmt=fmt, cfg=cfg))
            try:
                ms = bench(fn, q, kp, vp, pages, ntok, reps=10)
            except Exception as e:  # report and keep sweeping
                print(f"K{kb}V{vb} tpb={tpb} w={warps} st={stages} sp={splits} {lg} {cv}: "
                      f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            tb = nbytes * S * H / (ms * 1e-3) / 1e12
            rows.append(dict(tier=tier, tpb=tpb, warps=warps, stages=stages, splits=splits,
                             logits=lg, prefetch=pf, dequant=dq, convert=cv, skip=list(skip),
                             ms=ms, tbps=tb))
            print(f"K{kb}V{vb} tpb={tpb:3d} w={warps} st={stages} sp={splits} pf={pf} dq={dq} "
                  f"{lg:5s} {cv:5s} skip={'+'.join(skip) or '-':14s} "
                  f"{ms:7.3f} ms {tb:5.2f} TB/s", flush=True)
        del kp, vp
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print("\nbest per tier and logits mode:")
    for tier, lg, cv in itertools.product(args.tiers.split(","), args.logits.split(","),
                                          args.convert.split(",")):
        cands = [r for r in rows if r["tier"] == tier and r["logits"] == lg
                 and r["convert"] == cv]
        if cands:
            b = min(cands, key=lambda r: r["ms"])
            print(f"  {tier:9s} {lg:5s} {cv:5s} {b['ms']:.3f} ms {b['tbps']:.2f} TB/s  "
                  f"tpb={b['tpb']} w={b['warps']} st={b['stages']} sp={b['splits']} "
                  f"pf={b['prefetch']} dq={b['dequant']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
