"""wise_jax params: conversion from/to the HF layout, orbax save/restore, loading, on-device init."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import Checkpoint, CheckpointError, expected_shapes, random_tensors, save_checkpoint
from wise_core.presets import PRESETS
from wise_core.tokenizer import byte_tokenizer

CONFIG = PRESETS["test-tiny-gqa"]


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CONFIG, seed=3)


def test_checkpoint_tensors_round_trip(tensors):
    params = wise_jax.from_checkpoint_tensors(CONFIG, tensors)
    assert params.layers.qkv_proj.shape == (2, 128, (4 + 2 + 2) * 32)  # [layers, in, q | k | v]
    assert params.layers.gate_up_proj.shape == (2, 128, 2 * 256)
    np.testing.assert_array_equal(np.asarray(params.layers.o_proj[1]),
                                  tensors["model.layers.1.self_attn.o_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params.layers.qkv_proj[1, :, 128 + 64:]),
                                  tensors["model.layers.1.self_attn.v_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params.layers.gate_up_proj[0, :, 256:]),
                                  tensors["model.layers.0.mlp.up_proj.weight"].T)
    back = wise_jax.to_checkpoint_tensors(CONFIG, params)
    assert back.keys() == tensors.keys()
    for name in tensors:
        assert np.array_equal(back[name], tensors[name]), name

    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    tied_tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    params = wise_jax.from_checkpoint_tensors(tied, tied_tensors)
    assert params.lm_head is None
    assert "lm_head.weight" not in wise_jax.to_checkpoint_tensors(tied, params)
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        wise_jax.from_checkpoint_tensors(CONFIG, {k: v for k, v in tensors.items() if k != "model.norm.weight"})


def test_orbax_save_restore_identical(tensors, tmp_path):
    for dtype in (jnp.float32, jnp.bfloat16):
        params = wise_jax.from_checkpoint_tensors(CONFIG, tensors, dtype)
        path = wise_jax.save_params(tmp_path / jnp.dtype(dtype).name, params)
        restored = wise_jax.restore_params(path, CONFIG)
        assert jax.tree.structure(restored) == jax.tree.structure(params)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(FileExistsError, match="already exists"):
        wise_jax.save_params(path, params)
    wise_jax.save_params(path, params, overwrite=True)


def test_restore_reports_mismatch_and_damage(tensors, tmp_path):
    path = wise_jax.save_params(tmp_path / "p", wise_jax.from_checkpoint_tensors(CONFIG, tensors))
    wider = dataclasses.replace(CONFIG, intermediate_size=512)
    with pytest.raises(CheckpointError,
                       match=r"'layers.gate_up_proj' has shape \(2, 128, 512\), config needs \(2, 128, 1024\)"):
        wise_jax.restore_params(path, wider)
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    tied_path = wise_jax.save_params(tmp_path / "tied", wise_jax.from_checkpoint_tensors(
        tied, {k: v for k, v in tensors.items() if k != "lm_head.weight"}))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head'"):
        wise_jax.restore_params(tied_path, CONFIG)
    with pytest.raises(CheckpointError, match="unexpected tensor 'lm_head'"):
        wise_jax.restore_params(path, tied)
    with pytest.raises(CheckpointError, match="not a wise_jax params checkpoint"):
        wise_jax.restore_params(tmp_path / "nowhere", CONFIG)

    manifest = path / "wise_params.json"
    text = manifest.read_text()
    manifest.write_text(text[:20])
    with pytest.raises(CheckpointError, match="malformed manifest"):
        wise_jax.restore_params(path, CONFIG)
    manifest.write_text(text)
    shutil.rmtree(path / "orbax")
    with pytest.raises(CheckpointError, match="cannot read the saved arrays"):
        wise_jax.restore_params(path, CONFIG)


def test_load_model_and_tokenizer(tensors, tmp_path):
    directory = save_checkpoint(tmp_path / "ckpt", Checkpoint(CONFIG, tensors, byte_tokenizer()))
    config, params = wise_jax.load_model(directory, dtype=jnp.bfloat16)
    assert config == CONFIG and params.embed_tokens.dtype == jnp.bfloat16
    config, params, tokenizer = wise_jax.load_model(directory, with_tokenizer=True)
    assert tokenizer.encode("hi").ids == [104, 105]
    assert wise_jax.load_tokenizer(directory).encode("hi").ids == [104, 105]
    config, params, tokenizer = wise_jax.load_model("random-tiny", with_tokenizer=True)
    assert tokenizer.decode([104, 105]) == "hi"
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model'"):
        wise_jax.load_model("no-such-model")
    (directory / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="too short"):
        wise_jax.load_model(directory)


def test_init_params_on_device_matches_layout():
    config = PRESETS["test-tiny"]
    params = wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    tensors = wise_jax.to_checkpoint_tensors(config, params)        # validates every shape
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(config)
    assert np.all(tensors["model.norm.weight"] == 1) and np.all(tensors["model.early_exit_gate.bias"] == 0)
    assert 0.015 < tensors["model.layers.0.mlp.up_proj.weight"].std() < 0.025
    abstract = wise_jax.abstract_params(config, jnp.bfloat16)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), params)
