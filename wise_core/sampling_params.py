"""What a request asks of both engines (wise_torch.LLM, wise_jax.LLM), framework-free: its
sampling parameters (`SamplingParams`, validated once here), and `LLM.generate`'s prompts paired
with them and queued."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

MAX_SEED = 2 ** 63
MAX_LOGPROBS = 20     # the most alternatives SamplingParams.logprobs asks for (vLLM's default max_logprobs)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request decodes, with vLLM's parameters, meanings and defaults.

    max_tokens: tokens to generate (>= 1; the first comes from prefill); min_tokens: eos and
    stop_token_ids cannot end the request before this many tokens (they are masked out of the
    logits) and stop strings do not stop it before (<= max_tokens). temperature 0 is greedy,
    > 0 samples softmax(logits / temperature) restricted, in this order, to the tokens of
    probability >= min_p x the largest (min_p in [0, 1]; 0: all), to the top_k most probable (0
    or -1: all; ties to the lower id), and to top_p of what is left (the smallest prefix of
    tokens ranked by probability reaching top_p, in (0, 1]); seed: an int in [0, 2**63) makes
    the request's samples reproducible whatever else runs beside it (None: the engine draws
    them: wise_torch from its generator, wise_jax from its seed and the request id);
    ignore_eos: keep going past the model's eos; stop_token_ids: more ids that end the request;
    stop: strings that end it (needs the engine's tokenizer): the text ends before the first one
    found (after it with include_stop_str_in_output), the tokens at the one that completed it,
    stop_reason names it.

    Logits processing, before temperature: logit_bias {token id: bias in [-100, 100]} is added
    to the logits (OpenAI's range; values outside are refused, not clamped) and min_tokens masks
    the stop ids; then repetition_penalty (> 0; 1: none) divides the positive and multiplies
    the negative logits of every token in the prompt or the output so far (vLLM, HF), and
    presence_penalty / frequency_penalty (in [-2, 2]) subtract presence x (count > 0) +
    frequency x count over the output's tokens (OpenAI); then temperature, min_p, top_k, top_p.
    Greedy decoding takes the argmax of the processed logits.

    logprobs: None, or k in [0, MAX_LOGPROBS]: report log p of each generated token (under the
    model's raw logits, before any processing: vLLM's default) with its rank and the k most
    probable tokens (`CompletionOutput.logprobs`); True is taken as 0 and False as None (the
    bool this field was). prompt_logprobs: None, or k in [0, MAX_LOGPROBS]: score the prompt as
    vLLM does (`RequestOutput.prompt_logprobs`): log p of each prompt token after the tokens
    before it (float32 log_softmax of the prefill's raw logits at the position before), with its
    rank and the k most probable tokens there. Such a request takes no cached prefix (automatic
    prefix caching skips no part of its prefill: a cached page's logits were never computed),
    so the scores are those of an engine without the cache; an n > 1 request scores its prompt
    once.

    n: completions of the prompt (vLLM's n): its prompt is prefilled once and the completions
    share its full pages; with a seed, completion i samples as a request with seed + i would.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SamplingParams.{name} must be a positive integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an integer >= -1 (-1 or 0: every token), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], "
                             f"got {self.min_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        logprobs = (0 if self.logprobs else None) if isinstance(self.logprobs, bool) else self.logprobs
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (the top "
                             f"alternatives reported beside the chosen token), got {self.logprobs!r}")
        object.__setattr__(self, "logprobs", None if logprobs is None else int(logprobs))
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (the "
                             f"top alternatives reported beside each prompt token), got {self.prompt_logprobs!r}")
        if self.prompt_logprobs is not None:
            object.__setattr__(self, "prompt_logprobs", int(self.prompt_logprobs))
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(
                    _is_int(t) and t >= 0 and isinstance(b, numbers.Real) and not isinstance(b, bool)
                    and -100.0 <= b <= 100.0 for t, b in bias.items()):
                raise ValueError(f"SamplingParams.logit_bias must be a dict of token ids (integers >= 0) to biases in "
                                 f"[-100, 100], got {bias!r:.200}")
            bias = {int(t): float(b) for t, b in bias.items()} or None
            object.__setattr__(self, "logit_bias", bias)
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or any(
                not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of integer ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a sequence of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        # numpy scalars pass the checks above; the engines get plain Python numbers
        object.__setattr__(self, "n", int(self.n))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "top_k", max(0, int(self.top_k)))     # -1, as vLLM's "all", is 0
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    def completion(self, index: int) -> SamplingParams:
        """The params of completion `index` of an n > 1 request: n 1, seed + index (mod 2**63)."""
        seed = None if self.seed is None else (self.seed + index) % MAX_SEED
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        """Any penalty set: the logits need the request's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processed(self) -> bool:
        """The logits are processed before temperature (a penalty, logit_bias or min_tokens)."""
        return self.penalized or self.logit_bias is not None or self.min_tokens > 0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def prompts_with_params(prompts, params, array_types: tuple[type, ...] = ()) -> list:
    """`LLM.generate`'s arguments checked and paired: prompts one string, one list of token ids,
    or a non-empty list (or tuple) of strings or token-id lists (an array, of `array_types`, is
    refused: pass a list); params one SamplingParams (or None) for all, or a list of one per
    prompt. Returns [(prompt, params)]."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts)):
        prompts = [prompts]                    # one prompt, as vLLM's generate takes it
    if isinstance(prompts, (np.ndarray,) + tuple(array_types)) or not isinstance(prompts, (list, tuple)) \
            or not prompts:
        raise TypeError("prompts must be a string, a token-id list, or a non-empty list of them")
    if isinstance(params, (list, tuple)):
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    else:
        params = [params] * len(prompts)
    return list(zip(prompts, params))


def add_all(engine, pairs: list) -> list[int]:
    """Queue each (prompt, params) of `prompts_with_params` on `engine` (its add_request) ->
    their request ids; when one is refused, the ones this call queued are aborted before the
    error goes on, so nothing of a failed call stays queued."""
    ids = []
    try:
        for prompt, params in pairs:
            ids.append(engine.add_request(prompt, params))
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    return ids
