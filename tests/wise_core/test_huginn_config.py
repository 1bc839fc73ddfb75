"""wise_core.model_config: the Huginn architecture's fields, the released config's names, validation."""

import dataclasses

import pytest

from wise_core.config_error import ConfigError
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS

HUGINN = PRESETS["huginn-0125"]
TINY = PRESETS["test-tiny-huginn"]

# The released recpre/raven_config_minimal.json (huginn-0125's shape), as published.
RELEASED = {
    "name": "nebel-raven-3.5b", "architectures": ["RavenForCausalLM"], "torch_dtype": "bfloat16",
    "model_type": "huginn_raven", "block_size": 4096, "vocab_size": 65536, "padding_multiple": 4096,
    "tie_embeddings": True, "num_attention_heads": 55, "num_key_value_heads": 55, "n_embd": 5280,
    "intermediate_size": 17920, "bias": False, "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "norm_eps": 0.000001,
    "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "init_strategy": "takase", "init_orthogonal": False,
    "state_init": "like-init", "injection_type": "linear", "n_layers_in_recurrent_block": 4,
    "mean_recurrence": 32, "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": 8,
    "n_layers_in_prelude": 2, "n_layers_in_coda": 2, "qk_bias": True, "activation_checkpoint_impl": "per-iteration",
}


def test_released_config_loads():
    """The released config (no n_layers, no rope_base: RavenConfig's defaults 8 and 50000 apply)
    gives the huginn-0125 preset but for the token ids it does not carry."""
    config = ModelConfig.from_dict(RELEASED)
    assert config == dataclasses.replace(HUGINN, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert config.architecture == "huginn" and config.num_loops == 32 and config.head_dim == 96
    assert config.embed_scale == pytest.approx(72.6636084983398)  # the released init_values' embed_scale
    assert config.state_std == pytest.approx(0.008703882797784892)  # and its std


@pytest.mark.parametrize("name", ["huginn-0125", "test-tiny-huginn"])
def test_round_trip(name):
    config = PRESETS[name]
    raw = config.to_dict()
    assert raw["model_type"] == "huginn_raven" and raw["n_embd"] == config.hidden_size
    assert raw["mean_recurrence"] == config.total_ut_steps and "total_ut_steps" not in raw
    assert ModelConfig.from_dict(raw) == config


def test_ouro_dict_unchanged():
    """Ouro configs write and read as before: no Huginn field in their dict."""
    raw = PRESETS["test-tiny"].to_dict()
    assert raw["model_type"] == "ouro" and "architecture" not in raw
    assert not {"n_layers_in_prelude", "state_init", "qk_bias"} & set(raw)
    assert ModelConfig.from_dict(raw) == PRESETS["test-tiny"] and PRESETS["test-tiny"].architecture == "ouro"
    assert PRESETS["test-tiny"].embed_scale == 1.0


@pytest.mark.parametrize("change, message", [
    ({"architecture": "raven"}, "architecture must be one of"),
    ({"n_layers_in_prelude": 0}, "n_layers_in_prelude must be a positive integer for a Huginn model"),
    ({"n_layers_in_coda": None}, "n_layers_in_coda must be a positive integer for a Huginn model, got None"),
    ({"n_layers_in_recurrent_block": 4}, r"num_hidden_layers \(6\) must be .* \(1 \+ 4 \+ 2 = 7\)"),
    ({"state_init": "normal"}, "state_init must be one of"),
    ({"qk_bias": 1}, "qk_bias must be a boolean"),
    ({"head_dim": 32}, r"num_attention_heads \* head_dim \(2 \* 32\) must equal hidden_size \(128\)"),
    ({"num_key_value_heads": 1}, "one KV head per query head"),
    ({"early_exit_threshold": 0.5}, "a Huginn model has none"),
])
def test_huginn_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TINY, **change)


def test_ouro_rejects_huginn_fields():
    with pytest.raises(ConfigError, match="qk_bias is a Huginn field; an Ouro config leaves it None"):
        dataclasses.replace(PRESETS["test-tiny"], qk_bias=True)


@pytest.mark.parametrize("change, message", [
    ({"injection_type": "add"}, "injection_type='add'; wise implements injection_type='linear' only"),
    ({"norm_class_name": "LayerNorm"}, "wise implements norm_class_name='RMSNorm_llama' only"),
    ({"bias": True}, "wise implements bias=False only"),
    ({"n_heads": 48}, "gives n_heads=48 and num_attention_heads=55"),
    ({"mean_recurrence": 0}, "total_ut_steps must be a positive integer"),
    ({"n_layers": 9}, r"num_hidden_layers \(9\) must be"),
])
def test_released_dict_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**RELEASED, **change})


def test_unknown_architecture_field():
    with pytest.raises(ConfigError, match="architecture must be one of"):
        ModelConfig.from_dict({**PRESETS["test-tiny"].to_dict(), "architecture": "mamba"})
