"""Chat templates: a checkpoint's Jinja template rendered as transformers' apply_chat_template does.

The template is the checkpoint directory's `chat_template.jinja`, else the `chat_template` of
its `tokenizer_config.json` (a string, or a list of named templates of which "default" is
used), or the file `wise serve --chat-template FILE` names. It is rendered in a sandbox with
transformers' settings (trim_blocks, lstrip_blocks, the loopcontrols extension, `tojson`
without ASCII escaping, `raise_exception` and `strftime_now`) from `messages`,
`add_generation_prompt` and the special tokens `bos_token` and `eos_token` (tokenizer_config's
strings, else the tokenizer's tokens for the config's ids).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

from wise_core.checkpoint import BUILTIN_MODELS, PACKAGED_MODELS_DIR

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TemplateError(ValueError):
    """A template that raised (raise_exception) or failed to render: the request's fault (400)."""


def model_directory(model: str) -> Path | None:
    """The checkpoint directory of --model (a directory, or a packaged built-in), None for a
    model built in memory."""
    if Path(model).is_dir():
        return Path(model)
    if model in BUILTIN_MODELS and (PACKAGED_MODELS_DIR / model).is_dir():
        return PACKAGED_MODELS_DIR / model
    return None


def _token_text(value) -> str | None:
    """tokenizer_config's bos_token / eos_token: a string or an added-token object {"content"}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. render(messages) -> the prompt text."""

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None, origin: str):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template is not valid Jinja: {e.message} (line {e.lineno})") \
                from None
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template ({self.origin}) failed on the messages: {e}") from None


def load_chat_template(model: str, override: str | None, *, tokenizer, bos_token_id: int | None,
                       eos_token_id: int | None) -> ChatTemplate | None:
    """The chat template of --model (see the module docstring), or of the file `override`;
    None when the model has none. A file that is missing or not valid Jinja is a ValueError."""
    directory = model_directory(model)
    config = {}
    if directory is not None and (directory / TOKENIZER_CONFIG).is_file():
        path = directory / TOKENIZER_CONFIG
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable JSON file: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ValueError(f"--chat-template {override}: no such file")
        source, origin = path.read_text(encoding="utf-8"), str(path)
    elif directory is not None and (directory / TEMPLATE_FILE).is_file():
        source, origin = (directory / TEMPLATE_FILE).read_text(encoding="utf-8"), str(directory / TEMPLATE_FILE)
    else:
        source, origin = config.get("chat_template"), f"{directory / TOKENIZER_CONFIG if directory else model}"
        if isinstance(source, list):                       # named templates, as transformers saves several
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{origin}: chat_template must be a string or a list of named templates")

    def special(name: str, token_id: int | None) -> str | None:
        text = _token_text(config.get(name))
        if text is None and tokenizer is not None and token_id is not None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    return ChatTemplate(source, bos_token=special("bos_token", bos_token_id),
                        eos_token=special("eos_token", eos_token_id), origin=origin)
