#!/usr/bin/env python
"""Registers, spills, shared memory and loop instructions of the paged decode kernel.

Prints the Triton IR that Pallas emits for each launch configuration (works
on a CPU machine), then compiles it with the ``triton`` Python package (when
installed) for sm_90 to read the resource report, disassemble it and count the
instructions of each tier's page loop per token, keeping TTGIR / PTX / cubin:

    python scripts/kernel_resources.py --tiers 8-4-32,8-4-32+4-2-64 --warps 1,2
    python scripts/kernel_resources.py --policy      # the policy launch's loops instead
    python scripts/kernel_resources.py --tiers 8-4-32+4-2-64 --warps 1 --lanes 2 \
        --transposed 1 --merged 0,1                  # the launch that merges its rows too
    python scripts/kernel_resources.py --tiers 8-4-32+4-2-64 --warps 1 --lanes 2 \
        --transposed 1 --early 0,1                   # LaunchConfig.early_row_loads
    python scripts/kernel_resources.py --tiers 8-4-32+4-2-64 --warps 2 --lanes 2 \
        --transposed 1 --in-place 1 --meta-select 1 --int8 0,1,2   # int8 key dots

The ``triton`` package's compiler is close to, not the same as, the one inside
XLA, so treat the numbers as a guide. Occupancy follows from the registers
and shared memory of a Hopper multiprocessor (:func:`resident_programs`).
"""

import argparse
import collections
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
    bin_dir = os.path.join(os.path.dirname(triton_module.__file__), "backends", "nvidia", "bin")
    rep = ""
    # Some triton releases emit PTX newer than their sm_90 ptxas reads; the bundled
    # Blackwell ptxas (a newer CUDA) also compiles for sm_90a.
    for name in ("ptxas", "ptxas-blackwell"):
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            rep = subprocess.run([path, "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
            if "Used" in rep:
                break
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


def compile_sass(triton, ir_path: str, out_dir: str, name: str, warps: int, stages: int):
    """Compile a TTIR file for sm_90 with the ``triton`` package, keep TTGIR / PTX /
    cubin beside it; ``(registers, spill bytes, shared bytes, SASS text)``."""
    from triton.backends.compiler import GPUTarget

    k = triton.compile(ir_path, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as fh:
            fh.write(k.asm[ext])
    regs, spills = ptxas_report(triton, os.path.join(out_dir, f"{name}.ptx"))
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as fh:
        fh.write(k.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    return regs, spills, k.metadata.shared, sass


def resident_programs(regs: int, warps: int, smem: int) -> int:
    """Programs of ``warps`` warps that fit one Hopper multiprocessor at once.

    Its registers are four files of 16,384, one per warp scheduler, and a warp's
    registers come from one file, in units of 8 a thread: a one-warp program at
    200 registers leaves room for two per file (8 per multiprocessor), at 168 for
    three (12), as the launch records on the device show. Shared memory: 228 KiB,
    1 KiB of it reserved per program. At most 64 warps and 32 programs.
    """
    per_warp = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = 4 * (16384 // per_warp) // warps
    by_smem = 233472 // (smem + 1024)
    return min(by_regs, by_smem, 64 // warps, 32)


def loop_bodies(sass: str, innermost: bool = False) -> list[list[str]]:
    """The instructions of each loop of a SASS listing (a backward branch closes a loop);
    ``innermost``: only the loops that hold no other loop."""
    labels, cur, instrs = {}, None, []
    for line in sass.split("\n"):
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            cur = m.group(1)
            labels[cur] = None
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            if cur and labels[cur] is None:
                labels[cur] = addr
            instrs.append((addr, m.group(2)))
    loops = []
    for addr, text in instrs:
        m = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1)) is not None and labels[m.group(1)] < addr:
            loops.append((labels[m.group(1)], addr))
    if innermost:  # loops around others (LaunchConfig.row_chunk's over chunks) left out
        loops = [(a, b) for a, b in loops
                 if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [[t for x, t in instrs if a <= x <= b] for a, b in loops]


def opcode_counts(body: list[str]) -> collections.Counter:
    """Opcodes (without modifiers or predicates) of a loop body, most common first."""
    ops = collections.Counter()
    for text in body:
        words = text.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            ops[words[0].split(".")[0].rstrip(";")] += 1
    return ops


def flags(text: str) -> list[bool]:
    """A comma-separated list of 0 / 1 values as booleans."""
    return [bool(int(x)) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiers", default="8-4-32,4-2-64,8-4-32+4-2-64,8-8-32,16-16-16",
                   help="k-v-slots per tier, '+' joins the tiers of one launch")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="real query rows per KV head")
    p.add_argument("--warps", default="1,2")
    p.add_argument("--stages", default="3")
    p.add_argument("--sub", default="0", help="LaunchConfig.sub_slots values (0: whole pages)")
    p.add_argument("--lanes", default="1", help="LaunchConfig.page_lanes values")
    p.add_argument("--transposed", default="0",
                   help="LaunchConfig.transposed values (1: pages' tokens as the dot tile's "
                        "rows, the query rows padded to 8)")
    p.add_argument("--merged", default="0",
                   help="0: the launch of partials; 1: the launch that merges its rows "
                        "(paged_decode_merged: the last item of a row folds its items)")
    p.add_argument("--early", default="0",
                   help="LaunchConfig.early_row_loads values (1: every tier's token count "
                        "and first table entries loaded before the first loop)")
    p.add_argument("--split", default="0",
                   help="LaunchConfig.split_pages values (1: pages longer than lane_slots "
                        "walked a page per step, a part per lane)")
    p.add_argument("--in-place", default="0",
                   help="LaunchConfig.values_in_place values (1: value code slices left at "
                        "their bit offsets)")
    p.add_argument("--meta-select", default="0",
                   help="LaunchConfig.lane_meta_select values (1: each lane's metadata "
                        "loaded once, labelled L)")
    p.add_argument("--key-chunk", default="0",
                   help="LaunchConfig.key_chunk values (key bytes per dot; 0: the whole "
                        "row, labelled K<n> otherwise)")
    p.add_argument("--int8", default="0",
                   help="LaunchConfig.int8_query_digits values (the key dots in int8, the "
                        "query in this many int8 digits; 0: float16 dots, labelled I<n>)")
    p.add_argument("--ahead", default="0",
                   help="LaunchConfig.keys_ahead values (1: each step takes the next step's "
                        "key dots after its own value dots, labelled A)")
    p.add_argument("--prefetch", default="0",
                   help="LaunchConfig.l2_prefetch values (pages ahead asked of the L2 "
                        "cache; 0: none, labelled P<n> otherwise)")
    p.add_argument("--prefetch-next", type=int, default=0,
                   help="LaunchConfig.l2_prefetch_next (the next tier's first pages asked "
                        "of the L2 cache near a tier's end; labelled N<n>)")
    p.add_argument("--stack", default="1",
                   help="LaunchConfig.stack_pages values (pages per step of the tiers "
                        "walked a whole page per step by one lane; labelled X<n>)")
    p.add_argument("--row-chunk", type=int, default=0,
                   help="LaunchConfig.row_chunk (units a row's cursor hands out per take; "
                        "0: off)")
    p.add_argument("--rows", type=int, default=0,
                   help="query rows of the kernel's tiles (0: tile_rows, 8 with --transposed "
                        "1 for groups up to 8, else 16); 16 with --transposed 1 gives a "
                        "group of 4 four page lanes")
    p.add_argument("--padded-q", action="store_true",
                   help="q padded to 16 rows in memory (the launches before padded_rows)")
    p.add_argument("--policy", action="store_true",
                   help="the policy launch instead (pallas_kernels/policy_scores.py, with the "
                        "attention merge inside, Llama3-8B shapes): its loops' instructions, "
                        "barriers and shuffles per step, for each --lane-victims value")
    p.add_argument("--lane-victims", default="0,1",
                   help="with --policy: score_victims' lane_victims values")
    p.add_argument("--out", default="results/ttir")
    p.add_argument("--opcodes", type=int, default=0, help="also print each loop's N most "
                   "common opcodes (static counts: a rarely taken branch, such as the lazy "
                   "rescale, is included)")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_decode as pdk

    try:
        import triton
    except ImportError:
        triton = None
    os.makedirs(args.out, exist_ok=True)
    if args.policy:
        return policy_report(args, triton)
    D, G = args.head_dim, args.group
    print(f"{'tiers':24s} {'w':>2s} {'st':>2s} {'regs':>5s} {'spill B':>7s} {'smem B':>7s} "
          f"{'blocks/SM':>9s}  loop instructions per token (warp-level)")
    for (spec, warps, stages, sub, lanes, kchunk, ahead, stack, int8, trans, merged, early,
         split, vip, msel, keys_ahead) in itertools.product(
            args.tiers.split(","), [int(x) for x in args.warps.split(",")],
            [int(x) for x in args.stages.split(",")], [int(x) for x in args.sub.split(",")],
            [int(x) for x in args.lanes.split(",")],
            [int(x) for x in args.key_chunk.split(",")],
            [int(x) for x in args.prefetch.split(",")],
            [int(x) for x in args.stack.split(",")],
            [int(x) for x in args.int8.split(",")],
            *(flags(text) for text in (args.transposed, args.merged, args.early, args.split,
                                       args.in_place, args.meta_select, args.ahead))):
        tiers, caps = [], []
        for part in spec.split("+"):
            kb, vb, cap = (int(x) for x in part.split("-"))
            fmt = pdk.TierFormat(kb, vb, D, cap)
            pages, ntok = jnp.zeros((1, 1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
            if kb == 16:
                kp = jnp.zeros((8, cap, D), jnp.bfloat16)
                tiers.append(pdk.TierInput(fmt, kp, kp, None, pages, ntok))
            else:
                kv, vv = pdk.page_views(jnp.zeros((8, fmt.data_bytes), jnp.uint8), fmt)
                meta = (jnp.zeros((8, 64), jnp.uint32),) * 2
                tiers.append(pdk.TierInput(fmt, kv, vv, meta, pages, ntok))
            caps.append(min(cap, sub) if sub and kb < 16 else cap)  # tokens per loop step
        if (lanes > 1 or trans) and (sub or "16-16" in spec):
            continue
        cfg = pdk.LaunchConfig(num_warps=warps, num_stages=stages, sub_slots=sub,
                               page_lanes=lanes, transposed=trans, early_row_loads=early,
                               split_pages=split, values_in_place=vip,
                               lane_meta_select=msel, key_chunk=kchunk, l2_prefetch=ahead,
                               l2_prefetch_next=0 if ahead else args.prefetch_next,
                               stack_pages=stack, row_chunk=args.row_chunk,
                               int8_query_digits=int8, keys_ahead=keys_ahead)
        rows = args.rows or pdk.tile_rows(G, trans)
        n_lanes = cfg.lanes(rows, G)
        # stacked pages: the quantized tiers walked a whole page per step by one lane
        stacked = [int(part.split("-")[0]) < 16 and not sub and not (split and n_lanes > 1)
                   and (n_lanes == 1 or c > cfg.lane_slots)
                   for part, c in zip(spec.split("+"), caps)]
        if n_lanes > 1:  # tiers of pages up to lane_slots walk a page per lane per step
            # (split pages: a page per step, a part per lane)
            caps = [c * n_lanes if c <= cfg.lane_slots else c for c in caps]
        caps = [c * stack if st else c for c, st in zip(caps, stacked)]
        # As the caches call it: q holds the group's rows, the kernel pads them to 16
        # (--padded-q: q padded in memory, as before padded_rows).
        q = jnp.zeros((1, 1, rows if args.padded_q else G, D), jnp.bfloat16)
        padded_rows = None if args.padded_q else rows
        work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
        if merged:
            fn = jax.jit(lambda q: pdk.paged_decode_merged(
                q, tiers, work=work, group=G, cfg=cfg, interpret=False,
                padded_rows=padded_rows))
        else:  # a work list where the rows' cursors need its ranges
            fn = jax.jit(lambda q: pdk.paged_decode_partials(
                q, tiers, group=G, cfg=cfg, interpret=False, padded_rows=padded_rows,
                work=work if args.row_chunk else None))
        name = (f"{spec.replace('+', '_')}_w{warps}_st{stages}" + (f"_sub{sub}" if sub else "")
                + (f"_lanes{n_lanes}" if n_lanes > 1 else "") + ("_tr" if trans else "")
                + ("_merged" if merged else "") + ("_early" if early else "")
                + ("_split" if split else "") + ("_vip" if vip else "")
                + ("_msel" if msel else "") + (f"_kc{kchunk}" if kchunk else "")
                + (f"_pf{ahead}" if ahead else "")
                + (f"_pn{cfg.l2_prefetch_next}" if cfg.l2_prefetch_next else "")
                + (f"_x{stack}" if stack > 1 else "")
                + (f"_rc{args.row_chunk}" if args.row_chunk else "")
                + (f"_i8x{int8}" if int8 else "") + ("_ahead" if keys_ahead else ""))
        path = os.path.join(args.out, name + ".ttir")
        with open(path, "w") as fh:
            fh.write(strip_locations(triton_ir(fn, q)))
        label = (spec + (f" /{sub}" if sub else "") + (f" x{n_lanes}" if n_lanes > 1 else "")
                 + (" T" if trans else "") + (" M" if merged else "") + (" E" if early else "")
                 + (" S" if split else "") + (" V" if vip else "")
                 + (" L" if msel else "") + (f" K{kchunk}" if kchunk else "")
                 + (f" P{ahead}" if ahead else "")
                 + (f" N{cfg.l2_prefetch_next}" if cfg.l2_prefetch_next else "")
                 + (f" X{stack}" if stack > 1 else "") + (f" I{int8}" if int8 else "")
                 + (" A" if keys_ahead else ""))
        line = f"{label:24s} {warps:2d} {stages:2d}"
        if triton is None:
            print(line + "  (no triton package: TTIR written only)")
            continue
        try:
            regs, spills, smem, sass = compile_sass(triton, path, args.out, name, warps, stages)
        except Exception as e:  # keep going: report which IR the package rejects
            print(line + f"  compile failed: {str(e).splitlines()[0][:100]}")
            continue
        bodies = loop_bodies(sass, innermost=True)
        per_token = [f"{len(b) * warps / c:.1f}" for b, c in zip(bodies, caps)]
        blocks = resident_programs(regs, warps, smem)
        print(line + f" {regs:5d} {spills:7d} {smem:7d} {blocks:9d}  {', '.join(per_token)}",
              flush=True)
        for body, cap in zip(bodies, caps) if args.opcodes else ():
            top = opcode_counts(body).most_common(args.opcodes)
            print(f"    loop of {len(body)} instructions per {cap}-token step: "
                  + " ".join(f"{op} {n}" for op, n in top))
    return 0


def policy_report(args, triton) -> int:
    """``--policy``: the fused policy launch as the DiffKV cache runs it on the GPU
    (K8V4 pages of 32 slots, K4V2 of 64, group 4, head dim 128, 4 warps, blocks of
    512 tokens), per ``--lane-victims`` value: registers, and for each loop of the
    kernel its instructions, barriers (BAR) and shuffles (SHFL) per iteration."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.policy_scores import RowPartials, score_victims

    S, H, G, D, caps, widths, P, N = 8, 8, 4, 128, (32, 64), (40, 10), 4096, 256
    i32, f32, bf16 = jnp.int32, jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    logits = [sds((S, H, G, w * c), f32) for w, c in zip(widths, caps)]
    pages = [sds((S, H, w), i32) for w in widths]
    n_tok = [sds((S, H), i32)] * 2
    row = sds((S,), i32)
    side = (sds((P, caps[1]), f32), sds((P, caps[1]), i32))  # scores, positions
    parts = (sds((N, 16, D), f32), sds((N, 16), f32), sds((N, 16), f32), sds((S, H, 2), i32),
             sds((S, H, G, D), bf16), sds((S, H, D), bf16), sds((S, H, D), bf16))
    print(f"{'lane_victims':12s} {'regs':>5s} {'spill B':>7s}  loops: instructions / BAR / "
          "SHFL per iteration")
    for lanes in (bool(int(x)) for x in args.lane_victims.split(",")):
        def launch(logits, pages, n_tok, cur, plen, scores, positions, parts, lanes=lanes):
            return score_victims(logits, None, None, pages, n_tok, cur, plen, scores, positions,
                                 caps=caps, group=G, interpret=False, merge=False,
                                 partials=RowPartials(*parts), lane_victims=lanes)

        name = f"policy_scores_lanes{int(lanes)}"
        path = os.path.join(args.out, name + ".ttir")
        with open(path, "w") as fh:
            fh.write(strip_locations(triton_ir(jax.jit(launch), logits, pages, n_tok, row, row,
                                               *side, parts)))
        if triton is None:
            print(f"{str(lanes):12s}  (no triton package: TTIR written only)")
            continue
        regs, spills, _, sass = compile_sass(triton, path, args.out, name, 4, 2)
        loops = []
        for body in loop_bodies(sass):
            ops = opcode_counts(body)
            loops.append(f"{len(body)} / {ops.get('BAR', 0)} / {ops.get('SHFL', 0)}")
        print(f"{str(lanes):12s} {regs:5d} {spills:7d}  " + ", ".join(loops), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
