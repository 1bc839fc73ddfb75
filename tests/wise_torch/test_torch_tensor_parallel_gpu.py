"""wise_torch.LLM(tensor_parallel_size=2) on two CUDA GPUs (NCCL; run with NCCL_NVLS_ENABLE=0),
against the same engine on one GPU: the built-in model in bf16 and fp32, dense and WISE (Triton
kernel), CUDA graphs on every rank. Skipped without two GPUs.

Comparisons use parity.checks.compare_runs: logits within `rounding.model_bound` of the model's
depth, width and dtype, and the same greedy tokens except where the runs part on a near tie
(top-2 gap within twice the bound). The all-reduce adds the ranks' partial sums, each rounded to
the dtype: one more rounding per sublayer than one GPU."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import wise_torch as wt
from parity.checks import compare_runs
from parity.suite import Generated
from wise_core.wise_config import WiseConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

MODES = {"dense": None, "wise": WiseConfig()}


def stdlib_prompts(tokenizer, count, length):
    """`count` prompts of `length` tokens: the starts of the stdlib's larger .py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ids = [tokenizer.encode(p.read_text(errors="replace")).ids[:length] for p in sorted(root.glob("*.py"))]
    return [x for x in ids if len(x) == length][:count]


def outputs(dtype, wise_config, prompts, n, tp, **kw):
    """(Generated of greedy tokens and logits, the engine's stats) of `prompts` on `tp` GPUs."""
    kw = dict(page_size=128, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + n, **kw)
    with wt.LLM("ouro-py-3m", dtype=dtype, device="cuda:0", wise_config=wise_config, tensor_parallel_size=tp,
                **kw) as llm:
        ids = [llm.add_request(p, wt.SamplingParams(max_tokens=n, ignore_eos=True), keep_logits=True)
               for p in prompts]
        seqs = [llm.sequences[i] for i in ids]
        with torch.inference_mode():
            outs = llm.run_until_done(ids)
        assert llm.runner.use_graphs == kw.get("cuda_graphs", True) and bool(llm.runner.graphs) == llm.runner.use_graphs
        return (Generated([o.token_ids for o in outs], [torch.stack(s.logits).numpy() for s in seqs]),
                llm.stats(), llm.model.config)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bf16_two_gpus_equal_one_up_to_near_ties(mode):
    tokenizer = wt.load_model("ouro-py-3m").tokenizer
    prompts = stdlib_prompts(tokenizer, 32, 256)
    assert len(prompts) == 32
    one, one_stats, config = outputs(torch.bfloat16, MODES[mode], prompts, 64, 1)
    two, two_stats, _ = outputs(torch.bfloat16, MODES[mode], prompts, 64, 2)
    result = compare_runs(config, one, two, "bfloat16", False)
    print(f"\n{mode} bf16 ouro-py-3m, 32 prompts x 64 tokens, 1 vs 2 GPUs: {result.detail} "
          f"(max |logit diff| {result.measured:.3g}, bound {result.bound:.3g})")
    assert result.passed, result.detail
    if mode == "wise":
        assert one_stats.fallbacks == two_stats.fallbacks == 0
        assert abs(one_stats.density[2] - two_stats.density[2]) < 0.02 and two_stats.density[2] < 1


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fp32_two_gpus_give_the_tokens_of_one_through_preemption(mode):
    """A pool too small for every request: the ranks offload and restore their heads' K/V."""
    tokenizer = wt.load_model("ouro-py-3m").tokenizer
    prompts = stdlib_prompts(tokenizer, 8, 300)
    one, one_stats, config = outputs(torch.float32, MODES[mode], prompts, 48, 1, num_pages=12)
    two, two_stats, _ = outputs(torch.float32, MODES[mode], prompts, 48, 2, num_pages=12)
    assert one_stats.preemptions > 0 and two_stats.preemptions == one_stats.preemptions
    assert one.tokens == two.tokens
    result = compare_runs(config, one, two, "float32", False)
    assert result.passed, result.detail


def test_graphs_replay_the_eager_tp_step_bitwise():
    """Two ranks' sum is one addition per element, whatever NCCL's algorithm: graphs and eager
    steps give the same bits."""
    tokenizer = wt.load_model("ouro-py-3m").tokenizer
    prompts = stdlib_prompts(tokenizer, 4, 200)
    graphed, _, _ = outputs(torch.bfloat16, MODES["wise"], prompts, 32, 2)
    eager, _, _ = outputs(torch.bfloat16, MODES["wise"], prompts, 32, 2, cuda_graphs=False)
    assert graphed.tokens == eager.tokens
    assert all(np.array_equal(a, b) for a, b in zip(graphed.logits, eager.logits))
