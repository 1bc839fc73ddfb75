"""wise_jax.LLM on Huginn beyond the shared engine tests (tests/wise_core/engine/
test_engine_huginn.py): a checkpoint directory loads by path and serves the tokens of the params
built from its tensors; a mesh and an Ouro num_steps are refused; huginn-0125's head_dim (96)
decodes on the Pallas kernel with the reference kernel's tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from cases import prompts_of
from huginn_cases import TINY, checkpoint
from parity.huginn import jax_generate
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig
from wise_jax import LLM, from_checkpoint_tensors


def test_a_huginn_checkpoint_directory_serves_the_tokens_of_its_tensors(tmp_path):
    ckpt = checkpoint(tmp_path)
    prompt = prompts_of([37], TINY.vocab_size, seed=7)[0]
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", num_steps=2, num_pages=8, page_size=32, max_model_len=64,
              max_num_seqs=2, kernel="reference")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    want = jax_generate(from_checkpoint_tensors(TINY, ckpt.tensors), TINY, [prompt], max_new_tokens=6, num_steps=2)
    assert out.token_ids == want[0][0]


def test_what_huginn_does_not_run_is_refused():
    params = from_checkpoint_tensors(TINY, random_tensors(TINY, seed=0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="a mesh runs Ouro models only; this is a Huginn model"):
        LLM(params, TINY, num_pages=4, page_size=32, mesh=mesh)
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer, got 2.5"):
        LLM(params, TINY, num_pages=4, page_size=32, num_steps=2.5)
    ouro_config = PRESETS["test-tiny"]
    ouro = from_checkpoint_tensors(ouro_config, random_tensors(ouro_config, seed=0))
    with pytest.raises(ValueError, match=r"an Ouro model runs its 4 loops every step, got num_steps=3"):
        LLM(ouro, ouro_config, num_pages=4, page_size=32, num_steps=3)
    assert LLM(ouro, ouro_config, num_pages=4, page_size=32, num_steps=4).cache.k.shape[0] == 4 * 2


HEAD_DIM_96 = dataclasses.replace(TINY, hidden_size=192, head_dim=96)
"""test-tiny-huginn with huginn-0125's head_dim (2 heads of 96): the Pallas kernel runs 128-lane tiles."""


@pytest.mark.parametrize("wise_config", [None, WiseConfig(block_size=16, eta=0.8, discover_depths=(0,),
                                                          reuse_depths=(1,))], ids=["dense", "wise"])
def test_head_dim_96_on_the_pallas_kernel_gives_the_reference_kernels_tokens(wise_config):
    """LLM(kernel="pallas") on a Huginn of head_dim 96 (interpreted on a CPU) gives the reference
    kernel's greedy tokens, dense and WISE (sparse: the reuse iteration attends fewer blocks
    than dense)."""
    params = from_checkpoint_tensors(HEAD_DIM_96, random_tensors(HEAD_DIM_96, seed=3, std=0.08))
    prompts = prompts_of([40, 20], HEAD_DIM_96.vocab_size, seed=9)
    tokens, stats = {}, {}
    for kernel in ("reference", "pallas"):
        llm = LLM(params, HEAD_DIM_96, wise_config=wise_config, num_steps=2, num_pages=8, page_size=32,
                  max_model_len=64, max_num_seqs=2, kernel=kernel)
        assert llm.kernel == kernel
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        tokens[kernel], stats[kernel] = [o.token_ids for o in outs], llm.stats()
    assert tokens["pallas"] == tokens["reference"]
    if wise_config is not None:
        assert stats["pallas"].fallbacks == 0 and 0 < stats["pallas"].density[1] < 1, stats["pallas"].density
