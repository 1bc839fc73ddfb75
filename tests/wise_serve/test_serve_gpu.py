"""`wise serve` on the H200: bf16, CUDA-graph decode, dense and WISE (Triton), under concurrent
streams, disconnects and SIGTERM."""

import asyncio
import signal

import aiohttp
import pytest
import torch

from test_serve import Server, _stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("wise", [False, True], ids=["dense", "wise"])
def test_concurrent_streams_disconnects_and_sigterm_on_cuda(tmp_path, wise):
    s = Server(tmp_path, "--model", "ouro-py-3m", "--num-pages", "64", "--max-num-seqs", "32",
               *(["--wise"] if wise else []), cpu=False)
    try:
        prompts = [[(5 * j + i) % 256 for j in range(20 + 7 * i)] for i in range(48)]

        async def run():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                streams = [_stream(session, s.url, {"prompt": p, "max_tokens": 40 + i, "temperature": 0,
                                                    "ignore_eos": True}) for i, p in enumerate(prompts)]
                results = await asyncio.gather(*streams)
                for hang_up in range(8):                     # clients that leave after 3 tokens
                    async with session.post(f"{s.url}/v1/completions", json={
                            "prompt": prompts[hang_up], "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
                        seen = 0
                        async for line in r.content:
                            seen += line.startswith(b"data: ")
                            if seen == 3:
                                r.close()
                                break
                return results

        results = asyncio.run(run())
        for i, (chunks, usage, done) in enumerate(results):
            assert done and len(chunks) == usage["completion_tokens"] == 40 + i
            assert chunks[-1]["finish_reason"] == "length"
        m = s.wait_idle()
        assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"] == 64
        assert m["wise_client_disconnects_total"] == 8 and m["wise_engine_healthy"] == 1
        if wise:
            assert m["wise_fallbacks_total"] == 0 and 0 < m['wise_support_density{loop="2"}'] <= 1
        status, body = s.post({"prompt": prompts[0], "max_tokens": 8, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
