"""Per-call inputs of the jitted prefill and decode steps."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class PrefillBatch:
    """Prompts to prefill, padded to a bucketed shape.

    Attributes:
      tokens: ``[B, T]`` int32, right-padded.
      lengths: ``[B]`` int32 true prompt lengths (0 for padding rows).
      slots: ``[B]`` int32 cache slot of each row (padding rows use the scratch slot).
    """

    tokens: jax.Array
    lengths: jax.Array
    slots: jax.Array


@struct.dataclass
class DecodeBatch:
    """One new token for every slot.

    Attributes:
      tokens: ``[S]`` int32 last sampled token of each slot.
      active: ``[S]`` bool, slots that decode this step.
      num_page_slots: static; pages of each row the attention reads (a bucket that
        covers the longest active row), so short batches read short rows.
    """

    tokens: jax.Array
    active: jax.Array
    num_page_slots: int = struct.field(pytree_node=False, default=1)
