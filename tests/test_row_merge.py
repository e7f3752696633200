"""The work items' merge as one launch (pallas_kernels/row_merge.py) against
paged_decode.merge_work (XLA segment reductions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk
from pallas_kernels.row_merge import merge_rows


def partials(rng, S=4, H=3, G=3, D=32, N=24, max_pages=8):
    """Random partials over a planned work list; row (0, 1) and sequence 2 hold no
    pages (no items)."""
    pages = jnp.asarray(rng.integers(1, max_pages + 1, size=(S, H)), jnp.int32)
    pages = pages.at[0, 1].set(0).at[2].set(0)
    work = pdk.plan_work(pages, N)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    o, m = f(N, G, D), f(N, G) * 3
    l = jnp.asarray(rng.uniform(0.5, 20, size=(N, G)), jnp.float32)
    extra = (f(S, H, G, D), f(S, H, G) * 3, jnp.ones((S, H, G), jnp.float32))
    return work, o, m, l, extra, (S, H)


def check(got, ref, rtol):
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), rtol=rtol,
                                   atol=rtol)


@pytest.mark.parametrize("with_extra", [False, True], ids=["items", "items+extra"])
@pytest.mark.parametrize("G,D,per_step,dim_blocks",
                         [(3, 32, 1, 1), (4, 64, 4, 2), (1, 16, 8, 1), (3, 32, 16, 4)])
def test_matches_the_segment_merge(with_extra, G, D, per_step, dim_blocks):
    # Online (rescaled at each block's new max) against the global max first: equal
    # up to rounding; rows without items are zeros with M = NEG_INF, L = 0. Rows
    # hold 1 - 8 items: blocks of 4 - 16 leave lanes past the row (masked).
    rng = np.random.default_rng(G * 10 + D + with_extra + per_step)
    work, o, m, l, extra, (S, H) = partials(rng, G=G, D=D)
    ex = extra if with_extra else None
    got = merge_rows(o, m, l, work, S, H, ex, items_per_step=per_step, dim_blocks=dim_blocks,
                     interpret=True)
    ref = pdk.merge_work(o, m, l, work, S, H, ex)
    check(got, ref, 2e-5)
    if not with_extra:
        assert float(jnp.abs(got[0][2]).max()) == 0 and float(got[2][0, 1].max()) == 0
        assert float(jnp.abs(got[0][1]).min()) > 0  # rows with items are not zeros


@pytest.mark.parametrize("per_step,dim_blocks", [(2, 1), (4, 1), (4, 2)])
def test_rows_of_several_blocks(per_step, dim_blocks):
    # Few long rows, as a small batch's step: each row folds several blocks, the
    # last one partly past the row.
    rng = np.random.default_rng(39)  # rows of 20, 5 and 11 items
    work, o, m, l, extra, (S, H) = partials(rng, S=2, H=2, N=40, max_pages=40)
    counts = np.asarray(work.ranges)[:, 1]
    assert counts.max() > 2 * per_step and (counts % per_step).any()
    for ex in (None, extra):
        got = merge_rows(o, m, l, work, S, H, ex, items_per_step=per_step,
                         dim_blocks=dim_blocks, interpret=True)
        check(got, pdk.merge_work(o, m, l, work, S, H, ex), 2e-5)


def test_output_dtype_and_a_work_list_without_ranges():
    rng = np.random.default_rng(5)
    work, o, m, l, _, (S, H) = partials(rng)
    out = merge_rows(o, m, l, work, S, H, out_dtype=jnp.bfloat16, interpret=True)[0]
    ref = pdk.merge_work(o, m, l, work, S, H)[0]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="ranges"):
        merge_rows(o, m, l, pdk.WorkList(work.items, work.seg, S * H), S, H, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        merge_rows(o, m, l, work, S, H, items_per_step=6, interpret=True)
    with pytest.raises(ValueError, match="dim_blocks"):
        merge_rows(o, m, l, work, S, H, dim_blocks=3, interpret=True)


@pytest.mark.parametrize("dim_blocks", [1, 2])
def test_launch_lowers_to_triton_for_cuda(dim_blocks):
    # The GPU path (masked stores of the real rows, gathers by row index) through
    # Pallas' Triton lowering, on any machine.
    rng = np.random.default_rng(6)
    work, o, m, l, extra, (S, H) = partials(rng, G=3, D=64)
    fn = lambda o: merge_rows(o, m, l, work, S, H, extra, dim_blocks=dim_blocks,  # noqa: E731
                              interpret=False)
    text = jax.jit(fn).trace(o).lower(lowering_platforms=("cuda",)).as_text()
    assert "merge_rows" in text and "triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("G,D", [(3, 64), (4, 128), (8, 128)])
def test_compiled_merge_matches_on_gpu(G, D):
    rng = np.random.default_rng(40 + G)
    work, o, m, l, extra, (S, H) = partials(rng, S=6, H=8, G=G, D=D, N=96)
    for ex in (None, extra):
        for per_step, dim_blocks in ((1, 1), (8, 1), (16, 1), (8, 4)):
            check(merge_rows(o, m, l, work, S, H, ex, items_per_step=per_step,
                             dim_blocks=dim_blocks),
                  pdk.merge_work(o, m, l, work, S, H, ex), 1e-4)
