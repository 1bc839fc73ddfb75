"""wise_jax.load_model: a loaded model's tokenizer belongs to it; weights read from safetensors
straight into the target dtype equal the checkpoint's values bitwise; dtype forms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import wise_jax
from wise_core.checkpoint import Checkpoint, random_tensors, save_checkpoint
from wise_core.presets import PRESETS
from wise_core.tokenizer import byte_tokenizer
from wise_jax.loading import from_checkpoint_tensors

CONFIG = dataclasses.replace(PRESETS["test-tiny"], num_hidden_layers=2, vocab_size=258, bos_token_id=256,
                             eos_token_id=256, pad_token_id=257)


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CONFIG, seed=3, std=0.08)


def _shifted_tokenizer():
    """The byte tokenizer with its vocabulary rotated: same size, other ids."""
    tok = byte_tokenizer()
    vocab = tok.get_vocab()
    rotated = {piece: (i + 1) % 256 if i < 256 else i for piece, i in vocab.items()}
    out = Tokenizer(models.BPE(vocab=rotated, merges=[]))
    out.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    out.decoder = decoders.ByteLevel()
    return out


def test_each_model_keeps_its_own_tokenizer(tmp_path, tensors):
    """Two checkpoints with one config but different tokenizers, and one without: loading the
    second must not change the first's text, and the third borrows none."""
    a = save_checkpoint(tmp_path / "a", Checkpoint(CONFIG, tensors, byte_tokenizer()))
    b = save_checkpoint(tmp_path / "b", Checkpoint(CONFIG, tensors, _shifted_tokenizer()))
    c = save_checkpoint(tmp_path / "c", Checkpoint(CONFIG, tensors, None))
    config_a, params_a, tok_a = wise_jax.load_model(a, with_tokenizer=True)
    _, _, tok_b = wise_jax.load_model(b, with_tokenizer=True)
    _, _, tok_c = wise_jax.load_model(c, with_tokenizer=True)
    assert tok_a.encode("hi").ids == [104, 105] and tok_b.encode("hi").ids == [105, 106] and tok_c is None
    with pytest.raises(ValueError, match="needs a tokenizer"):  # no tokenizer is looked up by config
        wise_jax.generate(params_a, config_a, ["hi"], max_new_tokens=2, page_size=32)


@pytest.mark.parametrize("stored_bf16", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, "bfloat16", np.float16])
def test_weights_equal_the_checkpoint_bitwise(tmp_path, tensors, stored_bf16, dtype):
    """Read from safetensors (float32 or BF16 files, sharded) into `dtype`: the same params,
    bitwise, as converting the checkpoint's numpy tensors in memory."""
    directory = save_checkpoint(tmp_path / "m", Checkpoint(CONFIG, tensors, None), bf16=stored_bf16,
                                max_shard_bytes=200_000)
    config, params = wise_jax.load_model(directory, dtype=dtype)
    stored = {n: np.asarray(t, jnp.bfloat16).astype(np.float32) if stored_bf16 else t for n, t in tensors.items()}
    want = from_checkpoint_tensors(CONFIG, stored, jnp.dtype(dtype))
    for got_leaf, want_leaf in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got_leaf.dtype == want_leaf.dtype and got_leaf.shape == want_leaf.shape
        np.testing.assert_array_equal(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32))


@pytest.mark.parametrize("dtype", [jnp.int8, "int32", None, "float", object()])
def test_non_floating_dtypes_are_named(dtype):
    with pytest.raises(ValueError, match="dtype must be a floating dtype of"):
        wise_jax.load_model("random-tiny", dtype=dtype)


def test_unstacked_loading_gives_the_engine_layout(tmp_path, tensors):
    """layers="unstacked" loads what params.unstack_layers makes of the stacked load, bitwise,
    and the engine takes it as it is (no second copy of the weights)."""
    from wise_jax.params import unstack_layers
    directory = save_checkpoint(tmp_path / "m", Checkpoint(CONFIG, tensors, None), max_shard_bytes=200_000)
    _, stacked = wise_jax.load_model(directory, dtype="bfloat16")
    _, unstacked = wise_jax.load_model(directory, dtype="bfloat16", layers="unstacked")
    assert isinstance(unstacked.layers, tuple) and len(unstacked.layers) == CONFIG.num_hidden_layers
    want = unstack_layers(stacked)
    assert jax.tree.structure(unstacked) == jax.tree.structure(want)
    for got_leaf, want_leaf in zip(jax.tree.leaves(unstacked), jax.tree.leaves(want)):
        assert got_leaf.dtype == want_leaf.dtype and got_leaf.shape == want_leaf.shape
        np.testing.assert_array_equal(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32))
    llm = wise_jax.LLM(unstacked, CONFIG, page_size=32, max_num_seqs=1, max_model_len=64)
    assert all(a is b for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(unstacked)))
    with pytest.raises(ValueError, match="layers must be"):
        wise_jax.load_model(directory, layers="scan")
