"""Preemption's K/V copies: a preempted sequence's pages of every plane go to host memory and
come back into the pages it holds when it resumes (exact: it continues as if never stopped).
Under tensor parallelism each rank copies its own heads' K/V."""

from __future__ import annotations

import torch

from wise_torch.kv_cache import PagedKVCache


def copy_out(cache: PagedKVCache, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of `pages` of every plane -> (k, v) [planes, len(pages), page_size, kv_heads,
    head_dim]."""
    index = torch.tensor(pages, device=cache.device)
    return cache.k[:, index].cpu(), cache.v[:, index].cpu()


def copy_in(cache: PagedKVCache, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k and v (`copy_out`'s, or anything that broadcasts to them: a zero scrubs) into
    `pages` of every plane."""
    index = torch.tensor(pages, device=cache.device)
    cache.k[:, index] = k.to(cache.device)
    cache.v[:, index] = v.to(cache.device)
