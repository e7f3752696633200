#!/usr/bin/env python
"""Time the on-device memory manager of the DiffKV cache (runs on CPU or GPU).

* decode compaction: the per-step headroom allocation for every (sequence,
  layer, KV head, tier) row: one exclusive prefix sum over all rows, a slice
  of the circular free list each, and the page-table update (``end_decode``);
* prompt compaction: returning the unused part of every conservative prompt
  page set (``end_prefill``);
* for scale, one full decode step of a model with the same cache geometry
  (random weights; SmolLM2-135M shapes by default) at the same batch.

    python scripts/bench_compaction.py --seqs 256 --layers 30 --kv-heads 3
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timeit(fn, state, *args, repeats=20):
    """Median time of ``state = fn(state, *args)`` with the state donated (as in the engine).

    Each call starts from the same logical state (a fresh copy made outside the
    timed region), so every timed call does the same work.
    """
    import jax
    import jax.numpy as jnp

    fresh = lambda: jax.tree_util.tree_map(jnp.copy, state)  # noqa: E731
    jax.block_until_ready(fn(fresh(), *args))
    times = []
    for _ in range(repeats):
        s = fresh()
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        out = fn(s, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="tokens cached per sequence")
    p.add_argument("--model", default="smollm2-135m", help="preset whose shapes the decode "
                   "step uses (random weights); 'none' skips it")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.batch import DecodeBatch
    from diffkv_jax.diffkv_cache import DiffKVCache

    S, L, H = args.seqs, args.layers, args.kv_heads
    m = DiffKVCache(L, H, args.head_dim, max_seqs=S, max_context=2 * args.context)
    rng = np.random.default_rng(0)
    cap_h, cap_l = m.cap(0), m.cap(1)
    # A realistic mid-generation state: ~70% of tokens high, ~28% low, each row's
    # regions partly full; rows whose region is exactly full need a page this step.
    n_hi = rng.integers(int(0.6 * args.context), int(0.8 * args.context), size=(S, L, H))
    n_lo = rng.integers(int(0.2 * args.context), int(0.3 * args.context), size=(S, L, H))
    p_hi, p_lo = n_hi // cap_h + 1, n_lo // cap_l + 1
    full_hi = rng.random((S, L, H)) < 1 / cap_h
    full_lo = rng.random((S, L, H)) < 1 / cap_l
    n_hi = np.where(full_hi, p_hi * cap_h, n_hi)
    n_lo = np.where(full_lo, p_lo * cap_l, n_lo)
    owned = int(p_hi.sum() + p_lo.sum())
    num_pages = owned + 4 * S * L * H
    state = m.init_state(num_pages)
    R = m.row_len
    table = np.full((S + 1, L, H, R), num_pages, np.int32)
    ids = np.arange(owned, dtype=np.int32)
    k = 0
    for idx in np.ndindex(S, L, H):
        a, b = p_hi[idx], p_lo[idx]
        table[idx][:a] = ids[k:k + a]
        table[idx][R - b:] = ids[k + a:k + a + b]
        k += a + b
    pad = lambda x: np.concatenate([x, np.zeros((1,) + x.shape[1:], x.dtype)])  # noqa: E731
    free_pages = np.concatenate([np.arange(owned, num_pages), np.arange(owned)]).astype(np.int32)
    state = state.replace(
        page_table=jnp.asarray(table),
        n_tok=jnp.asarray(pad(np.stack([n_hi, n_lo], -1).astype(np.int32))),
        n_pages=jnp.asarray(pad(np.stack([p_hi, p_lo], -1).astype(np.int32))),
        seq_len=jnp.asarray(np.r_[np.full(S, args.context), 0].astype(np.int32)),
        free=state.free.replace(pages=jnp.asarray(free_pages),
                                num_free=jnp.asarray(num_pages - owned, jnp.int32)))
    batch = DecodeBatch(jnp.zeros(S, jnp.int32), jnp.ones(S, bool), 1)
    need = int(full_hi.sum() + full_lo.sum())

    decode_compact = jax.jit(m.end_decode, donate_argnums=(0,))
    t_decode, after = timeit(decode_compact, state, batch, repeats=args.repeats)
    got = int(num_pages - owned - int(after.free.num_free))
    assert got == need, (got, need)

    # Prompt compaction: conservative sets of B prompts returned in one prefix sum.
    from diffkv_jax.batch import PrefillBatch

    B, T = 16, args.context
    pm = DiffKVCache(L, H, args.head_dim, max_seqs=B, max_context=T + 64)
    pstate = pm.init_state(B * pm.pages_for_tokens(T + 64))
    pbatch = PrefillBatch(jnp.zeros((B, T), jnp.int32), jnp.full((B,), T, jnp.int32),
                          jnp.arange(B, dtype=jnp.int32))
    pstate, ctx = jax.jit(pm.begin_prefill)(pstate, pbatch)
    n_p = np.stack([rng.integers(1, T // pm.cap(0), size=(B, L, H)),
                    rng.integers(1, T // pm.cap(1), size=(B, L, H))], -1).astype(np.int32)
    pstate = pstate.replace(n_pages=pstate.n_pages.at[:B].set(jnp.asarray(n_p)))
    prompt_compact = jax.jit(pm.end_prefill, donate_argnums=(0,))
    t_prompt, _ = timeit(prompt_compact, pstate, ctx, repeats=args.repeats)

    result = {
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "rows": S * L * H * 2, "seqs": S, "layers": L, "kv_heads": H,
        "decode_compaction_ms": t_decode * 1e3, "pages_allocated_per_step": need,
        "prompt_compaction_ms_16x%d" % T: t_prompt * 1e3,
    }

    if args.model != "none":
        from diffkv_jax.steps import CompiledSteps
        from models.config import get_preset
        from models.llama import init_params

        cfg = get_preset(args.model)
        if (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (L, H, args.head_dim):
            dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
            params = init_params(cfg, jax.random.PRNGKey(0), dtype)
            steps = CompiledSteps(cfg, m, dtype)
            width = 1 << (int(args.context // cap_h + 2) - 1).bit_length()
            dbatch = DecodeBatch(jnp.zeros(S, jnp.int32), jnp.ones(S, bool), width)
            st = jax.tree_util.tree_map(jnp.copy, after)
            st, logits = steps.decode(params, st, dbatch)
            jax.block_until_ready(logits)
            ts = []
            for _ in range(max(3, args.repeats // 4)):
                t0 = time.perf_counter()
                st, logits = steps.decode(params, st, dbatch)
                jax.block_until_ready(logits)
                ts.append(time.perf_counter() - t0)
            ts.sort()
            result["decode_step_ms"] = ts[len(ts) // 2] * 1e3
            result["compaction_share_of_step"] = t_decode / ts[len(ts) // 2]

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
