"""A CUDA-graph capture that fails cannot take wise_torch.LLM down: the step it was for runs
eagerly, then and from then on, with the very tokens (and WISE / early-exit counters) of an
eager engine; the failure is in `stats().failed_step_programs` and logged once per step.

CPU: the engine runs with `runner.use_graphs` set, over fake CUDA streams and a fake CUDA graph
whose capture fails as an invalidated capture does (`capture_end` raises; the capture is then
over) -- the runner's real warm-up / capture / fallback code runs, the step's kernels run on
the CPU. The failure comes in the warm-up, inside the capture (a launch raising, as
`add_rms_norm`'s did on the H100 in issue 46) or only at the capture's end. The same on a GPU,
with a real capture failure: tests/wise_torch/test_torch_gpu.py::test_failed_capture_runs_eagerly."""

import contextlib
import dataclasses
import logging

import pytest
import torch

import wise_torch as wt
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch.engine import graphs as engine_graphs
from cases import prompts_of

LENGTHS, BUDGETS = [20, 70, 130], [14, 6, 3]   # rows over three context buckets, batches of 3, 2 and 1
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class FakeCuda:
    """Fake CUDA streams and graphs for the runner's capture path on a CPU. `phase` is where the
    step's code runs now ("eager", "warm-up" on the side stream, "capture"); every capture
    fails at its end; `captures` holds each capture's (pool, error mode), `unrouted` each
    pool whose allocation routing was undone."""

    def __init__(self):
        self.phase, self.captures, self.unrouted, self.pools = "eager", [], [], 0

    def stream(self, _stream):
        @contextlib.contextmanager
        def on_side_stream():
            outer, self.phase = self.phase, "warm-up" if self.phase == "eager" else self.phase
            try:
                yield
            finally:
                self.phase = outer
        return on_side_stream()

    def graph_pool_handle(self):
        self.pools += 1
        return (0, self.pools)

    def graph_class(self):
        fake = self

        class FailingGraph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                fake.captures.append((pool, capture_error_mode))
                fake.phase = "capture"

            def capture_end(self):
                fake.phase = "warm-up"
                raise RuntimeError(INVALIDATED)

            def replay(self):
                raise AssertionError("a graph whose capture failed is replayed")

        return FailingGraph

    def graph_context(self):
        """torch.cuda.graph over the fake graph (what the runner before issue 46 captured with)."""
        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            yield
            cuda_graph.capture_end()
        return graph


class FakeStream:
    def wait_stream(self, _other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name, value in dict(Stream=lambda *a: FakeStream(), current_stream=lambda *a: FakeStream(),
                            stream=fake.stream, synchronize=lambda *a: None, empty_cache=lambda: None,
                            graph_pool_handle=fake.graph_pool_handle, CUDAGraph=fake.graph_class(),
                            graph=fake.graph_context(), current_device=lambda: 0).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: fake.unrouted.append(pool))
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: None)
    return fake


def tiny_model(**changes):
    config = dataclasses.replace(PRESETS["test-tiny-gqa"], **changes)
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def fail_steps_in(model, fake: FakeCuda, phase: str, monkeypatch) -> None:
    """The model's decode steps raise (as a launch into an invalidated capture does) in `phase`."""
    decode_step = model.decode_step

    def step(*args, **kwargs):
        if fake.phase == phase:
            raise RuntimeError(f"{INVALIDATED} (simulated, in the {phase})")
        return decode_step(*args, **kwargs)
    monkeypatch.setattr(model, "decode_step", step)


def run(model, *, graphs: bool, wise_config=None, speculative_config=None):
    """The requests' tokens and kept logits, and the engine, eager or with (fake) CUDA graphs."""
    llm = wt.LLM(model, wise_config=wise_config, speculative_config=speculative_config, num_pages=64,
                 page_size=32, max_num_seqs=4, max_model_len=512, attention_backend="reference", cuda_graphs=False)
    llm.runner.use_graphs = graphs   # as on a CUDA device
    prompts = prompts_of(LENGTHS, model.config.vocab_size)
    keep = speculative_config is None   # speculation keeps no logits
    ids = [llm.add_request(p, wt.SamplingParams(max_tokens=n, ignore_eos=True), keep_logits=keep)
           for p, n in zip(prompts, BUDGETS)]
    seqs = [llm.sequences[i] for i in ids]
    with torch.inference_mode():
        outs = llm.run_until_done(ids)
    return [o.token_ids for o in outs], [torch.stack(s.logits) if keep else None for s in seqs], llm


def check_failed_captures(llm, fake: FakeCuda, caplog, *, began: bool) -> tuple:
    """Every step that tried a graph failed once, was noted, logged once and never tried again ->
    the failed steps."""
    failed = llm.stats().failed_step_programs
    assert failed and len(set(failed)) == len(failed)
    assert set(failed) == set(llm.runner.step_graphs.eager_steps) and not llm.runner.graphs
    warnings = [r for r in caplog.records if r.name == engine_graphs.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == len(failed)
    assert all("runs eagerly" in r.getMessage() and INVALIDATED in r.getMessage() for r in warnings)
    if began:   # each capture ended, its pool's routing undone; thread_local error mode
        assert len(fake.captures) == len(fake.unrouted) == len(failed)
        assert all(mode == "thread_local" for _, mode in fake.captures)
        assert [pool for pool, _ in fake.captures] == fake.unrouted
    else:
        assert fake.captures == []
    return failed


@pytest.mark.parametrize("phase", ["warm-up", "capture", "end"])
@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_failed_decode_capture_runs_the_step_eagerly(model, fake_cuda, caplog, monkeypatch, phase, wise_config):
    want_tokens, want_logits, eager = run(model, graphs=False, wise_config=wise_config)
    fail_steps_in(model, fake_cuda, phase, monkeypatch)
    with caplog.at_level(logging.WARNING, logger=engine_graphs.__name__):
        tokens, logits, llm = run(model, graphs=True, wise_config=wise_config)
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))   # the same padded step: bitwise
    failed = check_failed_captures(llm, fake_cuda, caplog, began=phase != "warm-up")
    assert {len(f) for f in failed} == {2} and {b for b, _ in failed} == {1, 2, 4}   # (batch bucket, width)
    stats, want = llm.stats(), eager.stats()
    assert stats.step_programs == 0 and stats.decode_tokens == want.decode_tokens
    assert (stats.fallbacks, stats.density) == (want.fallbacks, want.density)   # counters restored


def test_failed_capture_keeps_the_early_exit_counts(fake_cuda, caplog):
    model = tiny_model(early_exit_threshold=0.6)
    want_tokens, _, eager = run(model, graphs=False)
    tokens, _, llm = run(model, graphs=True)
    assert tokens == want_tokens
    check_failed_captures(llm, fake_cuda, caplog, began=True)
    assert llm.stats().mean_decode_depth == eager.stats().mean_decode_depth is not None


@pytest.mark.parametrize("method", ["loops", "wise"])
def test_failed_speculation_capture_runs_the_round_eagerly(model, fake_cuda, caplog, method):
    spec = SpeculativeConfig(method, num_draft=3, **({"draft_loops": 2} if method == "loops" else {}))
    wise = WiseConfig(eta=0.5) if method == "wise" else None
    want_tokens, _, eager = run(model, graphs=False, wise_config=wise, speculative_config=spec)
    tokens, _, llm = run(model, graphs=True, wise_config=wise, speculative_config=spec)
    assert tokens == want_tokens
    failed = check_failed_captures(llm, fake_cuda, caplog, began=True)
    assert {f[0] for f in failed if isinstance(f[0], str)} == {"draft", "verify"}
    stats, want = llm.stats(), eager.stats()
    assert (stats.spec_rounds, stats.draft_tokens, stats.accepted_tokens, stats.density) == (
        want.spec_rounds, want.draft_tokens, want.accepted_tokens, want.density)
