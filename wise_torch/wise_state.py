"""WISE state across a decode step: per-slot supports, their provenance, and counters.

Each request decoding with WISE holds a slot. For every (slot, layer) the state keeps the
support `bool[heads, max_blocks]`, the (request id, position) it was discovered for, and the
bitmask of discovery depths that ran for it. A reuse depth attends sparsely only when the
support is complete for the token being decoded (same request, same position, every discovery
depth ran); otherwise that (token, layer) attends densely and `fallbacks` counts it. Modes are
computed with tensor ops on the state's device (no host sync).
"""

from __future__ import annotations

import torch

from wise_core.config import ModelConfig, WiseConfig
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch.kv_cache import DecodeBatch


class WiseSlotsExhausted(RuntimeError):
    """Every WiseState slot is held by a request."""


class WiseState:
    """support: bool[slots, layers, heads, max_blocks]; tag_request, tag_position: int64[slots, layers]
    (-1: none); depths_run: int32[slots, layers] (bit d set when discovery depth d ran);
    slot_request: int64[slots] on the host (-1: free). Counters: fallbacks, and per loop the
    selected and causal (token, layer, head) blocks of reuse-depth calls (density)."""

    def __init__(self, config: WiseConfig, model_config: ModelConfig, *, max_slots: int,
                 max_blocks: int, device: torch.device | str = "cpu"):
        config.validate_for(model_config.num_loops)
        if max_slots <= 0 or max_blocks <= 0:
            raise ValueError(f"WiseState needs max_slots > 0 and max_blocks > 0, got {max_slots}, {max_blocks}")
        layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
        self.config = config
        self.support = torch.zeros(max_slots, layers, heads, max_blocks, dtype=torch.bool, device=device)
        self.tag_request = torch.full((max_slots, layers), -1, dtype=torch.int64, device=device)
        self.tag_position = torch.full((max_slots, layers), -1, dtype=torch.int64, device=device)
        self.depths_run = torch.zeros(max_slots, layers, dtype=torch.int32, device=device)
        self.slot_request = torch.full((max_slots,), -1, dtype=torch.int64)
        self.fallback_count = torch.zeros((), dtype=torch.int64, device=device)
        self.selected_blocks = torch.zeros(model_config.num_loops, dtype=torch.float64, device=device)
        self.causal_blocks = torch.zeros(model_config.num_loops, dtype=torch.float64, device=device)
        self.complete_mask = sum(1 << d for d in config.discover_depths)

    @property
    def num_layers(self) -> int:
        return self.support.shape[1]

    @property
    def max_blocks(self) -> int:
        return self.support.shape[3]

    # -- slots ------------------------------------------------------------------------------
    def acquire(self, request_id: int) -> int:
        """A free slot for `request_id` (>= 0), its supports invalidated."""
        if request_id < 0:
            raise ValueError(f"request ids must be non-negative, got {request_id}")
        if bool((self.slot_request == request_id).any()):
            raise ValueError(f"request {request_id} already holds a WISE slot")
        free = (self.slot_request < 0).nonzero()
        if free.numel() == 0:
            raise WiseSlotsExhausted(f"all {self.slot_request.numel()} WISE slots are in use; "
                                     f"release one or build the WiseState with more max_slots")
        slot = int(free[0, 0])
        self.slot_request[slot] = request_id
        self.tag_request[slot] = -1
        return slot

    def release(self, slot: int) -> None:
        """Free `slot`; its supports can no longer serve any token."""
        if not 0 <= slot < self.slot_request.numel() or self.slot_request[slot] < 0:
            raise ValueError(f"WISE slot {slot} is not held")
        self.slot_request[slot] = -1
        self.tag_request[slot] = -1

    # -- one decode step --------------------------------------------------------------------
    def begin_loop(self, loop: int, batch: DecodeBatch) -> torch.Tensor:
        """Modes int32[layers, batch] of `loop` for the batch's rows; records discovery provenance
        and counts fallbacks and density. Call once per loop, before its layers run."""
        n, layers = batch.size, self.num_layers
        role = self.config.depth_role(loop)
        if role == "dense":
            return torch.full((layers, n), DENSE, dtype=torch.int32, device=self.support.device)
        slots = batch.wise_slots
        request = batch.request_ids[:, None].expand(n, layers)
        position = batch.positions[:, None].expand(n, layers)
        match = (self.tag_request[slots] == request) & (self.tag_position[slots] == position)
        if role == "discover":
            if loop == self.config.discover_depths[0]:
                match = torch.zeros_like(match)
            modes = torch.where(match, DISCOVER_UNION, DISCOVER)
            self.depths_run[slots] = torch.where(match, self.depths_run[slots] | (1 << loop), 1 << loop).int()
            self.tag_request[slots] = request
            self.tag_position[slots] = position
        else:
            complete = match & (self.depths_run[slots] == self.complete_mask)
            modes = torch.where(complete, SPARSE, DENSE)
            self.fallback_count += (~complete).sum()
            causal = self.causal_mask(batch)                                    # [n, max_blocks]
            n_causal = causal.sum(-1)                                           # [n]
            chosen = (self.support[slots] & causal[:, None, None, :]).sum(-1)   # [n, layers, heads]
            chosen = torch.where(complete[:, :, None], chosen, n_causal[:, None, None])
            self.selected_blocks[loop] += chosen.sum()
            self.causal_blocks[loop] += n_causal.sum() * layers * self.support.shape[2]
        return modes.t().to(torch.int32).contiguous()

    def causal_mask(self, batch: DecodeBatch) -> torch.Tensor:
        """bool[batch, max_blocks]: blocks holding a key < seq_len."""
        starts = torch.arange(self.max_blocks, device=self.support.device) * self.config.block_size
        return starts[None, :] < batch.seq_lens[:, None]

    def gather(self, layer: int, batch: DecodeBatch) -> torch.Tensor:
        """The rows' supports of `layer`: bool[batch, heads, max_blocks] (a copy)."""
        return self.support[batch.wise_slots, layer]

    def store(self, layer: int, batch: DecodeBatch, support: torch.Tensor) -> None:
        """Write back the rows' supports of `layer` after a discovery call (`all_blocks`: every
        causal block instead)."""
        if self.config.all_blocks:
            support = self.causal_mask(batch)[:, None, :].expand_as(support)
        self.support[batch.wise_slots, layer] = support

    # -- counters ---------------------------------------------------------------------------
    @property
    def fallbacks(self) -> int:
        """(token, layer) pairs that attended densely at a reuse depth for want of a complete support."""
        return int(self.fallback_count)

    def density(self) -> dict[int, float | None]:
        """Per reuse depth: selected causal blocks / causal blocks over its calls (None before any)."""
        selected, causal = self.selected_blocks.tolist(), self.causal_blocks.tolist()
        return {d: (selected[d] / causal[d] if causal[d] else None) for d in self.config.reuse_depths}

    def reset_counters(self) -> None:
        self.fallback_count.zero_()
        self.selected_blocks.zero_()
        self.causal_blocks.zero_()

    # -- snapshot ---------------------------------------------------------------------------
    _TENSORS = ("support", "tag_request", "tag_position", "depths_run", "slot_request",
                "fallback_count", "selected_blocks", "causal_blocks")

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
