"""JetStream-style entry points: prefill / insert / generate as functions over the state.

For serving stacks that bring their own scheduler (JetStream's orchestrator,
or any loop of the same shape) instead of :class:`diffkv_jax.engine.Engine`.
Everything here is a thin wrapper around the jitted steps of
:mod:`diffkv_jax.steps` (no model code of its own); the cache state is a
pytree that goes in and comes back out, and it is *donated*: always continue
with the returned state, never the one passed in.

The first argument, ``engine_or_steps``, is a :class:`~diffkv_jax.steps.CompiledSteps`
or anything that holds one as ``.steps`` (a ``Generator`` or ``Engine``, whose
jitted functions are then shared). ``init_state`` gives a fresh state.

One request goes through::

    slot = insert(active)                                    # choose its decode slot
    state, first, free = prefill(steps, params, state, prompt, slot=slot)
    # ... then, every step, for all slots at once:
    batch = decode_batch(steps, last_tokens, active, lengths)
    state, tokens, free = generate(steps, params, state, batch,
                                   sampling_arrays(per_slot_sampling, per_slot_steps))
    # ... and when it is done:
    state = release(steps, state, [slot])

How this differs from JetStream's ``prefill -> Prefix -> insert(prefix,
decode_state, slot)``: there is no separate prefix to copy. :func:`prefill`
writes the prompt's KV straight into the pages of a decode slot, so the slot
must be chosen first, and :func:`insert` *is* that choice (it returns the slot
to prefill into; nothing is copied and the device is not touched). The slot
then decodes as soon as the caller marks it active in :func:`decode_batch`
with ``first`` as its input token.

What stays the caller's job: stop conditions (stop tokens, lengths, stop
strings), and admission. A decode step may allocate up to
``rows * num_layers * num_kv_heads * method.max_new_pages_per_row`` pages
(``rows`` = active slots); the free-page count returned by every call is what
to admit against (``Engine`` does this, with a tighter bound from the cache's
``growth_bound``: :func:`diffkv_jax.steps.pool_counts`). When the pool runs
dry the allocator sets ``state.alloc_failed``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffkv_jax.batch import DecodeBatch, PrefillBatch
from diffkv_jax.generation import (GenerationInputError, Generator, SamplingParams,
                                   decode_width, prompt_bucket)
from diffkv_jax.sampling import SamplingArrays, sample
from diffkv_jax.steps import CompiledSteps

_sample = jax.jit(sample)


def compiled_steps(engine_or_steps) -> CompiledSteps:
    """The :class:`CompiledSteps` of ``engine_or_steps`` (itself, or its ``.steps``)."""
    if isinstance(engine_or_steps, CompiledSteps):
        return engine_or_steps
    steps = getattr(engine_or_steps, "steps", None)
    if isinstance(steps, CompiledSteps):
        return steps
    raise TypeError(f"expected CompiledSteps or an object with .steps, got "
                    f"{type(engine_or_steps).__name__}")


def init_state(engine_or_steps, num_pages: int):
    """A fresh cache state with ``num_pages`` usable pages and every slot empty."""
    return compiled_steps(engine_or_steps).method.init_state(num_pages)


def insert(active: Sequence[bool], slot: int | None = None) -> int:
    """Choose the decode slot for the next sequence (call it *before* :func:`prefill`).

    ``active`` marks the slots in use (length ``method.max_seqs``). Returns
    ``slot`` if given and free, else the lowest free slot; raises
    :class:`GenerationInputError` when there is none. See the module docstring
    for why insertion is only a choice here.
    """
    active = np.asarray(active, bool)
    if slot is not None:
        if not 0 <= slot < len(active):
            raise GenerationInputError(f"slot {slot} is outside 0..{len(active) - 1}")
        if active[slot]:
            raise GenerationInputError(f"slot {slot} is in use")
        return int(slot)
    free = np.flatnonzero(~active)
    if len(free) == 0:
        raise GenerationInputError("every decode slot is in use")
    return int(free[0])


def sampling_arrays(sampling: Sequence[SamplingParams],
                    steps: Sequence[int]) -> SamplingArrays:
    """Per-row sampling parameters; ``steps[i]``: tokens row ``i`` has generated so far
    (the position in its random stream; what makes sampled outputs match ``Engine``'s)."""
    return Generator._sampling_arrays(list(sampling), len(sampling),
                                      np.asarray(steps, np.int32))


def prefill(engine_or_steps, params, state, tokens: Sequence[int], *, slot: int,
            sampling: SamplingParams | None = None, step: int = 0):
    """Prefill ``tokens`` (one sequence) into ``slot`` and sample its first new token.

    ``step`` is the number of tokens the sequence generated before (non-zero
    when a preempted sequence is recomputed from prompt + output). The prompt
    length is bucketed to a power of two (at least 16), as ``Engine`` does.

    Returns ``(state, first_token, free_pages)``: device scalars (int32).
    """
    steps = compiled_steps(engine_or_steps)
    method = steps.method
    tokens = [int(t) for t in tokens]
    if not 0 < len(tokens) < method.max_context:
        raise GenerationInputError(
            f"{len(tokens)} tokens; a slot holds 1 to {method.max_context - 1} before decoding")
    if not 0 <= slot < method.max_seqs:
        raise GenerationInputError(f"slot {slot} is outside 0..{method.max_seqs - 1}")
    T = prompt_bucket(len(tokens))
    padded = np.zeros((1, T), np.int32)
    padded[0, :len(tokens)] = tokens
    batch = PrefillBatch(jnp.asarray(padded), jnp.asarray([len(tokens)], jnp.int32),
                         jnp.asarray([slot], jnp.int32))
    state, logits = steps.prefill(params, state, batch)
    first = _sample(logits, sampling_arrays([sampling or SamplingParams()], [step]))
    return state, first[0], state.free.num_free


def decode_batch(engine_or_steps, tokens: Sequence[int], active: Sequence[bool],
                 lengths: Sequence[int]) -> DecodeBatch:
    """The inputs of one :func:`generate` call, for all ``method.max_seqs`` slots.

    ``tokens[s]``: slot ``s``'s last token (its first token right after
    prefill); ``active[s]``: whether it decodes; ``lengths[s]``: its prompt
    length plus the tokens generated so far (``tokens[s]`` included). The
    shape bucket (pages read, :func:`~diffkv_jax.generation.decode_width`) is the
    one ``Engine`` uses, so each bucket compiles once.
    """
    method = compiled_steps(engine_or_steps).method
    active = np.asarray(active, bool)
    longest = int(np.max(np.asarray(lengths)[active], initial=0))
    width = decode_width(method, longest + 1)
    return DecodeBatch(jnp.asarray(np.asarray(tokens, np.int32)), jnp.asarray(active), width)


def generate(engine_or_steps, params, state, batch: DecodeBatch, sampling: SamplingArrays):
    """One decode step for every active slot of ``batch``.

    ``sampling`` has one row per slot (:func:`sampling_arrays`). Returns
    ``(state, tokens [S], free_pages [])``; entries of inactive slots are
    meaningless. This is ``steps.decode_and_sample``, the step ``Engine`` runs
    (which also returns the bound on the next steps' page growth that the
    engine admits by; ``Engine`` keeps it).
    """
    state, tokens, counts = compiled_steps(engine_or_steps).decode_and_sample(
        params, state, batch, sampling)
    return state, tokens, counts[0]


def release(engine_or_steps, state, slots: Sequence[int]):
    """Return the pages of ``slots`` to the pool; they are free for :func:`insert` again."""
    steps = compiled_steps(engine_or_steps)
    mask = np.zeros(steps.method.max_seqs + 1, bool)
    mask[list(slots)] = True
    return steps.release(state, jnp.asarray(mask))


__all__ = ["compiled_steps", "init_state", "insert", "prefill", "sampling_arrays",
           "decode_batch", "generate", "release"]
