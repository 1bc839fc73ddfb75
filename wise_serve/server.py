"""The HTTP server: the OpenAI API (completions, chat completions) over the engine thread, on aiohttp.

    wise serve --model ouro-py-3m --port 8000            # --backend jax: the JAX engine
    curl localhost:8000/v1/completions -d '{"prompt": "def add(a, b): return", "max_tokens": 32, "temperature": 0}'

Routes: POST /v1/completions and POST /v1/chat/completions (JSON, or server-sent events with
`stream`: one chunk per generated token of each choice, then `data: [DONE]`), POST
/tokenize and POST /detokenize (vLLM's), GET /v1/models, GET /health, GET /metrics
(Prometheus). Each prompt is one engine request of `n` completions (one choice each; the engine
cuts its text at a stop string, and a TextStream follows the engine's outputs to stream the text
that no later token can change: `wise_core.detokenize`). Every request
gets one access-log line (logger "wise_serve.access": its id, status, prompt and completion
tokens, latency) and its id in the X-Request-Id header.

Why aiohttp (rather than FastAPI + uvicorn): one package is both the server and the load
client (benchmarks/serve/serve_load.py), so a machine without network gets the whole stack from one
small set of wheels (aiohttp and its seven dependencies, no pydantic); request validation is
the project's own (wise_serve.protocol), so every refusal is a 400 naming the field in our words
rather than a framework's 422; streaming is a plain `StreamResponse`; and `handler_cancellation`
cancels a request's handler the moment its client disconnects, which is where its pending
tokenization is dropped and its engine request aborted, its pages freed.

Tokenization (and chat-template rendering) runs in a pool of worker threads, never on the
event loop nor in the engine thread; a text prompt longer than `max_prompt_bytes` (max_model_len
x the vocabulary's longest token, in UTF-8 bytes: more text cannot fit max_model_len tokens) is
refused before it is tokenized.

No request can harm another. One request's work is bounded (`Limits`): at most
`max_request_sequences` sequences (prompts x n, refused before any prompt is tokenized) and
`max_request_tokens` tokens (prompt + max_tokens of every sequence; a chat's default max_tokens
counts as what max_model_len leaves), else a 400 naming the limit and its flag. A connection
whose request line and headers do not complete within `read_timeout` seconds is closed, as is
an idle keep-alive connection after as long, and a body that does not arrive within it is a 408
(the connection closed too): half-sent requests hold no file descriptor for long. A request the
engine fails (finish_reason "error": NaN logits) gets a 500 naming why (a stream: an error
event, then `[DONE]`), while the engine and every other request go on.

The engine is any `wise_core.engine.protocol.Engine` (wise_torch.LLM or wise_jax.LLM); the
server uses that protocol only (its tokenizer, vocab_size, max_model_len, page_size,
wise_config, requests and stats).

Lifecycle: the engine runs in its own thread (wise_serve.engine_loop). On SIGTERM (or SIGINT)
the server drains: it keeps listening but answers every new request with a 503 (/health too),
and lets in-flight requests finish for up to `shutdown_timeout` seconds; whatever is left then
(or at a second signal) is aborted: a stream ends with a chunk whose finish_reason is "abort"
and `[DONE]`, a non-streaming request gets a 503 naming how far it got. Then the process exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import json
import logging
import signal
import time
from typing import Awaitable, Callable

from aiohttp import web

from wise_core.detokenize import TextStream
from wise_core.engine.protocol import Engine
from wise_core.outputs import RequestOutput
from wise_serve import protocol
from wise_serve.args import MAX_REQUEST_SEQUENCES, MAX_REQUEST_TOKENS, READ_TIMEOUT
from wise_serve.chat import ChatTemplate, TemplateError
from wise_serve.engine_loop import EngineDead, EngineLoop, RequestHandle
from wise_serve.metrics import ServerMetrics
from wise_serve.protocol import BadRequest, Generation

log = logging.getLogger("wise_serve")
access_log = logging.getLogger("wise_serve.access")

MAX_BODY_BYTES = 16 << 20
HANDOFF_SECONDS = 5.0      # after the drain: time aborted requests get to send their last chunk
TOKENIZER_WORKERS = 2
UNDRAINED = ("/health", "/metrics")   # answered during the drain (the others: 503)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclasses.dataclass
class _Access:
    """What a request's access-log line says beyond its status and latency."""

    id: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


_ACCESS: contextvars.ContextVar[_Access] = contextvars.ContextVar("access")   # the request the task serves


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask and how long its bytes may take (module docstring), each with the
    `wise serve` flag that sets it."""

    max_request_sequences: int = MAX_REQUEST_SEQUENCES
    max_request_tokens: int = MAX_REQUEST_TOKENS
    read_timeout: float = READ_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("max_request_sequences", "max_request_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.read_timeout, (int, float)) or not 0 < self.read_timeout < float("inf"):
            raise ValueError(f"--read-timeout must be a positive number of seconds, got {self.read_timeout!r}")


class RequestFailed(Exception):
    """The engine ended one of the request's completions with finish_reason "error" (a 500)."""


class _Timing:
    """Arrival, first-token and last-token times of one engine request, observed into the histograms."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics = metrics
        self.start = self.last = start
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


class _Choice:
    """One completion as it arrives (completion `completion` of the engine request `handle`):
    its text (a TextStream following the engine's: the text the stop strings could still take
    held back, the engine's text at the end, which the engine cut at a stop string), tokens and
    logprobs. index: the
    choice's index in the response; prefix: text that starts the choice (echo: the prompt; None:
    no echo); prompt: with echo and logprobs, the prompt's ids and scores (RequestOutput's
    prompt_token_ids and prompt_ranked), once its first token came."""

    def __init__(self, index: int, handle: RequestHandle, completion: int, tokenizer, generation: Generation,
                 timing: _Timing, prefix: str | None = None):
        self.index, self.handle, self.completion, self.timing, self.prefix = index, handle, completion, timing, prefix
        self.text = TextStream(tokenizer, generation.stop, cut=False)
        self.want_logprobs = generation.logprobs is not None
        self.logprobs: list[float] = []
        self.ranked: list[dict[int, tuple[float, int]]] = []   # per token: the chosen's and the top k's (logprob, rank)
        self.want_prompt = generation.prompt_logprobs is not None
        self.prompt: tuple[list[int], list[dict[int, tuple[float, int]]]] | None = None
        self.reason: str | None = None

    def echoed(self) -> tuple[list[int], list[float | None], list[dict | None]]:
        """The echoed prompt's (tokens, logprobs, ranked entries), the first token's None; empty
        when the prompt was not scored (no echo with logprobs, or aborted before its first token)."""
        if self.prompt is None:
            return [], [], []
        ids, ranked = self.prompt
        return list(ids), [None] + [entry[t][0] for t, entry in zip(ids[1:], ranked)], [None] + list(ranked)

    def feed(self, request: RequestOutput) -> list[tuple[int | None, str | None]]:
        """The engine request's output so far -> this completion's new tokens, each (token id
        or None, finish reason or None); the last has a reason (a finished output without a new
        token gives None). Nothing once the choice has ended."""
        if self.reason is not None:
            return []
        out = request.completions[self.completion] if request.completions else request
        if out.finish_reason == "error":
            self._end("error")
            raise RequestFailed(f"the engine failed request {out.request_id}: {out.error}")
        new = out.token_ids[len(self.text.ids):]         # several at once from a speculative round
        if new and self.want_prompt and self.prompt is None:    # scored with the prefill that made the first token
            ranked = request.prompt_ranked
            if ranked is None or len(ranked) != len(request.prompt_token_ids) - 1:
                raise RuntimeError(f"the engine gave no prompt log probabilities for request {self.handle.request_id}, "
                                   "which asked for them")
            self.prompt = (request.prompt_token_ids, ranked)
        items = []
        for k, token in enumerate(new):
            self.timing.got(1)
            self.text.add([token])
            if self.want_logprobs:
                at = len(self.text.ids) - 1
                if out.logprobs is None or out.ranked is None or len(out.ranked) <= at:
                    raise RuntimeError(f"the engine gave no log probability for token {at} of request "
                                       f"{self.handle.request_id}, which asked for them")
                self.logprobs.append(out.logprobs[at])
                self.ranked.append(out.ranked[at])
            if out.finished and k == len(new) - 1:
                self.text.finish(out.text)
                return items + [(token, self._end(out.finish_reason))]
            items.append((token, None))
        if out.finished and not new:                     # aborted (shutdown) without a new token
            items.append((None, self._end(out.finish_reason)))
        return items

    def _end(self, reason: str) -> str:
        self.reason = reason
        self.timing.end(reason)
        return reason


async def _each_token(choices: list[_Choice], on_token: Callable[[_Choice, int | None, str | None], Awaitable]):
    """Run every choice to its end, awaiting on_token(choice, token, reason) for each token in
    the order tokens arrive across the engine requests (and, within one output of a request of
    n completions, in completion order). EngineDead and RequestFailed propagate."""
    requests: dict[int, list[_Choice]] = {}
    for c in choices:
        requests.setdefault(c.handle.request_id, []).append(c)

    async def tokens(group: list[_Choice]):
        while any(c.reason is None for c in group):
            out = await group[0].handle.next()
            for c in group:
                for token, reason in c.feed(out):
                    yield c, token, reason
            if out.finished and any(c.reason is None for c in group):
                raise RuntimeError(f"request {out.request_id} finished with a completion of no finish reason")

    if len(requests) == 1:
        async for item in tokens(choices):
            await on_token(*item)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(group: list[_Choice]) -> None:
        try:
            async for item in tokens(group):
                queue.put_nowait(item)
        except (EngineDead, RequestFailed) as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(group)) for group in requests.values()]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, (EngineDead, RequestFailed)):
                raise item
            else:
                await on_token(*item)
    finally:
        for t in tasks:
            t.cancel()


class CompletionServer:
    def __init__(self, engine: EngineLoop, *, model_name: str, chat_template: ChatTemplate | None = None,
                 tokenizer_workers: int = TOKENIZER_WORKERS, limits: Limits = Limits()):
        llm: Engine = engine.llm
        self.engine, self.model_name, self.chat_template, self.limits = engine, model_name, chat_template, limits
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len, self.vocab_size = llm.max_model_len, llm.vocab_size
        self.card = protocol.model_card(model_name, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        self.metrics = ServerMetrics()
        self.draining = False
        self.in_flight = 0
        self.served: set = set()       # open connections that completed a request's headers (`serve` prunes it)
        self.workers = concurrent.futures.ThreadPoolExecutor(tokenizer_workers, thread_name_prefix="wise-tokenize")
        self.longest_token_bytes = None if self.tokenizer is None else max(
            len(self.tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", errors="replace"))
            for i in range(self.tokenizer.get_vocab_size(with_added_tokens=True)))

    @property
    def max_prompt_bytes(self) -> int:
        """The longest text prompt (UTF-8 bytes) that can fit max_model_len tokens."""
        return self.max_model_len * self.longest_token_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.workers.shutdown))
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        """The drain's 503s; HTTP errors (404, 405, 413, ...) and unexpected exceptions as
        OpenAI-shaped JSON; the X-Request-Id header and the access-log line."""
        self.served.add(request.protocol)
        access = _Access(protocol.new_id("req"))
        _ACCESS.set(access)
        start, status = time.perf_counter(), "-"
        try:
            if self.draining and request.path not in UNDRAINED:
                response = self._error(503, "the server is shutting down", kind="server_error")
            else:
                try:
                    response = await handler(request)
                except web.HTTPException as e:
                    if e.status < 400:
                        status = e.status
                        raise
                    response = self._error(e.status, e.text or e.reason)
                    if e.status == 408:               # its client may still be sending: answer, then hang up
                        await self._send_and_close(request, response, access.id)
                except Exception as e:
                    log.exception("unhandled error in %s %s", request.method, request.path)
                    response = self._error(500, f"internal error: {e!r}", kind="server_error")
            if not response.prepared:
                response.headers["X-Request-Id"] = access.id
            status = response.status
            return response
        except asyncio.CancelledError:                 # the client disconnected (handler_cancellation)
            status = "disconnected"
            self.metrics.disconnects += 1
            raise
        finally:
            tokens = "" if access.prompt_tokens is None else \
                f" prompt_tokens={access.prompt_tokens} completion_tokens={access.completion_tokens}"
            access_log.info('%s "%s %s" %s%s %.3fs', access.id, request.method, request.path_qs, status, tokens,
                            time.perf_counter() - start)

    def _error(self, status: int, message: str, *, param: str | None = None,
               kind: str = "invalid_request_error") -> web.Response:
        self.metrics.rejected[status] += 1
        return _json(protocol.error_body(message, kind=kind, param=param), status)

    def _bad(self, e: Exception) -> web.Response:
        """A 400 from a BadRequest (its param) or the engine's own ValueError / TypeError."""
        return self._error(400, str(e), param=e.param if isinstance(e, BadRequest) else None)

    async def _body(self, request: web.Request) -> bytes:
        """The request body, once it has all arrived within the read timeout (else a 408, and the
        connection is closed: its client may still be sending)."""
        try:
            return await asyncio.wait_for(request.read(), self.limits.read_timeout)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {self.limits.read_timeout:g} s "
                                              f"(wise serve --read-timeout)") from None

    @staticmethod
    async def _send_and_close(request: web.Request, response: web.Response, request_id: str) -> None:
        """Send `response` now and close the connection, without reading what is left of the body."""
        response.headers["X-Request-Id"] = request_id
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()

    def _check_sequences(self, prompts: int, n: int) -> None:
        """At most max_request_sequences sequences (prompts x n) in one request."""
        limit = self.limits.max_request_sequences
        if prompts * n > limit:
            raise BadRequest(f"the request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences, more than "
                             f"the {limit} one request may hold (wise serve --max-request-sequences)", "prompt")

    def _check_tokens(self, prompts: list[list[int]], generation: Generation) -> None:
        """At most max_request_tokens tokens (prompt + max_tokens, per sequence) in one request."""
        limit = self.limits.max_request_tokens
        total = generation.n * sum(max(len(ids), self.max_model_len if generation.max_tokens is None
                                       else len(ids) + generation.max_tokens) for ids in prompts)
        if total > limit:
            raise BadRequest(f"the request holds {total} tokens (prompt + max_tokens over {len(prompts)} prompt(s) x "
                             f"n={generation.n}), more than the {limit} one request may hold "
                             f"(wise serve --max-request-tokens)", "max_tokens")

    # -- tokenization, in the worker threads ------------------------------------------------------
    async def _in_worker(self, fn, *args):
        """fn(*args) in a tokenizer thread; a cancelled caller drops it if it has not started."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    def _check_length(self, chars: int, nbytes: int | None, param: str) -> None:
        bound = self.max_prompt_bytes
        if (nbytes if nbytes is not None else chars) > bound:
            size = f"{nbytes} bytes" if nbytes is not None else f"{chars} characters"
            raise BadRequest(f"the {param} is {size}, more than the {bound} bytes (UTF-8) that can fit max_model_len "
                             f"({self.max_model_len}) tokens of at most {self.longest_token_bytes} bytes each", param)

    def _encode_now(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise BadRequest(f"the {param} holds a lone surrogate {text[e.start]!r} at index {e.start}: not valid "
                             f"Unicode text", param) from None
        self._check_length(len(text), nbytes, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def _encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """text -> token ids, in a worker thread once the bound is checked."""
        self._check_length(len(text), None, param)            # bytes >= characters: a quick refusal
        return await self._in_worker(self._encode_now, text, add_special_tokens, param)

    async def _render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise BadRequest(f"the model {self.model_name!r} has no chat template (tokenizer_config.json's "
                             f"chat_template): give one with wise serve --chat-template FILE, or use /v1/completions",
                             "messages")
        try:
            return await self._in_worker(
                lambda: self.chat_template.render(messages, add_generation_prompt=add_generation_prompt))
        except TemplateError as e:
            raise BadRequest(str(e), "messages") from None

    def token_text(self, token: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N" without a tokenizer (as vLLM)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

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

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            req = protocol.parse_tokenize(await self._body(request), model_name=self.model_name)
            if self.tokenizer is None:
                raise BadRequest("the model has no tokenizer", "prompt")
            if req.messages is not None:
                text = await self._render(req.messages, req.add_generation_prompt)
                ids = await self._encode(text, add_special_tokens=req.add_special_tokens, param="messages")
            else:
                ids = await self._encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except BadRequest as e:
            return self._bad(e)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            ids = protocol.parse_detokenize(await self._body(request), model_name=self.model_name,
                                            vocab_size=self.vocab_size)
            if self.tokenizer is None:
                raise BadRequest("the model has no tokenizer", "tokens")
        except BadRequest as e:
            return self._bad(e)
        return _json({"prompt": await self._in_worker(self.tokenizer.decode, ids)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        access = _ACCESS.get()
        access.id = protocol.new_id("cmpl")
        start = time.perf_counter()
        try:
            req = protocol.parse_completion(await self._body(request), model_name=self.model_name,
                                            has_tokenizer=self.tokenizer is not None, vocab_size=self.vocab_size)
            self._check_sequences(len(req.prompts), req.generation.n)
            prompts = await asyncio.gather(*(self._prompt_ids(p) for p in req.prompts))
            self._check_tokens(prompts, req.generation)
        except (ValueError, TypeError) as e:
            return self._bad(e)
        prefixes = None
        if req.echo:
            prefixes = [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)]
        return await self._generate(request, access, prompts, req.generation, start, chat=False, prefixes=prefixes)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        access = _ACCESS.get()
        access.id = protocol.new_id("chatcmpl")
        start = time.perf_counter()
        try:
            req = protocol.parse_chat(await self._body(request), model_name=self.model_name, vocab_size=self.vocab_size)
            self._check_sequences(1, req.generation.n)
            text = await self._render(req.messages)
            ids = await self._encode(text, add_special_tokens=False, param="messages")
            self._check_tokens([ids], req.generation)
        except (ValueError, TypeError) as e:
            return self._bad(e)
        return await self._generate(request, access, [ids], req.generation, start, chat=True)

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self._encode(prompt)
        if len(prompt) > self.max_model_len:                # the engine thread checks the ids of what fits
            raise BadRequest(f"the prompt holds {len(prompt)} token ids, more than max_model_len "
                             f"({self.max_model_len})", "prompt")
        return prompt

    async def _add(self, prompts: list[list[int]], generation: Generation) -> list[RequestHandle]:
        """Queue every prompt (one engine request of generation.n completions each), or none: when
        one is refused (a ValueError of the engine's, e.g. penalties with speculative decoding)
        the ones queued are aborted."""
        handles = []
        try:
            for ids in prompts:
                handles.append(await self.engine.add(ids, generation.params(len(ids), self.max_model_len)))
        except BaseException:
            for h in handles:
                self.engine.abort(h.request_id)
            raise
        return handles

    async def _generate(self, request: web.Request, access: _Access, prompts: list[list[int]],
                        generation: Generation, start: float, *, chat: bool,
                        prefixes: list[str] | None = None) -> web.StreamResponse:
        try:
            handles = await self._add(prompts, generation)
        except EngineDead as e:
            return self._error(503, str(e), kind="server_error")
        except (ValueError, TypeError) as e:           # BadRequest, and the engine's own checks
            return self._bad(e)
        n = generation.n
        choices = [_Choice(i * n + j, h, j, self.tokenizer, generation, _Timing(self.metrics, start),
                           None if prefixes is None else prefixes[i]) for i, h in enumerate(handles) for j in range(n)]
        access.prompt_tokens = sum(h.prompt_tokens for h in handles)
        self.in_flight += 1
        try:
            if generation.stream:
                return await self._stream(request, access, choices, generation, chat)
            return await self._complete(access, choices, generation, chat)
        finally:
            self.in_flight -= 1
            access.completion_tokens = sum(c.text.num_tokens for c in choices)
            for h in handles:
                if not h.done:
                    self.engine.abort(h.request_id)

    def _logprobs(self, chat: bool, k: int, tokens: list[int], logprobs: list[float | None],
                  ranked: list[dict[int, tuple[float, int]] | None], offset: int) -> dict:
        """The logprobs object of `tokens` (chosen), their log probabilities and ranked entries
        (the chosen token's, then the k most probable: RequestOutput.ranked; None for an echoed
        prompt's first token, completions only)."""
        texts = [self.token_text(t) for t in tokens]
        if chat:          # the k most probable, most probable first (a chosen token outside them is not listed)
            top = [[(self.token_text(t), lp) for t, (lp, _) in sorted(entry.items(), key=lambda e: -e[1][0])[:k]]
                   for entry in ranked]
            return protocol.chat_logprobs(texts, logprobs, top)
        top = [None if entry is None else [(self.token_text(t), lp) for t, (lp, _) in entry.items()]
               for entry in ranked]
        return protocol.completion_logprobs(texts, logprobs, offset, top)

    async def _complete(self, access: _Access, choices: list[_Choice], generation: Generation,
                        chat: bool) -> web.Response:
        async def nothing(*_):
            pass

        try:
            await _each_token(choices, nothing)
        except (EngineDead, RequestFailed) as e:
            for c in choices:
                if c.reason is None:
                    c.timing.end("error")
            return self._error(500, str(e), kind="server_error")
        if any(c.reason == "abort" for c in choices):
            done = " + ".join(str(c.text.num_tokens) for c in choices)
            return self._error(503, f"the server shut down before the request finished ({done} tokens generated, "
                                    f"{len(choices)} completion(s))", kind="server_error")
        out = []
        for c in choices:
            text = (c.prefix or "") + c.text.delta(final=True)
            ids = c.text.ids if generation.return_token_ids else None
            logprobs = None
            if generation.logprobs is not None:      # an echoed prompt's first, from text offset 0
                rows = (a + b for a, b in zip(c.echoed(), (c.text.ids, c.logprobs, c.ranked)))
                logprobs = self._logprobs(chat, generation.logprobs, *rows, 0)
            out.append(protocol.chat_choice(c.index, {"role": "assistant", "content": text}, c.reason, ids, logprobs)
                       if chat else protocol.choice(c.index, text, c.reason, ids, logprobs))
        return _json(protocol.completion_body(access.id, int(time.time()), self.model_name, out, protocol.usage(
            access.prompt_tokens, sum(c.text.num_tokens for c in choices)), chat=chat))

    async def _stream(self, request: web.Request, access: _Access, choices: list[_Choice], generation: Generation,
                      chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": access.id})
        await response.prepare(request)
        created = int(time.time())
        offsets = {c.index: 0 for c in choices}   # text offsets of the choices' next logprobs
        sent = {c.index: 0 for c in choices}       # tokens streamed per choice (feed may add several at once)

        async def write(choice: dict) -> None:
            chunk = protocol.completion_body(access.id, created, self.model_name, [choice], None, chat=chat,
                                             chunk=True)
            if generation.include_usage:
                chunk["usage"] = None
            await response.write(_sse(chunk))

        async def on_token(c: _Choice, token: int | None, reason: str | None) -> None:
            text = c.text.delta(final=reason is not None)
            tokens = [] if token is None else [token]
            ids = tokens if generation.return_token_ids else None
            at = slice(sent[c.index], sent[c.index] + len(tokens))      # this token's place in the choice
            sent[c.index] += len(tokens)
            rows = (tokens, c.logprobs[at], c.ranked[at]) if generation.logprobs is not None else None
            if c.prefix is not None:                      # echo: the prompt (and its logprobs) with the first token
                text, c.prefix = c.prefix + text, None
                if rows is not None:
                    rows = tuple(a + b for a, b in zip(c.echoed(), rows))
            logprobs = None
            if rows is not None:
                logprobs = self._logprobs(chat, generation.logprobs, *rows, offsets[c.index])
                offsets[c.index] += sum(len(self.token_text(t)) for t in rows[0])
            if chat:
                await write(protocol.chat_choice(c.index, {"content": text}, reason, ids, logprobs, delta=True))
            else:
                await write(protocol.choice(c.index, text, reason, ids, logprobs))

        try:
            try:
                if chat:                                  # the role first, as the OpenAI API streams it
                    for c in choices:
                        await write(protocol.chat_choice(c.index, {"role": "assistant", "content": ""}, None,
                                                         delta=True))
                await _each_token(choices, on_token)
            except (EngineDead, RequestFailed) as e:
                for c in choices:
                    if c.reason is None:
                        c.timing.end("error")
                await response.write(_sse(protocol.error_body(str(e), kind="server_error")))
            else:
                if generation.include_usage:
                    await response.write(_sse(protocol.completion_body(
                        access.id, created, self.model_name, [], protocol.usage(
                            access.prompt_tokens, sum(c.text.num_tokens for c in choices)), chat=chat, chunk=True)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:                   # the client went away between two tokens
            self.metrics.disconnects += 1
        return response


async def _close_unfinished_requests(server: web.Server, served: set, read_timeout: float) -> None:
    """Forever: close each connection that has not completed a request line and headers within
    read_timeout seconds of opening (`served`: the connections that have, kept to those open;
    after a request, aiohttp's keep-alive timeout, set to read_timeout, closes one left idle)."""
    opened: dict = {}             # open connection -> when this sweep first saw it
    loop = asyncio.get_running_loop()
    while True:
        now, connections = loop.time(), set(server.connections)
        opened = {c: opened.get(c, now) for c in connections}
        served &= connections
        for connection, since in opened.items():
            if connection not in served and now - since > read_timeout:
                connection.force_close()
        await asyncio.sleep(min(1.0, read_timeout / 4))


async def serve(llm: Engine, *, host: str, port: int, model_name: str, shutdown_timeout: float,
                chat_template: ChatTemplate | None = None, ready=None, description: str | None = None,
                engine_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                limits: Limits = Limits()) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring). ready(url) is
    called once the socket listens; description: how the engine decodes, for the start-up line
    (default: dense or WISE, from its wise_config); engine_context: what the engine thread runs
    in (`EngineLoop`); limits: what one request may ask and how long it may take to arrive."""
    loop = asyncio.get_running_loop()
    pages = llm.stats().total_pages                  # before the engine thread owns it
    engine = EngineLoop(llm, loop, engine_context)
    engine.start()
    server = CompletionServer(engine, model_name=model_name, chat_template=chat_template, limits=limits)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=limits.read_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        await engine.stop()
        raise
    sweeper = asyncio.ensure_future(_close_unfinished_requests(runner.server, server.served, limits.read_timeout))
    bound = runner.addresses[0]
    url = f"http://{bound[0] if ':' not in bound[0] else f'[{bound[0]}]'}:{bound[1]}"
    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    if description is None:
        description = "dense" if llm.wise_config is None else f"WISE eta {llm.wise_config.eta}"
    chat = "no chat template" if chat_template is None else f"chat template {chat_template.origin}"
    log.info("listening on %s (model %r, %d KV pages of %d tokens, max_model_len %d, %s, %s)", url, model_name,
             pages, llm.page_size, llm.max_model_len, description, chat)
    if ready is not None:
        ready(url)
    sig = await signals.get()
    server.draining = True
    log.info("%s: draining (new requests get a 503); %d request(s) in flight, up to %.1f s to finish",
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
    sweeper.cancel()
    await runner.cleanup()
    await engine.stop()
    log.info("shut down")
