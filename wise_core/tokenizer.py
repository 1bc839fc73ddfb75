"""Tokenizers: `tokenizer.json` through the `tokenizers` library, and the byte-level one wise
ships; prompts as text (`encode_text`) and as token ids (`check_token_ids`, the one check of
token ids a caller gives, in both engines, both `generate`s and the JAX functional paths)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: ids 0-255 are bytes, 256 is <|endoftext|> (bos/eos), 257 <|pad|>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocabulary by byte value.
    byte_chars = _bytes_to_unicode()
    assert sorted(byte_chars.values()) == sorted(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, token in enumerate(BYTE_SPECIAL_TOKENS):
        vocab[token] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The directory's tokenizer.json, or None when it has none."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on malformed files
        raise ValueError(f"{path}: not a readable tokenizer.json: {e}") from None


def encode_text(tokenizer: Tokenizer, text: str, what: str = "prompt") -> list[int]:
    """`tokenizer.encode(text).ids`, with text that is not valid Unicode (a lone surrogate, as
    undecodable bytes in sys.argv become) a ValueError naming `what` and the position."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate {text[e.start]!r} at index {e.start}: not valid "
                         f"Unicode text (decode its bytes with errors='replace' first)") from None
    return tokenizer.encode(text).ids


def check_token_ids(ids, vocab_size: int, what: str) -> list[int]:
    """Token ids a caller gives (a prompt, a forced continuation): a sequence (list, tuple), or a 1-D
    array (numpy, torch, jax: anything with ndim and tolist), of integers -> list[int], each in
    [0, vocab_size). Anything else is an error naming `what`: a TypeError for what is not
    integer ids (bools are not), a ValueError for an array not 1-D, no ids, or ids outside the
    vocabulary (the first five named)."""
    if hasattr(ids, "ndim") and hasattr(ids, "tolist"):
        if ids.ndim != 1:
            raise ValueError(f"{what}'s token ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"{what} must be a string or a sequence of integer token ids, got {ids!r:.80}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} holds token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    return ids
