"""A launched JAX step's outputs on their way to the host (`wise_core.engine.InFlight`)."""

from __future__ import annotations


import jax
import numpy as np


class InFlight:
    """A launched step's outputs on the device (wise_core.engine.InFlight): rows [(sequence,
    token index)], `at` the output row of each; prompt: per entry of prompt_rows its
    `score_prompt` outputs, over its chunk's padded positions."""

    def __init__(self, rows: list, outputs, at: list[int], prompt_rows: list | None = None,
                 prompt: list | None = None, loops_run: list[int] | None = None):
        self.rows, self._outputs, self._at, self.logits = rows, outputs, at, {}
        self.prompt_rows, self._prompt = prompt_rows or [], prompt or []
        self._loops_run = loops_run

    def read_prompt(self) -> list[tuple]:
        scores = []
        for (_, _, count), arrays in zip(self.prompt_rows, jax.device_get(self._prompt)):
            scores.extend(zip(*(np.asarray(x[:count]).tolist() for x in arrays)))
        return scores

    def read(self) -> tuple[list[int], list[bool], list[float], list[tuple] | None]:
        token, logprob, nan, logits, top, loops_run = jax.device_get(self._outputs)
        if loops_run is not None and self._loops_run is not None:   # the engine's early-exit counts
            self._loops_run[0] += int(loops_run[0])
            self._loops_run[1] += int(loops_run[1])
        at = np.asarray(self._at, np.int64)
        self.logits = {i: np.asarray(logits[at[i]]) for i, (seq, _) in enumerate(self.rows)
                       if seq.keep_logits and logits is not None}
        if top is not None:
            top = list(zip(*(x[at].tolist() for x in top)))
        return token[at].tolist(), nan[at].tolist(), logprob[at].tolist(), top
