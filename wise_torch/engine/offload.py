"""Preemption's K/V copies: a preempted sequence's pages of every plane go to host memory and
come back into the pages it holds when it resumes (exact: it continues as if never stopped), as
the pool holds them (an fp8 pool's codes and scales, never quantized again). Under tensor
parallelism each rank copies its own heads' K/V."""

from __future__ import annotations

import torch

from wise_torch.kv_cache import PagedKVCache


def copy_out(cache: PagedKVCache, pages: list[int]) -> tuple[torch.Tensor, ...]:
    """Host copies of `pages` of every plane, bitwise what the cache holds, in its
    `storage_names` order: k, v [planes, len(pages), page_size, kv_heads, head_dim], and an fp8
    cache's k_scale, v_scale [planes, len(pages), page_size, kv_heads]."""
    index = torch.tensor(pages, device=cache.device)
    return tuple(getattr(cache, name)[:, index].cpu() for name in cache.storage_names())


def copy_in(cache: PagedKVCache, pages: list[int], stored: tuple[torch.Tensor, ...]) -> None:
    """`copy_out`'s tuple written back, as it is, into `pages` of every plane."""
    names = cache.storage_names()
    if len(stored) != len(names):
        raise ValueError(f"the pages hold {len(stored)} arrays; this {cache.kv_cache_dtype} cache stores {names}")
    index = torch.tensor(pages, device=cache.device)
    for name, x in zip(names, stored):
        getattr(cache, name)[:, index] = x.to(cache.device)


def scrub(cache: PagedKVCache, pages: list[int]) -> None:
    """`pages` of every plane as an empty cache holds them: zeros (an fp8 cache's codes of +0.0
    and scales 1, the quantization of zeros)."""
    index = torch.tensor(pages, device=cache.device)
    for name in cache.storage_names():
        getattr(cache, name)[:, index] = 1.0 if name.endswith("_scale") else 0
