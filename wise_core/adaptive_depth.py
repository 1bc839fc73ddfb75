"""Huginn's per-token adaptive depth (`AdaptiveDepth`): a decode token leaves the core iterations
once they stop changing its next-token distribution."""

from __future__ import annotations

import dataclasses
import math

from wise_core.config_error import ConfigError, is_int


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
        if not is_int(self.min_steps) or self.min_steps < 0:
            raise ConfigError(f"AdaptiveDepth.min_steps must be a non-negative int, got {self.min_steps!r}")
