"""The inputs of a step, from the host to the device: a decode step's rows, a prefill's chunks.

Decode: the host lays a step out as a `DecodePlan` at a (batch bucket, context bucket) and
writes it into pinned host memory (`DecodeStaging.stage`); one asynchronous copy per buffer
then fills the static device buffers that the step (eager or its CUDA graph) reads
(`DecodeStaging.copy_in`). Two host stagings are used in turn: a step's copy may still be
queued when the next step is staged, never when the one after it is (the host has read that
step's tokens by then). The page table of a step at (bucket, width) is the first bucket * width
entries of a flat buffer, as [bucket, width] (`table_view`).

Prefill: a step's chunks packed as flat host lists (`PrefillInputs.pack`: chunks of one
(start, length) form a group, in the order SDPA and the varlen call run them), made device
tensors by `PrefillInputs.device_inputs`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from wise_core.engine.scheduler import Chunk
from wise_core.engine.step_plan import DecodePlan
from wise_torch.kv_cache import PagedKVCache, PrefillBatch, PrefillGroup, VarlenPrefill


def table_view(flat: torch.Tensor, bucket: int, width: int) -> torch.Tensor:
    """A page-table buffer as the [bucket, width] table of a step."""
    return flat[:bucket * width].view(bucket, width)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """A decode step's per-row inputs on the device, each int64[bucket]: the rows of the
    staging's metadata int64[len(DECODE_ROWS), rows] in field order, the `DecodePlan` fields of
    the same names (tokens: -1 where the token is in flight, read from the slot's next token)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    tags: torch.Tensor
    seq_slots: torch.Tensor


DECODE_ROWS = tuple(field.name for field in dataclasses.fields(DecodeRows))   # the metadata's rows, in order


class DecodeStaging:
    """A decode step's inputs (module docstring) for up to `rows` rows of `max_pages` pages:
    the static device buffers meta int64[len(DECODE_ROWS), rows], page_table
    int32[rows * max_pages] and seq_lens int32[rows] (the keys each row attends, as the
    attention reads them), and two pinned host stagings of meta and page_table; `staged`
    counts the steps staged (the staging in use: staged % 2)."""

    def __init__(self, rows: int, max_pages: int, device: torch.device):
        pin = device.type == "cuda"
        self.meta = torch.zeros(len(DECODE_ROWS), rows, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(rows * max_pages, dtype=torch.int32, device=device)
        self.host_meta = [torch.zeros(len(DECODE_ROWS), rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_table = [torch.zeros(rows * max_pages, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.staged = 0
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)

    def _next(self, bucket: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The host staging of the next step as numpy views: meta int64[6, rows], table
        int32[bucket, width]."""
        self.staged += 1
        table = table_view(self.host_table[self.staged % 2], bucket, width)
        return self.host_meta[self.staged % 2].numpy(), table.numpy()

    def stage(self, plan: DecodePlan, pages: int) -> tuple[np.ndarray, np.ndarray]:
        """Fill the next host staging with `plan` (its padding rows and the columns past a
        row's pages on the scratch page) -> its views meta int64[6, plan.rows] and table
        int32[plan.rows, pages] (`pages`: those of the longest row)."""
        meta, table = self._next(plan.rows, plan.width)
        for row, name in enumerate(DECODE_ROWS):
            meta[row, :plan.rows] = getattr(plan, name)
        table[:] = plan.page_table
        return meta[:, :plan.rows], table[:, :pages]

    def receive(self, bucket: int, width: int, meta: np.ndarray, table: np.ndarray, scratch_page: int) -> None:
        """Fill the next host staging with another rank's staged rows (`stage`'s views), the
        table's columns past them on `scratch_page`."""
        host_meta, host_table = self._next(bucket, width)
        host_meta[:, :bucket] = meta
        host_table[:] = scratch_page
        host_table[:, :table.shape[1]] = table

    def copy_in(self, bucket: int, width: int) -> None:
        """Copy the staged step's `bucket` rows and their [bucket, width] page table to the
        device buffers (asynchronous from pinned memory)."""
        host_meta, host_table = self.host_meta[self.staged % 2], self.host_table[self.staged % 2]
        self.meta[:, :bucket].copy_(host_meta[:, :bucket], non_blocking=True)
        self.page_table[:bucket * width].copy_(host_table[:bucket * width], non_blocking=True)

    def rows(self, bucket: int) -> DecodeRows:
        """The device metadata's first `bucket` rows, by name."""
        return DecodeRows(**{name: self.meta[row, :bucket] for row, name in enumerate(DECODE_ROWS)})

    def table(self, bucket: int, width: int) -> torch.Tensor:
        """The device page table int32[bucket, width] of a step."""
        return table_view(self.page_table, bucket, width)


@dataclasses.dataclass
class ChunkGroup:
    """Prefill chunks of one (start, length), on the host: each chunk's prompt tokens [start,
    start + length); token_index: their places in the step's flat tokens, chunk after chunk;
    pages: each chunk's pages up to start + length."""

    start: int
    length: int
    count: int
    token_index: list[int]
    pages: list[list[int]]


@dataclasses.dataclass
class PrefillInputs:
    """A prefill step's host inputs (lists of ints; what rank 0 sends its workers): the flat
    prompt tokens `ids` at `positions`, written to cache `slots`, in `groups` (a group's chunks
    hold consecutive runs of the flat tokens, in the group order: the varlen chunks' order);
    logit_index: the flat token whose logits each completing chunk returns (its last);
    score_index: the flat tokens whose logits score the prompt (`Chunk.scored`; empty: none)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    groups: list[ChunkGroup]
    logit_index: list[int]
    score_index: list[int]

    @classmethod
    def pack(cls, chunks: list[Chunk], cache: PagedKVCache) -> "PrefillInputs":
        """The inputs of prefilling `chunks`, whose pages are in `cache`."""
        members_of: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(chunks):
            members_of.setdefault((c.start, c.length), []).append(i)
        ids, positions, slots, offset = [], [], [], 0
        groups, first_token = [], {}
        for (start, length), members in members_of.items():
            index = []
            for i in members:
                seq = chunks[i].seq
                first_token[i] = offset
                ids.extend(seq.prompt[start:start + length])
                positions.extend(range(start, start + length))
                slots.extend(cache.slot(seq.pages, p) for p in range(start, start + length))
                index.extend(range(offset, offset + length))
                offset += length
            n_pages = -(-(start + length) // cache.page_size)
            pages = [chunks[i].seq.pages[:n_pages] for i in members]
            groups.append(ChunkGroup(start, length, len(members), index, pages))
        logit_index = [first_token[i] + c.length - 1 for i, c in enumerate(chunks) if c.completes]
        score_index = [first_token[i] + j for i, c in enumerate(chunks) for j in range(c.scored)]
        return cls(ids, positions, slots, groups, logit_index, score_index)

    def device_inputs(self, cache: PagedKVCache, *, varlen: bool) -> tuple[torch.Tensor, PrefillBatch]:
        """(ids int64[tokens], the PrefillBatch) on the cache's device. varlen: the chunks packed
        for one varlen call (`VarlenPrefill`), else in SDPA groups."""
        device = cache.device
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
        packed = None
        if varlen:
            packed = VarlenPrefill.build([(g.start, g.length, p) for g in self.groups for p in g.pages],
                                         page_size=cache.page_size, scratch_page=cache.scratch_page, device=device)
        batch = PrefillBatch(
            positions=as_long(self.positions), slot_mapping=as_long(self.slots),
            groups=[] if packed is not None else [PrefillGroup(g.start, g.length, g.count, as_long(g.token_index),
                                                               as_long(g.pages)) for g in self.groups],
            logit_index=as_long(self.logit_index), varlen=packed,
            score_index=as_long(self.score_index) if self.score_index else None)
        return as_long(self.ids), batch
