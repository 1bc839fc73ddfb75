"""wise_torch.LLM on Huginn beyond the shared engine tests (tests/wise_core/engine/
test_engine_huginn.py): a checkpoint directory loads by path and serves the tokens of the model
built from its tensors; `wise_torch.generate` (an engine) runs Huginn at its default depth;
speculation, tensor parallelism and an Ouro num_steps are refused; huginn-0125's head_dim (96)
decodes on the Triton kernel with the reference kernel's tokens."""

import dataclasses
import os

import pytest
import torch

from cases import prompts_of
from huginn_cases import TINY, checkpoint
from parity.huginn import torch_generate
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch import LLM, from_tensors, generate


def test_a_huginn_checkpoint_directory_serves_the_tokens_of_its_tensors(tmp_path):
    ckpt = checkpoint(tmp_path)
    prompt = prompts_of([37], TINY.vocab_size, seed=7)[0]
    llm = LLM(str(tmp_path / "ckpt"), device="cpu", num_steps=2, num_pages=8, page_size=32, max_model_len=64,
              max_num_seqs=2, kernel="reference")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    want = torch_generate(from_tensors(TINY, ckpt.tensors), [prompt], max_new_tokens=6, num_steps=2)[0][0]
    assert out.token_ids == want


def test_generate_runs_huginn_at_total_ut_steps():
    model = from_tensors(TINY, random_tensors(TINY, seed=1, std=0.08))
    prompt = prompts_of([45], TINY.vocab_size, seed=8)[0]
    got = generate(model, [prompt], max_new_tokens=6, eos_token_id=None, kernel="reference").tokens[0]
    assert got == torch_generate(model, [prompt], max_new_tokens=6, num_steps=TINY.total_ut_steps)[0][0]


def test_what_huginn_does_not_run_is_refused():
    model = from_tensors(TINY, random_tensors(TINY, seed=0))
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        LLM(model, num_pages=4, page_size=32, speculative_config=SpeculativeConfig())
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        LLM(model, num_pages=4, page_size=32, tensor_parallel_size=2)
    ouro = from_tensors(PRESETS["test-tiny"], random_tensors(PRESETS["test-tiny"], seed=0))
    with pytest.raises(ValueError, match=r"an Ouro model runs its 4 loops every step, got num_steps=3"):
        LLM(ouro, num_pages=4, page_size=32, num_steps=3)
    assert LLM(ouro, num_pages=4, page_size=32, num_steps=4).runner.cache.k.shape[0] == 4 * 2


HEAD_DIM_96 = dataclasses.replace(TINY, hidden_size=192, head_dim=96)
"""test-tiny-huginn with huginn-0125's head_dim (2 heads of 96): the Triton kernels run 128-lane tiles."""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs Triton")
@pytest.mark.parametrize("wise_config", [None, WiseConfig(block_size=16, eta=0.8, discover_depths=(0,),
                                                          reuse_depths=(1,))], ids=["dense", "wise"])
def test_head_dim_96_on_the_triton_kernel_gives_the_reference_kernels_tokens(wise_config):
    """LLM(kernel="triton") on a Huginn of head_dim 96 (interpreted on a CPU) decodes on the Triton
    kernel, not the reference, and gives the reference kernel's greedy tokens, dense and WISE
    (sparse: the reuse iteration attends fewer blocks than dense)."""
    model = from_tensors(HEAD_DIM_96, random_tensors(HEAD_DIM_96, seed=3, std=0.08))
    prompts = prompts_of([40, 20], HEAD_DIM_96.vocab_size, seed=9)
    tokens, stats = {}, {}
    for kernel in ("reference", "triton"):
        llm = LLM(model, wise_config=wise_config, num_steps=2, num_pages=8, page_size=32,
                  max_model_len=64, max_num_seqs=2, kernel=kernel)
        attention = next(iter(llm.runner.attention.values()))
        assert getattr(attention, "func", attention).__module__ == {
            "reference": "wise_torch.attention", "triton": "wise_torch.kernels.triton_decode"}[kernel]
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        tokens[kernel], stats[kernel] = [o.token_ids for o in outs], llm.stats()
    assert tokens["triton"] == tokens["reference"]
    if wise_config is not None:
        assert stats["triton"].fallbacks == 0 and 0 < stats["triton"].density[1] < 1, stats["triton"].density
