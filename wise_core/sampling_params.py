"""How one request decodes: the sampling parameters both engines take (wise_torch.LLM,
wise_jax.LLM), validated once here."""

from __future__ import annotations

import dataclasses
import math
import numbers

MAX_SEED = 2 ** 63


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    max_tokens: tokens to generate (>= 1; the first comes from prefill); temperature 0 is
    greedy, > 0 samples softmax(logits / temperature) restricted to top_p (the smallest prefix
    of tokens ranked by probability reaching top_p, in (0, 1]); seed: an int in [0, 2**63)
    makes the request's samples reproducible whatever else runs beside it (None: the engine
    draws them: wise_torch from its generator, wise_jax from its seed and the request id);
    ignore_eos: keep going past the model's eos; stop_token_ids: more ids that end the
    request; logprobs: report log p of each generated token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, numbers.Integral) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or any(
                not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of integer ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
