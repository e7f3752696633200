"""The DiffKV cache decoding through the Pallas kernel (interpret mode) matches the jnp path."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax.methods import make_method
from diffkv_jax.scoring import score_teacher_forced


@pytest.mark.parametrize("opts", [dict(alpha_high=1.0, alpha_low=0.05, window=8),
                                  dict(alpha_high=1.0, alpha_low=0.0, low_tier=False, window=8)])
def test_kernel_path_matches_reference_path(tiny_model, opts):
    cfg, params = tiny_model
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(0, cfg.vocab_size, size=120)) for _ in range(2)]
    ref = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=8, **opts)
    ker = dataclasses.replace(ref, attention_impl="pallas")
    # float32 dots in interpret mode; the paths differ only in summation order,
    # which can flip a near-tie in tiering, so compare the per-token likelihoods.
    assert_decodes_alike(cfg, params, ref, ker, docs)


def assert_decodes_alike(cfg, params, first, second, docs):
    """``docs`` scored through both methods: per-token likelihoods within 2e-3, top-1
    agreeing on > 98% of the tokens, tier fractions within 1 point."""
    a = score_teacher_forced(cfg, params, first, docs, 20, progress=False)
    b = score_teacher_forced(cfg, params, second, docs, 20, progress=False)
    assert np.abs(a.nll - b.nll).max() < 2e-3
    assert (a.argmax == b.argmax).mean() > 0.98
    for key in ("frac_high", "frac_low", "frac_pruned"):
        assert abs(a.memory[key] - b.memory[key]) < 0.01


def test_float16_logits_decode_like_float32_logits(tiny_model):
    # The policy reads its probabilities from the kernel's logits: stored as float16
    # (the default) they are within float16's rounding of float32's, so the tiering
    # and the likelihoods stay within the kernel-versus-reference tolerances.
    cfg, params = tiny_model
    rng = np.random.default_rng(11)
    docs = [list(rng.integers(0, cfg.vocab_size, size=120)) for _ in range(2)]
    f32 = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=8, window=8,
                      alpha_high=1.0, alpha_low=0.05, attention_impl="pallas",
                      logits_dtype="float32")
    f16 = dataclasses.replace(f32, logits_dtype="float16")
    assert make_method("diffkv", cfg, max_seqs=2, max_context=128).logits_dtype == "float16"
    assert_decodes_alike(cfg, params, f32, f16, docs)
    with pytest.raises(ValueError, match="logits_dtype"):
        dataclasses.replace(f32, logits_dtype="bfloat16")


@pytest.mark.parametrize("name,opts", [("diffkv", {"alpha_high": 1.0, "alpha_low": 0.05}),
                                       ("int8", {"alpha_high": 1.0})])
def test_token_writes_kernel_gives_the_same_decode_as_the_scatters(tiny_model, name, opts):
    # Only how the step's tokens reach the pool differs: the results are identical,
    # for both tiers and for the single-tier layout (which "auto" does not pick yet).
    cfg, params = tiny_model
    rng = np.random.default_rng(5)
    docs = [list(rng.integers(0, cfg.vocab_size, size=100)) for _ in range(2)]
    xla = make_method(name, cfg, max_seqs=2, max_context=128, page_size=8, window=8,
                      attention_impl="pallas", write_impl="xla", **opts)
    fused = dataclasses.replace(xla, write_impl="pallas")
    assert not xla.fused_writes and fused.fused_writes
    a = score_teacher_forced(cfg, params, xla, docs, 20, progress=False)
    b = score_teacher_forced(cfg, params, fused, docs, 20, progress=False)
    np.testing.assert_array_equal(a.nll, b.nll)
    assert a.memory == b.memory
    assert a.memory["frac_low"] > 0 if name == "diffkv" else a.memory["frac_high"] == 1
    with pytest.raises(ValueError, match="write_impl"):
        dataclasses.replace(xla, write_impl="cuda")


def _two_prompts(tiny_model, compiled: bool, seed: int):
    """The tiny model (head dim 64 when compiled: the GPU kernels' K4V2 value slices
    need it) and two random prompts of 40 and 70 tokens."""
    import jax

    from models.llama import init_params

    cfg, params = tiny_model
    if compiled:
        cfg = dataclasses.replace(cfg, head_dim=64)
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    rng = np.random.default_rng(seed)
    return cfg, params, [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (40, 70)]


@pytest.mark.parametrize("opts", [dict(alpha_high=1.0, alpha_low=0.05),
                                  dict(high_frac=0.5, low_frac=0.3)],
                         ids=["thresholds", "fixed-mix"])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_decision_in_the_write_kernel_gives_the_same_state(tiny_model, opts, compiled):
    # decide_impl="pallas" moves the victims' merge, the decision and the page
    # lookups into the token-writes launch: the cache state after every step (the
    # pool's bytes, side arrays, tables, counts) is identical to the XLA decision's.
    # (Compiled on the GPU the kernels' K4V2 value slices need head dim 64.)
    import jax

    from diffkv_jax.engine import Engine
    from diffkv_jax.generation import SamplingParams

    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=6)
    # (the compiled decode kernel needs pages of at least 16 tokens, its smallest dot tile)
    xla = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=16 if compiled else 8,
                      window=8, attention_impl="pallas", write_impl="pallas", decide_impl="xla",
                      **opts)
    fused = dataclasses.replace(xla, decide_impl="pallas")
    runs = []
    for m in (xla, fused):
        eng = Engine(cfg, params, m, num_pages=2 * m.pages_for_tokens(128) + 64)
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=50)) for p in prompts]
        states = []
        for _ in range(30):  # mid-generation: the rows still hold their tokens
            eng.step()
            states.append([np.asarray(x) for x in jax.tree_util.tree_leaves(eng.state)])
        runs.append(([eng.requests[i].output for i in ids], states,
                     m.memory_stats(eng.state)))
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) > 20
    assert runs[0][2]["frac_low"] > 0 and runs[0][2] == runs[1][2]
    for step_a, step_b in zip(runs[0][1], runs[1][1]):
        for a, b in zip(step_a, step_b):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="decide_impl"):
        dataclasses.replace(xla, decide_impl="pallas", write_impl="xla")


def test_token_writes_kernel_is_the_default_only_on_the_gpu_kernel_path(tiny_model):
    from pallas_kernels import backend

    cfg, _ = tiny_model
    kernels = make_method("diffkv", cfg, max_seqs=2, max_context=128, attention_impl="pallas")
    assert kernels.write_impl == "auto" and kernels.fused_writes == backend.on_gpu()
    # (so does the decision inside the token-writes launch)
    assert kernels.decide_impl == "auto" and kernels.decides_in_kernel == backend.on_gpu()
    forced = make_method("diffkv", cfg, max_seqs=2, max_context=128, attention_impl="pallas",
                         write_impl="pallas")
    assert forced.fused_writes and forced.decides_in_kernel == backend.on_gpu()
    # (prefill's window-scores kernel follows the same rule)
    assert kernels.window_kernel == backend.on_gpu()
    assert not make_method("diffkv", cfg, max_seqs=2, max_context=128).window_kernel
    assert not make_method("diffkv", cfg, max_seqs=2, max_context=128).fused_writes
    assert not make_method("int8", cfg, max_seqs=2, max_context=128,
                           attention_impl="pallas").fused_writes


def test_pallas_impl_rejects_unfit_tiers():
    from diffkv_jax.diffkv_cache import DiffKVCache
    from diffkv_jax.unified_page import Tier

    with pytest.raises(ValueError, match="Pallas"):
        DiffKVCache(1, 1, 16, 1, 64, high=Tier(8, 4), low=Tier(8, 2), attention_impl="pallas")


@pytest.mark.parametrize("merge", ["xla", "pallas", "launch"])
def test_full_cache_kernel_path_matches_reference_path(tiny_model, merge):
    # "launch": the attention launch merges its own rows (its counters in the state).
    cfg, params = tiny_model
    rng = np.random.default_rng(4)
    docs = [list(rng.integers(0, cfg.vocab_size, size=90)) for _ in range(2)]
    ref = make_method("full", cfg, max_seqs=2, max_context=128, page_size=8)
    ker = dataclasses.replace(ref, attention_impl="pallas", merge_impl=merge)
    assert ker.merges_in_launch == (merge == "pallas")
    assert ker.merges_in_attention == (merge == "launch")
    a = score_teacher_forced(cfg, params, ref, docs, 10, progress=False)
    b = score_teacher_forced(cfg, params, ker, docs, 10, progress=False)
    # Uncompressed, float32 dots: the two paths differ only in summation order.
    assert np.abs(a.nll - b.nll).max() < 1e-4
    assert (a.argmax == b.argmax).all()


def test_full_cache_rejects_unknown_attention_impl():
    from models.config import PRESETS

    with pytest.raises(ValueError, match="attention_impl"):
        make_method("full", PRESETS["smollm2-135m"], max_seqs=1, max_context=16,
                    attention_impl="fast")
    with pytest.raises(ValueError, match="merge_impl"):
        make_method("full", PRESETS["smollm2-135m"], max_seqs=1, max_context=16,
                    merge_impl="fast")
    with pytest.raises(ValueError, match="merge_impl"):  # needs the kernel path
        make_method("full", PRESETS["smollm2-135m"], max_seqs=1, max_context=16,
                    merge_impl="launch")


def _kernel_method(cfg, compiled: bool, **opts):
    """DiffKV on the kernel path, as the serving comparisons below take it (pages of 16
    tokens compiled: the GPU kernel's smallest dot tile; 8 in interpret mode)."""
    return make_method("diffkv", cfg, max_seqs=2, max_context=128,
                       page_size=16 if compiled else 8, window=8, attention_impl="pallas",
                       alpha_high=1.0, alpha_low=0.05, **opts)


def _serve(cfg, params, method, prompts, max_new: int, steps: int, dtype=jnp.float32):
    """``steps`` engine steps over ``prompts`` (compute ``dtype``): (outputs, scores or
    None where the cache keeps none, memory stats)."""
    from diffkv_jax.engine import Engine
    from diffkv_jax.generation import SamplingParams

    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(128) + 64,
                 dtype=dtype)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    for _ in range(steps):
        eng.step()
    scores = getattr(eng.state, "scores", None)
    return ([eng.requests[i].output for i in ids],
            None if scores is None else np.asarray(scores), method.memory_stats(eng.state))


def _assert_scores_agree(got, want, compiled: bool, rtol: float = 1e-4,
                         atol: float = 1e-5) -> None:
    """The scores of two launches that sum differently (two merges, two tilings) after
    30 steps. With float32 dots (interpret mode) they differ by rounding: nearly all
    within ``rtol``, ``atol``, and every one within 2e-3 relative, since a rounding
    difference can tip a near-tie in the policy's choices (which token a page
    demotes) some step and move the few scores after it a little more (one score
    of 4,496 off by 2.6e-4 relative on one CPU, none on another). Compiled, the dots
    take float16 operands: a rounding difference moves a query element or a logit
    across a float16 rounding boundary some steps later, and the scores then differ
    by up to ~5e-3 relative (the same serving in interpret mode with the launch's
    float16 operands: at most 1.6e-3 on scores up to 12 for the merges, 2.4e-3 on
    scores up to 6.8 for the tilings). A launch that loses or mis-weights a partial
    is off in most scores, by far more."""
    got, want = np.asarray(got), np.asarray(want)
    if compiled:
        np.testing.assert_allclose(got, want, rtol=5e-3, atol=2e-3)
        return
    np.testing.assert_allclose(got, want, rtol=max(rtol, 2e-3), atol=max(atol, 1e-4))
    close = np.abs(got - want) <= atol + rtol * np.abs(want)
    assert close.mean() >= 0.99, f"{(~close).sum()} of {close.size} scores off"


def _serve_both(cfg, params, prompts, methods):
    """:func:`_serve` (40 new tokens, 30 steps) with each of two methods, after
    checking that both give the same greedy tokens, more than 20 of them."""
    runs = [_serve(cfg, params, m, prompts, max_new=40, steps=30) for m in methods]
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) > 20
    return runs


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_merge_in_the_policy_launch_serves_the_same_tokens(tiny_model, compiled):
    # merge_impl="pallas": the policy launch merges the attention partials and the
    # token being decoded itself. Equal up to rounding (an online merge), so the
    # greedy tokens match and the scores agree closely.
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=8)
    xla = _kernel_method(cfg, compiled, merge_impl="xla")
    fused = dataclasses.replace(xla, merge_impl="pallas")
    assert fused.merges_in_policy and not xla.merges_in_policy
    # The default merges in the policy launch where the kernels run compiled.
    assert dataclasses.replace(xla, merge_impl="auto").merges_in_policy == compiled
    runs = _serve_both(cfg, params, prompts, (xla, fused))
    assert runs[0][2]["frac_low"] > 0
    _assert_scores_agree(runs[1][1], runs[0][1], compiled)
    with pytest.raises(ValueError, match="merge_impl"):
        make_method("diffkv", cfg, max_seqs=2, max_context=128, merge_impl="pallas")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_merge_in_the_attention_launch_serves_the_same_tokens(tiny_model, compiled):
    # merge_impl="launch": each row's last work item merges the row inside the
    # attention launch, and the policy launch folds that one partial with the token
    # being decoded. Equal up to rounding: the same greedy tokens, close scores, and
    # the merge counters zero again after every launch.
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=10)
    policy = _kernel_method(cfg, compiled, merge_impl="pallas")
    launch = dataclasses.replace(policy, merge_impl="launch")
    assert launch.merges_in_attention and launch.merges_in_policy
    assert not policy.merges_in_attention
    runs = _serve_both(cfg, params, prompts, (policy, launch))
    assert runs[0][2]["frac_low"] > 0
    _assert_scores_agree(runs[1][1], runs[0][1], compiled)
    with pytest.raises(ValueError, match="merge_impl"):
        make_method("diffkv", cfg, max_seqs=2, max_context=128, merge_impl="launch")


def test_merge_counters_stay_zero_between_launches(tiny_model):
    # The attention launch's merge counters live in the state, zero between launches.
    from diffkv_jax.engine import Engine
    from diffkv_jax.generation import SamplingParams

    cfg, params, prompts = _two_prompts(tiny_model, False, seed=11)
    method = _kernel_method(cfg, False, merge_impl="launch")
    eng = Engine(cfg, params, method, num_pages=2 * method.pages_for_tokens(128) + 64)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=6))
    for _ in range(4):
        eng.step()
    counters = np.asarray(eng.state.merge_counters)
    assert counters.shape == (2 * cfg.num_kv_heads,) and not counters.any()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_token_tiles_serve_the_same_tokens(tiny_model, compiled):
    # kernel_tiles="tokens": the decode launch takes its dots with a page's tokens
    # as the tiles' rows (LaunchConfig.transposed). Only summation order and the
    # padding differ: the same greedy tokens and tier mix, scores close.
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=12)
    queries = _kernel_method(cfg, compiled, kernel_tiles="queries")
    tokens = dataclasses.replace(queries, kernel_tiles="tokens")
    # The default takes token tiles where the kernels run compiled.
    assert dataclasses.replace(queries, kernel_tiles="auto").token_tiles == compiled
    assert not dataclasses.replace(tokens, attention_impl="reference",
                                   kernel_tiles="auto").token_tiles
    runs = _serve_both(cfg, params, prompts, (queries, tokens))
    assert runs[0][2]["frac_low"] > 0
    assert abs(runs[0][2]["frac_low"] - runs[1][2]["frac_low"]) < 0.02
    _assert_scores_agree(runs[1][1], runs[0][1], compiled, 2e-3, 1e-4)
    with pytest.raises(ValueError, match="kernel_tiles"):
        dataclasses.replace(queries, kernel_tiles="columns")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_lane_victims_serve_the_same_tokens(tiny_model, compiled):
    # lane_victims: the policy launch keeps each lane's best victim candidate and
    # reduces the lanes once after its walk. The same victims, so the same state.
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=14)
    steps = _kernel_method(cfg, compiled)
    lanes = dataclasses.replace(steps, lane_victims=True)
    runs = _serve_both(cfg, params, prompts, (steps, lanes))
    assert runs[0][2]["frac_low"] > 0
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    assert make_method("diffkv", cfg, max_seqs=2, max_context=128,
                       lane_victims=True).lane_victims


@pytest.mark.parametrize("rule", ["h2o", "streamingllm"])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_merge_in_the_policy_launch_serves_eviction_baselines_the_same(tiny_model, rule,
                                                                       compiled):
    # The eviction baselines (one K8V8 tier, victims evicted) take the same merge
    # where the kernels run compiled: same greedy tokens, close scores, tokens evicted.
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=9)
    keep = dict(budget=32, window=8) if rule == "h2o" else dict(budget=32)
    xla = make_method(rule, cfg, max_seqs=2, max_context=128, page_size=16 if compiled else 8,
                      attention_impl="pallas", merge_impl="xla", **keep)
    fused = dataclasses.replace(xla, merge_impl="pallas")
    assert fused.merges_in_policy and not xla.merges_in_policy
    runs = [_serve(cfg, params, m, prompts, max_new=30, steps=25) for m in (xla, fused)]
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) > 15
    assert runs[0][2]["frac_pruned"] > 0.3
    # Rounding-level differences in a layer's output can move a later token's 8-bit
    # code by one step, and with it that token's probabilities by ~1e-3 afterwards.
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=2e-3, atol=1e-4)


def _scores_with_and_without(tiny_model, monkeypatch, switch: str, seed: int):
    """Teacher-forced scores of a random head-dim-128 model through the DiffKV kernel
    launches with ``diffkv_kernel_attention.<switch>`` at ``{128: 2}`` and at ``{}``,
    and through the float32 jnp path: ``(with, without, plain)``."""
    import jax

    from diffkv_jax import diffkv_kernel_attention as dka
    from models.llama import init_params

    cfg = dataclasses.replace(tiny_model[0], head_dim=128)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, cfg.vocab_size, size=100)) for _ in range(2)]
    ref = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=16,
                      alpha_high=1.0, alpha_low=0.05, window=8)
    ker = dataclasses.replace(ref, attention_impl="pallas")
    runs = []
    for value in ({128: 2}, {}):
        monkeypatch.setattr(dka, switch, value)
        jax.clear_caches()  # the launch settings are read when the step is traced
        runs.append(score_teacher_forced(cfg, params, ker, docs, 20, progress=False))
    return (*runs, score_teacher_forced(cfg, params, ref, docs, 20, progress=False))


def _assert_decodes_alike(new, one, plain):
    """Likelihoods, greedy tokens and the tier mix of ``new`` stay with ``one``'s, and
    ``new`` is no farther from the float32 path ``plain`` than ``one``."""
    assert np.abs(new.nll - one.nll).max() < 5e-2
    assert np.abs(new.nll - one.nll).mean() < 1e-2
    assert (new.argmax == one.argmax).mean() > 0.98
    for key in ("frac_high", "frac_low", "frac_pruned"):
        assert abs(new.memory[key] - one.memory[key]) < 0.01
    assert (np.abs(new.nll - plain.nll).mean()
            <= 1.5 * np.abs(one.nll - plain.nll).mean() + 1e-3)
    assert new.memory["frac_low"] > 0


@pytest.mark.gpu
def test_page_lanes_decode_like_one_lane_on_gpu(tiny_model, monkeypatch):
    # At head dim 128 the DiffKV launches walk two K8V4 pages per loop step
    # (LaunchConfig.page_lanes, diffkv_kernel_attention.PAGE_LANES): teacher-forced
    # likelihoods, greedy tokens and the tier mix stay with the one-lane launch's.
    # (float16 dots on a random model: the one-lane launch itself is ~0.1 from the
    # float32 jnp path at worst, ~0.02 on average; the lane merge only reorders
    # sums, which moves a later token's 8-bit codes now and then: measured on the
    # H200, max 0.025, mean 0.006 from one lane, tokens and tiers identical.)
    lanes, one, plain = _scores_with_and_without(tiny_model, monkeypatch, "PAGE_LANES", 11)
    assert not np.array_equal(lanes.nll, one.nll)  # the two launches did differ
    _assert_decodes_alike(lanes, one, plain)


@pytest.mark.gpu
def test_two_warps_decode_like_one_warp_on_gpu(tiny_model, monkeypatch):
    # At head dim 128 the DiffKV launches run two warps per program
    # (diffkv_kernel_attention.QUANTIZED_WARPS): the tile's reductions are split
    # between the warps, so sums are reordered as with page lanes; the same bounds.
    two, one, plain = _scores_with_and_without(tiny_model, monkeypatch, "QUANTIZED_WARPS", 12)
    _assert_decodes_alike(two, one, plain)


@pytest.mark.gpu
def test_full_cache_merge_launch_serves_the_same_tokens_on_gpu(tiny_model):
    # The uncompressed cache's work items merged by one launch (the default where the
    # kernels run compiled) against XLA's segment reductions: the same greedy tokens.
    cfg, params, prompts = _two_prompts(tiny_model, True, seed=13)
    xla = make_method("full", cfg, max_seqs=2, max_context=128, page_size=16,
                      attention_impl="pallas", merge_impl="xla")
    launch = dataclasses.replace(xla, merge_impl="auto")
    assert launch.merges_in_launch and not xla.merges_in_launch
    _serve_both(cfg, params, prompts, (xla, launch))
    # ... and merged inside the attention launch (merge_impl="launch").
    _serve_both(cfg, params, prompts, (xla, dataclasses.replace(xla, merge_impl="launch")))


@pytest.mark.gpu
def test_prefill_window_scores_from_cudnn_statistics_serve_the_same_tokens(tiny_model,
                                                                          monkeypatch):
    # A 16-bit model on the GPU kernel path: the prefill's window kernel takes its
    # normalizers from cuDNN's softmax statistics. Withheld (the kernel computes its
    # own), the greedy tokens and the cache's scores are the same.
    import jax

    from diffkv_jax import attention
    from models.llama import init_params

    cfg, _, prompts = _two_prompts(tiny_model, True, seed=9)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16)
    real = attention.prefill_attention_lse
    calls = {"given": 0, "withheld": 0}

    def counted(q, k, v, lengths):
        out, lse = real(q, k, v, lengths)
        calls["given"] += lse is not None
        return out, lse

    def withheld(q, k, v, lengths):
        calls["withheld"] += 1
        return attention.prefill_attention(q, k, v, lengths), None

    method = make_method("diffkv", cfg, max_seqs=2, max_context=128, page_size=16, window=8,
                         attention_impl="pallas", alpha_high=1.0, alpha_low=0.05)
    assert method.window_kernel
    runs = []
    for fn in (counted, withheld):
        monkeypatch.setattr(attention, "prefill_attention_lse", fn)
        runs.append(_serve(cfg, params, dataclasses.replace(method), prompts, max_new=40,
                           steps=30, dtype=jnp.bfloat16))
    assert calls["given"] > 0 and calls["withheld"] > 0
    assert runs[0][0] == runs[1][0] and len(runs[0][0][0]) > 20
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_early_row_loads_serve_the_same_tokens_and_scores(tiny_model, compiled,
                                                         monkeypatch):
    # early_row_loads changes when the decode launch reads its rows' counts and first
    # table entries, not what it computes: the same tokens and the same scores.
    from diffkv_jax import diffkv_kernel_attention as dka
    from pallas_kernels import paged_decode as pdk

    launched, launch = [], pdk.paged_decode_partials  # each decode launch's setting

    def recording(*args, cfg, **kw):
        launched.append(cfg.early_row_loads)
        return launch(*args, cfg=cfg, **kw)

    monkeypatch.setattr(dka.pdk, "paged_decode_partials", recording)
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=12)
    plain = _kernel_method(cfg, compiled)
    early = _kernel_method(cfg, compiled, early_row_loads=True)
    assert early.early_row_loads and not plain.early_row_loads
    runs = _serve_both(cfg, params, prompts, (plain, early))
    assert False in launched and True in launched
    assert runs[0][2]["frac_low"] > 0
    np.testing.assert_array_equal(runs[1][1], runs[0][1])


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
@pytest.mark.parametrize("merge", ["xla", "launch"])
def test_full_cache_early_row_loads_serve_the_same_tokens(tiny_model, compiled, merge,
                                                          monkeypatch):
    # The uncompressed cache's launches take the setting too (the launch of partials,
    # and the one that merges its own rows): the same greedy tokens.
    from diffkv_jax import diffkv_kernel_attention as dka
    from pallas_kernels import paged_decode as pdk

    launched = []
    for name in ("paged_decode_partials", "paged_decode_merged"):
        def recording(*args, cfg, _launch=getattr(pdk, name), **kw):
            launched.append(cfg.early_row_loads)
            return _launch(*args, cfg=cfg, **kw)

        monkeypatch.setattr(dka.pdk, name, recording)
    cfg, params, prompts = _two_prompts(tiny_model, compiled, seed=14)
    plain = make_method("full", cfg, max_seqs=2, max_context=128, page_size=16,
                        attention_impl="pallas", merge_impl=merge)
    early = make_method("full", cfg, max_seqs=2, max_context=128, page_size=16,
                        attention_impl="pallas", merge_impl=merge, early_row_loads=True)
    assert early.early_row_loads and not plain.early_row_loads
    _serve_both(cfg, params, prompts, (plain, early))
    assert False in launched and True in launched
