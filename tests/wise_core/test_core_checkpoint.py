"""wise_core.checkpoint: round trips and every malformed checkpoint named by its error."""

import dataclasses
import json
import struct

import numpy as np
import pytest

from wise_core.checkpoint import (BUILTIN_MODELS, DEFAULT_MODEL, Checkpoint, CheckpointError,
                                  expected_shapes, load_checkpoint, random_tensors, save_checkpoint)
from wise_core.presets import PRESETS
from wise_core.safetensors_io import read_tensors, write_tensors
from wise_core.tokenizer import byte_tokenizer

CONFIG = dataclasses.replace(PRESETS["test-tiny-gqa"], num_hidden_layers=1)


@pytest.fixture
def checkpoint():
    return Checkpoint(CONFIG, random_tensors(CONFIG, seed=1), byte_tokenizer())


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def bf16_nearest_even(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: the bit formula, an oracle
    independent of ml_dtypes (finite inputs)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return rounded.view(np.float32)


def test_round_trip(tmp_path, checkpoint):
    save_checkpoint(tmp_path, checkpoint)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == CONFIG
    assert_same_tensors(loaded.tensors, checkpoint.tensors)
    assert loaded.tokenizer.encode("def f(x):").ids == checkpoint.tokenizer.encode("def f(x):").ids


def test_sharded_round_trip(tmp_path, checkpoint):
    save_checkpoint(tmp_path, checkpoint, max_shard_bytes=100_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert_same_tensors(load_checkpoint(tmp_path).tensors, checkpoint.tensors)


def test_bf16_round_trip_rounds_to_nearest_even(tmp_path, checkpoint):
    save_checkpoint(tmp_path, checkpoint, bf16=True)
    loaded = load_checkpoint(tmp_path).tensors
    for name, array in checkpoint.tensors.items():
        assert loaded[name].dtype.name == "bfloat16", name  # as stored, not widened
        np.testing.assert_array_equal(loaded[name].astype(np.float32), bf16_nearest_even(array), err_msg=name)
    halfway = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], np.float32)  # ties: to even
    np.testing.assert_array_equal(bf16_nearest_even(halfway), [1.0, 1 + 2 ** -6, -1.0])


def test_tied_checkpoint_drops_lm_head(tmp_path):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    tensors = random_tensors(config)
    assert "lm_head.weight" not in tensors
    save_checkpoint(tmp_path, Checkpoint(config, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}))
    assert_same_tensors(load_checkpoint(tmp_path).tensors, tensors)


def test_builtin_default_model():
    loaded = load_checkpoint(DEFAULT_MODEL)
    assert DEFAULT_MODEL in BUILTIN_MODELS
    assert loaded.tokenizer is not None
    assert {n: a.shape for n, a in loaded.tensors.items()} == expected_shapes(loaded.config)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
    (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected tensor 'extra'"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((3, 4), np.float32)}),
     r"'model.layers.0.mlp.up_proj.weight' has shape \(3, 4\), expected \(256, 128\)"),
])
def test_save_rejects_mismatched_tensors(tmp_path, checkpoint, edit, message):
    edit(checkpoint.tensors)
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(tmp_path, checkpoint)


def _rewrite_weights(directory, edit):
    tensors = read_tensors(directory / "model.safetensors")
    edit(tensors)
    write_tensors(directory / "model.safetensors", tensors)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("lm_head.weight"), "missing tensor 'lm_head.weight'"),
    (lambda t: t.update({"model.layers.7.mlp.up_proj.weight": np.zeros(1, np.float32)}),
     "unexpected tensor 'model.layers.7.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.norm.weight": np.zeros(5, np.float32)}),
     r"'model.norm.weight' has shape \(5,\), expected \(128,\)"),
    (lambda t: t.update({"model.norm.weight": np.zeros(128, np.int32)}), "non-floating dtype int32"),
])
def test_load_rejects_mismatched_tensors(tmp_path, checkpoint, edit, message):
    save_checkpoint(tmp_path, checkpoint)
    _rewrite_weights(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{oops", "not valid JSON"),
    ("[]", "JSON object"),
    (json.dumps({"hidden_size": 128}), "missing the required field"),
    (json.dumps({**CONFIG.to_dict(), "head_dim": 63}), "head_dim must be even"),
])
def test_bad_config_json(tmp_path, checkpoint, text, message):
    save_checkpoint(tmp_path, checkpoint)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_missing_files(tmp_path, checkpoint):
    save_checkpoint(tmp_path, checkpoint)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name, message", [("config.json", "config.json is a directory, not a config file"),
                                           ("model.safetensors", "model.safetensors is a directory, not a file")])
def test_a_checkpoint_file_that_is_a_directory_is_named(tmp_path, checkpoint, name, message):
    save_checkpoint(tmp_path, checkpoint)
    (tmp_path / name).unlink()
    (tmp_path / name).mkdir()
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_unknown_model_name():
    with pytest.raises(CheckpointError, match=r"unknown model 'no-such-model'.*random-tiny"):
        load_checkpoint("no-such-model")


@pytest.mark.parametrize("keep", [4, 200, -100])
def test_truncated_safetensors(tmp_path, checkpoint, keep):
    save_checkpoint(tmp_path, checkpoint)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="too short|exceeds the file size|truncated"):
        load_checkpoint(tmp_path)


def _entry(dtype="F32", shape=(4,), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


NORM = "model.norm.weight"


@pytest.mark.parametrize("header, message", [
    ([1, 2], "header must be a JSON object"),
    ({NORM: {"shape": [4], "data_offsets": [0, 16]}}, f"tensor '{NORM}' has a malformed header entry"),
    ({NORM: _entry(offsets=[0])}, rf"tensor '{NORM}' has data_offsets \[0\]"),
    ({NORM: _entry(offsets=[0.0, 16.0])}, rf"tensor '{NORM}' has data_offsets \[0.0, 16.0\]"),
    ({NORM: _entry(offsets=["0", "16"])}, rf"tensor '{NORM}' has data_offsets \['0', '16'\]"),
    ({NORM: _entry(offsets=[16, 0])}, "0 <= start <= end"),
    ({NORM: _entry(shape="4")}, rf"tensor '{NORM}' has shape '4'; a shape is a list of non-negative integers"),
    ({NORM: _entry(shape=[-4])}, rf"tensor '{NORM}' has shape \[-4\]"),
    ({NORM: _entry(shape=[True])}, rf"tensor '{NORM}' has shape \[True\]"),
    ({NORM: _entry(dtype="F33")}, "unsupported dtype 'F33'"),
    ({NORM: _entry(shape=(5,))}, rf"tensor '{NORM}' holds 16 bytes, its shape \[5\] of F32 needs 20"),
    ({NORM: _entry(offsets=(0, 16)), "b": _entry(shape=(2,), offsets=(8, 16))}, f"tensor 'b' .* overlaps tensor '{NORM}'"),
    ({"b": _entry(shape=(2,), offsets=(8, 16))}, "8 unused bytes before tensor 'b'"),
    ({"b": _entry(shape=(2,), offsets=(0, 8))}, "8 bytes after the last tensor"),
])
def test_malformed_safetensors_header(tmp_path, checkpoint, header, message):
    """Each is a CheckpointError naming the file and the tensor (no TypeError, no guess)."""
    save_checkpoint(tmp_path, checkpoint)
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(CheckpointError, match=message) as error:
        load_checkpoint(tmp_path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("name", ["", "   ", 3, None])
def test_no_model_name(name):
    with pytest.raises(CheckpointError, match="unknown model|a model is a checkpoint directory"):
        load_checkpoint(name)


def test_sharded_errors(tmp_path, checkpoint):
    save_checkpoint(tmp_path, checkpoint, max_shard_bytes=100_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path)
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shards[-1].name}' is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="malformed index"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("where", ["outside", "absolute", "subdir"])
def test_an_index_may_name_only_files_of_its_directory(tmp_path, checkpoint, where):
    """A shard elsewhere (.., an absolute path, a subfolder) is refused before it is opened,
    even when the file is there and valid."""
    save_checkpoint(tmp_path / "ckpt", checkpoint, max_shard_bytes=100_000)
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    moved = {"outside": tmp_path / shard, "absolute": tmp_path / "abs" / shard,
             "subdir": tmp_path / "ckpt" / "sub" / shard}[where]
    moved.parent.mkdir(exist_ok=True)
    (tmp_path / "ckpt" / shard).rename(moved)
    named = {"outside": f"../{shard}", "absolute": str(moved), "subdir": f"sub/{shard}"}[where]
    index["weight_map"] = {n: named if f == shard else f for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a file name in the checkpoint directory"):
        load_checkpoint(tmp_path / "ckpt")


def test_a_tokenizer_that_is_not_the_models_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    config = dataclasses.replace(CONFIG, eos_token_id=256)          # the byte tokenizer's <|endoftext|>
    save_checkpoint(tmp_path, Checkpoint(config, random_tensors(config, seed=1), byte_tokenizer()))
    assert load_checkpoint(tmp_path).tokenizer is not None          # the model's own: accepted
    big = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size + 10)}, unk_token="t0"))
    big.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=f"has {config.vocab_size + 10} tokens, more than the model's vocab_size"):
        load_checkpoint(tmp_path)
    small = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    small.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="no token for the model's eos_token_id 256"):
        load_checkpoint(tmp_path)
