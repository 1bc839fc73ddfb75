"""One thread at a time inside an engine.

An engine's host state (the scheduler's queues, the sequences' tokens, the pages) and its
device buffers (donated and replaced by each step in wise_jax) change within a call; a second
thread entering meanwhile would read them half-changed (torch: an IndexError, or other tokens
than a solo run's; JAX: "Array has been deleted"). Serializing the callers instead would be
correct only if every caller's sequence of calls interleaved well (a `generate` steps until its
own requests finish, so it would also run and return another thread's requests' steps), so a
second thread is refused at once with a RuntimeError naming both threads. The same thread may
enter again (`generate` calls `add_request` and `step`). wise_serve gives its engine one thread
of its own (`wise_serve.engine_loop.EngineLoop`) and queues every other thread's calls to it.
"""

from __future__ import annotations

import functools
import threading


class SingleThread:
    """Who is inside an engine: `acquire(what)` lets in the thread inside (again) or a thread
    when none is, and refuses any other with a RuntimeError; `release` undoes one acquire."""

    def __init__(self, engine_name: str):
        self.engine_name = engine_name
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._depth = 0

    def acquire(self, what: str) -> None:
        me = threading.current_thread()
        with self._lock:
            if self._owner is not None and self._owner is not me:
                raise RuntimeError(
                    f"{self.engine_name}.{what} called from thread {me.name!r} while thread {self._owner.name!r} is "
                    f"inside the engine: an engine is not thread-safe; call it from one thread (or hand calls to "
                    f"the thread that owns it, as wise_serve's EngineLoop does)")
            self._owner = me
            self._depth += 1

    def release(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None


def one_thread(method):
    """An engine method that refuses a second thread (the engine's `_single_thread` guard)."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        guard: SingleThread = self._single_thread
        guard.acquire(method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.release()

    return guarded
