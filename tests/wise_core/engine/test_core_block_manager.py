"""wise_core.engine.block_manager: page accounting and prefix caching (keys, sharing, eviction)."""

from wise_core.engine.block_manager import BlockManager, page_key
from wise_core.engine.sequence import Sequence
from wise_core.sampling_params import SamplingParams


def seq_of(prompt, request_id=0):
    return Sequence(request_id, list(prompt), SamplingParams(), frozenset(), arrival=request_id)


def prefill(blocks, seq):
    """What the engine does for a whole-prompt prefill: pages, progress, registration."""
    assert blocks.grow(seq, len(seq.prompt))
    seq.num_cached = len(seq.prompt)
    blocks.register(seq)


def test_keys_name_the_whole_prefix():
    a = page_key(page_key(b"", [1, 2]), [3, 4])
    assert a == page_key(page_key(b"", [1, 2]), [3, 4]) and len(a) == 16
    assert a != page_key(page_key(b"", [9, 2]), [3, 4])       # same page, another prefix


def test_a_shared_prefix_is_matched_short_of_the_last_token():
    blocks = BlockManager(16, 4, prefix_caching=True)
    first = seq_of(range(10))                                  # pages [0:4) [4:8) full, [8:10) partial
    prefill(blocks, first)
    assert len(blocks.cached) == 2
    same = seq_of(range(10), 1)
    blocks.match(same)
    assert same.pages == first.pages[:2] and same.num_cached == 8
    exact = seq_of(range(8), 2)                                # 8 tokens: at most 7 may be cached -> 1 page
    blocks.match(exact)
    assert exact.pages == first.pages[:1] and exact.num_cached == 4
    other = seq_of([5] + list(range(1, 10)), 3)                # first page differs: nothing
    blocks.match(other)
    assert other.pages == [] and other.num_cached == 0
    assert (blocks.query_tokens, blocks.hit_tokens) == (10 + 8 + 10, 8 + 4)
    assert blocks.refs[first.pages[0]] == 3 and blocks.refs[first.pages[1]] == 2


def test_released_cached_pages_are_evicted_last_and_least_recent_first():
    blocks = BlockManager(4, 2, prefix_caching=True)
    a, b = seq_of([1, 2, 3]), seq_of([7, 8, 9], 1)
    prefill(blocks, a)
    prefill(blocks, b)
    assert blocks.num_free == 0
    blocks.release(a)
    blocks.release(b)
    assert blocks.num_free == 4 and len(blocks.evictable) == 2     # the partial pages are plainly free
    again = seq_of([1, 2, 3], 2)
    blocks.match(again)
    assert again.pages == [0] and blocks.refs[0] == 1 and blocks.num_free == 3   # a's first page
    new = seq_of([4, 4, 4, 4, 4, 4], 3)
    assert blocks.grow(new, 6)                                  # 2 free pages, then b's cached page
    assert set(new.pages) == {1, 3, 2} and len(blocks.cached) == 1
    late = seq_of([7, 8, 9], 4)
    blocks.match(late)
    assert late.pages == []                                     # b's page was evicted with its key


def test_unmatch_gives_back_pages_and_counts():
    blocks = BlockManager(8, 2, prefix_caching=True)
    first = seq_of([1, 2, 3, 4, 5])
    prefill(blocks, first)
    blocks.release(first)
    seq = seq_of([1, 2, 3, 4, 5], 1)
    blocks.match(seq)
    assert seq.num_cached == 4 and blocks.num_free == 6
    blocks.unmatch(seq)
    assert seq.pages == [] and seq.num_cached == 0 and blocks.num_free == 8
    assert (blocks.query_tokens, blocks.hit_tokens) == (0, 0)


def test_without_prefix_caching_nothing_is_keyed():
    blocks = BlockManager(8, 2)
    first = seq_of([1, 2, 3, 4, 5])
    prefill(blocks, first)
    seq = seq_of([1, 2, 3, 4, 5], 1)
    blocks.match(seq)
    assert not blocks.cached and seq.pages == [] and seq.num_cached == 0
    blocks.release(first)
    assert blocks.num_free == 8 and not blocks.evictable
