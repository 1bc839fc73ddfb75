"""wise_torch.kv_cache storage and the engine's block manager (page growth and release)."""

import pytest
import torch

from wise_core.engine.block_manager import BlockManager
from wise_core.engine.sequence import Sequence
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_torch.kv_cache import PagedKVCache


def seq(n=1):
    return Sequence(0, [1] * n, SamplingParams(), frozenset(), arrival=0)


def test_grow_takes_pages_as_needed_and_release_returns_them():
    blocks = BlockManager(num_pages=4, page_size=64)
    s = seq()
    assert blocks.grow(s, 1) and s.pages == [0]
    assert blocks.grow(s, 64) and s.pages == [0]          # still one page
    assert blocks.grow(s, 65) and s.pages == [0, 1]
    assert blocks.num_free == 2
    blocks.release(s)
    assert s.pages == [] and blocks.num_free == 4


def test_exhaustion_takes_nothing():
    blocks = BlockManager(num_pages=2, page_size=32)
    s = seq()
    assert blocks.grow(s, 32)
    assert not blocks.grow(s, 32 * 3)                      # needs 2 more, 1 free
    assert s.pages == [0] and blocks.num_free == 1


def test_storage_shapes_scratch_page_and_slots():
    config = PRESETS["test-tiny-gqa"]
    cache = PagedKVCache.for_model(config, num_pages=4, page_size=64, dtype=torch.bfloat16)
    assert cache.k.shape == (4 * 2, 5, 64, 2, 32) and cache.k.dtype == torch.bfloat16
    assert cache.scratch_page == 4                        # the extra page no request holds
    assert cache.slot([3, 1], 70) == 1 * 64 + 6
    assert PagedKVCache.page_bytes(config, 64, torch.bfloat16) == cache.k[:, 0].numel() * 2 * 2
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        PagedKVCache.for_model(config, num_pages=0, page_size=64)
