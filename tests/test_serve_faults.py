"""The server in-process (aiohttp's test server) when the engine fails in a step."""

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

import wise_torch as wt
from wise_serve.engine_loop import EngineLoop
from wise_serve.server import CompletionServer


def test_a_failing_step_ends_every_request_with_an_error_and_the_server_reports_it():
    llm = wt.LLM("random-tiny", num_pages=8, page_size=32, max_model_len=128, max_num_seqs=4, kernel="reference",
                 cuda_graphs=False, device="cpu")
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
    and the text is dense decode's (lossless speculation)."""
    kw = dict(num_pages=16, page_size=32, max_model_len=128, max_num_seqs=4, kernel="reference", cuda_graphs=False,
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
            text = await (await client.get("/metrics")).text()
            values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("wise_spec_"))
            assert float(values["wise_spec_accepted_tokens_total"]) > 0     # some rounds gave several tokens
        await engine.stop()

    asyncio.run(run())
