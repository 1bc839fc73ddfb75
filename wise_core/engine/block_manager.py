"""The page pool: which pages are free, which sequence holds which, growth as sequences grow,
and automatic prefix caching.

A page holds `page_size` tokens of one sequence in every (loop, layer) plane. Pages are taken
as a sequence grows (prefill chunks, then one token per decode step), not reserved for its
whole lifetime, and return to the pool when it finishes, is aborted or is preempted. The
manager only names pages (ints); the framework's device side holds their K/V.

Prefix caching (`prefix_caching=True`): a full page of prompt tokens whose K/V a prefill wrote
gets a content key, a 128-bit BLAKE2b digest of the key of the page before it and its
page_size token ids (so a key names the whole prefix up to the page's end), registered by
`register` once the step that wrote it is launched (later steps run after it, in stream
order). A new sequence first takes, through `match`, the longest run of its prompt's full pages
whose keys are registered (at most all but one prompt token, so that a prefill computes the
first token's logits): shared pages are counted (`refs`), and its prefill starts after them.
A request that scores its prompt (SamplingParams.prompt_logprobs) takes no cached page, as in
vLLM: a cached page's logits were never computed; its prefill runs whole (and registers its
pages for later requests).
Only prompt pages written by prefill are registered, never pages holding generated tokens: a
WISE decode step writes K/V that a dense prefill of the same tokens would not, so a cached
prefix always holds exactly the K/V its prompt would get without the cache. A page whose last
holder lets go keeps its key on an evictable list (least recently released first) that `grow`
takes from after the free pages, dropping the key.

The completions of an n > 1 request share their first completion's full prompt pages
(`fork`, with or without prefix caching): each prefills only the rest of its prompt (less than
a page), so its first token is sampled from its own logits, and writes its own pages from there.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from wise_core.engine.sequence import Sequence

_ROOT = b""   # the key before a prompt's first page


def page_key(previous: bytes, tokens: list[int]) -> bytes:
    """The content key of a full page of `tokens` after the page keyed `previous`."""
    return hashlib.blake2b(previous + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    """num_pages pages of page_size tokens. refs[p]: sequences holding page p; a page on
    neither list is held. Prefix-cache counters: query_tokens (prompt tokens of the sequences
    matched) and hit_tokens (those found cached); forked_tokens: prompt tokens completions took
    from their first completion's pages."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = False):
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.free: deque[int] = deque(range(num_pages))
        self.refs = [0] * num_pages
        self.key_of: dict[int, bytes] = {}          # registered page -> its key
        self.cached: dict[bytes, int] = {}          # key -> registered page
        self.evictable: OrderedDict[int, None] = OrderedDict()   # registered pages no one holds
        self.query_tokens = self.hit_tokens = self.forked_tokens = 0

    @property
    def num_free(self) -> int:
        """Pages `grow` can hand out: free ones and cached ones no sequence holds."""
        return len(self.free) + len(self.evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` keys."""
        return max(self.pages_for(num_tokens) - len(seq.pages), 0)

    def _take(self) -> int:
        if self.free:
            page = self.free.popleft()
        else:   # the least recently released cached page: its key goes
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of.pop(page)]
        self.refs[page] = 1
        return page

    def _drop(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the pages for `num_tokens` keys; False (and nothing taken) if too few are free."""
        needed = self.missing(seq, num_tokens)
        if needed > self.num_free:
            return False
        seq.pages.extend(self._take() for _ in range(needed))
        return True

    def shareable(self, seq: Sequence) -> int:
        """Full pages of seq's prompt that a sequence with the same prompt may share: all short
        of its last token, whose logits a prefill must compute."""
        return (len(seq.prompt) - 1) // self.page_size

    def fork(self, seq: Sequence, parent: Sequence) -> bool:
        """A new sequence with parent's prompt takes parent's full prompt pages, whose prefill
        is launched, and starts after them -> False (nothing taken) if parent holds none now."""
        count = self.shareable(seq)
        if seq.pages or seq.num_cached or parent.num_cached < count * self.page_size or len(parent.pages) < count:
            return False
        for page in parent.pages[:count]:
            self.refs[page] += 1
        seq.pages = parent.pages[:count]
        seq.num_cached = count * self.page_size
        self.forked_tokens += seq.num_cached
        return count > 0

    def unfork(self, seq: Sequence) -> None:
        """Undo `fork` for a sequence that could not start."""
        self.forked_tokens -= seq.num_cached
        self.release(seq)
        seq.num_cached = 0

    def match(self, seq: Sequence) -> None:
        """A new sequence (no pages, nothing cached) takes the registered pages of its prompt's
        longest cached prefix of full pages, short of its last token, and starts after them. A
        sequence that scores its prompt (`Sequence.scores_prompt`) takes none and is not counted:
        its prefill needs the logits of every prompt position."""
        if not self.prefix_caching or seq.pages or seq.num_cached or seq.scores_prompt:
            return
        self.query_tokens += len(seq.prompt)
        key = _ROOT
        for i in range(self.shareable(seq)):
            key = page_key(key, seq.prompt[i * self.page_size:(i + 1) * self.page_size])
            page = self.cached.get(key)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
            seq.pages.append(page)
        seq.num_cached = len(seq.pages) * self.page_size
        self.hit_tokens += seq.num_cached

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match` for a sequence that could not start (its pages back, counters too)."""
        if not self.prefix_caching:
            return
        self.query_tokens -= len(seq.prompt)
        self.hit_tokens -= seq.num_cached
        self.release(seq)
        seq.num_cached = 0

    def register(self, seq: Sequence) -> None:
        """Register `seq`'s full prompt pages whose K/V a launched prefill wrote (up to
        num_cached): a later sequence with the same prefix can `match` them."""
        if not self.prefix_caching:
            return
        key = _ROOT
        for i in range(min(seq.num_cached, len(seq.prompt)) // self.page_size):
            key = page_key(key, seq.prompt[i * self.page_size:(i + 1) * self.page_size])
            if key not in self.cached:   # else: this page (matched), or another holding the same prefix
                self.key_of[seq.pages[i]], self.cached[key] = key, seq.pages[i]

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return the pages `seq` holds past those of its first `num_tokens` keys (speculative
        decoding rolls back the pages of rejected drafts)."""
        keep = self.pages_for(num_tokens)
        self._drop(seq.pages[keep:])
        del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        self._drop(seq.pages)
        seq.pages = []

    def uncached_sole_pages(self, seq: Sequence) -> list[int]:
        """The pages only `seq` holds, their prefix-cache keys dropped: a failed request's pages
        (its K/V may hold NaN) are scrubbed before they go back, and no cached prefix hands them
        on. A page it shares is scrubbed by its last holder: each holder of a shared prompt page
        attends all of it, so NaN there fails them all."""
        pages = [p for p in seq.pages if self.refs[p] == 1]
        for page in pages:
            key = self.key_of.pop(page, None)
            if key is not None:
                del self.cached[key]
        return pages
