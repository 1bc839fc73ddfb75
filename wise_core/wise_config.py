"""The WISE decode settings: `WiseConfig` (block size, eta, the discovery and reuse depths, the
selection rule: the algorithm; which attention runs it is the engine's `attention_backend`) and
Huginn's WISE profile (`huginn_wise_config`). A frozen dataclass, hashable, so it can be a static argument under jit."""

from __future__ import annotations

import dataclasses
import numbers

from wise_core.config_error import ConfigError, is_int
from wise_core.selection import Custom, Eta, SelectionRule


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
            if not isinstance(depths, (tuple, list)) or any(not is_int(d) or d < 0 for d in depths):
                raise ConfigError(f"WiseConfig.{name} must be a tuple or list of non-negative loop indices "
                                  f"(Python ints), got {depths!r}")
            if len(set(depths)) != len(depths):
                raise ConfigError(f"WiseConfig.{name} repeats a loop: {depths}")
            object.__setattr__(self, name, tuple(sorted(depths)))  # loop order, whatever the input order
        bs = self.block_size
        if not is_int(bs) or bs <= 0 or bs & (bs - 1):
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
    fields (block_size, eta, ...). This is the project's choice, mirroring Ouro's default
    (discover the first two loops, reuse the rest), not a profile taken from the WISE paper (whose
    Huginn discovery iterations are not stated in the material this project follows)."""
    if not is_int(num_steps) or num_steps < 3:
        raise ConfigError(f"huginn_wise_config needs num_steps >= 3 core iterations (2 discover, 1 or more "
                          f"reuse), got {num_steps!r}")
    return WiseConfig(discover_depths=(0, 1), reuse_depths=tuple(range(2, num_steps)), **settings)
