"""Checks of `generate` / `teacher_force` arguments shared by both frameworks, and the eos default.

Each returns the value to use or raises an error naming the argument (TypeError for a wrong
type, ValueError for a value out of range), so that a bad argument never reaches a comparison
or a library call that fails with a message about something else.
"""

from __future__ import annotations

import math

from wise_core.wise_config import WiseConfig


class _ModelEos:
    def __repr__(self) -> str:
        return "<the model's eos_token_id>"


MODEL_EOS = _ModelEos()
"""Default of `generate(eos_token_id=...)` in both frameworks: stop at the model config's
eos_token_id (None never stops early)."""

SEED_LIMIT = 2 ** 63  # seeds are in [0, 2**63): what both torch.Generator and jax.random.key take


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_max_new_tokens(max_new_tokens) -> int:
    if not _is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return max_new_tokens


def check_sampling(temperature, top_p) -> tuple[float, float]:
    """(temperature, top_p) as floats: temperature finite and >= 0 (0: greedy), top_p in (0, 1]."""
    if not _is_real(temperature):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {temperature!r}")
    if not _is_real(top_p):
        raise TypeError(f"top_p must be a number, got {top_p!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), float(top_p)


def check_seed(seed) -> int | None:
    """None, or an int in [0, 2**63)."""
    if seed is None:
        return None
    if not _is_int(seed):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def resolve_eos(eos_token_id, vocab_size: int, model_eos: int | None) -> int | None:
    """The eos id to stop at: `model_eos` for MODEL_EOS, None (never stop early), or an int id
    in the vocabulary."""
    if eos_token_id is MODEL_EOS:
        return model_eos
    if eos_token_id is None:
        return None
    if not _is_int(eos_token_id):
        raise TypeError(f"eos_token_id must be an int token id or None, got {eos_token_id!r}")
    if not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary (size {vocab_size})")
    return eos_token_id


def check_wise_config(wise_config, num_loops: int) -> WiseConfig | None:
    """None (dense decode) or a WiseConfig valid for a model of `num_loops` loops."""
    if wise_config is None:
        return None
    if not isinstance(wise_config, WiseConfig):
        raise TypeError(f"wise_config must be a WiseConfig or None, got {type(wise_config).__name__} "
                        f"{wise_config!r:.80}" + (" (build one: WiseConfig(**settings))"
                                                 if isinstance(wise_config, dict) else ""))
    wise_config.validate_for(num_loops)
    return wise_config
