"""Ouro's per-token early exit over one pass of the loops (the rule: `wise_core.ouro_reference`).

`ExitState` follows the rows of a step through `OuroForCausalLM.run_loops`: after each loop but
the last it adds the loop's exit probability to each row's cumulative one (float32, summed as the
released code does) and marks the rows that reach `early_exit_threshold`, keeping their normed
state of that loop. Rows that exited ride along masked: they keep running (static shapes, one
CUDA graph per bucket), their later results are discarded (`output` reads the exit loop's state)
and, with `keep_kv` (decode), each later loop's K/V at their slot is overwritten by the previous
loop's (so by the exit loop's K/V: the latest computed iteration of that position) before any
row attends. Prefill runs every loop for every token (keep_kv False) and only the logits are the
exit loop's.
"""

from __future__ import annotations

import torch
from torch import nn

from wise_torch.kv_cache import KVPlane


class ExitState:
    """rows: the step's token rows; threshold: `early_exit_threshold` (< 1); keep_kv: write the
    exit loop's K/V into the later loops' planes. `exit_loop` int32[rows] is each row's exit loop
    (the last loop until it exits)."""

    def __init__(self, rows: int, loops: int, threshold: float, *, keep_kv: bool, device):
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"ExitState needs an early_exit_threshold in [0, 1), got {threshold}")
        self.loops, self.threshold, self.keep_kv = loops, threshold, keep_kv
        self.total = torch.zeros(rows, dtype=torch.float32, device=device)
        self.remaining = torch.ones(rows, dtype=torch.float32, device=device)
        self.exited = torch.zeros(rows, dtype=torch.bool, device=device)
        self.exit_loop = torch.full((rows,), loops - 1, dtype=torch.int32, device=device)
        self.state: torch.Tensor | None = None

    def store_kv(self, loop: int, planes: KVPlane, previous: KVPlane, slots: torch.Tensor) -> None:
        """After loop `loop` stored its K/V (planes: its `KVPlane`, k, v [pages, page_size,
        kv_heads, head_dim]) at `slots` int64[rows]: exited rows take the previous loop's plane's
        storage there instead (an fp8 plane's codes and scales, as they are)."""
        if not self.keep_kv or loop == 0:
            return
        for plane, before in zip(planes, previous):
            if plane is None:     # an unquantized plane's scales
                continue
            flat, flat_before = plane.view(-1, *plane.shape[2:]), before.view(-1, *before.shape[2:])
            keep = self.exited.view(-1, *(1,) * (flat.dim() - 1))
            flat[slots] = torch.where(keep, flat_before[slots], flat[slots])

    def end_loop(self, loop: int, h: torch.Tensor, gate: nn.Linear) -> None:
        """After loop `loop` with normed states h [rows, hidden]: the rows whose cumulative exit
        probability reaches the threshold exit here (none can after the last loop, which every
        remaining row ends at)."""
        if loop == self.loops - 1:
            return
        z = h.float() @ gate.weight[0].float() + gate.bias.float()
        lam = torch.sigmoid(z)
        self.total = self.total + lam * self.remaining
        self.remaining = self.remaining * (1.0 - lam)
        now = ~self.exited & (self.total >= self.threshold)
        self.state = h.clone() if self.state is None else torch.where(now[:, None], h, self.state)
        self.exit_loop = torch.where(now, loop, self.exit_loop)
        self.exited = self.exited | now

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, hidden], the last loop's normed states -> each row's exit loop's."""
        return h if self.state is None else torch.where(self.exited[:, None], self.state, h)
