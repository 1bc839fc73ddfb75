"""Load client for `wise serve`: N streaming completions at a fixed rate or concurrency.

    python -m benchmarks.serve.serve_load --url http://127.0.0.1:8000 --num-requests 256 --concurrency 64 \\
        --prompt-len 1024 --output-len 128 --ignore-eos --out benchmarks/results/serve --label dense

Prompts are random token ids (prompt lengths uniform in prompt_len * [1 - spread, 1 + spread],
output lengths likewise), sent as `stream: true` so that every token's arrival is seen; with
--rate the arrivals are a Poisson process, with --concurrency a fixed number of clients each
send their next request when the last one ends. --disconnect-fraction makes that share of the
clients close their connection after a random number of tokens (the server must abort them).
Reports time to first token, time per output token (per request: (last - first) / (tokens - 1)),
inter-token latency and end-to-end latency (mean, p50, p90, p99), request and token
throughput, and errors, with the server's /metrics before and after; writes JSON + markdown +
a PNG of the latency distributions.

--offline runs the same workload on an in-process engine (the `wise serve` engine flags; no
HTTP; all requests queued at once, --max-num-seqs of them decoding): the throughput the server
is held against.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import report as rp


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    disconnect_after: int | None = None     # close the connection after this many tokens


@dataclasses.dataclass
class Result:
    index: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    disconnected: bool = False
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    start: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float:
        return self.end - self.start


def _spread(rng: random.Random, center: int, spread: float) -> int:
    low, high = max(1, round(center * (1 - spread))), max(1, round(center * (1 + spread)))
    return rng.randint(low, high)


def make_workload(n: int, *, prompt_len: int, output_len: int, vocab_size: int, prompt_spread: float = 0.0,
                  output_spread: float = 0.0, disconnect_fraction: float = 0.0, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = _spread(rng, output_len, output_spread)
        prompt = [rng.randrange(vocab_size) for _ in range(_spread(rng, prompt_len, prompt_spread))]
        cut = rng.randint(1, m - 1) if m > 1 and rng.random() < disconnect_fraction else None
        out.append(Request(prompt, m, cut))
    return out


# -- the HTTP client ------------------------------------------------------------------------------
async def _one(session, url: str, model: str | None, req: Request, body_extra: dict, result: Result) -> None:
    import aiohttp

    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **body_extra}
    if model is not None:
        body["model"] = model
    result.start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            result.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    result.error = f"{resp.status}: {json.loads(text)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    result.error = f"{resp.status}: {text[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    result.ok = result.finish_reason is not None and result.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream: {chunk['error']['message']}"
                    continue
                if chunk["choices"]:
                    c = chunk["choices"][0]
                    result.token_times.append(time.perf_counter())
                    result.text += c["text"]
                    result.finish_reason = c["finish_reason"] or result.finish_reason
                    if req.disconnect_after is not None and len(result.token_times) >= req.disconnect_after \
                            and c["finish_reason"] is None:
                        resp.close()
                        result.disconnected = True
                        return
                elif chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
            else:
                result.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()


async def fetch_json(session, url: str):
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


async def scrape_metrics(session, url: str) -> dict[str, float]:
    """Unlabelled samples and finish-reason counters of /metrics (histogram buckets left out)."""
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "_bucket{" in line or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


async def run_requests(url: str, requests: list[Request], *, rate: float | None = None,
                       concurrency: int | None = None, model: str | None = None, body_extra: dict | None = None,
                       seed: int = 0, timeout: float = 600.0) -> tuple[list[Result], float]:
    """Send `requests` at `rate` (Poisson, req/s) or with `concurrency` clients -> (results, seconds)."""
    import aiohttp

    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    results = [Result(i) for i in range(len(requests))]
    extra = body_extra or {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = time.perf_counter()
        if concurrency is not None:
            todo = iter(range(len(requests)))

            async def worker():
                for i in todo:
                    await _one(session, url, model, requests[i], extra, results[i])

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed + 1)
            tasks, t = [], start
            for i, req in enumerate(requests):
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                tasks.append(asyncio.ensure_future(_one(session, url, model, req, extra, results[i])))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


# -- summary -------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "n": len(values)}


def summarize(requests: list[Request], results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = r.error[:160]
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(len(r.token_times) for r in results)
    prompt_tokens = sum(len(requests[r.index].prompt) for r in results if r.ok or r.disconnected)
    usage_wrong = [r.index for r in done if r.completion_tokens != len(r.token_times)
                   or r.prompt_tokens != len(requests[r.index].prompt)]
    itl = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "requests": len(results), "completed": len(done), "disconnected": sum(r.disconnected for r in results),
        "failed": sum(r.error is not None for r in results), "errors": errors,
        "usage_mismatches": usage_wrong[:20], "duration_s": duration,
        "request_throughput": len(done) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration, "output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e for r in done]),
        "finish_reasons": {k: sum(r.finish_reason == k for r in done) for k in sorted({r.finish_reason for r in done})},
    }


SERVER_GAUGES = ("wise_kv_pages_total", "wise_kv_pages_free", "wise_requests_running", "wise_requests_waiting",
                 "wise_process_resident_memory_bytes", 'wise_support_density{loop="2"}',
                 'wise_support_density{loop="3"}')
SERVER_COUNTERS = ("wise_preemptions_total", "wise_fallbacks_total", "wise_client_disconnects_total",
                   "wise_generation_tokens_total", "wise_prefix_cache_queries_total",
                   "wise_prefix_cache_hits_total")  # reported as the run's increase


def environment() -> dict:
    return dict(rp.environment(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                aiohttp=rp.version("aiohttp"))


def markdown(report: dict) -> str:
    s, c = report["summary"], report["config"]
    mode = f"rate {c['rate']} req/s" if c.get("rate") else f"concurrency {c.get('concurrency')}"
    lines = [f"# serve_load {report['label']}", "",
             f"{s['requests']} requests, {mode}, prompt {c['prompt_len']} (spread {c['prompt_spread']}), output "
             f"{c['output_len']} (spread {c['output_spread']}); {report['environment']['date']}", "",
             "| metric | value |", "|---|---|",
             f"| completed / disconnected / failed | {s['completed']} / {s['disconnected']} / {s['failed']} |",
             f"| duration | {s['duration_s']:.2f} s |",
             f"| request throughput | {s['request_throughput']:.2f} req/s |",
             f"| output token throughput | {s['output_token_throughput']:.1f} tok/s |",
             f"| total token throughput | {s['total_token_throughput']:.1f} tok/s |"]
    if s.get("ttft_ms") is not None or s.get("e2e_ms") is not None:
        lines += ["", "| ms | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
        for key, name in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                          ("itl_ms", "inter-token latency"), ("e2e_ms", "end to end")):
            p = s.get(key)
            if p is not None:
                lines.append(f"| {name} | {p['mean']:.1f} | {p['p50']:.1f} | {p['p90']:.1f} | {p['p99']:.1f} |")
    if s.get("engine"):
        lines += ["", "Engine: " + ", ".join(f"{k} {v}" for k, v in s["engine"].items())]
    if s["errors"]:
        lines += ["", "Errors:", *(f"- {n} x {e}" for e, n in s["errors"].items())]
    if report.get("server"):
        lines += ["", "Server /metrics after the run (counters: their increase during it): "
                  + ", ".join(f"{k} {v:g}" for k, v in report["server"].items())]
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path, title: str) -> None:
    plt = rp.pyplot()
    done = [r for r in results if r.ok]
    series = (("time to first token", [r.ttft for r in done if r.ttft is not None]),
              ("time per output token", [r.tpot for r in done if r.tpot is not None]),
              ("end to end", [r.e2e for r in done]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values) in zip(axes, series):
        ms = np.asarray(values) * 1e3
        if len(ms):
            ax.hist(ms, bins=40, color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (90, "--"), (99, ":")):
                ax.axvline(np.percentile(ms, q), color="k", linestyle=style, label=f"p{q} {np.percentile(ms, q):.1f}")
            ax.legend()
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
    fig.suptitle(title)
    fig.tight_layout()
    rp.save_png(fig, path)


def write(report: dict, results: list[Result] | None, out: Path) -> None:
    stem = f"serve_load-{report['label']}"
    plot_to = None if results is None else (lambda path: plot(results, path, f"serve_load {report['label']}"))
    rp.write_report(out, stem, report, markdown(report), plot_to)
    print(f"wrote {out / stem}.json/.md" + ("/.png" if results is not None else ""), file=sys.stderr)


def summary_table(directory) -> str:
    """Markdown: per arm, offline and server (at a concurrency) throughput and latencies, from
    the serve_load-ARM-{offline,conc,rate}.json files of benchmarks/serve/serve_h200.sh."""
    d = Path(directory)

    def load(label):
        p = d / f"serve_load-{label}.json"
        return json.loads(p.read_text())["summary"] if p.exists() else None

    def pct(s, k):
        return f"{s[k]['p50']:.0f} / {s[k]['p99']:.0f}" if s and s.get(k) else "-"

    lines = ["| arm | offline out tok/s | server out tok/s | server / offline | TTFT p50/p99 ms | "
             "TPOT p50/p99 ms | e2e p50/p99 ms | rate: req/s | rate: TTFT p50/p99 ms | "
             "rate: TPOT p50/p99 ms | failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ("dense", "wise", "spec"):
        off, conc, rate = load(f"{arm}-offline"), load(f"{arm}-conc"), load(f"{arm}-rate")
        if conc is None:
            continue
        cells = [arm, f"{off['output_token_throughput']:.0f}" if off else "-", f"{conc['output_token_throughput']:.0f}",
                 f"{conc['output_token_throughput'] / off['output_token_throughput']:.3f}" if off else "-",
                 pct(conc, "ttft_ms"), pct(conc, "tpot_ms"), pct(conc, "e2e_ms"),
                 f"{rate['request_throughput']:.2f}" if rate else "-", pct(rate, "ttft_ms"), pct(rate, "tpot_ms"),
                 str(conc["failed"] + (rate["failed"] if rate else 0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def wait_ready(url: str, timeout: float) -> None:
    """Poll GET /health until it answers 200 (SystemExit after `timeout` seconds)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


# -- offline baseline ----------------------------------------------------------------------------
def run_offline(args) -> dict:
    """The workload on an in-process engine (the `wise serve` engine flags, --backend among them):
    every request queued at once."""
    from wise_serve.model import build_llm, engine_context
    from wise_core.sampling_params import SamplingParams

    llm = build_llm(args)
    vocab = args.vocab_size or llm.vocab_size
    requests = workload(args, vocab, args.num_requests, args.workload_seed)
    warmup = workload(args, vocab, args.warmup_requests if args.warmup_requests is not None else args.concurrency,
                      args.workload_seed + 7)

    def run(reqs):
        with engine_context(args.backend)():
            start = time.perf_counter()
            for r in reqs:
                llm.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=args.temperature,
                                                         ignore_eos=args.ignore_eos))
            tokens = 0
            while llm.has_unfinished():
                tokens += len(llm.step())
            return tokens, time.perf_counter() - start

    if warmup:
        run(warmup)
    tokens, duration = run(requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    stats = llm.stats()
    return {"requests": len(requests), "completed": len(requests), "duration_s": duration, "output_tokens": tokens,
            "request_throughput": len(requests) / duration, "output_token_throughput": tokens / duration,
            "total_token_throughput": (tokens + prompt_tokens) / duration, "disconnected": 0, "failed": 0,
            "errors": {}, "engine": {"preemptions": stats.preemptions, "fallbacks": stats.fallbacks,
                                     "density": stats.density, "total_pages": stats.total_pages,
                                     "prefix_cache_queries": stats.prefix_cache_queries,
                                     "prefix_cache_hits": stats.prefix_cache_hits}}


def workload(args, vocab_size: int, n: int, seed: int, disconnect_fraction: float = 0.0) -> list[Request]:
    return make_workload(n, prompt_len=args.prompt_len, output_len=args.output_len, vocab_size=vocab_size,
                         prompt_spread=args.prompt_spread, output_spread=args.output_spread,
                         disconnect_fraction=disconnect_fraction, seed=seed)


# -- command line --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    from wise_serve.args import add_engine_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None, help="model field of the requests (default: none sent)")
    p.add_argument("--num-requests", type=int, default=200)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="requests per second (Poisson arrivals)")
    mode.add_argument("--concurrency", type=int, help="clients, each sending its next request when one ends")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prompt-spread", type=float, default=0.0, help="prompt lengths uniform in len * [1-s, 1+s]")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-spread", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=None, help="token ids drawn below this (default: the server's)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--disconnect-fraction", type=float, default=0.0)
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="untimed requests first (default: the concurrency, or 8 at a rate)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--out", type=Path, default=None, help="write serve_load-LABEL.json/.md/.png here")
    p.add_argument("--label", default="run")
    p.add_argument("--offline", action="store_true",
                   help="run the workload on an in-process engine instead (engine flags below)")
    add_engine_arguments(p.add_argument_group("engine (with --offline; --seed also seeds the workload)"))
    args = p.parse_args(argv)
    args.workload_seed = 0 if args.seed is None else args.seed
    if args.offline and args.rate is not None:
        p.error("--offline queues every request at once: use --concurrency (the engine's --max-num-seqs)")
    return args


async def main_async(args) -> tuple[dict, list[Result]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        card = (await fetch_json(session, f"{args.url}/v1/models"))["data"][0]
    vocab = args.vocab_size or card["vocab_size"]
    requests = workload(args, vocab, args.num_requests, args.workload_seed, args.disconnect_fraction)
    extra = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    kw = dict(rate=args.rate, concurrency=args.concurrency, model=args.served_model_name, body_extra=extra,
              seed=args.workload_seed, timeout=args.timeout)
    n_warm = args.warmup_requests if args.warmup_requests is not None else (args.concurrency or 8)
    if n_warm:
        await run_requests(args.url, workload(args, vocab, n_warm, args.workload_seed + 7), **kw)
    async with aiohttp.ClientSession() as session:
        before = await scrape_metrics(session, args.url)
    results, duration = await run_requests(args.url, requests, **kw)
    async with aiohttp.ClientSession() as session:
        after = await scrape_metrics(session, args.url)
    server = {k: after[k] for k in SERVER_GAUGES if k in after}
    server.update({k: after[k] - before.get(k, 0) for k in SERVER_COUNTERS if k in after})
    report = {"label": args.label, "config": _config(args), "environment": environment(), "model": card,
              "summary": summarize(requests, results, duration), "server": server,
              "requests": [_record(r) for r in results]}
    return report, results


def _record(r: Result) -> dict:
    return {"index": r.index, "ok": r.ok, "status": r.status, "error": r.error, "disconnected": r.disconnected,
            "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "tokens_seen": len(r.token_times), "ttft_s": r.ttft,
            "tpot_s": r.tpot, "e2e_s": r.e2e}


def _config(args) -> dict:
    """The run's arguments; the engine's only with --offline (a server runs its own engine, whose
    model the report's "model" names): a client's engine defaults would misdescribe the run."""
    from wise_serve.args import add_engine_arguments
    engine = set()
    if not args.offline:
        parser = argparse.ArgumentParser(add_help=False)
        add_engine_arguments(parser)
        engine = {action.dest for action in parser._actions}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in engine}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.offline:
        report = {"label": args.label, "config": _config(args), "environment": environment(),
                  "summary": run_offline(args)}
        results = None
    else:
        report, results = asyncio.run(main_async(args))
    s = report["summary"]
    print(f"{args.label}: {s['completed']}/{s['requests']} completed, {s['disconnected']} disconnected, "
          f"{s['failed']} failed in {s['duration_s']:.2f} s: {s['request_throughput']:.2f} req/s, "
          f"{s['output_token_throughput']:.1f} output tok/s, {s['total_token_throughput']:.1f} total tok/s")
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = s.get(key)
        if p:
            print(f"  {key}: mean {p['mean']:.1f} p50 {p['p50']:.1f} p90 {p['p90']:.1f} p99 {p['p99']:.1f}")
    if s["errors"]:
        print("  errors: " + "; ".join(f"{n} x {e}" for e, n in s["errors"].items()))
    if args.out is not None:
        write(report, results, args.out)
    return report


if __name__ == "__main__":
    main()
