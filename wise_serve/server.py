"""The HTTP server: OpenAI-compatible completions over the engine thread, on aiohttp.

    wise serve --model ouro-py-3m --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

Routes: POST /v1/completions (JSON, or server-sent events with `stream`: one chunk per
generated token, then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

Why aiohttp (rather than FastAPI + uvicorn): one package is both the server and the load
client (benchmarks/serve_load.py), so a machine without network gets the whole stack from one
small set of wheels (aiohttp and its seven dependencies, no pydantic); request validation is
the project's own (wise_serve.protocol), so every refusal is a 400 naming the field in our words
rather than a framework's 422; streaming is a plain `StreamResponse`; and `handler_cancellation`
cancels a request's handler the moment its client disconnects, which is where the engine
request is aborted and its pages freed.

Lifecycle: the engine runs in its own thread (wise_serve.engine_loop). On SIGTERM (or SIGINT)
the server stops listening (a new connection is refused; a completion asked on a connection
already open gets a 503), and lets in-flight requests
finish for up to `shutdown_timeout` seconds; whatever is left then (or at a second signal) is
aborted: a stream ends with a chunk whose finish_reason is "abort" and `[DONE]`, a
non-streaming request gets a 503 naming how far it got. Then the process exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

from aiohttp import web

from wise_serve import protocol
from wise_serve.engine_loop import EngineDead, EngineLoop, RequestHandle
from wise_serve.metrics import ServerMetrics
from wise_serve.protocol import BadRequest, CompletionRequest
from wise_core.detokenize import TextStream
from wise_torch.engine.llm import LLM

log = logging.getLogger("wise_serve")

MAX_BODY_BYTES = 16 << 20
HANDOFF_SECONDS = 5.0      # after the drain: time aborted requests get to send their last chunk


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _Timing:
    """Arrival, first-token and last-token times of one request, observed into the histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def got(self, n: int) -> None:
        now = time.perf_counter()
        for _ in range(n):
            (self.metrics.ttft if self.tokens == 0 else self.metrics.tpot).observe(now - self.last)
            self.last = now
            self.tokens += 1

    def end(self, reason: str) -> None:
        self.metrics.finished[reason] += 1
        self.metrics.e2e.observe(time.perf_counter() - self.start)


class CompletionServer:
    def __init__(self, engine: EngineLoop, *, model_name: str):
        llm: LLM = engine.llm
        self.engine, self.model_name = engine, model_name
        self.tokenizer = llm.tokenizer
        self.card = protocol.model_card(model_name, max_model_len=llm.max_model_len,
                                        vocab_size=llm.model.config.vocab_size)
        self.metrics = ServerMetrics()
        self.draining = False
        self.in_flight = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler):
        """HTTP errors (404, 405, 413, ...) and unexpected exceptions as OpenAI-shaped JSON."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self._error(e.status, e.text or e.reason)
        except Exception as e:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return self._error(500, f"internal error: {e!r}", kind="server_error")

    def _error(self, status: int, message: str, *, param: str | None = None,
               kind: str = "invalid_request_error") -> web.Response:
        self.metrics.rejected[status] += 1
        return _json(protocol.error_body(message, kind=kind, param=param), status)

    # -- routes ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self.card]})

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return _json({"status": f"the engine failed: {self.engine.error!r}"}, 503)
        if self.draining:
            return _json({"status": "shutting down"}, 503)
        return _json({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        stats = await self.engine.stats() if self.engine.thread.is_alive() else None
        text = self.metrics.render(stats, healthy=self.engine.alive, draining=self.draining)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return self._error(503, "the server is shutting down", kind="server_error")
        timing = _Timing(self.metrics)
        try:
            req = protocol.parse_completion(await request.read(), model_name=self.model_name,
                                            has_tokenizer=self.tokenizer is not None)
            handle = await self.engine.add(req.prompt, req.params)
        except EngineDead as e:
            return self._error(503, str(e), kind="server_error")
        except (ValueError, TypeError) as e:           # BadRequest, and the engine's own checks
            return self._error(400, str(e), param=getattr(e, "param", None) if isinstance(e, BadRequest) else None)
        self.in_flight += 1
        try:
            if req.stream:
                return await self._stream(request, req, handle, timing)
            return await self._complete(req, handle, timing)
        except asyncio.CancelledError:                 # the client disconnected (handler_cancellation)
            self.metrics.disconnects += 1
            raise
        finally:
            self.in_flight -= 1
            if not handle.done:
                self.engine.abort(handle.request_id)

    async def _tokens(self, handle: RequestHandle, text: TextStream, timing: _Timing):
        """The request's tokens one at a time as they come -> (token id or None, finish reason or
        None); the last has a reason (a finished output without a new token yields None)."""
        while True:
            out = await handle.next()
            new = out.token_ids[len(text.ids):]     # several at once from a speculative round
            for k, token in enumerate(new):
                timing.got(1)
                text.add([token])
                if text.stopped:                       # the engine request is aborted in `completions`
                    yield token, "stop"
                    return
                if out.finished and k == len(new) - 1:
                    text.finish()
                    yield token, "stop" if text.stopped else out.finish_reason
                    return
                yield token, None
            if out.finished and not new:               # aborted (shutdown) without a new token
                yield None, out.finish_reason
                return

    async def _complete(self, req: CompletionRequest, handle: RequestHandle, timing: _Timing) -> web.Response:
        text = TextStream(self.tokenizer, req.stop)
        reason = None
        try:
            async for _, reason in self._tokens(handle, text, timing):
                pass
        except EngineDead as e:
            timing.end("error")
            return self._error(500, str(e), kind="server_error")
        timing.end(reason)
        if reason == "abort":
            return self._error(503, f"the server shut down before the request finished ({text.num_tokens} of "
                                    f"{req.params.max_tokens} tokens generated)", kind="server_error")
        body = protocol.completion_body(
            protocol.new_completion_id(), int(time.time()), self.model_name,
            protocol.choice(text.delta(final=True), reason, text.ids if req.return_token_ids else None),
            protocol.usage(handle.prompt_tokens, text.num_tokens))
        return _json(body)

    async def _stream(self, request: web.Request, req: CompletionRequest, handle: RequestHandle,
                      timing: _Timing) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        cid, created = protocol.new_completion_id(), int(time.time())
        text = TextStream(self.tokenizer, req.stop)
        reason = None
        try:
            try:
                async for token, reason in self._tokens(handle, text, timing):
                    ids = None if not req.return_token_ids else [] if token is None else [token]
                    chunk = protocol.completion_body(
                        cid, created, self.model_name,
                        protocol.choice(text.delta(final=reason is not None), reason, ids), None)
                    if req.include_usage:
                        chunk["usage"] = None
                    await response.write(_sse(chunk))
            except EngineDead as e:
                timing.end("error")
                await response.write(_sse(protocol.error_body(str(e), kind="server_error")))
            else:
                timing.end(reason)
                if req.include_usage:
                    await response.write(_sse(protocol.completion_body(
                        cid, created, self.model_name, None, protocol.usage(handle.prompt_tokens, text.num_tokens))))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:                   # the client went away between two tokens
            self.metrics.disconnects += 1
        return response


async def serve(llm: LLM, *, host: str, port: int, model_name: str, shutdown_timeout: float,
                ready=None) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring). ready(url) is
    called once the socket listens."""
    loop = asyncio.get_running_loop()
    engine = EngineLoop(llm, loop)
    engine.start()
    server = CompletionServer(engine, model_name=model_name)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        await engine.stop()
        raise
    bound = runner.addresses[0]
    url = f"http://{bound[0] if ':' not in bound[0] else f'[{bound[0]}]'}:{bound[1]}"
    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    if llm.speculator is not None:
        spec = llm.speculator.config
        mode = f"dense output, speculative {spec.method} drafts of {spec.num_draft} tokens"
    else:
        mode = "dense" if llm.wise_config is None else f"WISE eta {llm.wise_config.eta}"
    log.info("listening on %s (model %r, %d KV pages of %d tokens, max_model_len %d, %s)", url, model_name,
             llm.blocks.num_pages, llm.page_size, llm.max_model_len, mode)
    if ready is not None:
        ready(url)
    sig = await signals.get()
    server.draining = True
    await site.stop()
    log.info("%s: no longer listening; %d request(s) in flight, up to %.1f s to finish",
             signal.Signals(sig).name, server.in_flight, shutdown_timeout)
    deadline = loop.time() + shutdown_timeout
    while server.in_flight and loop.time() < deadline and signals.empty():
        await asyncio.sleep(0.01)
    if server.in_flight:
        aborted = await engine.abort_all()
        log.info("aborted %d request(s) still in flight", aborted)
        deadline = loop.time() + HANDOFF_SECONDS
        while server.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    await runner.cleanup()
    await engine.stop()
    log.info("shut down")
