"""``LaunchConfig.int8_query_digits``: the key dots in int8, the query rounded to
one or two int8 digits per row.

The operands are checked exactly (``code_convert.int8_slices``, ``_int8_digits``);
the launch against the plain-jnp reference given the rounded query
(``int8_query_rows``) at the float dots' own tolerances, and two digits against
the reference of the query as it is; the lowering for CUDA takes int8 dots
(checked on the CPU); compiled on the GPU (marked ``gpu``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import code_convert
from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import (TIER_SETS, check_kernel, lowering_tiers, make_tier,
                                            random_packed_codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_int8_slices_are_codes_at_the_top_bits_minus_128(bits):
    packed, codes = random_packed_codes(bits)
    got = code_convert.int8_slices(packed, bits, interpret=True)
    assert len(got) == 8 // bits
    for i, g in enumerate(got):
        assert g.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(g, np.int32),
                                      codes[:, i] * 2 ** (8 - bits) - 128)


@pytest.mark.parametrize("digits", [1, 2])
def test_query_digits_round_each_row_to_its_scale(digits):
    rng = np.random.default_rng(digits)
    q = jnp.asarray(rng.normal(size=(3, 5, 128)) * rng.uniform(0.1, 10, size=(3, 5, 1)),
                    jnp.float32)
    got = np.asarray(pdk.int8_query_rows(q, digits))
    step = np.abs(np.asarray(q)).max(-1, keepdims=True) / 127
    err = np.abs(got - np.asarray(q))
    # Half a step of the last digit; a second digit clipped to -127 (the rounding left
    # by the first is within [-128, 128) of its steps) one step. float32's own
    # rounding on top.
    unit = step / 256 ** (digits - 1)
    assert (err <= unit * (0.5 if digits == 1 else 1.0) * (1 + 1e-3) + 1e-6 * step).all()
    assert err.max() > unit.min() * 1e-3  # it does round
    # the largest component is a whole number of steps
    np.testing.assert_allclose(np.abs(got).max(-1), np.abs(np.asarray(q)).max(-1), rtol=1e-6)


CASES = [("k8v4+k4v2 wide", 128, 4, 8, True, 2, 16), ("k8v4+k4v2", 64, 3, 16, False, 1, None),
         ("k8v8", 64, 3, 8, True, 1, 16), ("k2v2", 128, 4, 16, False, 1, None),
         ("k4v4", 64, 8, 8, True, 1, None)]


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("tier_set,D,G,pad,transposed,lanes,work_items", CASES)
@pytest.mark.parametrize("dot_dtype,tol", [("float32", 1e-4), ("float16", 3e-3)])
def test_int8_key_dots_match_the_reference_of_the_rounded_query(
        tier_set, D, G, pad, transposed, lanes, work_items, dot_dtype, tol, digits):
    # The int8 dots and their offsets are exact: the tolerances are the float dots'
    # (float32: summation order; float16: the values' operands).
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype=dot_dtype, tol=tol, pad=pad,
                 page_lanes=lanes, work_items=work_items, rows_in_kernel=work_items is not None,
                 transposed=transposed, tier_weights=(1, 2)[:len(TIER_SETS[tier_set])],
                 seed=len(tier_set) + D + digits, int8_query_digits=digits,
                 ref_query=functools.partial(pdk.int8_query_rows, digits=digits))


@pytest.mark.parametrize("tier_set,D,G", [("k8v4+k4v2 wide", 128, 4), ("k8v8", 64, 3)])
def test_two_digits_match_the_reference_of_the_query_itself(tier_set, D, G):
    # Two digits round the query to 2^-16 of its row's largest component: below the
    # float32 check's tolerance.
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype="float32", tol=1e-4, seed=3,
                 int8_query_digits=2)


def test_one_digit_differs_from_the_reference_of_the_query_itself():
    # The rounding the tests above take into account is real: one digit is off the
    # unrounded query's reference by more than the float32 tolerance.
    with pytest.raises(AssertionError):
        check_kernel("k8v8", 64, 3, 2, interpret=True, dot_dtype="float32", tol=1e-4,
                     seed=3, int8_query_digits=1)


def test_short_key_rows_keep_float16_dots():
    # K2 at head dim 64: 16-byte key rows, under the int8 dot's depth of 32.
    rng = np.random.default_rng(9)
    S, H, P, NP, D, G = 3, 2, 24, 3, 64, 3
    tiers = [make_tier(rng, pdk.TierFormat(2, 2, D, 16), P, S, H, NP)[0]]
    q = pdk.pad_group(jnp.asarray(rng.normal(size=(S, H, G, D)), jnp.float32), 16)
    outs = [jax.tree.leaves(pdk.paged_decode_partials(
        q, tiers, group=G, cfg=pdk.LaunchConfig(num_splits=2, int8_query_digits=d),
        interpret=True)) for d in (0, 1)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int8_key_dots_refuse_narrow_key_chunks():
    with pytest.raises(ValueError, match="32 bytes"):
        pdk.LaunchConfig(int8_query_digits=1, key_chunk=16)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        pdk.LaunchConfig(int8_query_digits=3)


@pytest.mark.parametrize("digits", [1, 2])
def test_int8_key_dots_lower_to_int8_dots_for_cuda(digits):
    # On the CPU: the launch lowers for CUDA, and its Triton IR takes int8 operands
    # into int32 dots (the GPU's integer tensor-core instructions).
    from scripts.kernel_resources import triton_ir

    D, G = 128, 4
    tiers = lowering_tiers(D)  # K8V4 and K4V2
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, values_in_place=True,
                           lane_meta_select=True, num_warps=2, int8_query_digits=digits)
    q = jnp.zeros((1, 1, G, D), jnp.bfloat16)
    fn = jax.jit(lambda q: pdk.paged_decode_partials(q, tiers, group=G, cfg=cfg,
                                                     interpret=False, padded_rows=8))
    ir = triton_ir(fn, q)
    int8_dots = [line for line in ir.split("\n") if "tt.dot" in line and "xi8>" in line]
    # per tier: its slices (1 for K8, 2 for K4) times the digits, per lane (2 for K8V4's
    # 32-slot pages; K4V2's 64-slot pages walk one lane)
    assert len(int8_dots) == (1 * 2 + 2 * 1) * digits
    assert all("xi32>" in line for line in int8_dots)


@pytest.mark.gpu
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("tier_set,D,G,lanes", [("k8v4+k4v2 wide", 128, 4, 2),
                                                ("k8v4+k4v2", 64, 3, 2), ("k8v8", 128, 8, 1),
                                                ("k2v2", 128, 4, 1)])
def test_compiled_int8_key_dots_match_reference_on_gpu(tier_set, D, G, lanes, digits):
    ref_query = functools.partial(pdk.int8_query_rows, digits=digits)
    for nw in (1, 2):
        check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-3, pad=8,
                     page_lanes=lanes, work_items=16, seed=170 + G + lanes + digits,
                     rows_in_kernel=True, transposed=True, num_warps=nw, values_in_place=True,
                     tier_weights=(1, 2)[:len(TIER_SETS[tier_set])], int8_query_digits=digits,
                     ref_query=ref_query)
    check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-3, pad=16,
                 page_lanes=1, seed=180 + G, int8_query_digits=digits, ref_query=ref_query)
