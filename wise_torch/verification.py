"""Verification attention: a run of queries per row against the paged cache, causally.

A speculative round (`wise_torch.engine.speculative`) verifies `n = num_draft + 1` positions of
each row in one pass: query i of row b sits at position `starts[b] + i` and attends the keys
0..starts[b] + i of its row, that is the committed cache and the round's positions up to its
own, whose K/V the pass stored first (as a prefill chunk does). Every query attends densely.

    verify_attention(q, k_pages, v_pages, page_table, starts, *, scale=None)
      q:        [batch, n, heads, head_dim]
      k_pages:  [num_pages, page_size, kv_heads, head_dim]   (v_pages the same)
      page_table int32[batch, max_pages]; starts int32[batch]
      -> out [batch, n, heads, head_dim] (q's dtype)

Keys past the page table's capacity do not exist: a query's keys are capped at
max_pages * page_size. Implementations: `verify_attention_reference` (each query is a DENSE
row of `decode_attention_reference`, so a verified position attends exactly as a dense decode
step of that position does) and the Triton kernel `wise_torch.kernels.triton_verify`, which
reads each key once for all the queries of a row.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import torch

from wise_core.modes import DENSE
from wise_torch.attention import TORCH_KERNELS, auto_kernel, decode_attention_reference
from wise_torch.kv_cache import PagedKVCache
from wise_torch.model import PagedContext
from wise_torch.verify_check import check_verify_args


@dataclasses.dataclass
class VerifyBatch:
    """Per-round metadata of a verification pass over `rows` rows of `queries` positions each,
    flat row-major (position i of row b is token b * queries + i).

    positions, slot_mapping: int64[rows * queries] (padding positions: any position the RoPE
    table holds, the scratch slot); page_table: int32[rows, max_pages]; starts: int32[rows],
    the position of each row's first query.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    starts: torch.Tensor

    @property
    def rows(self) -> int:
        return self.starts.shape[0]

    @property
    def queries(self) -> int:
        return self.positions.shape[0] // self.rows


class VerifyContext(PagedContext):
    """A verification pass (`VerifyBatch`) for `OuroForCausalLM.run_loops`: each plane's K/V of
    the round's positions is stored in the paged cache, then every position attends causally
    over its row's cache. `attention` is a prepared `verify_attention`."""

    def __init__(self, num_layers: int, batch: VerifyBatch, cache: PagedKVCache, attention: Callable):
        super().__init__(num_layers, batch, cache)
        self.attention = attention

    def attend(self, q: torch.Tensor, loop: int, layer: int) -> torch.Tensor:
        b = self.batch
        plane = self.planes(loop, layer)
        if plane.k_scale is not None:
            raise ValueError("verification attention does not read kv_cache_dtype='fp8' pages yet")
        out = self.attention(q.view(b.rows, b.queries, *q.shape[1:]), plane.k, plane.v, b.page_table, b.starts)
        return out.view(q.shape)


def verify_attention_reference(q, k_pages, v_pages, page_table, starts, *, scale: float | None = None):
    """The module's contract in plain torch: query i of row b is a DENSE row of
    `decode_attention_reference` with the row's page table and starts[b] + i + 1 keys."""
    check_verify_args(q, k_pages, v_pages, page_table, starts)
    batch, n, heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    max_keys = page_table.shape[1] * page_size
    seq_lens = (starts[:, None] + torch.arange(1, n + 1, device=q.device, dtype=torch.int32)).clamp(max=max_keys)
    block_size = page_size & -page_size  # any power of two dividing the page: DENSE rows select nothing
    rows = batch * n
    support = torch.zeros(rows, heads, max_keys // block_size, dtype=torch.bool, device=q.device)
    out, _ = decode_attention_reference(
        q.reshape(rows, heads, head_dim), k_pages, v_pages, page_table.repeat_interleave(n, 0),
        seq_lens.flatten(), torch.full((rows,), DENSE, dtype=torch.int32, device=q.device), support,
        block_size=block_size, eta=1.0, scale=scale)
    return out.view(q.shape)


def resolve_verify_kernel(kernel: str, device: torch.device | str, head_dim: int | None = None) -> Callable:
    """The verify_attention implementation for `kernel` on `device` for q of `head_dim` ("auto":
    `wise_torch.attention.auto_kernel`, the decode kernel's choice)."""
    if kernel not in TORCH_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not available in wise_torch (choose from {TORCH_KERNELS})")
    if kernel == "auto":
        kernel = auto_kernel(device, head_dim)
    if kernel == "reference":
        return verify_attention_reference
    try:
        module = importlib.import_module("wise_torch.kernels.triton_verify")
    except ImportError as e:
        raise RuntimeError(f"the Triton verification kernel (wise_torch.kernels.triton_verify) cannot be "
                           f"imported: {e}; use kernel='reference'") from e
    return module.verify_attention


def prepare_verify_attention(kernel: str, *, batches: list[int], queries: int, heads: int, kv_heads: int,
                             head_dim: int, max_keys: int, dtype: torch.dtype, device: torch.device | str,
                             min_splits: Callable[[int], int] = lambda batch: 1) -> dict[int, Callable]:
    """Per batch size of `batches`, `kernel`'s verify attention for calls of up to that many rows
    of `queries` queries and `max_keys` keys (Triton: one workspace shared by all, so that a call
    allocates nothing and never syncs, and `min_splits(batch)` splits per row at least)."""
    fn = resolve_verify_kernel(kernel, device, head_dim)
    if fn is verify_attention_reference:
        return dict.fromkeys(batches, fn)
    module = importlib.import_module(fn.__module__)
    configs = {b: dataclasses.replace(module.config_for(head_dim, dtype), min_splits=min_splits(b)) for b in batches}
    widest = max(configs.values(), key=lambda c: c.min_splits)
    workspace = module.VerifyWorkspace.allocate(max(batches), queries, heads, head_dim, max_keys, dtype=dtype,
                                                device=device, config=widest)
    return {b: functools.partial(fn, workspace=dataclasses.replace(workspace, config=config))
            for b, config in configs.items()}


def verify_attention(q, k_pages, v_pages, page_table, starts, *, scale: float | None = None,
                     kernel: str = "auto"):
    """`verify_attention_reference`'s contract, run by `kernel` ("auto", "reference", "triton")."""
    fn = resolve_verify_kernel(kernel, q.device, q.shape[-1])
    return fn(q, k_pages, v_pages, page_table, starts, scale=scale)
