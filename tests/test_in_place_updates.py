"""The compiled decode step updates the donated page pool in place (no pool copies)."""

import jax.numpy as jnp
import pytest

from diffkv_jax.batch import DecodeBatch
from diffkv_jax.methods import make_method
from diffkv_jax.steps import CompiledSteps


def pool_copies(cfg, params, kind, **opts):
    m = make_method(kind, cfg, max_seqs=4, max_context=128, **opts)
    state = m.init_state(300)
    batch = DecodeBatch(jnp.zeros(4, jnp.int32), jnp.ones(4, bool), 4)
    text = CompiledSteps(cfg, m, jnp.float32).decode.lower(params, state, batch).compile().as_text()
    pool = state.data if kind == "diffkv" else state.k_pages
    dtype = {"uint8": "u8", "float32": "f32"}[pool.dtype.name]
    shape = f"{dtype}[{','.join(map(str, pool.shape))}]"
    assert "input_output_alias" in text  # the state is donated
    return [ln for ln in text.splitlines() if " copy(" in ln and shape in ln]


def test_full_cache_decode_has_no_pool_copy(tiny_model):
    assert pool_copies(*tiny_model, "full") == []


def test_diffkv_high_tier_only_decode_has_no_pool_copy(tiny_model):
    assert pool_copies(*tiny_model, "diffkv", low_tier=False) == []


def test_diffkv_decode_has_no_pool_copy(tiny_model):
    # Demotion reads the victim and writes the low tier: the read must be one
    # gather every write depends on, or XLA copies the pool (a regression guard).
    assert pool_copies(*tiny_model, "diffkv") == []


@pytest.mark.parametrize("writes", ["xla", pytest.param("pallas", marks=pytest.mark.gpu),
                                    pytest.param("pallas+decide", marks=pytest.mark.gpu)])
def test_diffkv_kernel_decode_has_no_side_array_copy(tiny_model, writes):
    # The kernel path updates scores inside a kernel (aliased) and writes the
    # pool, metadata and positions by scatter or by the token-writes kernel
    # (aliased): none of them may be copied. The token-writes kernel is checked
    # compiled on the GPU: in interpret mode its reads of the pool it writes run
    # as a loop of gathers and scatters, which XLA may copy around.
    cfg, params = tiny_model
    decide = "pallas" if writes.endswith("+decide") else "xla"
    writes = writes.split("+")[0]
    if writes == "pallas":  # the GPU kernels' K4V2 slices need head dim 64
        import dataclasses

        import jax

        from models.llama import init_params

        cfg = dataclasses.replace(cfg, head_dim=64)
        params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    m = make_method("diffkv", cfg, max_seqs=4, max_context=128, attention_impl="pallas",
                    write_impl=writes, decide_impl=decide)
    state = m.init_state(300)
    batch = DecodeBatch(jnp.zeros(4, jnp.int32), jnp.ones(4, bool), 4)
    text = CompiledSteps(cfg, m, jnp.float32).decode.lower(params, state, batch).compile().as_text()
    shapes = {f"{'u8' if a.dtype.name == 'uint8' else a.dtype.name[0] + a.dtype.name[-2:]}"
              f"[{','.join(map(str, a.shape))}]"
              for a in (state.data, state.k_meta, state.scores, state.positions)}
    shapes = {s.replace("i32", "s32") for s in shapes}
    assert len(shapes) == 4 and all(s in text for s in shapes)  # the names HLO prints
    copies = [ln for ln in text.splitlines() if " copy(" in ln and any(s in ln for s in shapes)]
    assert copies == []
