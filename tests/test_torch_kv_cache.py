"""wise_torch.kv_cache: the page allocator, page tables, slots and writes."""

import pytest
import torch

from wise_core.config import PRESETS
from wise_torch.kv_cache import KVCacheExhausted, PagedKVCache


def small_cache(num_pages=6, page_size=32):
    return PagedKVCache(planes=3, num_pages=num_pages, page_size=page_size, kv_heads=2, head_dim=4)


def test_reserve_grows_one_page_at_a_time_and_release_returns_pages():
    cache = small_cache()
    assert cache.reserve(7, 1) == [0]
    assert cache.reserve(7, 32) == [0]          # still fits the first page
    assert cache.reserve(7, 33) == [0, 1]       # one more page
    assert cache.reserve(9, 70) == [2, 3, 4]
    cache.release(7)
    assert cache.free_pages == [5, 0, 1]
    assert cache.reserve(9, 100) == [2, 3, 4, 5]  # pages come back in free-list order
    assert cache.reserve(11, 40) == [0, 1]
    with pytest.raises(KeyError, match="request 7 holds no pages"):
        cache.release(7)


def test_exhaustion_is_an_error_and_changes_nothing():
    cache = small_cache(num_pages=3)
    cache.reserve(0, 64)
    with pytest.raises(KVCacheExhausted, match=r"request 1 needs 2 more page\(s\) for 40 tokens, 1 of 3"):
        cache.reserve(1, 40)
    assert 1 not in cache.pages and cache.free_pages == [2]
    with pytest.raises(KVCacheExhausted, match="request 0 needs 2 more"):
        cache.reserve(0, 128)
    assert cache.pages[0] == [0, 1] and cache.free_pages == [2]


def test_page_table_slots_and_decode_batch():
    cache = small_cache()
    cache.free_pages = [4, 1, 5, 0, 2, 3]  # out of order
    cache.reserve(0, 40)
    cache.reserve(1, 10)
    table = cache.page_table([1, 0], max_pages=3)
    assert table.dtype == torch.int32
    assert table.tolist() == [[5, 0, 0], [4, 1, 0]]
    with pytest.raises(ValueError, match="holds 2 pages, more than max_pages=1"):
        cache.page_table([0], max_pages=1)
    batch = cache.decode_batch([0, 1], [40, 10], max_pages=3, wise_slots=[1, 0])
    assert batch.positions.tolist() == [39, 9] and batch.seq_lens.dtype == torch.int32
    assert batch.slot_mapping.tolist() == [1 * 32 + 7, 5 * 32 + 9]
    assert batch.request_ids.tolist() == [0, 1] and batch.wise_slots.tolist() == [1, 0]
    with pytest.raises(ValueError, match="request 1 needs 33 keys but holds 1 page"):
        cache.decode_batch([1], [33], max_pages=3)


def test_write_lands_in_every_addressed_slot_of_one_plane():
    cache = small_cache()
    cache.reserve(0, 64)
    slots = torch.tensor([3, 40, 63])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    cache.write(1, slots, k, v)
    flat_k = cache.k[1].reshape(-1, 2, 4)
    assert torch.equal(flat_k[slots], k) and torch.equal(cache.v[1].reshape(-1, 2, 4)[slots], v)
    assert not cache.k[0].any() and not cache.k[2].any()
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 3


def test_for_model_shapes_and_validation():
    config = PRESETS["test-tiny-gqa"]
    cache = PagedKVCache.for_model(config, num_pages=4, page_size=64, dtype=torch.bfloat16)
    assert cache.k.shape == (4 * 2, 4, 64, 2, 32) and cache.k.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        small_cache(num_pages=0)
