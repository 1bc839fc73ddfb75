"""Paged KV storage (one page pool per (loop, layer) plane) and the per-step metadata objects.

Storage `k, v: [planes, num_pages + 1, page_size, kv_heads, head_dim]` with plane
`loop * num_hidden_layers + layer`; page `p` of a request is storage index `pages[p]` in every
plane. A token at position `pos` lives at flat slot `pages[pos // page_size] * page_size +
pos % page_size` of each plane's `[(num_pages + 1) * page_size, kv_heads, head_dim]` view. The
extra last page (`scratch_page`) belongs to no request: padding rows write there and page-table
entries past a request's pages point there. Which request holds which page is the engine's
block manager's business (`wise_torch.engine.block_manager`).
"""

from __future__ import annotations

import dataclasses

import torch

from wise_core.config import ModelConfig


@dataclasses.dataclass
class DecodeBatch:
    """Per-step metadata of a decode step: one query token per row (padding rows included).

    positions: int64[batch] (position of the token decoded); seq_lens: int32[batch] (keys in the
    cache counting that token); page_table: int32[batch, max_pages]; slot_mapping: int64[batch]
    (flat cache slot of the token); epochs: int64[batch], a number naming the token (request,
    position and attempt) that no other decoded token shares, -1 for padding rows (WISE tags
    supports with it).
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    epochs: torch.Tensor

    @property
    def size(self) -> int:
        return self.positions.shape[0]


@dataclasses.dataclass
class PrefillGroup:
    """Prompt chunks of one (start, length): `count` sequences whose tokens at positions
    [start, start + length) are prefilled together. token_index: int64[count * length], their
    rows in the step's flat tokens; pages: int64[count, pages for start + length keys]."""

    start: int
    length: int
    count: int
    token_index: torch.Tensor
    pages: torch.Tensor


@dataclasses.dataclass
class PrefillBatch:
    """Per-step metadata of chunked prefill over flat tokens: positions, slot_mapping int64[n];
    groups (list[PrefillGroup]); logit_index int64[m], the tokens whose logits are returned
    (the last prompt token of each chunk that completes its prompt)."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    groups: list[PrefillGroup]
    logit_index: torch.Tensor


class PagedKVCache:
    """K/V storage for every plane, plus the scratch page."""

    def __init__(self, *, planes: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("planes", planes), ("num_pages", num_pages), ("page_size", page_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {value!r}")
        shape = (planes, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages

    @classmethod
    def for_model(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "PagedKVCache":
        return cls(planes=config.num_loops * config.num_hidden_layers, num_pages=num_pages,
                   page_size=page_size, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   dtype=dtype, device=device)

    @staticmethod
    def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page in every plane (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (2 * config.num_loops * config.num_hidden_layers * page_size * config.num_key_value_heads
                * config.head_dim * itemsize)

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def device(self) -> torch.device:
        return self.k.device

    def slot(self, pages: list[int], position: int) -> int:
        """Flat slot of `position` of a request holding `pages`."""
        return pages[position // self.page_size] * self.page_size + position % self.page_size
