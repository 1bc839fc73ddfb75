"""The Python standard library's own source as an offline corpus, byte-tokenized.

Files are the `*.py` under `sysconfig.get_paths()["stdlib"]` (third-party `site-packages` /
`dist-packages` excluded). A file is held out when the SHA-256 of its path relative to the
stdlib root (POSIX form) falls in the lowest `fraction` of the hash range, so a path lands on
the same side on every machine and Python version. Token ids are those of
`wise_core.tokenizer.byte_tokenizer`: id = byte value, 256 = <|endoftext|> (bos/eos).
A stream is the files in sorted path order, each preceded by <|endoftext|>.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

EOT = 256  # <|endoftext|> of the byte tokenizer
HELD_OUT_FRACTION = 0.1
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Sorted POSIX paths (relative to `root`) of the stdlib's `*.py` files."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {root} does not exist")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            paths.append(rel.as_posix())
    return sorted(paths)


def is_held_out(rel_path: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """True when the file at `rel_path` (POSIX, relative to the stdlib root) is held out."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1], got {fraction}")
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split_files(paths: list[str], fraction: float = HELD_OUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train, held_out) lists, each in the input order."""
    held = [p for p in paths if is_held_out(p, fraction)]
    train = [p for p in paths if not is_held_out(p, fraction)]
    return train, held


def token_stream(paths: list[str], root: Path | None = None, tokenizer: Tokenizer | None = None,
                 separator: int | None = EOT) -> np.ndarray:
    """int64[n_tokens]: each file's tokens preceded by `separator` (none when None), in order.

    Without a tokenizer the tokens are the file's bytes (the byte tokenizer's ids, exact for any
    encoding); with one, the file decoded as UTF-8 (invalid bytes replaced) and encoded by it.
    """
    root = stdlib_root() if root is None else Path(root)
    if not paths:
        raise ValueError("token_stream needs at least one file")
    parts = []
    for rel in paths:
        if separator is not None:
            parts.append(np.array([separator], np.int64))
        data = (root / rel).read_bytes()
        if tokenizer is None:
            parts.append(np.frombuffer(data, np.uint8).astype(np.int64))
        else:
            parts.append(np.array(tokenizer.encode(data.decode("utf-8", "replace")).ids, np.int64))
    return np.concatenate(parts)


def sample_contexts(stream: np.ndarray, n: int, min_len: int, max_len: int, continuation: int,
                    seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """`n` (context, continuation) token-id pairs cut from `stream` at seeded random offsets.

    Context lengths are uniform in [min_len, max_len]; the continuation (`continuation` tokens)
    follows the context in the stream.
    """
    if not 0 < min_len <= max_len:
        raise ValueError(f"need 0 < min_len <= max_len, got {min_len}, {max_len}")
    if max_len + continuation > len(stream):
        raise ValueError(f"stream of {len(stream)} tokens is shorter than a context of {max_len} "
                         f"plus a continuation of {continuation}")
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        start = int(rng.integers(0, len(stream) - length - continuation + 1))
        window = stream[start:start + length + continuation].tolist()
        pairs.append((window[:length], window[length:]))
    return pairs
