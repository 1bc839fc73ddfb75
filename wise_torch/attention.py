"""Attention: dense causal prefill, and paged single-token decode in the four WISE modes.

`decode_attention_reference` is the plain-torch reference of the decode contract in
docs/DESIGN.md; `decode_attention` dispatches to it or to the Triton kernel
(`wise_torch.kernels.triton_decode`, same signature).
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
from wise_core.config import FRAMEWORK_KERNELS
from wise_core.modes import DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch.decode_check import check_call


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


def select_blocks(mass: torch.Tensor, rule) -> torch.Tensor:
    """A selection rule (`wise_core.selection`; a number: the eta rule with that eta), vectorised:
    `wise_core.reference.select_blocks`'s.

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
        chosen = rule.fn(mass)
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
                               return_mass: bool = False, validate: bool = True):
    """One query token per row against its paged keys, per row mode (docs/DESIGN.md).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim];
    page_table: int32[batch, max_pages]; seq_lens: int32[batch]; modes: int32[batch];
    support: bool[batch, heads, max_blocks], updated in place for discovery rows.
    Returns (out [batch, heads, head_dim] in q's dtype, support) and, with return_mass,
    mass float32[batch, heads, max_blocks] (the block mass of the probabilities attended).
    Every mode runs the same masked softmax, so DENSE, DISCOVER and a SPARSE row with every
    causal block selected are bitwise equal. validate: also check the values (`check_call`).
    """
    check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
               validate=validate)
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_keys = page_table.shape[1] * page_size
    max_blocks = max_keys // block_size
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale

    pages = page_table.long()
    k = k_pages[pages].reshape(batch, max_keys, kv_heads, head_dim).float()
    v = v_pages[pages].reshape(batch, max_keys, kv_heads, head_dim).float()
    qg = q.float().reshape(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k).reshape(batch, heads, max_keys) * scale

    key_pos = torch.arange(max_keys, device=q.device)
    causal = key_pos < seq_lens.long()[:, None]                              # [batch, keys]
    in_support = support[:, :, key_pos // block_size]                       # [batch, heads, keys]
    sparse = (modes == SPARSE)[:, None, None]
    mask = causal[:, None, :] & (in_support | ~sparse)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs.reshape(batch, kv_heads, group, max_keys), v)

    mass = probs.reshape(batch, heads, max_blocks, block_size).sum(-1)
    support.copy_(update_support(modes, support, select_blocks(mass, eta)))
    out = out.reshape(batch, heads, head_dim).to(q.dtype)
    return (out, support, mass) if return_mass else (out, support)


TORCH_KERNELS = FRAMEWORK_KERNELS["torch"]


def resolve_kernel(kernel: str, device: torch.device | str) -> Callable:
    """The decode_attention implementation for `kernel` on `device` ("auto": triton on CUDA).
    Triton runs on a CUDA device, or anywhere in its interpreter (TRITON_INTERPRET=1)."""
    if kernel not in TORCH_KERNELS:
        raise ValueError(f"kernel {kernel!r} is not available in wise_torch (choose from {TORCH_KERNELS})")
    on_cuda = torch.device(device).type == "cuda"
    if kernel == "auto":
        kernel = "triton" if on_cuda else "reference"
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
    unchanged."""
    selection = rules.as_rule(selection)

    def call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, return_mass: bool = False, **kwargs):
        held = support.clone()
        out, _, mass = fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, return_mass=True, **kwargs)
        support.copy_(update_support(modes, held, select_blocks(mass, selection)))
        return (out, support, mass) if return_mass else (out, support)
    return call


def _with_selection(fn: Callable, selection: rules.SelectionRule | None) -> Callable:
    """fn for the eta rule (None or `Eta`: its eta is the call's), `select_after` for another."""
    return fn if selection is None or isinstance(selection, rules.Eta) else select_after(fn, selection)


def prepare_decode_attention(kernel: str, *, batches: list[int], heads: int, kv_heads: int, head_dim: int,
                             max_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                             min_splits: Callable[[int], int] = lambda batch: 1,
                             selection: rules.SelectionRule | None = None) -> dict[int, Callable]:
    """Per batch size of `batches`, `kernel`'s decode attention for a decode loop that builds its
    inputs by construction: values not validated (validate=False), calls of up to that many rows
    and `max_blocks` blocks per row (any narrower support too: a decode step sized by its live
    context). Triton: one workspace shared by all, so that a call allocates nothing and never
    syncs, and `min_splits(batch)` programs per row at least, to fill the GPU when batches are
    small (`prepare_verify_attention`'s pattern). selection: a rule other than eta runs as
    `select_after` (None or `Eta`: the eta rule, of the calls' eta)."""
    fn = resolve_kernel(kernel, device)
    if fn is decode_attention_reference:
        return dict.fromkeys(batches, _with_selection(functools.partial(fn, validate=False), selection))
    module = importlib.import_module(fn.__module__)
    configs = {b: dataclasses.replace(module.config_for(head_dim, dtype), min_splits=min_splits(b)) for b in batches}
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
                     selection: rules.SelectionRule | None = None):
    """`decode_attention_reference`'s contract, run by `kernel` ("auto", "reference", "triton").
    selection: None or `Eta` (whose eta then replaces `eta`): the eta rule; another rule runs as
    `select_after`."""
    if isinstance(selection, rules.Eta):
        eta, selection = selection.eta, None
    fn = _with_selection(resolve_kernel(kernel, q.device), selection)
    return fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size,
              eta=eta, scale=scale, return_mass=return_mass, validate=validate)
