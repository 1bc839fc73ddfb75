"""The architecture of a model: `ModelConfig`, the fields of an Ouro or a Huginn `config.json`
(`architecture` says which), read, checked and written back. A frozen dataclass, hashable, so it
can be a static argument under jit. Named architectures: `wise_core.presets`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from wise_core.config_error import ConfigError, is_int, is_real


POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim",
                       "max_position_embeddings", "total_ut_steps")
FLOAT_FIELDS = ("rope_theta", "rms_norm_eps", "early_exit_threshold")
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

ARCHITECTURES = ("ouro", "huginn")
HUGINN_INT_FIELDS = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
HUGINN_FIELDS = HUGINN_INT_FIELDS + ("state_init", "qk_bias")
STATE_INITS = ("like-init", "zero")
"""Huginn's initial recurrent state: "like-init" (the released code at inference: a truncated
normal like the weight init, times the embedding scale) or "zero"."""

# Huginn config.json names (released RavenConfig) -> ModelConfig field.
HUGINN_NAMES = {"n_embd": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
                "rope_base": "rope_theta", "norm_eps": "rms_norm_eps", "block_size": "max_position_embeddings",
                "mean_recurrence": "total_ut_steps", "tie_embeddings": "tie_word_embeddings"}
# The released RavenConfig's defaults for fields a Huginn config.json may leave out.
HUGINN_DEFAULTS = {"rope_theta": 50_000.0, "tie_word_embeddings": True, "qk_bias": True, "state_init": "like-init"}
OURO_MODEL_TYPES = (None, "ouro")
OURO_HIDDEN_ACTS = (None, "silu")


def _check_ouro_implements(raw: dict[str, Any]) -> None:
    """An Ouro config dict's fields that change the model, where set to something wise does not
    implement, are a ConfigError naming the field (loading them silently would give the tokens
    of another model): a foreign model_type, hidden_act other than silu, rope_scaling, a sliding
    window (use_sliding_window true, or sliding_window set without use_sliding_window false, or
    a layer_types entry other than full_attention), attention or MLP biases."""
    model_type = raw.get("model_type")
    if model_type not in OURO_MODEL_TYPES:
        raise ConfigError(f"config model_type {model_type!r:.60} is not a model wise implements (ouro, or "
                          f"huginn_raven for Huginn)")
    if raw.get("hidden_act") not in OURO_HIDDEN_ACTS:
        raise ConfigError(f"config hidden_act {raw['hidden_act']!r:.60}: wise implements silu only")
    if raw.get("rope_scaling") not in (None, {}):
        raise ConfigError(f"config rope_scaling {json.dumps(raw['rope_scaling']):.80}: wise implements plain RoPE "
                          f"(rope_theta) only; rope_scaling must be null")
    use_window, window = raw.get("use_sliding_window"), raw.get("sliding_window")
    if use_window not in (None, False) or (window is not None and use_window is not False):
        raise ConfigError(f"config use_sliding_window {json.dumps(use_window)} with sliding_window "
                          f"{json.dumps(window):.40}: wise implements full attention only (use_sliding_window must "
                          f"be false or sliding_window null)")
    layer_types = raw.get("layer_types") or ()
    other = sorted({t for t in layer_types if t != "full_attention"}, key=str)
    if other:
        raise ConfigError(f"config layer_types holds {other[0]!r:.40}: wise implements full_attention layers only")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name) not in (None, False):
            raise ConfigError(f"config {name} {json.dumps(raw[name]):.40}: wise implements no {name.split('_')[0]} "
                              f"biases in an Ouro model ({name} must be false)")


# Huginn config.json fields that name a structure; wise implements these values only.
HUGINN_FIXED = {"architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
                "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
                "injection_type": "linear", "bias": False}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a recurrent-depth decoder (HF `config.json` field names).

    architecture "ouro": `num_hidden_layers` shared layers run `total_ut_steps` times.
    architecture "huginn" (huginn-0125): a prelude of `n_layers_in_prelude` layers, a core block
    of `n_layers_in_recurrent_block` layers iterated `total_ut_steps` times (the released config's
    `mean_recurrence`) on a recurrent state that starts as `state_init` says, a coda of
    `n_layers_in_coda` layers; `num_hidden_layers` is their sum, `qk_bias` adds a learned bias to
    q and k. The Huginn fields are None for Ouro.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architecture: str = "ouro"
    n_layers_in_prelude: int | None = None
    n_layers_in_recurrent_block: int | None = None
    n_layers_in_coda: int | None = None
    state_init: str | None = None
    qk_bias: bool | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"ModelConfig.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value):
                raise ConfigError(f"ModelConfig.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"ModelConfig.tie_word_embeddings must be a boolean (JSON true or false), "
                              f"got {self.tie_word_embeddings!r}")
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ConfigError(f"ModelConfig.{name} must be an integer token id or null, got {value!r}")
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ConfigError(
                f"early_exit_threshold must be in [0, 1], got {self.early_exit_threshold}")
        if self.architecture == "huginn":
            self._check_huginn()
        else:
            given = [name for name in HUGINN_FIELDS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{given[0]} is a Huginn field; an Ouro config leaves it None "
                                  f"(set architecture='huginn' for a Huginn model)")

    def _check_huginn(self) -> None:
        for name in HUGINN_INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer for a Huginn model, got {value!r}")
        layers = self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda
        if self.num_hidden_layers != layers:
            raise ConfigError(
                f"num_hidden_layers ({self.num_hidden_layers}) must be the prelude, core block and coda layers "
                f"together ({self.n_layers_in_prelude} + {self.n_layers_in_recurrent_block} + "
                f"{self.n_layers_in_coda} = {layers})")
        if self.state_init not in STATE_INITS:
            raise ConfigError(f"ModelConfig.state_init must be one of {STATE_INITS} for a Huginn model, "
                              f"got {self.state_init!r}")
        if not isinstance(self.qk_bias, bool):
            raise ConfigError(f"ModelConfig.qk_bias must be a boolean for a Huginn model, got {self.qk_bias!r}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"a Huginn model has one KV head per query head (its q and k biases share a shape); "
                              f"got {self.num_attention_heads} heads, {self.num_key_value_heads} KV heads")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"a Huginn model's heads span its width: num_attention_heads * head_dim "
                f"({self.num_attention_heads} * {self.head_dim}) must equal hidden_size ({self.hidden_size})")
        if self.early_exit_threshold != 1.0:
            raise ConfigError(f"early_exit_threshold is Ouro's learned exit gate; a Huginn model has none "
                              f"(got {self.early_exit_threshold})")

    @property
    def num_loops(self) -> int:
        """Recurrent depth: passes over the shared layers (`total_ut_steps`; Huginn's core block
        iterations)."""
        return self.total_ut_steps

    @property
    def loop_layers(self) -> int:
        """Layers run at each depth, those a WISE state holds supports for: Ouro's shared layers,
        Huginn's core block (its prelude and coda attend densely)."""
        return self.n_layers_in_recurrent_block if self.architecture == "huginn" else self.num_hidden_layers

    @property
    def embed_scale(self) -> float:
        """Huginn multiplies its embeddings by sqrt(hidden_size) (Ouro: 1)."""
        return math.sqrt(self.hidden_size) if self.architecture == "huginn" else 1.0

    @property
    def state_std(self) -> float:
        """Huginn's "like-init" state: std of the truncated normal before `embed_scale`, the
        released init's sqrt(2 / (5 hidden_size))."""
        return math.sqrt(2.0 / (5.0 * self.hidden_size))

    @property
    def kv_groups(self) -> int:
        """Query heads served by one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @staticmethod
    def is_huginn_dict(raw: dict[str, Any]) -> bool:
        """A Huginn (released RavenConfig) config dict: its model_type, architectures or our
        `architecture` field says so."""
        return (raw.get("architecture") == "huginn" or raw.get("model_type") == "huginn_raven"
                or "RavenForCausalLM" in (raw.get("architectures") or ()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an HF Ouro or Huginn config dict; unknown keys are ignored, missing required
        ones named, every field's JSON type checked (see `__post_init__`). head_dim defaults to
        hidden_size // num_attention_heads, num_key_value_heads to num_attention_heads; an eos,
        bos or pad id given as a list must list exactly one id. A Huginn dict (`is_huginn_dict`)
        may use the released names (`HUGINN_NAMES`: n_embd, n_heads, mean_recurrence, ...); its
        structural fields (`HUGINN_FIXED`), where present, must hold the values wise implements."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if cls.is_huginn_dict(raw):
            raw = cls._huginn_names(raw)
        elif raw.get("architecture", "ouro") != "ouro":
            raise ConfigError(f"architecture must be one of {ARCHITECTURES}, got {raw['architecture']!r}")
        else:
            _check_ouro_implements(raw)
        values: dict[str, Any] = {name: raw[name] for name in fields if raw.get(name) is not None}
        for name in TOKEN_FIELDS:
            if isinstance(values.get(name), list):  # HF allows a list of eos ids; wise takes one
                if len(values[name]) != 1:
                    raise ConfigError(f"{name} lists {values[name]!r:.80}; wise takes exactly one id")
                values[name] = values[name][0]
        if "head_dim" not in values and "hidden_size" in values and "num_attention_heads" in values:
            hidden, heads = values["hidden_size"], values["num_attention_heads"]
            # None when they are invalid: __post_init__ then names the one that is
            values["head_dim"] = hidden // heads if is_int(hidden) and is_int(heads) and heads > 0 else None
        if "num_key_value_heads" not in values and "num_attention_heads" in values:
            values["num_key_value_heads"] = values["num_attention_heads"]
        missing = [name for name, f in fields.items() if name not in values and f.default is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"config is missing the required field {missing[0]!r}")
        return cls(**values)

    @staticmethod
    def _huginn_names(raw: dict[str, Any]) -> dict[str, Any]:
        """A Huginn config dict with the released names mapped onto ModelConfig's."""
        for name, value in HUGINN_FIXED.items():
            if name in raw and raw[name] != value:
                raise ConfigError(f"Huginn config has {name}={raw[name]!r}; wise implements {name}={value!r} only")
        out = dict(raw, architecture="huginn")
        for released, ours in HUGINN_NAMES.items():
            if raw.get(released) is None:
                continue
            if raw.get(ours) is not None and raw[ours] != raw[released]:
                raise ConfigError(f"Huginn config gives {released}={raw[released]!r} and {ours}={raw[ours]!r}, "
                                  f"which name the same field")
            out[ours] = raw[released]
        for name, value in HUGINN_DEFAULTS.items():
            if out.get(name) is None:
                out[name] = value
        counts = [out.get(name) for name in HUGINN_INT_FIELDS]
        if out.get("num_hidden_layers") is None and all(is_int(c) for c in counts):
            out["num_hidden_layers"] = sum(counts)
        return out

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"{path} is a directory, not a config file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """HF-style config dict (what `config.json` holds): Ouro's field names, or for Huginn the
        released RavenConfig's (`HUGINN_NAMES`, `HUGINN_FIXED`)."""
        values = dataclasses.asdict(self)
        if self.architecture == "huginn":
            ours_to_released = {ours: released for released, ours in HUGINN_NAMES.items()}
            out: dict[str, Any] = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
                                   **HUGINN_FIXED}
            out.update({ours_to_released.get(k, k): v for k, v in values.items()
                        if k not in ("architecture", "early_exit_threshold")})
            out["num_attention_heads"] = self.num_attention_heads  # the released config keeps both names
            return out
        out = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "hidden_act": "silu"}
        out.update({k: v for k, v in values.items() if k not in ("architecture",) + HUGINN_FIELDS})
        return out

