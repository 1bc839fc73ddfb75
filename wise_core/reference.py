"""The numpy specification of WISE: block mass, the selection rule, union, density, attention.

Both frameworks are tested against these functions. Conventions (shared by every kernel):

- Keys are split into blocks of `block_size` consecutive positions; block b holds keys
  [b * block_size, (b + 1) * block_size). A key position is causal when it is < seq_len.
- Block mass is the softmax probability summed over a block's keys; non-causal blocks have
  mass 0.
- Selection (`select_blocks`), per row, in float32: rank blocks by mass descending, ties to the
  lower index; with `c` the running sum of the ranked masses, `total = c[-1]` and
  `threshold = eta * total`, the block at rank r is kept iff r == 0 or c[r - 1] < threshold.
  That is the smallest ranked prefix whose mass reaches eta of the total, never empty.
  Implementations may sum in another order; they then agree except where a running sum lies
  within float32 rounding of the threshold. Masses below float32's smallest normal number
  count as zero (GPU arithmetic and XLA on CPU flush such subnormals). That is the default rule
  (`wise_core.selection.Eta`); `select_blocks(mass, rule)` is also the reference of the other
  rules (`TopK`, `Threshold`, `Custom`), which rank the blocks the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from wise_core import selection


def select_blocks(mass: np.ndarray, rule, context: selection.SelectionContext | None = None) -> np.ndarray:
    """mass: float[..., n_blocks] (finite, non-negative) -> bool[..., n_blocks] support chosen by
    `rule` (a `wise_core.selection` rule, or a number: the eta rule with that eta). context: a
    `SelectionContext` of numpy arrays, which a Custom(..., context=True) rule reads (its rank
    filled here)."""
    rule = selection.as_rule(rule)
    mass = np.asarray(mass)
    if mass.ndim == 0 or mass.shape[-1] == 0:
        raise ValueError(f"mass must have a non-empty last (block) axis, got shape {mass.shape}")
    mass = mass.astype(np.float32)
    if np.any(mass < 0) or not np.all(np.isfinite(mass)):
        raise ValueError("mass must be finite and non-negative")
    mass = np.where(mass < np.finfo(np.float32).tiny, np.float32(0), mass)
    order = np.argsort(-mass, axis=-1, kind="stable")  # descending, ties to the lower index
    ranked = np.take_along_axis(mass, order, axis=-1)
    running = np.cumsum(ranked, axis=-1, dtype=np.float32)
    total = running[..., -1:]
    if isinstance(rule, selection.Eta):
        before = np.concatenate([np.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
        keep_ranked = before < np.float32(rule.eta) * total
    elif isinstance(rule, selection.TopK):
        keep_ranked = np.broadcast_to(np.arange(mass.shape[-1]) < rule.k, mass.shape).copy()
    elif isinstance(rule, selection.Threshold):
        keep_ranked = (ranked >= np.float32(rule.fraction) * total) & (ranked > 0)
    else:  # Custom: the user's choice, in block order
        if context is not None:
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.broadcast_to(np.arange(mass.shape[-1]), order.shape), axis=-1)
            context = dataclasses.replace(context, rank=rank.astype(np.int32))
        chosen = np.asarray(rule.choose(mass, context))
        if chosen.shape != mass.shape or chosen.dtype != np.bool_:
            raise ValueError(f"selection rule {rule.describe()!r} returned {chosen.dtype}{list(chosen.shape)}; "
                             f"it must return bool{list(mass.shape)}")
        keep_ranked = np.take_along_axis(chosen, order, axis=-1)
    keep_ranked[..., 0] = True  # never empty
    keep = np.zeros_like(keep_ranked)
    np.put_along_axis(keep, order, keep_ranked, axis=-1)
    return keep


def num_blocks(seq_len: int, block_size: int) -> int:
    """Blocks covering `seq_len` keys."""
    return -(-seq_len // block_size)


def block_mass(probs: np.ndarray, block_size: int, n_blocks: int | None = None) -> np.ndarray:
    """probs: [..., n_keys] -> mass [..., n_blocks], summing each block's probabilities."""
    probs = np.asarray(probs)
    n_keys = probs.shape[-1]
    n_blocks = num_blocks(n_keys, block_size) if n_blocks is None else n_blocks
    pad = n_blocks * block_size - n_keys
    if pad < 0:
        raise ValueError(f"{n_keys} keys do not fit in {n_blocks} blocks of {block_size}")
    padded = np.concatenate([probs, np.zeros(probs.shape[:-1] + (pad,), probs.dtype)], axis=-1)
    return padded.reshape(probs.shape[:-1] + (n_blocks, block_size)).sum(-1)


def union(*supports: np.ndarray) -> np.ndarray:
    """OR of several bool supports of the same shape."""
    return np.logical_or.reduce([np.asarray(s, bool) for s in supports])


def causal_blocks(seq_len: int, block_size: int, n_blocks: int) -> np.ndarray:
    """bool[n_blocks]: blocks holding at least one key < seq_len."""
    return np.arange(n_blocks) * block_size < seq_len


def all_blocks(seq_len: int, block_size: int, shape: tuple[int, ...], n_blocks: int) -> np.ndarray:
    """The all-blocks support: every causal block selected, broadcast to shape + (n_blocks,)."""
    return np.broadcast_to(causal_blocks(seq_len, block_size, n_blocks), tuple(shape) + (n_blocks,)).copy()


def support_density(support: np.ndarray, seq_len: int, block_size: int) -> float:
    """Fraction of the causal blocks a support selects, averaged over its leading axes."""
    support = np.asarray(support, bool)
    causal = causal_blocks(seq_len, block_size, support.shape[-1])
    return float((support & causal).sum(-1).mean() / causal.sum())


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, block_size: int = 32,
              support: np.ndarray | None = None, scale: float | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Single-token attention over one sequence, dense or restricted to a block support.

    q: [heads, head_dim]; k, v: [seq, kv_heads, head_dim]; support: bool[heads, n_blocks] or
    None (dense). Query head h reads KV head h // (heads // kv_heads).
    Returns (out [heads, head_dim], mass [heads, n_blocks]): the output in float64, and the
    block mass of the probabilities actually attended (dense mass when support is None).
    """
    heads, head_dim = q.shape
    seq, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    n_blocks = num_blocks(seq, block_size) if support is None else support.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    group = heads // kv_heads
    kh = np.repeat(np.asarray(k, np.float64), group, axis=1)  # [seq, heads, dim]
    vh = np.repeat(np.asarray(v, np.float64), group, axis=1)
    scores = np.einsum("hd,shd->hs", np.asarray(q, np.float64), kh) * scale
    if support is not None:
        key_block = np.arange(seq) // block_size
        scores = np.where(np.asarray(support, bool)[:, key_block], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hs,shd->hd", probs, vh)
    return out, block_mass(probs, block_size, n_blocks)
