"""Tokenizers: `tokenizer.json` through the `tokenizers` library, and the byte-level one wise ships."""

from __future__ import annotations

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
