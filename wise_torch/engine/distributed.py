"""The processes of a tensor-parallel engine (`LLM(..., tensor_parallel_size=N)`).

The process that makes the LLM is rank 0: it holds the scheduler, the block manager, the
sequences, the sampler and its own shard. `start` spawns ranks 1..N-1 with torch.multiprocessing
(start method "spawn": a CUDA context cannot be forked); every rank joins torch.distributed's
default process group (NCCL on CUDA, rank r on device index base + r; gloo on CPU), receives its
shard of rank 0's model by broadcast (`wise_torch.parallel.broadcast_shard`) and builds a
ModelRunner with rank 0's settings. Then each worker follows (`wise_torch.engine.follower`):
rank 0 sends every device-side call of a step (with its host inputs: the staged decode rows,
the prefill chunks' arrays, the pages to offload or restore) down a pipe to each worker before
running it itself, and a worker's Follower runs the same calls in the same order on its runner,
so the collectives inside them -- the all-reduces of every layer, the broadcast of each decode
step's input tokens -- pair up. Workers never report back: only rank 0 samples and reads
tokens, and its sampled tokens reach the workers' devices through that broadcast, on the
device, so the engine's one-step-behind pipelining is kept.

Why spawned workers rather than a torchrun launch: an LLM is one object in one Python process
(a script, a notebook, `generate`, a test), and with torchrun every rank would run the user's
whole program. Why a pipe for the calls rather than a collective: an idle worker waits on it
without a timeout, rank 0 never waits for a worker to be ready to receive, and a worker whose
rank 0 is gone sees the pipe close and exits. The tensors move by torch.distributed only.

A script that makes such an LLM needs the `if __name__ == "__main__":` guard (spawn imports
the main module in every worker).
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wise_torch.parallel import TensorParallel, broadcast_shard, check_divisible

START_TIMEOUT_S = 300       # a worker that has not started by then is an error
JOIN_TIMEOUT_S = 30         # after that long a closing worker is terminated
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class Workers:
    """Rank 0's handle on ranks 1..N-1: `send` a Follower call to all of them, `close` them."""

    def __init__(self, device: torch.device):
        self.device = device                  # rank 0's
        self.processes: list = []
        self.pipes: list = []
        self.closed = False

    def send(self, name: str, *args) -> None:
        """Every worker runs `Follower.<name>(*args)` next (in the order sent)."""
        if self.closed:
            raise RuntimeError("the engine's tensor-parallel workers are closed")
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), 1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} has exited (code {process.exitcode}); "
                                   f"the engine cannot go on")
            pipe.send((name, args))

    def wait_ready(self) -> None:
        """Wait until every worker reports its runner built (after `send("settings", ...)`)."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), 1):
            _wait_ready(rank, process, pipe)

    def close(self) -> None:
        """Stop the workers (each finishes the calls sent, leaves the process group and exits),
        then leave the process group here."""
        if self.closed:
            return
        self.closed = True
        if self.device.type == "cuda" and dist.is_initialized():
            torch.cuda.synchronize(self.device)     # rank 0's steps in flight end (with the workers')
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:          # that worker is gone already
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0))
            if process.is_alive():
                process.terminate()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank: CUDA device indices base, base + 1, ... (base: rank 0's), or the CPU."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CUDA devices or the CPU, not {device}")
    base = device.index if device.index is not None else torch.cuda.current_device()
    if base + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} from cuda:{base} needs {base + size} CUDA devices, "
                         f"this machine has {torch.cuda.device_count()}")
    return [torch.device("cuda", base + r) for r in range(size)]


def start(model, size: int) -> tuple[Workers, object]:
    """Spawn ranks 1..size-1 of a tensor-parallel engine over `model` (rank 0's whole
    OuroForCausalLM, on rank 0's device) -> (the workers, rank 0's shard). The workers then
    wait for their runner's settings (`Workers.send("settings", ...)` first, then
    `Workers.wait_ready`) and calls."""
    check_divisible(model.config, size)
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1 starts its own torch.distributed process group, but this "
                           "process has one already (an LLM not closed, or the program's own)")
    weight = model.head_weight
    devices = rank_devices(weight.device, size)
    backend = "nccl" if devices[0].type == "cuda" else "gloo"
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    workers = Workers(devices[0])
    try:
        for rank in range(1, size):
            here, there = context.Pipe()
            process = context.Process(
                target=_worker, daemon=True, name=f"wise-tp-rank{rank}",
                args=(rank, size, init_method, backend, str(devices[rank]), model.config, weight.dtype,
                      torch.get_num_threads(), there))
            process.start()
            there.close()
            workers.processes.append(process)
            workers.pipes.append(here)
        for rank, (process, pipe) in enumerate(zip(workers.processes, workers.pipes), 1):
            _wait_ready(rank, process, pipe)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        shard = broadcast_shard(model, model.config, TensorParallel(0, size), dtype=weight.dtype,
                                device=devices[0], tokenizer=model.tokenizer)
    except BaseException:
        workers.close()
        raise
    return workers, shard


def _wait_ready(rank: int, process, pipe) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not pipe.poll(0.05):
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (code {process.exitcode}); "
                               f"its traceback is on stderr")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S} s")
    message = pipe.recv()
    if message != "ready":
        raise RuntimeError(f"tensor-parallel rank {rank} sent {message!r} instead of starting")


def _worker(rank: int, size: int, init_method: str, backend: str, device: str, config, dtype: torch.dtype,
            threads: int, pipe) -> None:
    """Rank `rank`: join the group, take its shard, build its runner, then run rank 0's calls
    until told to stop (None) or rank 0's end of the pipe closes."""
    from wise_torch.engine.follower import Follower
    from wise_torch.engine.model_runner import ModelRunner
    torch.set_num_threads(threads)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe.send("ready")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        model = broadcast_shard(None, config, TensorParallel(rank, size), dtype=dtype, device=device)
        follower = None
        with torch.inference_mode():
            while True:
                try:
                    message = pipe.recv()
                except EOFError:      # rank 0 is gone
                    break
                if message is None:
                    break
                name, args = message
                if name == "settings":
                    follower = Follower(ModelRunner(model, **args[0]))
                    pipe.send("ready")
                else:
                    getattr(follower, name)(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        dist.destroy_process_group()
