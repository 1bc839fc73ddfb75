"""A decode step's plan on the host, the same arrays for both engines.

The scheduler says which sequences decode (`Step.decode`); `DecodePlan.build` lays them out as
compacted rows -- row i is the i-th sequence, rows past them up to the batch bucket pad -- at the
step's (batch bucket, context bucket) (`wise_core.buckets`). Each engine copies the arrays to its
device and runs the step on them: nothing about where a token's K/V go or which pages a row reads
is decided on the device.

Per row (int32, numpy):
- tokens: the input token, or -1 when it is still on the device (the row's sequence slot's last
  sampled token, which the step reads there: the host launches a step before it has read the
  previous one);
- positions: the token's position (keys the row holds before the step);
- seq_lens: positions + 1, the keys it attends (a padding row: 1, the scratch page's first key);
- slot_mapping: the flat cache index page * page_size + offset where the token's K/V go (a padding
  row: the scratch page's first);
- tags: the WISE token tag, issued once per decoded token by the plan's `TagCounter` (modulo
  TAG_LIMIT, int32 in both frameworks); a WISE support is reused only under its token's tag, so a
  sequence may sit in any row from one step to the next; -1: a padding row;
- seq_slots: the row's sequence slot (the index of its per-sequence device buffers: the token in
  flight, logits-processing state); a padding row: 0, never written;
- page_table int32[rows, width]: the row's pages, the scratch page past them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from wise_core.engine.sequence import Sequence

TAG_LIMIT = 2 ** 31   # tags are int32 on every device: issued modulo this


class TagCounter:
    """Issues WISE token tags: 0, 1, 2, ... modulo TAG_LIMIT (a tag is live for one step, so
    wrapping around after 2**31 tokens cannot meet a support of the same tag)."""

    def __init__(self) -> None:
        self.next = 0

    def issue(self, count: int) -> np.ndarray:
        """`count` consecutive tags, int32[count]."""
        tags = (self.next + np.arange(count, dtype=np.int64)) % TAG_LIMIT
        self.next = int((self.next + count) % TAG_LIMIT)
        return tags.astype(np.int32)


@dataclasses.dataclass
class DecodePlan:
    """One decode step's rows (module docstring): `rows` (the batch bucket) x `width` (the context
    bucket, pages per row), the first `live` rows real."""

    rows: int
    width: int
    live: int
    tokens: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    tags: np.ndarray
    seq_slots: np.ndarray
    page_table: np.ndarray

    @classmethod
    def build(cls, seqs: list[Sequence], *, rows: int, width: int, page_size: int, scratch_page: int,
              tags: TagCounter) -> "DecodePlan":
        """The plan of decoding each of `seqs` one token at `rows` x `width` pages: the step's own
        bucket (`wise_core.buckets`) or a larger one (padding rows and columns change no row's
        result); a bucket that does not hold them is a ValueError."""
        if not seqs:
            raise ValueError("a decode step needs at least one sequence")
        need_rows, need_pages = len(seqs), max(len(seq.pages) for seq in seqs)
        if rows < need_rows or width < need_pages:
            raise ValueError(f"a step of {need_rows} rows of up to {need_pages} pages does not fit "
                             f"{rows} rows x {width} pages")
        plan = cls(rows, width, need_rows,
                   tokens=np.zeros(rows, np.int32), positions=np.zeros(rows, np.int32),
                   seq_lens=np.ones(rows, np.int32), slot_mapping=np.full(rows, scratch_page * page_size, np.int32),
                   tags=np.full(rows, -1, np.int32), seq_slots=np.zeros(rows, np.int32),
                   page_table=np.full((rows, width), scratch_page, np.int32))
        plan.tags[:need_rows] = tags.issue(need_rows)
        for row, seq in enumerate(seqs):
            position = len(seq.tokens) - 1             # its last token, PENDING (-1) while in flight
            page = seq.pages[position // page_size]
            plan.tokens[row], plan.positions[row], plan.seq_lens[row] = seq.tokens[-1], position, position + 1
            plan.slot_mapping[row] = page * page_size + position % page_size
            plan.seq_slots[row] = seq.slot
            plan.page_table[row, :len(seq.pages)] = seq.pages
        return plan
