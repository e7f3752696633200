#!/usr/bin/env python
"""Choose DiffKV thresholds for a model: the most compression within a quality budget.

Scores calibration documents (CoQA stories past the ones the evaluation uses)
teacher-forced through the decode path, with compression active, for the
uncompressed cache and every (alpha_high, alpha_low) of a grid, and asks each
setting for the keys of synthetic passkey prompts (a haystack and keys other
than the evaluation's: seed 1); keeps the settings whose perplexity increase,
top-1 agreement with the uncompressed run and passkey retrieval (the share of
the keys the uncompressed cache finds that the setting finds too) stay within
the budget, and writes the one with the fewest cache bytes as the model's
preset (picked up by ``--kv diffkv``):

    python scripts/calibrate.py --model smollm2-135m --docs 2 --tokens 1024

The grid, the budget and where the preset goes are options; every setting's
numbers are printed and saved as JSON.
"""

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Passages skipped before the calibration text starts, so it does not overlap
#: the evaluation's long-text documents (built from the first passages).
CALIBRATION_SKIP = 400


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def windows(text: str) -> list[int | None]:
    """``64,all`` -> [64, None]: prompt queries counted by the prompt scores (None: all)."""
    return [None if x == "all" else int(x) for x in text.split(",") if x]


#: Seed of the calibration passkeys; the evaluation's are seed 0.
CALIBRATION_PASSKEY_SEED = 1


def choose(rows, max_ppl_increase: float, min_agreement: float, min_retrieval: float = 0.0):
    """The admissible row with the smallest memory ratio (ties: lower perplexity), or None.

    A row without a ``retrieval`` entry (no passkeys asked) passes that criterion."""
    ok = [r for r in rows if r["ppl_increase"] <= max_ppl_increase
          and r["agreement"] >= min_agreement and r.get("retrieval", 1.0) >= min_retrieval]
    return min(ok, key=lambda r: (r["memory_ratio"], r["ppl_increase"])) if ok else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--model-path", default=None)
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per calibration document")
    p.add_argument("--prefix", type=int, default=256, help="prompt part of each document")
    p.add_argument("--alpha-high", default="0.5,1,2,4")
    p.add_argument("--alpha-low", default="0,0.02,0.05,0.1,0.2")
    p.add_argument("--obs-window", default="64",
                   help="prompt-phase observation windows to try: the last N prompt queries "
                        "count towards a token's score, 'all' for every query (e.g. 64,all)")
    p.add_argument("--max-ppl-increase", type=float, default=0.02,
                   help="quality budget: relative perplexity increase over the uncompressed cache")
    p.add_argument("--min-agreement", type=float, default=0.95,
                   help="quality budget: top-1 agreement with the uncompressed cache")
    p.add_argument("--passkeys", type=int, default=10,
                   help="calibration passkey prompts (over five depths; 0: no retrieval check)")
    p.add_argument("--passkey-length", type=int, default=1024, help="tokens per passkey prompt")
    p.add_argument("--min-retrieval", type=float, default=1.0,
                   help="quality budget: share of the keys the uncompressed cache retrieves "
                        "that a setting must retrieve too")
    p.add_argument("--preset-dir", default=None,
                   help="where the preset goes (default: $DIFFKV_JAX_PRESETS or "
                        "~/.cache/diffkv-jax/presets)")
    p.add_argument("--json", default=None, help="also write every setting's numbers here")
    args = p.parse_args()

    import jax.numpy as jnp

    from diffkv_jax.evaluation.datasets import load_passkey, long_text_documents
    from diffkv_jax.evaluation.tasks import passkey_score
    from diffkv_jax.engine import pages_to_serve
    from diffkv_jax.generation import Generator, SamplingParams
    from diffkv_jax.methods import make_method
    from diffkv_jax.presets import save_preset
    from diffkv_jax.scoring import score_teacher_forced
    from models.loading import load_model

    loaded = load_model(args.model, args.model_path)
    cfg, params, tok = loaded.cfg, loaded.params, loaded.tokenizer
    dtype = jnp.float32
    docs = [list(d.token_ids) for d in long_text_documents(
        tok.encode, args.tokens, args.docs, skip=CALIBRATION_SKIP)]
    common = dict(max_seqs=len(docs), max_context=args.tokens, dtype=dtype)

    def score(name, **opts):
        t0 = time.perf_counter()
        res = score_teacher_forced(cfg, params, make_method(name, cfg, **common, **opts),
                                   docs, args.prefix, dtype, progress=False)
        return res, time.perf_counter() - t0

    passkeys = load_passkey(tok.encode, lengths=(args.passkey_length,),
                            per_cell=-(-args.passkeys // 5), seed=CALIBRATION_PASSKEY_SEED,
                            limit=args.passkeys) if args.passkeys else []
    passkey_ids = [tok.encode(ex.prompt) for ex in passkeys]

    def retrieved(name, **opts) -> set[int]:
        """Indices of the calibration passkeys whose key the setting's greedy reply gives."""
        if not passkeys:
            return set()
        new = 8
        method = make_method(name, cfg, max_seqs=len(passkeys),
                             max_context=max(map(len, passkey_ids)) + new, dtype=dtype, **opts)
        pages = sum(pages_to_serve(method, len(ids) + new) for ids in passkey_ids)
        gen = Generator(cfg, params, method, pages, dtype)
        res = gen.generate(passkey_ids, [SamplingParams(max_new_tokens=new)] * len(passkeys))
        return {i for i, (ex, out) in enumerate(zip(passkeys, res.tokens))
                if passkey_score(tok.decode(out), ex.passkey) == 1.0}

    full, secs = score("full")
    full_keys = retrieved("full")
    print(f"full: perplexity {full.perplexity:.3f}, passkeys {len(full_keys)}/{len(passkeys)} "
          f"({secs:.0f} s)", flush=True)
    rows = []
    for obs, ah, al in itertools.product(windows(args.obs_window), floats(args.alpha_high),
                                         floats(args.alpha_low)):
        if not ah > al:
            continue
        opts = dict(alpha_high=ah, alpha_low=al, obs_window=obs)
        res, secs = score("diffkv", **opts)
        t0 = time.perf_counter()
        keys = retrieved("diffkv", **opts)
        secs += time.perf_counter() - t0
        m = res.memory
        row = dict(alpha_high=ah, alpha_low=al, obs_window=obs, perplexity=res.perplexity,
                   ppl_increase=res.perplexity / full.perplexity - 1,
                   agreement=float((res.argmax == full.argmax).mean()),
                   memory_ratio=(m["page_bytes"] + m["table_bytes"]) / m["bytes_16bit_same_tokens"],
                   frac_high=m["frac_high"], frac_low=m["frac_low"], frac_pruned=m["frac_pruned"])
        if passkeys:
            row.update(passkeys=len(keys), retrieval=len(keys & full_keys) / max(len(full_keys), 1))
        rows.append(row)
        print(f"obs_window={obs or 'all'!s:<4} alpha_high={ah:<5g} alpha_low={al:<5g} "
              f"ppl {row['perplexity']:.3f} ({row['ppl_increase']:+.2%}) top-1 {row['agreement']:.1%} memory "
              f"{row['memory_ratio']:.1%} (high {row['frac_high']:.0%}, low "
              f"{row['frac_low']:.0%}, pruned {row['frac_pruned']:.0%})"
              + (f" passkeys {len(keys)}/{len(passkeys)}" if passkeys else "")
              + f" [{secs:.0f} s]",
              flush=True)
    min_retrieval = args.min_retrieval if full_keys else 0.0
    best = choose(rows, args.max_ppl_increase, args.min_agreement, min_retrieval)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(model=cfg.name, full_perplexity=full.perplexity,
                           full_passkeys=len(full_keys), num_passkeys=len(passkeys), rows=rows,
                           chosen=best, args=vars(args)), fh, indent=1)
    if best is None:
        print(f"no setting meets the budget (perplexity +{args.max_ppl_increase:.1%}, top-1 >= "
              f"{args.min_agreement:.0%}, passkey retrieval >= {min_retrieval:.0%}); no preset "
              "written", file=sys.stderr)
        return 1
    path = save_preset(cfg.name, {k: best[k] for k in ("alpha_high", "alpha_low", "obs_window")},
                       dict(method="scripts/calibrate.py", date=time.strftime("%Y-%m-%d"),
                            docs=args.docs, tokens=args.tokens, prefix=args.prefix,
                            skip=CALIBRATION_SKIP, budget=dict(
                                max_ppl_increase=args.max_ppl_increase,
                                min_agreement=args.min_agreement,
                                min_retrieval=min_retrieval),
                            passkeys=dict(n=len(passkeys), length=args.passkey_length,
                                          seed=CALIBRATION_PASSKEY_SEED,
                                          full_retrieved=len(full_keys)),
                            full_perplexity=full.perplexity,
                            result={k: best[k] for k in ("perplexity", "ppl_increase",
                                                         "agreement", "memory_ratio",
                                                         "retrieval") if k in best}),
                       args.preset_dir)
    print(f"\nchosen: alpha_high={best['alpha_high']:g} alpha_low={best['alpha_low']:g} "
          f"obs_window={best['obs_window'] or 'all'}: "
          f"memory {best['memory_ratio']:.1%} of 16-bit, perplexity "
          f"{best['ppl_increase']:+.2%}, top-1 {best['agreement']:.1%}"
          + (f", passkey retrieval {best['retrieval']:.0%}" if "retrieval" in best else "")
          + f"\npreset written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
