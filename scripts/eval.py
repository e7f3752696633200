#!/usr/bin/env python
"""Evaluate KV-cache methods on benchmark datasets, sample by sample, against the full cache.

    python scripts/eval.py --methods full,diffkv,int8 --datasets lambada,passkey,gsm8k \\
        --limit 20 --out results/eval

Methods are names from ``diffkv_jax.methods.METHODS`` with optional options:
``diffkv:alpha_high=1.5,alpha_low=0.05`` (a plain ``diffkv`` takes the model's
calibrated preset, as ``generate.py --kv diffkv`` does; values parsed as int / float /
true / false / none, else kept as text, e.g. ``high=K8V4``; ``page_size=`` and
``dtype=`` go to ``make_method`` too). The method label written to the results
is the spec as given, so ``full`` must appear as plain ``full`` to be the
baseline that every other method is paired with (``--baseline`` to change it).

Generation tasks run through one continuous-batching :class:`Engine` per
method (shared by all its datasets, so each shape bucket compiles once),
greedy, closed loop: ``--max-batch`` requests are in flight and a new one is
submitted as soon as one finishes. Per sample, one JSON line
(:class:`SampleResult`) is appended to ``OUT/results.jsonl``:

* ``output_tokens``: the generated tokens up to the end of the answer. An EOS
  token is not counted. Task stop strings go to the engine
  (``SamplingParams.stop_strings``, the tokenizer as its detokenizer): a
  request ends at the step whose token completes a stop string (its pages go
  back to the pool at once), the text is cut before the stop string and the
  tokens kept end with the one that completed it (``finish_reason``
  ``stop_string``). This gives exactly what generating to ``max_new_tokens``
  and truncating afterwards would give (greedy), without the wasted steps,
  and the latency of a server that honours stop strings.
* ``score``: the task's scorer on that text; ``extra`` holds the text, the
  finish reason, prompt length, preemptions and the cache's own accounting.
* ``kv_bytes``: the cache bytes this request held when it finished (its pages,
  data plus per-token metadata, plus its page-table rows; see
  ``Request.kv_bytes``); ``kv_bytes_16bit``: 16-bit K and V for the same tokens.
* ``latency_s``: host wall time from submission to finish, minus compilation
  that happened meanwhile (``extra.latency_raw_s`` keeps it in).

``longppl`` documents are scored teacher-forced through the decode path with
compression active (:func:`diffkv_jax.scoring.score_teacher_forced`), in
batches of ``--max-batch`` documents: per document the mean NLL and perplexity
(``score`` stays empty), top-1 predictions for agreement with the full cache,
and the chunk's cache bytes divided by its documents. ``score_teacher_forced``
builds its own jitted steps per call, so each chunk of documents compiles once.

Runs resume: samples whose (method, dataset, sample_id) is already in the
JSONL are skipped. At the end ``summary.md``, ``summary.json`` and plots
(quality vs memory, D histogram, latency CDF, negatives by task) are written
from every record in the JSONL.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffkv_jax.evaluation.metrics import FULL_METHOD  # noqa: E402
from diffkv_jax.evaluation.tasks import TASK_NAMES  # noqa: E402
from diffkv_jax.methods import METHODS  # noqa: E402

RESULTS_FILE = "results.jsonl"
CONFIG_FILE = "config.json"
PLOTS = {
    "accuracy_vs_memory": "accuracy_vs_memory.png",
    "length_change": "length_change_hist.png",
    "latency_cdf": "latency_cdf.png",
    "negatives_by_task": "negatives_by_task.png",
}


class EvalError(Exception):
    """Bad input: printed as one ``error:`` line, exit status 2."""


# --------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class MethodRun:
    """A method to evaluate: its registry ``name``, ``options`` and result ``label``.

    ``calibrated``: options eval.py computed or looked up itself (fp8 scales, the
    DiffKV preset); they go to ``make_method`` under the given ones but stay out
    of the label.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    calibrated: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in self.options)


def _fmt(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the text."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_methods(spec: str) -> list[MethodRun]:
    """``"full,diffkv:alpha_high=1.5,alpha_low=0.05,int8"`` -> three :class:`MethodRun`.

    A comma-separated item ``key=value`` (no ``:``) continues the options of
    the method before it. Unknown names raise :class:`EvalError` listing the
    available ones.
    """
    runs: list[list] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if ":" in item:
            name, opt = item.split(":", 1)
            runs.append([name.strip(), []])
            items = [opt]
        elif "=" in item:
            if not runs:
                raise EvalError(f"option {item!r} comes before any method in --methods")
            items = [item]
        else:
            runs.append([item, []])
            items = []
        for it in items:
            if not it.strip():
                continue
            if "=" not in it:
                raise EvalError(f"method option {it!r} must look like key=value")
            k, v = it.split("=", 1)
            runs[-1][1].append((k.strip(), parse_value(v)))
    if not runs:
        raise EvalError("--methods is empty")
    out = []
    for name, opts in runs:
        if name not in METHODS:
            raise EvalError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
        keys = [k for k, _ in opts]
        if len(set(keys)) != len(keys):
            raise EvalError(f"method {name!r} repeats an option: {', '.join(keys)}")
        out.append(MethodRun(name, tuple(opts)))
    labels = [r.label for r in out]
    if len(set(labels)) != len(labels):
        raise EvalError(f"--methods lists the same method twice: {', '.join(labels)}")
    return out


def parse_datasets(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise EvalError("--datasets is empty")
    for n in names:
        if n not in TASK_NAMES:
            raise EvalError(f"unknown dataset {n!r}; available: {', '.join(TASK_NAMES)}")
    if len(set(names)) != len(names):
        raise EvalError("--datasets lists a dataset twice")
    return names


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval.py", description="Evaluate KV-cache methods x datasets against the full cache.",
        epilog=f"methods: {', '.join(METHODS)}; datasets: {', '.join(TASK_NAMES)}")
    p.add_argument("--methods", default="full,diffkv",
                   help="comma-separated methods, each optionally NAME:key=value,key=value "
                        "(default: full,diffkv)")
    p.add_argument("--datasets", default="lambada,passkey",
                   help="comma-separated datasets (default: lambada,passkey)")
    p.add_argument("--limit", type=int, default=None,
                   help="samples per dataset (first N; default: all; longppl: 8 documents)")
    p.add_argument("--out", default="results/eval", help="output folder (default results/eval)")
    p.add_argument("--model", default="smollm2-135m", help="preset name or weights path")
    p.add_argument("--model-path", default=None, help="weights for the preset")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype, and the full cache's storage dtype (auto: float32 "
                        "on CPU, bfloat16 on GPU)")
    p.add_argument("--max-context", type=_positive, default=2048,
                   help="longest sequence (prompt + generated) a request may hold; longer "
                        "prompts are skipped (default 2048)")
    p.add_argument("--max-batch", type=_positive, default=8,
                   help="requests decoded together (engine slots; default 8)")
    p.add_argument("--kv-budget-mb", type=float, default=None,
                   help="page pool size per method in MiB (default: enough for --max-batch "
                        "sequences of --max-context, so nothing is preempted)")
    p.add_argument("--max-new-tokens", type=_positive, default=None,
                   help="cap on every task's own max_new_tokens")
    p.add_argument("--chat", action="store_true",
                   help="wrap prompts in the model's chat template (default: plain completion)")
    p.add_argument("--baseline", default=FULL_METHOD,
                   help="method label that the others are paired with (default: full)")
    p.add_argument("--passkey-lengths", type=_int_list, default=(1024, 2000),
                   help="passkey prompt lengths in tokens (default 1024,2000)")
    p.add_argument("--longppl-tokens", type=_positive, default=2048,
                   help="tokens per longppl document (default 2048)")
    p.add_argument("--longppl-prefix", type=_positive, default=256,
                   help="longppl tokens prefilled before teacher-forced decoding (default 256)")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the summary and plots from the existing results")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-param-cache", action="store_true",
                   help="do not save/restore converted parameters with orbax")
    return p


# --------------------------------------------------------------------------- samples


@dataclasses.dataclass
class Sample:
    sample_id: str
    example: Any
    prompt_ids: list[int] | None = None


def sample_id(dataset: str, ex: Any, index: int) -> str:
    """A stable id: the example's own id where it has one, else a description + index.

    Passkey: ``index`` is the example's index within its (length, depth) cell,
    which with the two determines the prompt.
    """
    if dataset == "passkey":
        return f"len{ex.target_tokens}-depth{ex.depth:g}-{index}"
    if dataset == "longppl":
        return f"doc{index}-{ex.n_tokens}tok"
    for attr in ("id", "task_id"):
        v = getattr(ex, attr, None)
        if v is not None:
            return str(v)
    if dataset == "mmlu":
        return f"{ex.subject}-{index}"
    return str(index)


def load_samples(task, args, encode) -> list[Sample]:
    """The first ``--limit`` examples of ``task`` with their ids."""
    from diffkv_jax.evaluation import datasets as ds

    if task.name == "passkey":
        examples = ds.load_passkey(encode, lengths=args.passkey_lengths, limit=args.limit)
    elif task.name == "longppl":
        examples = task.load(limit=args.limit, encode=encode, target_tokens=args.longppl_tokens)
    else:
        examples = task.load(limit=args.limit, encode=encode)
    if task.name == "passkey":
        cells: collections.Counter = collections.Counter()
        index = []
        for ex in examples:
            index.append(cells[(ex.target_tokens, ex.depth)])
            cells[(ex.target_tokens, ex.depth)] += 1
    else:
        index = range(len(examples))
    samples = [Sample(sample_id(task.name, ex, i), ex) for i, ex in zip(index, examples)]
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):  # ids must be unique for pairing and resume
        samples = [Sample(f"{s.sample_id}#{i}", s.example) for i, s in enumerate(samples)]
    return samples


# --------------------------------------------------------------------------- engines


def build_method(run: MethodRun, cfg, *, max_seqs: int, max_context: int, dtype):
    """``make_method`` for ``run``; a ``dtype`` option overrides the compute dtype."""
    from diffkv_jax.methods import make_method

    opts = {**dict(run.calibrated), **dict(run.options)}
    opts.setdefault("dtype", dtype)
    try:
        return make_method(run.name, cfg, max_seqs=max_seqs, max_context=max_context, **opts)
    except (ValueError, TypeError) as e:
        raise EvalError(f"method {run.label!r}: {e}") from None


def pool_pages(method, args, label: str) -> int:
    """Pages of the pool: ``--kv-budget-mb`` worth, or enough for a full batch at max context."""
    from diffkv_jax.engine import pages_to_serve

    one = pages_to_serve(method, method.max_context)
    if args.kv_budget_mb is None:
        return method.max_seqs * one
    pages = int(args.kv_budget_mb * 2**20) // method.page_bytes
    if pages < one:
        raise EvalError(
            f"--kv-budget-mb {args.kv_budget_mb:g} holds {pages} pages of method {label!r}; "
            f"one sequence of --max-context {method.max_context} needs {one} "
            f"({one * method.page_bytes / 2**20:.1f} MiB)")
    return pages


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", disable=disable, leave=True,
                dynamic_ncols=True)


@dataclasses.dataclass
class _Live:
    sample: Sample
    t_submit: float
    compile_at_submit: float


def generate_task(engine, task, samples: list[Sample], *, label: str, tokenizer,
                  max_new_tokens: int, write, progress: bool) -> None:
    """Serve ``samples`` through ``engine`` (closed loop) and ``write`` one SampleResult each.

    ``engine`` must have a detokenizer when ``task`` has stop strings.
    """
    from diffkv_jax.evaluation.metrics import SampleResult
    from diffkv_jax.generation import SamplingParams

    eos = tuple(tokenizer.eos_token_ids)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=eos,
                              stop_strings=tuple(task.stop))
    pending = collections.deque(samples)
    live: dict[int, _Live] = {}
    bar = _progress(len(samples), f"{label} / {task.name}", not progress)
    try:
        while pending or live:
            while pending and len(live) < engine.method.max_seqs:
                s = pending.popleft()
                rid = engine.add_request(s.prompt_ids, sampling)
                live[rid] = _Live(s, time.perf_counter(), engine.compile_seconds)
            engine.step()
            now = time.perf_counter()
            for rid in list(live):
                lv, req = live[rid], engine.requests[rid]
                if req.status not in ("finished", "cancelled"):
                    continue
                del live[rid]
                write(_result(SampleResult, task, label, lv, req, tokenizer, eos, now,
                              engine.compile_seconds))
                bar.update(1)
    finally:
        bar.close()
        for rid in live:  # interrupted: free the slots so the engine stays usable
            engine.cancel(rid)


def _result(SampleResult, task, label, lv: _Live, req, tokenizer, eos, now, compile_now):
    toks = list(req.output)
    if req.finish_reason == "stop" and toks and toks[-1] in eos:
        toks = toks[:-1]
    reason = "stop_string" if req.stop_string is not None else req.finish_reason
    # The engine's text: the tokens without the EOS, cut before a stop string.
    text = req.text if req.text is not None else tokenizer.decode(toks)
    score = task.score(text, lv.sample.example) if task.score is not None else math.nan
    raw = now - lv.t_submit
    stats = req.kv_stats or {}
    return SampleResult(
        method=label, dataset=task.name, sample_id=lv.sample.sample_id, score=score,
        output_tokens=toks, kv_bytes=req.kv_bytes,
        kv_bytes_16bit=stats.get("bytes_16bit_same_tokens"),
        latency_s=max(raw - (compile_now - lv.compile_at_submit), 0.0), task_type=task.kind,
        extra={"text": text, "finish_reason": reason, "prompt_tokens": len(lv.sample.prompt_ids),
               "preemptions": req.preemptions, "latency_raw_s": raw, "kv": stats})


def score_longppl(run: MethodRun, task, samples: list[Sample], *, cfg, params, dtype, args,
                  write, progress: bool) -> None:
    """Teacher-forced perplexity of each document, ``--max-batch`` documents per call."""
    import numpy as np

    from diffkv_jax.evaluation.metrics import SampleResult
    from diffkv_jax.scoring import score_teacher_forced

    n_tok = args.longppl_tokens
    if not 0 < args.longppl_prefix < n_tok:
        raise EvalError(f"--longppl-prefix must be below --longppl-tokens ({n_tok})")
    size = min(args.max_batch, len(samples))
    method = build_method(run, cfg, max_seqs=size, max_context=n_tok, dtype=dtype)
    bar = _progress(len(samples), f"{run.label} / longppl", not progress)
    try:
        for at in range(0, len(samples), size):
            chunk = samples[at:at + size]
            docs = [list(s.example.token_ids) for s in chunk]
            t0 = time.perf_counter()
            r = score_teacher_forced(cfg, params, method, docs, args.longppl_prefix, dtype=dtype,
                                     progress=progress)
            wall = time.perf_counter() - t0
            mem, B = r.memory, len(chunk)
            for b, s in enumerate(chunk):
                nll = float(np.mean(r.nll[b]))
                write(SampleResult(
                    method=run.label, dataset=task.name, sample_id=s.sample_id,
                    kv_bytes=(mem["page_bytes"] + mem["table_bytes"]) // B,
                    kv_bytes_16bit=mem["bytes_16bit_same_tokens"] // B, task_type=task.kind,
                    extra={"nll": nll, "perplexity": math.exp(nll),
                           "scored_tokens": int(r.nll.shape[1]), "prefix": args.longppl_prefix,
                           "argmax": [int(t) for t in r.argmax[b]],
                           "kv_bytes_scope": f"mean over a chunk of {B} documents",
                           "kv": {k: v for k, v in mem.items()}, "chunk_decode_s":
                           r.decode_seconds, "chunk_wall_s": wall}))
                bar.update(1)
    finally:
        bar.close()


# --------------------------------------------------------------------------- reports


def longppl_rows(results, baseline: str) -> list[dict]:
    """Per method: documents, mean NLL, perplexity, its ratio to the baseline's (on the
    documents both scored), top-1 agreement with the baseline, memory ratio."""
    import numpy as np

    latest = {}
    for r in results:
        if r.dataset == "longppl" and "nll" in r.extra:
            latest[r.key] = r
    base = {r.sample_id: r for r in latest.values() if r.method == baseline}
    by_method: dict[str, list] = {}
    for r in latest.values():
        by_method.setdefault(r.method, []).append(r)
    rows = []
    for m in sorted(by_method, key=lambda m: (m != baseline, m)):
        rs = by_method[m]
        nll = float(np.mean([r.extra["nll"] for r in rs]))
        paired = [(r, base[r.sample_id]) for r in rs if r.sample_id in base]
        agree = [float(np.mean(np.asarray(r.extra["argmax"]) == np.asarray(f.extra["argmax"])))
                 for r, f in paired
                 if len(r.extra.get("argmax", ())) == len(f.extra.get("argmax", ()))]
        base_nll = [f.extra["nll"] for _, f in paired]
        own_nll = [r.extra["nll"] for r, _ in paired]
        ratios = [r.kv_bytes / r.kv_bytes_16bit for r in rs if r.kv_bytes_16bit]
        rows.append({
            "method": m, "count": len(rs), "mean_nll": nll, "perplexity": math.exp(nll),
            "ppl_vs_baseline": (math.exp(float(np.mean(own_nll)) - float(np.mean(base_nll)))
                                if paired else math.nan),
            "top1_agreement_rate": float(np.mean(agree)) if agree else math.nan,
            "mean_memory_ratio": float(np.mean(ratios)) if ratios else math.nan})
    return rows


LONGPPL_COLUMNS = ("method", ("count", "docs"), ("mean_nll", "mean NLL"), "perplexity",
                   ("ppl_vs_baseline", "ppl / baseline (same docs)"),
                   ("top1_agreement_rate", "top-1 agreement"), "mean_memory_ratio")


def write_reports(out: str, baseline: str, config: dict) -> dict:
    """summary.md, summary.json and the plots, from every record in OUT/results.jsonl."""
    from diffkv_jax.evaluation import report
    from diffkv_jax.evaluation.metrics import (missing_full, pair_with_full, read_results,
                                               summarize)

    results = read_results(os.path.join(out, RESULTS_FILE))
    pairs = pair_with_full(results, full_method=baseline)
    rows = summarize(pairs, full_method=baseline)
    overall = summarize(pairs, per_dataset=False, full_method=baseline)
    ppl = longppl_rows(results, baseline)
    missing = missing_full(results, full_method=baseline)
    negatives = report.negative_rates_by_task(pairs, full_method=baseline)
    plots = {
        "accuracy_vs_memory": report.plot_accuracy_vs_memory(
            rows, os.path.join(out, PLOTS["accuracy_vs_memory"])),
        "length_change": report.plot_length_change_hist(
            pairs, os.path.join(out, PLOTS["length_change"]), full_method=baseline),
        "latency_cdf": report.plot_latency_cdf(
            [p for p in pairs if p.dataset != "longppl"],
            os.path.join(out, PLOTS["latency_cdf"])),
        "negatives_by_task": report.plot_negative_rate_by_task(
            pairs, os.path.join(out, PLOTS["negatives_by_task"]), full_method=baseline),
    }
    lines = [
        "# KV-cache evaluation", "",
        f"Model `{config.get('model')}`, dtype {config.get('dtype')}; baseline `{baseline}` "
        f"(same engine, same run). {len(results)} records in `{RESULTS_FILE}`.", "",
        "Per sample: D = (L_baseline - L) / L_baseline (D < 0: longer answer); negative = "
        "the baseline scored > 0 and the method lost more than 10% of it; memory = measured "
        "KV bytes (pages + metadata + page table) / 16-bit K and V for the same tokens; "
        "latency = submission to finish with --max-batch requests in flight, compilation "
        "excluded. The full cache stores K and V at its dtype (the compute dtype unless "
        "given, e.g. `full:dtype=bfloat16`), so at float32 its memory is ~2x 16-bit.", "",
        "## Per dataset", "", report.markdown_table(rows),
        "## All datasets", "", report.markdown_table(overall)]
    if ppl:
        lines += ["## Long-text perplexity (teacher-forced through the decode path)", "",
                  report.markdown_table(ppl, LONGPPL_COLUMNS)]
    if negatives:
        lines += ["## Negative-sample rate by task type", "",
                  report.markdown_table(
                      [{"task": t, **{f"{m}_rate": v for m, v in ms.items()}}
                       for t, ms in sorted(negatives.items())],
                      ["task", *[(f"{m}_rate", m) for m in dict.fromkeys(
                          m for ms in negatives.values() for m in ms)]])]
    if missing:
        lines += [f"{len(missing)} records have no `{baseline}` counterpart and are left out "
                  "of the tables above.", ""]
    lines += ["## Plots", ""] + [f"![{k}]({os.path.basename(v)})" for k, v in plots.items()]
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    summary = {
        "config": config, "baseline": baseline, "records": len(results),
        "summary": report.summary_records(rows), "overall": report.summary_records(overall),
        "longppl": [{k: (None if isinstance(v, float) and math.isnan(v) else v)
                     for k, v in r.items()} for r in ppl],
        "negative_rate_by_task": negatives,
        "missing_baseline": [list(k) for k in missing],
        "plots": {k: os.path.basename(v) for k, v in plots.items()},
    }
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    return summary


# --------------------------------------------------------------------------- main


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _check_config(out: str, config: dict) -> None:
    """Results in one folder must come from one model; record it on the first run."""
    path = os.path.join(out, CONFIG_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        for k in ("model", "dtype"):
            if old.get(k) != config[k]:
                raise EvalError(f"{out} holds results for {k} {old.get(k)!r}, not "
                                f"{config[k]!r}; use another --out")
        preset = config.get("diffkv_preset")
        if preset is not None and old.get("diffkv_preset", preset) != preset:
            raise EvalError(f"{out} holds diffkv results from the preset "
                            f"{old['diffkv_preset']}, not {preset}; use another --out")
        if preset is not None and "diffkv_preset" not in old:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({**old, "diffkv_preset": preset}, fh, indent=2)
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def main(argv: Sequence[str] | None = None, *, model=None) -> int:
    """Run the CLI. ``model``: an already loaded ``(cfg, params, tokenizer)`` (tests)."""
    args = build_parser().parse_args(argv)
    from diffkv_jax.generation import GenerationInputError
    from diffkv_jax.texts import DataUnavailableError
    from models.config import UnknownModelError
    from models.errors import ModelLoadError

    try:
        return _main(args, model)
    except (EvalError, DataUnavailableError, UnknownModelError, ModelLoadError,
            GenerationInputError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("interrupted; finished samples are saved, rerun to resume", file=sys.stderr)
        return 130


def _main(args, model) -> int:
    runs = parse_methods(args.methods)
    datasets = parse_datasets(args.datasets)
    if args.limit is not None and args.limit < 0:
        raise EvalError("--limit must be >= 0")
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, RESULTS_FILE)
    config = {"model": args.model, "dtype": args.dtype}
    if args.report_only:
        if not os.path.exists(results_path):
            raise EvalError(f"no results in {results_path}")
        if os.path.exists(os.path.join(args.out, CONFIG_FILE)):
            with open(os.path.join(args.out, CONFIG_FILE), encoding="utf-8") as fh:
                config = json.load(fh)
        return _report(args, config)

    from diffkv_jax.evaluation.metrics import append_jsonl, done_keys, result_key
    from diffkv_jax.evaluation.tasks import get_task

    tasks = [get_task(d) for d in datasets]
    # Datasets that need no tokenizer are read first: a missing package fails fast.
    early = {t.name: load_samples(t, args, None) for t in tasks if not t.needs_encode}

    import jax
    import jax.numpy as jnp

    if model is None:
        from models.loading import load_model

        dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
        m = load_model(args.model, model_path=args.model_path, dtype=dtype,
                       use_cache=not args.no_param_cache)
        model = (m.cfg, m.params, m.tokenizer)
    cfg, params, tok = model
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    config["dtype"] = jnp.dtype(dtype).name
    runs = with_fp8_scales(runs, cfg, params, dtype, tok, config)
    runs = with_diffkv_preset(runs, cfg.name, config)
    _check_config(args.out, config)
    if args.max_context > cfg.max_position_embeddings:
        raise EvalError(f"--max-context {args.max_context} is over {cfg.name}'s context "
                        f"({cfg.max_position_embeddings})")

    samples = {}
    for t in tasks:
        samples[t.name] = early.get(t.name) or load_samples(t, args, tok.encode)
        if t.name != "longppl":
            for s in samples[t.name]:
                text = t.prompt(s.example)
                if args.chat:
                    s.prompt_ids = tok.encode(tok.apply_chat_template(
                        [{"role": "user", "content": text}]), add_special_tokens=False)
                else:
                    s.prompt_ids = tok.encode(text)
    done = done_keys(results_path)
    write = lambda r: append_jsonl(results_path, r)  # noqa: E731
    progress = not args.no_progress

    for run in runs:
        engine = None  # built on first use, then shared by every dataset of the method
        for t in tasks:
            todo = [s for s in samples[t.name]
                    if result_key(run.label, t.name, s.sample_id) not in done]
            if not todo:
                continue
            if t.name == "longppl":
                score_longppl(run, t, todo, cfg=cfg, params=params, dtype=dtype, args=args,
                              write=write, progress=progress)
                continue
            fits = [s for s in todo if len(s.prompt_ids) < args.max_context]
            if len(fits) < len(todo):
                print(f"note: {t.name}: {len(todo) - len(fits)} prompts are not shorter than "
                      f"--max-context {args.max_context} and are skipped", file=sys.stderr)
            if not fits:
                continue
            if engine is None:
                engine = _engine(run, cfg, params, dtype, args, tok)
            max_new = min(t.max_new_tokens, args.max_new_tokens or t.max_new_tokens)
            generate_task(engine, t, fits, label=run.label, tokenizer=tok,
                          max_new_tokens=max_new, write=write, progress=progress)
        if engine is not None:
            print(f"{run.label}: {engine.num_compiled} executables compiled in "
                  f"{engine.compile_seconds:.1f} s; decode {engine.decode_tokens} tokens in "
                  f"{engine.decode_seconds:.1f} s; prefill {engine.prefill_tokens} tokens in "
                  f"{engine.prefill_seconds:.1f} s", file=sys.stderr)
    return _report(args, config)


#: Calibration text of fp8 runs given without scales: short, so it stays quick on a CPU.
FP8_CALIBRATION_DOCS, FP8_CALIBRATION_TOKENS = 2, 512


def with_fp8_scales(runs: list[MethodRun], cfg, params, dtype, tokenizer,
                    config: dict) -> list[MethodRun]:
    """``runs`` with calibrated K/V scales for every fp8 run that lacks them.

    Calibrated once, on the text ``scripts/calibrate.py`` uses (CoQA stories
    past the evaluation's), with the model being evaluated; the scales and
    where they came from go into ``config["fp8_scales"]``.
    """
    todo = [i for i, r in enumerate(runs) if r.name == "fp8"
            and not {"k_scale", "v_scale"} <= {k for k, _ in r.options}]
    if not todo:
        return runs
    from diffkv_jax.evaluation.datasets import long_text_documents
    from diffkv_jax.fp8_cache import DEFAULT_MARGIN, calibrate_fp8_scales
    from scripts.calibrate import CALIBRATION_SKIP

    t0 = time.perf_counter()
    docs = [list(d.token_ids) for d in long_text_documents(
        tokenizer.encode, FP8_CALIBRATION_TOKENS, FP8_CALIBRATION_DOCS, skip=CALIBRATION_SKIP)]
    k_scale, v_scale = calibrate_fp8_scales(cfg, params, docs, dtype=dtype)
    config["fp8_scales"] = {
        "source": f"calibrated by scripts/eval.py: amax of K (after RoPE) and V per (layer, "
                  f"KV head) over CoQA stories from passage {CALIBRATION_SKIP} on "
                  f"(scripts/calibrate.py's calibration text), scale = margin * amax / 448",
        "docs": FP8_CALIBRATION_DOCS, "tokens": FP8_CALIBRATION_TOKENS,
        "margin": DEFAULT_MARGIN, "k_scale": k_scale, "v_scale": v_scale}
    print(f"fp8: K/V scales calibrated on {FP8_CALIBRATION_DOCS} x {FP8_CALIBRATION_TOKENS} "
          f"tokens of calibration text ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    scales = (("k_scale", k_scale), ("v_scale", v_scale))
    return [dataclasses.replace(r, calibrated=scales) if i in todo else r
            for i, r in enumerate(runs)]


#: Options that choose DiffKV's thresholds; a ``diffkv`` run given none uses the preset.
DIFFKV_THRESHOLD_OPTIONS = ("alpha_high", "alpha_low", "high_frac", "low_frac")


def with_diffkv_preset(runs: list[MethodRun], model: str, config: dict) -> list[MethodRun]:
    """``runs`` with the model's calibrated preset (:mod:`diffkv_jax.presets`, as
    ``generate.py --kv diffkv`` uses it) for every ``diffkv`` run that sets no
    thresholds; the preset goes into ``config["diffkv_preset"]``."""
    from diffkv_jax import presets

    todo = [i for i, r in enumerate(runs) if r.name == "diffkv"
            and not {k for k, _ in r.options} & set(DIFFKV_THRESHOLD_OPTIONS)]
    found = presets.load_preset(model) if todo else None
    if found is None:
        return runs
    options, path = found
    config["diffkv_preset"] = {"path": str(path), "options": options}
    print(f"diffkv: thresholds from the calibrated preset {path}: "
          + ", ".join(f"{k}={v}" for k, v in options.items()), file=sys.stderr)
    out = []
    for i, r in enumerate(runs):
        given = {k for k, _ in r.options}
        extra = tuple((k, v) for k, v in options.items() if k not in given)
        out.append(dataclasses.replace(r, calibrated=r.calibrated + extra) if i in todo else r)
    return out


def _engine(run: MethodRun, cfg, params, dtype, args, tokenizer):
    from diffkv_jax.engine import Engine

    method = build_method(run, cfg, max_seqs=args.max_batch, max_context=args.max_context,
                          dtype=dtype)
    return Engine(cfg, params, method, num_pages=pool_pages(method, args, run.label),
                  dtype=dtype, detokenizer=tokenizer)


def _report(args, config: dict) -> int:
    summary = write_reports(args.out, args.baseline, config)
    print(f"wrote {os.path.join(args.out, 'summary.md')} ({summary['records']} records)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
