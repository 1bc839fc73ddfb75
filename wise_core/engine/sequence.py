"""Requests as the engine sees them: a sequence's tokens, pages and progress, and its output."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from wise_core.detokenize import TextStream
from wise_core.outputs import RequestOutput
from wise_core.sampling_params import SamplingParams


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
    preempted (the framework's host arrays). forced: tokens to feed instead of sampling
    (teacher forcing); keep_logits: keep each step's float32 logits (the framework's arrays);
    generator: the framework's random state of the request (a torch.Generator, a JAX key).
    group: the request id of the n > 1 request this sequence is a completion of (None: a
    request of its own); parent: the group's first completion, whose full prompt pages this one
    shares once their prefill is launched. prompt_ranked: the prompt's scores read so far
    (`scores_prompt`), per prompt token from the second {token id: (logprob, rank)}.
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
    stop_reason: int | str | None = None     # the stop id or string that ended it (None: eos or another reason)
    error: str | None = None                 # why the engine ended it (finish_reason "error")
    text: TextStream | None = None           # its text, when stop strings are watched
    offloaded: tuple | None = None
    forced: list[int] | None = None
    keep_logits: bool = False
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ranked: list[dict[int, tuple[float, int]]] = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    generator: object = None
    group: int | None = None
    parent: Sequence | None = dataclasses.field(default=None, repr=False)
    prompt_ranked: list[dict[int, tuple[float, int]]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def scores_prompt(self) -> bool:
        """Its prefill scores the prompt (SamplingParams.prompt_logprobs; of an n > 1 request,
        the first completion, which prefills the whole prompt)."""
        return self.params.prompt_logprobs is not None and self.parent is None

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
        """The host read the token at `index`: finish on a stop token or stop string (dropping
        any later token in flight) or on the token budget."""
        self.tokens[index] = token
        eos = not self.params.ignore_eos and token in self.eos_token_ids
        if self.text is not None and self.forced is None:
            self.text.add([token])
        stop_id = self.forced is None and (eos or token in self.params.stop_token_ids) \
            and index - len(self.prompt) >= self.params.min_tokens
        if stop_id or (self.text is not None and self.text.stopped):
            del self.tokens[index + 1:]
            self.stop_reason = (None if eos else token) if stop_id else self.text.stop_reason
            self.finish("stop")
        elif self.finishing and index == len(self.tokens) - 1:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason

    def fail(self, error: str) -> None:
        """The engine found this request broken (NaN logits): it ends here, finish_reason
        "error", `error` saying why; the tokens read before stay, nothing later is added."""
        del self.tokens[len(self.prompt) + len(self.output):]     # the tokens in flight, the failed one first
        self.error = error
        self.finish("error")


def output_of(seq: Sequence, tokenizer) -> RequestOutput:
    """What `seq` has produced so far, as the engines return it."""
    want_logprobs = seq.params.logprobs is not None or seq.forced is not None
    cut = seq.text.text if seq.text is not None and seq.text.stopped else None
    prompt_ranked = None
    if seq.scores_prompt:    # a copy while the prefill adds to it; once whole it never changes
        whole = len(seq.prompt_ranked) == len(seq.prompt) - 1
        prompt_ranked = seq.prompt_ranked if whole else list(seq.prompt_ranked)
    return RequestOutput(seq.request_id, seq.prompt, seq.output, seq.status is Status.FINISHED, seq.finish_reason,
                         list(seq.logprobs) if want_logprobs else None, tokenizer, seq.stop_reason, cut,
                         list(seq.ranked) if seq.params.logprobs is not None else None, prompt_ranked=prompt_ranked,
                         error=seq.error)


def ranked_entry(k: int, token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
                 ) -> dict[int, tuple[float, int]]:
    """One position of RequestOutput.ranked (or prompt_ranked): the token's (logprob, rank), then
    the k most probable tokens' (ranks 1, 2, ...; the token keeps its own entry)."""
    entry = {token: (logprob, rank)}
    for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs), 1):
        entry.setdefault(t, (lp, r))
    return entry


def logits_rows(seq: Sequence, vocab_size: int) -> tuple[np.ndarray, ...]:
    """A processed request's rows of the engines' per-slot logits state (its logit processing,
    `SamplingParams`), from the tokens the host has read (none may be in flight): prompt
    bool[vocab] (in the prompt), counts int32[vocab] (in the output), bias float32[vocab]
    (logit_bias), stops bool[vocab] (the ids min_tokens masks: eos unless ignored, stop_token_ids)."""
    p = seq.params
    generated = seq.tokens[len(seq.prompt):]
    if PENDING in generated:
        raise RuntimeError(f"request {seq.request_id}'s logits state is rebuilt while a token is in flight")
    prompt = np.zeros(vocab_size, bool)
    prompt[seq.prompt] = True
    counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab_size).astype(np.int32)
    bias = np.zeros(vocab_size, np.float32)
    for t, b in (p.logit_bias or {}).items():
        bias[t] = b
    stops = np.zeros(vocab_size, bool)
    ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.eos_token_ids))
    stops[[t for t in ids if 0 <= t < vocab_size]] = True
    return prompt, counts, bias, stops
