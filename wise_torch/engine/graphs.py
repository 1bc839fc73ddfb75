"""CUDA graphs of the engine's steps: capture, replay, and the eager fallback.

A step (decode: its (batch bucket, context bucket); speculation: its kind first) is captured
the first time it is needed, after a warm-up on a side stream that compiles its kernels, every
step's graph in one memory pool, and replayed from then on over its static inputs. The WISE and
early-exit counters the warm-up adds to are restored. A capture that fails (any exception in the
warm-up or the capture) cannot take the engine down: the capture is ended, the device
synchronised (a lost CUDA context raises there), and the step runs eagerly, then and at every
later call, with the tokens its graph would give; the failure is logged once and kept in
`StepGraphs.eager_steps`.

Captures use the "thread_local" error mode: a CUDA call from another thread of the process
(JAX's runtime threads, when both frameworks share it) does not invalidate a capture, as it does
in "global" mode.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch

from wise_torch.wise_state import WiseState

log = logging.getLogger(__name__)


def end_capture(graph: torch.cuda.CUDAGraph, pool: tuple, device: torch.device) -> None:
    """End `graph`'s capture into `pool`. When CUDA reports the capture failed (an invalidated
    capture: it is over, with no graph), torch's capture_end raises before it stops routing the
    device's allocations to the pool and drops its reference to it; this does both (what
    `torch.cuda.use_mem_pool` does on leaving), then re-raises: a routing left in place would keep
    the caching allocator from ever processing its cross-stream events again."""
    try:
        graph.capture_end()
    except Exception:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):   # not routed: the capture never began
            torch._C._cuda_endAllocateToPool(index, pool)
            torch._C._cuda_releasePool(index, pool)
        raise


def describe_step(key: tuple) -> str:
    """A captured step's name for the log: decode's key is (batch bucket, context bucket),
    speculation's starts with its kind ("draft", "verify")."""
    if isinstance(key[0], str):
        return f"speculation {key}"
    return f"decode (batch bucket {key[0]} rows, context bucket {key[1]} pages)"


class StepGraphs:
    """The capture and replay of one engine's step graphs (module docstring), shared by its
    decode steps and speculation: one memory pool (`pool`, None before the first capture), the
    steps whose capture failed with its error (`eager_steps`, key -> "Type: message") and the
    seconds spent capturing (`capture_s`). Each caller keeps its own graphs, key -> (graph,
    output), and hands them to `run`.

    wise, loops_run: the counters a step adds to (the WISE state; the early-exit counts
    int64[2]), each None where the engine has none. tensor_parallel: the steps hold collectives,
    so no collective of a warm-up may be pending when its capture begins."""

    def __init__(self, device: torch.device, *, wise: WiseState | None, loops_run: torch.Tensor | None,
                 tensor_parallel: bool):
        self.device, self.wise, self.loops_run, self.tensor_parallel = device, wise, loops_run, tensor_parallel
        self.eager_steps: dict[tuple, str] = {}
        self.pool = None
        self.capture_s = 0.0

    def run(self, graphs: dict, key: tuple, fn: Callable):
        """fn() (a step over the static inputs) -> its output: the replay of its graph in
        `graphs`, captured the first time `key` is needed; eagerly where `key`'s capture failed
        (the eager step computes what the graph would)."""
        if key in self.eager_steps:
            return fn()
        if key not in graphs:
            captured = self.capture(key, fn)
            if captured is None:
                return fn()
            graphs[key] = captured
        graph, out = graphs[key]
        graph.replay()
        return out

    def capture(self, key: tuple, fn: Callable) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None] | None:
        """Capture fn() as a CUDA graph in the shared pool, after a warm-up that compiles the
        kernels -> (graph, fn's output); the counters the warm-up touches are restored. Under
        tensor parallelism every rank captures the same step in the same call: the warm-up's
        collectives pair up, and the captured ones run at each replay.

        A capture that fails is ended and its partial graph dropped, the device synchronised,
        the counters restored, and `key` noted in `eager_steps` and logged -> None: the caller
        runs fn() eagerly, now and at every later step of `key`."""
        start = time.perf_counter()
        counters = self._save_counters()
        try:
            return self._warm_up_and_capture(fn)
        except Exception as error:
            self._abandon_capture(key, error)
            return None
        finally:
            self._restore_counters(counters)
            self.capture_s += time.perf_counter() - start

    def _save_counters(self) -> tuple[dict | None, torch.Tensor | None]:
        """Copies of the WISE state and the early-exit counts (None for those the engine lacks)."""
        return (None if self.wise is None else self.wise.snapshot(),
                None if self.loops_run is None else self.loops_run.clone())

    def _restore_counters(self, counters: tuple[dict | None, torch.Tensor | None]) -> None:
        wise, loops_run = counters
        if wise is not None:
            self.wise.restore(wise)
        if loops_run is not None:
            self.loops_run.copy_(loops_run)

    def _warm_up_and_capture(self, fn: Callable) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """fn() once on a side stream (compiling its kernels), then captured there -> (graph, output)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.tensor_parallel:
            torch.cuda.synchronize(self.device)   # no collective of the warm-up is pending during the capture
        return self._record_graph(fn, stream)

    def _record_graph(self, fn: Callable, stream: torch.cuda.Stream
                      ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """fn() captured on `stream` as a CUDA graph in the shared pool -> (graph, output). What
        `torch.cuda.graph` does, except that a capture that fails is ended before its error
        propagates (`end_capture`) and the current stream is restored either way."""
        pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except Exception:
                with contextlib.suppress(Exception):   # the capture's own error is fn's, raised below
                    end_capture(graph, pool, self.device)
                raise
            end_capture(graph, pool, self.device)
        self.pool = pool
        return graph, out

    def _abandon_capture(self, key: tuple, error: Exception) -> None:
        """After a failed capture of step `key` (ended by `_record_graph`; its graph dropped with
        the frame): wait for the device (a lost CUDA context raises here, the capture's error
        chained), then note `key` as eager and log it -- once, as a step is captured once."""
        torch.cuda.synchronize(self.device)
        self.eager_steps[key] = f"{type(error).__name__}: {error}"
        log.warning("CUDA-graph capture of the %s step failed, so that step runs eagerly from now on "
                    "(the same tokens, without the graph's speed): %s", describe_step(key),
                    self.eager_steps[key])
