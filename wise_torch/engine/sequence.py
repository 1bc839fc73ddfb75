"""Requests as the engine sees them: sampling parameters, sequences and their outputs."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers

import torch

MAX_SEED = 2 ** 63


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    max_tokens: tokens to generate (>= 1); temperature 0 is greedy, > 0 samples
    softmax(logits / temperature) restricted to top_p (the smallest prefix of tokens ranked by
    probability reaching top_p, in (0, 1]); seed: an int in [0, 2**63) makes the request's
    samples reproducible whatever else runs beside it (None: the engine's generator);
    ignore_eos: keep going past the model's eos; stop_token_ids: more ids that end the request;
    logprobs: report log p of each generated token.
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


class Status(enum.Enum):
    WAITING = "waiting"     # not started, or preempted (its K/V offloaded to host memory)
    RUNNING = "running"     # holds pages: prefilling or decoding
    FINISHED = "finished"


PENDING = -1   # a token sampled on the device whose value the host has not read yet


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request: its tokens (prompt then generated), pages and progress.

    tokens ends with PENDING entries for tokens sampled in steps still in flight (at most two:
    the engine reads a step's tokens while the next one runs). num_cached: tokens whose K/V is
    in the cache (prefill progress, then all but the last token while decoding); slot: the
    sequence's row in the engine's per-sequence device buffers while it runs; finishing: its
    last token is in flight (token budget reached); offloaded: the host copy of its K/V while
    preempted. forced: tokens to feed instead of sampling (teacher forcing); keep_logits: keep
    each step's float32 logits.
    """

    request_id: int
    prompt: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    slot: int = -1
    status: Status = Status.WAITING
    finishing: bool = False
    finish_reason: str | None = None
    offloaded: tuple[torch.Tensor, torch.Tensor] | None = None
    forced: list[int] | None = None
    keep_logits: bool = False
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def num_generated(self) -> int:
        """Generated tokens, those in flight included."""
        return len(self.tokens) - len(self.prompt)

    @property
    def output(self) -> list[int]:
        """The generated tokens the host has read."""
        out = self.tokens[len(self.prompt):]
        while out and out[-1] == PENDING:
            out.pop()
        return out

    @property
    def prefilled(self) -> bool:
        """Every prompt token is cached: the sequence decodes."""
        return self.num_cached >= len(self.prompt)

    @property
    def max_length(self) -> int:
        """Tokens the sequence holds when it ends at max_tokens (or at its forced continuation)."""
        extra = len(self.forced) if self.forced is not None else self.params.max_tokens
        return len(self.prompt) + extra

    def expect(self) -> int:
        """A token of this sequence was sampled on the device: hold its place -> its index."""
        self.tokens.append(PENDING)
        if len(self.tokens) >= self.max_length:
            self.finishing = True
        return len(self.tokens) - 1

    def resolve(self, index: int, token: int) -> None:
        """The host read the token at `index`: finish on a stop token (dropping any later
        token in flight) or on the token budget."""
        self.tokens[index] = token
        stop = self.forced is None and (not self.params.ignore_eos and token in self.eos_token_ids
                                        or token in self.params.stop_token_ids)
        if stop:
            del self.tokens[index + 1:]
            self.finish("stop")
        elif self.finishing and index == len(self.tokens) - 1:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason


@dataclasses.dataclass
class RequestOutput:
    """What one request has produced so far. text decodes token_ids with the model's tokenizer
    (None without one); logprobs: log p of each token (SamplingParams.logprobs, teacher forcing).
    prompt_token_ids is the engine's own list: read it, do not change it."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = None
    tokenizer: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(self.token_ids)

    @classmethod
    def of(cls, seq: Sequence, tokenizer) -> "RequestOutput":
        want_logprobs = seq.params.logprobs or seq.forced is not None
        return cls(seq.request_id, seq.prompt, seq.output, seq.status is Status.FINISHED, seq.finish_reason,
                   list(seq.logprobs) if want_logprobs else None, tokenizer)
