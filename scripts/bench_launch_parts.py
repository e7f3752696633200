#!/usr/bin/env python
"""Where a decode-attention launch's time goes: plan, kernel, merge (one GPU).

For uniform batches (every row ``--context`` tokens, as ``bench_attention.py``)
this times each part of the balanced work-item launch on its own:

* ``plan``: :func:`pallas_kernels.paged_decode.plan_work` (the engine plans once
  per step for all layers);
* ``kernel``: the Pallas kernel over the planned items;
* ``merge``: :func:`~pallas_kernels.paged_decode.merge_work` (segment max and sums);

and, for comparison, the even-split launch (``--splits`` per row) and its merge.
Llama3-8B head shapes; variants as in ``scripts/decode_cases.py``.

    python scripts/bench_launch_parts.py --batches 8,32,128 --mixes bf16,diffkv-high
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,32,128")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--mixes", default="bf16,diffkv-high,diffkv-50/50")
    p.add_argument("--splits", type=int, default=0,
                   help="even splits per row to compare (0: as the caches chose before, "
                        "about 4 programs per multiprocessor)")
    p.add_argument("--json", default="results/bench_launch_parts.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from diffkv_jax.diffkv_kernel_attention import work_items
    from pallas_kernels import paged_decode as pdk
    from scripts.decode_cases import SHAPES, random_case, time_ms

    nq, H, D = SHAPES["llama3-8b"]
    G = nq // H
    rows = []
    for mix in args.mixes.split(","):
        for S in map(int, args.batches.split(",")):
            tiers, nbytes = random_case(jax.random.PRNGKey(S), mix, S, H, D, args.context)
            q = jax.random.normal(jax.random.PRNGKey(1), (S, H, G, D), jnp.float32)
            qg = pdk.pad_group(q, 16)
            cfg = pdk.LaunchConfig(emit_logits=mix.startswith("diffkv"))
            n_items = work_items(S, H)

            plan = jax.jit(lambda tiers: pdk.plan_work(pdk.row_pages(tiers), n_items))
            work = plan(tiers)
            kernel = jax.jit(lambda qg, tiers, work: pdk.paged_decode_partials(
                qg, tiers, group=G, cfg=cfg, work=work)[:3])
            o, m, l = kernel(qg, tiers, work)
            merge = jax.jit(lambda o, m, l, work: pdk.merge_work(o, m, l, work, S, H)[0])
            parts = {"plan": time_ms(plan, tiers), "kernel": time_ms(kernel, qg, tiers, work),
                     "merge": time_ms(merge, o, m, l, work)}

            K = args.splits
            if not K:
                K = 1
                while S * H * K < 4 * 132 and 2 * K <= max(t.pages.shape[-1] for t in tiers):
                    K *= 2
            ecfg = pdk.LaunchConfig(num_splits=K, emit_logits=cfg.emit_logits)
            even = jax.jit(lambda qg, tiers: pdk.paged_decode_partials(qg, tiers, group=G,
                                                                       cfg=ecfg)[:3])
            eo = even(qg, tiers)
            emerge = jax.jit(lambda o, m, l: pdk.merge_partials([(o, m, l)])[0])
            parts.update({f"even-{K} kernel": time_ms(even, qg, tiers),
                          f"even-{K} merge": time_ms(emerge, *eo)})
            used = int((work.seg < S * H).sum())
            rows.append(dict(mix=mix, batch=S, context=args.context, items=n_items,
                             used_items=used, splits=K, bytes=nbytes, ms=parts))
            print(f"done {mix} B={S}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)
    print(f"\n{'mix':13s} {'B':>4s} {'items':>6s} {'plan':>7s} {'kernel':>7s} {'merge':>7s} "
          f"{'K':>3s} {'evenK':>7s} {'emerge':>7s}  (ms)")
    for r in rows:
        t = r["ms"]
        K = r["splits"]
        print(f"{r['mix']:13s} {r['batch']:4d} {r['used_items']:6d} {t['plan']:7.3f} "
              f"{t['kernel']:7.3f} {t['merge']:7.3f} {K:3d} {t[f'even-{K} kernel']:7.3f} "
              f"{t[f'even-{K} merge']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
