"""The circular free list: disjoint allocation by prefix sum, release, wrapping."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from diffkv_jax import free_list as fl

alloc = jax.jit(fl.allocate, static_argnums=(2,))
release = jax.jit(fl.release)


def test_exclusive_cumsum():
    counts = jnp.asarray([3, 0, 2, 5], jnp.int32)
    offs, total = fl.exclusive_cumsum(counts)
    assert offs.tolist() == [0, 3, 3, 5] and int(total) == 10


def test_allocate_gives_disjoint_slices():
    f = fl.new_free_list(16)
    f, ids, ok = alloc(f, jnp.asarray([2, 0, 3], jnp.int32), 4)
    ids = np.asarray(ids)
    assert bool(ok)
    assert ids[0, :2].tolist() == [0, 1] and (ids[0, 2:] == -1).all()
    assert (ids[1] == -1).all()
    assert ids[2, :3].tolist() == [2, 3, 4]
    assert int(f.num_free) == 11 and int(f.start) == 5


def test_overdraw_allocates_nothing():
    f = fl.new_free_list(4)
    f2, ids, ok = alloc(f, jnp.asarray([3, 2], jnp.int32), 3)
    assert not bool(ok)
    assert (np.asarray(ids) == -1).all()
    assert int(f2.num_free) == 4 and int(f2.start) == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=4, max_size=4)),
                min_size=1, max_size=60))
def test_random_alloc_release_sequence_keeps_pages_unique(ops):
    P = 13
    f = fl.new_free_list(P)
    owned: list[int] = []
    for do_release, counts in ops:
        if do_release and owned:
            k = len(owned) // 2 + 1
            back, owned = owned[:k], owned[k:]
            ids = np.full((2, len(back)), -1, np.int32)
            ids[0] = back
            f = release(f, jnp.asarray(ids))
        else:
            f, ids, ok = alloc(f, jnp.asarray(counts, jnp.int32), 3)
            got = [int(x) for x in np.asarray(ids).ravel() if x >= 0]
            assert bool(ok) == (sum(counts) <= P - len(owned))
            owned += got
        ring = np.asarray(f.pages)
        n, s = int(f.num_free), int(f.start)
        free = [int(ring[(s + i) % P]) for i in range(n)]
        assert 0 <= s < P
        assert len(set(owned)) == len(owned), "a page is owned twice"
        assert sorted(free + owned) == list(range(P)), "pages lost or duplicated"
