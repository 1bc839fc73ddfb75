"""The OpenAI completions API as the server speaks it: request validation and response shapes.

`parse_completion` turns a request body into a `CompletionRequest` or raises `BadRequest`
naming the field and the problem. Unknown fields are rejected, not ignored: a misspelt
`max_token` silently falling back to the default would be a silent wrong result. Fields of the
OpenAI API that the engine does not implement (`n`, `best_of`, `logprobs`, penalties,
`logit_bias`, `suffix`, `echo`) are accepted only at their neutral value. Defaults follow the
OpenAI API (max_tokens 16, temperature 1, top_p 1). Extensions (as in vLLM): `top_k` (-1 or 0:
every token), `min_p` (0: off), `ignore_eos`, and `return_token_ids` (each choice and stream
chunk also carries the token ids).

The engine checks what only it knows (prompt length against max_model_len and the pool,
token ids against the vocabulary); its ValueErrors become 400s too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

from wise_core.request import MAX_SEED, SamplingParams

FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
    "echo", "n", "best_of", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "user",
    "ignore_eos", "return_token_ids", "top_k", "min_p"})
MAX_STOP_STRINGS = 4          # as the OpenAI API
DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400). param: the request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """prompt: text or token ids; stop: strings that end the completion (not included in it)."""

    prompt: str | list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _reject_constant(name: str):
    raise BadRequest(f"invalid JSON: {name} is not a JSON number")


def load_json(body: bytes) -> dict:
    """The request body as a JSON object (BadRequest otherwise). NaN and Infinity are refused."""
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]                                   # a batch of one prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, (str, list)) for v in value):
            raise BadRequest(f"prompt holds {len(value)} prompts; the server takes one prompt per request",
                             "prompt")
        bad = [v for v in value if not _is_int(v)]
        if bad:
            raise BadRequest(f"prompt must be a string or a list of integer token ids; it holds {bad[0]!r:.40}",
                             "prompt")
        if not value:
            raise BadRequest("prompt is empty", "prompt")
        return value
    raise BadRequest(f"prompt must be a string or a list of integer token ids, got {type(value).__name__}",
                     "prompt")


NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": "",
           "echo": False, "logprobs": None}


def _neutral(obj: dict) -> None:
    """Fields of the API the engine does not implement, accepted at their neutral value (or null) only."""
    for name, neutral in NEUTRAL.items():
        value = obj.get(name)
        if value is None or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
            continue
        what = "echo (the prompt in the completion)" if name == "echo" else name
        raise BadRequest(f"{what}={json.dumps(value):.40} is not supported by this server", name)


def parse_completion(body: bytes, *, model_name: str, has_tokenizer: bool = True) -> CompletionRequest:
    """Validate a /v1/completions body. model_name: the served model (a request may leave it out)."""
    obj = load_json(body)
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
                         unknown[0])
    model = obj.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"unknown model {model!r:.80}: this server serves {model_name!r}", "model")
    if "prompt" not in obj:
        raise BadRequest("prompt is required", "prompt")
    prompt = _prompt(obj["prompt"])
    if isinstance(prompt, str) and not has_tokenizer:
        raise BadRequest("the model has no tokenizer: send the prompt as a list of token ids", "prompt")
    _neutral(obj)

    max_tokens = obj.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not _is_int(max_tokens) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {json.dumps(max_tokens):.40}", "max_tokens")
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
    flags = {}
    for name in ("stream", "ignore_eos", "return_token_ids"):
        value = obj.get(name)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false, got {json.dumps(value):.40}", name)
        flags[name] = bool(value)
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not flags["stream"]:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(f"stream_options must be an object with the one key include_usage (true or false), "
                             f"got {json.dumps(options):.60}", "stream_options")
        include_usage = options.get("include_usage", False)
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user must be a string, got {json.dumps(user):.40}", "user")
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                            top_k=top_k, min_p=float(min_p), seed=seed, ignore_eos=flags["ignore_eos"])
    return CompletionRequest(prompt, params, tuple(stop), flags["stream"], include_usage,
                             flags["return_token_ids"] or not has_tokenizer)


# -- responses -----------------------------------------------------------------------------------
def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, created: int, model: str, choice: dict, usage_: dict | None) -> dict:
    """A completion (or one stream chunk: usage None, or the usage chunk: no choice)."""
    body = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [] if choice is None else [choice]}
    if usage_ is not None or choice is None:
        body["usage"] = usage_
    return body


def choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    out = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def model_card(name: str, *, max_model_len: int, vocab_size: int, created: int | None = None) -> dict:
    """GET /v1/models entry; max_model_len and vocab_size are extensions (as vLLM's max_model_len)."""
    return {"id": name, "object": "model", "created": int(time.time()) if created is None else created,
            "owned_by": "wise", "max_model_len": max_model_len, "vocab_size": vocab_size}
