#!/usr/bin/env python
"""Time a decode step's page allocation (``end_decode``) at serving shapes, by prefix sum.

Every decode step ends with the cache's allocation: one exclusive prefix sum
over all (sequence, layer, KV head, tier) rows' page requests, a slice of the
circular free list each, and the page-table update. This times it for the
DiffKV and the uncompressed cache at the throughput benchmark's shapes (128
slots of Llama3-8B: 65,536 DiffKV tier rows), once with each prefix sum:

* ``cumsum``: ``jnp.cumsum`` (what :func:`diffkv_jax.free_list.exclusive_cumsum` uses);
* ``associative_scan``: ``jax.lax.associative_scan`` (what it used before).

The DiffKV state has 3% of its tier regions full (they get a page); the step is
timed back to back with the state donated, as in the engine. Both variants must
leave the same page tables and free counts.

    python scripts/bench_page_allocation.py            # on the GPU
    python scripts/bench_page_allocation.py --small    # 8 slots, for a quick CPU check
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--small", action="store_true", help="8 slots and small pools")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax import free_list as fl
    from diffkv_jax.batch import DecodeBatch
    from diffkv_jax.methods import make_method
    from models.config import get_preset

    cfg = get_preset(args.model)
    S = 8 if args.small else 128
    pools = {"diffkv": 20000 if args.small else 898779, "full": 786432}
    current = fl.exclusive_cumsum

    def associative_scan(counts):
        inclusive = jax.lax.associative_scan(jnp.add, counts)
        return inclusive - counts, inclusive[-1]

    variants = {"cumsum": current, "associative_scan": associative_scan}
    rows = []
    try:
        for name in ("diffkv", "full"):
            m = make_method(name, cfg, max_seqs=S, max_context=8192, dtype=jnp.bfloat16,
                            attention_impl="pallas")
            ref = None
            for vname, fn in variants.items():
                fl.exclusive_cumsum = fn
                rng = np.random.default_rng(0)
                state = m.init_state(pools[name])
                if name == "diffkv":
                    cap = np.asarray([m.cap(0), m.cap(1)])
                    n_pages = np.ones((S + 1, cfg.num_layers, cfg.num_kv_heads, 2), np.int32)
                    n_tok = np.minimum(rng.integers(0, cap + 1, size=n_pages.shape), cap - 1)
                    n_tok = np.where(rng.random(n_tok.shape) < 0.03, cap, n_tok)
                    state = state.replace(n_tok=jnp.asarray(n_tok, jnp.int32),
                                          n_pages=jnp.asarray(n_pages))
                batch = DecodeBatch(jnp.zeros(S, jnp.int32), jnp.ones(S, bool), 1)
                step = jax.jit(m.end_decode, donate_argnums=0)
                st = jax.block_until_ready(step(state, batch))
                check = (int(np.asarray(st.page_table).sum()), int(st.free.num_free))
                ref = ref or check
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        st = step(st, batch)
                    jax.block_until_ready(st)
                    times.append((time.perf_counter() - t0) / args.iters * 1e3)
                rows.append({"method": name, "prefix_sum": vname, "ms": min(times),
                             "same_result": check == ref})
                print("done", name, vname, file=sys.stderr, flush=True)
    finally:
        fl.exclusive_cumsum = current

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(jax.devices()[0]), "slots": S, "rows": rows}, fh, indent=2)
    print(f"{'method':8} {'prefix sum':18} {'end_decode ms':>14}  same result")
    for r in rows:
        print(f"{r['method']:8} {r['prefix_sum']:18} {r['ms']:14.4f}  {r['same_result']}")
    return 0 if all(r["same_result"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
