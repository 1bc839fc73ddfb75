"""wise_torch.huginn: WISE decode over core iterations (Ouro's WiseState and DecodeContext, the
core plane (step, layer) as the state's (loop, layer)): every block selected equals dense decode
bitwise; greedy WISE generation equals the numpy reference's tokens; bad depths are refused."""

import dataclasses

import numpy as np
import pytest
import torch

from huginn_cases import NEW_TOKENS, SEED, STEPS, TINY, TOP2, WISE, checkpoint, prompts, reference_generate
from parity.huginn import torch_generate
from wise_core.config_error import ConfigError
from wise_core.huginn_reference import huginn_weights
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_torch.huginn import huginn_from_tensors
from wise_torch.wise_state import WiseState

ALL_BLOCKS = WiseConfig(block_size=16, discover_depths=(0, 1), reuse_depths=(3,), all_blocks=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("huginn-wise"))


@pytest.fixture(scope="module")
def model(ckpt):
    return huginn_from_tensors(TINY, ckpt.tensors)


def generate(model, wise_config=None, *, num_steps=STEPS):
    return torch_generate(model, prompts(), max_new_tokens=NEW_TOKENS, num_steps=num_steps, seed=SEED,
                          wise_config=wise_config)


def test_all_blocks_wise_is_bitwise_dense(model):
    """WISE with every causal block selected: the same tokens and bitwise the same logits as dense
    decode (every mode runs one masked softmax, so DISCOVER and a full SPARSE row are DENSE's)."""
    dense_tokens, dense_logits, _ = generate(model)
    wise_tokens, wise_logits, wise = generate(model, ALL_BLOCKS)
    assert wise_tokens == dense_tokens
    for got, want in zip(wise_logits, dense_logits):
        np.testing.assert_array_equal(got, want)
    assert wise.density()[3] == 1.0 and wise.fallbacks == 0


@pytest.mark.parametrize("wise_config", [WISE, TOP2], ids=["eta", "top-2"])
def test_wise_generation_equals_the_reference(model, ckpt, wise_config):
    """Greedy WISE tokens (the eta rule, and top-2 blocks) equal the float64 spec's
    (`huginn_forward(..., wise=)`), and WISE is sparse on them: the reuse iteration attends fewer
    blocks than dense, with no fallback, and its logits differ from dense decode's."""
    weights = huginn_weights(TINY, ckpt.tensors)
    tokens, logits, wise = generate(model, wise_config)
    assert tokens == [reference_generate(TINY, weights, p, wise_config) for p in prompts()]
    assert wise.density()[3] < 0.9 and wise.fallbacks == 0, wise.density()
    _, dense_logits, _ = generate(model)
    assert any(not np.array_equal(a, b) for a, b in zip(logits, dense_logits))


def test_depths_outside_the_iterations_are_refused(model):
    """A WISE depth >= num_steps, or a WISE state of another model's layers, is an error naming it."""
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        generate(model, WISE, num_steps=3)
    with pytest.raises(ConfigError, match=r"WISE depths \[5\] are out of range for 4 core iterations"):
        WiseState(dataclasses.replace(WISE, reuse_depths=(5,)), TINY, max_rows=1, max_blocks=6)
    assert WiseState(dataclasses.replace(WISE, reuse_depths=(5,)), TINY, max_rows=1, max_blocks=6,
                     num_loops=6).density() == {5: None}
    wise = WiseState(WISE, PRESETS["test-tiny"], max_rows=1, max_blocks=6)
    with pytest.raises(ValueError, match="the WISE state holds 2 layers; this model's core block has 3"):
        model.decode_step(torch.tensor([1]), None, None, num_steps=STEPS, state=None, attention=None,
                          dense_modes=None, unused_support=None, wise=wise)
