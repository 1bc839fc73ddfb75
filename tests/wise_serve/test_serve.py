"""`wise serve` as a subprocess on localhost (CPU, fp32, reference kernel, eager decode), once per
backend (`--backend torch`, `--backend jax`; one server and one offline engine per backend).

Every text compared is against `LLM.generate` on the same prompt with an engine of the same
backend and settings (greedy); the server and the offline engine batch requests differently, so
equality also checks that a request's tokens do not depend on what runs beside it.
"""

import asyncio
import json
import random
import signal

import aiohttp
import pytest

from benchmarks.serve import serve_load
from serve_cases import BACKENDS, Server, offline_engine
from wise_core.sampling_params import SamplingParams

MAIN = dict(model="ouro-py-3m", num_pages=12, page_size=32, max_model_len=96, max_num_seqs=16)
PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, x):", "for i in range(10):",
           "    return", "# Copyright", "try:\n    import json\nexcept ImportError:", "x = [", "if __name__",
           "def __init__(self):\n        self."]


def server_args(cfg: dict, *extra: str) -> list[str]:
    return ["--model", cfg["model"], "--num-pages", str(cfg["num_pages"]), "--page-size", str(cfg["page_size"]),
            "--max-model-len", str(cfg["max_model_len"]), "--max-num-seqs", str(cfg["max_num_seqs"]), *extra]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def server(tmp_path_factory, backend):
    s = Server(tmp_path_factory.mktemp("serve"), *server_args(MAIN), backend=backend)
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def offline(backend):
    """LLM.generate with the server's backend and engine settings -> {(prompt, max_tokens): RequestOutput}."""
    llm = offline_engine(backend, MAIN["model"], num_pages=MAIN["num_pages"], page_size=MAIN["page_size"],
                         max_model_len=MAIN["max_model_len"], max_num_seqs=MAIN["max_num_seqs"])
    cache = {}

    def generate(items: list[tuple]) -> list:
        items = [key(p, n) for p, n in items]
        todo = [it for it in dict.fromkeys(items) if it not in cache]
        if todo:
            outs = llm.generate([p if isinstance(p, str) else list(p) for p, _ in todo],
                                [SamplingParams(max_tokens=m) for _, m in todo], use_tqdm=False)
            cache.update(zip(todo, outs))
        return [cache[it] for it in items]

    return generate


def key(prompt, max_tokens):
    return (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)


# -- endpoints ----------------------------------------------------------------------------------------
def test_models_health_metrics_and_unknown_routes(server):
    status, _, data = server.request("GET", "/v1/models")
    card = json.loads(data)["data"][0]
    assert status == 200 and card["id"] == "ouro-py-3m" and card["object"] == "model"
    assert card["max_model_len"] == 96 and card["vocab_size"] == 258
    status, _, data = server.request("GET", "/health")
    assert status == 200 and json.loads(data) == {"status": "ok"}
    m = server.metrics()
    for name in ("wise_requests_running", "wise_requests_waiting", "wise_kv_pages_free", "wise_kv_pages_total",
                 "wise_preemptions_total", "wise_generation_tokens_total", "wise_decode_tokens_per_second",
                 "wise_time_to_first_token_seconds_count", "wise_time_per_output_token_seconds_count",
                 "wise_e2e_request_latency_seconds_count", "wise_process_resident_memory_bytes",
                 'wise_time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert name in m, name
    assert m["wise_kv_pages_total"] == 12
    status, _, data = server.request("GET", "/v1/nothing")
    assert status == 404 and "Not Found" in json.loads(data)["error"]["message"]
    status, _, data = server.request("GET", "/v1/completions")
    assert status == 405


def test_completion_equals_offline_generation(server, offline):
    items = [("def fib(n):", 24), ([65, 66, 67, 10], 10), ("import", 1)]
    for (prompt, n), want in zip(items, offline(items)):
        status, body = server.post({"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        c = body["choices"][0]
        assert body["object"] == "text_completion" and body["model"] == "ouro-py-3m"
        assert c["text"] == want.text and c["token_ids"] == want.token_ids
        assert c["finish_reason"] == want.finish_reason
        assert body["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": len(want.token_ids),
                                 "total_tokens": len(want.prompt_token_ids) + len(want.token_ids)}


def test_stop_string_cuts_the_text_and_frees_the_request(server, offline):
    prompt = "def __init__(self):\n"
    [full] = offline([(prompt, 40)])
    stop = full.text[10:13]
    status, body = server.post({"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop, "§§"]})
    c = body["choices"][0]
    assert status == 200 and c["finish_reason"] == "stop"
    assert c["text"] == full.text[:full.text.index(stop)]
    assert body["usage"]["completion_tokens"] < len(full.token_ids)
    m = server.wait_idle()
    assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"]


def test_a_shared_prefix_is_served_from_the_prefix_cache(server, offline):
    """Four prompts sharing a 70-token prefix, one after another: every one after the first finds
    the prefix's two full pages (64 tokens) cached, /metrics counts each prompt token looked up
    and each found, and the texts are the offline engine's."""
    prompts = [list(range(1, 71)) + [100 + i] for i in range(4)]
    m0 = server.metrics()
    for prompt, want in zip(prompts, offline([(p, 4) for p in prompts])):
        status, body = server.post({"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert status == 200 and body["choices"][0]["token_ids"] == want.token_ids, body
    m = server.metrics()
    queries = m["wise_prefix_cache_queries_total"] - m0["wise_prefix_cache_queries_total"]
    hits = m["wise_prefix_cache_hits_total"] - m0["wise_prefix_cache_hits_total"]
    assert (queries, hits) == (4 * 71, 3 * 64)
    assert m["wise_prefix_cache_hit_rate"] == m["wise_prefix_cache_hits_total"] / m["wise_prefix_cache_queries_total"]
    assert m["wise_prefix_cache_hit_rate"] > 0


async def _stream(session, url, body):
    """One streaming completion -> (chunks, usage, saw_done)."""
    chunks, usage, done = [], None, False
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk["choices"]:
                    chunks.append(chunk["choices"][0])
                else:
                    usage = chunk["usage"]
    return chunks, usage, done


def test_100_concurrent_streams_equal_offline_generation(server, offline):
    rng = random.Random(0)
    items = [(rng.choice(PROMPTS) if i % 2 else [rng.randrange(256) for _ in range(rng.randint(1, 40))],
              rng.randint(1, 12)) for i in range(100)]

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(_stream(session, server.url, {"prompt": p, "max_tokens": n,
                                                                         "temperature": 0}) for p, n in items))

    results = asyncio.run(run())
    wants = offline(items)
    for (prompt, n), (chunks, usage, done), want in zip(items, results, wants):
        assert done and chunks[-1]["finish_reason"] == want.finish_reason
        assert all(c["finish_reason"] is None for c in chunks[:-1])
        assert "".join(c["text"] for c in chunks) == want.text
        assert len(chunks) == len(want.token_ids) == usage["completion_tokens"]        # one chunk per token
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
    m = server.wait_idle()
    assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"]


# -- bad requests ---------------------------------------------------------------------------------------
BAD_REQUESTS = [
    (b"{oops", "invalid JSON"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens must be a positive integer"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens must be a positive integer, got -1"),
    ({"prompt": "a", "temperature": -1}, "temperature must be a number >= 0"),
    ({"prompt": "a", "top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"prompt": "a", "top_p": 1.01}, "top_p must be a number in (0, 1]"),
    ({"prompt": "a", "bogus": 1}, "unknown field 'bogus'"),
    ({"prompt": "a" * 90, "max_tokens": 16}, "more than max_model_len (96)"),
    ({"prompt": [1, 2, 258], "max_tokens": 2}, "ids [258] outside the vocabulary (size 258)"),
    ({"prompt": [-1], "max_tokens": 2}, "ids [-1] outside the vocabulary"),
    ({"prompt": "a", "model": "gpt-3.5-turbo-instruct"}, "unknown model 'gpt-3.5-turbo-instruct'"),
    ({"prompt": ""}, "the prompt is empty"),
]


@pytest.mark.parametrize("body, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_is_a_400_naming_it_and_the_next_is_served(server, body, message):
    status, reply = server.post(body)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    status, reply = server.post({"prompt": "x = 1", "max_tokens": 1, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1


# -- disconnects and the soak ---------------------------------------------------------------------------
def test_client_disconnects_abort_their_requests_and_free_their_pages(server):
    before = server.metrics()["wise_client_disconnects_total"]

    async def run():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "def", "max_tokens": 90, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(f"{server.url}/v1/completions", json=body) as r:
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen == 2:
                        r.close()                 # hang up mid-stream
                        break
            body = {"prompt": "def", "max_tokens": 90, "temperature": 0, "ignore_eos": True}
            waiting = asyncio.ensure_future(session.post(f"{server.url}/v1/completions", json=body))
            # Hang up once the engine runs it (its 90 tokens take the JAX engine about 0.2 s on CPU, a
            # poll of /metrics a few ms).
            while (await asyncio.to_thread(server.metrics))["wise_requests_running"] < 1:
                assert not waiting.done(), "the request finished before it was seen running"
                await asyncio.sleep(0.005)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

    asyncio.run(run())
    m = server.wait_idle()
    assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"] == 12
    assert m["wise_requests_running"] == m["wise_requests_waiting"] == 0
    assert m["wise_client_disconnects_total"] == before + 2


def test_soak_with_disconnects_and_preemption(server, offline, backend):
    """2,000 streaming requests of random lengths (torch; with jax, whose CPU steps are slower, 300
    twice: the first pass compiles the step programs the workload needs), 10 % of the clients
    hanging up mid-stream, 16 at a time against a pool of 12 pages that forces preemption."""
    m0 = server.metrics()
    n, warm_n = (2000, 200) if backend == "torch" else (600, 300)
    requests = serve_load.make_workload(n if backend == "torch" else warm_n, prompt_len=20, prompt_spread=0.95,
                                        output_len=5, output_spread=0.8, vocab_size=256, disconnect_fraction=0.1,
                                        seed=1)
    requests = requests if backend == "torch" else requests * 2
    body = {"temperature": 0}
    warm, _ = asyncio.run(serve_load.run_requests(server.url, requests[:warm_n], concurrency=16, body_extra=body))
    warm_metrics = server.metrics()
    rss_warm, programs_warm = warm_metrics["wise_process_resident_memory_bytes"], warm_metrics["wise_step_programs"]
    rest, duration = asyncio.run(serve_load.run_requests(server.url, requests[warm_n:], concurrency=16,
                                                         body_extra=body))
    for r in rest:
        r.index += warm_n
    results = warm + rest
    summary = serve_load.summarize(requests, results, duration)
    assert summary["failed"] == 0, summary["errors"]                       # no 5xx, no broken stream
    assert summary["disconnected"] == sum(r.disconnect_after is not None for r in requests) > n // 15
    assert summary["completed"] == n - summary["disconnected"] and not summary["usage_mismatches"]
    m = server.wait_idle()
    assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"] == 12
    assert m["wise_requests_running"] == m["wise_requests_waiting"] == 0
    assert m["wise_preemptions_total"] > m0["wise_preemptions_total"]
    # A client hanging up after the server wrote its last token is no disconnect the server sees.
    assert 0 < m["wise_client_disconnects_total"] - m0["wise_client_disconnects_total"] <= summary["disconnected"]
    assert m["wise_engine_healthy"] == 1
    # Resident memory after warm-up: the requests after it may not grow it by 16 MiB (a leaked
    # preempted request alone keeps its host K/V, 1 MiB a page with this model; the growth seen on
    # CPU is about 2 MiB), besides 64 MiB per decode-step program made since: jax compiles a
    # (batch, context) bucket the first time a step needs it, which with what compiling leaves
    # behind grew the server by 26 to 69 MiB on CPU (measured); torch's eager steps make none.
    new_programs = m["wise_step_programs"] - programs_warm
    assert m["wise_process_resident_memory_bytes"] - rss_warm < (16 << 20) + new_programs * (64 << 20)
    sample = random.Random(2).sample([r for r in results if r.ok], 60)
    wants = offline([(requests[r.index].prompt, requests[r.index].max_tokens) for r in sample])
    for r, want in zip(sample, wants):
        assert r.text == want.text and r.finish_reason == want.finish_reason


def test_serve_load_reports_json_markdown_and_png(server, tmp_path):
    common = ["--url", server.url, "--num-requests", "12", "--prompt-len", "10", "--prompt-spread", "0.5",
              "--output-len", "4", "--ignore-eos", "--out", str(tmp_path)]
    report = serve_load.main([*common, "--concurrency", "4", "--warmup-requests", "2", "--label", "c4"])
    s = report["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (12, 0, 48) and not s["usage_mismatches"]
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] and s["e2e_ms"]["n"] == 12
    assert report["server"]["wise_generation_tokens_total"] == 48          # the warm-up is not counted
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"serve_load-c4.{suffix}").stat().st_size > 0
    assert json.loads((tmp_path / "serve_load-c4.json").read_text())["summary"]["completed"] == 12
    assert "| time to first token |" in (tmp_path / "serve_load-c4.md").read_text()
    assert "model" not in report["config"] and "num_pages" not in report["config"]  # the server's, not ours
    report = serve_load.main([*common, "--rate", "50", "--warmup-requests", "0", "--label", "rate"])
    assert report["summary"]["completed"] == 12 and report["summary"]["output_tokens"] == 48


def test_offline_baseline_on_dummy_weights(tmp_path):
    report = serve_load.main(["--offline", "--model", "test-tiny", "--load-format", "dummy", "--q-scale", "4",
                              "--wise", "--device", "cpu", "--attention-backend", "reference", "--num-pages", "8",
                              "--page-size", "32", "--max-model-len", "64", "--max-num-seqs", "4",
                              "--num-requests", "6", "--concurrency", "4", "--warmup-requests", "0",
                              "--prompt-len", "20", "--output-len", "5", "--ignore-eos", "--out", str(tmp_path),
                              "--label", "wise-offline"])
    s = report["summary"]
    assert (s["completed"], s["output_tokens"]) == (6, 30) and s["engine"]["fallbacks"] == 0
    assert (tmp_path / "serve_load-wise-offline.md").read_text().count("Engine: ") == 1
    assert report["config"]["model"] == "test-tiny" and report["config"]["wise"] is True


# -- WISE, the pool limit and SIGTERM --------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_wise_server_pool_limit_and_sigterm_drain(tmp_path, backend_name):
    s = Server(tmp_path, "--model", "random-tiny", "--wise", "--eta", "0.9", "--num-pages", "4", "--page-size",
               "32", "--max-model-len", "256", "--max-num-seqs", "4", "--shutdown-timeout", "60", backend=backend_name)
    try:
        status, body = s.post({"prompt": list(range(70)), "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        m = s.metrics()
        assert m["wise_fallbacks_total"] == 0 and 0 < m['wise_support_density{loop="2"}'] <= 1
        status, body = s.post({"prompt": list(range(100)), "max_tokens": 100})
        assert status == 400 and "more than the pool's 4" in body["error"]["message"]

        async def run():
            async with aiohttp.ClientSession() as session:
                long = asyncio.ensure_future(_stream(session, s.url, {"prompt": [1, 2, 3], "max_tokens": 120,
                                                                      "temperature": 0, "ignore_eos": True}))
                async with session.post(f"{s.url}/v1/completions", json={
                        "prompt": [4, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "stream": True}) as r:
                    lines = [await r.content.readline()]
                    s.proc.send_signal(signal.SIGTERM)                 # drain: in-flight requests finish
                    lines += [line async for line in r.content]
                short = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
                assert short[-1]["choices"][0]["finish_reason"] == "length" and len(short) == 12
                assert lines[-2:] == [b"data: [DONE]\n", b"\n"]                 # the stream's last event
                async with aiohttp.ClientSession() as fresh:            # a new connection: still listening
                    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/health")):
                        async with fresh.request(method, f"{s.url}{path}", json={"prompt": [1]}) as r:
                            assert r.status == 503, path
                            body = await r.json()
                            assert "shutting down" in (body["status"] if path == "/health" else
                                                       body["error"]["message"])
                assert not long.done()
                s.proc.send_signal(signal.SIGTERM)                     # a second signal aborts what is left
                return await long

        chunks, usage, done = asyncio.run(run())
        assert done and chunks[-1]["finish_reason"] == "abort" and len(chunks) - 1 < 120
        assert s.proc.wait(30) == 0
        log = s.log_path.read_text()
        assert "aborted 1 request(s) still in flight" in log and "shut down" in log
    finally:
        s.stop()
