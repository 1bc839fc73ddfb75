"""The JAX engine's compiled step programs: which one runs a step, and compiling them off the step path.

A step runs a program compiled for its variant (its static options: for decode greedy or
sampling, logits kept, logits processing) and its bucket (sizes such as batch rows x context
width, `wise_core.buckets`). Compiling one is seconds to tens of seconds on a GPU for a large
model, so a step never waits for one it can avoid: it runs in the exact program when that is
compiled, else in the smallest compiled program of its variant whose bucket holds it (every size
at least the step's) -- padding rows and a wider page table give every row the very same token
(`wise_core.engine.step_plan`) -- while the exact one compiles on a background thread. Only a
step no compiled program holds waits (a "blocking" compile). With `background` off every program
compiles when a step first needs it, on the step path (the CPU default: compiling costs the
host's cores, which a CPU engine computes on).

`StepPrograms.start` compiles a start-up set in the background (the engine's: the largest decode
bucket of the default variant, which holds every step of it, one row at every width, and the prefill (opening chunks and
later ones) and first-token programs of single prompts). The counts (`stats`): programs compiled, their seconds, steps run in
a larger bucket than their own, steps that waited for a compile and the seconds they waited.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
import weakref
from typing import Callable, Hashable

log = logging.getLogger(__name__)

# A program's key: (variant, *sizes); variant: any hashable naming the program's static options,
# sizes: its bucket (ints, e.g. rows and width).
Key = tuple


class StepPrograms:
    """Compiled programs of one kind by (variant, *sizes) (module docstring).

    compile(key) -> a callable program (it traces, lowers and compiles; may run on a background
    thread). background: compile missing programs off the step path and run steps in a larger
    compiled bucket meanwhile."""

    def __init__(self, compile: Callable[[Key], Callable], *, background: bool):
        self._compile = compile
        self.background = background
        self._ready: dict[Key, Callable] = {}
        self._pending: dict[Key, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="wise-compile")
                          if background else None)
        self.compiles = 0
        self.compile_s = 0.0
        self.larger_steps = 0      # steps run in a larger bucket than their own
        self.blocked_steps = 0     # steps that waited for a compile
        self.blocked_s = 0.0
        self.failures: dict[Key, BaseException] = {}
        if self._executor is not None:   # an engine let go drops the compiles not started yet
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)

    def _build(self, key: Key) -> Callable:
        start = time.perf_counter()
        program = self._compile(key)
        with self._lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - start
            self._ready[key] = program
        return program

    def _background_build(self, key: Key) -> None:
        try:
            self._build(key)
        except BaseException as e:   # noqa: BLE001 -- kept: the step that needs it compiles it again and raises
            log.warning("compiling the program %s in the background failed: %r", key, e)
            with self._lock:
                self.failures[key] = e
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def request(self, key: Key) -> None:
        """Compile `key` in the background (once; nothing without background)."""
        if self._executor is None:
            return
        with self._lock:
            if key in self._ready or key in self._pending or key in self.failures:
                return
            self._pending[key] = self._executor.submit(self._background_build, key)

    def start(self, keys: list[Key]) -> None:
        """Compile the start-up set `keys`, in this order, in the background."""
        for key in keys:
            self.request(key)

    def find(self, variant: Hashable, *sizes: int) -> tuple[Callable, tuple[int, ...]] | None:
        """A compiled program for a step of `variant` needing a bucket of `sizes`, without
        waiting -> (program, its sizes): the exact one, else (background) the smallest compiled
        one of the variant holding it (every size at least the step's), the exact one then
        compiling in the background; None when neither is compiled."""
        key = (variant, *sizes)
        with self._lock:
            program = self._ready.get(key)
            if program is not None:
                return program, sizes
            holding = [(math.prod(k[1:]), k[1:]) for k in self._ready
                       if self.background and k[0] == variant and all(a >= b for a, b in zip(k[1:], sizes))]
            if holding:
                _, larger = min(holding)
                self.larger_steps += 1
                program = self._ready[(variant, *larger)]
        self.request(key)
        return None if program is None else (program, larger)

    def choose(self, variant: Hashable, *sizes: int) -> tuple[Callable, tuple[int, ...]]:
        """The program a step of `variant` needing a bucket of `sizes` runs -> (program, its
        sizes): `find`'s, else the exact one compiled now (counted as a blocking compile)."""
        found = self.find(variant, *sizes)
        if found is not None:
            return found
        key = (variant, *sizes)
        with self._lock:
            pending = self._pending.get(key)
        start = time.perf_counter()
        if pending is not None:
            concurrent.futures.wait([pending])
        with self._lock:
            failed = self.failures.pop(key, None)
            program = self._ready.get(key)
        if program is None:
            if failed is not None:
                log.warning("compiling %s again on the step path after its background compile failed", key)
            program = self._build(key)
        with self._lock:
            self.blocked_steps += 1
            self.blocked_s += time.perf_counter() - start
        return program, sizes

    def stats(self) -> dict:
        with self._lock:
            return dict(compiles=self.compiles, compile_s=self.compile_s, larger_bucket_steps=self.larger_steps,
                        compile_blocked_steps=self.blocked_steps, compile_blocked_s=self.blocked_s,
                        step_programs=len(self._ready))

    def wait(self) -> None:
        """Wait for every background compile requested so far (tests, benchmarks' warm-up)."""
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                return
            concurrent.futures.wait(pending)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
