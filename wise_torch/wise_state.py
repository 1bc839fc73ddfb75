"""WISE state of a decode step: per-row supports, their provenance tags, and counters.

A decode step runs every loop for each row's token. For every (row, layer) the state keeps the
support `bool[heads, max_blocks]`, the tag of the token it was discovered for
(`DecodeBatch.tags`, the WISE token tag: unique per decoded token, so two tokens at the same
position of one request, or two requests, never share one) and the bitmask of discovery
depths that stored it. Tags are written when a discovery loop has stored its supports
(`end_loop`), never before. A reuse depth attends sparsely only where the support is complete
for the row's token (same tag, every discovery depth ran); otherwise that (token, layer)
attends densely and `fallbacks` counts it. A sparse draft step of speculation reads, at every
loop, the support of another token instead: its request's last verified one
(`sparse_draft_modes`), by the same tags. Padding rows (tag -1) are never counted. Everything
runs as tensor ops on the state's device: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Callable

import torch

from wise_core.model_config import ModelConfig
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_core.wise_config import WiseConfig
from wise_torch.kv_cache import DecodeBatch


def causal_block_mask(seq_lens: torch.Tensor, max_blocks: int, block_size: int) -> torch.Tensor:
    """bool[batch, max_blocks]: the blocks holding a key < seq_len (seq_lens: int[batch])."""
    starts = torch.arange(max_blocks, device=seq_lens.device) * block_size
    return starts[None, :] < seq_lens[:, None]


class WiseState:
    """Supports, tags and counters for decode steps of up to `max_rows` rows, one support per
    layer run at each depth (`ModelConfig.loop_layers`: Ouro's layers, Huginn's core block).
    num_loops: the depths a step may run (None: the model's `num_loops`; a Huginn decode of more
    core iterations than total_ut_steps passes its num_steps)."""

    def __init__(self, config: WiseConfig, model_config: ModelConfig, *, max_rows: int, max_blocks: int,
                 device: torch.device | str = "cpu", num_loops: int | None = None):
        if not isinstance(config, WiseConfig):
            raise TypeError(f"wise_config must be a WiseConfig, got {type(config).__name__}")
        num_loops = model_config.num_loops if num_loops is None else num_loops
        config.validate_for(num_loops, None if model_config.architecture != "huginn" else
                            f"{num_loops} core iterations (the WISE state's num_loops)")
        for name, value in (("max_rows", max_rows), ("max_blocks", max_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"WiseState: {name} must be a positive integer, got {value!r}")
        self.config = config
        layers, heads = model_config.loop_layers, model_config.num_attention_heads
        self.support = torch.zeros(layers, max_rows, heads, max_blocks, dtype=torch.bool, device=device)
        # The token tag of each stored support (-1: none), int64 like `DecodeBatch.tags`.
        self.tag = torch.full((max_rows, layers), -1, dtype=torch.int64, device=device)
        self.depths_run = torch.zeros(max_rows, layers, dtype=torch.int32, device=device)
        self.fallback_count = torch.zeros((), dtype=torch.int64, device=device)
        self.selected_blocks = torch.zeros(num_loops, dtype=torch.float64, device=device)
        self.causal_blocks = torch.zeros(num_loops, dtype=torch.float64, device=device)
        self.complete_mask = sum(1 << d for d in config.discover_depths)
        self.discover_modes = torch.full((layers, max_rows), DISCOVER, dtype=torch.int32, device=device)

    @property
    def num_layers(self) -> int:
        return self.support.shape[0]

    @property
    def max_rows(self) -> int:
        return self.support.shape[1]

    @property
    def max_blocks(self) -> int:
        return self.support.shape[3]

    def support_of(self, layer: int, rows: int, blocks: int | None = None) -> torch.Tensor:
        """The supports of `layer` for rows [0, rows) over the first `blocks` blocks (None: all):
        bool[rows, heads, blocks], a view the decode kernel reads (SPARSE, DISCOVER_UNION) and
        writes (discovery) in place. A decode step sized by its live context passes the blocks
        its page table covers; a support never outlives its token, so blocks past them are
        never read."""
        return self.support[layer, :rows, :, :blocks]

    def _matches(self, batch: DecodeBatch) -> torch.Tensor:
        """bool[rows, layers]: the stored support was discovered for the row's token."""
        return self.tag[:batch.size] == batch.tags[:, None]

    # -- one decode step --------------------------------------------------------------------
    def begin_loop(self, loop: int, batch: DecodeBatch, blocks: int | None = None,
                   ran: torch.Tensor | None = None) -> torch.Tensor | None:
        """Modes int32[layers, rows] of `loop` (None for a dense loop); a reuse loop also counts
        fallbacks and density over the first `blocks` blocks (`support_of`) of the rows that run
        it (ran bool[rows]; None: every row; a row that exited early rides along uncounted).
        Call once per loop, before its layers run."""
        n = batch.size
        role = self.config.depth_role(loop)
        if role == "dense":
            return None
        if role == "discover":
            if loop == self.config.discover_depths[0]:
                return self.discover_modes[:, :n]
            earlier = sum(1 << d for d in self.config.discover_depths if d < loop)
            union = self._matches(batch) & ((self.depths_run[:n] & earlier) == earlier)
            return torch.where(union, DISCOVER_UNION, DISCOVER).t().to(torch.int32).contiguous()
        return self._reuse_modes(loop, batch, self._matches(batch), blocks, ran)

    def _reuse_modes(self, loop: int, batch: DecodeBatch, matches: torch.Tensor, blocks: int | None,
                     ran: torch.Tensor | None = None) -> torch.Tensor:
        """Modes int32[layers, rows]: SPARSE where the stored support `matches` (bool[rows,
        layers]) the token it is read for and is complete, else DENSE; counts fallbacks and
        density at a reuse depth over the rows that run it (ran: `begin_loop`'s)."""
        n = batch.size
        complete = matches & (self.depths_run[:n] == self.complete_mask)                      # [rows, layers]
        if self.config.depth_role(loop) == "reuse":
            real = batch.tags >= 0 if ran is None else (batch.tags >= 0) & ran
            self.fallback_count += (~complete & real[:, None]).sum()
            blocks = self.max_blocks if blocks is None else blocks
            causal = causal_block_mask(batch.seq_lens, blocks, self.config.block_size)        # [rows, blocks]
            n_causal = causal.sum(-1)                                                          # [rows]
            chosen = (self.support[:, :n, :, :blocks] & causal[None, :, None, :]).sum(-1)     # [layers, rows, heads]
            chosen = torch.where(complete.t()[:, :, None], chosen, n_causal[None, :, None])
            self.selected_blocks[loop] += (chosen * real[None, :, None]).sum()
            self.causal_blocks[loop] += (n_causal * real).sum() * self.num_layers * self.support.shape[2]
        return torch.where(complete, SPARSE, DENSE).t().to(torch.int32).contiguous()

    def sparse_draft_modes(self, loop: int, batch: DecodeBatch, verified_tags: torch.Tensor,
                           verified_positions: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
        """Modes int32[layers, rows] of `loop` of a sparse draft step (`SpeculativeConfig(
        sparse_discovery=True)`), whatever the loop's role: row r's draft token attends the
        support discovered for its request's last verified token, the token of tag
        verified_tags[r] at verified_positions[r] (int64[rows] each), SPARSE where the stored
        support is that token's and complete, else DENSE (a fallback; fallbacks and density are
        counted at reuse depths, as `begin_loop` counts them). Such a support first gets the
        blocks of the keys after the verified token (the drafts' own, up to the row's position),
        which its discovery could not see; nothing else is written, tags included. Call once per
        loop, before its layers run (no `end_loop`)."""
        n, bs = batch.size, self.config.block_size
        matches = (self.tag[:n] == verified_tags[:, None]) & (verified_tags >= 0)[:, None]   # [rows, layers]
        blocks = self.max_blocks if blocks is None else blocks
        index = torch.arange(blocks, device=self.support.device)
        after = (index[None, :] >= ((verified_positions + 1) // bs)[:, None]) & (
            index[None, :] <= (batch.positions // bs)[:, None])                                  # [rows, blocks]
        self.support[:, :n, :, :blocks] |= matches.t()[:, :, None, None] & after[None, :, None, :]
        return self._reuse_modes(loop, batch, matches, blocks)

    def end_loop(self, loop: int, batch: DecodeBatch, blocks: int | None = None) -> None:
        """After a discovery loop's layers stored their supports: tag them with the rows' tags
        (`all_blocks`: first replace the first `blocks` blocks by every causal block)."""
        if self.config.depth_role(loop) != "discover":
            return
        n = batch.size
        if self.config.all_blocks:
            blocks = self.max_blocks if blocks is None else blocks
            causal = causal_block_mask(batch.seq_lens, blocks, self.config.block_size)
            self.support[:, :n, :, :blocks] = causal[None, :, None, :]
        bit = 1 << loop
        if loop == self.config.discover_depths[0]:
            self.depths_run[:n] = bit
        else:
            self.depths_run[:n] = torch.where(self._matches(batch), self.depths_run[:n] | bit, bit)
        self.tag[:n] = batch.tags[:, None]

    # -- counters ---------------------------------------------------------------------------
    @property
    def fallbacks(self) -> int:
        """(token, layer) pairs that attended densely at a reuse depth for want of a complete support."""
        return int(self.fallback_count)

    def density(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[int, float | None]:
        """Per reuse depth: selected causal blocks / causal blocks over its calls (None before any).
        reduce: sums the counts over tensor-parallel ranks in place (each rank counts its heads)."""
        if reduce is None:
            selected, causal = self.selected_blocks.tolist(), self.causal_blocks.tolist()
        else:
            selected, causal = reduce(torch.stack([self.selected_blocks, self.causal_blocks])).tolist()
        return {d: (selected[d] / causal[d] if causal[d] else None) for d in self.config.reuse_depths}

    def reset_counters(self) -> None:
        self.fallback_count.zero_()
        self.selected_blocks.zero_()
        self.causal_blocks.zero_()

    # -- snapshot ---------------------------------------------------------------------------
    _TENSORS = ("support", "tag", "depths_run", "fallback_count", "selected_blocks", "causal_blocks")

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every state tensor."""
        return {name: getattr(self, name).clone() for name in self._TENSORS}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Copy a `snapshot()` back in place (the tensors keep their identity)."""
        missing = set(self._TENSORS) - set(snapshot)
        if missing:
            raise ValueError(f"snapshot lacks {sorted(missing)}")
        for name in self._TENSORS:
            own, saved = getattr(self, name), snapshot[name]
            if own.shape != saved.shape or own.dtype != saved.dtype:
                raise ValueError(f"snapshot tensor {name!r} is {saved.dtype}{list(saved.shape)}, "
                                 f"the state holds {own.dtype}{list(own.shape)}")
            own.copy_(saved)
