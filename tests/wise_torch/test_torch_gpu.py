"""wise_torch on a CUDA GPU (an H200): the paged decode path, the Triton kernel inside generate,
bf16, and an Ouro-1.4B-wide model. Skipped without CUDA."""

import dataclasses

import pytest
import torch

import wise_torch as wt
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from cases import prompts_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_model(name, dtype=torch.float32, std=0.08, **changes):
    config = dataclasses.replace(PRESETS[name], **changes)
    return wt.from_tensors(config, random_tensors(config, seed=0, std=std), dtype=dtype, device="cuda")


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_paged_decode_matches_forward(kernel):
    model = gpu_model("test-tiny-gqa")
    prompt = prompts_of([150], model.config.vocab_size)[0]
    llm = wt.LLM(model, num_pages=4, page_size=64, max_num_seqs=1, max_model_len=192, attention_backend=kernel)
    llm.blocks.free.reverse()
    rid = llm.add_request(prompt[:1], wt.SamplingParams(max_tokens=150), forced=prompt[1:] + [0], keep_logits=True)
    seq = llm.sequences[rid]
    with torch.inference_mode():
        llm.run_until_done([rid])
        full = model(torch.tensor(prompt, device="cuda")[None])[0]
    assert llm.runner.use_graphs and llm.runner.graphs
    diff, bound = rounding.model_difference(torch.stack(seq.logits), full.cpu(), model.config, keys=150)
    assert diff <= bound, (diff, bound)  # fp32; SDPA vs paged decode


def test_generate_triton_against_reference_fp32():
    model = gpu_model("test-tiny")
    prompts = prompts_of([300, 40, 129], model.config.vocab_size, seed=1)

    def run(kernel="auto", **wise):
        return wt.generate(model, prompts, max_new_tokens=16, eos_token_id=None, return_logits=True,
                           attention_backend=kernel, wise_config=WiseConfig(**wise) if wise else None)

    dense, dense_tri, dense_ref = run(), run("triton"), run("reference")
    assert all(torch.equal(a, b) for a, b in zip(dense.logits, dense_tri.logits))  # "auto" is Triton on CUDA
    discover_only = run("triton", reuse_depths=())
    assert all(torch.equal(a, b) for a, b in zip(discover_only.logits, dense_tri.logits))
    assert dense_tri.tokens == dense_ref.tokens
    for a, b in zip(dense_tri.logits, dense_ref.logits):
        diff, bound = rounding.model_difference(a, b, model.config, keys=316)  # fp32, another summation order
        assert diff <= bound, (diff, bound)
    all_blocks = run("triton", all_blocks=True)
    assert all(torch.equal(a, b) for a, b in zip(all_blocks.logits, dense_tri.logits))
    wise, wise_ref = run("triton", eta=0.9), run("reference", eta=0.9)
    assert wise.stats.fallbacks == wise_ref.stats.fallbacks == 0
    for d in (2, 3):
        assert abs(wise.stats.density[d] - wise_ref.stats.density[d]) < 0.01
        assert wise.stats.density[d] < 1.0


def test_cpu_and_gpu_generate_agree():
    cpu = wt.load_model("random-tiny")
    gpu = wt.load_model("random-tiny", device="cuda")
    cpu_out = wt.generate(cpu, ["def fib(n):", "hello"], max_new_tokens=12, eos_token_id=None, return_logits=True)
    gpu_out = wt.generate(gpu, ["def fib(n):", "hello"], max_new_tokens=12, eos_token_id=None, return_logits=True)
    assert cpu_out.tokens == gpu_out.tokens
    for a, b in zip(cpu_out.logits, gpu_out.logits):
        diff, bound = rounding.model_difference(b, a, cpu.config, keys=24)  # fp32, two devices
        assert diff <= bound, (diff, bound)


def test_bf16_wise_generation_and_scoring():
    model = gpu_model("test-tiny-gqa", dtype=torch.bfloat16)
    prompts = prompts_of([500, 64], model.config.vocab_size, seed=2)
    out = wt.generate(model, prompts, max_new_tokens=20, eos_token_id=None,
                      wise_config=WiseConfig(), attention_backend="triton")
    assert [len(t) for t in out.tokens] == [20, 20] and out.stats.fallbacks == 0
    context, continuation = prompts[0][:400], prompts[0][400:]
    dense = wt.teacher_force(model, context, continuation)
    all_blocks = wt.teacher_force(model, context, continuation, wise_config=WiseConfig(all_blocks=True))
    assert torch.equal(all_blocks.logprobs[0], dense.logprobs[0])
    wise = wt.teacher_force(model, context, continuation, wise_config=WiseConfig())
    assert (wise.logprobs[0] - dense.logprobs[0]).abs().mean() < 0.1


def test_ouro_width_model_bf16():
    model = gpu_model("ouro-1.4b", dtype=torch.bfloat16, std=0.02, num_hidden_layers=2)
    prompts = prompts_of([1000, 700, 1500, 64], model.config.vocab_size, seed=3)
    args = dict(max_new_tokens=8, eos_token_id=None, return_logits=True)
    dense = wt.generate(model, prompts, **args)
    all_blocks = wt.generate(model, prompts, wise_config=WiseConfig(all_blocks=True), **args)
    assert all(torch.equal(a, b) for a, b in zip(all_blocks.logits, dense.logits))
    wise = wt.generate(model, prompts, wise_config=WiseConfig(), **args)
    assert wise.stats.fallbacks == 0
    assert all(torch.isfinite(x).all() for x in wise.logits)


def engine_outputs(model, prompts, wise_config, n, page_size=128, **kw):
    llm = wt.LLM(model, wise_config=wise_config, page_size=page_size, max_num_seqs=len(prompts),
                 max_model_len=max(map(len, prompts)) + n, **kw)
    ids = [llm.add_request(p, wt.SamplingParams(max_tokens=n, ignore_eos=True), keep_logits=True) for p in prompts]
    seqs = [llm.sequences[i] for i in ids]
    with torch.inference_mode():
        outs = llm.run_until_done(ids)
    return [o.token_ids for o in outs], [torch.stack(s.logits) for s in seqs], llm


@pytest.mark.parametrize("wise", [False, True], ids=["dense", "wise"])
def test_cuda_graphs_give_the_eager_tokens_bf16(wise):
    model = wt.load_model("ouro-py-3m", dtype=torch.bfloat16, device="cuda")
    prompts = [model.tokenizer.encode(t).ids for t in ("def fib(n):", "import os\n" * 40, "class A:\n    def")]
    wise_config = WiseConfig() if wise else None
    graphed = engine_outputs(model, prompts, wise_config, 48, cuda_graphs=True)
    eager = engine_outputs(model, prompts, wise_config, 48, cuda_graphs=False)
    assert graphed[2].runner.graphs and not eager[2].runner.graphs
    assert graphed[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(graphed[1], eager[1]))  # the same padded step: bitwise


def test_wise_triton_tokens_equal_reference_tokens_builtin_fp32():
    model = wt.load_model("ouro-py-3m", dtype=torch.float32, device="cuda")
    prompts = [model.tokenizer.encode(t).ids for t in ("def fib(n):", "import os\nimport sys\n" * 30,
                                                      "class Stack:\n    def push(self, x):")]
    wise_config = WiseConfig(eta=0.95)
    triton = engine_outputs(model, prompts, wise_config, 64, attention_backend="triton")
    reference = engine_outputs(model, prompts, wise_config, 64, attention_backend="reference")
    assert triton[0] == reference[0]
    for a, b in zip(triton[1], reference[1]):
        diff, bound = rounding.model_difference(a, b, model.config, keys=2048)  # fp32, another summation order
        assert diff <= bound, (diff, bound)
    assert triton[2].stats().density[2] < 1.0


def test_all_blocks_under_graphs_is_bitwise_dense():
    model = gpu_model("ouro-1.4b", dtype=torch.bfloat16, std=0.02, num_hidden_layers=2)
    prompts = prompts_of([1000, 700, 1500, 64], model.config.vocab_size, seed=3)
    dense = engine_outputs(model, prompts, None, 16, num_pages=64)
    all_blocks = engine_outputs(model, prompts, WiseConfig(all_blocks=True), 16, num_pages=64)
    assert dense[2].runner.graphs and dense[0] == all_blocks[0]
    assert all(torch.equal(a, b) for a, b in zip(dense[1], all_blocks[1]))
    wise = engine_outputs(model, prompts, WiseConfig(), 16, num_pages=64)
    assert wise[2].stats().fallbacks == 0 and wise[2].stats().density[2] < 1.0


def test_preemption_under_graphs_keeps_the_tokens_fp32():
    # The trained built-in model (peaked logits) in fp32: batches of other sizes (another bucket, other
    # splits) change results only at rounding level, far from its greedy choices.
    model = wt.load_model("ouro-py-3m", dtype=torch.float32, device="cuda")
    prompts = [model.tokenizer.encode(t).ids[:n] for t, n in (("import os\n" * 40, 94), ("def f(x):\n" * 40, 60),
                                                             ("class A:\n" * 40, 126), ("# x\n" * 40, 30))]
    # Prompts just short of page boundaries: all four fit 12 pages of 32 after prefill, their growth does not.
    free = engine_outputs(model, prompts, WiseConfig(), 24, page_size=32, num_pages=64)
    tight = engine_outputs(model, prompts, WiseConfig(), 24, page_size=32, num_pages=12)
    assert tight[2].stats().preemptions > 0 and tight[2].stats().free_pages == 12
    assert tight[0] == free[0]


def staggered_outputs(model, prompts, budgets, **kw):
    """engine_outputs with a budget per request: the rows finish apart, so the steps run at
    several (batch bucket, context bucket)s, each its own CUDA graph."""
    llm = wt.LLM(model, wise_config=WiseConfig(), page_size=128, max_num_seqs=len(prompts),
                 max_model_len=max(map(len, prompts)) + max(budgets), **kw)
    ids = [llm.add_request(p, wt.SamplingParams(max_tokens=n, ignore_eos=True), keep_logits=True)
           for p, n in zip(prompts, budgets)]
    seqs = [llm.sequences[i] for i in ids]
    with torch.inference_mode():
        outs = llm.run_until_done(ids)
    return [o.token_ids for o in outs], [torch.stack(s.logits) for s in seqs], llm


@pytest.mark.parametrize("fault", ["sync", "raise"])
def test_failed_capture_runs_eagerly(fault, monkeypatch, caplog):
    """The first decode step's CUDA-graph capture fails for real -- "sync": a device-to-host read
    inside the capture (illegal: CUDA invalidates the capture, and its end raises), "raise": an
    exception from inside the capture (its end succeeds: a partial graph) -- and the engine goes
    on: that step, (3 rows, 4 pages), runs eagerly, the later ones, (2, 1) and (1, 1), capture
    and replay their graphs in the same CUDA context, and the tokens, logits and WISE counters
    are an eager engine's (the CPU simulation of the same:
    tests/wise_torch/test_torch_capture_failure.py)."""
    model = wt.load_model("ouro-py-3m", dtype=torch.bfloat16, device="cuda")
    prompts = [model.tokenizer.encode(t).ids for t in ("def fib(n):", "import os\n" * 40, "class A:\n    def")]
    budgets = [48, 16, 32]
    eager = staggered_outputs(model, prompts, budgets, cuda_graphs=False)
    decode_step, faults = model.decode_step, []

    def first_capture_fails(tokens, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing() and not faults:
            faults.append(fault)
            if fault == "sync":
                tokens.sum().item()   # raises: not permitted while the stream captures
            raise RuntimeError("a launch failed under capture (forced by the test)")
        return decode_step(tokens, *args, **kwargs)
    monkeypatch.setattr(model, "decode_step", first_capture_fails)
    with caplog.at_level("WARNING", logger="wise_torch.engine.graphs"):
        tokens, logits, llm = staggered_outputs(model, prompts, budgets, cuda_graphs=True)
    stats = llm.stats()
    assert faults == [fault] and stats.failed_step_programs == ((3, 4),)
    assert sorted(llm.runner.graphs) == [(1, 1), (2, 1)] and stats.step_programs == 2
    assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1
    assert tokens == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(logits, eager[1]))   # eager and graph steps: bitwise
    assert (stats.fallbacks, stats.density) == (eager[2].stats().fallbacks, eager[2].stats().density)
    torch.cuda.synchronize()   # the context is still usable
