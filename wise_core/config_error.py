"""ConfigError, the error every configuration of wise_core raises (`ModelConfig`, `WiseConfig`,
`AdaptiveDepth`, `SpeculativeConfig`), and the JSON type tests their checks share."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or inconsistent configuration."""


def is_int(x) -> bool:
    """A Python int that is not a bool (JSON integers; numpy integers are not accepted)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A Python int or float that is not a bool (JSON numbers)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)

