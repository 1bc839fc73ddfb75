"""wise_core.model_config, wise_core.wise_config, wise_core.speculative_config: ModelConfig, WiseConfig and
SpeculativeConfig validation; wise_core.config re-exports them (and wise_core.request what the engines take
and give), importing and defining nothing else."""

import ast
import dataclasses
import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from wise_core.engine.args import EngineArgs
from wise_core.config_error import ConfigError
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig

TINY = PRESETS["test-tiny"]


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer"),
    ({"total_ut_steps": True}, "total_ut_steps must be a positive integer"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "multiple of num_key_value_heads"),
    ({"head_dim": 63}, "head_dim must be even"),
    ({"rope_theta": 0.0}, "rope_theta must be positive"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be positive"),
    ({"early_exit_threshold": 1.5}, "early_exit_threshold"),
    ({"eos_token_id": 384}, "eos_token_id=384 is outside the vocabulary"),
])
def test_model_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TINY, **change)


def test_model_config_from_dict():
    raw = TINY.to_dict()
    assert ModelConfig.from_dict(raw) == TINY
    derived = {k: v for k, v in raw.items() if k not in ("head_dim", "num_key_value_heads")}
    config = ModelConfig.from_dict(derived)
    assert config.head_dim == TINY.hidden_size // TINY.num_attention_heads
    assert config.num_key_value_heads == TINY.num_attention_heads
    assert ModelConfig.from_dict({**raw, "eos_token_id": [5]}).eos_token_id == 5
    with pytest.raises(ConfigError, match="eos_token_id lists \\[5, 6\\]; wise takes exactly one id"):
        ModelConfig.from_dict({**raw, "eos_token_id": [5, 6]})
    with pytest.raises(ConfigError, match="missing the required field 'vocab_size'"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "vocab_size"})


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, r"config model_type 'llama' is not a model wise implements \(ouro, or huginn_raven"),
    ({"hidden_act": "gelu"}, "config hidden_act 'gelu': wise implements silu only"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "config hidden_act 'gelu_pytorch_tanh'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"config rope_scaling \{\"type\": \"yarn\".*must be null"),
    ({"use_sliding_window": True, "sliding_window": 256}, "config use_sliding_window true with sliding_window 256: "
                                                         "wise implements full attention only"),
    ({"sliding_window": 4096}, "config use_sliding_window null with sliding_window 4096"),
    ({"use_sliding_window": "yes"}, 'config use_sliding_window "yes"'),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "config layer_types holds 'sliding_attention'"),
    ({"attention_bias": True}, "config attention_bias true: wise implements no attention biases"),
    ({"mlp_bias": True}, "config mlp_bias true: wise implements no mlp biases"),
])
def test_config_fields_the_model_does_not_implement_are_refused(change, message):
    """Each field would make the released model another one; loading it silently would give the
    unmodified model's tokens."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**TINY.to_dict(), **change})


def test_config_fields_at_what_the_model_implements_load():
    """The released Ouro config's values (and nulls) of the same fields load as the config."""
    released = {"model_type": "ouro", "hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False,
                "sliding_window": 4096, "layer_types": ["full_attention"] * 2, "attention_bias": False,
                "mlp_bias": False, "attention_dropout": 0.0, "use_cache": True, "max_window_layers": 2}
    assert ModelConfig.from_dict({**TINY.to_dict(), **released}) == TINY
    assert ModelConfig.from_dict({**TINY.to_dict(), "sliding_window": None}) == TINY


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", r"tie_word_embeddings must be a boolean \(JSON true or false\), got 'false'"),
    ("tie_word_embeddings", 0, "tie_word_embeddings must be a boolean"),
    ("rope_theta", [10000], r"rope_theta must be a finite number, got \[10000\]"),
    ("rope_theta", "1e4", "rope_theta must be a finite number, got '1e4'"),
    ("rms_norm_eps", float("inf"), "rms_norm_eps must be a finite number, got inf"),
    ("early_exit_threshold", True, "early_exit_threshold must be a finite number, got True"),
    ("eos_token_id", "256", "eos_token_id must be an integer token id or null, got '256'"),
    ("eos_token_id", ["256"], "eos_token_id must be an integer token id or null, got '256'"),
    ("bos_token_id", 1.5, "bos_token_id must be an integer token id or null, got 1.5"),
    ("pad_token_id", True, "pad_token_id must be an integer token id or null, got True"),
    ("eos_token_id", [], r"eos_token_id lists \[\]; wise takes exactly one id"),
    ("hidden_size", "128", "hidden_size must be a positive integer, got '128'"),
    ("vocab_size", 384.0, "vocab_size must be a positive integer, got 384.0"),
    ("num_attention_heads", [2], r"num_attention_heads must be a positive integer, got \[2\]"),
])
def test_every_json_field_is_type_checked(field, value, message):
    """config.json values of the wrong JSON type are errors naming the field (a string "false"
    for tie_word_embeddings used to read as true and drop lm_head)."""
    raw = {**TINY.to_dict(), field: value}
    if field in ("hidden_size", "num_attention_heads"):
        del raw["head_dim"]  # derived from them
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_json_numbers_become_floats():
    config = ModelConfig.from_dict({**TINY.to_dict(), "rope_theta": 10000, "early_exit_threshold": 1})
    assert config.rope_theta == 10000.0 and isinstance(config.rope_theta, float)
    assert isinstance(config.early_exit_threshold, float) and config == TINY


def test_model_config_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json(tmp_path / "config.json")


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 48}, "power of two"),
    ({"block_size": 0}, "power of two"),
    ({"block_size": True}, "power of two"),
    ({"eta": 0.0}, r"eta must be in \(0, 1\]"),
    ({"eta": 1.01}, r"eta must be in \(0, 1\]"),
    ({"discover_depths": ()}, "at least one loop"),
    ({"discover_depths": (-1, 0)}, "non-negative loop indices"),
    ({"reuse_depths": (2, 2)}, "repeats a loop"),
    ({"discover_depths": (0, 2), "reuse_depths": (2, 3)}, r"loops \[2\] are both"),
    ({"discover_depths": (0, 3), "reuse_depths": (2,)}, "comes before the last discovery depth"),
    ({"eta": "0.9"}, "eta must be a number"),
    ({"discover_depths": 0}, "tuple or list of non-negative loop indices"),
    ({"discover_depths": (True,)}, "tuple or list of non-negative loop indices"),
    ({"discover_depths": (np.int64(0), np.int64(1))}, r"discover_depths must be .*Python ints.*np.int64\(0\)"),
    ({"block_size": np.int64(32)}, r"block_size must be a positive power of two \(a Python int\), got np.int64\(32\)"),
    ({"block_size": 32.0}, r"block_size must be a positive power of two \(a Python int\), got 32.0"),
    ({"all_blocks": "no"}, "all_blocks must be True or False, got 'no'"),
    ({"all_blocks": 1}, "all_blocks must be True or False, got 1"),
    ({"eta": float("nan")}, r"eta must be in \(0, 1\], got nan"),
])
def test_wise_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        WiseConfig(**kwargs)


def test_attention_is_the_engines_choice_not_the_wise_configs():
    """WiseConfig holds the algorithm; the attention implementation is EngineArgs.attention_backend
    (checked against every framework's names here, against its own by the engine)."""
    with pytest.raises(TypeError, match="kernel"):
        WiseConfig(kernel="triton")
    assert EngineArgs().attention_backend == "auto" and EngineArgs(attention_backend="pallas").attention_backend
    for bad in ("cuda", ["triton"], None):
        with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'fa4', 'pallas', 'reference', "
                                             "'triton'"):
            EngineArgs(attention_backend=bad)


def test_wise_config_roles_and_range():
    config = WiseConfig(discover_depths=[0, 1], reuse_depths=[3])
    assert config.discover_depths == (0, 1)  # lists become tuples: hashable
    assert [config.depth_role(loop) for loop in range(4)] == ["discover", "discover", "dense", "reuse"]
    config.validate_for(4)
    with pytest.raises(ConfigError, match=r"\[3\] are out of range for a model with 3 loops"):
        config.validate_for(3)
    hash(config)


def test_wise_config_depths_in_loop_order():
    """Depths given out of order mean the same loops: the first discovery loop is the lowest."""
    assert WiseConfig(discover_depths=(1, 0), reuse_depths=(3, 2)) == WiseConfig()


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="medusa"), "method must be one of"),
    (dict(num_draft=0), "num_draft must be a positive integer"),
    (dict(num_draft=True), "num_draft must be a positive integer"),
    (dict(draft_loops=0), "draft_loops must be None or a positive integer"),
    (dict(sparse_discovery="yes"), "sparse_discovery must be a bool"),
    (dict(method="loops", sparse_discovery=True), "sparse_discovery applies to method 'wise'"),
])
def test_speculative_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(**kwargs)


def test_speculative_config_verify_depth():
    wise = WiseConfig()
    assert SpeculativeConfig("wise").verify_depth(4, wise) == 2
    assert SpeculativeConfig("wise").verify_depth(4, WiseConfig(discover_depths=(0,), reuse_depths=(1, 3))) == 1
    assert SpeculativeConfig("loops").verify_depth(4, None) == 2
    assert SpeculativeConfig("loops", draft_loops=3).verify_depth(4, None) == 3
    with pytest.raises(ConfigError, match="needs a WiseConfig with a reuse depth"):
        SpeculativeConfig("wise").verify_depth(4, WiseConfig(reuse_depths=()))
    for draft_loops in (1, 2, 5):        # the draft's loops must hold a reuse loop and be the model's
        with pytest.raises(ConfigError, match=r"draft_loops must be in \[3, 4\]"):
            SpeculativeConfig("wise", draft_loops=draft_loops).verify_depth(4, wise)
    assert SpeculativeConfig("wise", draft_loops=3).verify_depth(4, wise) == 2
    assert SpeculativeConfig("wise", draft_loops=3).draft_end(4) == 3 and SpeculativeConfig("wise").draft_end(4) == 4
    assert SpeculativeConfig("wise", sparse_discovery=True).verify_depth(4, wise) == 0    # no draft loop is exact
    assert SpeculativeConfig("wise", draft_loops=3, sparse_discovery=True).verify_depth(4, wise) == 0
    with pytest.raises(ConfigError, match=r"draft_loops must be in \[3, 4\]"):
        SpeculativeConfig("wise", draft_loops=2, sparse_discovery=True).verify_depth(4, wise)
    with pytest.raises(ConfigError, match="pass no wise_config"):
        SpeculativeConfig("loops").verify_depth(4, wise)
    with pytest.raises(ConfigError, match=r"draft_loops must be in \[1, 3\]"):
        SpeculativeConfig("loops", draft_loops=4).verify_depth(4, None)


@pytest.mark.parametrize("name", ["config", "request"])
def test_the_one_import_modules_only_re_export(name):
    """wise_core.config and wise_core.request hold imports from the modules of each job and
    `__all__` naming them all: every name is the object of its home module."""
    module = importlib.import_module(f"wise_core.{name}")
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {}
    for node in tree.body[1:]:    # after the docstring
        if isinstance(node, ast.ImportFrom):
            imported.update({alias.name: node.module for alias in node.names})
        else:
            assert isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"], ast.dump(node)[:200]
    assert sorted(module.__all__) == sorted(imported)
    for symbol, home in imported.items():
        assert home.startswith("wise_core.") and getattr(module, symbol) is getattr(importlib.import_module(home), symbol)
