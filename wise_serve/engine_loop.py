"""The engine thread: drives `Engine.step()` beside the asyncio event loop.

The engine is any `wise_core.engine.protocol.Engine` (wise_torch.LLM, wise_jax.LLM): this
module uses that protocol only. An engine is not thread-safe, so one thread owns it. The event
loop talks to it through a queue of commands (add a request, abort one, read the stats, ...),
each a callable run in the engine thread between two steps, its result handed back through a
future. While requests are unfinished the thread runs commands queued so far, then one step;
idle, it blocks on the queue. Each step's outputs go back to the event loop in one
`call_soon_threadsafe`, onto the asyncio queue of each request's `RequestHandle`.

A request whose client went away is aborted (`Engine.abort` frees its pages at once). A request
the engine finds broken (NaN logits) is not an exception: the engine ends it alone with
finish_reason "error" and steps on, so only that request's client sees a failure (a 500). If a
step raises, the engine itself failed (a bug, a device fault) and its state cannot be trusted:
it is dead, every request in flight receives the exception, new requests are refused
(`EngineDead`), and commands still run so that nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from typing import Callable, ContextManager

from wise_core.engine.protocol import Engine
from wise_core.outputs import RequestOutput
from wise_core.sampling_params import SamplingParams
from wise_core.stats import EngineStats

log = logging.getLogger("wise_serve")


class EngineDead(RuntimeError):
    """The engine failed in a step; the server no longer serves completions."""


class RequestHandle:
    """The event-loop side of one request. Outputs (RequestOutput, or the exception that
    killed the engine) arrive on `outputs`; `done` once a finished output was taken."""

    def __init__(self, request_id: int, prompt_tokens: int):
        self.request_id, self.prompt_tokens = request_id, prompt_tokens
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False

    async def next(self) -> RequestOutput:
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            self.done = True
            raise EngineDead(f"the engine failed: {item!r}") from item
        if item.finished:
            self.done = True
        return item


class EngineLoop:
    """The thread that owns `llm` (module docstring). context: entered by the thread around all
    it does (the backend's, e.g. torch.inference_mode; wise_serve.model.engine_context)."""

    def __init__(self, llm: Engine, loop: asyncio.AbstractEventLoop,
                 context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.llm, self.loop, self.context = llm, loop, context
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[int, RequestHandle] = {}   # engine thread only
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="wise-engine", daemon=True)
        self._stopping = False

    # -- event-loop side -----------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def _submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        if not self.thread.is_alive():
            raise EngineDead("the engine thread is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put((fn, future))
        return future

    async def call(self, fn: Callable[[], object]):
        """Run fn() in the engine thread between steps -> its result (or its exception)."""
        return await asyncio.wrap_future(self._submit(fn))

    async def add(self, prompt, params: SamplingParams) -> RequestHandle:
        """Queue a request -> its handle. The engine's ValueError/TypeError (prompt too long for
        max_model_len or the pool, ids outside the vocabulary, ...) propagate: bad requests."""

        def add() -> RequestHandle:
            if self.error is not None:
                raise EngineDead(f"the engine failed: {self.error!r}")
            rid = self.llm.add_request(prompt, params)
            handle = RequestHandle(rid, len(self.llm.prompt_token_ids(rid)))
            self.handles[rid] = handle
            return handle

        future = self._submit(add)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:      # the client went away: a request queued after all is aborted
            future.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or self.abort(f.result().request_id))
            raise

    def abort(self, request_id: int) -> None:
        """Abort a request whose client is gone (no output is delivered for it)."""
        if self.thread.is_alive():
            self.commands.put((lambda: self._abort(request_id, notify=False), None))

    async def abort_all(self) -> int:
        """Abort every request in flight; each handle receives its "abort" output. -> how many."""
        return await self.call(lambda: sum(self._abort(rid, notify=True) for rid in list(self.handles)))

    async def stats(self) -> EngineStats:
        return await self.call(self.llm.stats)

    async def stop(self) -> None:
        """Abort what is left and end the thread."""
        if self.thread.is_alive():
            await self.abort_all()

            def stop() -> None:
                self._stopping = True

            await self.call(stop)
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join)

    # -- engine thread --------------------------------------------------------------------------
    def _abort(self, request_id: int, *, notify: bool) -> bool:
        handle = self.handles.pop(request_id, None)
        try:
            out = self.llm.abort(request_id)
        except KeyError:                       # finished in the meantime
            return False
        if notify and handle is not None:
            self._deliver([(handle, out)])
        return True

    def _deliver(self, items: list[tuple[RequestHandle, RequestOutput | BaseException]]) -> None:
        def put() -> None:
            for handle, item in items:
                handle.outputs.put_nowait(item)

        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:                   # the event loop is closed: nobody is listening
            pass

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                fn, future = self.commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if future is not None and not future.set_running_or_notify_cancel():
                continue                        # cancelled before it ran
            try:
                result = fn()
            except BaseException as e:          # handed to the caller
                if future is not None:
                    future.set_exception(e)
                else:
                    log.exception("engine command failed")
            else:
                if future is not None:
                    future.set_result(result)

    def _fail(self, error: BaseException) -> None:
        """The engine is dead: every request in flight receives the error."""
        self.error = error
        self._deliver([(h, error) for h in self.handles.values()])
        self.handles.clear()

    def _run(self) -> None:
        try:
            with self.context():
                self._serve()
        except BaseException as e:             # a bug outside the step: fail loudly, hang nobody
            log.exception("the engine thread stopped")
            self._fail(e)
        while True:                            # commands that came too late
            try:
                _, future = self.commands.get_nowait()
            except queue.Empty:
                break
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDead("the engine thread has stopped"))

    def _serve(self) -> None:
        while not self._stopping:
            busy = self.error is None and self.llm.has_unfinished()
            self._run_commands(block=not busy)
            if self._stopping or self.error is not None or not self.llm.has_unfinished():
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:
                log.exception("the engine failed in a step; no more completions are served")
                self._fail(e)
                continue
            items = []
            for out in outputs:
                handle = self.handles.get(out.request_id)
                if handle is None:
                    continue
                if out.finished:
                    del self.handles[out.request_id]
                items.append((handle, out))
            if items:
                self._deliver(items)
