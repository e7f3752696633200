#!/usr/bin/env python
"""Registers, spills and shared memory of the paged decode kernel (GPU machine).

Prints the Triton IR that Pallas emits for each launch configuration, then
compiles it with the ``triton`` Python package (when installed) to read the
resource report and keep the TTGIR / PTX for inspection:

    python scripts/kernel_resources.py --tiers 8-4-32,16-16-16 --out results/ttir

The ``triton`` package's compiler is close to, not the same as, the one inside
XLA, so treat the numbers as a guide. Occupancy follows from 65,536 registers
and 228 KiB of shared memory per H200 multiprocessor.
"""

import argparse
import contextlib
import functools
import io
import itertools
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MARK = "The Triton module for pallas_call"


def strip_locations(ir: str) -> str:
    """The module alone, without the pretty-printed source locations ``triton`` cannot parse."""
    lines = ir.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("module @"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
    text = "\n".join(lines[start:end + 1])
    text = re.sub(r' "[^"\n]*"\(#loc\d+\)', "", text)
    text = re.sub(r" loc\([^()\n]*(\([^()\n]*\)[^()\n]*)*\)", "", text)
    text = re.sub(r" \[unknown\]", "", text)
    text = re.sub(r" #loc\d*", "", text)
    return re.sub(r" /[^ \n]*\.py:\d+:\d+( to :?\d+(:\d+)?)?", "", text)


def ptxas_report(triton_module, ptx_path: str) -> tuple[int, int]:
    """(registers, spill-store bytes) from the ``ptxas`` bundled with ``triton``."""
    ptxas = os.path.join(os.path.dirname(triton_module.__file__), "backends", "nvidia", "bin",
                         "ptxas")
    rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return (int(regs.group(1)) if regs else -1), (int(spill.group(1)) if spill else -1)


def triton_ir(fn, *args) -> str:
    """TTIR text of the single Pallas kernel inside ``fn``."""
    from jax.experimental import pallas as pl

    orig = pl.pallas_call
    pl.pallas_call = functools.partial(orig, debug=True)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            # Lowering for CUDA works without a GPU (the kernel targets sm_90).
            fn.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pl.pallas_call = orig
    text = buf.getvalue()
    return text[text.index(MARK):].split("\n", 1)[1]  # strip_locations cuts the module out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiers", default="8-4-32,4-2-64,16-16-16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=16, help="query rows (padded group)")
    p.add_argument("--tokens-per-block", default="64")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="1")
    p.add_argument("--prefetch", default="0")
    p.add_argument("--skip", default="-", help="';'-separated stage sets, as in tune_decode_kernel")
    p.add_argument("--out", default="results/ttir")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_decode as pdk

    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        triton = None
    os.makedirs(args.out, exist_ok=True)
    D, G = args.head_dim, args.group
    print(f"{'tier':9s} {'tpb':>4s} {'w':>2s} {'st':>2s} {'pf':>2s} {'skip':22s} {'regs':>5s} "
          f"{'spill B':>7s} {'smem B':>7s} {'blocks/SM':>9s}")
    for tier, tpb, warps, stages, pf, skip in itertools.product(
            args.tiers.split(","), (int(x) for x in args.tokens_per_block.split(",")),
            (int(x) for x in args.warps.split(",")), (int(x) for x in args.stages.split(",")),
            (int(x) for x in args.prefetch.split(",")), args.skip.split(";")):
        kb, vb, cap = (int(x) for x in tier.split("-"))
        skip_t = () if skip == "-" else tuple(skip.split("+"))
        npb = max(1, tpb // cap)
        P = 8
        if kb == 16:
            kp = jnp.zeros((P, cap, D), jnp.bfloat16)
            metas = (None,) * 4
            fmt = pdk.TierFormat(16, 16, D, cap)
        else:
            kw, vw = D * kb // 8, D * vb // 8
            kp = jnp.zeros((P, cap, kw + vw), jnp.uint8)
            metas = tuple(jnp.zeros((P, cap), jnp.float16) for _ in range(4))
            fmt = pdk.TierFormat(kb, vb, D, cap, 0, kw)
        cfg = pdk.LaunchConfig(pages_per_block=npb, num_warps=warps, num_stages=stages,
                               emit_logits=False, skip=skip_t, prefetch=bool(pf))
        q = jnp.zeros((1, 1, G, D), jnp.bfloat16)
        pages = jnp.zeros((1, 1, npb * 2), jnp.int32)
        ntok = jnp.zeros((1, 1), jnp.int32)
        fn = jax.jit(lambda q, kp, pages, ntok: pdk.paged_decode_partials(
            q, kp, kp, *metas, pages, ntok, fmt=fmt, cfg=cfg, interpret=False))
        name = f"{tier}_tpb{tpb}_w{warps}_st{stages}_pf{pf}_{skip.replace('+', '-')}"
        path = os.path.join(args.out, name + ".ttir")
        with open(path, "w") as fh:
            fh.write(strip_locations(triton_ir(fn, q, kp, pages, ntok)))
        line = f"{tier:9s} {tpb:4d} {warps:2d} {stages:2d} {pf:2d} {skip:22s}"
        if triton is None:
            print(line + "  (no triton package: TTIR written only)")
            continue
        try:
            k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=stages))
        except Exception as e:  # keep going: report which IR the package rejects
            print(line + f"  compile failed: {str(e).splitlines()[0][:100]}")
            continue
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(args.out, f"{name}.{ext}"), "w") as fh:
                fh.write(k.asm[ext])
        regs, spills = ptxas_report(triton, os.path.join(args.out, f"{name}.ptx"))
        smem = k.metadata.shared
        blocks = min(65536 // max(1, regs * 32 * warps), 232448 // max(1, smem + 1024), 32)
        print(line + f" {regs:5d} {spills:6d} {smem:7d} {blocks:9d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
