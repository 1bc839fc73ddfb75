"""Paged KV cache: one page pool per (loop, layer) plane, one page table per request.

Storage `k, v: [planes, num_pages, page_size, kv_heads, head_dim]` with plane
`loop * num_hidden_layers + layer`; page `p` of a request is storage index `pages[p]` in every
plane. A token at position `pos` lives at flat slot `pages[pos // page_size] * page_size +
pos % page_size` of each plane's `[num_pages * page_size, kv_heads, head_dim]` view.
"""

from __future__ import annotations

import dataclasses

import torch

from wise_core.config import ModelConfig


class KVCacheExhausted(RuntimeError):
    """The page pool has too few free pages for a request."""


@dataclasses.dataclass
class DecodeBatch:
    """Per-step metadata of a decode step: one query token per row.

    positions: int64[batch] (position of the token decoded); seq_lens: int32[batch] (keys in the
    cache counting that token); page_table: int32[batch, max_pages]; slot_mapping: int64[batch]
    (flat cache slot of the token); request_ids: int64[batch]; wise_slots: int64[batch] (the
    rows' WiseState slots) or None.
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    request_ids: torch.Tensor
    wise_slots: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.positions.shape[0]


class PagedKVCache:
    """K/V storage for every plane plus a page allocator (free list, pages per request)."""

    def __init__(self, *, planes: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("planes", planes), ("num_pages", num_pages), ("page_size", page_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {value!r}")
        shape = (planes, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages: list[int] = list(range(num_pages))
        self.pages: dict[int, list[int]] = {}

    @classmethod
    def for_model(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "PagedKVCache":
        return cls(planes=config.num_loops * config.num_hidden_layers, num_pages=num_pages,
                   page_size=page_size, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow `request_id`'s pages (creating the request if new) to hold `num_tokens` keys."""
        held = self.pages.setdefault(request_id, [])
        needed = self.pages_for(num_tokens) - len(held)
        if needed > len(self.free_pages):
            if not held:
                del self.pages[request_id]
            raise KVCacheExhausted(
                f"KV cache exhausted: request {request_id} needs {needed} more page(s) for "
                f"{num_tokens} tokens, {len(self.free_pages)} of {self.num_pages} pages are free")
        for _ in range(max(needed, 0)):
            held.append(self.free_pages.pop(0))
        return held

    def release(self, request_id: int) -> None:
        """Return the request's pages to the free list."""
        if request_id not in self.pages:
            raise KeyError(f"request {request_id} holds no pages")
        self.free_pages.extend(self.pages.pop(request_id))

    def page_table(self, request_ids: list[int], max_pages: int) -> torch.Tensor:
        """int32[len(request_ids), max_pages]; entries past a request's pages are 0."""
        rows = []
        for rid in request_ids:
            pages = self.pages[rid]
            if len(pages) > max_pages:
                raise ValueError(f"request {rid} holds {len(pages)} pages, more than max_pages={max_pages}")
            rows.append(pages + [0] * (max_pages - len(pages)))
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), max_pages).to(self.device)

    def slots(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slots int64[...] of `positions` (int64[batch, ...]) through `page_table` [batch, max_pages]."""
        flat = positions.reshape(positions.shape[0], -1)
        page = torch.gather(page_table.long(), 1, flat // self.page_size)
        return (page * self.page_size + flat % self.page_size).reshape(positions.shape)

    def decode_batch(self, request_ids: list[int], seq_lens: list[int], max_pages: int,
                     wise_slots: list[int] | None = None) -> DecodeBatch:
        """Metadata for decoding the token at position seq_len - 1 of each request (pages must be reserved)."""
        for rid, n in zip(request_ids, seq_lens):
            if n > len(self.pages.get(rid, ())) * self.page_size:
                raise ValueError(f"request {rid} needs {n} keys but holds "
                                 f"{len(self.pages.get(rid, ()))} page(s) of {self.page_size}")
        table = self.page_table(request_ids, max_pages)
        lens = torch.tensor(seq_lens, dtype=torch.int32).to(self.device)
        positions = lens.long() - 1
        return DecodeBatch(
            positions=positions, seq_lens=lens, page_table=table,
            slot_mapping=self.slots(table, positions[:, None])[:, 0],
            request_ids=torch.tensor(request_ids, dtype=torch.int64).to(self.device),
            wise_slots=None if wise_slots is None else torch.tensor(wise_slots, dtype=torch.int64).to(self.device))

    def write(self, plane: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [n, kv_heads, head_dim] at flat slots int64[n] of `plane`."""
        kv_heads, head_dim = self.k.shape[-2:]
        self.k[plane].view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[plane].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(self.v.dtype))
