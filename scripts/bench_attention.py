#!/usr/bin/env python
"""Decode-attention benchmark: verify against the reference, then time, on one GPU.

Variants (same logical KV: ``context`` tokens per (sequence, KV head)):

* ``jax-bf16``: JAX's own Pallas ``paged_attention`` (bf16 pages of 16 tokens);
* ``ours-bf16``: our kernel on bf16 pages of 16 tokens (the uncompressed baseline);
* ``int8``: every token K8V8 with per-token scale/zero;
* ``diffkv-high``: every token K8V4 (DiffKV's high tier);
* ``diffkv-50/50``: half the tokens K8V4, half K4V2;
* ``diffkv-mix``: 35% K8V4, 45% K4V2, 20% pruned.

Our variants run the kernel as the caches do (balanced work items planned on
the device, the policy's logits emitted as float16 for the DiffKV tiers), plus
the exact merge of the items. Bytes read = K/V data + metadata + page IDs. With
``--chain``, a profiler trace of the same chain also times the attention
kernels alone (``kern.ms``: ours the decode launch and its merge, JAX's its
kernel; without the chain's per-launch reduction and add and the gaps between
kernels), with the bandwidth and speed-up on that time, and prints each attention
kernel's launch record from the trace once (registers per thread, shared memory,
block, theoretical occupancy, as XLA compiled it). Each variant is checked
against the plain-jnp reference on two rows of the same geometry first.

``--kernel-tiles queries,tokens`` times every quantized variant with both dot
tilings of the kernel (``LaunchConfig.transposed``: "tokens" makes a page's
tokens the tiles' rows, the queries padded to 8 columns), the second as
``<variant>/tokens``.

Times are of back-to-back calls by default; ``--chain L`` times ``L`` launches of
every variant (ours with its merge) chained in one jitted call, as a decode
step runs one per layer, so the host's dispatch of each call stays out of the
figure (it is comparable to the device time of the short launches). With a
chain, ``--plan step`` (the default) plans our work items once per chained
call, shared by its ``L`` launches, as the engine plans them once per decode
step for all its layers; ``--plan launch`` plans them in every launch (and
without a chain every call plans its own). ``--merge rows`` (default) merges
the items in one launch (:func:`pallas_kernels.row_merge.merge_rows`),
``--merge segments`` with XLA's segment reductions
(:func:`pallas_kernels.paged_decode.merge_work`), ``--merge last`` inside the
decode launch, by each row's last item to finish
(:func:`pallas_kernels.paged_decode.paged_decode_merged`: no merge launch; its
counters are made once per chained call, with the plan, and passed from
launch to launch).

``--tune "w=1-2;ls=64,w=1-2;n=3168"`` times every quantized variant once per
setting besides the engine's own launch: ``w`` the tiers' work units per page
(``LaunchConfig.tier_weights``, high-low), ``ls`` the longest pages the page lanes
walk (``LaunchConfig.lane_slots``), ``n`` the launch's work items, ``wave`` the
items planned to run at once (``plan_work(wave=)``, 0: off), ``st`` / ``nw`` its
pipeline stages and warps, ``lg`` the bits of the stored logits
(``LaunchConfig.logits_dtype``, 16 or 32), ``m`` the merge (as ``--merge``), ``el=1``
the rows' token counts and first table entries loaded before the first loop
(``LaunchConfig.early_row_loads``), ``sn`` the share of an item within which the
plan moves a row's cut onto its tier boundary (``plan_work(snap=)``), ``gp`` the
units the item across a row's tier boundary holds fewer, for its second loop's
start (``plan_work(gap=)``), ``vp=1``
the value codes' slices left at their bit offsets
(``LaunchConfig.values_in_place``), ``sp=1`` K4V2's pages walked a page per
step, half a page per lane (``LaunchConfig.split_pages``), ``ms=1`` each lane's
metadata loaded once and chosen per column (``LaunchConfig.lane_meta_select``),
``pl`` the page lanes (``LaunchConfig.page_lanes``; fewer hold fewer registers),
``pr`` the query rows of the kernel's tiles (``padded_rows``: with token tiles 16
instead of 8 gives a group of 4 four page lanes with ``pl=4``), ``kc`` the key
bytes per dot (``LaunchConfig.key_chunk``), ``i8`` the key dots in int8 with
the query in that many int8 digits (``LaunchConfig.int8_query_digits``; the error
column then includes the query's rounding), ``ka=1`` each step's key dots taken
in the step before (``LaunchConfig.keys_ahead``);
labelled
``<variant>/tokens[setting]``.

    python scripts/bench_attention.py                     # the full grid
    python scripts/bench_attention.py --models llama3-8b --batches 32,128 --contexts 4096
"""

import argparse
import dataclasses
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("jax-bf16", "ours-bf16", "int8", "diffkv-high", "diffkv-50/50", "diffkv-mix")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,smollm2-135m")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--kernel-tiles", default="queries",
                   help="comma list of the quantized launches' dot tilings: queries, tokens")
    p.add_argument("--chain", type=int, default=0,
                   help="time this many launches chained in one call (0: separate calls)")
    p.add_argument("--plan", default="step", choices=("step", "launch"),
                   help="our work items planned once per chained call, or in every launch")
    p.add_argument("--merge", default="rows", choices=("rows", "segments", "last"),
                   help="our items merged by one launch (rows), XLA segment reductions, or "
                        "inside the decode launch by each row's last item (last)")
    p.add_argument("--tune", default="",
                   help="';'-separated launch settings to time besides the engine's, "
                        "each a ','-list of w=HI-LO (tier weights), ls=N (lane slots), "
                        "n=N (work items), wave=N (items run at once, 0: off), st=N (pipeline "
                        "stages), nw=N (warps), lg=16|32 (logits' bits), "
                        "m=rows|segments|last (the merge), el=0|1 (the row's loads before "
                        "the first loop: LaunchConfig.early_row_loads), sn=P (cuts onto the "
                        "tier boundary), gp=N (units an item across the tier boundary holds "
                        "fewer: plan_work(gap=)), vp=0|1, sp=0|1, ms=0|1 (values in place, split "
                        "pages, lanes' metadata once), pl=1|2|4 (page lanes), sx=1|2|4 (pages "
                        "per step of the tiers one lane walks: LaunchConfig.stack_pages), "
                        "rc=N (units per chunk a row's cursor hands out as the launch runs: "
                        "LaunchConfig.row_chunk; 0: off), rs=P (the percent of a row "
                        "its cursor hands out: LaunchConfig.row_share)")
    p.add_argument("--no-kernel-time", action="store_true",
                   help="with --chain, skip the profiler trace that times the attention "
                        "kernels alone")
    p.add_argument("--copy-gib", type=float, default=4.0,
                   help="size of the copy that measures the bandwidth")
    p.add_argument("--page-order", default="random", choices=("random", "sorted"),
                   help="the pools' page order for our launches: random (as served) or "
                        "sorted (each row's pages side by side: a diagnostic of what the "
                        "pages' scatter costs)")
    p.add_argument("--json", default="results/bench_attention.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    from diffkv_jax.diffkv_kernel_attention import (HI, LO, TIER_GAP, TIER_SNAP, _launch,
                                                    min_item_units, plan_wave, tier_weights,
                                                    work_items)
    from pallas_kernels import paged_decode as pdk
    from pallas_kernels.row_merge import merge_rows
    from scripts.decode_cases import (ATTENTION_KERNELS, SHAPES, case_output, chained_call,
                                      copy_bandwidth, kernel_ms, random_case, time_chained_ms,
                                      time_launch_ms, write_results)
    from scripts.device_profile import kernel_times

    launch_records = []  # {kernel, record}, each distinct one once, in the order first seen

    def timed(fn, q, *rest, prepare=None, threaded=False):
        """``(ms, kernel ms)``: the chained (or back-to-back) time per launch and, with
        a chain, the attention kernels' own device time per launch (None without)."""
        if not args.chain:
            return time_launch_ms(fn, q, *rest, prepare=prepare), None
        # compiled once, timed and traced
        chain = chained_call(fn, args.chain, prepare, threaded)
        ms = time_chained_ms(fn, q, *rest, launches=args.chain, chain=chain)
        if args.no_kernel_time:
            return ms, None
        kms, kernels = kernel_ms(fn, q, *rest, launches=args.chain, chain=chain)
        if kms is None and kernels:
            print("no attention kernel in the trace: "
                  + ", ".join(f"{n[:40]} {t * 1e3:.1f} us" for n, t in kernels[:6]), flush=True)
        for name, text in getattr(kernel_times, "details", {}).items():
            record = {"kernel": name, "record": text}  # registers, occupancy as XLA compiled
            if any(n in name for n in ATTENTION_KERNELS) and record not in launch_records:
                launch_records.append(record)
                print(f"  launch {name[:48]}: {text}", flush=True)
        return ms, kms

    merges = {"rows": merge_rows, "segments": pdk.merge_work}

    def parse_setting(text):
        out = {}
        for part in filter(None, text.split(",")):
            k, _, val = part.partition("=")
            if k == "w":
                out["tier_weights"] = tuple(int(x) for x in val.split("-"))
            elif k == "ls":
                out["lane_slots"] = int(val)
            elif k == "n":
                out["items"] = int(val)
            elif k == "wave":
                out["wave"] = int(val) or None
            elif k == "st":
                out["num_stages"] = int(val)
            elif k == "nw":
                out["num_warps"] = int(val)
            elif k == "lg" and val in ("16", "32"):
                out["logits_dtype"] = f"float{val}"
            elif k == "m" and val in ("rows", "segments", "last"):
                out["merge"] = val
            elif k == "el" and val in ("0", "1"):
                out["early_row_loads"] = val == "1"
            elif k == "sn" and 0 <= float(val) < 0.5:
                out["snap"] = float(val)
            elif k == "gp" and val.isdigit():
                out["gap"] = int(val)
            elif k == "vp" and val in ("0", "1"):
                out["values_in_place"] = val == "1"
            elif k == "sp" and val in ("0", "1"):
                out["split_pages"] = val == "1"
            elif k == "ms" and val in ("0", "1"):
                out["lane_meta_select"] = val == "1"
            elif k == "pl" and val in ("1", "2", "4"):
                out["page_lanes"] = int(val)
            elif k == "pr" and val in ("8", "16"):
                out["padded_rows"] = int(val)
            elif k == "kc" and val.isdigit() and int(val) % 16 == 0:
                out["key_chunk"] = int(val)
            elif k == "pf" and val.isdigit():
                out["l2_prefetch"] = int(val)
            elif k == "pn" and val.isdigit():
                out["l2_prefetch_next"] = int(val)
            elif k == "sx" and val in ("1", "2", "4"):
                out["stack_pages"] = int(val)
            elif k == "rc" and val.isdigit():
                out["row_chunk"] = int(val)
            elif k == "rs" and val.isdigit() and int(val) <= 100:
                out["row_share"] = int(val)
            elif k == "i8" and val in ("0", "1", "2"):
                out["int8_query_digits"] = int(val)
            elif k == "ka" and val in ("0", "1"):
                out["keys_ahead"] = val == "1"
            else:
                raise SystemExit(f"--tune: unknown setting {part!r} (w, ls, n, wave, st, nw, "
                                 "lg=16|32, m=rows|segments|last, el=0|1, sn in [0, 0.5), gp=N, "
                                 "vp=0|1, sp=0|1, ms=0|1, pl=1|2|4, pr=8|16, kc=16n, pf=N, pn=N, "
                                 "sx=1|2|4, rc=N, rs=P, i8=0|1|2, ka=0|1)")
        return out

    def run_variant(v, model, S, N, q, qg, kq, key, index, tiles="queries", setting=""):
        nq, H, D = SHAPES[model]
        G = nq // H
        if v == "jax-bf16":
            ps, per_row = 16, N // 16
            if not pdk.addressable(H * S * per_row * ps * D, 2):
                print(f"skip jax-bf16 {model} B={S} N={N}: its pools need 64-bit "
                      "offsets", flush=True)
                return None
            kp = jax.random.normal(kq, (H, S * per_row, ps, D), jnp.bfloat16)
            tables = jax.random.permutation(kq, S * per_row).reshape(
                S, per_row).astype(jnp.int32)
            fn = jax.jit(functools.partial(
                jax_pa.paged_attention, pages_per_compute_block=8,
                k_splits=min(16, per_row // 8), block_h=16))
            ms = timed(fn, q / math.sqrt(D), kp, kp, tables, jnp.full((S,), N, jnp.int32))
            del kp
            return (*ms, S * H * (N * 4 * D + per_row * 4), None)
        mix = "bf16" if v == "ours-bf16" else v
        tiers, nbytes = random_case(jax.random.fold_in(key, index), mix, S, H, D,
                                    N, page_order=args.page_order)
        # The caches' launch: page lanes for the quantized pages, not the 16-bit ones.
        lane_dim = 0 if mix == "bf16" else D
        transposed = tiles == "tokens" and mix != "bf16"
        tune = parse_setting(setting)
        n_tiers = len(tiers)
        # The engine's work units per page of each tier, unless the setting names them.
        weights = tune.get("tier_weights", tier_weights((HI, LO)[:n_tiers]))[:n_tiers]
        cfg = _launch(emit_logits=mix.startswith("diffkv"), head_dim=lane_dim,
                      transposed=transposed, weights=weights)
        cfg = dataclasses.replace(cfg, **{k: tune[k] for k in ("lane_slots", "num_stages",
                                                                "num_warps", "logits_dtype",
                                                                "early_row_loads",
                                                                "values_in_place",
                                                                "split_pages",
                                                                "lane_meta_select",
                                                                "page_lanes", "key_chunk",
                                                                "l2_prefetch",
                                                                "l2_prefetch_next",
                                                                "stack_pages", "row_chunk",
                                                                "row_share",
                                                                "int8_query_digits",
                                                                "keys_ahead")
                                          if k in tune})
        tile_rows = tune.get("padded_rows") or pdk.tile_rows(G, transposed)
        n_items = tune.get("items") or work_items(S, H)
        wave = tune.get("wave", plan_wave())

        snap = tune.get("snap", TIER_SNAP) if n_tiers > 1 else 0.0
        gap = tune.get("gap", TIER_GAP) if n_tiers > 1 and not snap else 0

        def plan(tiers):
            return pdk.plan_work(pdk.row_pages(tiers, weights=weights), n_items,
                                 min_pages=min_item_units(weights), wave=wave,
                                 bounds=pdk.tier_bounds(tiers, weights), snap=snap,
                                 max_weight=max(weights), gap=gap)

        merge_kind = tune.get("merge", args.merge)
        threaded = merge_kind == "last"
        if threaded:  # merged in the decode launch; its counters pass from launch to launch
            def prepare(tiers):
                S_, H_ = tiers[0].n_tok.shape
                return plan(tiers), pdk.merge_counters(S_, H_, cfg)

            def launch(qg, prepared, tiers, cfg=cfg):
                work, counters = prepared
                out, _, _, logits, counters = pdk.paged_decode_merged(
                    qg, tiers, work=work, counters=counters, group=G, cfg=cfg,
                    padded_rows=tile_rows)
                return (out, logits), (work, counters)

            @jax.jit
            def ours(qg, tiers):
                return launch(qg, prepare(tiers), tiers)[0]
        else:
            merge, prepare = merges[merge_kind], plan

            def launch(qg, work, tiers, cfg=cfg):
                o, m, l, logits = pdk.paged_decode_partials(qg, tiers, group=G, cfg=cfg,
                                                            work=work, padded_rows=tile_rows)
                return merge(o, m, l, work, qg.shape[0], H)[0], logits

            @jax.jit
            def ours(qg, tiers):
                return launch(qg, plan(tiers), tiers)

        small, _ = random_case(jax.random.fold_in(key, 99), mix, 2, H, D,
                               min(N, 2048))
        # Two query rows of their own: the timed batch may have only one.
        qc = jax.random.normal(jax.random.fold_in(kq, 98), (2, H, G, D), jnp.bfloat16)
        rout = case_output(qc, small)
        got = ours(qc, small)[0][:, :, :G]
        err = float(jnp.abs(got - rout).max() / jnp.abs(rout).max())
        ms = (timed(launch, qg, tiers, prepare=prepare, threaded=threaded)
              if args.plan == "step" and args.chain else timed(ours, qg, tiers))
        del tiers
        return (*ms, nbytes, err)

    def save():  # after every shape, so a run cut short keeps what it measured
        write_results(args.json, bw, args, rows, launch_records=launch_records)

    bw = copy_bandwidth(args.copy_gib)
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.2f} TB/s; "
          + (f"{args.chain} launches chained per call, planned per "
             f"{'call' if args.plan == 'step' else 'launch'}" if args.chain
             else "separate calls")
          + f"; merge: {args.merge}", flush=True)
    variants = args.variants.split(",")
    rows, key = [], jax.random.PRNGKey(0)
    for model in args.models.split(","):
        nq, H, D = SHAPES[model]
        G = nq // H
        for S in map(int, args.batches.split(",")):
            for N in map(int, args.contexts.split(",")):
                key, kq = jax.random.split(key)
                q = jax.random.normal(kq, (S, nq, D), jnp.bfloat16)
                qg = q.reshape(S, H, G, D)  # the kernel pads the group (padded_rows)
                res = {}
                runs = [(v, "queries") for v in variants]
                runs += [(v, "tokens") for v in variants if v not in ("jax-bf16", "ours-bf16")
                         and "tokens" in args.kernel_tiles.split(",")]
                if "queries" not in args.kernel_tiles.split(","):
                    runs = [(v, t) for v, t in runs
                            if t == "tokens" or v in ("jax-bf16", "ours-bf16")]
                quantized = [(v, t) for v, t in runs if v not in ("jax-bf16", "ours-bf16")]
                runs = [(v, t, "") for v, t in runs]
                runs += [(v, t, st) for st in filter(None, args.tune.split(";"))
                         for v, t in quantized]
                for v, tiles, setting in runs:
                    label = v if tiles == "queries" else f"{v}/tokens"
                    label += f"[{setting}]" if setting else ""
                    try:
                        # (the same random case for both tilings of a variant)
                        res[label] = run_variant(v, model, S, N, q, qg, kq, key,
                                                 variants.index(v), tiles, setting)
                    except Exception as e:  # report and keep going (e.g. an unaddressable pool)
                        print(f"skip {label} {model} B={S} N={N}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]}", flush=True)
                    if res.get(label) is None:
                        res.pop(label, None)
                base, kbase = res.get("jax-bf16", (None, None))[:2]
                for v, (ms, kms, nb, err) in res.items():
                    tb = nb / (ms * 1e-3) / 1e12
                    ktb = None if kms is None else nb / (kms * 1e-3) / 1e12
                    rows.append(dict(model=model, batch=S, context=N, variant=v, ms=ms, bytes=nb,
                                     tbps=tb, frac_copy_bw=tb / bw, rel_err=err,
                                     speedup_vs_jax=None if base is None else base / ms,
                                     kernel_ms=kms, kernel_tbps=ktb,
                                     kernel_frac_copy_bw=None if ktb is None else ktb / bw,
                                     kernel_speedup_vs_jax=(None if kbase is None or kms is None
                                                            else kbase / kms)))
                save()
                print(f"done {model} B={S} N={N}", flush=True)
    width = max([20] + [len(r["variant"]) for r in rows])
    # "kernel" columns: the attention kernels' own device time from a profiler trace
    # of the same chain (ours: the decode launch and its merge; JAX's: its kernel).
    print(f"\n{'model':13s} {'B':>4s} {'N':>6s} {'variant':{width}s} {'ms':>8s} {'MB':>8s} "
          f"{'TB/s':>6s} {'%copy':>6s} {'vs jax':>7s} {'rel.err':>8s} {'kern.ms':>8s} "
          f"{'%copy':>6s} {'vs jax':>7s}")
    for r in rows:
        sp = "" if r["speedup_vs_jax"] is None else f"{r['speedup_vs_jax']:6.2f}x"
        er = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        km = "" if r["kernel_ms"] is None else f"{r['kernel_ms']:8.3f}"
        kf = "" if r["kernel_frac_copy_bw"] is None else f"{r['kernel_frac_copy_bw']:6.1%}"
        ks = ("" if r["kernel_speedup_vs_jax"] is None
              else f"{r['kernel_speedup_vs_jax']:6.2f}x")
        print(f"{r['model']:13s} {r['batch']:4d} {r['context']:6d} {r['variant']:{width}s} "
              f"{r['ms']:8.3f} {r['bytes'] / 1e6:8.1f} {r['tbps']:6.2f} "
              f"{r['frac_copy_bw']:6.1%} {sp:>7s} {er:>8s} {km:>8s} {kf:>6s} {ks:>7s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
