"""Model and WISE configuration.

`ModelConfig` holds the fields of an Ouro or a Huginn `config.json` (`architecture` says which);
`WiseConfig` holds the WISE decode settings; `SpeculativeConfig` the lossless speculative
decoding settings. All are frozen dataclasses, hashable, so they can be static arguments under
jit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

from wise_core.selection import Custom, Eta, SelectionRule


class ConfigError(ValueError):
    """An invalid or inconsistent configuration."""


def _is_int(x) -> bool:
    """A Python int that is not a bool (JSON integers; numpy integers are not accepted)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    """A Python int or float that is not a bool (JSON numbers)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
# Huginn config.json fields that name a structure; wise implements these values only.
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
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ConfigError(f"ModelConfig.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"ModelConfig.tie_word_embeddings must be a boolean (JSON true or false), "
                              f"got {self.tie_word_embeddings!r}")
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
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
            if not _is_int(value) or value <= 0:
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
            values["head_dim"] = hidden // heads if _is_int(hidden) and _is_int(heads) and heads > 0 else None
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
        if out.get("num_hidden_layers") is None and all(_is_int(c) for c in counts):
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


# Presets. Ouro-1.4B / 2.6B follow the released config.json files.
PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=65536, total_ut_steps=4,
        early_exit_threshold=1.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "ouro-2.6b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=65536, total_ut_steps=4,
        early_exit_threshold=1.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    # Small shapes for tests: MHA and GQA, head_dim 64 (the `-gqa` variant has 2 query heads per KV head).
    "test-tiny": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4),
    "test-tiny-gqa": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4),
    # huginn-0125 (tomg-group-umd), following the released RavenConfig; its generation config
    # also stops on 65508 (wise takes one eos id).
    "huginn-0125": ModelConfig(
        vocab_size=65536, hidden_size=5280, intermediate_size=17920, num_hidden_layers=8,
        num_attention_heads=55, num_key_value_heads=55, head_dim=96, rope_theta=50_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=32, tie_word_embeddings=True,
        bos_token_id=65504, eos_token_id=65505, pad_token_id=65509, architecture="huginn",
        n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2, state_init="like-init",
        qk_bias=True),
    # Huginn in small shapes for tests: prelude, core block and coda of different lengths.
    "test-tiny-huginn": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4, tie_word_embeddings=True,
        architecture="huginn", n_layers_in_prelude=1, n_layers_in_recurrent_block=3, n_layers_in_coda=2,
        state_init="like-init", qk_bias=True),
}


KERNELS = ("auto", "reference", "triton", "pallas")
"""Every decode-attention kernel name (`WiseConfig.kernel`, `wise generate --kernel`)."""
FRAMEWORK_KERNELS = {"torch": ("auto", "reference", "triton"), "jax": ("auto", "reference", "pallas")}
"""The names each framework runs: "auto" (its GPU kernel on a GPU, the reference elsewhere), the
plain reference, and its kernel."""


MAX_DISCOVER_DEPTH = 30
"""The deepest discovery depth: the WISE states record the discovery depths run as bits of an int32."""


@dataclasses.dataclass(frozen=True)
class WiseConfig:
    """WISE decode settings.

    block_size: keys per block (tokens); a power of two, and page sizes must be multiples of it.
    eta: mass fraction the support must reach, in (0, 1].
    discover_depths: loops that attend densely and record block mass; selections are OR-ed.
    reuse_depths: loops that attend only the support found by the discovery loops.
    On Huginn a depth is a core iteration (the prelude and coda attend densely; see
    `huginn_wise_config`, docs/DESIGN.md "Huginn").
    kernel: attention implementation ("auto" picks the framework's fastest on the device).
    all_blocks: select every causal block (equivalence checks: WISE must then equal dense).
    selection: None (the default): discovery keeps the eta rule's blocks; or another rule of
    `wise_core.selection` (`TopK`, `Threshold`, `Custom`; a plain callable is taken as
    `Custom(fn)`), which then replaces the eta rule (`eta` is unused). The GPU kernels compute
    the eta rule in their finish step; under another rule they return the block mass and the
    rule selects from it (`decode_attention(selection=...)`). `rule` is the rule in force.
    """

    block_size: int = 32
    eta: float = 0.95
    discover_depths: tuple[int, ...] = (0, 1)
    reuse_depths: tuple[int, ...] = (2, 3)
    kernel: str = "auto"
    all_blocks: bool = False
    selection: SelectionRule | None = None

    def __post_init__(self) -> None:
        sel = self.selection
        if sel is not None and not isinstance(sel, SelectionRule):
            if not callable(sel):
                raise ConfigError(f"WiseConfig.selection must be None (the eta rule), a wise_core.selection rule "
                                  f"(TopK, Threshold, Custom) or a function of the block mass, got {sel!r}")
            object.__setattr__(self, "selection", Custom(sel))
        if isinstance(sel, Eta):
            raise ConfigError(f"WiseConfig.selection={sel!r}: give the eta rule as WiseConfig(eta={sel.eta!r}) "
                              f"(selection takes the other rules: TopK, Threshold, Custom)")
        for name in ("discover_depths", "reuse_depths"):
            depths = getattr(self, name)
            if not isinstance(depths, (tuple, list)) or any(not _is_int(d) or d < 0 for d in depths):
                raise ConfigError(f"WiseConfig.{name} must be a tuple or list of non-negative loop indices "
                                  f"(Python ints), got {depths!r}")
            if len(set(depths)) != len(depths):
                raise ConfigError(f"WiseConfig.{name} repeats a loop: {depths}")
            object.__setattr__(self, name, tuple(sorted(depths)))  # loop order, whatever the input order
        bs = self.block_size
        if not _is_int(bs) or bs <= 0 or bs & (bs - 1):
            raise ConfigError(f"WiseConfig.block_size must be a positive power of two (a Python int), got {bs!r}")
        if not isinstance(self.eta, numbers.Real) or isinstance(self.eta, bool):
            raise ConfigError(f"WiseConfig.eta must be a number, got {self.eta!r}")
        if not 0.0 < self.eta <= 1.0:
            raise ConfigError(f"WiseConfig.eta must be in (0, 1], got {self.eta!r}")
        object.__setattr__(self, "eta", float(self.eta))
        if not self.discover_depths:
            raise ConfigError("WiseConfig.discover_depths must name at least one loop")
        if self.discover_depths[-1] > MAX_DISCOVER_DEPTH:
            raise ConfigError(f"discovery depth {self.discover_depths[-1]} is past {MAX_DISCOVER_DEPTH}: the WISE "
                              f"state records the discovery depths run as bits of an int32")
        overlap = set(self.discover_depths) & set(self.reuse_depths)
        if overlap:
            raise ConfigError(f"loops {sorted(overlap)} are both discovery and reuse depths")
        if self.reuse_depths and min(self.reuse_depths) < max(self.discover_depths):
            raise ConfigError(
                f"reuse depth {min(self.reuse_depths)} comes before the last discovery depth "
                f"{max(self.discover_depths)}")
        if not isinstance(self.kernel, str) or self.kernel not in KERNELS:
            raise ConfigError(f"WiseConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not isinstance(self.all_blocks, bool):
            raise ConfigError(f"WiseConfig.all_blocks must be True or False, got {self.all_blocks!r}")

    @property
    def rule(self) -> SelectionRule:
        """The selection rule in force: `selection`, or Eta(eta) when it is None."""
        return Eta(self.eta) if self.selection is None else self.selection

    def validate_for(self, num_loops: int, what: str | None = None) -> None:
        """Check the depths against a loop count; `what` names that count in the error (default
        "a model with N loops"; a Huginn decode: its num_steps core iterations)."""
        bad = [d for d in self.discover_depths + self.reuse_depths if d >= num_loops]
        if bad:
            what = f"a model with {num_loops} loops" if what is None else what
            raise ConfigError(f"WISE depths {bad} are out of range for {what}")

    def depth_role(self, loop: int) -> str:
        """'discover', 'reuse' or 'dense' for loop index `loop`."""
        if loop in self.discover_depths:
            return "discover"
        if loop in self.reuse_depths:
            return "reuse"
        return "dense"

    def role_runs(self, num_loops: int) -> list[tuple[str, range]]:
        """Loops 0 .. num_loops - 1 as runs of consecutive loops of one role, in order:
        [(role, loops)], e.g. discovery (0, 1) and reuse (2, 3) of 4 loops -> [('discover',
        range(0, 2)), ('reuse', range(2, 4))]. A decode step runs each run as one loop body."""
        runs: list[tuple[str, range]] = []
        for loop in range(num_loops):
            role = self.depth_role(loop)
            if runs and runs[-1][0] == role:
                runs[-1] = (role, range(runs[-1][1].start, loop + 1))
            else:
                runs.append((role, range(loop, loop + 1)))
        return runs


def huginn_wise_config(num_steps: int = 32, **settings) -> WiseConfig:
    """The WISE profile for Huginn at `num_steps` core iterations (huginn-0125's default r = 32):
    discovery on iterations 0 and 1, reuse on 2 .. num_steps - 1; `settings`: the other WiseConfig
    fields (block_size, eta, kernel, ...). This is the project's choice, mirroring Ouro's default
    (discover the first two loops, reuse the rest), not a profile taken from the WISE paper (whose
    Huginn discovery iterations are not stated in the material this project follows)."""
    if not _is_int(num_steps) or num_steps < 3:
        raise ConfigError(f"huginn_wise_config needs num_steps >= 3 core iterations (2 discover, 1 or more "
                          f"reuse), got {num_steps!r}")
    return WiseConfig(discover_depths=(0, 1), reuse_depths=tuple(range(2, num_steps)), **settings)


SPECULATIVE_METHODS = ("wise", "loops")


ADAPTIVE_PRIOR = (0.8, 1.0)   # adaptive drafting's prior: acceptance 0.8, worth one draft


@dataclasses.dataclass(frozen=True)
class AdaptiveDepth:
    """Per-token adaptive depth of Huginn's decode, the released code's KL exit criterion
    (`KLExitEvaluator` of recpre/raven_modeling_minimal.py): after each core iteration from
    `min_steps` on (0-based, as released), the coda and head read the state and the token exits
    once KL(p_previous || p) < `threshold` (p_previous starts uniform over the vocabulary); at
    most the call's num_steps. A later token reading a position at an iteration past that
    position's exit reads the position's last computed iteration's K/V (the released
    "latest-m4" lookup). threshold: the released default ("auto") is 1e-3."""

    threshold: float = 1e-3
    min_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ConfigError(f"AdaptiveDepth.threshold must be a finite number >= 0, got {self.threshold!r}")
        if not _is_int(self.min_steps) or self.min_steps < 0:
            raise ConfigError(f"AdaptiveDepth.min_steps must be a non-negative int, got {self.min_steps!r}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Lossless speculative decoding: draft `num_draft` tokens cheaply, verify them densely.

    method "wise": a draft token runs the discovery loops densely (their K/V is exact and kept)
    and the reuse loops sparsely (the WiseConfig's), every loop or loops 0..draft_loops-1 only
    (then the LM head); "loops": a draft token runs loops 0..draft_loops-1 densely, then the LM
    head. Verification recomputes the loops from the verify depth on (the first reuse depth for
    "wise", draft_loops for "loops") densely for the num_draft + 1 positions of a round, and
    accepts the longest prefix the dense model agrees with (rejection sampling when sampling),
    so the output is the dense model's. draft_loops: "loops": None is half the model's loops;
    "wise": None is every loop, else in (first reuse depth, loops] (with
    WiseConfig(discover_depths=(0,), reuse_depths=(1, 2, 3)) and draft_loops=2, a 2-loop draft
    with WISE on its second loop).
    sparse_discovery ("wise" only): every loop of a draft token, discovery loops included,
    attends sparsely the support the request's last verified token (the round's first token,
    whose discovery loops run densely) discovered, plus the blocks of the keys written after
    it (the drafts' own); verification then recomputes every loop densely (verify depth 0).
    accept_rate: for timing only (`benchmarks/engine/throughput.py --accept-rate`): each draft token
    is accepted with this probability, a Bernoulli draw from numpy's generator seeded with
    accept_seed (drawn per round as [rows, num_draft] in the round's row order, accepted as a
    prefix), instead of by the dense model's agreement. The drafts and the verification pass
    run as in a real round, so a round costs what a real one does, but the output is not the
    model's: accepted drafts are kept whatever the model says, and the token after them is the
    verification's greedy token. None (the default): lossless speculation.
    adaptive: each request drafts, per round, the count in [0, num_draft] that maximises its
    expected tokens per unit of time (`draft_count`) from its running acceptance; draft_cost:
    a draft step's time in units of a dense step (the verification pass and the draft's loops
    before the verify depth together cost about one), for `draft_count`.
    """

    method: str = "wise"
    num_draft: int = 4
    draft_loops: int | None = None
    accept_rate: float | None = None
    accept_seed: int = 0
    adaptive: bool = False
    draft_cost: float = 0.75
    sparse_discovery: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_draft
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"SpeculativeConfig.num_draft must be a positive integer, got {k!r}")
        d = self.draft_loops
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(f"SpeculativeConfig.draft_loops must be None or a positive integer, got {d!r}")
        p = self.accept_rate
        if p is not None and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0):
            raise ConfigError(f"SpeculativeConfig.accept_rate must be None or a probability in [0, 1], got {p!r}")
        if not isinstance(self.accept_seed, int) or isinstance(self.accept_seed, bool) or self.accept_seed < 0:
            raise ConfigError(f"SpeculativeConfig.accept_seed must be a non-negative integer, got {self.accept_seed!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"SpeculativeConfig.adaptive must be a bool, got {self.adaptive!r}")
        c = self.draft_cost
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 < c < math.inf:
            raise ConfigError(f"SpeculativeConfig.draft_cost must be a positive finite number, got {c!r}")
        if not isinstance(self.sparse_discovery, bool):
            raise ConfigError(f"SpeculativeConfig.sparse_discovery must be a bool, got {self.sparse_discovery!r}")
        if self.sparse_discovery and self.method != "wise":
            raise ConfigError(f"SpeculativeConfig.sparse_discovery applies to method 'wise' (sparse loops on a WISE "
                              f"support), got method {self.method!r}")

    def draft_count(self, drafted: float, accepted: float) -> int:
        """The drafts of an adaptive request's next round, from its (decayed) counts of drafts
        proposed and accepted: with a per-draft acceptance a (their ratio, under a prior of 0.8
        worth one draft), k drafts commit 1 + a + ... + a^k tokens in a round costing about
        1 + k * draft_cost dense steps; the k in [0, num_draft] with the most tokens per cost
        (the smallest on a tie). At k = 0 a round is a dense step, so a request whose drafts are
        mostly rejected stops drafting until its decayed counts (`Speculator`) drift back to the
        prior and it tries again."""
        a = (accepted + ADAPTIVE_PRIOR[0]) / (drafted + ADAPTIVE_PRIOR[1])
        rates = [sum(a ** i for i in range(k + 1)) / (1 + k * self.draft_cost) for k in range(self.num_draft + 1)]
        return max(range(self.num_draft + 1), key=lambda k: (rates[k], -k))

    def draft_end(self, num_loops: int) -> int:
        """Loops a draft token runs before the LM head (after `verify_depth` checked the config)."""
        if self.method == "wise":
            return num_loops if self.draft_loops is None else self.draft_loops
        return max(num_loops // 2, 1) if self.draft_loops is None else self.draft_loops

    def verify_depth(self, num_loops: int, wise_config: WiseConfig | None) -> int:
        """The first loop verification recomputes (every loop before it is exact in the draft),
        checked against a model of `num_loops` loops and the engine's WiseConfig ("wise" needs
        one with a reuse depth, "loops" none). sparse_discovery: 0 (no loop of a draft is exact)."""
        if self.method == "wise":
            if wise_config is None or not wise_config.reuse_depths:
                raise ConfigError("speculative method 'wise' needs a WiseConfig with a reuse depth")
            depth = wise_config.reuse_depths[0]
            if self.draft_loops is not None and not depth < self.draft_loops <= num_loops:
                raise ConfigError(f"speculative method 'wise' drafts with loops 0..draft_loops-1, its reuse loops "
                                  f"from {depth} on sparse: draft_loops must be in [{depth + 1}, {num_loops}] "
                                  f"(None: every loop), got {self.draft_loops}")
            return 0 if self.sparse_discovery else depth
        if wise_config is not None:
            raise ConfigError("speculative method 'loops' drafts with dense loops; pass no wise_config "
                              "(method 'wise' drafts with WISE)")
        depth = self.draft_end(num_loops)
        if not 1 <= depth < num_loops:
            raise ConfigError(f"SpeculativeConfig.draft_loops must be in [1, {num_loops - 1}] for a model with "
                              f"{num_loops} loops, got {depth}")
        return depth
