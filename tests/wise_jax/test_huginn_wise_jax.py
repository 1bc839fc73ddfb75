"""wise_jax.huginn: WISE decode over core iterations (Ouro's wise_state, the core plane (step,
layer) as the state's (loop, layer)): every block selected equals dense decode bitwise; greedy
WISE generation equals the numpy reference's tokens; bad depths are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from huginn_cases import NEW_TOKENS, SEED, STEPS, TINY, TOP2, WISE, checkpoint, prompts, reference_generate
from parity.huginn import jax_generate
from wise_core.config_error import ConfigError
from wise_core.huginn_reference import huginn_weights, num_planes
from wise_core.wise_config import WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.huginn import decode_step, huginn_from_tensors

ALL_BLOCKS = WiseConfig(block_size=16, discover_depths=(0, 1), reuse_depths=(3,), all_blocks=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("huginn-wise-jax"))


@pytest.fixture(scope="module")
def params(ckpt):
    return huginn_from_tensors(TINY, ckpt.tensors)


def generate(params, wise_config=None, scan_loops=True):
    return jax_generate(params, TINY, prompts(), max_new_tokens=NEW_TOKENS, num_steps=STEPS, seed=SEED,
                        wise_config=wise_config, scan_loops=scan_loops)


def test_all_blocks_wise_is_bitwise_dense(params):
    """WISE with every causal block selected: the same tokens and bitwise the same logits as dense
    decode (every mode runs one masked softmax, so DISCOVER and a full SPARSE row are DENSE's),
    every iteration straight-line in both (with scan_loops their programs loop over different runs
    of iterations, which XLA may fuse otherwise)."""
    dense_tokens, dense_logits, _ = generate(params, scan_loops=False)
    wise_tokens, wise_logits, wise = generate(params, ALL_BLOCKS, scan_loops=False)
    assert wise_tokens == dense_tokens
    for got, want in zip(wise_logits, dense_logits):
        np.testing.assert_array_equal(got, want)
    assert wise.density(ALL_BLOCKS)[3] == 1.0 and int(wise.fallbacks) == 0


@pytest.mark.parametrize("wise_config", [WISE, TOP2], ids=["eta", "top-2"])
def test_wise_generation_equals_the_reference(params, ckpt, wise_config):
    """Greedy WISE tokens (the eta rule, and top-2 blocks) equal the float64 spec's
    (`huginn_forward(..., wise=)`), and WISE is sparse on them: the reuse iteration attends fewer
    blocks than dense, with no fallback."""
    weights = huginn_weights(TINY, ckpt.tensors)
    tokens, _, wise = generate(params, wise_config)
    assert tokens == [reference_generate(TINY, weights, p, wise_config) for p in prompts()]
    assert wise.density(wise_config)[3] < 0.9 and int(wise.fallbacks) == 0, wise.density(wise_config)


def test_depths_outside_the_iterations_are_refused(params):
    """A WISE depth >= num_steps, or no WISE state of the core block's layers, is an error naming it."""
    cache = kvc.create(TINY, batch=1, max_pages=3, num_pages=3, page_size=32, planes=num_planes(TINY, STEPS))

    def step(num_steps=STEPS, state=ws.create(WISE, slots=1, layers=3, heads=2, max_blocks=6)):
        decode_step(params, TINY, cache, jnp.zeros(1, jnp.int32), jnp.zeros((1, TINY.hidden_size)),
                    jnp.zeros(1, jnp.int32), num_steps=num_steps, kernel="reference", wise_config=WISE,
                    wise_state=state)
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        step(num_steps=3)
    other = ws.create(WISE, slots=1, layers=2, heads=TINY.num_attention_heads, max_blocks=6)
    for state, got in ((None, "none"), (other, "one of 2 layers")):
        with pytest.raises(ValueError, match=f"needs a wise_state of the core block's 3 layers, got {got}"):
            step(state=state)
