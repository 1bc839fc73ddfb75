"""Paged KV storage (one page pool per (loop, layer) plane) and the per-step metadata objects.

Storage `k, v: [planes, num_pages + 1, page_size, kv_heads, head_dim]` with plane
`loop * num_hidden_layers + layer`; page `p` of a request is storage index `pages[p]` in every
plane. A token at position `pos` lives at flat slot `pages[pos // page_size] * page_size +
pos % page_size` of each plane's `[(num_pages + 1) * page_size, kv_heads, head_dim]` view. The
extra last page (`scratch_page`) belongs to no request: padding rows write there and page-table
entries past a request's pages point there. Which request holds which page is the engine's
block manager's business (`wise_core.engine.block_manager`).

An fp8 cache (`PagedKVCache(..., kv_cache_dtype="fp8")`, issue 50) holds k, v as uint8 float8
e4m3fn codes and `k_scale`, `v_scale` float32 [planes, num_pages + 1, page_size, kv_heads], one
scale per (token, KV head), by `wise_core.kv_quant`'s rule (`wise_torch.kv_quant`); an
unquantized cache has scales None. Every write of K/V values quantizes them
(`layers.rope_store_kv` with a plane's scales); a copy of what the cache holds (early exit's
later planes, preemption's offload and restore: `wise_torch.engine.offload`) moves codes and
scales as they are, never quantizing twice. Every attention reads the values dequantized to the
model's dtype (`KVPlane.gather`; the decode reference dequantizes the pages it gathers,
`wise_torch.attention`). An empty fp8 page holds the quantization of zeros: codes 0 (+0.0) and
scales 1.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from wise_core import kv_quant as quant_spec
from wise_core.model_config import ModelConfig
from wise_torch import kv_quant


@dataclasses.dataclass
class DecodeBatch:
    """Per-step metadata of a decode step: one query token per row (padding rows included).

    positions: int64[batch] (position of the token decoded); seq_lens: int32[batch] (keys in the
    cache counting that token); page_table: int32[batch, max_pages]; slot_mapping: int64[batch]
    (flat cache slot of the token); tags: int64[batch], the WISE token tag, a number naming the
    token (request, position and attempt) that no other decoded token shares, -1 for padding
    rows (WISE tags supports with it). The engine's tags come from the step plan's `TagCounter`
    (`wise_core.engine.step_plan`: int32, modulo 2**31); torch holds them as int64, widened in
    the int64 step metadata.
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    tags: torch.Tensor

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
class VarlenPrefill:
    """A step's prompt chunks as one packed variable-length call over the paged pool
    (FlashAttention's varlen layout): request r's chunk is the flat tokens
    cu_seqlens_q[r]:cu_seqlens_q[r + 1], at positions seqused_k[r] - its length onward (the
    chunk's causal offset, its cached prefix), attending keys 0..seqused_k[r] - 1 causally
    (query at position p sees keys <= p), read through page_table[r].

    cu_seqlens_q: int32[b + 1] (0 first, total queries last); seqused_k: int32[b];
    page_table: int32[b, most pages of a request] (past a request's pages: the scratch page);
    max_seqlen_q: the longest chunk (a host int: it sizes a kernel's grid).
    """

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    max_seqlen_q: int

    @classmethod
    def build(cls, chunks: list[tuple[int, int, list[int]]], *, page_size: int, scratch_page: int,
              device: torch.device | str = "cpu") -> "VarlenPrefill":
        """chunks: (start, length, pages) of each request, in the order of their runs of flat
        tokens; pages: the request's pages, at least those holding keys 0..start + length - 1."""
        if not chunks:
            raise ValueError("VarlenPrefill needs at least one chunk")
        cu, used, tables = [0], [], []
        for start, length, pages in chunks:
            if start < 0 or length <= 0:
                raise ValueError(f"a chunk needs start >= 0 and length > 0, got start {start}, length {length}")
            need = -(-(start + length) // page_size)
            if len(pages) < need:
                raise ValueError(f"a chunk at {start}..{start + length - 1} needs {need} pages of {page_size}, "
                                 f"got {len(pages)}")
            cu.append(cu[-1] + length)
            used.append(start + length)
            tables.append(list(pages[:need]))
        width = max(map(len, tables))
        table = [t + [scratch_page] * (width - len(t)) for t in tables]
        as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return cls(as_int32(cu), as_int32(used), as_int32(table), max(length for _, length, _ in chunks))

    @property
    def size(self) -> int:
        return self.seqused_k.shape[0]


@dataclasses.dataclass
class PrefillBatch:
    """Per-step metadata of chunked prefill over flat tokens: positions, slot_mapping int64[n];
    groups (list[PrefillGroup]); logit_index int64[m], the tokens whose logits are returned
    (the last prompt token of each chunk that completes its prompt); varlen: the same chunks as
    one packed call (`VarlenPrefill`) for a varlen prefill attention (None: grouped SDPA, which
    reads groups); score_index int64[s]: more tokens whose logits are returned, apart (the
    prompt positions scored for SamplingParams.prompt_logprobs; None: none)."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    groups: list[PrefillGroup]
    logit_index: torch.Tensor
    varlen: VarlenPrefill | None = None
    score_index: torch.Tensor | None = None


class KVPlane(NamedTuple):
    """One (loop, layer) plane of a cache: k, v [num_pages + 1, page_size, kv_heads, head_dim] (the
    model's dtype, or an fp8 cache's uint8 codes) and k_scale, v_scale (an fp8 cache's float32
    [num_pages + 1, page_size, kv_heads]; None otherwise). Iterating gives the four, Nones included."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """The keyword arguments an attention over the plane's pages takes beside k and v:
        {k_scale, v_scale} for an fp8 plane, {} otherwise."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def gather(self, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V values of `pages` (an int64 index of any shape [...]) -> k, v [..., page_size,
        kv_heads, head_dim]: as stored, or an fp8 plane's dequantized to `dtype`."""
        k, v = self.k[pages], self.v[pages]
        if self.k_scale is None:
            return k, v
        return kv_quant.dequantize(k, self.k_scale[pages], dtype), kv_quant.dequantize(v, self.v_scale[pages], dtype)


STORAGE = ("k", "v", "k_scale", "v_scale")


class PagedKVCache:
    """K/V storage for every plane, plus the scratch page. dtype: the model's (the K/V it writes
    and its attention reads); kv_cache_dtype: "auto" holds them in dtype, "fp8" as uint8 e4m3fn
    codes with float32 scales k_scale, v_scale (module docstring)."""

    def __init__(self, *, planes: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto"):
        for name, value in (("planes", planes), ("num_pages", num_pages), ("page_size", page_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {value!r}")
        fp8 = quant_spec.check_kv_cache_dtype(kv_cache_dtype) == "fp8"
        shape = (planes, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=torch.uint8 if fp8 else dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device) if fp8 else None
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages

    @classmethod
    def for_model(cls, config: ModelConfig, *, num_pages: int, page_size: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  kv_cache_dtype: str = "auto") -> "PagedKVCache":
        return cls(planes=config.num_loops * config.num_hidden_layers, num_pages=num_pages,
                   page_size=page_size, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)

    @staticmethod
    def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype, planes: int | None = None,
                   kv_cache_dtype: str = "auto") -> int:
        """Bytes of one page in every plane (K and V); planes: the cache's (None: Ouro's loops x
        layers; a Huginn cache's is `wise_core.huginn_reference.num_planes`); per (token, KV head)
        head_dim values of `dtype`, or for kv_cache_dtype "fp8" head_dim bytes of codes and a
        4-byte scale (`wise_core.kv_quant.entry_bytes`)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        planes = config.num_loops * config.num_hidden_layers if planes is None else planes
        return 2 * planes * page_size * config.num_key_value_heads * quant_spec.entry_bytes(
            config.head_dim, itemsize, kv_cache_dtype)

    @property
    def quantized(self) -> bool:
        """Whether the K/V are fp8 codes with scales (kv_cache_dtype "fp8")."""
        return self.k_scale is not None

    @property
    def kv_cache_dtype(self) -> str:
        """"fp8" for a quantized cache, "auto" (the model's dtype) otherwise."""
        return "fp8" if self.quantized else "auto"

    def storage_names(self) -> tuple[str, ...]:
        """The attributes holding the K/V: ("k", "v"), and an fp8 cache's scales."""
        return STORAGE if self.quantized else STORAGE[:2]

    def plane(self, plane: int) -> KVPlane:
        """The storage of plane `plane` (views: writes through it land in the cache)."""
        if not self.quantized:
            return KVPlane(self.k[plane], self.v[plane])
        return KVPlane(self.k[plane], self.v[plane], self.k_scale[plane], self.v_scale[plane])

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def device(self) -> torch.device:
        return self.k.device

    def slot(self, pages: list[int], position: int) -> int:
        """Flat slot of `position` of a request holding `pages`."""
        return pages[position // self.page_size] * self.page_size + position % self.page_size
