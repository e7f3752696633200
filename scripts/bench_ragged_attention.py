#!/usr/bin/env python
"""Decode attention over an engine-like batch: many slots, some active, ragged lengths.

The serving engine's batch is not the uniform grid of ``bench_attention.py``:
of ``--slots`` decode slots only ``--active`` decode, at lengths spread
between ``--min-len`` and ``--max-len`` tokens (long generations in flight).
This times one layer's launch plus its merge, as the caches run it, two
ways on the same rows:

* ``even-K``: every slot gets K splits of its own pages (programs of rows with
  no tokens exit at once);
* ``work``: balanced work items planned on the device (``plan_work``: items of
  at most the same number of pages over the active rows only).

Methods: ``bf16`` (the uncompressed cache's 16-token pages) and ``diffkv``
(``--low-frac`` of each row's tokens K4V2, the rest K8V4, policy logits
emitted). Llama3-8B head shapes.

``--chain L --plan step`` plans the work launches' items once per chained call,
shared by its ``L`` launches, as a decode step plans them for all its layers
(``--plan launch``, the default, plans them in every launch).

``--variants`` times other settings of the work launch on the same rows, each
a comma-separated list of ``warps``, ``stages``, ``lanes``, ``tokens`` (1: a
page's tokens as the dot tiles' rows, ``LaunchConfig.transposed``, queries
padded to 8), ``items``, ``min_pages``, ``wave`` (the items planned to run at
once, ``plan_work(wave=)``; 0: off), ``merge`` (0: XLA's segment reductions,
``merge_work``, as the ``work`` launch; n: the one-launch merge,
``row_merge.merge_rows``, folding n items per step; last: inside the decode
launch, ``paged_decode.paged_decode_merged``), ``merge_dims`` (that
merge's programs per row, each over a block of the head dim) (variants
separated by ``;``), e.g. to tune the launch where the engine runs it:

    python scripts/bench_ragged_attention.py --slots 128 --active 14,24,45,64
    python scripts/bench_ragged_attention.py --methods diffkv --active 45,64 --splits 1 \
        --variants "lanes=1;warps=2;stages=4;warps=2,stages=2;min_pages=8"
    python scripts/bench_ragged_attention.py --methods bf16 --splits 1 --active 6,22,46 \
        --variants "merge=1;merge=8;merge=16;merge=8,merge_dims=4"
"""

import dataclasses

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--active", default="14,24,45,64")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=4700)
    p.add_argument("--low-frac", type=float, default=0.14)
    p.add_argument("--methods", default="bf16,diffkv")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--items", default="",
                   help="work-item counts to try besides the default (comma-separated)")
    p.add_argument("--min-pages", type=int, default=2,
                   help="pages of the lightest tier per work item at least (min_item_units)")
    p.add_argument("--variants", default="",
                   help="work-launch settings to try besides the caches' (see above)")
    p.add_argument("--no-logits", action="store_true",
                   help="DiffKV without the policy's logits (to see what they cost)")
    p.add_argument("--chain", type=int, default=0,
                   help="time this many launches chained in one call, as a decode step runs "
                        "one per layer (0: separate calls, whose dispatch can exceed the "
                        "launch)")
    p.add_argument("--plan", default="launch", choices=("launch", "step"),
                   help="with --chain: the work launches' items planned in every launch, "
                        "or once per chained call (as a decode step plans all its layers)")
    p.add_argument("--json", default="results/bench_ragged_attention.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.diffkv_kernel_attention import (_launch, min_item_units, plan_wave, tier_weights,
                                                    work_items)
    from pallas_kernels import paged_decode as pdk
    from pallas_kernels.row_merge import merge_rows
    from scripts.decode_cases import time_launch_ms

    def timed(fn, q, *rest, prepare=None, threaded=False):
        step = args.chain and args.plan == "step"
        return time_launch_ms(fn, q, *rest, chain=args.chain, prepare=prepare if step else None,
                              threaded=threaded and step)

    nq, H, D = 32, 8, 128
    G, S = nq // H, args.slots
    rows = []
    fields = {"warps": "num_warps", "stages": "num_stages", "lanes": "page_lanes",
              "tokens": "transposed"}

    # plan_work's settings as the caches plan (with --min-pages), unless a variant names them.
    default_plan = {"min_pages": args.min_pages, "wave": plan_wave()}

    def variant(spec: str) -> tuple[dict, int | None, dict, tuple]:
        """``(LaunchConfig changes, items or None, plan_work settings, (merge,
        merge_dims))`` of one --variants entry (merge "last": inside the launch)."""
        changes, items, merge, dims = {}, None, 0, 1
        plan = dict(default_plan)
        for part in filter(None, spec.split(",")):
            key, _, value = part.partition("=")
            if key in fields:
                changes[fields[key]] = bool(int(value)) if key == "tokens" else int(value)
            elif key == "items":
                items = int(value)
            elif key == "min_pages":
                plan["min_pages"] = int(value)
            elif key == "wave":
                plan["wave"] = int(value) or None
            elif key == "merge":
                merge = value if value == "last" else int(value)
            elif key == "merge_dims":
                dims = int(value)
            else:
                raise SystemExit(f"unknown variant setting {key!r} in {spec!r}")
        if dims > 1 and (not merge or merge == "last"):
            raise SystemExit(f"merge_dims needs merge=N (the one-launch merge) in {spec!r}")
        return changes, items, plan, (merge, dims)

    variants = [(spec, *variant(spec)) for spec in filter(None, args.variants.split(";"))]

    def case(active: int, method: str, seed: int):
        rng = np.random.default_rng(seed)
        lens = np.zeros(S, np.int64)
        live = rng.choice(S, active, replace=False)
        lens[live] = rng.integers(args.min_len, args.max_len + 1, active)
        spec = ([(16, 16, 16, 1.0)] if method == "bf16"
                else [(8, 4, 32, 1 - args.low_frac), (4, 2, 64, args.low_frac)])
        tiers, nbytes = [], 0
        key = jax.random.PRNGKey(seed)
        for kb, vb, cap, frac in spec:
            fmt = pdk.TierFormat(kb, vb, D, cap)
            n = (lens * frac).astype(np.int64)
            width = -(-args.max_len // cap) + 1
            P = int((-(-n // cap)).sum()) * H + 1
            key, a, b, c = jax.random.split(key, 4)
            pages = jax.random.randint(c, (S, H, width), 0, P, jnp.int32)
            n_tok = jnp.asarray(np.broadcast_to(n[:, None], (S, H)), jnp.int32)
            if fmt.quantized:
                data = jax.random.randint(a, (P, fmt.data_bytes), 0, 256,
                                          jnp.int32).astype(jnp.uint8)
                meta = jax.random.uniform(b, (2, P, cap, 2), jnp.float16, 0.01, 0.1)
                kv, vv = pdk.page_views(data, fmt)
                metas = tuple(pdk.pack_meta(meta[i, ..., 0], meta[i, ..., 1]) for i in (0, 1))
                tiers.append(pdk.TierInput(fmt, kv, vv, metas, pages, n_tok))
                nbytes += int(n.sum()) * H * (fmt.key_width + fmt.value_width + 8)
            else:
                k = jax.random.normal(a, (P, cap, D), jnp.bfloat16)
                v = jax.random.normal(b, (P, cap, D), jnp.bfloat16)
                tiers.append(pdk.TierInput(fmt, k, v, None, pages, n_tok))
                nbytes += int(n.sum()) * H * 4 * D
        act = np.zeros(S, bool)
        act[live] = True
        return tiers, nbytes, jnp.asarray(act)

    for method in args.methods.split(","):
        for A in map(int, args.active.split(",")):
            tiers, nbytes, act = case(A, method, A)
            q = jax.random.normal(jax.random.PRNGKey(A), (S, nq, D), jnp.float32)
            qr = q.reshape(S, H, G, D)  # the caches' launch: real rows, padded in the kernel
            qg = pdk.pad_group(qr, 16)  # the even splits' launch (padded in memory)
            emit = method == "diffkv" and not args.no_logits
            res = {}
            for K in map(int, args.splits.split(",")):
                cfg = pdk.LaunchConfig(num_splits=K, emit_logits=emit)

                @jax.jit
                def even(qg, tiers, cfg=cfg):
                    o, m, l, lg = pdk.paged_decode_partials(qg, tiers, group=G, cfg=cfg)
                    return pdk.merge_partials([(o, m, l)])[0], lg

                res[f"even-{K}"] = (timed(even, qg, tiers), even(qg, tiers)[0])
            # The caches' launch: page lanes for the quantized pages, not the 16-bit ones.
            lane_dim = D if method == "diffkv" else 0
            cfg = _launch(emit, lane_dim, weights=tier_weights() if method == "diffkv" else ())
            launches = [("work", cfg, work_items(S, H), default_plan, (0, 1))]
            launches += [(f"work-{n}", cfg, n, default_plan, (0, 1))
                         for n in (int(n) for n in args.items.split(",") if n)]
            launches += [(spec, dataclasses.replace(cfg, **changes),
                          items or work_items(S, H), mp, merge)
                         for spec, changes, items, mp, merge in variants]
            for name, lcfg, n_items, plan, merge in launches:

                def planned(tiers, act, cfg=lcfg, n_items=n_items, plan=plan):
                    units = min_item_units(cfg.tier_weights, plan["min_pages"])
                    return pdk.plan_work(pdk.row_pages(tiers, act, cfg.tier_weights), n_items,
                                         **dict(plan, min_pages=units))

                def launch(qr, wl, tiers, act, cfg=lcfg, merge=merge):
                    # As the caches call it: q's real rows, padded in the kernel.
                    rows = pdk.tile_rows(G, cfg.transposed and method != "bf16")
                    if merge[0] == "last":  # wl: the plan and the merge counters
                        out, _, _, lg, counters = pdk.paged_decode_merged(
                            qr, tiers, work=wl[0], counters=wl[1], group=G, cfg=cfg,
                            padded_rows=rows)
                        return (out, lg), (wl[0], counters)
                    o, m, l, lg = pdk.paged_decode_partials(qr, tiers, group=G, cfg=cfg,
                                                            work=wl, padded_rows=rows)
                    if merge[0]:
                        return merge_rows(o, m, l, wl, S, H, items_per_step=merge[0],
                                          dim_blocks=merge[1])[0], lg
                    return pdk.merge_work(o, m, l, wl, S, H)[0], lg

                threaded = merge[0] == "last"
                if threaded:
                    def planned(tiers, act, planned=planned, cfg=lcfg):
                        return planned(tiers, act), pdk.merge_counters(S, H, cfg)

                @jax.jit
                def work(qr, tiers, act, planned=planned, launch=launch, threaded=threaded):
                    out = launch(qr, planned(tiers, act), tiers, act)
                    return out[0] if threaded else out

                try:
                    ms = (timed(launch, qr, tiers, act, prepare=planned, threaded=threaded)
                          if args.chain and args.plan == "step" else timed(work, qr, tiers, act))
                    res[name] = (ms, work(qr, tiers, act)[0])
                except Exception as e:  # report and keep going
                    print(f"{method} active={A} {name}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
            ref = np.asarray(next(iter(res.values()))[1])[np.asarray(act)]
            for name, (ms, out) in res.items():
                err = float(np.abs(np.asarray(out)[np.asarray(act)] - ref).max()
                            / np.abs(ref).max())
                rows.append(dict(method=method, slots=S, active=A, launch=name, ms=ms,
                                 bytes=nbytes, tbps=nbytes / (ms * 1e-3) / 1e12,
                                 diff_vs_first=err))
            print(f"done {method} active={A}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows},
                  fh, indent=1)
    width = max([9] + [len(r["launch"]) for r in rows])
    print(f"\n{'method':7s} {'active':>6s} {'launch':{width}s} {'ms':>7s} {'MB':>7s} "
          f"{'TB/s':>5s} {'diff':>8s}")
    for r in rows:
        print(f"{r['method']:7s} {r['active']:6d} {r['launch']:{width}s} {r['ms']:7.3f} "
              f"{r['bytes'] / 1e6:7.1f} {r['tbps']:5.2f} {r['diff_vs_first']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
