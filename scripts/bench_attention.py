#!/usr/bin/env python
"""Decode-attention benchmark: verify against the reference, then time, on one GPU.

Variants (same logical KV: ``context`` tokens per (sequence, KV head)):

* ``jax-bf16``: JAX's own Pallas ``paged_attention`` (bf16 pages of 16 tokens);
* ``ours-bf16``: our kernel on the same bf16 pages (uncompressed baseline);
* ``int8``: every token K8V8 with per-token scale/zero;
* ``diffkv-high``: every token K8V4 (DiffKV high tier);
* ``diffkv-50/50``: half the tokens K8V4, half K4V2;
* ``diffkv-mix``: a realistic tier mix (``--mix high,low``, rest pruned).

DiffKV variants also produce the per-token probabilities the policy needs
(columns ``ms`` include them; ``kernel ms`` is the attention kernels alone).
Bytes read = K/V data + metadata + page-table entries actually touched.

    python scripts/bench_attention.py                 # full grid, JSON in results/
    python scripts/bench_attention.py --quick         # a few shapes
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def bench(fn, *args, reps=20):
    """Median milliseconds of ``fn(*args)`` (device-synchronized)."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def copy_bandwidth():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
    f = jax.jit(lambda a: a + 1)
    ms = bench(f, x, reps=10)
    return 2 * x.nbytes / (ms * 1e-3) / 1e12


def launch_for(S, H, np_pages, npb, sms=132, prefetch=False):
    """Launch settings from scripts/tune_decode_kernel.py sweeps (llama3-8b, B=64, 4K):
    64 tokens per block, 4 warps, 2 stages; prefetch helps the 16-bit pages only."""
    from pallas_kernels.paged_decode import LaunchConfig

    splits = 1
    while S * H * splits < 2 * sms and np_pages % (2 * splits * npb) == 0 and splits < 64:
        splits *= 2
    return LaunchConfig(pages_per_block=npb, num_splits=splits, num_warps=4, num_stages=2,
                        dot_dtype="bfloat16", logits_dtype="bfloat16", prefetch=prefetch)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--mix", default="0.35,0.45", help="high,low fractions of diffkv-mix")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default="results/bench_attention.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    from pallas_kernels import paged_decode as pdk

    if args.quick:
        args.batches, args.contexts = "8,64", "4096"
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw:.2f} TB/s", flush=True)
    mix_hi, mix_lo = (float(x) for x in args.mix.split(","))
    rows, errors = [], []
    key = jax.random.PRNGKey(0)

    for model in args.models.split(","):
        nq, H, D = SHAPES[model]
        G = nq // H
        for S in (int(b) for b in args.batches.split(",")):
            for N in (int(c) for c in args.contexts.split(",")):
                if S * N * H * 2 * D >= 2**31 - 2**24:
                    # One bf16 pool of this size needs 64-bit offsets, which the kernels'
                    # Triton lowering does not use yet.
                    print(f"skip {model} B={S} N={N}: pool over 2^31 elements", flush=True)
                    continue
                key, *ks = jax.random.split(key, 12)
                q = jax.random.normal(ks[0], (S, nq, D), jnp.bfloat16)
                qg = pdk.pad_group(q.reshape(S, H, G, D), 16)
                res = {}

                # --- bf16 pages: JAX's kernel and ours on the very same bytes --------
                ps = 16
                per_row = N // ps
                P = S * per_row
                k_pages = jax.random.normal(ks[1], (H, P, ps, D), jnp.bfloat16)
                v_pages = jax.random.normal(ks[2], (H, P, ps, D), jnp.bfloat16)
                tables = jax.random.permutation(ks[3], P).reshape(S, per_row).astype(jnp.int32)
                lengths = jnp.full((S,), N, jnp.int32)
                jax_fn = jax.jit(functools.partial(
                    jax_pa.paged_attention, pages_per_compute_block=8,
                    k_splits=min(16, per_row // 8), block_h=16))
                res["jax-bf16"] = (bench(jax_fn, q, k_pages, v_pages, tables, lengths,
                                         reps=args.reps), None, N * 2 * D * 2 + per_row * 4)
                ours_pages = (jnp.arange(H)[None, :, None] * P + tables[:, None, :])
                fmt16 = pdk.TierFormat(16, 16, D, ps)
                cfg16 = dataclasses.replace(launch_for(S, H, per_row, 2, prefetch=True),
                                            emit_logits=False)
                kp, vp = k_pages.reshape(H * P, ps, D), v_pages.reshape(H * P, ps, D)
                ntok = jnp.full((S, H), N, jnp.int32)

                @jax.jit
                def ours16(qg, kp, vp, pages, ntok):
                    o, m, l, _ = pdk.paged_decode_partials(qg, kp, vp, None, None, None, None,
                                                           pages, ntok, fmt=fmt16, cfg=cfg16)
                    return pdk.merge_partials([(o, m, l)])[0]

                res["ours-bf16"] = (bench(ours16, qg, kp, vp, ours_pages, ntok, reps=args.reps),
                                    None, N * 2 * D * 2 + per_row * 4)
                if S <= 8 and N <= 4096:  # verify against the plain-jnp reference
                    # JAX's kernel and reference do not scale the logits by 1/sqrt(D).
                    ref = jax_pa.paged_attention_reference(
                        q / math.sqrt(D), jnp.moveaxis(k_pages[:, tables].reshape(H, S, N, D), 0, 2),
                        jnp.moveaxis(v_pages[:, tables].reshape(H, S, N, D), 0, 2), lengths)
                    got = ours16(qg, kp, vp, ours_pages, ntok)[:, :, :G].reshape(S, nq, D)
                    err = float(jnp.abs(got - ref.astype(jnp.float32)).max())
                    errors.append((model, S, N, "ours-bf16", err))
                del k_pages, v_pages, kp, vp

                # --- quantized tiers ------------------------------------------------
                def tier_case(name, parts, with_probs=True):
                    """parts: list of (k_bits, v_bits, slots, tokens_per_row)."""
                    pools, fmts, cfgs, pages_l, ntoks, nbytes = [], [], [], [], [], 0
                    k2 = jax.random.PRNGKey(len(name) + S + N)
                    for (kb, vb, cap, ntk) in parts:
                        kw, vw = D * kb // 8, D * vb // 8
                        npr = max(1, -(-ntk // cap))
                        npr = 1 << (npr - 1).bit_length()
                        Pt = S * H * npr + 1
                        k2, a, b, c = jax.random.split(k2, 4)
                        tok = jax.random.randint(a, (Pt, cap, kw + vw), 0, 256, jnp.int32
                                                 ).astype(jnp.uint8)
                        meta = jax.random.uniform(b, (4, Pt, cap), jnp.float16, 0.01, 0.1)
                        pg = jax.random.permutation(c, Pt - 1)[: S * H * npr]
                        pg = pg.reshape(S, H, npr).astype(jnp.int32)
                        fmt = pdk.TierFormat(kb, vb, D, cap, 0, kw)
                        npb = max(1, 64 // cap)
                        pools.append((tok, meta))
                        fmts.append(fmt)
                        cfg = launch_for(S, H, npr, npb)
                        cfgs.append(cfg if with_probs else dataclasses.replace(
                            cfg, emit_logits=False))
                        pages_l.append(pg)
                        ntoks.append(jnp.full((S, H), ntk, jnp.int32))
                        nbytes += ntk * (kw + vw + 8) + npr * 4
                    fmts, cfgs = tuple(fmts), tuple(cfgs)

                    def kernels(qg, pools, pages_l, ntoks):
                        out = []
                        for (tok, meta), fmt, cfg, pg, nt in zip(pools, fmts, cfgs, pages_l,
                                                                 ntoks):
                            out.append(pdk.paged_decode_partials(
                                qg, tok, tok, meta[0], meta[1], meta[2], meta[3], pg, nt,
                                fmt=fmt, cfg=cfg))
                        return out

                    @jax.jit
                    def attn(qg, pools, pages_l, ntoks):
                        parts_ = kernels(qg, pools, pages_l, ntoks)
                        out, M, L = pdk.merge_partials([x[:3] for x in parts_])
                        if not with_probs:
                            return out
                        probs = [pdk.group_max_probabilities(x[3], M, L, G) for x in parts_]
                        return out, probs

                    @jax.jit
                    def kern_only(qg, pools, pages_l, ntoks):
                        return [x[:3] for x in kernels(qg, pools, pages_l, ntoks)]

                    t_all = bench(attn, qg, pools, pages_l, ntoks, reps=args.reps)
                    t_k = bench(kern_only, qg, pools, pages_l, ntoks, reps=args.reps)
                    if S <= 8 and N <= 4096:
                        from diffkv_jax import quantization as qz
                        ref_parts = []
                        for (tok, meta), fmt, pg, nt in zip(pools, fmts, pages_l, ntoks):
                            kw = fmt.v_offset
                            kh = qz.dequantize_packed(tok[..., :kw], meta[0], meta[1],
                                                      fmt.k_bits, D)[pg]
                            vh = qz.dequantize_packed(tok[..., kw:], meta[2], meta[3],
                                                      fmt.v_bits, D)[pg]
                            sh = kh.shape
                            kh = kh.reshape(S, H, sh[2] * sh[3], D)
                            vh = vh.reshape(S, H, sh[2] * sh[3], D)
                            ref_parts.append(pdk.tier_attention_reference(
                                qg.astype(jnp.float32), kh, vh, nt)[:3])
                        ref = pdk.merge_partials(ref_parts)[0]
                        got = attn(qg, pools, pages_l, ntoks)
                        got = got[0] if isinstance(got, tuple) else got
                        err = float(jnp.abs(got[:, :, :G] - ref[:, :, :G]).max())
                        errors.append((model, S, N, name, err))
                    res[name] = (t_all, t_k, nbytes)

                tier_case("int8", [(8, 8, 32, N)], with_probs=False)
                tier_case("diffkv-high", [(8, 4, 32, N)])
                tier_case("diffkv-50/50", [(8, 4, 32, N // 2), (4, 2, 64, N // 2)])
                tier_case("diffkv-mix", [(8, 4, 32, int(N * mix_hi)),
                                         (4, 2, 64, int(N * mix_lo))])
                base = res["jax-bf16"][0]
                for name, (ms, kms, nb) in res.items():
                    total = nb * S * H
                    t = kms if kms is not None else ms
                    rows.append(dict(model=model, batch=S, context=N, variant=name, ms=ms,
                                     kernel_ms=kms, bytes=total, tbps=total / (t * 1e-3) / 1e12,
                                     frac_copy_bw=total / (t * 1e-3) / 1e12 / bw,
                                     speedup_vs_jax=base / ms))
                print(f"done {model} B={S} N={N}", flush=True)

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"copy_bandwidth_tbps": bw, "device": jax.devices()[0].device_kind,
                   "rows": rows, "max_abs_errors": errors}, fh, indent=1)
    print("\nverification (max |ours - reference|, bf16 dots):")
    for e in errors:
        print(f"  {e[0]:13s} B={e[1]:<4d} N={e[2]:<6d} {e[3]:13s} {e[4]:.2e}")
    print(f"\n{'model':13s} {'B':>4s} {'N':>6s} {'variant':13s} {'ms':>8s} {'kern ms':>8s} "
          f"{'MB':>8s} {'TB/s':>6s} {'%copy':>6s} {'vs jax':>7s}")
    for r in rows:
        km = "" if r["kernel_ms"] is None else f"{r['kernel_ms']:8.3f}"
        print(f"{r['model']:13s} {r['batch']:4d} {r['context']:6d} {r['variant']:13s} "
              f"{r['ms']:8.3f} {km:>8s} {r['bytes'] / 1e6:8.1f} {r['tbps']:6.2f} "
              f"{r['frac_copy_bw']:6.1%} {r['speedup_vs_jax']:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
