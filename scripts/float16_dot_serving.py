#!/usr/bin/env python
"""How far two DiffKV kernel paths drift apart when the dots take float16 operands.

The engine's compiled comparisons (tests/test_diffkv_kernel_path.py) serve the
same prompts with two launches that sum differently (two merges, two dot
tilings) and compare the policy's scores after 30 steps. On the GPU the
quantized launches take float16 dot operands; in interpret mode float32. This
script runs such a pair in interpret mode (CPU is enough) with the launch forced
to float16 operands, the way the GPU runs it, optionally with the value codes in
place and each lane's metadata once, and prints the largest score difference
against a tolerance:

    python scripts/float16_dot_serving.py --pair tiles --options off,on
    python scripts/float16_dot_serving.py --pair policy-merge --rtol 1e-4 --atol 1e-5

Pairs: ``tiles`` (query against token tiles, both merged in the policy launch),
``policy-merge`` (XLA's merge against the policy launch's), ``launch-merge``
(the policy launch's merge against the attention launch's). The model, prompts,
settings and serving loop are the tests' own (tests/test_diffkv_kernel_path.py,
as compiled: head dim 64, pages of 16 tokens, 40 and 70 token prompts, 40 new
tokens, 30 steps).
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

#: (first method's options, second's), over the compiled tests' DiffKV settings.
PAIRS = {
    "tiles": (dict(kernel_tiles="queries", merge_impl="pallas"),
              dict(kernel_tiles="tokens", merge_impl="pallas")),
    "policy-merge": (dict(merge_impl="xla"), dict(merge_impl="pallas")),
    "launch-merge": (dict(merge_impl="pallas"), dict(merge_impl="launch")),
}
#: The seed of each pair's prompts in the tests.
SEEDS = {"tiles": 12, "policy-merge": 8, "launch-merge": 10}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="tiles", choices=sorted(PAIRS))
    p.add_argument("--options", default="off,on",
                   help="','-list: off (values in place and each lane's metadata once "
                        "both off), on (both on: the caches' launch)")
    p.add_argument("--rtol", type=float, default=2e-3)
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args()

    from diffkv_jax import diffkv_kernel_attention as dka
    # The tests' own model, prompts, settings and serving loop, as they run compiled.
    from tests.conftest import TINY
    from tests.test_diffkv_kernel_path import _kernel_method, _serve, _two_prompts

    cfg, params, prompts = _two_prompts((TINY, None), True, seed=SEEDS[args.pair])
    launch = dka._launch
    rows = []
    print(f"pair {args.pair}; tolerance rtol {args.rtol:g}, atol {args.atol:g}; "
          f"backend {jax.default_backend()}")
    print("options  same tokens  frac_low (a, b)   max err / allowed  over   max abs err  "
          "max |score|  time")
    for opt in filter(None, args.options.split(",")):
        if opt not in ("off", "on"):
            raise SystemExit(f"--options: off or on, got {opt!r}")
        on = opt == "on"

        def forced(*a, _on=on, **k):  # the GPU's float16 operands, here
            return dataclasses.replace(launch(*a, **k), dot_dtype="float16",
                                       values_in_place=_on, lane_meta_select=_on)

        dka._launch = forced
        try:
            t0 = time.perf_counter()
            runs = [_serve(cfg, params, _kernel_method(cfg, True, **o), prompts,
                           max_new=40, steps=30) for o in PAIRS[args.pair]]
        finally:
            dka._launch = launch
        a, b = runs[1][1], runs[0][1]
        err = np.abs(a - b)
        allowed = args.atol + args.rtol * np.abs(b)
        r = dict(options=opt, same_tokens=runs[0][0] == runs[1][0],
                 frac_low=[runs[0][2]["frac_low"], runs[1][2]["frac_low"]],
                 max_err_over_allowed=float((err / allowed).max()),
                 over=int((err > allowed).sum()), scores=int(err.size),
                 max_abs_err=float(err.max()), max_score=float(np.abs(b).max()))
        rows.append(r)
        print(f"{opt:8s} {str(r['same_tokens']):12s} "
              f"{r['frac_low'][0]:.3f}, {r['frac_low'][1]:.3f}   "
              f"{r['max_err_over_allowed']:17.2f}  {r['over']:4d}   "
              f"{r['max_abs_err']:11.2e}  {r['max_score']:11.2f}  "
              f"{time.perf_counter() - t0:4.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"pair": args.pair, "rtol": args.rtol, "atol": args.atol, "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
