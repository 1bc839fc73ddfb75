"""wise_jax.LLM beyond what both engines share (tests/wise_core/engine/test_engine.py): the logits of a prompt
prefilled in chunks against `wise_jax.generate` of the prompt alone (fp32, reference kernel,
CPU), whose prompt prefills in one chunk."""

import numpy as np
import pytest

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig

from cases import prompts_of

CONFIG = PRESETS["test-tiny"]
PAGE = 32
WISE = WiseConfig(eta=0.5)
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=5, std=0.08))


def alone(params, prompt, n, wise_config, **kw):
    return wise_jax.generate(params, CONFIG, [prompt], max_new_tokens=n, eos_token_id=None, page_size=PAGE,
                             wise_config=wise_config, attention_backend="reference", **kw)


def engine(params, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": PAGE, "max_num_seqs": 8, "max_model_len": 256,
          "attention_backend": "reference", **kw}
    return wise_jax.LLM(params, CONFIG, wise_config=wise_config, **kw)


@MODES
def test_logits_of_a_prompt_prefilled_in_chunks_are_the_unchunked_ones(params, wise_config):
    """150 prompt tokens at 40 a step: four chunks, three of them starting mid-page."""
    prompt = prompts_of([150], CONFIG.vocab_size)[0]
    llm = engine(params, wise_config, max_num_batched_tokens=40)
    rid = llm.add_request(prompt, wise_jax.SamplingParams(max_tokens=8, ignore_eos=True), keep_logits=True)
    seq = llm.sequences[rid]
    out = llm.run_until_done([rid])[0]
    want = alone(params, prompt, 8, wise_config, return_logits=True)
    assert out.token_ids == want.tokens[0]
    # fp32; the chunks attend in a float32 softmax over gathered keys, the whole prompt through
    # prefill_attention: the same sums in another order over at most 150 keys
    diff, bound = rounding.model_difference(np.stack(seq.logits), want.logits[0], CONFIG, keys=160)
    assert diff <= bound, (diff, bound)
    stats = llm.stats()
    assert stats.prompt_tokens == 150 and stats.free_pages == stats.total_pages
