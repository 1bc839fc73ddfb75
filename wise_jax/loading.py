"""Loading models and their tokenizers.

`load_model` returns `(config, params)`; the checkpoint's tokenizer is kept in a registry keyed
by that config (configs are frozen, hashable dataclasses), so `generate` accepts strings for a
loaded model without being handed the tokenizer. Two checkpoints with identical configs share an
entry: the last one loaded wins; pass `tokenizer=` to `generate` to be explicit.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from tokenizers import Tokenizer

from wise_core import tokenizer as core_tokenizer
from wise_core.checkpoint import BUILTIN_MODELS, load_checkpoint
from wise_core.config import ModelConfig
from wise_jax.params import Params, from_checkpoint_tensors

_TOKENIZERS: dict[ModelConfig, Tokenizer] = {}


def load_model(path_or_name: str | Path, *, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    """A checkpoint directory (HF Ouro layout) or built-in model name -> (config, params of dtype).
    Registers the checkpoint's tokenizer for `config` (see `tokenizer_for`)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    checkpoint = load_checkpoint(path_or_name)
    params = from_checkpoint_tensors(checkpoint.config, checkpoint.tensors, dtype)
    if checkpoint.tokenizer is not None:
        register_tokenizer(checkpoint.config, checkpoint.tokenizer)
    return checkpoint.config, params


def load_tokenizer(path_or_name: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory or built-in model (None when it has none)."""
    name = str(path_or_name)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]().tokenizer
    return core_tokenizer.load_tokenizer(Path(path_or_name))


def register_tokenizer(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Make `tokenizer` the one `generate` uses for `config`."""
    _TOKENIZERS[config] = tokenizer


def tokenizer_for(config: ModelConfig) -> Tokenizer | None:
    """The tokenizer registered for `config`, or None."""
    return _TOKENIZERS.get(config)
