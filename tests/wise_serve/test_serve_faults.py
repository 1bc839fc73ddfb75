"""The server in-process (aiohttp's test server): a failing engine step, speculation (torch), slow
tokenization and clients that leave, a model without a chat template; the engine-facing cases
once per backend."""

import asyncio
import json
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from serve_cases import BACKENDS, offline_engine
from wise_serve.chat import load_chat_template
from wise_serve.engine_loop import EngineLoop
from wise_serve.server import CompletionServer


def tiny_engine(backend: str):
    return offline_engine(backend, "random-tiny", num_pages=8, page_size=32, max_model_len=128, max_num_seqs=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_step_ends_every_request_with_an_error_and_the_server_reports_it(backend):
    llm = tiny_engine(backend)
    step, calls = llm.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 4:
            raise FloatingPointError("injected: the model's logits are NaN")
        return step()

    llm.step = failing_step

    async def run():
        engine = EngineLoop(llm, asyncio.get_running_loop())
        engine.start()
        server = CompletionServer(engine, model_name="random-tiny")
        async with TestClient(TestServer(server.app())) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": 50, "temperature": 0, "ignore_eos": True}
            waiting = asyncio.ensure_future(client.post("/v1/completions", json=body))
            r = await client.post("/v1/completions", json={**body, "stream": True})
            events = [line async for line in r.content if line.startswith(b"data: ")]
            assert r.status == 200 and events[-1] == b"data: [DONE]\n"
            error = json.loads(events[-2][6:])["error"]
            assert "injected: the model's logits are NaN" in error["message"] and error["type"] == "server_error"
            assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events[:-2])
            r = await waiting
            assert r.status == 500 and "the engine failed" in (await r.json())["error"]["message"]
            r = await client.post("/v1/completions", json=body)
            assert r.status == 503 and "the engine failed" in (await r.json())["error"]["message"]
            r = await client.get("/health")
            assert r.status == 503 and "injected" in (await r.json())["status"]
            r = await client.get("/metrics")
            text = await r.text()
            assert "wise_engine_healthy 0" in text and 'wise_requests_finished_total{finish_reason="error"} 2' in text
        await engine.stop()
        assert not engine.thread.is_alive()

    asyncio.run(run())


def test_speculative_engine_streams_one_chunk_per_token_with_dense_text():
    """A speculative round yields several tokens at once; the stream still has one chunk per token
    and the text is dense decode's (lossless speculation; torch only)."""
    import wise_torch as wt

    kw = dict(num_pages=16, page_size=32, max_model_len=128, max_num_seqs=4, attention_backend="reference",
              cuda_graphs=False,
              device="cpu")
    prompts = ["def add(a, b):\n    return", "    def __init__(self"]
    dense = wt.LLM("ouro-py-3m", **kw).generate(prompts, wt.SamplingParams(max_tokens=24), use_tqdm=False)
    llm = wt.LLM("ouro-py-3m", speculative_config=wt.SpeculativeConfig("wise", num_draft=3), **kw)

    async def run():
        engine = EngineLoop(llm, asyncio.get_running_loop())
        engine.start()
        server = CompletionServer(engine, model_name="ouro-py-3m")
        async with TestClient(TestServer(server.app())) as client:
            for prompt, want in zip(prompts, dense):
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                               "stream": True, "return_token_ids": True})
                chunks = [json.loads(line[6:])["choices"][0] async for line in r.content
                          if line.startswith(b"data: {")]
                assert [c["token_ids"] for c in chunks] == [[t] for t in want.token_ids]
                assert "".join(c["text"] for c in chunks) == want.text
                assert chunks[-1]["finish_reason"] == want.finish_reason
            for field, value in (("presence_penalty", 0.5), ("logprobs", 2)):   # the engine's refusals: 400s
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value})
                body = await r.json()
                assert r.status == 400 and "speculative decoding does not apply" in body["error"]["message"], body
            text = await (await client.get("/metrics")).text()
            values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("wise_spec_"))
            assert float(values["wise_spec_accepted_tokens_total"]) > 0     # some rounds gave several tokens
        await engine.stop()

    asyncio.run(run())


class _BlockingTokenizer:
    """A tokenizer whose encode waits for `release` (a slow tokenization), recording its texts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts, self.release = tokenizer, [], threading.Event()

    def encode(self, text, **kw):
        self.texts.append(text)
        assert self.release.wait(30)
        return self.tokenizer.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokenization_runs_off_the_event_loop_and_a_client_that_leaves_drops_it(backend):
    """One tokenizer worker, blocked on the first prompt: /health still answers at once; both
    clients hang up; the queued prompt is never tokenized, the first's result is dropped, and
    the engine never sees either request."""
    llm = tiny_engine(backend)

    async def run():
        engine = EngineLoop(llm, asyncio.get_running_loop())
        engine.start()
        server = CompletionServer(engine, model_name="random-tiny", tokenizer_workers=1)
        slow = server.tokenizer = _BlockingTokenizer(llm.tokenizer)
        async with TestClient(TestServer(server.app(), handler_cancellation=True)) as client:
            body = {"max_tokens": 4, "temperature": 0}
            first = asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": "first"}))
            second = asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": "second"}))
            while not slow.texts:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            r = await client.get("/health")
            # The event loop is free: /health takes milliseconds; 1 s is far from a blocked loop's 30 s.
            assert r.status == 200 and time.perf_counter() - start < 1.0
            await asyncio.sleep(0.1)                   # the second request waits for the one worker
            second.cancel()
            first.cancel()
            while server.metrics.disconnects < 2:
                await asyncio.sleep(0.01)
            slow.release.set()
            await asyncio.sleep(0.2)
            assert slow.texts == ["first"]
            stats = await engine.stats()
            assert llm.next_id == 0 and stats.running == stats.waiting == 0
            assert stats.free_pages == stats.total_pages
            r = await client.post("/v1/completions", json={**body, "prompt": "third"})
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
        await engine.stop()

    asyncio.run(run())


def test_chat_without_a_template_is_a_400_saying_so():
    llm = tiny_engine("torch")
    assert load_chat_template("random-tiny", None, tokenizer=llm.tokenizer, bos_token_id=256,
                              eos_token_id=256) is None

    async def run():
        engine = EngineLoop(llm, asyncio.get_running_loop())
        engine.start()
        server = CompletionServer(engine, model_name="random-tiny")
        async with TestClient(TestServer(server.app())) as client:
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})):
                r = await client.post(path, json=body)
                error = (await r.json())["error"]
                assert r.status == 400 and error["param"] == "messages", path
                assert "the model 'random-tiny' has no chat template" in error["message"]
                assert "--chat-template FILE" in error["message"]
        await engine.stop()

    asyncio.run(run())
