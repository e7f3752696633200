#!/usr/bin/env python
"""How the engine's preemption settings change a memory-bound workload (any device).

A small random Llama-architecture model serves requests arriving over time on
a pool of a few longest requests, so that the pool runs short. For each cache
method and pool size it compares: preempting on the free-page bound alone
(``Engine.READ_BEFORE_PREEMPTING = False``), reading every result in flight
first (the default), and swapping preempted caches to host memory
(``preemption="swap"``). It counts steps to serve everything, preemptions,
tokens prefilled (recomputation included) and their padded size.

    python scripts/bench_preemption.py --kinds full,diffkv --pools 1.2,1.5
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("bound-only", "read-first", "swap")


def serve(cfg, params, kind, pool_mult, mode, args):
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.engine import Engine
    from diffkv_jax.generation import SamplingParams
    from diffkv_jax.methods import make_method

    opts = dict(window=4, alpha_high=1.0, alpha_low=0.5) if kind == "diffkv" else {}
    longest = args.max_prompt + args.max_new
    method = make_method(kind, cfg, max_seqs=args.max_batch, max_context=longest + 4,
                         page_size=4 if kind == "full" else 8, dtype=jnp.float32, **opts)
    step_pages = method.num_layers * method.num_kv_heads * method.max_new_pages_per_row
    pages = int(method.pages_for_tokens(longest) * pool_mult) + 2 * step_pages
    eng = Engine(cfg, params, method, num_pages=pages,
                 preemption="swap" if mode == "swap" else "recompute")
    eng.READ_BEFORE_PREEMPTING = mode != "bound-only"
    rng = np.random.default_rng(args.seed)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=int(rng.integers(1, args.max_prompt))))
               for _ in range(args.requests)]
    news = [int(rng.integers(1, args.max_new)) for _ in range(args.requests)]
    arrivals = sorted(rng.integers(0, args.arrival_steps, size=args.requests))
    ids, step = [], 0
    while len(ids) < args.requests or eng.has_unfinished():
        while len(ids) < args.requests and arrivals[len(ids)] <= step:
            i = len(ids)
            ids.append(eng.add_request(prompts[i], SamplingParams(max_new_tokens=news[i])))
        eng.step()
        step += 1
    reqs = [eng.requests[i] for i in ids]
    assert all(r.status == "finished" for r in reqs) and eng.free_pages == eng.num_pages
    return dict(kind=kind, pool=pool_mult, mode=mode, pages=pages, steps=step,
                preemptions=sum(r.preemptions for r in reqs), reads=eng.preemption_syncs,
                swaps=eng.swap_outs, prompt_tokens=sum(len(p) for p in prompts),
                prefill_tokens=eng.prefill_tokens, prefill_padded=eng.prefill_padded_tokens,
                generated=sum(len(r.output) for r in reqs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="full,diffkv")
    p.add_argument("--pools", default="1.2,1.5", help="pool sizes, in longest requests")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-prompt", type=int, default=20)
    p.add_argument("--max-new", type=int, default=40)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--arrival-steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.llama import init_params

    cfg = ModelConfig(name="tiny", vocab_size=97, hidden_size=64, intermediate_size=128,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      rope_theta=10000.0, max_position_embeddings=512,
                      tie_word_embeddings=False, qkv_bias=True)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    rows = []
    for kind in args.kinds.split(","):
        for pool in map(float, args.pools.split(",")):
            for mode in args.modes.split(","):
                rows.append(serve(cfg, params, kind, pool, mode, args))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), rows=rows), fh, indent=1)
    print(f"\n{'cache':7s} {'pool':>5s} {'mode':11s} {'steps':>6s} {'preempt':>8s} "
          f"{'reads':>6s} {'swaps':>6s} {'prefilled':>10s} {'padded':>8s}")
    for r in rows:
        print(f"{r['kind']:7s} {r['pool']:5.1f} {r['mode']:11s} {r['steps']:6d} "
              f"{r['preemptions']:8d} {r['reads']:6d} {r['swaps']:6d} "
              f"{r['prefill_tokens']:10d} {r['prefill_padded']:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
