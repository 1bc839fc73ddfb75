"""wise_core.checkpoint: the huginn-0125 HF layout (names, shapes, tied head, the optional RoPE
table), random Huginn checkpoints written and read back, and their errors."""

import dataclasses
import json
import math

import numpy as np
import pytest

from wise_core.checkpoint import (Checkpoint, CheckpointError, expected_shapes, huginn_layers, load_checkpoint,
                                  open_checkpoint, random_tensors, save_checkpoint)
from wise_core.huginn_reference import huginn_weights
from wise_core.presets import PRESETS
from wise_core.safetensors_io import write_tensors

HUGINN = PRESETS["huginn-0125"]
TINY = PRESETS["test-tiny-huginn"]


def test_huginn_0125_layout():
    """The released model's tensors: 8 layers of 9 tensors plus wte, adapter, ln_f (the head tied),
    3.56e9 parameters as the model card's 3.5B."""
    shapes = expected_shapes(HUGINN)
    assert len(shapes) == 8 * 9 + 3 and "lm_head.weight" not in shapes
    assert sum(math.prod(s) for s in shapes.values()) == 3_564_976_800
    assert shapes["transformer.wte.weight"] == (65536, 5280)
    assert shapes["transformer.adapter.weight"] == (5280, 10560)
    assert shapes["transformer.core_block.3.attn.Wqkv.weight"] == (3 * 5280, 5280)
    assert shapes["transformer.core_block.3.attn.qk_bias"] == (2, 1, 55, 96)
    assert shapes["transformer.coda.1.mlp.fc.weight"] == (2 * 17920, 5280)
    assert shapes["transformer.prelude.0.mlp.proj.weight"] == (5280, 17920)
    assert huginn_layers(HUGINN) == [("prelude", 0), ("prelude", 1), ("core_block", 0), ("core_block", 1),
                                     ("core_block", 2), ("core_block", 3), ("coda", 0), ("coda", 1)]
    untied = expected_shapes(dataclasses.replace(HUGINN, tie_word_embeddings=False, qk_bias=False))
    assert untied["lm_head.weight"] == (65536, 5280) and not any("qk_bias" in n for n in untied)


def test_random_tensors():
    t = random_tensors(TINY, seed=0, std=0.05)
    assert set(t) == set(expected_shapes(TINY))
    assert all(np.all(t[n] == 1) for n in t if ".norm_" in n or n == "transformer.ln_f.weight")
    assert np.std(t["transformer.prelude.0.attn.qk_bias"]) > 0.03  # biases drawn, not zero
    assert np.std(t["transformer.adapter.weight"]) == pytest.approx(0.05, rel=0.05)


@pytest.mark.parametrize("bf16, shard", [(False, None), (True, 300_000)])
def test_write_and_read(tmp_path, bf16, shard):
    tensors = random_tensors(TINY, seed=1)
    save_checkpoint(tmp_path, Checkpoint(TINY, tensors), bf16=bf16, max_shard_bytes=shard)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "huginn_raven" and raw["n_layers_in_recurrent_block"] == 3
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == TINY and set(loaded.tensors) == set(tensors)
    for name, t in tensors.items():
        np.testing.assert_allclose(np.asarray(loaded.tensors[name], np.float32), t, rtol=2 ** -8 if bf16 else 0)
    weights = huginn_weights(TINY, loaded.tensors)  # bf16 as released: the reference reads it in float64
    assert weights["lm_head.weight"] is weights["transformer.wte.weight"]
    assert all(w.dtype == np.float64 for w in weights.values())


def test_released_extras_accepted_and_dropped(tmp_path):
    """A released checkpoint may hold the tied head and the persistent freqs_cis buffer: both
    are shape-checked and dropped (wise ties the head and computes RoPE)."""
    tensors = random_tensors(TINY, seed=2)
    save_checkpoint(tmp_path, Checkpoint(TINY, tensors))
    extras = {"lm_head.weight": tensors["transformer.wte.weight"],
              "freqs_cis": np.zeros((1, TINY.max_position_embeddings, 1, TINY.head_dim // 2, 2), np.float32)}
    write_tensors(tmp_path / "model.safetensors", {**tensors, **extras})
    assert set(open_checkpoint(tmp_path).tensors) == set(tensors)
    write_tensors(tmp_path / "model.safetensors", {**tensors, "freqs_cis": np.zeros((1, 8, 1, 32, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor 'freqs_cis' has shape \(1, 8, 1, 32, 2\), expected"):
        open_checkpoint(tmp_path)


def test_errors(tmp_path):
    tensors = random_tensors(TINY, seed=3)
    save_checkpoint(tmp_path, Checkpoint(TINY, tensors))
    bad = {**tensors, "transformer.adapter.weight": np.zeros((128, 128), np.float32)}
    del bad["transformer.coda.1.attn.qk_bias"]
    write_tensors(tmp_path / "model.safetensors", bad)
    with pytest.raises(CheckpointError, match=r"missing tensor 'transformer.coda.1.attn.qk_bias' \(expected "
                                              r"shape \(2, 1, 2, 64\)\).*'transformer.adapter.weight' has shape "
                                              r"\(128, 128\)"):
        open_checkpoint(tmp_path)
    ouro = random_tensors(PRESETS["test-tiny"], seed=0)
    with pytest.raises(CheckpointError, match="missing tensor 'transformer.adapter.weight'"):
        save_checkpoint(tmp_path / "o", Checkpoint(TINY, ouro))
