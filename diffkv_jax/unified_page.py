"""Unified pages: one page size for every precision tier.

A page holds the tokens of one (sequence, layer, KV head) at one precision.
Its data bytes are fixed; a tier with fewer bits per token fits more tokens in
the same bytes (K8V4: T tokens, K4V2: 2T tokens for the same ``T * 1.5 * D``
bytes), so a page is always full of useful data. Inside the data blob a tier
stores ``[capacity, key_width]`` packed keys token-major, then
``[value_width, capacity]`` packed values byte-dim-major (the layout the
decode kernel reads, :mod:`pallas_kernels.paged_decode`). Per-token metadata
(key/value scale and zero packed in one uint32 each, accumulated score,
position) lives in side arrays that share the page ID, sized for the tier
with the most tokens per page.
"""

from __future__ import annotations

import dataclasses

from diffkv_jax.quantization import packed_width

METADATA_BYTES_PER_SLOT = 4 * 2 + 4 + 4  # k/v scale+zero (fp16), score (f32), position (i32)


@dataclasses.dataclass(frozen=True)
class Tier:
    """Bits per key and per value element of one precision tier."""

    k_bits: int
    v_bits: int

    def __post_init__(self):
        for b in (self.k_bits, self.v_bits):
            if b not in (2, 4, 8):
                raise ValueError(f"tier bits must be 8, 4 or 2, got K{self.k_bits}V{self.v_bits}")

    def token_bytes(self, head_dim: int) -> int:
        return packed_width(head_dim, self.k_bits) + packed_width(head_dim, self.v_bits)

    def __str__(self) -> str:
        return f"K{self.k_bits}V{self.v_bits}"


@dataclasses.dataclass(frozen=True)
class UnifiedPageLayout:
    """Byte geometry of a unified page for a head dim and a list of tiers (high first).

    ``tokens_high`` K/V tokens of the first tier fill the data bytes exactly; every
    other tier gets ``data_bytes // token_bytes`` slots.
    """

    head_dim: int
    tiers: tuple[Tier, ...]
    tokens_high: int = 32

    @property
    def data_bytes(self) -> int:
        return self.tokens_high * self.tiers[0].token_bytes(self.head_dim)

    def capacity(self, tier: int) -> int:
        """Token slots of a page of tier ``tier``."""
        return self.data_bytes // self.tiers[tier].token_bytes(self.head_dim)

    @property
    def slots(self) -> int:
        """Metadata slots per page (the largest tier capacity)."""
        return max(self.capacity(t) for t in range(len(self.tiers)))

    def key_width(self, tier: int) -> int:
        return packed_width(self.head_dim, self.tiers[tier].k_bits)

    def value_width(self, tier: int) -> int:
        return packed_width(self.head_dim, self.tiers[tier].v_bits)

    def token_bytes(self, tier: int) -> int:
        """Bytes between consecutive tokens of a tier (packed key then packed value)."""
        return self.tiers[tier].token_bytes(self.head_dim)

    def used_bytes(self, tier: int) -> int:
        """Data bytes a full page of the tier occupies (== data_bytes when the tier fits exactly)."""
        return self.capacity(tier) * self.token_bytes(tier)

    @property
    def page_bytes(self) -> int:
        """Bytes one page costs: data plus its metadata side arrays."""
        return self.data_bytes + self.slots * METADATA_BYTES_PER_SLOT
