"""Lossless speculative decoding's settings (`SpeculativeConfig`) and their arithmetic: how many
tokens a request drafts (`draft_count`), the loops a draft runs and the loop verification
recomputes from. A frozen dataclass, hashable, so it can be a static argument under jit."""

from __future__ import annotations

import dataclasses
import math

from wise_core.config_error import ConfigError
from wise_core.wise_config import WiseConfig


SPECULATIVE_METHODS = ("wise", "loops")
ADAPTIVE_PRIOR = (0.8, 1.0)   # adaptive drafting's prior: acceptance 0.8, worth one draft


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
    adaptive: each request drafts, per round, the count in [0, num_draft] that maximises its
    expected tokens per unit of time (`draft_count`) from its running acceptance; draft_cost:
    a draft step's time in units of a dense step (the verification pass and the draft's loops
    before the verify depth together cost about one), for `draft_count`.
    """

    method: str = "wise"
    num_draft: int = 4
    draft_loops: int | None = None
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
