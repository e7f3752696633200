"""Unified page geometry and the static read widths of the DiffKV cache."""

import pytest

from diffkv_jax.batch import DecodeBatch
from diffkv_jax.diffkv_cache import DiffKVCache
from diffkv_jax.unified_page import Tier, UnifiedPageLayout


def test_k8v4_and_k4v2_share_page_bytes():
    lay = UnifiedPageLayout(128, (Tier(8, 4), Tier(4, 2)), tokens_high=32)
    assert lay.data_bytes == 6144
    assert lay.capacity(0) == 32 and lay.capacity(1) == 64
    assert lay.token_bytes(0) == 192 and lay.token_bytes(1) == 96
    assert lay.used_bytes(0) == lay.used_bytes(1) == lay.data_bytes


@pytest.mark.parametrize("high,low", [((8, 4), (4, 2)), ((8, 4), (8, 2)), ((8, 8), (4, 4)),
                                      ((4, 4), (4, 2)), ((8, 4), (2, 2))])
def test_read_widths_cover_every_token(high, low):
    m = DiffKVCache(1, 1, 16, max_seqs=1, max_context=256, high=Tier(*high), low=Tier(*low),
                    tokens_per_page=4)
    for pages in range(1, m.row_len + 1):
        n_hi, n_lo = m._widths(DecodeBatch(None, None, pages))
        tokens = min(pages, m.row_len) * m.cap(0)
        assert n_hi * m.cap(0) >= min(tokens, m.row_len * m.cap(0))
        assert n_lo * m.cap(1) >= min(tokens, (m.row_len - 1) * m.cap(1)) or n_lo == m.row_len


def test_low_tier_wider_than_high_is_rejected():
    with pytest.raises(ValueError, match="low tier"):
        DiffKVCache(1, 1, 16, max_seqs=1, max_context=64, high=Tier(8, 4), low=Tier(8, 8))
    with pytest.raises(ValueError):
        Tier(3, 4)
