"""A launched torch step's outputs on their way to the host (`wise_core.engine.InFlight`)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PromptScores:
    """A prefill's prompt scores on the device: rows [(sequence, first prompt token scored,
    count)] of the chunks that score positions (`Chunk.scored`), and `ranked` (log p, rank, top
    ids, top log p; `wise_torch.engine.sampler.ranked`) of each scored position's next prompt
    token, chunk after chunk."""

    rows: list
    ranked: tuple


class InFlight:
    """What a step sampled, on its way to the host: the rows' (sequence, token index), and
    pinned host copies of the tokens (a NaN flag each), their log p (when asked), their rank and
    the most probable tokens (`ranked`, when asked), kept logits, and the prompt scores (prompt_rows
    and `ranked` of their positions), enqueued after the sampling kernels; `read` and
    `read_prompt` wait for just those copies."""

    def __init__(self, rows: list, tokens: torch.Tensor, nan: torch.Tensor, logprobs: torch.Tensor | None,
                 logits: dict[int, torch.Tensor], top: tuple | None = None, prompt: PromptScores | None = None):
        pin = tokens.device.type == "cuda"
        host = lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)  # noqa: E731
        self.rows = rows
        self._tokens, self._nan = host(tokens), host(nan)
        self._logprobs = None if logprobs is None else host(logprobs)
        self._top = None if top is None else tuple(host(t) for t in top)
        self.logits = {i: host(row) for i, row in logits.items()}
        self.prompt_rows, self._prompt = [], ()
        if prompt is not None:
            self.prompt_rows, self._prompt = prompt.rows, tuple(host(t) for t in prompt.ranked)
        self.event = None
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def _wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> tuple[list[int], list[bool], list[float] | None, list[tuple] | None]:
        self._wait()
        logprobs = None if self._logprobs is None else self._logprobs.tolist()
        top = None if self._top is None else list(zip(*(t.tolist() for t in self._top)))
        return self._tokens.tolist(), self._nan.tolist(), logprobs, top

    def read_prompt(self) -> list[tuple]:
        self._wait()
        return list(zip(*(t.tolist() for t in self._prompt)))
