"""wise_torch.LLM decodes at a context bucket (the page-table width of the batch's longest row,
`wise_core.buckets`), not at max_model_len: the tokens are exactly those of the
unbucketed engine (every step at max_model_len's width), dense, WISE and speculative, fp32,
with the reference and the interpreted Triton kernels."""

import os

import pytest
import torch

import wise_torch as wt
from wise_core.buckets import context_buckets
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from cases import prompts_of

# Prompt lengths and budgets: the first row grows across a page (1 -> 2 pages of 32, the first
# rung to the second), the others sit at 3 and 5 pages (rungs 4 and 8), so one batch spans
# three rungs. max_model_len 512: the unbucketed engine runs every step at 16 pages.
LENGTHS, BUDGETS = [20, 70, 130], [14, 4, 2]


@pytest.fixture(scope="module")
def model():
    config = PRESETS["test-tiny-gqa"]
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


def run(model, *, bucketed: bool, attention_backend: str, wise_config=None, speculative_config=None):
    """Every request's tokens, and the (batch bucket, width) of every decode step."""
    llm = wt.LLM(model, wise_config=wise_config, num_pages=64, page_size=32, max_num_seqs=4, max_model_len=512,
                 attention_backend=attention_backend, speculative_config=speculative_config)
    runner = llm.runner
    if not bucketed:
        runner.widths = [runner.max_pages]
    steps, stage = [], runner._stage

    def staging(seqs, bucket, width):   # note each step's (bucket, width) and its longest row's pages
        steps.append((bucket, width, max(len(seq.pages) for seq in seqs)))
        return stage(seqs, bucket, width)
    runner._stage = staging
    prompts = prompts_of(LENGTHS, model.config.vocab_size)
    params = [wt.SamplingParams(max_tokens=n, ignore_eos=True) for n in BUDGETS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], steps, llm


def test_context_buckets_ladder():
    assert context_buckets(1) == [1]
    assert context_buckets(8) == [1, 2, 4, 8]
    assert context_buckets(9) == [1, 2, 4, 8, 9]
    assert context_buckets(512) == [1 << i for i in range(10)]


KERNELS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_bucketed_decode_gives_the_unbucketed_tokens(model, kernel, wise_config):
    tokens, steps, llm = run(model, bucketed=True, attention_backend=kernel, wise_config=wise_config)
    want, wide, _ = run(model, bucketed=False, attention_backend=kernel, wise_config=wise_config)
    assert tokens == want
    assert {w for _, w, _ in wide} == {16}
    # Each step runs at the smallest rung holding its longest row; here at 1, 2, 4 and 8 pages.
    assert all(w == min(r for r in (1, 2, 4, 8, 16) if r >= pages) for _, w, pages in steps)
    assert {w for _, w, _ in steps} == {1, 2, 4, 8}
    stats = llm.stats()
    assert stats.step_program_bound == len(llm.runner.buckets) * len(llm.runner.widths) == 3 * 5
    assert stats.step_programs == 0 and stats.step_memory_bytes == 0   # eager on a CPU: no graphs
    if wise_config is not None:
        assert stats.fallbacks == 0 and 0 < stats.density[2] < 1


def test_a_row_crossing_a_rung_keeps_its_tokens(model):
    """One request alone, from 1 page to 2 (width 1 -> 2), against the unbucketed engine."""
    wise = WiseConfig(eta=0.5)
    prompt = prompts_of([25], model.config.vocab_size, seed=4)
    outs = {}
    for bucketed in (True, False):
        llm = wt.LLM(model, wise_config=wise, num_pages=16, page_size=32, max_num_seqs=2, max_model_len=1024,
                     attention_backend="reference")
        if not bucketed:
            llm.runner.widths = [llm.runner.max_pages]
        widths, forward = [], llm.runner._forward
        llm.runner._forward = lambda bucket, width, forward=forward: widths.append(width) or forward(bucket, width)
        outs[bucketed] = llm.generate(prompt, wt.SamplingParams(max_tokens=20, ignore_eos=True),
                                      use_tqdm=False)[0].token_ids
        if bucketed:
            assert widths[0] == 1 and widths[-1] == 2 and widths == sorted(widths)
    assert outs[True] == outs[False]


def test_speculative_rounds_bucketed_give_the_unbucketed_tokens(model):
    spec = SpeculativeConfig("wise", num_draft=3)
    tokens, _, llm = run(model, bucketed=True, attention_backend="reference", wise_config=WiseConfig(eta=0.5),
                         speculative_config=spec)
    want, _, _ = run(model, bucketed=False, attention_backend="reference", wise_config=WiseConfig(eta=0.5),
                     speculative_config=spec)
    assert tokens == want
    assert llm.stats().spec_rounds > 0
