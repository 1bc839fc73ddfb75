"""The page pool: which pages are free, which sequence holds which, growth as sequences grow.

A page holds `page_size` tokens of one sequence in every (loop, layer) plane. Pages are taken
as a sequence grows (prefill chunks, then one token per decode step), not reserved for its
whole lifetime, and all return to the pool when it finishes, is aborted or is preempted.
The manager only names pages (ints); the framework's device side holds their K/V.

Prefix caching fits here later without changing its callers: a full page gets a content hash
(of the hash of the page before it and its page_size token ids) and a reference count; `grow`
first looks up a sequence's full prompt pages by hash and shares those it finds (count + 1,
num_cached advanced past them), `release` and `trim` decrement counts and put a page whose
count reaches 0 on an evictable list (still hashed) that `grow` takes from after the free
pages. The scheduler's budget checks already go through `missing` and `num_free`.
"""

from __future__ import annotations

from collections import deque

from wise_core.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` keys."""
        return max(self.pages_for(num_tokens) - len(seq.pages), 0)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the pages for `num_tokens` keys; False (and nothing taken) if too few are free."""
        needed = self.missing(seq, num_tokens)
        if needed > len(self.free):
            return False
        seq.pages.extend(self.free.popleft() for _ in range(needed))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return the pages `seq` holds past those of its first `num_tokens` keys (speculative
        decoding rolls back the pages of rejected drafts)."""
        keep = self.pages_for(num_tokens)
        self.free.extend(seq.pages[keep:])
        del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.pages)
        seq.pages = []
