"""``generate``: text generation from the command line (``scripts/generate.py``).

Bad input (unknown model, missing weights, empty or over-long prompt, invalid
sampling values, unreadable files) prints one ``error:`` line on stderr and
exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from diffkv_jax import presets
from diffkv_jax.methods import DEFAULT_METHOD, METHODS



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate text with a Llama-family model through a paged KV cache.")
    p.add_argument("--model", default="smollm2-135m",
                   help="preset name (e.g. smollm2-135m, llama3-8b) or a path to a "
                        "safetensors directory or .gguf file (default: smollm2-135m, embedded)")
    p.add_argument("--model-path", default=None,
                   help="weights for the preset: a Hugging Face safetensors directory or .gguf")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string: generation ends before it (the text is cut there); "
                        "repeat for several")
    p.add_argument("--kv", default=DEFAULT_METHOD,
                   help=f"KV cache method: {', '.join(METHODS)} (default {DEFAULT_METHOD})")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (high-tier tokens for diffkv; default 16 full, 32 diffkv)")
    d = p.add_argument_group("diffkv options")
    d.add_argument("--alpha-high", type=float, default=None,
                   help="high-tier threshold, relative to the uniform attention 1/N (default: "
                        "the model's calibrated preset if any, else 1)")
    d.add_argument("--alpha-low", type=float, default=None,
                   help="pruning threshold, relative to 1/N (default: the model's calibrated "
                        "preset if any, else 0.02)")
    d.add_argument("--window", type=int, default=64, help="recent tokens always kept high")
    d.add_argument("--obs-window", type=int, default=None,
                   help="prompt queries counted for prompt-phase scores, 0 = all (default: "
                        "the calibrated preset's when it applies, else 64)")
    d.add_argument("--high-bits", default="K8V4", help="high tier, e.g. K8V4")
    d.add_argument("--low-bits", default="K4V2", help="low tier, e.g. K4V2, or 'off'")
    d.add_argument("--attention", default="reference", choices=("reference", "pallas"),
                   help="decode attention: plain jnp (default) or the Pallas paged kernel "
                        "(interpret mode without a GPU)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prefill prompts this many tokens per step (every cache but "
                        "kivi); default: whole prompts")
    p.add_argument("--max-context", type=int, default=None,
                   help="longest sequence to plan for (default: what the prompts need, "
                        "capped by the model's context)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute and cache dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-param-cache", action="store_true",
                   help="do not save/restore converted parameters with orbax")
    p.add_argument("--quiet", action="store_true", help="no statistics on stderr")
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def diffkv_thresholds(model: str, alpha_high: float | None, alpha_low: float | None,
                      obs_window: int | None = None) -> dict:
    """Policy options for ``--kv diffkv``: the thresholds given, else the model's calibrated
    preset (:mod:`diffkv_jax.presets`, written by ``scripts/calibrate.py``: thresholds and
    the observation window they were chosen with), else 1 and 0.02 with a 64-query window.
    ``obs_window`` (0: every prompt query) overrides the window either way."""
    preset = presets.load_preset(model) if alpha_high is None and alpha_low is None else None
    if preset is not None:
        options, path = preset
        print(f"diffkv thresholds from the calibrated preset {path}: alpha_high="
              f"{options.get('alpha_high')}, alpha_low={options.get('alpha_low')}"
              + (f", obs_window={options['obs_window'] or 'all'}" if "obs_window" in options
                 else ""), file=sys.stderr)
        out = {k: options[k] for k in ("alpha_high", "alpha_low", "obs_window") if k in options}
    else:
        out = dict(alpha_high=1.0 if alpha_high is None else alpha_high,
                   alpha_low=0.02 if alpha_low is None else alpha_low)
    if obs_window is not None:
        out["obs_window"] = obs_window or None
    out.setdefault("obs_window", 64)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt is None:
        return _fail("give at least one --prompt")
    if args.max_new_tokens <= 0:
        return _fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.kv not in METHODS:
        return _fail(f"unknown --kv method {args.kv!r}; available: {', '.join(METHODS)}")
    if args.page_size is not None and args.page_size <= 0:
        return _fail("--page-size must be >= 1")
    for text in args.prompt:
        if not text.strip():
            return _fail("empty prompt")
    if any(not s for s in args.stop or ()):
        return _fail("--stop needs a non-empty string")

    # Imports are deferred so argument errors answer instantly.
    from diffkv_jax.generation import GenerationInputError
    from models.config import UnknownModelError
    from models.errors import ModelLoadError

    try:
        return _run(args)
    except (UnknownModelError, ModelLoadError, GenerationInputError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


def _run(args) -> int:
    import jax
    import jax.numpy as jnp

    from diffkv_jax.engine import Engine, pages_to_serve
    from diffkv_jax.generation import GenerationInputError, SamplingParams, next_pow2
    from diffkv_jax.methods import make_method
    from models.loading import load_model

    dtype = None if args.dtype == "auto" else getattr(jnp, args.dtype)
    loaded = load_model(args.model, model_path=args.model_path, dtype=dtype,
                        use_cache=not args.no_param_cache)
    cfg, params, tok = loaded.cfg, loaded.params, loaded.tokenizer
    dtype = jax.tree_util.tree_leaves(params)[0].dtype

    texts = []
    for text in args.prompt:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": text})
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        texts.append(text)
    # A rendered chat template already carries any BOS the model wants.
    prompts = [tok.encode(t, add_special_tokens=not args.chat) for t in texts]
    longest = max(len(p) for p in prompts)
    model_ctx = cfg.max_position_embeddings
    if longest >= model_ctx:
        raise GenerationInputError(
            f"prompt has {longest} tokens; {cfg.name} has a context of {model_ctx}")
    max_context = args.max_context or min(model_ctx, next_pow2(longest + args.max_new_tokens, 64))
    max_context = min(max_context, model_ctx)
    if longest >= max_context:
        raise GenerationInputError(
            f"prompt has {longest} tokens; --max-context is {max_context}")
    if longest + args.max_new_tokens > max_context:
        print(f"note: generation capped at {max_context - longest} new tokens by the context "
              f"({max_context})", file=sys.stderr)

    stop = tuple(tok.eos_token_ids)
    sampling = [SamplingParams(args.temperature, args.top_p, args.top_k, args.seed + i,
                               args.max_new_tokens, stop, tuple(args.stop or ()))
                for i in range(len(prompts))]
    for s in sampling:
        s.validate()
    options = {"attention_impl": args.attention}
    if args.kv == "diffkv":
        low_off = args.low_bits.lower() == "off"
        alphas = diffkv_thresholds(cfg.name, args.alpha_high, args.alpha_low, args.obs_window)
        options = dict(**alphas, window=args.window, low_tier=not low_off,
                       high=args.high_bits, attention_impl=args.attention)
        if not low_off:
            options["low"] = args.low_bits
    try:
        method = make_method(args.kv, cfg, max_seqs=len(prompts), max_context=max_context,
                             dtype=dtype, page_size=args.page_size, **options)
    except ValueError as e:
        raise GenerationInputError(str(e)) from None
    # Every sequence at its longest, plus the pages decode steps may add per row.
    num_pages = sum(pages_to_serve(method, len(p) + args.max_new_tokens) for p in prompts)
    # The tokenizer detokenizes for the engine: stop strings, streamed text, Request.text.
    try:
        gen = Engine(cfg, params, method, num_pages=num_pages, dtype=dtype, detokenizer=tok,
                     prefill_chunk=args.prefill_chunk)
    except ValueError as e:  # e.g. --prefill-chunk with a cache that prefills whole prompts
        raise GenerationInputError(str(e)) from None

    single = len(prompts) == 1
    ids = [gen.add_request(p, s) for p, s in zip(prompts, sampling)]
    row_of = {rid: i for i, rid in enumerate(ids)}
    # Continuous batching. One prompt streams its text as it is sampled (never a
    # character that could still turn out to belong to a stop string); several
    # print each answer when it finishes.
    for new in gen.run():
        for rid in new:
            if single:
                piece = gen.stream_text(rid)
                if piece:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            elif gen.requests[rid].status == "finished":
                print(f"[{row_of[rid]}] {gen.requests[rid].text}", flush=True)
    if single:
        sys.stdout.write(gen.stream_text(ids[0]) + "\n")
    sys.stdout.flush()
    if not args.quiet:
        m = gen.peak_memory
        rate = lambda n, t: n / max(t, 1e-9)  # noqa: E731
        print(f"prefill: {gen.prefill_tokens} tokens in {gen.prefill_seconds:.3f} s "
              f"({rate(gen.prefill_tokens, gen.prefill_seconds):.1f} tok/s; compilation "
              f"{gen.compile_seconds:.1f} s excluded)\n"
              f"decode:  {gen.decode_tokens} tokens in {gen.decode_seconds:.3f} s "
              f"({rate(gen.decode_tokens, gen.decode_seconds):.1f} tok/s)\n"
              f"kv cache ({args.kv}, at its largest): {m['tokens']} tokens, {m['pages']} pages = "
              f"{m['page_bytes'] / 2**20:.2f} MiB + page table {m['table_bytes'] / 2**20:.2f} MiB"
              f" = {(m['page_bytes'] + m['table_bytes']) / m['bytes_16bit_same_tokens']:.1%} of "
              f"16-bit KV for the same tokens ({m['bytes_16bit_same_tokens'] / 2**20:.2f} MiB)",
              file=sys.stderr)
        if "frac_high" in m:
            print(f"tiers: high {m['frac_high']:.1%}, low {m['frac_low']:.1%}, "
                  f"pruned {m['frac_pruned']:.1%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
