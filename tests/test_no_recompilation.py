"""After warm-up, decoding never compiles again (compilations counted via jax.monitoring)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import Generator, SamplingParams
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.steps import CompiledSteps

_COMPILES = {"n": 0}


def _listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def compiles():
    return _COMPILES["n"]


def test_decode_steps_do_not_recompile(tiny_model):
    cfg, params = tiny_model
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=4,
                       max_context=256, page_size=8)
    steps = CompiledSteps(cfg, method, jnp.float32)
    state = method.init_state(4 * method.pages_for_tokens(256))
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(4, 32)).astype(np.int32)
    state, _ = steps.prefill(params, state, PrefillBatch(
        jnp.asarray(toks), jnp.asarray([32, 7, 19, 0], jnp.int32),
        jnp.asarray([0, 1, 2, 4], jnp.int32)))
    active = jnp.asarray([True, True, True, False])
    state, _ = steps.decode(params, state, DecodeBatch(jnp.asarray(toks[:, 0]), active, 16))
    before = compiles()
    rng = np.random.default_rng(1)
    for i in range(20):
        act = jax.device_put(rng.random(4) < 0.8)
        tk = jax.device_put(rng.integers(0, cfg.vocab_size, size=4).astype(np.int32))
        state, logits = steps.decode(params, state, DecodeBatch(tk, act, 16))
    logits.block_until_ready()
    assert compiles() == before, f"{compiles() - before} compilations after warm-up"


def test_generator_second_run_compiles_nothing(smollm):
    cfg, params, tok = smollm.cfg, smollm.params, smollm.tokenizer
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                       max_context=128, page_size=16)
    gen = Generator(cfg, params, method, num_pages=2 * method.pages_for_tokens(128))
    prompts = [tok.encode("Once upon a time"), tok.encode("The three primary colours are")]
    sampling = [SamplingParams(max_new_tokens=24), SamplingParams(temperature=0.8, top_p=0.9,
                                                                  top_k=40, seed=3,
                                                                  max_new_tokens=24)]
    first = gen.generate(prompts, sampling)
    n_exec, before = gen.num_compiled, compiles()
    second = gen.generate(prompts, sampling)
    assert compiles() == before, f"{compiles() - before} compilations in the second run"
    assert gen.num_compiled == n_exec
    assert second.decode_tokens >= 20
    # Same seeds, same cache: the sampled continuations repeat exactly.
    assert first.tokens == second.tokens
    # Every page went back to the free list.
    assert int(gen.state.free.num_free) == gen.num_pages


def test_greedy_decode_step_has_no_host_branch(tiny_model):
    """The engine's greedy decode step holds no conditional: on the GPU one reads its
    predicate back to the host mid-step, so the host could not queue the next step."""
    cfg, params = tiny_model
    method = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seqs=2,
                       max_context=64, page_size=8)
    steps = CompiledSteps(cfg, method, jnp.float32)
    state = method.init_state(2 * method.pages_for_tokens(64))
    smp = Generator._sampling_arrays([SamplingParams(), SamplingParams()], 2,
                                     steps=np.zeros(2, np.int32))
    assert smp.greedy_only
    batch = DecodeBatch(jnp.zeros(2, jnp.int32), jnp.ones(2, bool), 8)
    text = steps.decode_and_sample.lower(params, state, batch, smp).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_kernel_decode_compiles_one_width_bucket(tiny_model):
    """The Pallas path walks each row's real pages, so every length shares one decode
    bucket (the whole row); the reference gathers what it is given, so its buckets
    grow in powers of two with the longest row."""
    from diffkv_jax.generation import decode_width
    from diffkv_jax.methods import make_method

    cfg, _ = tiny_model
    for name in ("full", "diffkv"):
        ref = make_method(name, cfg, max_seqs=2, max_context=512, dtype=jnp.float32)
        ker = make_method(name, cfg, max_seqs=2, max_context=512, dtype=jnp.float32,
                          attention_impl="pallas")
        assert {decode_width(ker, n) for n in (1, 40, 300, 511)} == {ker.row_len}
        widths = [decode_width(ref, n) for n in (1, 40, 300)]
        assert widths == sorted(widths) and len(set(widths)) == 3
        assert all(w & (w - 1) == 0 or w == ref.row_len for w in widths)


@pytest.mark.parametrize("weights,snap", [(None, None), ((8, 15), 0.3)])
def test_kernel_work_lists_cover_the_active_rows_of_every_layer(tiny_model, monkeypatch,
                                                                weights, snap):
    """The Pallas path sizes its attention launches on the device (no shape bucket
    for the number of active rows): every layer's work items cover exactly the
    work units of the active rows' pages, and a few long rows split into many
    items; also with other tier weights and cuts moved onto the tier boundaries."""
    from diffkv_jax import diffkv_kernel_attention as dka
    from diffkv_jax.diffkv_kernel_attention import plan_decode_work
    from diffkv_jax.methods import make_method
    from diffkv_jax.steps import CompiledSteps

    cfg, params = tiny_model
    S, T = 16, 200
    m = make_method("diffkv", cfg, max_seqs=S, max_context=T + 8, dtype=jnp.float32,
                    attention_impl="pallas")
    steps = CompiledSteps(cfg, m, jnp.float32)
    rng = np.random.default_rng(0)
    slots = np.asarray([2, 9, 11], np.int32)
    lens = np.asarray([T, 130, 41], np.int32)
    toks = rng.integers(0, cfg.vocab_size, size=(3, T)).astype(np.int32)
    state = m.init_state(S * m.pages_for_tokens(T + 8))
    state, _ = steps.prefill(params, state, PrefillBatch(jnp.asarray(toks), jnp.asarray(lens),
                                                         jnp.asarray(slots)))
    active = np.zeros(S, bool)
    active[slots[:2]] = True  # slot 11 holds tokens but does not decode
    if weights is not None:
        monkeypatch.setattr(dka, "TIER_WEIGHTS", dict(zip((dka.HI, dka.LO), weights)))
        monkeypatch.setattr(dka, "TIER_SNAP", snap)
    w = [dka.TIER_WEIGHTS[t] for t in (dka.HI, dka.LO)]
    work = plan_decode_work(m, state, jnp.asarray(active))
    items, seg = np.asarray(work.items), np.asarray(work.seg)
    n_tok = np.asarray(state.n_tok)
    H = m.num_kv_heads
    assert items.shape[0] == cfg.num_layers
    for layer in range(cfg.num_layers):
        for s in range(S):
            for h in range(H):
                pages = 0
                if active[s]:
                    pages = sum(-(-n_tok[s, layer, h, t] // m.cap(t)) * w[t]
                                for t in (0, 1))
                mine = items[layer][seg[layer] == s * H + h]
                covered = np.zeros(pages, int)
                for _, _, b, e in mine:
                    assert e <= pages
                    covered[b:e] += 1
                assert np.all(covered == 1) and (len(mine) > 0) == (pages > 0)
                if active[s] and s == slots[0]:
                    assert len(mine) > 1  # the long row is split


def test_decode_buckets_cover_every_step_shape(tiny_model):
    """Warm-up compiles :func:`decode_buckets`; every width a step can be given is
    among them, on both attention paths (one on the Pallas path)."""
    from diffkv_jax.generation import decode_buckets, decode_width
    from diffkv_jax.methods import make_method

    cfg, _ = tiny_model
    for impl in ("reference", "pallas"):
        m = make_method("diffkv", cfg, max_seqs=64, max_context=300, dtype=jnp.float32,
                        attention_impl=impl)
        buckets = set(decode_buckets(m))
        seen = {decode_width(m, t) for t in range(1, 301)}
        assert seen == buckets  # nothing compiled that no step uses
        assert len(buckets) == 1 if impl == "pallas" else len(buckets) > 1


def test_engine_after_warm_up_compiles_no_decode_step(tiny_model):
    """After ``warm_up`` a workload of mixed lengths and batch sizes, greedy and sampled,
    compiles no decode executable (prefill buckets still compile on first use)."""
    from diffkv_jax.engine import Engine
    from diffkv_jax.methods import make_method

    cfg, params = tiny_model
    m = make_method("full", cfg, max_seqs=4, max_context=96, dtype=jnp.float32)
    eng = Engine(cfg, params, m, num_pages=4 * m.pages_for_tokens(96) + 64)
    from diffkv_jax.generation import decode_buckets

    compiled = eng.warm_up(sampled=True)
    assert compiled == 2 * len(decode_buckets(m)) > 0  # greedy and sampled variants
    assert eng.warm_up(sampled=True) == 0  # already compiled: nothing to do
    decode_keys = {k for k in eng._executables if k[0] == "decode"}
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (5, 40, 17, 70, 3, 9)]
    sampling = [SamplingParams(max_new_tokens=n, temperature=t, seed=i)
                for i, (n, t) in enumerate(zip((20, 12, 25, 20, 8, 30), (0, 0.8, 0, 0, 1.0, 0)))]
    outs = eng.generate(prompts, sampling)
    assert all(r.status == "finished" and len(r.output) > 0 for r in outs)
    assert {k for k in eng._executables if k[0] == "decode"} == decode_keys
