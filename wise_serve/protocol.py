"""The OpenAI API as the server speaks it: request validation and response shapes.

`parse_completion` (/v1/completions), `parse_chat` (/v1/chat/completions), `parse_tokenize` and
`parse_detokenize` (vLLM's /tokenize and /detokenize) turn a request body into a request object
or raise `BadRequest` naming the field and the problem. Unknown fields are rejected, not
ignored: a misspelt `max_token` silently falling back to the default would be a silent wrong
result. Out-of-range values are refused, never clamped. Defaults follow the OpenAI API
(completions: max_tokens 16; chat: what max_model_len leaves after the prompt, as vLLM;
temperature 1, top_p 1).

The OpenAI fields map onto the engine's SamplingParams: `n` (completions of each prompt, in
[1, 128]: one engine request whose prompt is prefilled once; with a seed, completion i samples
as seed + i; choice index = prompt index x n + completion index), `presence_penalty` and
`frequency_penalty` (in [-2, 2]), `logit_bias` ({token id as a string: bias in [-100, 100]},
ids checked against the vocabulary), completions' `logprobs: k` and chat's `top_logprobs: k`
(k in [0, 20]: the chosen token's log probability, under the model's raw logits, with the k
most probable tokens'). `best_of` is accepted only equal to `n` (every completion made is
returned: none is chosen over another), `suffix` only empty (the model does not fill in the
middle). `echo` with `logprobs: k` scores the prompt too (SamplingParams.prompt_logprobs k): its
tokens' logprobs precede the completion's, the first token's null (the OpenAI legacy
completions shape, as vLLM). Extensions
(as in vLLM): `top_k` (-1 or 0: every token), `min_p` (0: off), `ignore_eos`,
`repetition_penalty` (> 0; 1: none), `min_tokens` (no eos, stop id or stop string ends a
completion before), `include_stop_str_in_output`, and `return_token_ids` (each choice and
stream chunk also carries the token ids).

The engine checks what only it knows (prompt length against max_model_len and the pool,
token ids against the vocabulary); its ValueErrors become 400s too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

from wise_core.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos", "return_token_ids", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "include_stop_str_in_output"})
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "top_logprobs", "max_completion_tokens"}
MAX_STOP_STRINGS = 4          # as the OpenAI API
DEFAULT_MAX_TOKENS = 16       # completions; chat's default is what max_model_len leaves
MAX_TOP_LOGPROBS = MAX_LOGPROBS   # chat's top_logprobs range in the OpenAI API; completions' logprobs as vLLM
MAX_N = 128                   # the OpenAI API's range of n
MAX_PENALTY = 2.0             # presence and frequency penalties: [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0        # logit_bias values: [-100, 100] (OpenAI)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400). param: the request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Generation:
    """What completions and chat share. sampling: SamplingParams' fields but max_tokens, stop, logprobs;
    max_tokens None: what max_model_len leaves after the prompt (chat); stop: strings that end
    the text (not included in it, unless sampling's include_stop_str_in_output); logprobs: None,
    or k: report each generated token's log probability with the k most probable tokens';
    prompt_logprobs: the same of the prompt's tokens (completions' echo with logprobs), or None."""

    sampling: dict
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None
    prompt_logprobs: int | None = None

    @property
    def n(self) -> int:
        return self.sampling["n"]

    def params(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The engine's SamplingParams for a prompt of `prompt_tokens` tokens."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_tokens
            if max_tokens < 1:
                raise BadRequest(f"the prompt holds {prompt_tokens} tokens: max_model_len ({max_model_len}) leaves "
                                 f"no room for a completion", "messages")
        if self.sampling["min_tokens"] > max_tokens:
            raise BadRequest(f"min_tokens ({self.sampling['min_tokens']}) is more than max_tokens ({max_tokens})",
                             "min_tokens")
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                              stop=self.stop, **self.sampling)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """prompts: each a text or token ids (one choice each, in order); echo: the prompt's text
    starts each choice's text."""

    prompts: list[str | list[int]]
    echo: bool
    generation: Generation


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """messages: [{"role", "content": str, "name"?}], content parts joined as text."""

    messages: list[dict]
    generation: Generation


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """Either prompt (a text) or messages (through the chat template); add_special_tokens: the
    tokenizer's post-processing (default: true for a prompt, false for messages, as vLLM)."""

    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _reject_constant(name: str):
    raise BadRequest(f"invalid JSON: {name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's members -> the dict; a key given twice is refused (json keeps the last silently)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise BadRequest(f"invalid JSON: the key {key!r:.40} appears twice in one object", key)
        obj[key] = value
    return obj


def load_json(body: bytes) -> dict:
    """The request body as a JSON object (BadRequest otherwise). NaN and Infinity are refused, and
    a key given twice in one object."""
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _known(obj: dict, fields: frozenset, model_name: str) -> None:
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                         unknown[0])
    model = obj.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"unknown model {model!r:.80}: this server serves {model_name!r}", "model")


def _token_ids(value, what: str) -> list[int]:
    bad = [v for v in value if not _is_int(v)]
    if bad:
        raise BadRequest(f"{what} must be a string or a list of integer token ids; it holds {bad[0]!r:.40}", what)
    if not value:
        raise BadRequest(f"{what} is empty", what)
    return value


def _prompts(value) -> list[str | list[int]]:
    """A prompt (a string or token ids) or a list of them -> the list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        prompts = [v if isinstance(v, str) else _token_ids(v, "prompt") for v in value]
        for p in prompts:
            if p == "":
                raise BadRequest("prompt is empty", "prompt")
        return prompts
    if isinstance(value, list):
        return [_token_ids(value, "prompt")]
    raise BadRequest(f"prompt must be a string, a list of integer token ids, or a list of either, got "
                     f"{type(value).__name__}", "prompt")


NEUTRAL = {"suffix": ""}
WHY = {"suffix": "the model does not fill in the middle"}


def _neutral(obj: dict) -> None:
    """Fields of the API the engine does not implement, accepted at their neutral value (or null) only."""
    for name, neutral in NEUTRAL.items():
        value = obj.get(name)
        if value is None or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
            continue
        raise BadRequest(f"{name}={json.dumps(value):.40} is not supported by this server ({WHY[name]})", name)


def _number(obj: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    """A number field in [low, high] ((low, high] with open_low), default when absent or null."""
    value = obj.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (low < value if open_low else low <= value) or not value <= high:
        where = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise BadRequest(f"{name} must be a number in {where}, got {json.dumps(value):.40}", name)
    return float(value)


def _n(obj: dict) -> int:
    n = obj.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer in [1, {MAX_N}], got {json.dumps(n):.40}", "n")
    best_of = obj.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):
        raise BadRequest(f"best_of={json.dumps(best_of):.40} is not supported by this server (it returns every "
                         f"completion it makes, none chosen over another: best_of must equal n ({n}) or be left "
                         f"out)", "best_of")
    return n


def _logit_bias(obj: dict, vocab_size: int | None) -> dict[int, float] | None:
    """{"token id": bias} -> {id: bias}; ids in the vocabulary (when vocab_size is given), biases in [-100, 100]."""
    value = obj.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"logit_bias must be an object of token ids (strings) to biases, got "
                         f"{json.dumps(value):.40}", "logit_bias")
    bias = {}
    for key, b in value.items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(f"logit_bias keys must be token ids (decimal integers >= 0), got {key!r:.40}",
                             "logit_bias")
        if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias[{key!r:.20}] must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {json.dumps(b):.40}", "logit_bias")
        if int(key) in bias:
            twin = next(k for k in value if k != key and int(k) == int(key))
            raise BadRequest(f"logit_bias keys {twin!r:.20} and {key!r:.20} name the same token id {int(key)}",
                             "logit_bias")
        bias[int(key)] = float(b)
    bad = sorted(t for t in bias if vocab_size is not None and t >= vocab_size)
    if bad:
        raise BadRequest(f"logit_bias names token ids {bad[:5]} outside the vocabulary (size {vocab_size})",
                         "logit_bias")
    return bias or None


def _flag(obj: dict, name: str, default: bool = False) -> bool:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {json.dumps(value):.40}", name)
    return default if value is None else value


def _max_tokens(obj: dict, name: str) -> int | None:
    value = obj.get(name)
    if value is not None and (not _is_int(value) or value <= 0):
        raise BadRequest(f"{name} must be a positive integer, got {json.dumps(value):.40}", name)
    return value


def _generation(obj: dict, *, has_tokenizer: bool, logprobs: int | None, max_tokens: int | None,
                vocab_size: int | None) -> Generation:
    """The sampling fields both endpoints take (the logprobs fields are each endpoint's own)."""
    _neutral(obj)
    n = _n(obj)
    temperature = obj.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"temperature must be a number >= 0, got {json.dumps(temperature):.40}", "temperature")
    top_p = obj.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be a number in (0, 1], got {json.dumps(top_p):.40}", "top_p")
    top_k = obj.get("top_k")
    top_k = 0 if top_k is None else top_k
    if not _is_int(top_k) or top_k < -1:
        raise BadRequest(f"top_k must be an integer >= -1 (-1 or 0: every token), got {json.dumps(top_k):.40}",
                         "top_k")
    min_p = obj.get("min_p")
    min_p = 0.0 if min_p is None else min_p
    if not _is_number(min_p) or not 0 <= min_p <= 1:
        raise BadRequest(f"min_p must be a number in [0, 1], got {json.dumps(min_p):.40}", "min_p")
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
        raise BadRequest(f"seed must be an integer in [0, 2**63), got {json.dumps(seed):.40}", "seed")
    stop = obj.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of non-empty strings, got "
                         f"{json.dumps(obj.get('stop')):.60}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop holds {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed", "stop")
    if stop and not has_tokenizer:
        raise BadRequest("stop strings need a tokenizer and the model has none", "stop")
    stream = _flag(obj, "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(f"stream_options must be an object with the one key include_usage (true or false), "
                             f"got {json.dumps(options):.60}", "stream_options")
        include_usage = options.get("include_usage", False)
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user must be a string, got {json.dumps(user):.40}", "user")
    min_tokens = obj.get("min_tokens")
    min_tokens = 0 if min_tokens is None else min_tokens
    if not _is_int(min_tokens) or min_tokens < 0:
        raise BadRequest(f"min_tokens must be an integer >= 0, got {json.dumps(min_tokens):.40}", "min_tokens")
    sampling = dict(n=n, temperature=float(temperature), top_p=float(top_p), top_k=top_k, min_p=float(min_p),
                    seed=seed, ignore_eos=_flag(obj, "ignore_eos"),
                    presence_penalty=_number(obj, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                    frequency_penalty=_number(obj, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                    repetition_penalty=_number(obj, "repetition_penalty", 1.0, 0.0, math.inf, open_low=True),
                    logit_bias=_logit_bias(obj, vocab_size), min_tokens=min_tokens,
                    include_stop_str_in_output=_flag(obj, "include_stop_str_in_output"))
    return Generation(sampling, max_tokens, tuple(stop), stream, include_usage,
                      _flag(obj, "return_token_ids") or not has_tokenizer, logprobs)


def parse_completion(body: bytes, *, model_name: str, has_tokenizer: bool = True,
                     vocab_size: int | None = None) -> CompletionRequest:
    """Validate a /v1/completions body. model_name: the served model (a request may leave it out);
    vocab_size: logit_bias ids are checked against it (None: not checked here)."""
    obj = load_json(body)
    _known(obj, COMPLETION_FIELDS, model_name)
    if "prompt" not in obj:
        raise BadRequest("prompt is required", "prompt")
    prompts = _prompts(obj["prompt"])
    if not has_tokenizer and any(isinstance(p, str) for p in prompts):
        raise BadRequest("the model has no tokenizer: send the prompt as a list of token ids", "prompt")
    logprobs = obj.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the most probable tokens listed "
                         f"beside the chosen one), got {json.dumps(logprobs):.40}", "logprobs")
    echo = _flag(obj, "echo")
    if echo and not has_tokenizer:
        raise BadRequest("echo needs a tokenizer (the prompt's text) and the model has none", "echo")
    max_tokens = _max_tokens(obj, "max_tokens")
    generation = _generation(obj, has_tokenizer=has_tokenizer, logprobs=logprobs,
                             max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                             vocab_size=vocab_size)
    if echo and logprobs is not None:
        generation = dataclasses.replace(generation, prompt_logprobs=logprobs)
    return CompletionRequest(prompts, echo, generation)


def _content(value, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines, as vLLM)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}.content[{k}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                                 f"{json.dumps(kind):.40} parts are not supported (the model reads text only)",
                                 "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRequest(f"{where}.content must be a string or a non-empty list of text parts, got "
                     f"{json.dumps(value):.40}", "messages")


def parse_messages(value) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content", "name"?}] for the chat template."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"messages must be a non-empty list of messages, got {json.dumps(value):.40}", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with role and content, got {json.dumps(m):.40}", "messages")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise BadRequest(f"{where} has unknown field {unknown[0]!r} (a message takes role, content, name)",
                             "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got "
                             f"{json.dumps(role):.40}", "messages")
        if "content" not in m:
            raise BadRequest(f"{where}.content is required", "messages")
        message = {"role": role, "content": _content(m["content"], where)}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise BadRequest(f"{where}.name must be a string, got {json.dumps(m['name']):.40}", "messages")
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_chat(body: bytes, *, model_name: str, vocab_size: int | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body (vocab_size: as parse_completion's)."""
    obj = load_json(body)
    _known(obj, CHAT_FIELDS, model_name)
    if "messages" not in obj:
        raise BadRequest("messages is required", "messages")
    messages = parse_messages(obj["messages"])
    logprobs = _flag(obj, "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{json.dumps(top):.40}", "top_logprobs")
        if not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens, max_completion = _max_tokens(obj, "max_tokens"), _max_tokens(obj, "max_completion_tokens")
    if max_tokens is not None and max_completion is not None:
        raise BadRequest("give max_completion_tokens or max_tokens (its old name), not both", "max_tokens")
    return ChatRequest(messages, _generation(obj, has_tokenizer=True, logprobs=(top or 0) if logprobs else None,
                                             max_tokens=max_completion if max_tokens is None else max_tokens,
                                             vocab_size=vocab_size))


def parse_tokenize(body: bytes, *, model_name: str) -> TokenizeRequest:
    """Validate a /tokenize body: {"prompt": str} or {"messages": [...]}, as vLLM's."""
    obj = load_json(body)
    _known(obj, frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs"}), model_name)
    if ("prompt" in obj) == ("messages" in obj):
        raise BadRequest("give either prompt (a text) or messages (a chat), not both or neither", "prompt")
    prompt = obj.get("prompt")
    if "prompt" in obj and not isinstance(prompt, str):
        raise BadRequest(f"prompt must be a string, got {json.dumps(prompt):.40}", "prompt")
    messages = parse_messages(obj["messages"]) if "messages" in obj else None
    if messages is None and "add_generation_prompt" in obj:
        raise BadRequest("add_generation_prompt applies to messages only", "add_generation_prompt")
    return TokenizeRequest(prompt, messages, _flag(obj, "add_special_tokens", default=messages is None),
                           _flag(obj, "add_generation_prompt", default=True), _flag(obj, "return_token_strs"))


def parse_detokenize(body: bytes, *, model_name: str, vocab_size: int) -> list[int]:
    """Validate a /detokenize body {"tokens": [ids]} -> the ids."""
    obj = load_json(body)
    _known(obj, frozenset({"model", "tokens"}), model_name)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise BadRequest(f"tokens must be a list of integer token ids, got {json.dumps(tokens):.40}", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"tokens holds ids {bad[:5]} outside the vocabulary (size {vocab_size})", "tokens")
    return tokens


# -- responses -----------------------------------------------------------------------------------
def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def new_id(prefix: str) -> str:
    """A request id: "cmpl" (completions), "chatcmpl" (chat), "req" (other routes)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, created: int, model: str, choices: list[dict], usage_: dict | None, *,
                    chat: bool = False, chunk: bool = False) -> dict:
    """A completion, or one stream chunk (chunk: usage only when given, as the usage chunk has
    no choice). object: text_completion, chat.completion or chat.completion.chunk."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": cid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
           logprobs: dict | None = None) -> dict:
    """One completions choice (or its stream delta)."""
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_choice(index: int, message: dict, finish_reason: str | None, token_ids: list[int] | None = None,
                logprobs: dict | None = None, *, delta: bool = False) -> dict:
    """One chat choice: message {"role", "content"}, or in a stream chunk its delta."""
    out = {"index": index, "delta" if delta else "message": message, "logprobs": logprobs,
           "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offset: int,
                        top: list[list[tuple[str, float]] | None]) -> dict:
    """Completions' logprobs object for tokens whose text starts at character `offset`:
    text_offset counts the characters of the tokens before (as vLLM); top: per token
    [(text, logprob)], the chosen token then the k most probable (as vLLM: k + 1 entries, or k
    when the chosen is among them; tokens of the same text share one entry). An echoed prompt's
    first token has no logprob: None in logprobs and top (null)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [None if entry is None else dict(entry) for entry in top], "text_offset": offsets}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: list[str], logprobs: list[float], top: list[list[tuple[str, float]]]) -> dict:
    """Chat's logprobs object: one entry per token; top: per token the k most probable
    [(text, logprob)], most probable first."""
    return {"content": [{"token": t, "logprob": lp, "bytes": _bytes(t),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": _bytes(a)} for a, alp in entry]}
                        for t, lp, entry in zip(tokens, logprobs, top)]}


def model_card(name: str, *, max_model_len: int, vocab_size: int, created: int | None = None) -> dict:
    """GET /v1/models entry; max_model_len and vocab_size are extensions (as vLLM's max_model_len)."""
    return {"id": name, "object": "model", "created": int(time.time()) if created is None else created,
            "owned_by": "wise", "max_model_len": max_model_len, "vocab_size": vocab_size}
