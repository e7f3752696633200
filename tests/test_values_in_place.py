"""``LaunchConfig.values_in_place``: the value codes' slices left at their bit
offsets (``code_convert.magic_slices(in_place=True)``: float16 ``1024 + c 2^(b i)``),
the powers of two undone on the value accumulators.

The conversion is checked exactly; the launch against the plain-jnp reference and
against the launch without it (interpret mode, every quantized tier set, both tile
orientations, lanes, work lists; compiled on the GPU, marked ``gpu``).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import code_convert
from pallas_kernels import paged_decode as pdk

from tests.test_paged_decode_kernel import (TIER_SETS, check_kernel, random_packed_codes,
                                            random_partials)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_slices_in_place_are_codes_at_their_offsets_plus_1024(bits):
    packed, codes = random_packed_codes(bits)
    codes = codes.astype(np.float32)
    got = code_convert.magic_slices(packed, bits, interpret=True, in_place=True)
    assert len(got) == 8 // bits
    for i, g in enumerate(got):
        assert g.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(g, np.float32),
                                      codes[:, i] * 2.0 ** (bits * i) + 1024)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k8v4+k4v2", "k2v2", "k4v4", "k8v8"])
@pytest.mark.parametrize("pad,transposed,lanes,work_items", [(8, True, 2, 16),
                                                             (16, False, 1, None)])
def test_values_in_place_match_reference(tier_set, pad, transposed, lanes, work_items):
    D, G = (128, 4) if "wide" in tier_set else (64, 3)
    check_kernel(tier_set, D, G, 2, interpret=True, dot_dtype="float16", tol=3e-2, pad=pad,
                 page_lanes=lanes, work_items=work_items, seed=len(tier_set) + pad,
                 rows_in_kernel=work_items is not None, transposed=transposed,
                 tier_weights=(1, 2)[:len(TIER_SETS[tier_set])], values_in_place=True)


@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k2v2"])
def test_values_in_place_agree_with_the_shifted_codes(tier_set):
    # Both launches' dots are exact (float16 codes and weights, float32 sums); they
    # differ by the float32 rounding of the 1024 offsets' removal, up to about 1e-4
    # of the output scale where a partial's probabilities run up to 2^8 (the shifted
    # codes' sums are then multiples of 2^-11; in place, the higher slices' rounding
    # is divided by their powers of two). Every part of the head dim is compared (a
    # wrong power of two shows in its quarter alone, as an error the size of the
    # output).
    base = dict(dot_dtype="float16", logits_dtype="float32", transposed=True, page_lanes=2,
                num_splits=2)
    a = random_partials(tier_set, pdk.LaunchConfig(**base), seed=4)
    b = random_partials(tier_set, pdk.LaunchConfig(values_in_place=True, **base), seed=4)
    (o_a, m_a, l_a), (o_b, m_b, l_b) = a[:3], b[:3]
    np.testing.assert_array_equal(np.asarray(m_a), np.asarray(m_b))
    np.testing.assert_array_equal(np.asarray(l_a), np.asarray(l_b))
    o_a, o_b = np.asarray(o_a), np.asarray(o_b)
    scale = float(np.abs(o_a).max())
    for part in np.split(np.arange(o_a.shape[-1]), 4):
        np.testing.assert_allclose(o_b[..., part], o_a[..., part], atol=1e-3 * scale)


def test_float32_codes_ignore_values_in_place():
    base = dict(dot_dtype="float32", logits_dtype="float32", transposed=True, page_lanes=2)
    a = random_partials("k8v4+k4v2 wide", pdk.LaunchConfig(**base), seed=6)
    b = random_partials("k8v4+k4v2 wide", pdk.LaunchConfig(values_in_place=True, **base), seed=6)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_set", ["k8v4+k4v2 wide", "k8v4+k4v2", "k2v2", "k8v8"])
@pytest.mark.parametrize("D,G,lanes", [(64, 3, 2), (128, 4, 2), (128, 8, 1)])
def test_compiled_values_in_place_match_reference_on_gpu(tier_set, D, G, lanes):
    check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2, pad=8,
                 page_lanes=lanes, work_items=16, seed=140 + G + lanes, rows_in_kernel=True,
                 transposed=True, tier_weights=(1, 2)[:len(TIER_SETS[tier_set])],
                 values_in_place=True)
    check_kernel(tier_set, D, G, 2, interpret=False, dot_dtype="float16", tol=3e-2, pad=16,
                 page_lanes=1, seed=150 + G, values_in_place=True)
