"""Stop strings in the engine: detection across tokens, the text kept, safe streaming,
refusals; the incremental text against a full decode with the real SmolLM2 tokenizer."""

import dataclasses
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from diffkv_jax import cli
from diffkv_jax.engine import Engine, TextTracker
from diffkv_jax.generation import GenerationInputError, SamplingParams
from diffkv_jax.methods import make_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A toy vocabulary for the tiny model: id i reads "<i>", so every token is several
# characters and a stop string can start or end in the middle of one.
PIECES = [f"<{i}>" for i in range(97)]


def worst_step_pages(method, rows: int) -> int:
    """Pages one decode step of ``rows`` rows allocates at most (every layer and head
    gaining its most), which sizes the tiny pools below."""
    return rows * method.num_layers * method.num_kv_heads * method.max_new_pages_per_row


class ToyDetok:
    """``list[int] -> str`` that records the length of every slice it is asked for."""

    def __init__(self):
        self.calls = []

    def __call__(self, ids):
        self.calls.append(len(ids))
        return "".join(PIECES[i] for i in ids)


def make_engine(cfg, params, detokenizer=None, max_seqs=3, max_context=96, pages=None):
    method = make_method("full", cfg, max_seqs=max_seqs, max_context=max_context, page_size=4)
    pages = pages or max_seqs * method.pages_for_tokens(max_context)
    return Engine(cfg, params, method, num_pages=pages, detokenizer=detokenizer)


PROMPTS = [[5, 17, 3, 88, 41, 9, 2], [60, 61, 62], list(range(10, 40))]
# Sampled, not greedy: the random tiny model repeats itself greedily. Each request's
# random stream depends only on its seed and step, so outputs are reproducible.
SAMPLING = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=11 + i) for i in range(3)]


def with_(i, **kw):
    return dataclasses.replace(SAMPLING[i], **kw)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Outputs of PROMPTS, 24 tokens each, no stop strings."""
    cfg, params = tiny_model
    return [r.output for r in make_engine(cfg, params).generate(PROMPTS, SAMPLING)]


def spanning_stop(tokens, k, n=2):
    """A stop string from the middle of token ``k`` to the end of token ``k + n - 1``,
    and the text before it."""
    text = "".join(PIECES[t] for t in tokens)
    start = len("".join(PIECES[t] for t in tokens[:k])) + 1
    stop = text[start:start + len("".join(PIECES[t] for t in tokens[k:k + n])) - 1]
    assert text.find(stop) == start, "the reference must not contain the stop string earlier"
    return stop, text[:start]


def test_stop_string_spanning_two_tokens(tiny_model, reference):
    cfg, params = tiny_model
    stop, before = spanning_stop(reference[0], 6)
    det = ToyDetok()
    eng = make_engine(cfg, params, detokenizer=det)
    rid = eng.add_request(PROMPTS[0], with_(0, stop_strings=(stop,)))
    other = eng.add_request(PROMPTS[1], SAMPLING[1])
    for _ in eng.run():
        pass
    # Incremental: every decode call saw at most two ids (a token plus its context),
    # never the whole output.
    assert det.calls and max(det.calls) <= 2
    r = eng.requests[rid]
    assert r.status == "finished" and r.finish_reason == "stop" and r.stop_string == stop
    # Tokens up to the one that completed the stop string (token 7): none after it.
    assert r.output == reference[0][:8]
    assert r.text == before and stop not in r.text
    assert det(r.output).startswith(before + stop)
    # The other request is untouched, and its text is the plain decode.
    o = eng.requests[other]
    assert o.output == reference[1] and o.text == det(reference[1]) and o.stop_string is None
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


def test_earliest_stop_string_wins_and_stop_token_ids_are_not_text(tiny_model, reference):
    cfg, params = tiny_model
    out = reference[2]
    late, _ = spanning_stop(out, 9)
    early, before = spanning_stop(out, 4, n=1)
    eng = make_engine(cfg, params, detokenizer=ToyDetok())
    r = eng.generate([PROMPTS[2]], with_(2, stop_strings=(late, early)))[0]
    assert r.stop_string == early and r.text == before and r.output == out[:5]
    # A stop token id ends the request before any stop string and is not in the text.
    k = out.index(out[3])
    r = eng.generate([PROMPTS[2]], with_(2, stop_token_ids=(out[k],), stop_strings=(late,)))[0]
    assert r.finish_reason == "stop" and r.stop_string is None
    assert r.output == out[:k + 1] and r.text == "".join(PIECES[t] for t in out[:k])


def test_streamed_text_never_contains_part_of_a_stop_string(tiny_model, reference):
    cfg, params = tiny_model
    # Spans three tokens: its beginning is generated two steps before it completes.
    stops = [spanning_stop(reference[i], 5, n=3) for i in (0, 2)]
    eng = make_engine(cfg, params, detokenizer=ToyDetok())
    ids = [eng.add_request(PROMPTS[0], with_(0, stop_strings=(stops[0][0], "zzz"))),
           eng.add_request(PROMPTS[1], with_(1, max_new_tokens=10)),
           eng.add_request(PROMPTS[2], with_(2, stop_strings=(stops[1][0],)))]
    streamed = {rid: "" for rid in ids}
    before = {ids[0]: stops[0][1], ids[2]: stops[1][1]}
    lagged = False
    for new in eng.run_text():
        for rid, piece in new.items():
            streamed[rid] += piece
        for rid, text in before.items():  # never a character of the stop string
            assert text.startswith(streamed[rid]), (streamed[rid], text)
        for rid in ids:
            req = eng.requests[rid]
            if req.status == "running":
                full = ToyDetok()(req.output)
                # Only text that can no longer turn into a stop string is out.
                assert full.startswith(streamed[rid])
                lagged |= len(streamed[rid]) < len(full)
    for rid, (stop, before) in zip((ids[0], ids[2]), stops):
        assert eng.requests[rid].stop_string == stop
        assert streamed[rid] == before == eng.requests[rid].text
        assert ToyDetok()(eng.requests[rid].output).startswith(before + stop)
    assert streamed[ids[1]] == ToyDetok()(reference[1][:10])  # no stop strings: all of it
    assert lagged  # something was held back at some point


def test_stream_holds_back_only_what_could_begin_a_stop_string():
    tr = TextTracker(lambda ids: "".join("abcdefgh"[i] for i in ids), ("cdX", "hhhh"))
    got = []
    for t in [0, 1, 2, 3, 4]:  # a b c d e
        tr.feed(t)
        got.append(tr.take(final=False))
    # "c", then "cd" could begin "cdX": held until "e" rules it out.
    assert got == ["a", "b", "", "", "cde"]
    assert not tr.feed(7) and tr.take(final=False) == ""  # "h" could begin "hhhh"
    assert tr.take(final=True) == "h" and tr.text == "abcdeh"


def test_stop_strings_need_a_detokenizer(tiny_model, reference):
    cfg, params = tiny_model
    eng = make_engine(cfg, params)  # no detokenizer
    ok = eng.add_request(PROMPTS[1], with_(1, max_new_tokens=5))
    with pytest.raises(GenerationInputError, match="detokenizer"):
        eng.add_request(PROMPTS[0], SamplingParams(stop_strings=("x",)))
    with pytest.raises(GenerationInputError):
        next(eng.run_text())
    for _ in eng.run():
        pass
    r = eng.requests[ok]
    assert r.status == "finished" and r.output == reference[1][:5] and r.text is None
    assert len(eng.requests) == 1  # the refused request was never queued
    with pytest.raises(TypeError):
        make_engine(cfg, params, detokenizer=42)


@pytest.mark.parametrize("stops", [("",), ("ok", ""), ("ok", 3), "abc", (None,)])
def test_invalid_stop_strings_are_refused(tiny_model, stops):
    cfg, params = tiny_model
    eng = make_engine(cfg, params, detokenizer=ToyDetok())
    with pytest.raises(GenerationInputError, match="stop"):
        eng.add_request([1, 2], SamplingParams(stop_strings=stops))
    assert not eng.requests
    # A list is accepted and stored as a tuple (the params stay hashable).
    smp = SamplingParams(stop_strings=["<1", "2>"])
    assert smp.stop_strings == ("<1", "2>") and hash(smp)
    eng.add_request([1, 2], smp)


def test_stop_strings_survive_preemption(tiny_model):
    """A pool too small for everyone: requests are preempted and recomputed, and each
    stops exactly where it stops when served alone."""
    cfg, params = tiny_model
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=int(rng.integers(4, 30))))
               for _ in range(12)]
    sampling = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, stop_strings=(
        f"{rng.integers(0, 10)}><{rng.integers(1, 10)}", f"<{rng.integers(0, 97)}>"))
        for i in range(len(prompts))]
    probe = make_engine(cfg, params, max_seqs=4)
    small = probe.method.pages_for_tokens(48) * 2 + worst_step_pages(probe.method, 4)
    eng = make_engine(cfg, params, ToyDetok(), max_seqs=4, pages=small)
    # Preempt on the free-page bound (not the exact count the engine reads first),
    # so that this small workload preempts.
    eng.READ_BEFORE_PREEMPTING = False
    reqs = eng.generate(prompts, sampling)
    assert any(r.preemptions for r in reqs), "the pool was meant to force preemption"
    assert any(r.stop_string for r in reqs) and any(r.finish_reason == "length" for r in reqs)
    single = make_engine(cfg, params, ToyDetok(), max_seqs=4)
    for p, s, r in zip(prompts, sampling, reqs):
        alone = single.generate([p], [s])[0]
        assert (r.output, r.text, r.stop_string) == (alone.output, alone.text,
                                                     alone.stop_string)
        full = ToyDetok()(r.output)
        if r.stop_string is None:
            assert r.text == full and not any(x in full for x in s.stop_strings)
        else:
            cut = min(i for i in (full.find(x) for x in s.stop_strings) if i >= 0)
            assert r.text == full[:cut]
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


# ----------------------------------------------------------- the real tokenizer, no weights


@pytest.fixture(scope="module")
def smol_tokenizer():
    from models.gguf_loader import embedded_gguf_path
    from models.tokenizer import Tokenizer
    return Tokenizer.from_gguf(embedded_gguf_path())


def test_incremental_text_matches_a_full_decode(smol_tokenizer):
    """Byte-level BPE with multi-byte characters split across tokens: at every token the
    tracker finds a stop string exactly when the full decode shows one, and its text and
    stream equal the full decode cut at the earliest stop string."""
    tok = smol_tokenizer
    pool = tok.encode("Question: 日本語 😀 naïve\n\ndef f(x):\n    return x  # ok\n")
    pool += [tok.token_to_id(t) for t in ("Ã", "¦", "ð", "Ł")]  # lone UTF-8 bytes
    rng = random.Random(0)
    stop_sets = [("\n\n", "Question:"), ("ï", "😀 n"), ("return",), ("\n",)]
    hits = 0
    for trial in range(400):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        stops = stop_sets[trial % len(stop_sets)]
        tr = TextTracker(tok.decode, stops)
        streamed, n = "", len(ids)
        for k, t in enumerate(ids):
            hit = tr.feed(t)
            full = tok.decode(ids[:k + 1])
            assert hit == any(s in full for s in stops), (ids[:k + 1], stops)
            streamed += tr.take(final=hit)
            if hit:
                n = k + 1
                break
        streamed += tr.take(final=True)
        full = tok.decode(ids[:n])
        cuts = [i for i in (full.find(s) for s in stops) if i >= 0]
        want = full[:min(cuts)] if cuts else full
        assert tr.text == want and streamed == want
        hits += bool(cuts)
    assert 50 < hits < 400  # both outcomes were exercised


# ----------------------------------------------------------- generate.py --stop


def test_generate_cli_stop(tmp_path):
    assert cli.main(["--prompt", "hi", "--stop", ""]) == 2  # refused before loading
    env = dict(os.environ, DIFFKV_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--chat", "--kv", "full",
         "--prompt", "What is the capital of France?", "--stop", " Paris", "--stop", "zzz"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The full answer is "The capital of France is Paris." (tests/test_cli.py).
    assert proc.stdout == "The capital of France is\n"


def test_static_batch_generator_refuses_stop_strings(tiny_model):
    from diffkv_jax.generation import GenerationInputError, Generator, SamplingParams
    from diffkv_jax.methods import make_method

    cfg, params = tiny_model
    method = make_method("full", cfg, max_seqs=1, max_context=64, page_size=8)
    gen = Generator(cfg, params, method, num_pages=4 * method.pages_for_tokens(64))
    with pytest.raises(GenerationInputError, match="Engine"):
        gen.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=2, stop_strings=("x",))])
