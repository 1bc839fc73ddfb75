"""wise_jax.kv_cache: page allocation and release under jit and eagerly, the scratch page, and the writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wise_core.presets import PRESETS
from wise_jax import kv_cache as kvc

CONFIG = PRESETS["test-tiny"]


def _cache(batch=3, max_pages=4, num_pages=8, page_size=32):
    return kvc.create(CONFIG, batch=batch, max_pages=max_pages, num_pages=num_pages, page_size=page_size)


def _held(cache):
    """Pages each row holds, per the page table and its length."""
    n = np.asarray(kvc.pages_for(cache.seq_lens, cache.page_size))
    return [np.asarray(cache.page_table)[b, :n[b]].tolist() for b in range(len(n))]


def _check_consistent(cache):
    held = sum(_held(cache), [])
    free = np.asarray(cache.free_pages)[:int(cache.num_free)].tolist()
    assert len(set(held)) == len(held), "a page is held twice"
    assert sorted(held + free) == list(range(cache.num_pages)), "pages lost or duplicated"


def test_layout_and_errors():
    cache = _cache()
    assert cache.k.shape == (4 * 2, 8 + 1, 32, 2, 64)  # planes = loops * layers; + the scratch page
    assert (cache.page_size, cache.max_pages, cache.capacity, cache.num_pages) == (32, 4, 128, 8)
    assert cache.scratch_page == 8 and np.all(np.asarray(cache.page_table) == 8)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        _cache(page_size=0)


def test_reserve_allocates_at_page_boundaries_and_release_returns_pages():
    reserve = jax.jit(kvc.reserve)
    cache = reserve(_cache(), jnp.array([1, 32, 33], jnp.int32))
    assert [len(p) for p in _held(cache)] == [1, 1, 2]
    assert int(cache.num_free) == 4
    _check_consistent(cache)
    table_before = np.asarray(cache.page_table).copy()
    cache = reserve(cache, jnp.array([2, 33, 33], jnp.int32))   # only row 1 crosses a boundary
    assert [len(p) for p in _held(cache)] == [1, 2, 2] and int(cache.num_free) == 3
    assert np.array_equal(np.asarray(cache.page_table)[:, 0], table_before[:, 0])   # existing pages stay
    assert np.asarray(cache.seq_lens).tolist() == [2, 33, 33]
    _check_consistent(cache)

    cache = jax.jit(kvc.release)(cache, jnp.array([False, True, False]))
    assert np.asarray(cache.seq_lens).tolist() == [2, 0, 33] and int(cache.num_free) == 5
    assert np.all(np.asarray(cache.page_table)[1] == cache.scratch_page)     # never another request's page
    _check_consistent(cache)
    cache = reserve(cache, jnp.array([2, 128, 33], jnp.int32))  # the released pages serve again
    assert int(cache.num_free) == 1 and not bool(cache.overflowed)
    _check_consistent(cache)


def test_exhaustion_raises_eagerly_and_flags_under_jit():
    cache = _cache(num_pages=3)
    with pytest.raises(kvc.PoolExhaustedError, match="needs 4 pages but only 3 of 3 are free"):
        kvc.reserve(cache, jnp.array([64, 64, 0], jnp.int32))
    with pytest.raises(kvc.PoolExhaustedError, match=r"rows \[2\] need \[129\] keys"):
        kvc.reserve(cache, jnp.array([1, 1, 129], jnp.int32))
    over = jax.jit(kvc.reserve)(cache, jnp.array([64, 64, 0], jnp.int32))
    assert bool(over.overflowed)
    assert int(over.num_free) == 3 and np.asarray(over.seq_lens).tolist() == [0, 0, 0]   # nothing granted


def test_insert_and_token_writes_land_in_the_rows_pages():
    rng = np.random.default_rng(0)
    cache = kvc.reserve(_cache(), jnp.array([0, 3, 0], jnp.int32))
    k = rng.standard_normal((8, 64, 2, 64)).astype(np.float32)                # 2 pages of one request
    cache = jax.jit(kvc.insert)(cache, jnp.asarray(k), jnp.asarray(-k), jnp.int32(40), jnp.int32(0))
    table = np.asarray(cache.page_table)
    assert np.asarray(cache.seq_lens).tolist() == [40, 3, 0] and int(cache.num_free) == 5
    for plane in (0, 5):
        np.testing.assert_array_equal(np.asarray(cache.k[plane])[table[0, :2]].reshape(64, 2, 64), k[plane])
        np.testing.assert_array_equal(np.asarray(cache.v[plane])[table[0, :2]].reshape(64, 2, 64), -k[plane])
    _check_consistent(cache)

    before = np.asarray(cache.k).copy()
    cache = kvc.reserve(cache, jnp.array([41, 4, 0], jnp.int32))
    token = rng.standard_normal((3, 2, 64)).astype(np.float32)
    cache = jax.jit(kvc.write_token)(cache, 7, jnp.asarray(token), jnp.asarray(token), jnp.array([True, True, False]))
    table = np.asarray(cache.page_table)
    for b, pos in enumerate([40, 3]):
        np.testing.assert_array_equal(np.asarray(cache.v[7, table[b, pos // 32], pos % 32]), token[b])
    changed = np.argwhere(np.any(np.asarray(cache.k) != before, axis=(2, 3, 4)))
    # rows 0 and 1 in their pages; row 2 (not written) on the scratch page 8
    assert sorted(map(tuple, changed.tolist())) == sorted([(7, table[0, 1]), (7, table[1, 0]), (7, 8)])
    k_pages, _, shifted = kvc.plane_pages(cache, 7)
    assert k_pages.shape == (8 * 9, 32, 2, 64)
    np.testing.assert_array_equal(np.asarray(k_pages[shifted[0, 1], 40 % 32]), token[0])


def test_insert_that_does_not_fit_writes_nothing():
    cache = kvc.reserve(_cache(num_pages=3), jnp.array([0, 64, 0], jnp.int32))        # 1 page left
    k = jnp.ones((8, 64, 2, 64), jnp.float32)
    over = jax.jit(kvc.insert)(cache, k, k, jnp.int32(40), jnp.int32(0))
    assert bool(over.overflowed) and np.asarray(over.seq_lens).tolist() == [0, 64, 0]
    assert int(over.num_free) == 1 and not np.asarray(over.k[:, :3]).any()      # only the scratch page written
