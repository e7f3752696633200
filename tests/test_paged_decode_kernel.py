"""The Pallas paged decode kernel against its plain-jnp reference.

Random codes, metadata, page tables and ragged lengths (empty rows included),
every tier format, one or two tiers per launch, 1 - 4 even splits or balanced
work lists (inactive rows skipped): in interpret
mode on the CPU and, marked ``gpu``, compiled on the GPU.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import quantization as qz
from pallas_kernels import code_convert
from pallas_kernels import paged_decode as pdk


def make_tier(rng, fmt: pdk.TierFormat, P: int, S: int, H: int, NP: int):
    """Random pages of one tier, its kernel operands and the dequantized tokens of
    every row in slot order (``[S, H, NP * slots, D]``)."""
    D, cap = fmt.head_dim, fmt.slots
    pages = jnp.asarray(rng.integers(0, P, size=(S, H, NP)), jnp.int32)
    n_tok = jnp.asarray(rng.integers(0, NP * cap + 1, size=(S, H)), jnp.int32)
    n_tok = n_tok.at[0, 0].set(0).at[-1, -1].set(NP * cap)  # an empty and a full row
    if not fmt.quantized:
        k = jnp.asarray(rng.normal(size=(P, cap, D)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(P, cap, D)), jnp.float32)
        tier = pdk.TierInput(fmt, k, v, None, pages, n_tok)
        return tier, k[pages].reshape(S, H, NP * cap, D), v[pages].reshape(S, H, NP * cap, D)
    kw, vw = fmt.key_width, fmt.value_width
    data = jnp.asarray(rng.integers(0, 256, size=(P, fmt.data_bytes)), jnp.uint8)
    M = cap + 3  # metadata arrays may be wider than this tier's slots
    f16 = lambda a: jnp.asarray(a, jnp.float16)  # noqa: E731
    ks, kz = f16(rng.uniform(0.01, 0.1, (P, M))), f16(rng.normal(size=(P, M)))
    vs, vz = f16(rng.uniform(0.01, 0.1, (P, M))), f16(rng.normal(size=(P, M)))
    keys = data[:, :cap * kw].reshape(P, cap, kw)
    values = data[:, cap * kw:].reshape(P, vw, cap).transpose(0, 2, 1)  # byte-dim-major
    k_hat = qz.dequantize_packed(keys, ks[:, :cap], kz[:, :cap], fmt.k_bits, D)
    v_hat = qz.dequantize_packed(values, vs[:, :cap], vz[:, :cap], fmt.v_bits, D)
    kv, vv = pdk.page_views(data, fmt)
    tier = pdk.TierInput(fmt, kv, vv, (pdk.pack_meta(ks, kz), pdk.pack_meta(vs, vz)), pages,
                         n_tok)
    return (tier, k_hat[pages].reshape(S, H, NP * cap, D),
            v_hat[pages].reshape(S, H, NP * cap, D))


# (k_bits, v_bits, tokens per page); the GPU kernel needs pages of >= 16 tokens.
TIER_SETS = {
    "k8v4": [(8, 4, 16)],
    "k8v4+k4v2": [(8, 4, 16), (4, 2, 32)],  # DiffKV's unified pages (same bytes per page)
    "k8v4+k4v2 wide": [(8, 4, 32), (4, 2, 64)],  # the same at head dim 128's 6 KB pages
    "k8v8": [(8, 8, 16)],
    "k2v2": [(2, 2, 16)],
    "k4v4": [(4, 4, 32)],
    "16bit": [(16, 16, 16)],
}


def random_partials(tier_set, cfg, G=4, D=128, pad=8, seed=0):
    """The leaves of :func:`pdk.paged_decode_partials` (interpret mode) over random
    pages of ``tier_set`` (3 x 2 rows of up to 3 pages per tier) and a random query
    group padded to ``pad`` rows."""
    rng = np.random.default_rng(seed)
    S, H, P, NP = 3, 2, 24, 3
    tiers = [make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)[0]
             for kb, vb, cap in TIER_SETS[tier_set]]
    q = pdk.pad_group(jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32), pad)
    return jax.tree.leaves(pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg,
                                                     interpret=True))


def check_kernel(tier_set, D, G, splits, *, interpret, dot_dtype, tol, lazy=True, pad=None,
                 seed=0, work_items=None, sub_slots=0, page_lanes=1, rows_in_kernel=False,
                 transposed=False, tier_weights=(), lane_slots=32, logits_dtype=None,
                 min_pages=2, snap=0.0, gap=0, ref_query=None, **launch):
    """``logits_dtype``: the stored logits' type (None: that of the dots, so the
    float32 checks compare float32 logits). ``work_items``: launch over
    :func:`pdk.plan_work` items (rows 1 and 4 inactive) instead of ``splits`` even
    splits per row. ``rows_in_kernel``: q keeps its ``G``
    rows and the kernel pads them to ``pad`` itself (``padded_rows``).
    ``tier_weights``: work units per page of each tier, in the plan and the launch;
    ``min_pages``: the plan's least units per item; ``snap``: the plan's cuts moved
    onto the rows' tier boundaries within that share of an item; ``gap``: units the
    item across a row's tier boundary holds fewer (``plan_work(gap=)``); ``ref_query``:
    the query the reference takes, from the launch's (None: the same); ``launch``: more
    :class:`pdk.LaunchConfig` fields."""
    rng = np.random.default_rng(seed)
    S, H, P, NP = (3, 2, 24, 3) if work_items is None else (5, 2, 40, 5)
    tiers, refs = [], []
    for kb, vb, cap in TIER_SETS[tier_set]:
        tier, kh, vh = make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)
        tiers.append(tier)
        refs.append((kh, vh, tier.n_tok))
    q = jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32)
    cfg = pdk.LaunchConfig(num_splits=splits, dot_dtype=dot_dtype, lazy_rescale=lazy,
                           sub_slots=sub_slots, page_lanes=page_lanes, transposed=transposed,
                           tier_weights=tier_weights, lane_slots=lane_slots,
                           logits_dtype=logits_dtype or dot_dtype, **launch)
    qk = q if pad is None or rows_in_kernel else pdk.pad_group(q, pad)
    padded_rows = pdk.padded_group(G, pad) if rows_in_kernel else None
    active = np.ones(S, bool)
    work = None
    if work_items is not None:
        active[[1, 4]] = False
        work = pdk.plan_work(pdk.row_pages(tiers, jnp.asarray(active), tier_weights),
                             work_items, min_pages=min_pages,
                             bounds=pdk.tier_bounds(tiers, tier_weights), snap=snap,
                             max_weight=max(tier_weights, default=1), gap=gap)
    o, m, l, logits = pdk.paged_decode_partials(qk, tiers, group=G, cfg=cfg, work=work,
                                                interpret=interpret, padded_rows=padded_rows)
    assert o.shape[-2] == G and m.shape[-1] == G and l.shape[-1] == G
    q_ref = q if ref_query is None else ref_query(q)
    ref = [pdk.tier_attention_reference(q_ref, kh, vh, nt) for kh, vh, nt in refs]
    # An extra always-present source (like the token being decoded) keeps rows defined.
    extra = (jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32),
             jnp.asarray(rng.normal(size=(S, H, G)), jnp.float32), jnp.ones((S, H, G)))
    if work is None:
        out, M, L = pdk.merge_partials([(o, m, l)], extra)
    else:
        out, M, L = pdk.merge_work(o, m, l, work, S, H, extra)
    rout, rM, rL = pdk.merge_partials([r[:3] for r in ref], extra)
    out, M, L, rout, rM, rL = (np.asarray(x)[active] for x in (out, M, L, rout, rM, rL))
    assert np.isfinite(out).all()
    scale = float(np.abs(rout).max())
    assert np.abs(out - rout).max() <= tol * scale
    for lg, r, (_, _, nt) in zip(logits, ref, refs):
        assert lg.shape[2] == G
        lg, r3 = np.asarray(lg)[active], np.asarray(r[3])[active]
        valid = np.arange(lg.shape[-1])[None, None, :] < np.asarray(nt)[active][..., None]
        p = pdk.group_max_probabilities(lg, M, L, G)
        rp = pdk.group_max_probabilities(r3, rM, rL, G)
        err = np.abs(np.where(valid, p, 0) - np.where(valid, rp, 0)).max()
        assert err <= tol * 10 * float(np.asarray(rp).max())


@pytest.mark.parametrize("tier_set", list(TIER_SETS))
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2), (64, 8, 4)])
def test_kernel_matches_reference(tier_set, D, G, splits):
    # float32 throughout: only summation order differs (tolerance 1e-4 relative).
    check_kernel(tier_set, D, G, splits, interpret=True, dot_dtype="float32", tol=1e-4,
                 lazy=splits != 4)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v8", "k2v2", "k4v4"])
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2)])
def test_magic_code_conversion_matches_reference(tier_set, D, G, splits):
    # float16 dots take the magic path (codes as float16 1024 + c, q and p * scale
    # rounded to float16): relative errors around 1e-3 of the output scale.
    check_kernel(tier_set, D, G, splits, interpret=True, dot_dtype="float16", tol=3e-3)


def check_float16_logits(*, interpret, dot_dtype, transposed, lanes, seed):
    """The same launch storing its logits as float16 and as float32: the outputs are
    identical (the cast touches only what is stored) and every valid logit, and the
    group-max probability the policy takes from it, is within float16's rounding:
    ``|s16 - s32| <= |s32| 2^-11`` (plus 2^-25 below float16's normal range) and
    ``|p16 - p32| <= p32 (2^(max_g |s| 2^-11) - 1)`` (1% slack for float32's own)."""
    rng = np.random.default_rng(seed)
    S, H, P, NP, D, G = 3, 2, 24, 3, 128, 4
    tiers = [make_tier(rng, pdk.TierFormat(kb, vb, D, cap), P, S, H, NP)[0]
             for kb, vb, cap in TIER_SETS["k8v4+k4v2 wide"]]
    # Large logits (|s| up to ~100 in log2 units) to stress the 11 bits.
    q = jnp.asarray(rng.normal(size=(S, H, G, D)) * 8, jnp.float32)
    qk = pdk.pad_group(q, 8 if transposed else 16)
    runs = {}
    for dt in ("float16", "float32"):
        cfg = pdk.LaunchConfig(num_splits=2, dot_dtype=dot_dtype, transposed=transposed,
                               page_lanes=lanes, logits_dtype=dt)
        runs[dt] = pdk.paged_decode_partials(qk, tiers, group=G, cfg=cfg, interpret=interpret)
    (o16, m16, l16, lg16), (o32, m32, l32, lg32) = runs["float16"], runs["float32"]
    for a, b in ((o16, o32), (m16, m32), (l16, l32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # One more source (as the token being decoded) keeps empty rows defined.
    extra = (jnp.zeros((S, H, G, D)), jnp.asarray(rng.normal(size=(S, H, G)), jnp.float32),
             jnp.ones((S, H, G)))
    _, M, L = pdk.merge_partials([(o32, m32, l32)], extra)
    largest = 0.0
    for t, a, b in zip(tiers, lg16, lg32):
        assert a.dtype == jnp.float16 and b.dtype == jnp.float32
        valid = np.arange(a.shape[-1])[None, None, None, :] < np.asarray(t.n_tok)[..., None, None]
        # Slots past a row's tokens hold garbage (-inf in float16): zeroed.
        a32 = np.where(valid, np.asarray(a, np.float32), 0)
        b = np.where(valid, np.asarray(b), 0)
        assert np.all(np.abs(a32 - b) <= np.abs(b) * 2.0**-11 + 2.0**-25)
        p16 = np.asarray(pdk.group_max_probabilities(jnp.asarray(a32, jnp.float16), M, L, G))
        p32 = np.asarray(pdk.group_max_probabilities(b, M, L, G))
        bound = p32 * (2.0 ** (np.abs(b).max(axis=2) * 2.0**-11 + 2.0**-25) - 1) * 1.01
        assert np.all(np.abs(p16 - p32) <= bound + 1e-30)
        largest = max(largest, float(np.abs(b).max()))
    assert largest > 16  # the check covered logits where float16 rounds coarsely


@pytest.mark.parametrize("transposed,lanes", [(False, 1), (True, 2)])
def test_float16_logits_round_only_what_is_stored(transposed, lanes):
    check_float16_logits(interpret=True, dot_dtype="float32", transposed=transposed,
                         lanes=lanes, seed=5 + lanes)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed,lanes", [(False, 1), (True, 2), (False, 4)])
def test_compiled_float16_logits_round_only_what_is_stored_on_gpu(transposed, lanes):
    check_float16_logits(interpret=False, dot_dtype="float16", transposed=transposed,
                         lanes=lanes, seed=9 + lanes)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "16bit"])
@pytest.mark.parametrize("work_items", [11, 16, 64])
def test_work_list_launch_matches_reference(tier_set, work_items):
    # Balanced items over ragged rows (one to many items per row, inactive rows
    # skipped), merged per row.
    check_kernel(tier_set, 64, 3, 1, interpret=True, dot_dtype="float32", tol=1e-4,
                 work_items=work_items, seed=work_items)


@pytest.mark.parametrize("seed", range(6))
def test_plan_work_covers_every_page_once_in_balanced_items(seed):
    rng = np.random.default_rng(seed)
    S, H = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    caps = [16, 32]
    n_tok = [jnp.asarray(rng.integers(0, 300, size=(S, H)), jnp.int32) for _ in caps]
    if seed == 0:  # one long row among empty ones
        n_tok = [n.at[:].set(0).at[0, 0].set(299) for n in n_tok]
    tiers = [pdk.TierInput(pdk.TierFormat(8, 4, 64, c), None, None, None, None, n)
             for c, n in zip(caps, n_tok)]
    active = jnp.asarray(rng.random(S) < 0.7)
    N = S * H + int(rng.integers(1, 50))
    work = pdk.plan_work(pdk.row_pages(tiers, active), N, min_pages=2)
    items, seg = np.asarray(work.items), np.asarray(work.seg)
    pages = sum(-(-np.asarray(n) // c) for n, c in zip(n_tok, caps))
    pages = np.where(np.asarray(active)[:, None], pages, 0)
    assert work.size == N and np.all(np.diff(seg) >= 0)
    longest = 0
    for s in range(S):
        for h in range(H):
            mine = items[seg == s * H + h]
            assert np.all(mine[:, :2] == [s, h])
            covered = np.zeros(pages[s, h], int)
            for _, _, b, e in mine:
                assert b < e
                covered[b:e] += 1
                longest = max(longest, e - b)
            assert np.all(covered == 1)
    unused = items[seg == S * H]
    assert np.all(unused[:, 2] == unused[:, 3])
    # Items are no longer than the balanced share (or min_pages).
    rows = int((pages > 0).sum())
    assert longest <= max(-(-int(pages.sum()) // max(N - rows, 1)), 2)
    with pytest.raises(ValueError, match="more items than rows"):
        pdk.plan_work(pdk.row_pages(tiers), S * H)


@pytest.mark.parametrize("width", [4, 1024])
def test_smallest_fitting_count_matches_a_linear_search(width, monkeypatch):
    """The grid search against trying every count, with a narrow grid too (4 wide,
    2 levels: exact where its bounds are less than 16 counts apart, a fitting
    count past that)."""
    monkeypatch.setattr(pdk, "SEARCH_WIDTH", width)
    rng = np.random.default_rng(width)
    for trial in range(25):
        n = int(rng.integers(1, 40))
        top = int(rng.choice([5, 60, 3000, 200000, 2_000_000]))
        flat = rng.integers(0, top, size=n)
        target = int(rng.integers(1, 3 * n + 5))
        min_pages = int(rng.integers(1, 4))
        got = int(pdk.smallest_fitting_count(jnp.asarray(flat, jnp.int32), target, min_pages))
        count = lambda c: int(np.sum(-(-flat // c)))  # noqa: E731
        hi = max(int(flat.max()), min_pages)
        fitting = [c for c in range(min_pages, hi + 1) if count(c) <= target]
        if not fitting:  # not even one item per row fits
            assert got == hi
        elif hi - min_pages < width ** pdk.SEARCH_LEVELS:
            assert got == fitting[0], (flat, target, min_pages)
        else:
            assert min_pages <= got <= hi and count(got) <= target


@pytest.mark.parametrize("seed", range(6))
def test_plan_work_in_one_wave_takes_the_smallest_count_that_fits(seed):
    rng = np.random.default_rng(100 + seed)
    S, H = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    pages = rng.integers(0, 400, size=(S, H))
    if seed == 0:
        pages[:] = 64  # equal rows: the wave filled exactly
    pages[rng.random((S, H)) < 0.2] = 0
    rows = int((pages > 0).sum())
    wave = rows + int(rng.integers(0, 60)) if seed != 5 else max(rows - 1, 1)
    N = S * H + 80
    work = pdk.plan_work(jnp.asarray(pages, jnp.int32), N, min_pages=2, wave=wave)
    items, seg = np.asarray(work.items), np.asarray(work.seg)
    used = seg < S * H
    for r in range(S * H):  # every page of every row once, in order
        mine = items[seg == r]
        covered = np.zeros(pages.reshape(-1)[r], int)
        for _, _, b, e in mine:
            covered[b:e] += 1
        assert np.all(covered == 1)
    longest = int((items[used, 3] - items[used, 2]).max(initial=0))
    count = lambda c: int(np.sum(-(-pages // c)))  # noqa: E731
    if rows <= wave:
        assert used.sum() <= wave
        # The smallest count that fits: one page fewer per item overflows the wave.
        C = max(longest, 2)
        assert count(C) <= wave and (C == 2 or count(C - 1) > wave)
    else:  # the rows alone exceed the wave: the plan without it
        plain = pdk.plan_work(jnp.asarray(pages, jnp.int32), N, min_pages=2)
        assert np.array_equal(items, np.asarray(plain.items))
    if seed == 0:
        assert used.sum() == count(longest) <= wave
        # As the DiffKV step plans every layer at once: vmapped, the same items.
        import jax

        layers = jnp.stack([jnp.asarray(pages, jnp.int32), jnp.asarray(pages // 3, jnp.int32)])
        both = jax.vmap(lambda p: pdk.plan_work(p, N, wave=wave).items)(layers)
        assert np.array_equal(np.asarray(both[0]), items)
        one = pdk.plan_work(layers[1], N, wave=wave).items
        assert np.array_equal(np.asarray(both[1]), np.asarray(one))


@pytest.mark.parametrize("tier_set,sub", [("k8v4+k4v2", 16), ("k8v4+k4v2 wide", 16),
                                          ("k8v4+k4v2 wide", 32), ("k4v4", 16)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_pages_walked_in_parts_match_reference(tier_set, sub, work_items):
    # LaunchConfig.sub_slots: each loop step covers part of a quantized page
    # (whole pages when the page has no more slots than that).
    check_kernel(tier_set, 64, 3, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 sub_slots=sub, work_items=work_items, seed=sub)
    check_kernel(tier_set, 64, 3, 1, interpret=True, dot_dtype="float16", tol=3e-3,
                 sub_slots=sub, seed=sub + 1)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v4+k4v2 wide", "k2v2"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 4), (128, 4, 2), (64, 8, 2), (64, 1, 4)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_page_lanes_match_reference(tier_set, D, G, lanes, work_items):
    # LaunchConfig.page_lanes: the 16 padded query rows hold the group once per lane,
    # each lane over its own pages, merged exactly at the end of the program; items
    # whose pages do not fill the last step leave lanes idle; the wide set's 64-slot
    # tier is walked by lane 0's rows alone (LaunchConfig.lane_slots).
    splits = 1 if work_items else 2
    check_kernel(tier_set, D, G, splits, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=16, page_lanes=lanes, work_items=work_items, seed=lanes + G)
    if work_items is None:  # the float16 magic-code path, rescaling on every page
        check_kernel(tier_set, D, G, splits, interpret=True, dot_dtype="float16", tol=3e-3,
                     pad=16, page_lanes=lanes, seed=lanes + G + 1, lazy=False)


def test_page_lanes_on_k8v8_pages_match_reference():
    # The eviction baselines' K8V8 pages take the lanes too (head dim 128 on the GPU).
    check_kernel("k8v8", 128, 4, 1, interpret=True, dot_dtype="float32", tol=1e-4, pad=16,
                 page_lanes=2, work_items=16, seed=9)


def test_page_lanes_fit_the_padded_rows():
    cfg = pdk.LaunchConfig(page_lanes=4)
    assert [cfg.lanes(16, g) for g in (1, 3, 4, 5, 8, 16)] == [4, 4, 4, 2, 2, 1]
    assert pdk.LaunchConfig(page_lanes=8).lanes(16, 1) == 8
    assert cfg.lanes(4, 4) == 1 and cfg.lanes(6, 3) == 2
    with pytest.raises(ValueError, match="sub_slots"):
        pdk.LaunchConfig(page_lanes=2, sub_slots=16)


def test_group_padding_does_not_change_results():
    check_kernel("k8v4+k4v2", 64, 3, 2, interpret=True, dot_dtype="float32", tol=1e-4, pad=16)


@pytest.mark.parametrize("D,G,lanes", [(64, 3, 1), (128, 4, 2), (64, 3, 4)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_rows_padded_in_the_kernel_match_reference(D, G, lanes, work_items):
    # padded_rows: q holds the real rows, the kernel's tile rows past them repeat the
    # last one (never stored); no padded copy of q in memory.
    check_kernel("k8v4+k4v2", D, G, 1 if work_items else 2, interpret=True,
                 dot_dtype="float32", tol=1e-4, pad=16, page_lanes=lanes,
                 work_items=work_items, seed=30 + lanes, rows_in_kernel=True)
    with pytest.raises(ValueError, match="padded_rows"):
        q = jnp.zeros((1, 1, 4, D), jnp.float32)
        tier, _, _ = make_tier(np.random.default_rng(0), pdk.TierFormat(8, 4, D, 32), 4, 1, 1, 1)
        pdk.paged_decode_partials(q, [tier], padded_rows=2, interpret=True)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v4+k4v2 wide", "k2v2", "k4v4"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 1), (128, 4, 2), (64, 8, 1), (64, 1, 4)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_token_tiles_match_reference(tier_set, D, G, lanes, work_items):
    # LaunchConfig.transposed: a page's tokens are the dot tiles' rows and the query
    # rows their columns, padded to 8 (q as its real rows or padded in memory; with
    # page lanes, the 8 columns hold the group once per lane).
    check_kernel(tier_set, D, G, 1, interpret=True, dot_dtype="float32", tol=1e-4, pad=8,
                 page_lanes=lanes, work_items=work_items, seed=60 + G + lanes,
                 rows_in_kernel=work_items is not None, transposed=True)
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype="float16", tol=3e-2, pad=8,
                 page_lanes=lanes, seed=70 + G, lazy=False, transposed=True)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v4+k4v2 wide"])
@pytest.mark.parametrize("key_chunk,transposed", [(16, True), (32, True), (64, False)])
def test_key_dot_in_column_chunks_matches_reference(tier_set, key_chunk, transposed):
    # LaunchConfig.key_chunk: the key dot taken over chunks of a row's key bytes, each
    # chunk's code slices against the query dims they hold (K4V2: byte c holds dims c
    # and c + D/2), summed into one accumulator.
    check_kernel(tier_set, 128, 4, 1, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8 if transposed else 16, page_lanes=2, work_items=16, seed=key_chunk,
                 rows_in_kernel=True, transposed=transposed, tier_weights=(1, 2),
                 key_chunk=key_chunk)
    with pytest.raises(ValueError, match="key_chunk"):
        pdk.LaunchConfig(key_chunk=24)


@pytest.mark.parametrize("split", [False, True])
def test_token_tiles_of_16_columns_walk_four_lanes(split):
    # Token tiles padded to 16 columns instead of 8 hold a group of 4 four times:
    # four K8V4 pages per step (bench_attention.py --tune pl=4,pr=16); K4V2's 64-slot
    # pages by lane 0 alone, or a 16-slot part per lane with split pages.
    assert pdk.LaunchConfig(page_lanes=4, transposed=True).lanes(16, 4) == 4
    check_kernel("k8v4+k4v2", 128, 4, 1, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=16, page_lanes=4, work_items=16, seed=5, rows_in_kernel=True,
                 transposed=True, tier_weights=(1, 2), lane_meta_select=True,
                 split_pages=split)


@pytest.mark.parametrize("weights", [(1, 2), (2, 3), (1, 3), (3, 1)])
@pytest.mark.parametrize("work_items", [None, 11, 16, 64])
def test_weighted_work_units_match_reference(weights, work_items):
    # Items cut in work units where a low page counts several (LaunchConfig.tier_weights):
    # each page still belongs to exactly one item of its row, whatever the cut.
    check_kernel("k8v4+k4v2", 64, 3, 3, interpret=True, dot_dtype="float32", tol=1e-4,
                 work_items=work_items, seed=sum(weights) + (work_items or 0),
                 tier_weights=weights)
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8, page_lanes=2, work_items=work_items, seed=5 + (work_items or 0),
                 rows_in_kernel=work_items is not None, transposed=True,
                 tier_weights=weights)


@pytest.mark.parametrize("work_items", [16, 64])
def test_eighths_work_units_match_reference(work_items):
    # Weights in eighths of a high page (the 8 : 15 the program traces tried), planned
    # with items of at least two high pages (min_item_units).
    from diffkv_jax.diffkv_kernel_attention import min_item_units

    weights = (8, 15)
    assert min_item_units(weights) == 16 and min_item_units(()) == 2
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8, page_lanes=2, work_items=work_items, seed=work_items,
                 rows_in_kernel=True, transposed=True, tier_weights=weights,
                 min_pages=min_item_units(weights))


@pytest.mark.parametrize("work_items", [16, 40])
def test_snapped_plan_matches_reference(work_items):
    # Cuts moved onto the tier boundaries (half an item away at most): each page still
    # belongs to one item of its row, and the launch reads what the items name.
    weights = (8, 15)
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8, page_lanes=2, work_items=work_items, seed=30 + work_items,
                 rows_in_kernel=True, transposed=True, tier_weights=weights,
                 min_pages=16, snap=0.45)


def test_snap_moves_the_cut_nearest_the_tier_boundary():
    # The 50/50 mix at 4K under weights 8 : 15: 64 high and 32 low pages, 992 units in
    # four items of 248. The second cut (496) lies 16 units before the boundary (512);
    # moved, each tier's two items share its units (32 high pages, 16 low pages each).
    units, bound = jnp.asarray([[992, 992]]), jnp.asarray([[512, 500]])
    cuts = lambda **kw: np.asarray(pdk.plan_work(units, 9, min_pages=16, wave=8, **kw)  # noqa: E731
                                   .items)[:8, 2:]
    assert cuts()[:4].tolist() == [[0, 248], [248, 496], [496, 744], [744, 992]]
    snapped = cuts(bounds=bound, snap=0.1, max_weight=15)
    assert snapped[:4].tolist() == [[0, 256], [256, 512], [512, 752], [752, 992]]
    assert snapped[4:].tolist() == [[0, 250], [250, 500], [500, 746], [746, 992]]
    # Too far for the tolerance (16 > 0.05 * 248): the cuts stay.
    assert np.array_equal(cuts(bounds=bound, snap=0.05, max_weight=15)[:4], cuts()[:4])
    # A boundary at a row's end or start moves nothing.
    edge = cuts(bounds=jnp.asarray([[992, 0]]), snap=0.4, max_weight=15)
    assert np.array_equal(edge, cuts())


def _two_tier_rows(rng, empty_low: bool = False):
    """``(S, H, units, bounds, N)``: random rows of up to 40 high and 40 low pages under
    weights 8 : 15 (a fifth with no high pages, and with ``empty_low`` a fifth with
    no low pages), each row's high units as its bound, and a work-item count."""
    S, H = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    hi, lo = rng.integers(0, 40, size=(2, S, H))
    hi[rng.random((S, H)) < 0.2] = 0
    if empty_low:
        lo[rng.random((S, H)) < 0.2] = 0
    return S, H, hi * 8 + lo * 15, hi * 8, S * H + int(rng.integers(1, 60))


@pytest.mark.parametrize("seed", range(6))
def test_snapped_plan_covers_every_page_once(seed):
    snap = [0.45, 0.1, 0.25][seed % 3]
    S, H, units, bounds, N = _two_tier_rows(np.random.default_rng(200 + seed))
    wave = None if seed % 2 else N - 1
    plain = pdk.plan_work(jnp.asarray(units, jnp.int32), N, min_pages=16, wave=wave)
    work = pdk.plan_work(jnp.asarray(units, jnp.int32), N, min_pages=16, wave=wave,
                         bounds=jnp.asarray(bounds, jnp.int32), snap=snap, max_weight=15)
    items, seg = np.asarray(work.items), np.asarray(work.seg)
    assert np.array_equal(seg, np.asarray(plain.seg))
    assert np.array_equal(np.asarray(work.ranges), np.asarray(plain.ranges))
    before = np.asarray(plain.items)
    C = int((before[:, 3] - before[:, 2]).max())
    moved_rows = 0
    for r in range(S * H):
        mine, was = items[seg == r], before[seg == r]
        b, u = int(bounds.reshape(-1)[r]), int(units.reshape(-1)[r])
        covered = np.zeros(u, int)
        for _, _, lo_, hi_ in mine:
            covered[lo_:hi_] += 1
        assert np.all(covered == 1)
        if len(was) < 2:
            continue
        cuts = was[1:, 2]
        j = int(np.argmin(np.abs(cuts - b)))
        fits = abs(int(cuts[j]) - b) <= int(C * snap) and 0 < b < u
        i, rest = j + 1, len(was) - j - 1
        fits = fits and b // i >= 15 and (u - b) // rest >= 15
        if fits:  # the cut on the boundary, each side's items within a unit of equal
            moved_rows += 1
            assert b in mine[:, 2]
            size = mine[:, 3] - mine[:, 2]
            assert np.ptp(size[:i]) <= 1 and np.ptp(size[i:]) <= 1 and size.min() >= 15
            assert size.max() <= C + snap * C + 1
        else:
            assert np.array_equal(mine, was)
    if snap == 0.45:
        assert moved_rows > 0


def test_min_item_units_give_every_full_item_a_page():
    # Short rows in units of eighths of a high page: an item as long as the plan's least
    # units holds the first unit of some page (a page is its item's that holds its first
    # unit), so only a row's shorter last item can be left without one; with items of
    # two units, as the plan's default, most items would hold no page.
    from diffkv_jax.diffkv_kernel_attention import min_item_units

    weights = (8, 15)
    least = min_item_units(weights)
    assert least == 16 and min_item_units((1, 2)) == 2 and min_item_units((1, 3)) == 3
    assert min_item_units(weights, pages=4) == 32 and min_item_units((), pages=4) == 4
    rng = np.random.default_rng(3)
    hi, lo = rng.integers(0, 4, size=(2, 6, 4))
    units = jnp.asarray(hi * weights[0] + lo * weights[1], jnp.int32)

    def items_without_a_page(min_pages):
        work = pdk.plan_work(units, 200, min_pages=min_pages, wave=190)
        items, used = np.asarray(work.items), np.asarray(work.seg) < work.num_rows
        empty = []
        for s, h, b, e in items[used]:
            starts = [8 * p for p in range(hi[s, h])] + [8 * hi[s, h] + 15 * p
                                                         for p in range(lo[s, h])]
            if not any(b <= u < e for u in starts):
                empty.append(e - b)
        return empty

    assert all(span < least for span in items_without_a_page(least))
    assert len(items_without_a_page(2)) > len(items_without_a_page(least))


def test_weighted_plan_balances_the_units():
    # A row of 8 high and 4 low pages at weights (1, 2) holds 16 units: with items of
    # 4 units each takes 4 high pages or 2 low ones.
    caps = [16, 32]
    tiers = [pdk.TierInput(pdk.TierFormat(8, 4, 64, c), None, None, None, None,
                           jnp.asarray([[n]], jnp.int32)) for c, n in zip(caps, [128, 128])]
    units = pdk.row_pages(tiers, weights=(1, 2))
    assert int(units[0, 0]) == 8 + 2 * 4
    work = pdk.plan_work(units, 5, min_pages=4)
    used = np.asarray(work.items)[np.asarray(work.seg) == 0]
    assert [tuple(x[2:]) for x in used] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(ValueError, match="tier_weights"):
        pdk.LaunchConfig(tier_weights=(1, 0))


@pytest.mark.parametrize("work_items", [None, 16])
def test_page_lanes_over_64_slot_pages_match_reference(work_items):
    # lane_slots=64: K4V2's 64-slot pages walked by both lanes too.
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8, page_lanes=2, work_items=work_items, seed=17,
                 rows_in_kernel=work_items is not None, transposed=True, lane_slots=64,
                 tier_weights=(1, 2))


def test_token_tiles_leave_16bit_launches_alone():
    # 16-bit pages keep the query rows as the tile rows: transposed changes nothing.
    check_kernel("16bit", 64, 3, 2, interpret=True, dot_dtype="float32", tol=1e-4, pad=16,
                 transposed=True)
    with pytest.raises(ValueError, match="sub_slots"):
        pdk.LaunchConfig(transposed=True, sub_slots=16)


def random_packed_codes(bits: int):
    """Random bytes ``[5, 12]`` of ``bits``-bit codes and the codes of each slice:
    ``codes[:, i]`` (int32) are those at bit offset ``i * bits`` of every byte."""
    rng = np.random.default_rng(bits)
    packed = jnp.asarray(rng.integers(0, 256, size=(5, 12)), jnp.uint8)
    codes = np.asarray(qz.unpack(packed, bits, 12 * 8 // bits).reshape(5, 8 // bits, 12),
                       np.int32)
    return packed, codes


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_magic_slices_are_codes_plus_1024(bits):
    packed, codes = random_packed_codes(bits)
    got = code_convert.magic_slices(packed, bits, interpret=True)
    for i, g in enumerate(got):
        assert g.dtype == jnp.float16
        assert np.array_equal(np.asarray(g, np.float32), np.asarray(codes[:, i], np.float32) + 1024)


def test_packed_metadata_round_trips():
    rng = np.random.default_rng(3)
    s = jnp.asarray(rng.uniform(0.01, 1, (4, 7)), jnp.float16)
    z = jnp.asarray(rng.normal(size=(4, 7)), jnp.float16)
    w = pdk.pack_meta(s, z)
    assert w.dtype == jnp.uint32 and w.shape == (4, 7)
    back = np.asarray(w).view(np.float16).reshape(4, 7, 2)
    assert np.array_equal(back[..., 0], np.asarray(s)) and np.array_equal(back[..., 1], np.asarray(z))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", list(TIER_SETS))
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2), (128, 8, 4), (64, 1, 2)])
@pytest.mark.parametrize("lazy", [True, False])
def test_compiled_kernel_matches_reference_on_gpu(tier_set, D, G, splits, lazy):
    # float16 (quantized) or 16-bit pool dtype operands, float32 accumulation.
    check_kernel(tier_set, D, G, splits, interpret=False, dot_dtype="float16", tol=3e-2,
                 lazy=lazy, pad=16)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "16bit", "k8v8"])
@pytest.mark.parametrize("D,G", [(64, 3), (128, 4)])
@pytest.mark.parametrize("work_items", [11, 64])
def test_compiled_work_list_launch_matches_reference_on_gpu(tier_set, D, G, work_items):
    check_kernel(tier_set, D, G, 1, interpret=False, dot_dtype="float16", tol=3e-2, pad=16,
                 work_items=work_items, seed=work_items)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v4+k4v2 wide", "k4v4", "k2v2"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 4), (128, 4, 4), (128, 4, 2), (64, 8, 2),
                                       (64, 1, 4)])
@pytest.mark.parametrize("work_items", [None, 16])
def test_compiled_page_lanes_match_reference_on_gpu(tier_set, D, G, lanes, work_items):
    check_kernel(tier_set, D, G, 1 if work_items else 2, interpret=False, dot_dtype="float16",
                 tol=3e-2, pad=16, page_lanes=lanes, work_items=work_items, seed=lanes + G)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "16bit"])
@pytest.mark.parametrize("D,G,lanes", [(128, 4, 2), (64, 3, 1), (128, 8, 1)])
def test_compiled_rows_padded_in_the_kernel_match_reference_on_gpu(tier_set, D, G, lanes):
    check_kernel(tier_set, D, G, 1, interpret=False, dot_dtype="float16", tol=3e-2, pad=16,
                 page_lanes=lanes, work_items=16, seed=40 + G, rows_in_kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gib", [3.0, 4.5])
def test_pools_over_2gib_are_addressed_with_64bit_offsets_on_gpu(gib):
    # A 3 GiB byte pool (64-bit offsets by backend.wide_offsets) and a 4.5 GiB one
    # (by the lowering itself); the rows' pages sit past the 2^31-element mark,
    # where 32-bit offsets would wrap around.
    from pallas_kernels import backend

    assert backend.wide_offsets() or gib > 4
    D, cap = 128, 32
    fmt = pdk.TierFormat(8, 4, D, cap)
    P = int(gib * 2**30) // fmt.data_bytes + 1
    rng = np.random.default_rng(7)
    tail = jnp.asarray(rng.integers(0, 256, size=(8, fmt.data_bytes)), jnp.uint8)
    data = jnp.zeros((P, fmt.data_bytes), jnp.uint8).at[P - 8:].set(tail)
    f16 = lambda a: jnp.asarray(a, jnp.float16)  # noqa: E731
    ks, kz = f16(rng.uniform(0.01, 0.1, (P, cap))), f16(rng.normal(size=(P, cap)))
    vs, vz = f16(rng.uniform(0.01, 0.1, (P, cap))), f16(rng.normal(size=(P, cap)))
    pages = jnp.asarray(P - 8 + rng.permutation(8), jnp.int32).reshape(1, 1, 8)
    n_tok = jnp.asarray([[8 * cap - 5]], jnp.int32)
    kv, vv = pdk.page_views(data, fmt)
    tier = pdk.TierInput(fmt, kv, vv, (pdk.pack_meta(ks, kz), pdk.pack_meta(vs, vz)), pages,
                         n_tok)
    q = jnp.asarray(rng.normal(size=(1, 1, 4, D)), jnp.float32)
    o, m, l, _ = pdk.paged_decode_partials(pdk.pad_group(q, 16), [tier], group=4)
    ids = pages[0, 0]
    kw = fmt.key_width
    keys = data[ids, :cap * kw].reshape(8, cap, kw)
    vals = data[ids, cap * kw:].reshape(8, D // 2, cap).transpose(0, 2, 1)
    kh = qz.dequantize_packed(keys, ks[ids], kz[ids], 8, D).reshape(1, 1, 8 * cap, D)
    vh = qz.dequantize_packed(vals, vs[ids], vz[ids], 4, D).reshape(1, 1, 8 * cap, D)
    ro, rm, rl, _ = pdk.tier_attention_reference(q, kh, vh, n_tok)
    out = pdk.merge_partials([(o[:, :, :, :4], m[..., :4], l[..., :4])])[0]
    ref = pdk.merge_partials([(ro, rm, rl)])[0]
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 3e-2 * float(np.abs(ref).max())


@pytest.mark.parametrize("wide", [False, True])
def test_pool_addressing_limits(wide, monkeypatch):
    # The lowering's own offsets: 32-bit signed element offsets up to 4 GiB, 64-bit
    # above, so only one-byte pools of 2 - 4 GiB overflow; with wide offsets none do.
    from pallas_kernels import backend

    monkeypatch.setattr(backend, "wide_offsets", lambda: wide)
    assert pdk.addressable(2**31, 2) and pdk.addressable(2**31, 1)
    assert pdk.addressable(2**31 + 1, 1) == wide and pdk.addressable(2**32, 1) == wide
    assert pdk.addressable(2**32 + 1, 1) and pdk.addressable(2**30, 4)


def test_refs_of_2_to_4_gib_lower_with_64bit_offsets():
    # Lowered for CUDA on any machine: the probe of backend.wide_offsets finds
    # 64-bit offsets in a 3 GiB byte ref's Triton module; the environment switch
    # turns them off (a fresh interpreter: the patch is installed at import).
    import subprocess
    import sys

    from pallas_kernels import backend

    assert backend.wide_offsets()
    code = "from pallas_kernels import backend; print(backend.wide_offsets())"
    env = dict(os.environ, DIFFKV_JAX_NARROW_OFFSETS="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_diffkv_cache_refuses_pools_the_kernel_cannot_address(monkeypatch):
    from diffkv_jax.diffkv_cache import DiffKVCache
    from pallas_kernels import backend

    monkeypatch.setattr(backend, "wide_offsets", lambda: False)  # the lowering's own
    m = DiffKVCache(1, 1, 128, 1, 64, attention_impl="pallas")
    with pytest.raises(ValueError, match="32-bit offsets"):
        m.init_state(3 * 2**30 // m.layout.data_bytes)


def lowering_tiers(D: int = 128):
    """K8V4 and K4V2 tier inputs of zeros: shapes for lowering the launch for CUDA on
    the CPU (nothing runs)."""
    tiers = []
    for kb, vb, cap in [(8, 4, 32), (4, 2, 64)]:
        fmt = pdk.TierFormat(kb, vb, D, cap)
        kv, vv = pdk.page_views(jnp.zeros((8, fmt.data_bytes), jnp.uint8), fmt)
        meta = (jnp.zeros((8, cap), jnp.uint32),) * 2
        tiers.append(pdk.TierInput(fmt, kv, vv, meta, jnp.zeros((1, 1, 2), jnp.int32),
                                   jnp.zeros((1, 1), jnp.int32)))
    return tiers


def test_gpu_lowering_accumulates_in_the_mma():
    # Lowered for CUDA on the CPU: every product that adds to an accumulator goes
    # through backend.dot_acc, so no float add consumes a dot's result (with
    # Pallas' own dot, each one was an FADD per output element per page).
    import re

    import jax

    from pallas_kernels import backend
    from scripts.kernel_resources import strip_locations, triton_ir

    assert backend.FUSED_DOT_ACC
    D, G = 128, 4
    tiers = lowering_tiers(D)
    fn = jax.jit(lambda q: pdk.paged_decode_partials(q, tiers, group=G, interpret=False))
    ir = strip_locations(triton_ir(fn, jnp.zeros((1, 1, 16, D), jnp.bfloat16)))
    dots = re.findall(r"(%[\w#]+) = tt\.dot (%[\w#]+), (%[\w#]+), (%[\w#]+)", ir)
    # Keys: 1 dot for K8, 2 for K4. Values: 4 per tier (the launch keeps 4 output
    # slices of 32 dims for K4V2's 2-bit codes; K8V4's 64 value bytes fill them in two
    # row blocks of two nibble slices). One offset-sum dot per tier.
    assert len(dots) == (1 + 4 + 1) + (2 + 4 + 1)
    for name, *_ in dots:
        assert not re.search(rf"arith\.addf [^\n]*{re.escape(name)}(?![\w#])", ir), name


@pytest.mark.gpu
@pytest.mark.parametrize("weights,lane_slots", [((1, 2), 32), ((1, 3), 32), ((1, 2), 64)])
@pytest.mark.parametrize("D,G", [(128, 4), (64, 3)])
def test_compiled_weighted_work_units_match_reference_on_gpu(weights, lane_slots, D, G):
    check_kernel("k8v4+k4v2 wide", D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, work_items=16, seed=100 + sum(weights) + lane_slots,
                 rows_in_kernel=True, transposed=True, tier_weights=weights,
                 lane_slots=lane_slots)
    check_kernel("k8v4+k4v2 wide", D, G, 3, interpret=False, dot_dtype="float16", tol=3e-2,
                 pad=8, page_lanes=2, seed=110 + sum(weights), transposed=True,
                 tier_weights=weights, lane_slots=lane_slots)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2", "k8v4+k4v2 wide", "k2v2", "k8v8"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 2), (128, 4, 1), (128, 4, 2), (128, 8, 1)])
def test_compiled_token_tiles_match_reference_on_gpu(tier_set, D, G, lanes):
    # The dots with 8 query columns (m16n8k16 tiles) compiled by the Triton lowering,
    # over a work list and over even splits.
    check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2, pad=8,
                 page_lanes=lanes, work_items=16, seed=80 + G + lanes, rows_in_kernel=True,
                 transposed=True)
    check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2, pad=8,
                 page_lanes=lanes, seed=90 + G + lanes, transposed=True)


@pytest.mark.parametrize("work_items", [16, 40])
def test_gap_plan_matches_reference(work_items):
    # The item across a row's tier boundary holds fewer units (plan_work(gap=)): each
    # page still belongs to one item of its row, and the launch reads what they name.
    check_kernel("k8v4+k4v2 wide", 128, 4, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                 pad=8, page_lanes=2, work_items=work_items, seed=50 + work_items,
                 rows_in_kernel=True, transposed=True, tier_weights=(8, 15),
                 min_pages=16, gap=12)


def test_gap_shortens_the_item_across_the_tier_boundary():
    # The realistic mix's rows at 4K under 1 : 2: 45 high pages, then 29 low pages (58
    # units), 103 units in four items. Counted one unit longer at the boundary, the
    # second item (19 high pages and some low) holds a unit fewer, the others share it.
    units, bound = jnp.asarray([[103, 103]]), jnp.asarray([[45, 45]])
    cuts = lambda **kw: np.asarray(pdk.plan_work(units, 9, min_pages=2, wave=8, **kw)  # noqa: E731
                                   .items)[:4, 2:]
    assert cuts().tolist() == [[0, 26], [26, 52], [52, 78], [78, 103]]
    assert cuts(bounds=bound, gap=1).tolist() == [[0, 26], [26, 51], [51, 77], [77, 103]]
    # A row whose boundary is at its start or end holds one tier: no gap.
    assert np.array_equal(cuts(bounds=jnp.asarray([[0, 103]]), gap=1), cuts())
    assert np.array_equal(cuts(bounds=jnp.asarray([[103, 103]]), gap=1), cuts())
    with pytest.raises(ValueError, match="min_pages"):
        cuts(bounds=bound, gap=2)
    with pytest.raises(ValueError, match="bounds"):
        cuts(gap=1)
    with pytest.raises(ValueError, match="snap"):
        cuts(bounds=bound, gap=1, snap=0.2)


@pytest.mark.parametrize("seed", range(6))
def test_gap_plan_covers_every_page_once(seed):
    gap = [15, 1, 8][seed % 3]
    S, H, units, bounds, N = _two_tier_rows(np.random.default_rng(300 + seed), empty_low=True)
    wave = None if seed % 2 else N - 1
    work = pdk.plan_work(jnp.asarray(units, jnp.int32), N, min_pages=16, wave=wave,
                         bounds=jnp.asarray(bounds, jnp.int32), max_weight=15, gap=gap)
    items, seg = np.asarray(work.items), np.asarray(work.seg)
    # The plan's own count per item, on the rows counted gap units longer.
    both = (bounds > 0) & (bounds < units)
    longer = pdk.plan_work(jnp.asarray(units + gap * both, jnp.int32), N, min_pages=16,
                           wave=wave)
    assert np.array_equal(seg, np.asarray(longer.seg))
    C = int((np.asarray(longer.items)[:, 3] - np.asarray(longer.items)[:, 2]).max())
    across = 0
    for r in range(S * H):
        mine = items[seg == r]
        b, u = int(bounds.reshape(-1)[r]), int(units.reshape(-1)[r])
        covered = np.zeros(u, int)
        for _, _, lo_, hi_ in mine:
            assert lo_ < hi_
            covered[lo_:hi_] += 1
        assert np.all(covered == 1)
        size = mine[:, 3] - mine[:, 2]
        assert size.max(initial=0) <= C
        for lo_, hi_ in mine[:, 2:]:
            if lo_ < b < hi_:  # across the boundary: gap units fewer than planned
                across += 1
                assert hi_ - lo_ <= C - gap
    assert across > 0 or not both.any()
