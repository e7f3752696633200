#!/usr/bin/env python
"""Choose DiffKV thresholds for a model: the most compression within a quality budget.

Scores calibration documents (CoQA stories past the ones the evaluation uses)
teacher-forced through the decode path, with compression active, for the
uncompressed cache and every (alpha_high, alpha_low) of a grid; keeps the
settings whose perplexity increase and top-1 agreement with the uncompressed
run stay within the budget, and writes the one with the fewest cache bytes as
the model's preset (picked up by ``--kv diffkv``):

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


def choose(rows, max_ppl_increase: float, min_agreement: float):
    """The admissible row with the smallest memory ratio (ties: lower perplexity), or None."""
    ok = [r for r in rows if r["ppl_increase"] <= max_ppl_increase
          and r["agreement"] >= min_agreement]
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
    p.add_argument("--max-ppl-increase", type=float, default=0.02,
                   help="quality budget: relative perplexity increase over the uncompressed cache")
    p.add_argument("--min-agreement", type=float, default=0.95,
                   help="quality budget: top-1 agreement with the uncompressed cache")
    p.add_argument("--preset-dir", default=None,
                   help="where the preset goes (default: $DIFFKV_JAX_PRESETS or "
                        "~/.cache/diffkv-jax/presets)")
    p.add_argument("--json", default=None, help="also write every setting's numbers here")
    args = p.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from diffkv_jax.evaluation.datasets import long_text_documents
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

    full, secs = score("full")
    print(f"full: perplexity {full.perplexity:.3f} ({secs:.0f} s)", flush=True)
    rows = []
    for ah, al in itertools.product(floats(args.alpha_high), floats(args.alpha_low)):
        if not ah > al:
            continue
        res, secs = score("diffkv", alpha_high=ah, alpha_low=al)
        m = res.memory
        row = dict(alpha_high=ah, alpha_low=al, perplexity=res.perplexity,
                   ppl_increase=res.perplexity / full.perplexity - 1,
                   agreement=float((res.argmax == full.argmax).mean()),
                   memory_ratio=(m["page_bytes"] + m["table_bytes"]) / m["bytes_16bit_same_tokens"],
                   frac_high=m["frac_high"], frac_low=m["frac_low"], frac_pruned=m["frac_pruned"])
        rows.append(row)
        print(f"alpha_high={ah:<5g} alpha_low={al:<5g} ppl {row['perplexity']:.3f} "
              f"({row['ppl_increase']:+.2%}) top-1 {row['agreement']:.1%} memory "
              f"{row['memory_ratio']:.1%} (high {row['frac_high']:.0%}, low "
              f"{row['frac_low']:.0%}, pruned {row['frac_pruned']:.0%}) [{secs:.0f} s]",
              flush=True)
    best = choose(rows, args.max_ppl_increase, args.min_agreement)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(model=cfg.name, full_perplexity=full.perplexity, rows=rows,
                           chosen=best, args=vars(args)), fh, indent=1)
    if best is None:
        print(f"no setting meets the budget (perplexity +{args.max_ppl_increase:.1%}, top-1 >= "
              f"{args.min_agreement:.0%}); no preset written", file=sys.stderr)
        return 1
    path = save_preset(cfg.name, dict(alpha_high=best["alpha_high"], alpha_low=best["alpha_low"]),
                       dict(method="scripts/calibrate.py", date=time.strftime("%Y-%m-%d"),
                            docs=args.docs, tokens=args.tokens, prefix=args.prefix,
                            skip=CALIBRATION_SKIP, budget=dict(
                                max_ppl_increase=args.max_ppl_increase,
                                min_agreement=args.min_agreement),
                            full_perplexity=full.perplexity,
                            result={k: best[k] for k in ("perplexity", "ppl_increase",
                                                         "agreement", "memory_ratio")}),
                       args.preset_dir)
    print(f"\nchosen: alpha_high={best['alpha_high']:g} alpha_low={best['alpha_low']:g}: "
          f"memory {best['memory_ratio']:.1%} of 16-bit, perplexity "
          f"{best['ppl_increase']:+.2%}, top-1 {best['agreement']:.1%}\npreset written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
