"""wise_torch.LLM on Huginn beyond the shared engine tests (tests/wise_core/engine/
test_engine_huginn.py, which run each case on both frameworks: a checkpoint directory by path,
huginn-0125's head_dim on the Triton kernel, an Ouro num_steps refused): `wise_torch.generate`
(an engine) runs Huginn at its default depth; speculation and tensor parallelism are refused."""

import pytest

from cases import prompts_of
from huginn_cases import TINY
from parity.huginn import torch_generate
from wise_core.checkpoint import random_tensors
from wise_core.speculative_config import SpeculativeConfig
from wise_torch import LLM, from_tensors, generate


def test_generate_runs_huginn_at_total_ut_steps():
    model = from_tensors(TINY, random_tensors(TINY, seed=1, std=0.08))
    prompt = prompts_of([45], TINY.vocab_size, seed=8)[0]
    got = generate(model, [prompt], max_new_tokens=6, eos_token_id=None, attention_backend="reference").tokens[0]
    assert got == torch_generate(model, [prompt], max_new_tokens=6, num_steps=TINY.total_ut_steps)[0][0]


def test_what_huginn_does_not_run_is_refused():
    model = from_tensors(TINY, random_tensors(TINY, seed=0))
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        LLM(model, num_pages=4, page_size=32, speculative_config=SpeculativeConfig())
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        LLM(model, num_pages=4, page_size=32, tensor_parallel_size=2)
