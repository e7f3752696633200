"""Per-call inputs of the jitted prefill and decode steps."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class PrefillBatch:
    """Prompts to prefill, padded to a bucketed shape.

    Attributes:
      tokens: ``[B, T]`` int32, right-padded.
      lengths: ``[B]`` int32 true prompt lengths (0 for padding rows); in a chunk,
        the chunk's tokens.
      slots: ``[B]`` int32 cache slot of each row (padding rows use the scratch slot).
      start: ``[B]`` int32 or None. A chunk of a longer prompt (chunked prefill,
        only for methods with ``supports_chunked_prefill``): tokens of each row
        already in the cache; ``tokens`` continue from position ``start``. None:
        whole prompts.
      total: ``[B]`` int32 or None (with ``start``): the whole prompt's length; a
        row's first chunk (``start == 0``) allocates the pages of all of it.
      num_page_slots: static, with ``start``: pages per row that the first
        chunks allocate and the chunks' attention reads (a bucket covering the
        longest ``total``).
    """

    tokens: jax.Array
    lengths: jax.Array
    slots: jax.Array
    start: jax.Array | None = None
    total: jax.Array | None = None
    num_page_slots: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class DecodeBatch:
    """One new token for every slot.

    Attributes:
      tokens: ``[S]`` int32 last sampled token of each slot.
      active: ``[S]`` bool, slots that decode this step.
      num_page_slots: static; pages of each row the attention reads (a bucket that
        covers the longest active row), so short batches read short rows.
      work: filled by the cache method's ``begin_decode`` inside the step (callers
        leave it None): the Pallas attention launches' work items of every
        layer, which split the active rows' pages into equal pieces.
    """

    tokens: jax.Array
    active: jax.Array
    num_page_slots: int = struct.field(pytree_node=False, default=1)
    work: Any = None
