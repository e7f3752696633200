#!/usr/bin/env python
"""Compile time, first-call time and steady-state time of one decode step (diagnostics).

    python scripts/first_call_cost.py --model llama3-8b --layers 2 --methods full,diffkv
"""

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--methods", default="full,diffkv")
    p.add_argument("--attention", default="pallas")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--page-slots", type=int, default=8, help="pages read per row (bucket)")
    p.add_argument("--pages", type=int, default=0, help="pool pages (default: 40 per row)")
    p.add_argument("--hlo-copies", action="store_true",
                   help="list copy instructions of the compiled step larger than 64 MiB")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from diffkv_jax.batch import DecodeBatch
    from diffkv_jax.methods import make_method
    from diffkv_jax.steps import CompiledSteps
    from models.config import get_preset
    from models.loading import random_params

    cfg = dataclasses.replace(get_preset(args.model), num_layers=args.layers)
    params = random_params(cfg, 0, jnp.bfloat16)
    for name in args.methods.split(","):
        m = make_method(name, cfg, max_seqs=args.seqs, max_context=4096, dtype=jnp.bfloat16,
                        attention_impl=args.attention)
        state = m.init_state(args.pages or args.seqs * cfg.num_layers * cfg.num_kv_heads * 40)
        steps = CompiledSteps(cfg, m, jnp.bfloat16)
        batch = DecodeBatch(jnp.zeros(args.seqs, jnp.int32), jnp.ones(args.seqs, bool),
                            args.page_slots)
        t0 = time.perf_counter()
        exe = steps.decode.lower(params, state, batch).compile()
        t1 = time.perf_counter()
        state, logits = exe(params, state, batch)
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        if args.hlo_copies:
            import re

            for line in exe.as_text().splitlines():
                m_ = re.search(r"= (\w+)\[([\d,]+)\][^ ]* copy\(", line)
                if m_:
                    n = 1
                    for d in m_.group(2).split(","):
                        n *= int(d)
                    if n >= 64 * 2**20 // 2:
                        print("   copy:", line.strip()[:160])
        ts = []
        for _ in range(5):
            a = time.perf_counter()
            state, logits = exe(params, state, batch)
            jax.block_until_ready(logits)
            ts.append(time.perf_counter() - a)
        print(f"{name:8s} compile {t1 - t0:7.2f} s  first call {t2 - t1:7.2f} s  "
              f"then {sorted(ts)[2] * 1e3:8.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
