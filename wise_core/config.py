"""Model and WISE configuration.

`ModelConfig` holds the fields of an Ouro `config.json`; `WiseConfig` holds the WISE decode
settings. Both are frozen dataclasses, hashable, so they can be static arguments under jit.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An invalid or inconsistent configuration."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of an Ouro-style recurrent-depth decoder (HF `config.json` field names)."""

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "total_ut_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
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
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")

    @property
    def num_loops(self) -> int:
        """Recurrent depth: passes over the shared layers (`total_ut_steps`)."""
        return self.total_ut_steps

    @property
    def kv_groups(self) -> int:
        """Query heads served by one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an HF Ouro config dict; unknown keys are ignored, missing required ones named."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, field in fields.items():
            if name in raw and raw[name] is not None:
                values[name] = raw[name]
            elif name == "head_dim" and "hidden_size" in raw and "num_attention_heads" in raw:
                values[name] = raw["hidden_size"] // raw["num_attention_heads"]
            elif name == "num_key_value_heads" and "num_attention_heads" in raw:
                values[name] = raw["num_attention_heads"]
            elif field.default is dataclasses.MISSING:
                raise ConfigError(f"config is missing the required field {name!r}")
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if isinstance(values.get(name), list):  # HF allows a list of eos ids; keep the first
                if len(values[name]) != 1:
                    raise ConfigError(f"{name} lists several ids {values[name]}; wise takes one")
                values[name] = values[name][0]
        for name in ("rope_theta", "rms_norm_eps", "early_exit_threshold"):
            if name in values:
                values[name] = float(values[name])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """HF-style config dict (what `config.json` holds)."""
        out: dict[str, Any] = {"architectures": ["OuroForCausalLM"], "model_type": "ouro",
                               "hidden_act": "silu"}
        out.update(dataclasses.asdict(self))
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
}


KERNELS = ("auto", "reference", "triton", "pallas")
"""Every decode-attention kernel name (`WiseConfig.kernel`, `wise generate --kernel`)."""
FRAMEWORK_KERNELS = {"torch": ("auto", "reference", "triton"), "jax": ("auto", "reference", "pallas")}
"""The names each framework runs: "auto" (its GPU kernel on a GPU, the reference elsewhere), the
plain reference, and its kernel."""


class _ModelEos:
    def __repr__(self) -> str:
        return "<the model's eos_token_id>"


MODEL_EOS = _ModelEos()
"""Default of `generate(eos_token_id=...)` in both frameworks: stop at the model config's
eos_token_id (None never stops early)."""


@dataclasses.dataclass(frozen=True)
class WiseConfig:
    """WISE decode settings.

    block_size: keys per block (tokens); a power of two, and page sizes must be multiples of it.
    eta: mass fraction the support must reach, in (0, 1].
    discover_depths: loops that attend densely and record block mass; selections are OR-ed.
    reuse_depths: loops that attend only the support found by the discovery loops.
    kernel: attention implementation ("auto" picks the framework's fastest on the device).
    all_blocks: select every causal block (equivalence checks: WISE must then equal dense).
    """

    block_size: int = 32
    eta: float = 0.95
    discover_depths: tuple[int, ...] = (0, 1)
    reuse_depths: tuple[int, ...] = (2, 3)
    kernel: str = "auto"
    all_blocks: bool = False

    def __post_init__(self) -> None:
        for name in ("discover_depths", "reuse_depths"):
            depths = getattr(self, name)
            if not isinstance(depths, (tuple, list)) or any(
                    not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in depths):
                raise ConfigError(f"WiseConfig.{name} must be a sequence of non-negative loop indices, "
                                  f"got {depths!r}")
            if len(set(depths)) != len(depths):
                raise ConfigError(f"WiseConfig.{name} repeats a loop: {depths}")
            object.__setattr__(self, name, tuple(sorted(depths)))  # loop order, whatever the input order
        bs = self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0 or bs & (bs - 1):
            raise ConfigError(f"WiseConfig.block_size must be a power of two, got {bs!r}")
        if not isinstance(self.eta, numbers.Real) or isinstance(self.eta, bool):
            raise ConfigError(f"WiseConfig.eta must be a number, got {self.eta!r}")
        if not 0.0 < self.eta <= 1.0:
            raise ConfigError(f"WiseConfig.eta must be in (0, 1], got {self.eta!r}")
        if not self.discover_depths:
            raise ConfigError("WiseConfig.discover_depths must name at least one loop")
        overlap = set(self.discover_depths) & set(self.reuse_depths)
        if overlap:
            raise ConfigError(f"loops {sorted(overlap)} are both discovery and reuse depths")
        if self.reuse_depths and min(self.reuse_depths) < max(self.discover_depths):
            raise ConfigError(
                f"reuse depth {min(self.reuse_depths)} comes before the last discovery depth "
                f"{max(self.discover_depths)}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"WiseConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")

    def validate_for(self, num_loops: int) -> None:
        """Check the depths against a model's loop count."""
        bad = [d for d in self.discover_depths + self.reuse_depths if d >= num_loops]
        if bad:
            raise ConfigError(f"WISE depths {bad} are out of range for a model with {num_loops} loops")

    def depth_role(self, loop: int) -> str:
        """'discover', 'reuse' or 'dense' for loop index `loop`."""
        if loop in self.discover_depths:
            return "discover"
        if loop in self.reuse_depths:
            return "reuse"
        return "dense"
