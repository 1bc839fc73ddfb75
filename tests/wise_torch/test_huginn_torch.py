"""wise_torch.huginn: the Huginn forward in PyTorch against wise_core.huginn_reference on a
random HF-layout checkpoint, the load-time RoPE reordering, the plane layout, loading."""

import dataclasses

import numpy as np
import pytest
import torch

import wise_torch
from huginn_cases import TINY, bound, checkpoint
from wise_core.huginn_reference import HuginnCache, huginn_forward, huginn_weights, initial_state, num_planes
from wise_torch.attention import decode_attention_reference
from wise_torch.huginn import HuginnForCausalLM, huginn_from_tensors, split_half_rows
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch, PrefillGroup


@pytest.mark.parametrize("qk_bias, tied", [(True, True), (False, False)])
def test_forward_matches_reference(tmp_path, qk_bias, tied):
    config = dataclasses.replace(TINY, qk_bias=qk_bias, tie_word_embeddings=tied)
    ckpt = checkpoint(tmp_path, config)
    model = huginn_from_tensors(config, ckpt.tensors)
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, 10))
    with torch.inference_mode():
        got = model(torch.tensor(ids), num_steps=5, seed=3).double().numpy()
    weights = huginn_weights(config, ckpt.tensors)
    for row in range(2):
        want = huginn_forward(config, weights, ids[row], num_steps=5, seed=3)
        assert np.abs(got[row] - want).max() <= bound(config, 5, want, 10)


def test_explicit_and_zero_state(tmp_path):
    ckpt = checkpoint(tmp_path)
    model = huginn_from_tensors(TINY, ckpt.tensors)
    weights = huginn_weights(TINY, ckpt.tensors)
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, 6)
    state = np.random.default_rng(5).normal(size=(6, TINY.hidden_size))
    with torch.inference_mode():
        got = model(torch.tensor(ids)[None], num_steps=2, state=torch.tensor(state)[None])[0].double().numpy()
        seeded = model(torch.tensor(ids)[None], num_steps=2, seed=0)[0].double().numpy()
    want = huginn_forward(TINY, weights, ids, num_steps=2, state=state)
    assert np.abs(got - want).max() <= bound(TINY, 2, want, 6)
    assert np.abs(seeded - want).max() > 1e-2  # the state is an input that matters
    np.testing.assert_array_equal(model.initial_state(1, range(6), 0).numpy(),
                                  initial_state(TINY, np.arange(6), 0).astype(np.float32))
    with pytest.raises(ValueError, match=r"state must be \[1, 6, 128\]"):
        model(torch.tensor(ids)[None], state=torch.zeros(6, 128))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[384]]))


def test_split_half_rows():
    """Interleaved pairs (2j, 2j + 1) land at (j, j + d / 2) in every head."""
    w = torch.arange(2 * 8).float()[:, None]
    assert split_half_rows(w, 2, 8)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def test_paged_prefill_and_decode_match_reference(tmp_path):
    """Prefill 37 tokens into two pages of 32 (planes for 6 iterations, 4 run), then 3 dense decode
    steps: each call's logits equal the reference's cached forward within rounding."""
    ckpt = checkpoint(tmp_path)
    model, weights = huginn_from_tensors(TINY, ckpt.tensors), huginn_weights(TINY, ckpt.tensors)
    ids = np.random.default_rng(6).integers(0, TINY.vocab_size, 40)
    cache = PagedKVCache(planes=num_planes(TINY, 6), num_pages=3, page_size=32, kv_heads=2, head_dim=64)
    pages = torch.tensor([[2, 0]])
    slot = lambda pos: int(pages[0, pos // 32]) * 32 + pos % 32  # noqa: E731
    spec = HuginnCache()
    with torch.inference_mode():
        batch = PrefillBatch(torch.arange(37), torch.tensor([slot(p) for p in range(37)]),
                             [PrefillGroup(0, 37, 1, torch.arange(37), pages)], torch.arange(37))
        state = model.initial_state(1, range(37), 9)
        got = model.prefill(torch.tensor(ids[:37]), batch, cache, num_steps=4, state=state)
        want = huginn_forward(TINY, weights, ids[:37], num_steps=4, cache=spec, seed=9)
        assert np.abs(got.double().numpy() - want).max() <= bound(TINY, 4, want, 37)
        for pos in range(37, 40):
            step = DecodeBatch(positions=torch.tensor([pos]), seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
                               page_table=pages.int(), slot_mapping=torch.tensor([slot(pos)]),
                               tags=torch.tensor([pos]))
            got = model.decode_step(torch.tensor(ids[pos:pos + 1]), step, cache, num_steps=4,
                                    state=model.initial_state(1, range(pos, pos + 1), 9),
                                    attention=decode_attention_reference, dense_modes=torch.zeros(1, dtype=torch.int32),
                                    unused_support=torch.zeros(1, 2, 2, dtype=torch.bool))
            want = huginn_forward(TINY, weights, ids[pos:pos + 1], num_steps=4, cache=spec, seed=9)
            assert np.abs(got.double().numpy() - want).max() <= bound(TINY, 4, want, pos + 1), pos
        with pytest.raises(ValueError, match="the cache holds 21 planes; 7 core iterations need 24"):
            model.prefill(torch.tensor(ids[:37]), batch, cache, num_steps=7, state=state)


def test_the_loader_builds_a_huginn_model_from_a_huginn_checkpoint(tmp_path):
    """`load_model` of a Huginn checkpoint directory (and `from_tensors` of a Huginn config) is the
    HuginnForCausalLM of its tensors, bitwise; OuroForCausalLM refuses a Huginn config, naming it."""
    ckpt = checkpoint(tmp_path)
    want = huginn_from_tensors(TINY, ckpt.tensors)
    ids = torch.tensor(np.random.default_rng(3).integers(0, TINY.vocab_size, (1, 9)))
    for model in (wise_torch.load_model(tmp_path / "ckpt"), wise_torch.from_tensors(TINY, ckpt.tensors)):
        assert isinstance(model, HuginnForCausalLM)
        with torch.inference_mode():
            torch.testing.assert_close(model(ids, num_steps=2), want(ids, num_steps=2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="OuroForCausalLM runs architecture 'ouro', got 'huginn'"):
        wise_torch.OuroForCausalLM(TINY)
