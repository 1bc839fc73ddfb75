"""wise_jax.huginn: WISE decode over core iterations (Ouro's wise_state, the core plane (step,
layer) as the state's (loop, layer)): every block selected equals dense decode bitwise; greedy
WISE generation equals the numpy reference's tokens; bad depths are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from huginn_cases import NEW_TOKENS, SEED, STEPS, TINY, WISE, checkpoint, prompts, reference_generate
from wise_core.config import ConfigError, WiseConfig
from wise_core.huginn_reference import huginn_weights, initial_state, num_planes
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.huginn import decode_step, huginn_from_tensors, prefill

PAGE, PAGES = 32, 3   # pages per request: the longest prompt plus NEW_TOKENS fits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("huginn-wise-jax"))


@pytest.fixture(scope="module")
def params(ckpt):
    return huginn_from_tensors(TINY, ckpt.tensors)


def wise_state(wise_config, rows):
    return ws.create(wise_config, slots=rows, layers=TINY.n_layers_in_recurrent_block,
                     heads=TINY.num_attention_heads, max_blocks=PAGES * PAGE // wise_config.block_size)


def generate(params, prompts, wise_config=None, *, num_steps=STEPS, steps=NEW_TOKENS):
    """Greedy decode of the prompts as one batch (each prefilled alone, padded to whole pages, and
    inserted in its row), the core block run num_steps times. Returns (tokens per prompt, logits
    float32[steps - 1, rows, vocab] of the decode steps, the WiseState or None)."""
    rows = len(prompts)
    cache = kvc.create(TINY, batch=rows, max_pages=PAGES, num_pages=rows * PAGES, page_size=PAGE,
                       planes=num_planes(TINY, num_steps))
    tokens = []
    for r, prompt in enumerate(prompts):
        padded = np.zeros(-(-len(prompt) // PAGE) * PAGE, np.int32)
        padded[:len(prompt)] = prompt
        state = jnp.asarray(initial_state(TINY, np.arange(len(padded)), SEED), jnp.float32)
        logits, k, v = prefill(params, TINY, jnp.asarray(padded), jnp.int32(len(prompt)), state, num_steps=num_steps)
        cache = kvc.insert(cache, k, v, jnp.int32(len(prompt)), jnp.int32(r))
        tokens.append([int(jnp.argmax(logits))])
    wise = None if wise_config is None else wise_state(wise_config, rows)
    positions, logits = [len(p) for p in prompts], []
    for _ in range(steps - 1):
        state = jnp.asarray(np.concatenate([initial_state(TINY, [p], SEED) for p in positions]), jnp.float32)
        out, cache, wise = decode_step(params, TINY, cache, jnp.asarray([t[-1] for t in tokens], jnp.int32), state,
                                       jnp.arange(rows, dtype=jnp.int32), num_steps=num_steps, kernel="reference",
                                       wise_config=wise_config, wise_state=wise)
        logits.append(np.asarray(out))
        for r in range(rows):
            tokens[r].append(int(np.argmax(logits[-1][r])))
        positions = [p + 1 for p in positions]
    assert not bool(cache.overflowed)
    return tokens, np.stack(logits), wise


def test_all_blocks_wise_is_bitwise_dense(params):
    """WISE with every causal block selected: the same tokens and bitwise the same logits as dense
    decode (every mode runs one masked softmax, so DISCOVER and a full SPARSE row are DENSE's)."""
    dense_tokens, dense_logits, _ = generate(params, prompts())
    all_blocks = WiseConfig(block_size=16, discover_depths=(0, 1), reuse_depths=(3,), kernel="reference",
                            all_blocks=True)
    wise_tokens, wise_logits, wise = generate(params, prompts(), all_blocks)
    assert wise_tokens == dense_tokens
    np.testing.assert_array_equal(wise_logits, dense_logits)
    assert wise.density(all_blocks)[3] == 1.0 and int(wise.fallbacks) == 0


def test_wise_generation_equals_the_reference(params, ckpt):
    """Greedy WISE tokens equal the float64 spec's (`huginn_forward(..., wise=)`), and WISE is
    sparse on them: the reuse iteration attends fewer blocks than dense, with no fallback."""
    weights = huginn_weights(TINY, ckpt.tensors)
    tokens, _, wise = generate(params, prompts(), WISE)
    assert tokens == [reference_generate(TINY, weights, p, WISE) for p in prompts()]
    assert wise.density(WISE)[3] < 0.9 and int(wise.fallbacks) == 0, wise.density(WISE)


def test_depths_outside_the_iterations_are_refused(params):
    """A WISE depth >= num_steps, or no WISE state of the core block's layers, is an error naming it."""
    cache = kvc.create(TINY, batch=1, max_pages=PAGES, num_pages=PAGES, page_size=PAGE, planes=num_planes(TINY, STEPS))

    def step(num_steps=STEPS, state=wise_state(WISE, 1)):
        decode_step(params, TINY, cache, jnp.zeros(1, jnp.int32), jnp.zeros((1, TINY.hidden_size)),
                    jnp.zeros(1, jnp.int32), num_steps=num_steps, kernel="reference", wise_config=WISE,
                    wise_state=state)
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        step(num_steps=3)
    other = ws.create(WISE, slots=1, layers=2, heads=TINY.num_attention_heads, max_blocks=6)
    for state, got in ((None, "none"), (other, "one of 2 layers")):
        with pytest.raises(ValueError, match=f"needs a wise_state of the core block's 3 layers, got {got}"):
            step(state=state)
