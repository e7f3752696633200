#!/usr/bin/env python
"""Where a DiffKV attention launch's time goes, on one GPU: the decode kernel alone,
with its merge, with and without the policy's logits, under two item plans.

For each context, tier mix and plan (``wave``: items planned for one wave of the
GPU's resident programs, ``plan_work(wave=)``; ``none``: the plan without it),
times ``--chain`` launches chained in one call (:func:`time_chained_ms`, the work
list planned once per call) of

* ``kern``: the decode kernel alone (``paged_decode_partials``);
* ``full``: the kernel and its one-launch merge (``row_merge.merge_rows``);

each with the policy's logits emitted (as the DiffKV cache runs it) and without.
At the first context and mix it also traces the chained call (``full``, logits
on, both plans) and prints every kernel's device time per launch and the idle
time before it: what the chain itself adds (its reductions, adds and loop
steps) next to the attention kernels. Llama3-8B head shapes, token tiles.

    python scripts/attention_time_split.py --batch 32 --contexts 4096,16384
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--mixes", default="diffkv-50/50,diffkv-high")
    p.add_argument("--wave", type=int, default=1024, help="the one-wave plan's items")
    p.add_argument("--chain", type=int, default=32)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--json", default="results/attention_time_split.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from diffkv_jax.diffkv_kernel_attention import (HI, LO, _launch, min_item_units, tier_weights,
                                                    work_items)
    from pallas_kernels import paged_decode as pdk
    from pallas_kernels.row_merge import merge_rows
    from scripts.decode_cases import (chained_call, copy_bandwidth, random_case,
                                      time_chained_ms, write_results)
    from scripts.device_profile import kernel_times

    bw = copy_bandwidth(args.copy_gib)
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.2f} TB/s", flush=True)
    H, D, G, S = 8, 128, 4, args.batch
    out = []
    for ci, N in enumerate(map(int, args.contexts.split(","))):
        key = jax.random.PRNGKey(N)
        qg = jax.random.normal(key, (S, H, G, D), jnp.bfloat16)
        for mi, mix in enumerate(args.mixes.split(",")):
            tiers, nbytes = random_case(jax.random.fold_in(key, 1), mix, S, H, D, N)
            weights = tier_weights((HI, LO)[:len(tiers)])
            rows8 = pdk.tile_rows(G, True)
            for wave in (None, args.wave):
                def plan(tiers, wave=wave):
                    return pdk.plan_work(pdk.row_pages(tiers, weights=weights),
                                         work_items(S, H), min_pages=min_item_units(weights),
                                         wave=wave)

                for emit in (True, False):
                    cfg = _launch(emit_logits=emit, head_dim=D, transposed=True,
                                  weights=weights)

                    def kern(qg, work, tiers, cfg=cfg):
                        o, m, l, lg = pdk.paged_decode_partials(
                            qg, tiers, group=G, cfg=cfg, work=work, padded_rows=rows8)
                        return o, lg

                    def full(qg, work, tiers, cfg=cfg):
                        o, m, l, lg = pdk.paged_decode_partials(
                            qg, tiers, group=G, cfg=cfg, work=work, padded_rows=rows8)
                        return merge_rows(o, m, l, work, S, H)[0], lg

                    chain = chained_call(full, args.chain, plan)  # timed, then traced
                    tk = time_chained_ms(kern, qg, tiers, launches=args.chain, prepare=plan)
                    tf = time_chained_ms(full, qg, tiers, launches=args.chain, chain=chain)
                    r = dict(context=N, mix=mix, wave=wave, logits=emit, kern_ms=tk,
                             full_ms=tf, bytes=nbytes,
                             frac_copy_bw_full=nbytes / (tf * 1e-3) / 1e12 / bw)
                    out.append(r)
                    print(r, flush=True)
                    if ci == 0 and mi == 0 and emit:
                        zero = jnp.float32(0)
                        traced, busy, wall = kernel_times(
                            lambda t=tiers: jax.block_until_ready(chain(qg, zero, t)), calls=5)
                        per = 1e3 / args.chain  # ms per call -> us per launch
                        print(f"trace, wave={wave}: wall {wall * per:.1f} us per launch, "
                              f"kernels {busy * per:.1f} us", flush=True)
                        for name, ms, n in traced[:8]:
                            print(f"  {ms * per:7.2f} us x{n / args.chain:.1f}  {name[:70]}")
                        for name, ms in getattr(kernel_times, "gaps", [])[:6]:
                            print(f"  {ms * per:7.2f} us idle before {name[:60]}")
            del tiers
    write_results(args.json, bw, args, out)
    print(f"\n{'N':>6s} {'mix':14s} {'wave':>5s} {'logits':>6s} {'kern us':>8s} "
          f"{'full us':>8s} {'%copy':>6s}")
    for r in out:
        print(f"{r['context']:6d} {r['mix']:14s} {str(r['wave']):>5s} {int(r['logits']):6d} "
              f"{r['kern_ms'] * 1e3:8.1f} {r['full_ms'] * 1e3:8.1f} "
              f"{r['frac_copy_bw_full']:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
