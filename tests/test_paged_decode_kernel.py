"""The Pallas paged decode kernel against its plain-jnp reference (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffkv_jax import quantization as qz
from pallas_kernels import paged_decode as pdk


def make_tier(rng, fmt: pdk.TierFormat, P: int):
    """Random pools for one tier plus their dequantized values per page slot."""
    D, cap = fmt.head_dim, fmt.slots
    if not fmt.quantized:
        k = jnp.asarray(rng.normal(size=(P, cap, D)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(P, cap, D)), jnp.float32)
        return (k, v, None, None, None, None), k, v
    kw, vw = qz.packed_width(D, fmt.k_bits), qz.packed_width(D, fmt.v_bits)
    tokens = jnp.asarray(rng.integers(0, 256, size=(P, cap, kw + vw)), jnp.uint8)
    M = cap + 3  # metadata arrays may be wider than this tier's slots
    f16 = lambda a: jnp.asarray(a, jnp.float16)  # noqa: E731
    ks, kz = f16(rng.uniform(0.01, 0.1, (P, M))), f16(rng.normal(size=(P, M)))
    vs, vz = f16(rng.uniform(0.01, 0.1, (P, M))), f16(rng.normal(size=(P, M)))
    k_hat = qz.dequantize_packed(tokens[..., :kw], ks[:, :cap], kz[:, :cap], fmt.k_bits, D)
    v_hat = qz.dequantize_packed(tokens[..., kw:], vs[:, :cap], vz[:, :cap], fmt.v_bits, D)
    return (tokens, tokens, ks, kz, vs, vz), k_hat, v_hat


FORMATS = [(8, 4), (4, 2), (8, 8), (16, 16), (2, 2)]


@pytest.mark.parametrize("bits", FORMATS)
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2), (64, 8, 4)])
def test_kernel_matches_reference(bits, D, G, splits):
    # float32 throughout: only summation order differs (tolerance 1e-4 relative).
    check_kernel(bits, D, G, splits, interpret=True, dot_dtype="float32", tol=1e-4,
                 prefetch=splits == 2)


@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (8, 8), (2, 2)])
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2)])
def test_magic_code_conversion_matches_reference(bits, D, G, splits):
    # 16-bit dots take the magic path (codes as float16 1024 + c, q and p * scale
    # rounded to float16): relative errors around 1e-3 of the output scale.
    check_kernel(bits, D, G, splits, interpret=True, dot_dtype="bfloat16", tol=3e-3,
                 dequant=False)


@pytest.mark.gpu
@pytest.mark.parametrize("convert", ["magic", "cvt"])
@pytest.mark.parametrize("bits", FORMATS)
@pytest.mark.parametrize("D,G,splits", [(64, 3, 1), (128, 4, 2), (128, 8, 4), (64, 1, 2)])
def test_compiled_kernel_matches_reference_on_gpu(bits, D, G, splits, convert):
    # bf16 operands (q and the probabilities rounded to bf16, codes exact), float32
    # accumulation: relative errors around 1e-2 of the output scale.
    check_kernel(bits, D, G, splits, interpret=False, dot_dtype="bfloat16", tol=3e-2,
                 prefetch=splits == 2, dequant=convert == "cvt" and G % 2 == 0,
                 convert=convert)


def check_kernel(bits, D, G, splits, interpret, dot_dtype, tol, prefetch=False, dequant=None,
                 convert="magic"):
    rng = np.random.default_rng(hash((bits, D, G, splits)) % 2**32)
    kb, vb = bits
    cap = 8
    kw = D if kb == 16 else qz.packed_width(D, kb)
    fmt = pdk.TierFormat(kb, vb, D, cap, k_offset=0, v_offset=0 if kb == 16 else kw)
    S, H, P = 3, 2, 40
    pools, k_hat, v_hat = make_tier(rng, fmt, P)
    NP = 8
    pages = jnp.asarray(rng.integers(0, P, size=(S, H, NP)), jnp.int32)  # random page tables
    n_tok = jnp.asarray([[0, 5], [NP * cap, 17], [33, 9]], jnp.int32)  # ragged, incl. empty
    q = jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32)
    cfg = pdk.LaunchConfig(pages_per_block=2, num_splits=splits, dot_dtype=dot_dtype,
                           prefetch=prefetch, code_convert=convert,
                           dequant_in_registers=G % 2 == 0 if dequant is None else dequant)
    qk = q if interpret else pdk.pad_group(q, 16)
    o, m, l, logits = pdk.paged_decode_partials(qk, *pools, pages, n_tok, fmt=fmt, cfg=cfg,
                                                interpret=interpret)
    o, m, l, logits = o[:, :, :, :G], m[..., :G], l[..., :G], logits[:, :, :G]
    # Reference on the same page table, slot order = page order.
    kh = k_hat[pages].reshape(S, H, NP * cap, D)
    vh = v_hat[pages].reshape(S, H, NP * cap, D)
    ro, rm, rl, rlogits = pdk.tier_attention_reference(q, kh, vh, n_tok)
    # An extra always-present source (like the token being decoded) keeps rows defined.
    extra = (jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32),
             jnp.asarray(rng.normal(size=(S, H, G)), jnp.float32), jnp.ones((S, H, G)))
    out, M, L = pdk.merge_partials([(o, m, l)], extra)
    rout, rM, rL = pdk.merge_partials([(ro, rm, rl)], extra)
    scale = float(np.abs(np.asarray(rout)).max())
    assert np.abs(np.asarray(out) - np.asarray(rout)).max() <= tol * scale
    assert np.allclose(M, rM, rtol=tol, atol=tol) and np.allclose(L, rL, rtol=tol * 10)
    valid = np.arange(NP * cap)[None, None, :] < np.asarray(n_tok)[..., None]
    p = pdk.group_max_probabilities(logits, M, L, G)
    rp = pdk.group_max_probabilities(rlogits, rM, rL, G)
    assert np.abs(np.where(valid, p, 0) - np.where(valid, rp, 0)).max() <= tol * 10 * float(
        np.asarray(rp).max())


def test_group_padding_does_not_change_results():
    rng = np.random.default_rng(0)
    fmt = pdk.TierFormat(8, 4, 64, 8, v_offset=64)
    pools, _, _ = make_tier(rng, fmt, 20)
    pages = jnp.asarray(rng.integers(0, 20, size=(2, 1, 4)), jnp.int32)
    n_tok = jnp.asarray([[30], [7]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 1, 3, 64)), jnp.float32)
    cfg = pdk.LaunchConfig(pages_per_block=1, num_splits=2, dot_dtype="float32")
    a = pdk.paged_decode_partials(q, *pools, pages, n_tok, fmt=fmt, cfg=cfg, interpret=True)
    b = pdk.paged_decode_partials(pdk.pad_group(q, 16), *pools, pages, n_tok, fmt=fmt, cfg=cfg,
                                  interpret=True)
    assert np.allclose(a[0], b[0][:, :, :, :3], atol=1e-5)
    valid = np.arange(32)[None, None, None, :] < np.asarray(n_tok)[:, :, None, None]
    assert np.allclose(np.where(valid, a[3], 0), np.where(valid, b[3][:, :, :3], 0), atol=1e-5)


@pytest.mark.gpu
def test_pool_over_4gib_is_addressed_with_64bit_offsets_on_gpu():
    # A 4.5 GiB byte pool; the rows' pages sit past the 2^31-element mark, where
    # 32-bit offsets would wrap around.
    D, cap = 128, 32
    fmt = pdk.TierFormat(8, 4, D, cap, k_offset=0, v_offset=D)
    width = D + D // 2
    P = (9 * 2**29) // (cap * width) + 1
    pool = jnp.zeros((P, cap, width), jnp.uint8)
    rng = np.random.default_rng(7)
    tail = jnp.asarray(rng.integers(0, 256, size=(8, cap, width)), jnp.uint8)
    pool = pool.at[P - 8:].set(tail)
    meta = [jnp.asarray(rng.uniform(0.01, 0.1, (P, cap)), jnp.float16) for _ in range(4)]
    pages = jnp.asarray(P - 8 + rng.permutation(8), jnp.int32).reshape(1, 1, 8)
    n_tok = jnp.asarray([[8 * cap - 5]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(1, 1, 4, D)), jnp.float32)
    cfg = pdk.LaunchConfig(pages_per_block=2)
    o, m, l, _ = pdk.paged_decode_partials(pdk.pad_group(q, 16), pool, pool, *meta, pages,
                                           n_tok, fmt=fmt, cfg=cfg)
    kh = qz.dequantize_packed(pool[pages[0, 0]][..., :D], meta[0][pages[0, 0]],
                              meta[1][pages[0, 0]], 8, D).reshape(1, 1, 8 * cap, D)
    vh = qz.dequantize_packed(pool[pages[0, 0]][..., D:], meta[2][pages[0, 0]],
                              meta[3][pages[0, 0]], 4, D).reshape(1, 1, 8 * cap, D)
    ro, rm, rl, _ = pdk.tier_attention_reference(q, kh, vh, n_tok)
    out = pdk.merge_partials([(o[:, :, :, :4], m[..., :4], l[..., :4])])[0]
    ref = pdk.merge_partials([(ro, rm, rl)])[0]
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 3e-2 * float(np.abs(ref).max())
