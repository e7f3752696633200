#!/usr/bin/env python
"""The policy launch over an engine-like batch, and its launch settings (one GPU).

After each layer's decode attention the policy launch
(:func:`pallas_kernels.policy_scores.score_victims`) adds the step's
probabilities to every cached token's score, finds each row's victims and,
as the caches run it on a GPU, merges the attention launch's partials and the
token being decoded. This builds what one layer of the DiffKV cache holds in
the middle of serving: ``--slots`` slots of which ``--active`` decode, at
lengths drawn from ``--min-len`` to ``--max-len`` tokens, ``--low-frac`` of
each row's tokens in K4V2 pages and the rest in K8V4 pages of one pool (every
page its own, as the engine allocates them); runs the caches' attention
launch once for real partials and logits; then times the policy launch as
the caches call it (the merge inside, victims left per split for the
token-writes launch, scores updated in place; ``--launches`` of them chained
in one call, as a decode step runs one per layer, so the time is the
device's, not the call's dispatch) and each ``--variants`` entry: a
comma-separated list of ``splits``, ``block``, ``warps``, ``stages``, ``lanes``
(entries separated by ``;``); ``lanes=1`` keeps each lane's best victim
candidate across the loop and reduces the lanes once after it
(``score_victims(..., lane_victims=True)``); ``merge=0`` times the launch without the
attention merge (given the merged statistics the caches' launch computed: what
the merge costs inside it). Every variant is checked against
the caches' settings on the same inputs first (scores, the row outputs, the
victims).
Llama3-8B head shapes.

    python scripts/bench_policy_launch.py --active 24,45,64 \\
        --variants "splits=2;splits=8;block=256;block=1024;warps=2;warps=8;stages=3"
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"splits": "splits", "block": "block", "warps": "num_warps", "stages": "num_stages",
            "merge": "merge", "lanes": "lane_victims"}


def parse_variant(spec: str) -> dict:
    """``score_victims`` keyword arguments of one ``--variants`` entry."""
    kwargs = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in SETTINGS:
            raise SystemExit(f"unknown variant setting {key!r} in {spec!r} "
                             f"(known: {', '.join(SETTINGS)})")
        kwargs[SETTINGS[key]] = int(value)
    return kwargs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--active", default="24,45,64")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=4700)
    p.add_argument("--low-frac", type=float, default=0.14)
    p.add_argument("--prompt-len", type=int, default=95)
    p.add_argument("--variants", default="splits=2;splits=8;warps=2;warps=8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--launches", type=int, default=32,
                   help="launches chained in one call (a decode step runs one per layer); "
                        "the time is per launch, without the call's dispatch")
    p.add_argument("--json", default="results/bench_policy_launch.json")
    args = p.parse_args()
    variants = [("caches", {})] + [(s, parse_variant(s))
                                    for s in filter(None, args.variants.split(";"))]

    import jax
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.diffkv_kernel_attention import (_launch, min_item_units, plan_wave, tier_weights,
                                                    work_items)
    from pallas_kernels import paged_decode as pdk
    from pallas_kernels.policy_scores import RowPartials, VictimRule, merge_victims, score_victims

    nq, H, D = 32, 8, 128
    G, S = nq // H, args.slots
    caps = (32, 64)  # K8V4 and K4V2 slots of a 6 KB page at head dim 128
    fmts = (pdk.TierFormat(8, 4, D, caps[0]), pdk.TierFormat(4, 2, D, caps[1]))
    rule = VictimRule()
    rows = []

    def build(active: int, seed: int):
        """One layer's cache and the attention launch's outputs for ``active`` rows."""
        rng = np.random.default_rng(seed)
        lens = np.zeros(S, np.int64)
        live = rng.choice(S, active, replace=False)
        lens[live] = rng.integers(args.min_len, args.max_len + 1, active)
        n_lo = (lens * args.low_frac).astype(np.int64)
        n_tok = (lens - n_lo, n_lo)
        need = [-(-n // c) for n, c in zip(n_tok, caps)]  # pages per row and tier
        widths = [int(n.max()) + 1 for n in need]
        P = int(sum(n.sum() for n in need)) * H
        ids = rng.permutation(P).astype(np.int32)  # every page its own, scattered
        pages, at = [], 0
        for n, W in zip(need, widths):
            tab = np.zeros((S, H, W), np.int32)
            for s in np.flatnonzero(n):
                for h in range(H):
                    tab[s, h, :n[s]] = ids[at:at + n[s]]
                    at += n[s]
            pages.append(jnp.asarray(tab))
        key = jax.random.PRNGKey(seed)
        k_data, k_meta, k_q, k_new, k_sc = jax.random.split(key, 5)
        data = jax.random.randint(k_data, (P + 1, fmts[0].data_bytes), 0, 256,
                                  jnp.int32).astype(jnp.uint8)
        meta = jax.random.uniform(k_meta, (2, P + 1, caps[1], 2), jnp.float16, 0.01, 0.1)
        metas = tuple(pdk.pack_meta(meta[i, ..., 0], meta[i, ..., 1]) for i in (0, 1))
        counts = [jnp.asarray(np.broadcast_to(n[:, None], (S, H)), jnp.int32) for n in n_tok]
        tiers = [pdk.TierInput(f, *pdk.page_views(data, f), metas, pg, n)
                 for f, pg, n in zip(fmts, pages, counts)]
        act = jnp.asarray(lens > 0)
        qg = jax.random.normal(k_q, (S, H, G, D), jnp.bfloat16)
        work = pdk.plan_work(pdk.row_pages(tiers, act, tier_weights()), work_items(S, H),
                             min_pages=min_item_units(tier_weights()), wave=plan_wave())
        o, m, l, logits = pdk.paged_decode_partials(qg, tiers, group=G,
                                                    cfg=_launch(True, D, weights=tier_weights()),
                                                    work=work, padded_stats=True,
                                                    padded_rows=16)
        kn, vn = jax.random.normal(k_new, (2, S, H, D), jnp.bfloat16)
        partials = RowPartials(o, m, l, work.ranges.reshape(S, H, 2), qg, kn, vn)
        scores = jax.random.uniform(k_sc, (P + 1, caps[1]), jnp.float32, 0.0, 2.0)
        cur = jnp.asarray(lens, jnp.int32)
        positions = jnp.asarray(rng.integers(0, max(args.max_len, 1), (P + 1, caps[1])),
                                jnp.int32)
        plen = jnp.full((S,), args.prompt_len, jnp.int32)
        nbytes = int(sum(n.sum() for n in n_tok)) * H * (G * 4 + 4 + 4 + 4)
        return (logits, pages, counts, cur, plen, positions, partials), scores, nbytes

    for A in map(int, args.active.split(",")):
        fixed, scores0, nbytes = build(A, A)
        logits, pages, counts, cur, plen, positions, partials = fixed
        results, first, stats = {}, None, None
        for name, kw in variants:
            kw = dict(kw)
            with_merge = kw.pop("merge", 1) != 0
            if not with_merge and stats is None:
                print(f"active={A} {name}: FAILED merge=0 needs the caches' launch first",
                      flush=True)
                continue

            def launch(sc, kw=kw, with_merge=with_merge, stats=stats):
                if not with_merge:  # the merged statistics given, as the caches' launch made them
                    new, (vi, vf) = score_victims(
                        logits, *stats, pages, counts, cur, plen, sc, positions, caps=caps,
                        group=G, rule=rule, merge=False, **kw)
                    return new, vi, vf, None
                new, (vi, vf), merged = score_victims(
                    logits, None, None, pages, counts, cur, plen, sc, positions, caps=caps,
                    group=G, rule=rule, merge=False, partials=partials, **kw)
                return new, vi, vf, merged

            fn = jax.jit(launch, donate_argnums=0)

            def chained(sc, launch=launch):
                # As in a decode step: many launches in one call, each on the scores
                # the previous one wrote (so none is skipped), no dispatch in between.
                def body(_, carry):
                    sc, acc = carry
                    new, vi, vf, merged = launch(sc)
                    out = 0.0 if merged is None else merged[0][0, 0, 0, 0]
                    return new, acc + out + vf[0, 0, 0, 0]

                return jax.lax.fori_loop(0, args.launches, body, (sc, jnp.float32(0)))

            many = jax.jit(chained, donate_argnums=0)
            try:
                got = jax.block_until_ready(fn(jnp.copy(scores0)))
                # Scores updated in place, as the caches run it: each call feeds the next.
                sc = jnp.copy(scores0)
                sc = jax.block_until_ready(fn(sc)[0])
                sc = jax.block_until_ready(many(sc))[0]
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        sc = many(sc)[0]
                    jax.block_until_ready(sc)
                    times.append((time.perf_counter() - t0) / (args.reps * args.launches))
                ms = sorted(times)[2] * 1e3
            except Exception as e:  # report and keep going
                print(f"active={A} {name}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
                continue
            victims = merge_victims(got[1], got[2], 2)
            out = None if got[3] is None else np.asarray(got[3][0])[np.asarray(cur) > 0]
            if first is None:
                first = (np.asarray(got[0]), victims, out)
                stats = (got[3][1], got[3][2])  # M, L of the caches' launch
                agree, diff = 1.0, 0.0
            else:
                agree = float(np.mean([np.mean(np.asarray(a[0]) == np.asarray(b[0]))
                                       for a, b in zip(victims, first[1])]))
                diff = float(np.abs(np.asarray(got[0]) - first[0]).max())
                if out is not None:
                    diff = max(diff, float(np.abs(out - first[2]).max() / np.abs(first[2]).max()))
            results[name] = ms
            rows.append(dict(active=A, variant=name, ms=ms, bytes=nbytes,
                             tbps=nbytes / (ms * 1e-3) / 1e12, victims_agree=agree,
                             max_diff=diff))
            print(f"  active {A} {name}: {ms:.4f} ms, victims {agree:.1%}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows},
                  fh, indent=1)
    width = max([8] + [len(r["variant"]) for r in rows])
    print(f"\n{'active':>6s} {'variant':{width}s} {'ms':>7s} {'MB':>7s} {'TB/s':>5s} "
          f"{'victims':>7s} {'diff':>8s}")
    for r in rows:
        print(f"{r['active']:6d} {r['variant']:{width}s} {r['ms']:7.3f} {r['bytes'] / 1e6:7.1f} "
              f"{r['tbps']:5.2f} {r['victims_agree']:7.1%} {r['max_diff']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
