#!/usr/bin/env python
"""Sweep launch settings of the paged decode kernel on one shape (GPU).

    python scripts/tune_decode_kernel.py --model llama3-8b --batch 64 --context 4096 \\
        --mixes diffkv-high,diffkv-low --warps 1,2 --stages 2,3,4

Each setting is checked against the plain-jnp reference on a small batch of
the same geometry before it is timed; the table lists time, bytes read and
achieved bandwidth, and JAX's own bf16 ``paged_attention`` on the same
logical KV for scale.
"""

import argparse
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--mixes", default="bf16,int8,diffkv-high,diffkv-low,diffkv-50/50")
    p.add_argument("--warps", default="1,2")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--splits", default="1")
    p.add_argument("--lazy", default="1,0", help="1 = rescale only when the max grows")
    p.add_argument("--logits", default="1", help="1 = emit the policy's logits")
    p.add_argument("--sub", default="0", help="slots per loop step (LaunchConfig.sub_slots; "
                   "0 = whole pages)")
    p.add_argument("--lanes", default="1", help="pages per loop step (LaunchConfig.page_lanes)")
    p.add_argument("--work", action="store_true", help="launch over balanced work items "
                   "(plan_work, as the caches do) instead of even splits")
    p.add_argument("--items", default="0", help="with --work: work items of the launch "
                   "(0 = the caches' count, diffkv_kernel_attention.work_items)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    from diffkv_jax.diffkv_kernel_attention import work_items
    from pallas_kernels import paged_decode as pdk
    from scripts.decode_cases import SHAPES, case_output, copy_bandwidth, random_case, time_ms

    nq, H, D = SHAPES[args.model]
    G = nq // H
    S, N = args.batch, args.context
    bw = copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {bw:.2f} TB/s", flush=True)
    key = jax.random.PRNGKey(0)
    q = pdk.pad_group(jax.random.normal(key, (S, H, G, D), jnp.bfloat16), 16)

    # JAX's kernel on bf16 pages of 16 tokens, same logical KV.
    ps, per_row = 16, N // 16
    kp = jax.random.normal(key, (H, S * per_row, ps, D), jnp.bfloat16)
    tables = jax.random.permutation(key, S * per_row).reshape(S, per_row).astype(jnp.int32)
    jax_fn = jax.jit(functools.partial(jax_pa.paged_attention, pages_per_compute_block=8,
                                       k_splits=min(16, per_row // 8), block_h=16))
    jax_ms = time_ms(jax_fn, q[:, :, :G].reshape(S, nq, D), kp, kp, tables,
                     jnp.full((S,), N, jnp.int32))
    jax_bytes = S * H * (N * 4 * D + per_row * 4)
    del kp
    print(f"jax-bf16 paged_attention: {jax_ms:.3f} ms, {jax_bytes / jax_ms / 1e9:.2f} TB/s",
          flush=True)

    rows = []
    for mix in args.mixes.split(","):
        tiers, nbytes = random_case(jax.random.fold_in(key, hash(mix) % 1000), mix, S, H, D, N)
        small, _ = random_case(jax.random.fold_in(key, 7), mix, 2, H, D, min(N, 1024))
        rout = case_output(q[:2, :, :G], small)
        for warps, stages, splits, lazy, lg, sub, lanes, items in itertools.product(
                *(list(map(int, a.split(","))) for a in (args.warps, args.stages, args.splits,
                                                         args.lazy, args.logits, args.sub,
                                                         args.lanes, args.items))):
            if lanes > 1 and (sub or mix == "bf16"):
                continue
            cfg = pdk.LaunchConfig(num_splits=splits, num_warps=warps, num_stages=stages,
                                   lazy_rescale=bool(lazy), emit_logits=bool(lg),
                                   sub_slots=sub, page_lanes=lanes)

            @jax.jit
            def fn(q, tiers, cfg=cfg, items=items):
                if not args.work:
                    o, m, l, lg = pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg)
                    return pdk.merge_partials([(o, m, l)])[0], lg
                rows = q.shape[0]
                work = pdk.plan_work(pdk.row_pages(tiers), items or work_items(rows, H))
                o, m, l, lg = pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg, work=work)
                return pdk.merge_work(o, m, l, work, rows, H)[0], lg

            name = (f"{mix:13s} w={warps} st={stages} sp={splits} lazy={lazy} logits={lg} "
                    f"sub={sub} lanes={lanes}" + (f" items={items}" if items else ""))
            try:
                out = fn(q[:2], small)[0]
                err = float(jnp.abs(out[:, :, :G] - rout).max() / jnp.abs(rout).max())
                ms = time_ms(fn, q, tiers)
            except Exception as e:  # report and keep sweeping
                print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                      flush=True)
                continue
            tb = nbytes / (ms * 1e-3) / 1e12
            rows.append(dict(mix=mix, warps=warps, stages=stages, splits=splits, lazy=lazy,
                             logits=lg, sub=sub, lanes=lanes, items=items, ms=ms, tbps=tb, err=err,
                             speedup_vs_jax=jax_ms / ms))
            print(f"{name}: {ms:7.3f} ms {tb:5.2f} TB/s ({tb / bw:4.0%} copy) "
                  f"{jax_ms / ms:5.2f}x jax  rel.err {err:.1e}", flush=True)
        del tiers
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(copy_tbps=bw, jax_ms=jax_ms, rows=rows), fh, indent=1)
    print(f"\nbest per mix ({args.model} B={S} N={N}; jax bf16 {jax_ms:.3f} ms; "
          f"copy {bw:.2f} TB/s):")
    for mix in args.mixes.split(","):
        cands = [r for r in rows if r["mix"] == mix]
        if cands:
            b = min(cands, key=lambda r: r["ms"])
            print(f"  {mix:13s} {b['ms']:.3f} ms {b['tbps']:.2f} TB/s {b['speedup_vs_jax']:.2f}x "
                  f"w={b['warps']} st={b['stages']} sp={b['splits']} lazy={b['lazy']} sub={b['sub']} "
                  f"lanes={b['lanes']} items={b['items']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
