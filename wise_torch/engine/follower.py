"""The tensor-parallel mirror on a worker rank: rank 0's runner sends each device-side call with
its host inputs (`distributed.Workers.send`) before running it, and a worker's `Follower` runs
the same call on its own runner (its shard: its heads' K/V pages and WISE supports, the same pool
layout), so the collectives inside pair up. Each method is the worker's part of the
`ModelRunner` method of the same name, given what rank 0 sent."""

from __future__ import annotations

import numpy as np
import torch

from wise_torch.engine.model_runner import ModelRunner
from wise_torch.engine.offload import copy_in, copy_out
from wise_torch.engine.staging import PrefillInputs


class Follower:
    """A worker rank's runner under rank 0's calls. `offloaded`: the K/V this rank copied out
    for each preempted request, by request id, until it resumes or leaves."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.offloaded: dict[int, tuple[torch.Tensor, ...]] = {}

    def decode(self, bucket: int, width: int, meta: np.ndarray, table: np.ndarray) -> None:
        """The decode step of rank 0's staged rows (`DecodeStaging.stage`'s views). The staging
        buffers alternate as rank 0's do: rank 0 stages a step only once it has read the tokens
        of the step two before, which needed every rank's collectives of that step, each after
        that rank's copy of its inputs; so no copy of a worker is still queued when its buffer is
        refilled."""
        r = self.runner
        r.staging.receive(bucket, width, meta, table, r.cache.scratch_page)
        r.decode_staged(bucket, width)

    def prefill(self, inputs: PrefillInputs) -> None:
        self.runner.run_prefill(inputs)

    def offload(self, request_id: int, pages: list[int]) -> None:
        """Keep host copies of the request's `pages` (this rank's heads)."""
        self.offloaded[request_id] = copy_out(self.runner.cache, pages)

    def restore(self, request_id: int, pages: list[int]) -> None:
        """The request's copies back into its (new) `pages`."""
        copy_in(self.runner.cache, pages, self.offloaded.pop(request_id))

    def forget(self, request_id: int) -> None:
        """The request left the engine while offloaded: drop its copies."""
        del self.offloaded[request_id]

    def scrub(self, pages: list[int]) -> None:
        self.runner.scrub(pages)

    def wise_density(self) -> None:
        self.runner.wise_density()

    def reset_wise_counters(self) -> None:
        self.runner.reset_wise_counters()
