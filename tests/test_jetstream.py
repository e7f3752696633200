"""diffkv_jax.jetstream: requests driven through prefill / insert / generate alone."""

import numpy as np
import pytest

from diffkv_jax import jetstream as js
from diffkv_jax.engine import Engine
from diffkv_jax.generation import GenerationInputError, SamplingParams
from diffkv_jax.methods import make_method
from diffkv_jax.steps import CompiledSteps


def drive(steps, params, state, prompts, sampling, arrive_at):
    """A minimal JetStream-style loop: request i arrives at decode step ``arrive_at[i]`` and
    is inserted and prefilled once a slot is free; every step decodes all active slots;
    finished slots are released. Returns the state, the outputs and the free pages."""
    S = steps.method.max_seqs
    active = np.zeros(S, bool)
    last = np.zeros(S, np.int32)
    lengths = np.zeros(S, np.int32)
    owner = [None] * S
    out = [[] for _ in prompts]
    done = [False] * len(prompts)
    smp = [SamplingParams()] * S

    def accept(i, tok):
        out[i].append(int(tok))
        return len(out[i]) >= sampling[i].max_new_tokens

    t = 0
    while not all(done):
        for i in [i for i, a in enumerate(arrive_at) if a <= t and not out[i]]:
            if active.all():
                break
            slot = js.insert(active)
            state, first, free = js.prefill(steps, params, state, prompts[i], slot=slot,
                                            sampling=sampling[i])
            if accept(i, first):
                state, done[i] = js.release(steps, state, [slot]), True
                continue
            active[slot], last[slot], lengths[slot], owner[slot] = True, first, len(
                prompts[i]) + 1, i
            smp[slot] = sampling[i]
        if active.any():
            batch = js.decode_batch(steps, last, active, lengths)
            arrays = js.sampling_arrays(smp, [len(out[o]) if o is not None else 0
                                              for o in owner])
            state, toks, free = js.generate(steps, params, state, batch, arrays)
            toks = np.asarray(toks)
            finished = []
            for s in np.flatnonzero(active):
                i = owner[s]
                if accept(i, toks[s]):
                    finished.append(int(s))
                    done[i] = True
                else:
                    last[s], lengths[s] = toks[s], lengths[s] + 1
            if finished:
                state = js.release(steps, state, finished)
                active[finished] = False
                for s in finished:
                    owner[s], smp[s] = None, SamplingParams()
        t += 1
        assert t < 500
    return state, out, int(state.free.num_free)


@pytest.mark.parametrize("kind", ["full", "diffkv"])
def test_jetstream_functions_match_engine(tiny_model, kind):
    cfg, params = tiny_model
    opts = {"window": 8} if kind == "diffkv" else {}
    method = make_method(kind, cfg, max_seqs=2, max_context=96,
                         page_size=4 if kind == "full" else 8, **opts)
    pages = 2 * method.pages_for_tokens(96)
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (5, 23, 40)]
    sampling = [SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=4),
                SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)]
    ref = [r.output for r in Engine(cfg, params, method, num_pages=pages)
           .generate(prompts, sampling)]

    steps = CompiledSteps(cfg, method, np.float32)
    state = js.init_state(steps, pages)
    # Two slots for three requests: the third waits for a slot, arriving mid-decode.
    state, out, free = drive(steps, params, state, prompts, sampling, arrive_at=[0, 1, 5])
    assert out == ref
    assert [len(o) for o in out] == [9, 4, 12]
    assert free == pages  # every page came back


def test_insert_chooses_a_free_slot_and_prefill_checks_input(tiny_model):
    cfg, params = tiny_model
    method = make_method("full", cfg, max_seqs=3, max_context=32, page_size=4)
    eng = Engine(cfg, params, method, num_pages=3 * method.pages_for_tokens(32))
    assert js.compiled_steps(eng) is eng.steps
    assert js.insert([True, False, False]) == 1
    assert js.insert([True, False, False], slot=2) == 2
    for active, slot in (([True, True, True], None), ([True, False, False], 0),
                         ([False] * 3, 3)):
        with pytest.raises(GenerationInputError):
            js.insert(active, slot)
    state = js.init_state(eng, eng.num_pages)
    for toks, slot in (([], 0), ([1] * 32, 0), ([1, 2], 3)):
        with pytest.raises(GenerationInputError):
            js.prefill(eng, params, state, toks, slot=slot)
    with pytest.raises(TypeError):
        js.compiled_steps(object())
