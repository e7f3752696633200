"""The policy's score accumulation and victim search kernel against its jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk
from pallas_kernels.policy_scores import VictimRule, score_victims, score_victims_reference


def case(rng, caps=(8, 16), S=3, H=2, W=(3, 2), G=3, P=30, slots=16):
    """Random logits, merged statistics, pages (disjoint per row), scores and positions."""
    perm = rng.permutation(P)
    pages, n_tok, logits, probs = [], [], [], []
    M = jnp.asarray(rng.normal(size=(S, H, G)) + 2.0, jnp.float32)
    L = jnp.asarray(rng.uniform(5, 50, size=(S, H, G)), jnp.float32)
    used = 0
    for cap, w in zip(caps, W):
        ids = perm[used:used + S * H * w].reshape(S, H, w)
        used += S * H * w
        pages.append(jnp.asarray(ids, jnp.int32))
        n = rng.integers(0, w * cap + 1, size=(S, H))
        n[0, 0] = 0
        n[-1, -1] = w * cap
        n_tok.append(jnp.asarray(n, jnp.int32))
        lg = jnp.asarray(rng.normal(size=(S, H, G, w * cap)) * 2, jnp.float32)
        logits.append(lg)
        probs.append(pdk.group_max_probabilities(lg, M, L, G))
    scores = jnp.asarray(rng.uniform(0, 3, size=(P, slots)), jnp.float32)
    # Positions: each row's tokens get distinct positions below cur.
    positions = jnp.asarray(rng.permutation(P * slots).reshape(P, slots) % 500, jnp.int32)
    cur = jnp.asarray(rng.integers(500, 600, size=S), jnp.int32)
    plen = jnp.asarray(rng.integers(100, 400, size=S), jnp.int32)
    return logits, probs, M, L, pages, n_tok, cur, plen, scores, positions


def kernel_and_reference(rng, rule, caps, interpret, splits=None, block=512,
                         lane_victims=False, **case_args):
    """The kernel's and the reference's ``(scores, victims)`` on one random case (one
    tier for the eviction rules, which keep one), and the scores before."""
    logits, probs, M, L, pages, n_tok, cur, plen, scores, positions = case(rng, caps, **case_args)
    if rule.rule != "diffkv":
        logits, probs, pages, n_tok, caps = logits[:1], probs[:1], pages[:1], n_tok[:1], caps[:1]
    got = score_victims(logits, M, L, pages, n_tok, cur, plen, scores, positions, caps=caps,
                        group=3, rule=rule, interpret=interpret, splits=splits, block=block,
                        lane_victims=lane_victims)
    ref = score_victims_reference(probs, pages, n_tok, cur, plen, scores, positions, caps=caps,
                                  rule=rule)
    return got, ref, scores


@pytest.mark.parametrize("rule", [VictimRule("diffkv", window=100),
                                  VictimRule("diffkv", window=8, obs_window=None),
                                  VictimRule("h2o", window=50), VictimRule("streamingllm", sinks=40),
                                  VictimRule("snapkv")])
@pytest.mark.parametrize("splits,block", [(1, 512), (3, 16), (1, 16)])
@pytest.mark.parametrize("lanes", [False, True], ids=["per-step", "lane-victims"])
def test_kernel_matches_reference(rule, splits, block, lanes):
    # splits x block: one program per row walking it at once, three programs per row
    # walking 16 tokens per step (their victims merged after the launch), or one
    # walking 16 per step (two steps per tier). lanes: the victim search reduced
    # across the block's lanes in every step, or each lane keeping its own best
    # and one reduction after the loop.
    rng = np.random.default_rng(hash(rule.rule) % 1000 + rule.window + splits)
    (got_s, got_v), (ref_s, ref_v), scores = kernel_and_reference(
        rng, rule, (8, 16), True, splits=splits, block=block, lane_victims=lanes)
    np.testing.assert_allclose(got_s, ref_s, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(np.asarray(got_s), np.asarray(scores))  # something was added
    for g, r in zip(got_v, ref_v):
        np.testing.assert_array_equal(g[0], r[0])  # victim slots
        found = np.asarray(r[0]) >= 0
        np.testing.assert_array_equal(np.asarray(g[2])[found], np.asarray(r[2])[found])
        np.testing.assert_allclose(np.asarray(g[3])[found], np.asarray(r[3])[found], rtol=1e-6)
        if rule.rule == "diffkv":
            np.testing.assert_allclose(np.asarray(g[1])[found], np.asarray(r[1])[found],
                                       rtol=1e-6)
    if rule.rule == "snapkv":
        assert (np.asarray(got_v[0][0]) == -1).all()
    else:
        assert (np.asarray(got_v[0][0]) >= 0).any()


def test_inactive_rows_and_foreign_pages_are_untouched():
    rng = np.random.default_rng(5)
    logits, probs, M, L, pages, n_tok, cur, plen, scores, positions = case(rng)
    n_tok = [n.at[1].set(0) for n in n_tok]  # sequence 1 inactive
    got, victims = score_victims(logits, M, L, pages, n_tok, cur, plen, scores, positions,
                                 caps=(8, 16), group=3, interpret=True)
    touched = np.asarray(got) != np.asarray(scores)
    owned = set()
    for pg, nt, cap in zip(pages, n_tok, (8, 16)):
        for s in range(3):
            for h in range(2):
                owned |= set(np.asarray(pg[s, h, :-(-int(nt[s, h]) // cap)]).tolist())
    assert set(np.flatnonzero(touched.any(1)).tolist()) <= owned
    for v in victims:
        assert (np.asarray(v[0])[1] == -1).all()


def no_page_past_rows(pages, n_tok, caps, P):
    """The engine's page tables: columns past a row's pages name no page (``P``, the
    entry past the pool), as after admission."""
    out = []
    for pg, nt, cap in zip(pages, n_tok, caps):
        own = jnp.arange(pg.shape[-1])[None, None, :] < (-(-nt // cap))[..., None]
        out.append(jnp.where(own, pg, P))
    return out


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)],
                         ids=["here", "gpu"])
def test_columns_naming_no_page_give_the_same_scores_and_victims(interpret):
    # A row's last step of ``block`` tokens covers columns past its pages, which in
    # the engine name no page (the entry past the pool): the launch must neither
    # read nor write the pool there (on the GPU such a read lands past the end of
    # the scores and positions arrays; interpret mode clamps it, so here the test
    # checks the results only) and find what it finds with the stale IDs.
    caps = (32, 64) if not interpret else (8, 16)
    shape = dict(W=(3, 2), P=40, slots=64) if not interpret else {}
    rng = np.random.default_rng(31)
    logits, probs, M, L, pages, n_tok, cur, plen, scores, positions = case(rng, caps, **shape)
    P = scores.shape[0]
    rule = VictimRule("diffkv", window=100)
    kw = dict(caps=caps, group=3, rule=rule, interpret=interpret)
    stale = score_victims(logits, M, L, pages, n_tok, cur, plen, scores, positions, **kw)
    none = score_victims(logits, M, L, no_page_past_rows(pages, n_tok, caps, P), n_tok, cur,
                         plen, scores, positions, **kw)
    ref_s, ref_v = score_victims_reference(probs, pages, n_tok, cur, plen, scores, positions,
                                           caps=caps, rule=rule)
    np.testing.assert_array_equal(none[0], stale[0])
    np.testing.assert_allclose(none[0], ref_s, rtol=1e-5, atol=1e-6)
    for a, b, r in zip(none[1], stale[1], ref_v):
        np.testing.assert_array_equal(a[0], b[0])
        if interpret:
            np.testing.assert_array_equal(a[0], r[0])


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [VictimRule("diffkv", window=100), VictimRule("h2o", window=50),
                                  VictimRule("streamingllm", sinks=40)])
@pytest.mark.parametrize("block", [512, 32])
@pytest.mark.parametrize("lanes", [False, True], ids=["per-step", "lane-victims"])
def test_compiled_kernel_matches_reference_on_gpu(rule, block, lanes):
    rng = np.random.default_rng(11)
    (got_s, got_v), (ref_s, ref_v), _ = kernel_and_reference(rng, rule, (32, 64), False,
                                                             block=block, W=(3, 2), P=40,
                                                             slots=64, lane_victims=lanes)
    # exp2 on the GPU is approximate (a few ulps): scores within 1e-5, victims equal
    # unless two keys are that close.
    np.testing.assert_allclose(got_s, ref_s, rtol=1e-5, atol=1e-6)
    for g, r in zip(got_v, ref_v):
        assert (np.asarray(g[0]) == np.asarray(r[0])).mean() > 0.9


def merge_case(rng, S=3, H=2, G=3, D=32, N=20):
    """Random attention partials over a planned work list, and the token being decoded."""
    pages = jnp.asarray(rng.integers(0, 7, size=(S, H)), jnp.int32).at[0, 1].set(0)
    work = pdk.plan_work(pages, N)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    o, m = f(N, G, D), f(N, G) * 3
    l = jnp.asarray(rng.uniform(0.5, 20, size=(N, G)), jnp.float32)
    q, k_new, v_new = f(S, H, G, D), f(S, H, D), f(S, H, D)
    return work, o, m, l, q, k_new, v_new


def merged_reference(work, o, m, l, q, k_new, v_new):
    S, H, G, D = q.shape
    s_new = jnp.einsum("shgd,shd->shg", q, k_new) / np.sqrt(D)
    v_ext = jnp.broadcast_to(v_new[:, :, None], (S, H, G, D))
    out, M, L = pdk.merge_work(o, m, l, work, S, H, (v_ext, s_new, jnp.ones_like(s_new)))
    return out, M, L, jnp.max(jnp.exp(s_new - M) / L, axis=-1)


def fused_and_reference(rng, interpret, caps=(8, 16), splits=None, q_dtype=jnp.float32,
                        **case_args):
    from pallas_kernels.policy_scores import RowPartials

    logits, _, _, _, pages, n_tok, cur, plen, scores, positions = case(rng, caps, **case_args)
    work, o, m, l, q, k_new, v_new = merge_case(rng)
    q = q.astype(q_dtype)
    ref_merged = merged_reference(work, o, m, l, q.astype(jnp.float32), k_new, v_new)
    ref = score_victims(logits, ref_merged[1], ref_merged[2], pages, n_tok, cur, plen, scores,
                        positions, caps=caps, group=3, interpret=interpret)
    parts = RowPartials(o, m, l, work.ranges.reshape(3, 2, 2), q, k_new, v_new)
    got = score_victims(logits, None, None, pages, n_tok, cur, plen, scores, positions,
                        caps=caps, group=3, interpret=interpret, partials=parts, splits=splits)
    return got, (*ref, ref_merged)


def check_fused(got, ref, rtol):
    (got_s, got_v, got_m), (ref_s, ref_v, ref_m) = got, ref
    for g, r in zip(got_m, ref_m):  # out, M, L, p_new
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(got_s, ref_s, rtol=rtol, atol=rtol)
    for g, r in zip(got_v, ref_v):
        np.testing.assert_array_equal(g[0], r[0])


def test_merge_inside_the_policy_launch_matches_the_xla_merge():
    # The launch merges each row's work items (online, item by item) and the token
    # being decoded; the XLA merge takes the global max first: equal up to rounding.
    rng = np.random.default_rng(21)
    got, ref = fused_and_reference(rng, True)
    check_fused(got, ref, 2e-5)
    assert float(jnp.min(got[2][2])) > 0  # every row has the newcomer at least
    with pytest.raises(ValueError, match="partials"):
        from pallas_kernels.policy_scores import RowPartials

        work, o, m, l, q, k, v = merge_case(rng)
        logits, _, M, L, pages, n_tok, cur, plen, scores, positions = case(rng)
        score_victims(logits, M, L, pages, n_tok, cur, plen, scores, positions, caps=(8, 16),
                      group=3, interpret=True,
                      partials=RowPartials(o, m, l, work.ranges.reshape(3, 2, 2), q, k, v))


def test_merge_inside_the_policy_launch_writes_the_output_in_the_query_dtype():
    # A bfloat16 model reads the attention output as bfloat16 next: the launch writes
    # it so (computed in float32, rounded once), with no conversion launch after it.
    got, ref = fused_and_reference(np.random.default_rng(23), True, q_dtype=jnp.bfloat16)
    out, ref_out = got[2][0], ref[2][0]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, ref_out.astype(jnp.bfloat16))
    check_fused((got[0], got[1], got[2][1:]), (ref[0], ref[1], ref[2][1:]), 2e-5)


def test_merge_inside_the_policy_launch_with_several_splits_per_row():
    # Every split of a row takes M and L for its probabilities; the first alone
    # merges and stores the output: the same results with 3 splits as with 1.
    rng = np.random.default_rng(24)
    got, ref = fused_and_reference(rng, True, splits=3)
    check_fused(got, ref, 2e-5)
    one, _ = fused_and_reference(np.random.default_rng(24), True, splits=1)
    np.testing.assert_allclose(np.asarray(got[2][0]), np.asarray(one[2][0]), rtol=1e-6)


@pytest.mark.gpu
def test_compiled_merge_inside_the_policy_launch_matches_on_gpu():
    rng = np.random.default_rng(22)
    got, ref = fused_and_reference(rng, False, caps=(32, 64), W=(3, 2), P=40, slots=64)
    check_fused(got, ref, 1e-4)


@pytest.mark.parametrize("lanes", [False, True], ids=["per-step", "lane-victims"])
@pytest.mark.parametrize("fused", [False, True], ids=["scores", "scores+merge"])
def test_launch_lowers_to_triton_for_cuda(fused, lanes):
    # The GPU code path (masked stores, gathers by row index, dynamic loops) goes
    # through Pallas' Triton lowering on any machine: a lowering error shows here
    # before a GPU run.
    import jax

    from pallas_kernels.policy_scores import RowPartials

    rng = np.random.default_rng(23)
    logits, _, M, L, pages, n_tok, cur, plen, scores, positions = case(
        rng, (32, 64), W=(3, 2), P=40, slots=64)
    parts = None
    if fused:
        work, o, m, l, q, k, v = merge_case(rng, D=64)
        parts = RowPartials(o, m, l, work.ranges.reshape(3, 2, 2), q, k.astype(jnp.bfloat16),
                            v.astype(jnp.bfloat16))
        M = L = None

    def launch(lg, sc):
        return score_victims(lg, M, L, pages, n_tok, cur, plen, sc, positions, caps=(32, 64),
                             group=3, interpret=False, partials=parts, lane_victims=lanes)

    text = jax.jit(launch).trace(logits, scores).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("policy_scores") >= 1 and "triton" in text
