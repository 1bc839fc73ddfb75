"""What a request has produced, as both engines (wise_torch.LLM, wise_jax.LLM) give it, in vLLM's
shape: `RequestOutput`, its `CompletionOutput`s and their `Logprob`s."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry in CompletionOutput.logprobs, as vLLM's: logprob (under the model's raw
    logits), rank (1: the most probable; ties count against it), decoded_token (its text, None
    without a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request, in vLLM's shape: index (its place among the request's n),
    text (None without a tokenizer), token_ids, logprobs (SamplingParams.logprobs k not None:
    per position {token id: Logprob}, the chosen token first, then the k most probable; else
    None), finish_reason, stop_reason (the stop id or string that ended it; None for eos, the
    length, an abort, or while running)."""

    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclasses.dataclass
class RequestOutput:
    """What one request has produced so far. text decodes token_ids with the engine's tokenizer
    (None without one); logprobs: log p of each token (SamplingParams.logprobs not None, teacher
    forcing), else None. finish_reason: "length", "stop" (eos or a stop id), "abort", "error"
    (the engine found the request broken, e.g. NaN logits: `error` says why; the request alone
    ended, its pages freed, the others go on), or None while running; stop_reason: the stop id
    or string that ended it (None for eos); a stop string ends the text before it (token_ids
    keep the token that completed it). prompt_token_ids is the engine's own list: read it, do not
    change it. `outputs` and `prompt` give vLLM's shape;
    ranked: per position {token id: (logprob, rank)} (SamplingParams.logprobs not None), what
    `outputs` gives as Logprobs; prompt_ranked: the same of prompt tokens 1, 2, ...
    (SamplingParams.prompt_logprobs not None), what `prompt_logprobs` gives as Logprobs. A
    request of n > 1 completions: `completions` holds each one's output (this one's fields are
    the first's, but `finished`, which waits for all; the prompt is scored once, in the first's),
    and `outputs` lists them all."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = None
    tokenizer: object = dataclasses.field(default=None, repr=False, compare=False)
    stop_reason: int | str | None = None
    cut_text: str | None = dataclasses.field(default=None, repr=False)   # the text a stop string ended
    ranked: list[dict[int, tuple[float, int]]] | None = dataclasses.field(default=None, repr=False)
    completions: list[RequestOutput] | None = dataclasses.field(default=None, repr=False)
    prompt_ranked: list[dict[int, tuple[float, int]]] | None = dataclasses.field(default=None, repr=False)
    error: str | None = None

    @property
    def text(self) -> str | None:
        if self.cut_text is not None:
            return self.cut_text
        return None if self.tokenizer is None else self.tokenizer.decode(self.token_ids)

    @property
    def prompt(self) -> str | None:
        """The prompt as text (decoded from its ids; None without a tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.decode(self.prompt_token_ids)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(i, o.text, o.token_ids, o._as_logprobs(o.ranked), o.finish_reason, o.stop_reason)
                for i, o in enumerate(self.completions or [self])]

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs (SamplingParams.prompt_logprobs not None, else None): per prompt
        token, None for the first, then {token id: Logprob}: the prompt token's, then the k most
        probable at its position. A request still prefilling has the positions scored so far."""
        entries = self._as_logprobs(self.prompt_ranked)
        return None if entries is None else [None] + entries

    def _as_logprobs(self, ranked: list[dict[int, tuple[float, int]]] | None) -> list[dict[int, Logprob]] | None:
        """Ranked entries ({token id: (logprob, rank)}) as vLLM's Logprobs (decoded with the tokenizer)."""
        if ranked is None:
            return None
        tok = self.tokenizer
        return [{t: Logprob(lp, rank, None if tok is None else tok.decode([t])) for t, (lp, rank) in entry.items()}
                for entry in ranked]
