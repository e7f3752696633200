"""Continuous batching: same outputs as serving alone, preemption, cancellation, bad input."""

import numpy as np
import pytest

from diffkv_jax.engine import Engine
from diffkv_jax.generation import GenerationInputError, SamplingParams
from diffkv_jax.methods import make_method
from diffkv_jax.paged_cache import FullCache


def worst_step_pages(method, rows: int) -> int:
    """Pages one decode step of ``rows`` rows allocates at most (every layer and head
    gaining its most), which sizes the tiny pools below."""
    return rows * method.num_layers * method.num_kv_heads * method.max_new_pages_per_row


def make_engine(cfg, params, kind="full", max_seqs=4, max_context=96, pages=None,
                prefill_chunk=None, preemption="recompute", **opts):
    method = make_method(kind, cfg, max_seqs=max_seqs, max_context=max_context,
                         page_size=4 if kind == "full" else 8, **opts)
    pages = pages or max_seqs * method.pages_for_tokens(max_context)
    return Engine(cfg, params, method, num_pages=pages, prefill_chunk=prefill_chunk,
                  preemption=preemption)


def alone(cfg, params, prompts, sampling, **kw):
    """Each request served with the engine otherwise empty (same shapes, same slots)."""
    eng = make_engine(cfg, params, **kw)
    return [eng.generate([p], [s])[0].output for p, s in zip(prompts, sampling)]


def workload(cfg, n, rng, max_prompt=30, max_new=12):
    prompts = [list(rng.integers(0, cfg.vocab_size, size=rng.integers(1, max_prompt)))
               for _ in range(n)]
    sampling = [SamplingParams(max_new_tokens=int(rng.integers(1, max_new))) for _ in range(n)]
    return prompts, sampling


def serve_arrivals(eng, prompts, sampling, rng):
    """Requests arriving over 600 steps, 2% of steps cancelling one; checks that the
    others finish, that the pool forced preemption and that no page leaked."""
    n = len(prompts)
    ids, cancelled = [], set()
    arrivals = sorted(rng.integers(0, 600, size=n))
    step = 0
    while len(ids) < n or eng.has_unfinished():
        while len(ids) < n and arrivals[len(ids)] <= step:
            ids.append(eng.add_request(prompts[len(ids)], sampling[len(ids)]))
        if ids and rng.random() < 0.02:
            victim = int(rng.choice(ids))
            if eng.requests[victim].status in ("waiting", "running"):
                eng.cancel(victim)
                cancelled.add(victim)
        eng.step()
        step += 1
        assert step < 20000
    reqs = [eng.requests[i] for i in ids]
    assert all(r.status == ("cancelled" if r.id in cancelled else "finished") for r in reqs)
    assert any(r.preemptions for r in reqs), "the pool was meant to force preemption"
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short
    return reqs


def test_continuous_batching_matches_alone(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(0)
    prompts, sampling = workload(cfg, 10, rng)
    eng = make_engine(cfg, params)
    got = [r.output for r in eng.generate(prompts, sampling)]
    assert got == alone(cfg, params, prompts, sampling)
    assert eng.free_pages == eng.num_pages  # nothing leaked
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


@pytest.mark.parametrize("call_tokens,padded", [(256, 4 * 64), (0, 1 * 64 + 2 * 16)])
def test_prompts_share_a_prefill_only_where_it_pads_less(tiny_model, call_tokens, padded):
    # A 60-token prompt pads to 64 tokens; two 5-token prompts in its call would pad
    # to 64 each (and the three rows to four). Where a call's fixed cost is small
    # the short prompts wait one step and share a 16-token bucket instead.
    cfg, params = tiny_model
    prompts = [list(range(1, 61)), [7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]
    sampling = [SamplingParams(max_new_tokens=3)] * 3
    eng = make_engine(cfg, params)
    eng.PREFILL_CALL_TOKENS = call_tokens
    got = [r.output for r in eng.generate(prompts, sampling)]
    assert eng.prefill_padded_tokens == padded
    assert eng.prefill_tokens == 70
    assert got == alone(cfg, params, prompts, sampling)


def test_prompt_buckets_are_powers_of_two_then_four_per_octave():
    from diffkv_jax.engine import prefill_shape
    from diffkv_jax.generation import prompt_bucket

    assert [prompt_bucket(n) for n in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]
    assert [prompt_bucket(n) for n in (513, 640, 641, 1024, 1025, 2100, 4096, 4191)] == \
        [640, 640, 768, 1024, 1280, 2560, 4096, 5120]
    assert all(n <= prompt_bucket(n) < 2 * n + 16 for n in range(1, 513))
    assert all(n <= prompt_bucket(n) < 1.25 * n for n in range(513, 9000))
    assert prefill_shape([600, 30, 5]) == (4, 640)


@pytest.mark.parametrize("kind", ["full", "diffkv"])
def test_a_long_prompt_pads_to_its_fine_bucket_and_decodes_as_at_a_power_of_two(
        tiny_model, kind, monkeypatch):
    # 600 tokens pad to 640, not 1024; the padding is masked, so the tokens are
    # those of the power-of-two bucket.
    import diffkv_jax.generation as generation

    cfg, params = tiny_model
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, size=600)]
    sampling = [SamplingParams(max_new_tokens=6)]

    def serve():
        eng = make_engine(cfg, params, kind, max_context=640 + 16)
        out = eng.generate([prompt], sampling)[0].output
        return out, eng.prefill_padded_tokens

    fine, fine_padded = serve()
    monkeypatch.setattr(generation, "FINE_PROMPT_BUCKETS_FROM", 1 << 20)
    pow2, pow2_padded = serve()
    assert (fine_padded, pow2_padded) == (640, 1024)
    assert fine == pow2


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prompts", "chunks-of-8"])
def test_stress_preemption_cancellation_and_leaks(tiny_model, chunk):
    """300 requests arriving over time on a pool far too small to hold them all
    (with chunked prefill: recomputed contexts and long prompts come in pieces,
    and cancellations can hit a request mid-prefill)."""
    cfg, params = tiny_model
    rng = np.random.default_rng(1)
    prompts, sampling = workload(cfg, 300, rng, max_prompt=40, max_new=16)
    probe = make_engine(cfg, params)
    small = probe.method.pages_for_tokens(56) * 2 + worst_step_pages(probe.method, 4)
    eng = make_engine(cfg, params, pages=small, prefill_chunk=chunk)
    reqs = serve_arrivals(eng, prompts, sampling, rng)
    # Uncompressed cache: recomputation reproduces the cache exactly, so every
    # finished request, preempted or not, matches serving it alone.
    check = [r for r in reqs if r.status == "finished"][:40] + \
        [r for r in reqs if r.preemptions and r.status == "finished"][:20]
    ref = alone(cfg, params, [r.prompt for r in check], [r.sampling for r in check])
    assert [r.output for r in check] == ref
    # Buckets only, no per-step recompilation (chunks add page-width buckets).
    assert eng.num_compiled <= (24 if chunk is None else 32)
    if chunk:  # prompts really came in pieces (chunked batches carry a page width)
        assert any(name == "prefill" and key[2] > 0 for name, key in eng._executables)


@pytest.mark.parametrize("kind", ["full", "diffkv"])
def test_a_reserve_that_falls_short_is_recovered_without_a_wrong_token(tiny_model, kind):
    """The host's page accounting keeps device allocations from failing; were it
    ever wrong, rows that missed a page must not go on. Forced here by admitting
    regardless of the free pages and reserving nothing for decode growth: the
    engine drops what was sampled after the failing call (rows admitted by it
    decode from prompts never written), preempts every running request and
    recomputes, so the uncompressed cache's outputs still match serving each
    request alone (without the drop they do not), and nothing leaks."""
    cfg, params = tiny_model
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=rng.integers(20, 41)))
               for _ in range(12)]
    sampling = [SamplingParams(max_new_tokens=40)] * 12
    opts = dict(max_context=128, window=8) if kind == "diffkv" else {}
    probe = make_engine(cfg, params, kind=kind, **opts)
    eng = make_engine(cfg, params, kind=kind, pages=probe.method.pages_for_tokens(80) * 2,
                      **opts)
    eng._step_reserve = lambda rows, new=0: 0
    eng._fits = lambda free, need, rows, new: True
    ids = [eng.add_request(p, s) for p, s in zip(prompts, sampling)]
    # (a failure already in flight when the accounting is restored recovers later)
    with pytest.warns(RuntimeWarning, match="too short"):
        for _ in range(300):
            eng.step()
            if eng.allocation_recoveries or not eng.has_unfinished():
                break
        assert eng.allocation_recoveries >= 1
        del eng._step_reserve, eng._fits  # the class's own accounting again
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            assert steps < 5000
    reqs = [eng.requests[i] for i in ids]
    assert all(r.status == "finished" and len(r.output) == s.max_new_tokens
               for r, s in zip(reqs, sampling))
    assert any(r.preemptions for r in reqs)
    if kind == "full":
        assert [r.output for r in reqs] == alone(cfg, params, prompts, sampling)
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)


def test_diffkv_engine_serves_and_returns_every_page(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(2)
    prompts, sampling = workload(cfg, 12, rng, max_prompt=60, max_new=20)
    eng = make_engine(cfg, params, kind="diffkv", max_context=128, window=8)
    reqs = eng.generate(prompts, sampling)
    assert all(r.status == "finished" and len(r.output) == s.max_new_tokens
               for r, s in zip(reqs, sampling))
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


def test_bad_requests_are_refused_and_serving_continues(tiny_model):
    cfg, params = tiny_model
    eng = make_engine(cfg, params)
    ok = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    for prompt, smp in [([], SamplingParams()), ([5] * 200, SamplingParams()),
                        ([1], SamplingParams(temperature=-1.0)),
                        ([1], SamplingParams(top_p=0.0)), ([1], SamplingParams(max_new_tokens=0)),
                        ([cfg.vocab_size + 5], SamplingParams())]:
        with pytest.raises(GenerationInputError):
            eng.add_request(prompt, smp)
    with pytest.raises(KeyError):
        eng.cancel(12345)
    for _ in eng.run():
        pass
    assert eng.requests[ok].status == "finished" and len(eng.requests[ok].output) == 4


DIFFKV_STRESS = dict(kind="diffkv", max_context=64, window=4, alpha_high=1.0, alpha_low=0.5)


def diffkv_stress(cfg, params, rng, **kw):
    """The DiffKV stress workload: short prompts, long outputs (a compressed pool
    really runs short only once rows grow), on a pool of 1.5 longest requests."""
    prompts, sampling = workload(cfg, 300, rng, max_prompt=20, max_new=40)
    probe = make_engine(cfg, params, **kw)
    small = (int(probe.method.pages_for_tokens(60) * 1.5)
             + 2 * worst_step_pages(probe.method, 1))
    return prompts, sampling, make_engine(cfg, params, pages=small, **kw)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prompts", "chunks-of-8"])
def test_stress_diffkv_requests_never_preempted_match_alone(tiny_model, chunk):
    """The stress workload on the compressed cache: a request that was never
    preempted produces what it produces alone with the same cache method (its
    compression decisions depend on its own tokens only); with chunked prefill,
    alone with the same chunks (cancellations and preemptions also hit prompts
    mid-chunk)."""
    cfg, params = tiny_model
    rng = np.random.default_rng(4)
    kw = dict(DIFFKV_STRESS, prefill_chunk=chunk)
    prompts, sampling, eng = diffkv_stress(cfg, params, rng, **kw)
    reqs = serve_arrivals(eng, prompts, sampling, rng)
    stats = [r.kv_stats for r in reqs if r.status == "finished"]
    assert any(s["frac_low"] > 0 for s in stats), "thresholds were meant to demote tokens"
    check = [r for r in reqs if r.status == "finished" and not r.preemptions][:40]
    ref = alone(cfg, params, [r.prompt for r in check], [r.sampling for r in check], **kw)
    assert [r.output for r in check] == ref
    assert eng.num_compiled <= (24 if chunk is None else 32)
    if chunk:
        assert any(name == "prefill" and key[2] > 0 for name, key in eng._executables)


@pytest.mark.parametrize("kind", ["full", "diffkv"])
def test_swapped_requests_resume_exactly(tiny_model, kind):
    """Preemption by swapping: the stress workload on a tiny pool, where a
    preempted request's pages wait in host memory and come back as they were.
    Every finished request, swapped or not, produces what it produces alone with
    the same cache method (for DiffKV too: nothing is recomputed, so no decision
    is taken twice), nothing leaks and the host copies are all given back."""
    cfg, params = tiny_model
    if kind == "full":
        rng = np.random.default_rng(7)
        prompts, sampling = workload(cfg, 120, rng, max_prompt=40, max_new=16)
        kw = dict(kind=kind)
        probe = make_engine(cfg, params, **kw)
        small = probe.method.pages_for_tokens(56) * 2 + worst_step_pages(probe.method, 4)
        eng = make_engine(cfg, params, pages=small, preemption="swap", **kw)
    else:
        rng = np.random.default_rng(4)
        kw = DIFFKV_STRESS
        prompts, sampling, eng = diffkv_stress(cfg, params, rng, preemption="swap", **kw)
    reqs = serve_arrivals(eng, prompts, sampling, rng)
    assert eng.swap_outs > 0 and eng.swap_ins <= eng.swap_outs
    assert eng.swapped_bytes == 0 and all(r.swapped is None for r in reqs)
    swapped = [r for r in reqs if r.preemptions and r.status == "finished"]
    check = [r for r in reqs if r.status == "finished" and not r.preemptions][:15] + swapped[:25]
    assert swapped, "the pool was meant to swap finished requests out"
    ref = alone(cfg, params, [r.prompt for r in check], [r.sampling for r in check], **kw)
    assert [r.output for r in check] == ref
    assert eng.prefill_tokens == sum(len(r.prompt) for r in reqs if r.prefilled)
    if kind == "diffkv":
        assert any(r.kv_stats["frac_low"] > 0 for r in swapped)


def test_swap_needs_a_method_that_can_swap(tiny_model):
    cfg, params = tiny_model
    with pytest.raises(ValueError, match="preemption"):
        make_engine(cfg, params, preemption="disk")
    with pytest.raises(ValueError, match="recompute"):
        make_engine(cfg, params, kind="kivi4", preemption="swap")


def test_exposed_host_time_counts_only_steps_that_found_results_ready(tiny_model):
    """The device-idle bound: an iteration whose read really waited (the previous
    step was still running when this one was queued) adds nothing; one that found
    results ready adds the time since the previous queueing, or since the end of
    the host's last real wait for any result (read out of turn too) if that came
    later."""
    cfg, params = tiny_model
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                       max_context=64, page_size=8)
    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(64))
    ready, waited = 0.0, 10 * Engine.READY_WAIT_S
    eng._expose(1.0, ready, 1.1)          # first step: nothing before it
    assert eng.exposed_host_seconds == 0.0
    eng._expose(1.5, ready, 1.6)          # previous queued at 1.0, results ready
    assert abs(eng.exposed_host_seconds - 0.5) < 1e-12
    eng._expose(2.0, waited, 2.4)         # device still busy: nothing exposed
    assert abs(eng.exposed_host_seconds - 0.5) < 1e-12
    eng._expose(2.7, ready, 2.8)          # since the real wait ended at 2.4
    assert abs(eng.exposed_host_seconds - 0.8) < 1e-12
    eng._waited(waited, 3.1)              # a read before preempting waited until 3.1
    eng._waited(ready, 3.15)              # a read that found its result ready
    eng._expose(3.3, ready, 3.4)          # idle from 3.1 only, not from 2.7
    assert abs(eng.exposed_host_seconds - 1.0) < 1e-12


def test_exposed_host_time_leaves_out_compilation_and_unaccounted_steps(tiny_model):
    """Compilation between two queueings is not device idle time charged to the host
    (the rates leave it out too), the wait before a compilation is a real wait, and
    steps inside ``unaccounted()`` (e.g. traced ones) change no timing counter nor
    make the next step count the pause."""
    cfg, params = tiny_model
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                       max_context=64, page_size=8)
    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(64))
    ready, waited = 0.0, 10 * Engine.READY_WAIT_S
    eng._expose(1.0, ready, 1.1)
    eng.compile_seconds += 0.3            # a new prefill shape compiled in between
    eng._expose(1.5, ready, 1.6)
    assert abs(eng.exposed_host_seconds - 0.2) < 1e-12
    eng._drained(waited, 1.9)             # queued work finished before compiling
    eng.compile_seconds += 0.05           # compiled after that wait: left out
    eng._expose(2.0, ready, 2.1)
    assert abs(eng.exposed_host_seconds - 0.25) < 1e-12
    eng.compile_seconds += 0.1            # compiled before a real wait that ended at 2.3:
    eng._waited(waited, 2.3)              # the idle time counts from the wait, whole
    eng._expose(2.4, ready, 2.45)
    assert abs(eng.exposed_host_seconds - 0.35) < 1e-12
    before = (eng.exposed_host_seconds, eng.host_seconds, eng.decode_seconds)
    with eng.unaccounted():
        eng._expose(2.5, ready, 2.6)
        eng.host_seconds += 1.0
        eng.decode_seconds += 1.0
        assert eng.exposed_host_seconds > before[0]
    assert (eng.exposed_host_seconds, eng.host_seconds, eng.decode_seconds) == before
    eng._expose(9.0, ready, 9.1)          # the pause before it is not the host's
    assert eng.exposed_host_seconds == before[0]
    eng._expose(9.4, ready, 9.5)          # counting resumes from the next queueing
    assert abs(eng.exposed_host_seconds - before[0] - 0.4) < 1e-12
    # A real engine: steps inside unaccounted() still serve, their time is left out.
    rid = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8))
    with eng.unaccounted():
        for _ in range(3):
            eng.step()
    assert eng.decode_tokens == 0 and eng.decode_seconds == before[2]
    while eng.has_unfinished():
        eng.step()
    assert len(eng.requests[rid].output) == 8 and eng.decode_tokens > 0
