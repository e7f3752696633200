"""The fp8 cache: FP8 e4m3 K/V with calibrated per-(layer, KV head) scales.

* decode attention and model logits against the uncompressed cache, within
  e4m3's precision (3 mantissa bits: relative rounding error <= 2^-4);
* calibration recovers the amax of a model whose K/V are known by construction;
* values past the scale's range saturate at +-448 instead of becoming NaN;
* pages really are 1 byte per element: half of 16-bit for the same tokens,
  written in place;
* make_method errors, an Engine run that gives back every page, and eval.py's
  own calibration.
"""

from __future__ import annotations

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.engine import Engine
from diffkv_jax.evaluation.metrics import read_results
from diffkv_jax.fp8_cache import (FP8_MAX, NEED_SCALES, Fp8Cache, calibrate_fp8_scales,
                                  encode_fp8, kv_amax)
from diffkv_jax.generation import SamplingParams
from diffkv_jax.methods import make_method
from diffkv_jax.paged_cache import FullCache
from diffkv_jax.pool_writes import scatter_set
from diffkv_jax.steps import CompiledSteps
from scripts import eval as ev

E4M3_REL = 2.0 ** -4  # largest relative rounding error of a normal e4m3 value


def geometry(cfg, **kw):
    return dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, **kw)


@pytest.fixture(scope="module")
def scales(tiny_model):
    cfg, params = tiny_model
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab_size, size=64) for _ in range(2)]
    return calibrate_fp8_scales(cfg, params, docs)


# --------------------------------------------------------------------------- against full


def write_and_attend(method, k, v, q, prompt_len):
    """Prefill-write ``k, v [S, T, KVH, D]`` (first ``prompt_len`` tokens), decode-write
    the next token, attend with ``q [S, nq, D]``; layer 0. Returns (state, out [S, nq, D])."""
    S, T = k.shape[:2]
    state = method.init_state(S * method.pages_for_tokens(method.max_context))
    batch = PrefillBatch(jnp.zeros((S, T), jnp.int32), jnp.full((S,), prompt_len, jnp.int32),
                         jnp.arange(S, dtype=jnp.int32))
    state, batch = method.begin_prefill(state, batch)
    state, _ = method.prefill_attention(state, 0, jnp.zeros((S, T, q.shape[1], q.shape[2])),
                                        k, v, batch)
    state = method.end_prefill(state, batch)
    dec = DecodeBatch(jnp.zeros((S,), jnp.int32), jnp.ones((S,), bool), method.row_len)
    state, out = method.decode_attention(state, 0, q[:, None], k[:, prompt_len:prompt_len + 1],
                                         v[:, prompt_len:prompt_len + 1], dec)
    return state, np.asarray(out[:, 0])


def test_decode_attention_matches_full_within_e4m3_precision(tiny_model):
    cfg, _ = tiny_model
    rng = np.random.default_rng(1)
    S, T, H, D, nq = 3, 40, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    # Per-head magnitudes far apart, so one scale for all heads would not do.
    mag = np.array([0.05, 20.0])[:H, None]
    k = jnp.asarray(rng.normal(size=(S, T + 1, H, D)) * mag, jnp.float32)
    v = jnp.asarray(rng.normal(size=(S, T + 1, H, D)) * mag, jnp.float32)
    q = jnp.asarray(rng.normal(size=(S, nq, D)) / np.repeat(mag, nq // H, 0), jnp.float32)
    amax_k = np.abs(np.asarray(k)).max(axis=(0, 1, 3))
    amax_v = np.abs(np.asarray(v)).max(axis=(0, 1, 3))
    geo = geometry(cfg, max_seqs=S, max_context=64, page_size=8)
    full = FullCache(**geo)
    fp8 = Fp8Cache(**geo, k_scale=[list(amax_k / FP8_MAX)] * cfg.num_layers,
                   v_scale=[list(amax_v / FP8_MAX)] * cfg.num_layers)
    _, ref = write_and_attend(full, k, v, q, T)
    state, got = write_and_attend(fp8, k, v, q, T)
    assert state.k_pages.dtype == jnp.float8_e4m3fn
    # The output is a convex combination of V rows, so V's rounding moves it by at most
    # 2^-4 max|V| per head; K's rounding perturbs the softmax a little more.
    vmax = np.repeat(amax_v, nq // H)[None, :, None]
    err = np.abs(got - ref) / vmax
    assert err.max() < 2 * E4M3_REL, err.max()
    assert err.mean() < E4M3_REL / 4, err.mean()
    assert np.abs(got - ref).max() > 0  # it really is quantized


def teacher_forced_logits(cfg, params, method, seqs, prompt_len):
    """Logits of every position from ``prompt_len - 1`` on: prefill, then token by token."""
    S = method.max_seqs
    steps = CompiledSteps(cfg, method, jnp.float32)
    state = method.init_state(S * method.pages_for_tokens(method.max_context))
    toks = np.asarray(seqs, np.int32)
    batch = PrefillBatch(jnp.asarray(toks[:, :prompt_len]), jnp.full((S,), prompt_len, jnp.int32),
                         jnp.arange(S, dtype=jnp.int32))
    state, logits = steps.prefill(params, state, batch)
    out = [np.asarray(logits)]
    for p in range(prompt_len, toks.shape[1]):
        state, logits = steps.decode(params, state, DecodeBatch(
            jnp.asarray(toks[:, p]), jnp.ones((S,), bool), method.row_len))
        out.append(np.asarray(logits))
    assert not bool(state.alloc_failed)
    return np.stack(out, 1)


def test_tiny_model_logits_match_full(tiny_model, scales):
    cfg, params = tiny_model
    rng = np.random.default_rng(2)
    seqs = rng.integers(0, cfg.vocab_size, size=(2, 48))
    geo = dict(max_seqs=2, max_context=64, page_size=8)
    ref = teacher_forced_logits(cfg, params, make_method("full", cfg, **geo), seqs, 9)
    bf16 = teacher_forced_logits(cfg, params, make_method("full", cfg, **geo, dtype=jnp.bfloat16),
                                 seqs, 9)
    got = teacher_forced_logits(cfg, params, make_method(
        "fp8", cfg, **geo, k_scale=scales[0], v_scale=scales[1]), seqs, 9)
    # A random model is touchy (its logits move ~1e-2 with a bfloat16 cache already).
    # e4m3 rounds 2^5 times coarser than bfloat16 (2^-4 against 2^-9), so its error
    # may be up to that multiple of bfloat16's, no more; on average it stays below
    # 2^-4 of the logits' spread.
    err, err16 = np.abs(got - ref), np.abs(bf16 - ref)
    assert 0 < err.max() < 2 ** 5 * err16.max(), (err.max(), err16.max())
    assert err.mean() < 2 ** 5 * err16.mean(), (err.mean(), err16.mean())
    assert err.mean() < E4M3_REL * ref.std(), (err.mean(), ref.std())
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


# --------------------------------------------------------------------------- calibration


def test_calibration_recovers_a_constructed_amax(tiny_model):
    """K and V set by the projection biases alone (kernels zeroed): V = b_v at every token;
    K = RoPE(b_k) with b_k's second half zero, whose largest |entry| is b_k's, at position 0."""
    cfg, params = tiny_model
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(3)
    bk = rng.normal(size=(L, H, D)) * rng.uniform(0.1, 30, size=(L, H, 1))
    bk[..., D // 2:] = 0
    bv = rng.normal(size=(L, H, D)) * rng.uniform(0.1, 30, size=(L, H, 1))
    bv[1, 0, 3] = -100.0  # the largest magnitude is negative
    attn = dict(params["layers"]["attn"])
    for name, b in (("k_proj", bk), ("v_proj", bv)):
        attn[name] = {"kernel": jnp.zeros_like(attn[name]["kernel"]),
                      "bias": jnp.asarray(b.reshape(L, H * D), jnp.float32)}
    params = {**params, "layers": {**params["layers"], "attn": attn}}
    want_k = np.abs(bk).max(-1).astype(np.float32)
    want_v = np.abs(bv).max(-1).astype(np.float32)
    batches = [rng.integers(0, cfg.vocab_size, size=(2, 33)), list(range(5))]
    k_max, v_max = kv_amax(cfg, params, batches)
    np.testing.assert_array_equal(k_max, want_k)
    np.testing.assert_array_equal(v_max, want_v)
    k_scale, v_scale = calibrate_fp8_scales(cfg, params, batches, margin=1.0)
    np.testing.assert_allclose(np.asarray(k_scale) * FP8_MAX, want_k, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v_scale) * FP8_MAX, want_v, rtol=1e-6)
    k2, _ = calibrate_fp8_scales(cfg, params, batches, margin=2.0)
    np.testing.assert_allclose(np.asarray(k2), 2 * np.asarray(k_scale), rtol=1e-12)
    assert isinstance(k_scale, tuple) and len(k_scale) == L and len(k_scale[0]) == H
    with pytest.raises(ValueError, match="at least one"):
        calibrate_fp8_scales(cfg, params, [])


# --------------------------------------------------------------------------- saturation


def test_values_beyond_the_scale_saturate_instead_of_nan(tiny_model):
    x = jnp.array([1e9, -1e9, 500.0, 449.0, 448.0, 3.0, -1e-5, 0.0])
    got = np.asarray(encode_fp8(x, 1.0).astype(jnp.float32))
    np.testing.assert_array_equal(got, [448, -448, 448, 448, 448, 3, 0, 0])
    assert np.isnan(np.asarray(encode_fp8(jnp.array([jnp.nan]), 1.0), np.float32)).all()

    cfg, _ = tiny_model
    rng = np.random.default_rng(4)
    S, T, H, D = 2, 12, cfg.num_kv_heads, cfg.head_dim
    k = jnp.asarray(rng.normal(size=(S, T + 1, H, D)) * 1e6, jnp.float32)
    v = jnp.asarray(rng.normal(size=(S, T + 1, H, D)) * 1e6, jnp.float32)
    q = jnp.asarray(rng.normal(size=(S, cfg.num_heads, D)), jnp.float32)
    m = Fp8Cache(**geometry(cfg, max_seqs=S, max_context=32, page_size=4), k_scale=0.01,
                 v_scale=0.02)
    state, out = write_and_attend(m, k, v, q, T)
    pages = np.asarray(state.v_pages.astype(jnp.float32))
    assert np.isfinite(pages).all() and np.isfinite(np.asarray(state.k_pages, np.float32)).all()
    assert np.abs(pages).max() == FP8_MAX
    assert np.isfinite(out).all()
    # A convex combination of saturated values (matmuls may round at TF32 on a GPU).
    assert np.abs(out).max() <= FP8_MAX * 0.02 * 1.01


# --------------------------------------------------------------------------- memory


def test_pages_hold_one_byte_per_element_half_of_16_bit(tiny_model, scales):
    cfg, params = tiny_model
    geo = dict(max_seqs=2, max_context=64, page_size=8)
    fp8 = make_method("fp8", cfg, **geo, k_scale=scales[0], v_scale=scales[1])
    bf16 = make_method("full", cfg, **geo, dtype=jnp.bfloat16)
    assert fp8.page_bytes * 2 == bf16.page_bytes == 2 * 8 * cfg.head_dim * 2
    state = fp8.init_state(10)
    assert state.k_pages.nbytes + state.v_pages.nbytes == 11 * fp8.page_bytes

    prompts = [list(np.random.default_rng(5).integers(0, cfg.vocab_size, size=n))
               for n in (13, 30)]
    eng = Engine(cfg, params, fp8, num_pages=2 * fp8.pages_for_tokens(64) + 16)
    for r in eng.generate(prompts, [SamplingParams(max_new_tokens=7)] * 2):
        st = r.kv_stats
        assert st["tokens"] == len(r.prompt) + len(r.output) - 1
        # Same pages as a bfloat16 cache for these tokens, at half the bytes each.
        assert st["pages"] == bf16.pages_for_tokens(st["tokens"])
        assert 2 * st["page_bytes"] == st["pages"] * bf16.page_bytes
        assert 2 * st["data_bytes"] == st["bytes_16bit_same_tokens"]


def test_fp8_writes_stay_in_place(tiny_model):
    """Pools are scattered as their bits (``scatter_set``): XLA would otherwise widen
    the whole float8 pool to float16 around every write."""
    pool = jnp.asarray(np.random.default_rng(7).normal(size=(20, 4, 8)), jnp.float8_e4m3fn)
    page, slot = jnp.asarray([3, 7, 20, 3]), jnp.asarray([0, 2, 1, 1])  # 20: dropped
    vals = jnp.asarray(np.random.default_rng(8).normal(size=(4, 8)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(scatter_set(pool, (page, slot), vals), np.float32),
        np.asarray(pool.at[page, slot].set(vals.astype(pool.dtype), mode="drop"), np.float32))

    cfg, params = tiny_model
    m = make_method("fp8", cfg, max_seqs=4, max_context=128, k_scale=0.1, v_scale=0.1)
    state = m.init_state(300)
    batch = DecodeBatch(jnp.zeros(4, jnp.int32), jnp.ones(4, bool), 4)
    text = CompiledSteps(cfg, m, jnp.float32).decode.lower(params, state, batch).compile().as_text()
    assert "input_output_alias" in text
    shape = ",".join(map(str, state.k_pages.shape))
    for wide in ("f8e4m3fn", "f16", "f32"):
        assert not [ln for ln in text.splitlines()
                    if f"{wide}[{shape}]" in ln and (" copy(" in ln or " scatter(" in ln)]


# --------------------------------------------------------------------------- registry, engine


def test_make_method_errors_are_clear(tiny_model):
    cfg, _ = tiny_model
    geo = dict(max_seqs=2, max_context=64)
    ok = dict(k_scale=0.1, v_scale=0.1)
    with pytest.raises(ValueError, match="calibrate_fp8_scales") as e:
        make_method("fp8", cfg, **geo)
    assert str(e.value) == NEED_SCALES
    with pytest.raises(ValueError, match="calibrate_fp8_scales"):
        make_method("fp8", cfg, **geo, k_scale=0.1)
    with pytest.raises(ValueError, match=r"k_scale must be .*\[num_layers=3\]\[num_kv_heads=2\]"):
        make_method("fp8", cfg, **geo, k_scale=[0.1] * 5, v_scale=0.1)
    with pytest.raises(ValueError, match="v_scale must be"):
        make_method("fp8", cfg, **geo, k_scale=0.1, v_scale="big")
    with pytest.raises(ValueError, match="positive and finite"):
        make_method("fp8", cfg, **geo, k_scale=0.1, v_scale=[[0.1, 0.0]] * 3)
    with pytest.raises(ValueError, match="reference attention"):
        make_method("fp8", cfg, **geo, **ok, attention_impl="pallas")
    with pytest.raises(ValueError, match=r"\['alpha_high'\] do not apply"):
        make_method("fp8", cfg, **geo, **ok, alpha_high=1.0)
    m = make_method("fp8", cfg, **geo, k_scale=0.1, v_scale=np.full((3, 1), 0.2))
    assert m.k_scale == ((0.1, 0.1),) * 3 and m.v_scale == ((0.2, 0.2),) * 3
    assert m.name == "fp8" and m.dtype == "float8_e4m3fn"
    assert hash(m) == hash(make_method("fp8", cfg, **geo, k_scale=0.1, v_scale=0.2))


def test_engine_serves_and_returns_every_page(tiny_model, scales):
    cfg, params = tiny_model
    rng = np.random.default_rng(6)
    m = make_method("fp8", cfg, max_seqs=2, max_context=64, page_size=8,
                    k_scale=scales[0], v_scale=scales[1])
    # Room for about one and a half requests: they queue and some are preempted.
    # Prompt lengths in one bucket keep compilation short.
    eng = Engine(cfg, params, m, num_pages=m.pages_for_tokens(48) * 3 // 2)
    # Preempt on the free-page bound (not the exact count the engine reads first),
    # so that this small workload preempts.
    eng.READ_BEFORE_PREEMPTING = False
    prompts = [list(rng.integers(0, cfg.vocab_size, size=rng.integers(17, 30))) for _ in range(6)]
    sampling = [SamplingParams(max_new_tokens=int(rng.integers(8, 16))) for _ in range(6)]
    reqs = eng.generate(prompts, sampling)
    assert all(r.status == "finished" for r in reqs)
    assert [len(r.output) for r in reqs] == [s.max_new_tokens for s in sampling]
    assert any(r.preemptions for r in reqs)
    assert eng.free_pages == eng.num_pages
    assert not bool(eng.state.alloc_failed)  # the reserve never fell short


# --------------------------------------------------------------------------- eval.py


def test_eval_calibrates_fp8_once_and_keeps_the_label(tiny_model):
    cfg, params = tiny_model
    tok = types.SimpleNamespace(encode=lambda text: [ord(c) % cfg.vocab_size for c in text])
    runs = ev.parse_methods("full,fp8,fp8:k_scale=0.5,v_scale=0.25,fp8:page_size=8")
    config: dict = {}
    out = ev.with_fp8_scales(runs, cfg, params, jnp.float32, tok, config)
    assert [r.label for r in out] == [r.label for r in runs]
    assert out[0] == runs[0] and not out[0].calibrated and not out[2].calibrated
    prov = config["fp8_scales"]
    assert prov["docs"] == ev.FP8_CALIBRATION_DOCS and prov["tokens"] == ev.FP8_CALIBRATION_TOKENS
    assert "calibrate.py" in prov["source"]
    assert out[1].calibrated == out[3].calibrated == (("k_scale", prov["k_scale"]),
                                                      ("v_scale", prov["v_scale"]))
    built = [ev.build_method(r, cfg, max_seqs=2, max_context=64, dtype=jnp.float32)
             for r in out[1:]]
    assert built[0].k_scale == prov["k_scale"] and built[0].v_scale == prov["v_scale"]
    assert built[1].k_scale == ((0.5, 0.5),) * cfg.num_layers  # given scales win
    assert built[2].page_size == 8 and built[2].k_scale == prov["k_scale"]
    assert ev.with_fp8_scales(runs[:1], cfg, params, jnp.float32, tok, config) == runs[:1]
    with pytest.raises(ev.EvalError, match="calibrate_fp8_scales"):
        ev.build_method(runs[1], cfg, max_seqs=2, max_context=64, dtype=jnp.float32)


def test_eval_runs_fp8_out_of_the_box(smollm, tmp_path):
    out = tmp_path / "eval"
    argv = ["--methods", "fp8", "--datasets", "passkey", "--limit", "1", "--passkey-lengths",
            "200", "--max-context", "256", "--max-batch", "2", "--out", str(out), "--no-progress"]
    assert ev.main(argv, model=(smollm.cfg, smollm.params, smollm.tokenizer)) == 0
    prov = json.loads((out / "config.json").read_text())["fp8_scales"]
    L, H = smollm.cfg.num_layers, smollm.cfg.num_kv_heads
    assert np.shape(prov["k_scale"]) == np.shape(prov["v_scale"]) == (L, H)
    results = read_results(out / "results.jsonl")
    assert results and {r.method for r in results} == {"fp8"}
    for r in results:
        st = r.extra["kv"]
        assert 2 * st["data_bytes"] == st["bytes_16bit_same_tokens"]
        assert 0.5 < r.kv_bytes / r.kv_bytes_16bit < 0.6  # pages with headroom + page table
