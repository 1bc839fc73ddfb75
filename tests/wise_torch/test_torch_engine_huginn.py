"""wise_torch.LLM on Huginn beyond the shared engine tests (tests/wise_core/engine/
test_engine_huginn.py): a checkpoint directory loads by path and serves the tokens of the model
built from its tensors; `wise_torch.generate` (an engine) runs Huginn at its default depth;
speculation, tensor parallelism and an Ouro num_steps are refused."""

import pytest

from cases import prompts_of
from huginn_cases import TINY, checkpoint
from parity.huginn import torch_generate
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, SpeculativeConfig
from wise_core.request import SamplingParams
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
