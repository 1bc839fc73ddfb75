"""Prometheus text exposition (format 0.0.4) of the engine's stats and the server's own counters.

Engine-side values come from `Engine.stats()` read in the engine thread at scrape time (the
automatic prefix cache among them: `wise_prefix_cache_queries_total`, the prompt tokens looked
up, `wise_prefix_cache_hits_total`, those found cached, and their ratio
`wise_prefix_cache_hit_rate`, as vLLM's `vllm:prefix_cache_queries` / `_hits`); request
latencies (time to first token, time per output token, end to end) are observed by the server
as it hands tokens to clients. Every name starts with `wise_`.
"""

from __future__ import annotations

import bisect
import collections
import os

from wise_core.stats import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)       # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*map(_num, self.buckets), "+Inf"), self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        lines += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def resident_memory_bytes() -> int | None:
    """This process's resident set size (Linux /proc), None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ServerMetrics:
    """The server's counters and latency histograms (event-loop thread only)."""

    def __init__(self):
        self.ttft = Histogram("wise_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.", TTFT_BUCKETS)
        self.tpot = Histogram("wise_time_per_output_token_seconds",
                              "Seconds between consecutive output tokens of a request.", TPOT_BUCKETS)
        self.e2e = Histogram("wise_e2e_request_latency_seconds",
                             "Seconds from a request's arrival to its last token.", E2E_BUCKETS)
        self.finished: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[int] = collections.Counter()
        self.disconnects = 0

    def render(self, stats: EngineStats | None, *, healthy: bool, draining: bool) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"{name}{label} {_num(value)}")

        metric("wise_engine_healthy", "gauge", "1 while the engine serves, 0 once a step failed.",
               [({}, int(healthy))])
        metric("wise_server_draining", "gauge", "1 after SIGTERM, while in-flight requests finish.",
               [({}, int(draining))])
        if stats is not None:
            s = stats
            for name, kind, help_, value in (
                    ("wise_requests_running", "gauge", "Requests holding pages (prefilling or decoding).", s.running),
                    ("wise_requests_waiting", "gauge", "Requests queued or preempted.", s.waiting),
                    ("wise_kv_pages_total", "gauge", "KV pages in the pool.", s.total_pages),
                    ("wise_kv_pages_free", "gauge", "KV pages free.", s.free_pages),
                    ("wise_preemptions_total", "counter", "Requests preempted (K/V offloaded to host).", s.preemptions),
                    ("wise_prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.prompt_tokens),
                    ("wise_generation_tokens_total", "counter", "Tokens generated.", s.generated_tokens),
                    ("wise_decode_steps_total", "counter", "Decode steps run.", s.decode_steps),
                    ("wise_decode_tokens_per_second", "gauge",
                     "Decode tokens per second of decode time since the engine started.", s.decode_tokens_per_s),
                    ("wise_prefill_tokens_per_second", "gauge",
                     "Prompt tokens per second of prefill time since the engine started.", s.prefill_tokens_per_s),
                    ("wise_step_programs", "gauge",
                     "Decode-step programs made so far (torch: CUDA graphs, 0 when eager; jax: compiled steps).",
                     s.step_programs),
                    ("wise_prefix_cache_queries_total", "counter",
                     "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
                    ("wise_prefix_cache_hits_total", "counter",
                     "Prompt tokens found in the prefix cache (their prefill skipped).", s.prefix_cache_hits)):
                metric(name, kind, help_, [({}, value)])
            rate = s.prefix_cache_hit_rate            # None before any lookup: no sample
            metric("wise_prefix_cache_hit_rate", "gauge",
                   "Prefix cache hits / queries (prompt tokens) since the engine started.",
                   [] if rate is None else [({}, rate)])
            if s.fallbacks is not None:
                metric("wise_fallbacks_total", "counter",
                       "WISE (token, layer) pairs that attended densely at a reuse loop for want of a complete "
                       "support.", [({}, s.fallbacks)])
                metric("wise_support_density", "gauge",
                       "WISE: selected / causal key blocks at each reuse loop since the engine started.",
                       [({"loop": d}, x) for d, x in sorted((s.density or {}).items()) if x is not None])
            if s.spec_rounds is not None:
                metric("wise_spec_rounds_total", "counter", "Speculative (sequence, round) pairs.",
                       [({}, s.spec_rounds)])
                metric("wise_spec_draft_tokens_total", "counter", "Speculative tokens drafted.",
                       [({}, s.draft_tokens)])
                metric("wise_spec_accepted_tokens_total", "counter", "Speculative drafts the dense model accepted.",
                       [({}, s.accepted_tokens)])
        metric("wise_requests_finished_total", "counter", "Requests finished, by finish reason.",
               [({"finish_reason": r}, n) for r, n in sorted(self.finished.items())])
        metric("wise_requests_rejected_total", "counter", "Requests refused, by HTTP status.",
               [({"status": c}, n) for c, n in sorted(self.rejected.items())])
        metric("wise_client_disconnects_total", "counter", "Requests aborted because the client went away.",
               [({}, self.disconnects)])
        for histogram in (self.ttft, self.tpot, self.e2e):
            out.extend(histogram.render())
        rss = resident_memory_bytes()
        if rss is not None:
            metric("wise_process_resident_memory_bytes", "gauge", "Resident memory of the server process.",
                   [({}, rss)])
        return "\n".join(out) + "\n"
