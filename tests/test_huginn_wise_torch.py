"""wise_torch.huginn: WISE decode over core iterations (Ouro's WiseState and DecodeContext, the
core plane (step, layer) as the state's (loop, layer)): every block selected equals dense decode
bitwise; greedy WISE generation equals the numpy reference's tokens; bad depths are refused."""

import numpy as np
import pytest
import torch

from huginn_cases import NEW_TOKENS, SEED, STEPS, TINY, WISE, checkpoint, prompts, reference_generate
from wise_core.config import PRESETS, ConfigError, WiseConfig
from wise_core.huginn_reference import huginn_weights, num_planes
from wise_core.modes import DENSE
from wise_torch.attention import decode_attention_reference
from wise_torch.huginn import huginn_from_tensors
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch, PrefillGroup
from wise_torch.wise_state import WiseState

PAGE, PAGES = 32, 3   # pages per request: the longest prompt plus NEW_TOKENS fits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("huginn-wise"))


@pytest.fixture(scope="module")
def model(ckpt):
    return huginn_from_tensors(TINY, ckpt.tensors)


def generate(model, prompts, wise_config=None, *, num_steps=STEPS, steps=NEW_TOKENS):
    """Greedy decode of the prompts as one batch (each prefilled alone into its pages), the core
    block run num_steps times. Returns (tokens per prompt, logits float32[steps, rows, vocab],
    the WiseState or None)."""
    rows = len(prompts)
    cache = PagedKVCache(planes=num_planes(TINY, num_steps), num_pages=rows * PAGES, page_size=PAGE,
                         kv_heads=TINY.num_key_value_heads, head_dim=TINY.head_dim)
    table = torch.arange(rows * PAGES).view(rows, PAGES)
    slot = lambda r, p: int(table[r, p // PAGE]) * PAGE + p % PAGE  # noqa: E731
    blocks = PAGES * PAGE // 16
    wise = None if wise_config is None else WiseState(wise_config, TINY, max_rows=rows, max_blocks=blocks)
    tokens, logits = [[] for _ in prompts], []
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            n = len(prompt)
            batch = PrefillBatch(torch.arange(n), torch.tensor([slot(r, p) for p in range(n)]),
                                 [PrefillGroup(0, n, 1, torch.arange(n), table[r:r + 1, :-(-n // PAGE)])],
                                 torch.tensor([n - 1]))
            out = model.prefill(torch.tensor(prompt), batch, cache, num_steps=num_steps,
                                state=model.initial_state(1, range(n), SEED))
            tokens[r].append(int(out[0].argmax()))
        positions = [len(p) for p in prompts]
        for _ in range(steps - 1):
            step = DecodeBatch(positions=torch.tensor(positions), seq_lens=torch.tensor(positions, dtype=torch.int32) + 1,
                               page_table=table.int(), slot_mapping=torch.tensor([slot(r, p) for r, p in
                                                                                  enumerate(positions)]),
                               epochs=torch.tensor([r * 10_000 + p for r, p in enumerate(positions)]))
            state = torch.cat([model.initial_state(1, range(p, p + 1), SEED) for p in positions])
            out = model.decode_step(torch.tensor([t[-1] for t in tokens]), step, cache, num_steps=num_steps,
                                    state=state, attention=decode_attention_reference,
                                    dense_modes=torch.full((rows,), DENSE, dtype=torch.int32),
                                    unused_support=torch.zeros(rows, TINY.num_attention_heads, blocks, dtype=torch.bool),
                                    wise=wise)
            logits.append(out)
            for r in range(rows):
                tokens[r].append(int(out[r].argmax()))
            positions = [p + 1 for p in positions]
    return tokens, torch.stack(logits), wise


def test_all_blocks_wise_is_bitwise_dense(model):
    """WISE with every causal block selected: the same tokens and bitwise the same logits as dense
    decode (every mode runs one masked softmax, so DISCOVER and a full SPARSE row are DENSE's)."""
    dense_tokens, dense_logits, _ = generate(model, prompts())
    wise_tokens, wise_logits, wise = generate(model, prompts(), WiseConfig(
        block_size=16, discover_depths=(0, 1), reuse_depths=(3,), kernel="reference", all_blocks=True))
    assert wise_tokens == dense_tokens
    assert torch.equal(wise_logits, dense_logits)
    assert wise.density()[3] == 1.0 and wise.fallbacks == 0


def test_wise_generation_equals_the_reference(model, ckpt):
    """Greedy WISE tokens equal the float64 spec's (`huginn_forward(..., wise=)`), and WISE is
    sparse on them: the reuse iteration attends fewer blocks than dense, with no fallback, and its
    logits differ from dense decode's."""
    weights = huginn_weights(TINY, ckpt.tensors)
    tokens, logits, wise = generate(model, prompts(), WISE)
    assert tokens == [reference_generate(TINY, weights, p, WISE) for p in prompts()]
    assert wise.density()[3] < 0.9 and wise.fallbacks == 0, wise.density()
    _, dense_logits, _ = generate(model, prompts())
    assert not torch.equal(logits, dense_logits)


def test_depths_outside_the_iterations_are_refused(model):
    """A WISE depth >= num_steps, or a WISE state of another model's layers, is an error naming it."""
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        generate(model, prompts()[:1], WISE, num_steps=3, steps=2)
    with pytest.raises(ValueError, match="the WISE state holds 2 layers; this model's core block has 3"):
        wise = WiseState(WISE, PRESETS["test-tiny"], max_rows=1, max_blocks=6)
        model.decode_step(torch.tensor([1]), None, None, num_steps=STEPS, state=None, attention=None,
                          dense_modes=None, unused_support=None, wise=wise)
