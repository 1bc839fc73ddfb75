"""Attention: dense causal prefill, and paged single-token decode in the four WISE modes.

What an engine runs in each phase is derived from its one `attention_backend` by
`attention_plan` (docs/attention.md's table): prefill "sdpa" (`prefill_attention` per group of
chunks of one (start, length), over K/V gathered from the pages) or a packed varlen call over
the paged pool (`VarlenPrefill`): "fa4" (FlashAttention-4, `wise_torch.kernels.fa4`) or
"reference" (`prefill_attention_varlen_reference`, plain torch, same signature: FA4's oracle,
reached through a benchmark's or test's plan); the dense decode loops on the decode kernel or
FA4's paged decode; the WISE loops on the decode kernel. `decode_attention_reference` is the
plain-torch reference of the decode contract in docs/DESIGN.md; `decode_attention` dispatches
to it or to the Triton kernel (`wise_torch.kernels.triton_decode`, same signature).

An fp8 K/V cache (`PagedKVCache(..., kv_cache_dtype="fp8")`): k_pages and v_pages are uint8
e4m3fn codes and `k_scale`, `v_scale` float32 [num_pages, page_size, kv_heads] their scales
(`wise_core.kv_quant`). The references read them: `decode_attention_reference` and
`prefill_attention_varlen_reference` gather a row's pages and dequantize them to q's dtype, then
run the same code as over unquantized pages, so their output, mass and selection are those of
attention over the dequantized K/V (grouped SDPA prefill reads them through `KVPlane.gather`).
The engine does not run the Triton decode kernel or FlashAttention-4 over fp8 pages yet: for
such a cache attention_backend "auto" resolves to "reference" (`attention_plan`), and "triton"
or "fa4" is a ValueError, as kernel "triton" is in `resolve_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable

import torch
import torch.nn.functional as F

from wise_core import selection as rules
from wise_core.engine.args import ATTENTION_BACKENDS
from wise_core.kv_quant import check_kv_cache_dtype
from wise_core.modes import DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch import kv_quant
from wise_torch.decode_check import check_call
from wise_torch.kv_cache import VarlenPrefill


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0,
                      scale: float | None = None) -> torch.Tensor:
    """Dense causal attention of a run of queries at positions start.. over keys 0..start+n-1.

    q: [batch, n, heads, head_dim]; k, v: [batch, start + n, kv_heads, head_dim]
    -> [batch, n, heads, head_dim]. With start 0, right padding is harmless: a real token never
    attends a later (padded) position.
    """
    n, keys = q.shape[1], k.shape[1]
    if keys != start + n:
        raise ValueError(f"{n} queries from position {start} need {start + n} keys, got {keys}")
    mask = None
    if start:
        mask = torch.arange(keys, device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=not start,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def prefill_attention_varlen_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                       varlen: VarlenPrefill, *, scale: float | None = None,
                                       k_scale: torch.Tensor | None = None,
                                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a step's packed prompt chunks over their paged keys (`VarlenPrefill`).

    q: [total, heads, head_dim] (request r's queries at rows cu_seqlens_q[r]:cu_seqlens_q[r + 1]);
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] -> [total, heads, head_dim] in
    q's dtype. The query at position p of a request attends its keys 0..p (p = its causal offset
    seqused_k - chunk length, plus its index in the chunk). float32 math, one request at a time
    after reading the metadata on the host: the CPU path and the oracle of the FA4 call.
    k_scale, v_scale: an fp8 cache's scales float32 [num_pages, page_size, kv_heads], k_pages
    and v_pages then its uint8 codes: a request's pages are dequantized to q's dtype first.
    """
    total, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    cu, used = varlen.cu_seqlens_q.tolist(), varlen.seqused_k.tolist()
    if cu[0] != 0 or cu[-1] != total or len(cu) != len(used) + 1:
        raise ValueError(f"cu_seqlens_q {cu} does not describe {len(used)} chunks of {total} queries")
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for r, keys in enumerate(used):
        n = cu[r + 1] - cu[r]
        start = keys - n
        if start < 0 or -(-keys // page_size) > varlen.page_table.shape[1]:
            raise ValueError(f"chunk {r}: {n} queries over {keys} keys in {varlen.page_table.shape[1]} pages")
        pages = varlen.page_table[r, :-(-keys // page_size)].long()
        k, v = k_pages[pages], v_pages[pages]
        if k_scale is not None:    # an fp8 cache: the request's pages dequantized
            k = kv_quant.dequantize(k, k_scale[pages], q.dtype)
            v = kv_quant.dequantize(v, v_scale[pages], q.dtype)
        k = k.flatten(0, 1)[:keys].float()                                     # [keys, kv_heads, head_dim]
        v = v.flatten(0, 1)[:keys].float()
        qr = q[cu[r]:cu[r + 1]].float().view(n, kv_heads, group, head_dim)
        scores = torch.einsum("nkgd,skd->kgns", qr, k) * scale
        causal = torch.arange(keys, device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[cu[r]:cu[r + 1]] = torch.einsum("kgns,skd->nkgd", probs, v).reshape(n, heads, head_dim).to(q.dtype)
    return out


TORCH_BACKENDS = ATTENTION_BACKENDS["torch"]
PREFILL_ATTENTION = ("sdpa", "fa4", "reference")
DENSE_DECODE = ("kernel", "fa4")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What the torch engine runs in each phase (docs/attention.md's table; `attention_plan`).

    kernel: the decode kernel ("triton" or "reference", `resolve_kernel`): every WISE loop, and
    the dense loops unless dense_decode is "fa4". prefill: "sdpa", "fa4" or "reference"
    (`prefill_function`). dense_decode: "kernel" or "fa4" (`dense_decode_function`).
    wise_decode: what runs the WISE loops: "kernel", or an arm of the reference system's union
    decode ("fa4-union", "reference-union": `wise_torch.union_decode`), which no backend names:
    a measurement sets it through `LLM._attention_plan`. `stats()` reports prefill and wise_decode."""

    kernel: str
    prefill: str
    dense_decode: str = "kernel"
    wise_decode: str = "kernel"


def attention_plan(backend: str, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                   kv_cache_dtype: str = "auto") -> AttentionPlan:
    """The phases of `backend` for a model of `dtype` and `head_dim` on `device` (the one place
    the torch engine's attention is chosen; docs/attention.md):
    "auto": FlashAttention-4 prefill on a CUDA device in float16/bfloat16 when flash_attn.cute
    imports, else SDPA; the decode kernel `auto_kernel` picks (Triton on CUDA for a head_dim it
    takes, else the reference) for every decode loop.
    "triton": SDPA prefill, the Triton decode kernel for every decode loop.
    "fa4": FlashAttention-4 for prefill and the dense decode loops, the WISE loops on the decode
    kernel `auto_kernel` picks (FA4 has no WISE mode); a RuntimeError naming what is missing
    where FA4 cannot run.
    "reference": SDPA prefill, the plain-torch decode reference.
    kv_cache_dtype "fp8": "auto" is "reference"; "triton" and "fa4" are ValueErrors (neither
    reads fp8 pages in the engine yet)."""
    if backend not in TORCH_BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of wise_torch's ({', '.join(TORCH_BACKENDS)})")
    if check_kv_cache_dtype(kv_cache_dtype) != "auto":
        if backend in ("triton", "fa4"):
            raise ValueError(f"attention_backend={backend!r} does not read kv_cache_dtype={kv_cache_dtype!r} "
                             f"pages yet: use attention_backend='reference' or 'auto' (which runs the reference "
                             f"for an fp8 cache)")
        backend = "reference"   # what "auto" and "reference" run over fp8 pages
    if backend == "reference":
        return AttentionPlan(kernel="reference", prefill="sdpa")
    if backend == "triton":
        return AttentionPlan(kernel="triton", prefill="sdpa")
    if backend == "fa4":
        require_fa4("attention_backend", device, dtype)
        return AttentionPlan(kernel=auto_kernel(device, head_dim), prefill="fa4", dense_decode="fa4")
    prefill = "fa4" if fa4_unavailable("attention_backend", device, dtype) is None else "sdpa"
    return AttentionPlan(kernel=auto_kernel(device, head_dim), prefill=prefill)


def prefill_function(name: str, device: torch.device | str, dtype: torch.dtype,
                     kv_cache_dtype: str = "auto") -> Callable | None:
    """The packed varlen prefill of a plan's `prefill` (`prefill_attention_varlen_reference`'s
    signature), None for "sdpa". "fa4" where it cannot run, or over fp8 pages (FA4 does not read
    them yet), is an error naming the plan's prefill."""
    if name not in PREFILL_ATTENTION:
        raise ValueError(f"prefill attention {name!r} is not one of wise_torch's ({', '.join(PREFILL_ATTENTION)})")
    if name == "sdpa":
        return None
    if name == "reference":
        return prefill_attention_varlen_reference
    if check_kv_cache_dtype(kv_cache_dtype) != "auto":
        raise ValueError(f"prefill='fa4' (FlashAttention-4) does not read kv_cache_dtype={kv_cache_dtype!r} pages "
                         f"yet")
    require_fa4("prefill", device, dtype)
    from wise_torch.kernels import fa4
    return fa4.prefill_attention_varlen


def fa4_unavailable(what: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why FlashAttention-4 cannot run `what` for `dtype` activations on `device`; None if it can."""
    from wise_torch.kernels import fa4
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return (f"{what}='fa4' runs on a CUDA device in float16 or bfloat16; the model is {dtype} on "
                f"{torch.device(device)}")
    error = fa4.import_error()
    if error is not None:
        return (f"{what}='fa4' needs FlashAttention-4 (pip package {fa4.PACKAGE!r}, module {fa4.MODULE}), "
                f"which does not import: {error}")
    return None


def require_fa4(what: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Raise RuntimeError saying why FlashAttention-4 cannot run `what` here, if it cannot."""
    reason = fa4_unavailable(what, device, dtype)
    if reason is not None:
        raise RuntimeError(reason)


def dense_decode_function(name: str, device: torch.device | str, dtype: torch.dtype,
                          kv_cache_dtype: str = "auto") -> Callable | None:
    """What runs the DENSE decode calls of a plan's `dense_decode` (no WISE, or a WISE config's
    dense loops): "kernel" -> None (the decode kernel's dense rows); "fa4" ->
    `wise_torch.kernels.fa4.decode_attention_dense` (an error where it cannot run, and over fp8
    pages: FA4 does not read them yet). WISE calls stay on the decode kernel either way."""
    if name not in DENSE_DECODE:
        raise ValueError(f"dense decode {name!r} is not one of wise_torch's ({', '.join(DENSE_DECODE)})")
    if name == "kernel":
        return None
    if check_kv_cache_dtype(kv_cache_dtype) != "auto":
        raise ValueError(f"dense_decode='fa4' (FlashAttention-4's paged decode) does not read kv_cache_dtype="
                         f"{kv_cache_dtype!r} pages yet")
    require_fa4("dense_decode", device, dtype)
    from wise_torch.kernels import fa4
    return fa4.decode_attention_dense


def select_blocks(mass: torch.Tensor, rule, context: rules.SelectionContext | None = None) -> torch.Tensor:
    """A selection rule (`wise_core.selection`; a number: the eta rule with that eta), vectorised:
    `wise_core.reference.select_blocks`'s. context: the `SelectionContext` (torch tensors) a
    Custom(..., context=True) rule reads; its rank is filled here.

    mass: float[..., n_blocks], non-negative (not checked: no host sync) -> bool[..., n_blocks].
    Blocks are ranked by float32 mass, descending, ties to the lower index; the first is always
    kept.
    """
    rule = rules.as_rule(rule)
    mass = mass.float()
    mass = torch.where(mass < torch.finfo(torch.float32).tiny, torch.zeros_like(mass), mass)  # flush subnormals
    ranked, order = torch.sort(mass, dim=-1, descending=True, stable=True)
    running = torch.cumsum(ranked, dim=-1)
    total = running[..., -1:]
    if isinstance(rule, rules.Eta):
        before = torch.cat([torch.zeros_like(running[..., :1]), running[..., :-1]], dim=-1)
        keep_ranked = before < total * rule.eta
    elif isinstance(rule, rules.TopK):
        keep_ranked = (torch.arange(mass.shape[-1], device=mass.device) < rule.k).expand(mass.shape).clone()
    elif isinstance(rule, rules.Threshold):
        keep_ranked = (ranked >= total * rule.fraction) & (ranked > 0)
    else:
        if context is not None:
            index = torch.arange(mass.shape[-1], device=mass.device, dtype=torch.int32).expand(order.shape)
            rank = torch.empty_like(order, dtype=torch.int32).scatter_(-1, order, index)
            context = dataclasses.replace(context, rank=rank)
        chosen = rule.choose(mass, context)
        if not isinstance(chosen, torch.Tensor) or chosen.shape != mass.shape or chosen.dtype != torch.bool:
            got = f"{chosen.dtype}{list(chosen.shape)}" if isinstance(chosen, torch.Tensor) else type(chosen).__name__
            raise ValueError(f"selection rule {rule.describe()!r} returned {got}; it must return a "
                             f"torch.bool tensor of shape {list(mass.shape)}")
        keep_ranked = torch.gather(chosen, -1, order)
    keep_ranked[..., 0] = True  # never empty
    return torch.zeros_like(keep_ranked).scatter_(-1, order, keep_ranked)


def update_support(modes: torch.Tensor, support: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """support' of a decode call: `selected` for DISCOVER rows, support | selected for
    DISCOVER_UNION rows, support elsewhere. modes int32[batch]; support, selected bool[batch, heads, blocks]."""
    rows = modes[:, None, None]
    return torch.where(rows == DISCOVER, selected, torch.where(rows == DISCOVER_UNION, support | selected, support))


def decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, modes, support, *,
                               block_size: int, eta: float, scale: float | None = None,
                               return_mass: bool = False, validate: bool = True, reuse: bool = False,
                               k_scale=None, v_scale=None):
    """One query token per row against its paged keys, per row mode (docs/DESIGN.md).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim];
    page_table: int32[batch, max_pages]; seq_lens: int32[batch]; modes: int32[batch];
    support: bool[batch, heads, max_blocks], updated in place for discovery rows.
    Returns (out [batch, heads, head_dim] in q's dtype, support) and, with return_mass,
    mass float32[batch, heads, max_blocks] (the block mass of the probabilities attended).
    Every mode runs the same masked softmax, so DENSE, DISCOVER and a SPARSE row with every
    causal block selected are bitwise equal. validate: also check the values (`check_call`).
    reuse: a reuse loop's call, no row discovers (checked with validate): nothing is selected.
    k_scale, v_scale: None, or an fp8 cache's scales float32 [num_pages, page_size, kv_heads],
    k_pages and v_pages then its uint8 codes: the gathered pages are dequantized to q's dtype
    (`kv_quant.dequantize`) before the same arithmetic (module docstring).
    """
    check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
               validate=validate, reuse=reuse, k_scale=k_scale, v_scale=v_scale)
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_keys = page_table.shape[1] * page_size
    max_blocks = max_keys // block_size
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale

    pages = page_table.long()
    k, v = k_pages[pages], v_pages[pages]
    if k_scale is not None:    # an fp8 cache: the row's pages dequantized
        k = kv_quant.dequantize(k, k_scale[pages], q.dtype)
        v = kv_quant.dequantize(v, v_scale[pages], q.dtype)
    k = k.reshape(batch, max_keys, kv_heads, head_dim).float()
    v = v.reshape(batch, max_keys, kv_heads, head_dim).float()
    qg = q.float().reshape(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k).reshape(batch, heads, max_keys) * scale

    key_pos = torch.arange(max_keys, device=q.device)
    causal = key_pos < seq_lens.long()[:, None]                              # [batch, keys]
    in_support = support[:, :, key_pos // block_size]                       # [batch, heads, keys]
    sparse = (modes == SPARSE)[:, None, None]
    mask = causal[:, None, :] & (in_support | ~sparse)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    v = v.masked_fill(~causal[:, :, None, None], 0.0)     # a stale NaN past seq_len must not reach 0 x v
    out = torch.einsum("bkgs,bskd->bkgd", probs.reshape(batch, kv_heads, group, max_keys), v)

    mass = probs.reshape(batch, heads, max_blocks, block_size).sum(-1)
    if not reuse:
        support.copy_(update_support(modes, support, select_blocks(mass, eta)))
    out = out.reshape(batch, heads, head_dim).to(q.dtype)
    return (out, support, mass) if return_mass else (out, support)


TORCH_KERNELS = ("auto", "reference", "triton")
"""The decode kernels (`decode_attention(kernel=)`): "auto" (`auto_kernel`), the plain-torch
reference and the Triton kernel."""


def auto_kernel(device: torch.device | str, head_dim: int | None, kv_cache_dtype: str = "auto") -> str:
    """What kernel="auto" runs: "triton" on CUDA when the Triton kernels take head_dim (a multiple
    of 16, `kernels.triton_head_dim.takes`; None: not known, any), else "reference"; "reference"
    for kv_cache_dtype "fp8" on every device (the Triton kernel does not read fp8 pages yet)."""
    if torch.device(device).type != "cuda" or check_kv_cache_dtype(kv_cache_dtype) != "auto":
        return "reference"
    if head_dim is None:
        return "triton"
    from wise_torch.kernels.triton_head_dim import takes
    return "triton" if takes(head_dim) else "reference"


def resolve_kernel(kernel: str, device: torch.device | str, head_dim: int | None = None,
                   kv_cache_dtype: str = "auto") -> Callable:
    """The decode_attention implementation for `kernel` on `device` for q of `head_dim` ("auto":
    `auto_kernel`; the callers that run attention pass head_dim, so "auto" never picks a kernel
    that refuses it). Triton runs on a CUDA device, or anywhere in its interpreter
    (TRITON_INTERPRET=1). kv_cache_dtype "fp8" (pages of e4m3fn codes and scales): "auto" ->
    the reference, and "triton" is a ValueError (the Triton kernel does not read fp8 pages yet)."""
    if kernel not in TORCH_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not available in wise_torch (choose from {TORCH_KERNELS})")
    if check_kv_cache_dtype(kv_cache_dtype) != "auto" and kernel == "triton":
        raise ValueError(f"kernel='triton' (the Triton split decode kernel) does not read kv_cache_dtype="
                         f"{kv_cache_dtype!r} pages yet: use kernel='reference' or 'auto'")
    on_cuda = torch.device(device).type == "cuda"
    if kernel == "auto":
        kernel = auto_kernel(device, head_dim, kv_cache_dtype)
    if kernel == "reference":
        return decode_attention_reference
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the Triton kernel needs a CUDA device or TRITON_INTERPRET=1 (set before "
                           f"triton is imported); the tensors are on {torch.device(device)}. Use "
                           f"kernel='reference' on CPU")
    try:
        module = importlib.import_module("wise_torch.kernels.triton_decode")
    except ImportError as e:
        raise RuntimeError(f"the Triton decode kernel (wise_torch.kernels.triton_decode) cannot be "
                           f"imported: {e}; use kernel='reference'") from e
    return module.decode_attention


def select_after(fn: Callable, selection: rules.SelectionRule) -> Callable:
    """`fn` (a decode_attention implementation) running `selection` instead of the eta rule: the
    call returns its block mass and the discovery rows' supports become the rule's selection of
    it (`update_support`, onto a copy of the support held), so every kernel runs any rule
    unchanged. The call takes selection_context, what a Custom(..., context=True) rule reads."""
    selection = rules.as_rule(selection)

    def call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, return_mass: bool = False,
             reuse: bool = False, selection_context: rules.SelectionContext | None = None, **kwargs):
        if reuse:   # a reuse call selects nothing
            return fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, return_mass=return_mass,
                      reuse=True, **kwargs)
        held = support.clone()
        out, _, mass = fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, return_mass=True, **kwargs)
        support.copy_(update_support(modes, held, select_blocks(mass, selection, selection_context)))
        return (out, support, mass) if return_mass else (out, support)
    return call


def _with_selection(fn: Callable, selection: rules.SelectionRule | None) -> Callable:
    """fn for the eta rule (None or `Eta`: its eta is the call's), `select_after` for another."""
    return fn if selection is None or isinstance(selection, rules.Eta) else select_after(fn, selection)


def prepare_decode_attention(kernel: str, *, batches: list[int], heads: int, kv_heads: int, head_dim: int,
                             max_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                             min_splits: Callable[[int], int] = lambda batch: 1,
                             selection: rules.SelectionRule | None = None,
                             kv_cache_dtype: str = "auto") -> dict[int, Callable]:
    """Per batch size of `batches`, `kernel`'s decode attention for a decode loop that builds its
    inputs by construction: values not validated (validate=False), calls of up to that many rows
    and `max_blocks` blocks per row (any narrower support too: a decode step sized by its live
    context). Triton: one workspace shared by all, so that a call allocates nothing and never
    syncs, and `min_splits(batch)` programs per row at least, to fill the GPU when batches are
    small (`prepare_verify_attention`'s pattern). selection: a rule other than eta runs as
    `select_after` (None or `Eta`: the eta rule, of the calls' eta). kv_cache_dtype: the pages'
    (`resolve_kernel`: "fp8" runs the reference, which takes the calls' k_scale, v_scale)."""
    fn = resolve_kernel(kernel, device, head_dim, kv_cache_dtype)
    if fn is decode_attention_reference:
        return dict.fromkeys(batches, _with_selection(functools.partial(fn, validate=False), selection))
    module = importlib.import_module(fn.__module__)
    configs = {b: dataclasses.replace(module.config_for(head_dim, dtype, kv_cache_dtype), min_splits=min_splits(b))
               for b in batches}
    widest = max(configs.values(), key=lambda c: c.min_splits)
    workspace = module.DecodeWorkspace.allocate(
        max(batches), heads, kv_heads, head_dim, max_blocks, dtype=dtype, device=device, block_size=block_size,
        config=widest)
    return {b: _with_selection(functools.partial(fn, workspace=dataclasses.replace(workspace, config=config),
                                                 validate=False), selection)
            for b, config in configs.items()}


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *,
                     block_size: int, eta: float, scale: float | None = None,
                     return_mass: bool = False, kernel: str = "auto", validate: bool = True,
                     reuse: bool = False, selection: rules.SelectionRule | None = None,
                     k_scale=None, v_scale=None):
    """`decode_attention_reference`'s contract, run by `kernel` ("auto", "reference", "triton").
    reuse: a call of WISE's reuse loops, every row SPARSE or DENSE (checked with validate):
    support' is the support held, as for any row that does not discover (the Triton kernel then
    skips its selection). selection: None or `Eta` (whose eta then replaces `eta`): the eta
    rule; another rule runs as `select_after`. k_scale, v_scale: an fp8 cache's scales, the
    pages its codes (`decode_attention_reference`; "auto" runs the reference for them)."""
    if isinstance(selection, rules.Eta):
        eta, selection = selection.eta, None
    scales = {} if k_scale is None and v_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    fn = _with_selection(resolve_kernel(kernel, q.device, q.shape[-1], "fp8" if scales else "auto"), selection)
    return fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
              eta=eta, scale=scale, return_mass=return_mass, validate=validate, reuse=reuse, **scales)
