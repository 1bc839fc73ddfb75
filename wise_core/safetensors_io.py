"""Minimal safetensors reader/writer over numpy, with bfloat16 support.

numpy has no bfloat16, so BF16 tensors are read as float32 (exact) and written from float32
with round-to-nearest-even.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_CODES = {np.dtype(v): k for k, v in _NUMPY.items()}


class SafetensorsError(ValueError):
    """A malformed safetensors file."""


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file; BF16 becomes float32."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise SafetensorsError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise SafetensorsError(f"{path}: header length {header_len} exceeds the file size")
    try:
        header = json.loads(data[8:8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object")
    body = memoryview(data)[8 + header_len:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {info!r:.120}") from None
        if end > len(body) or start > end:
            raise SafetensorsError(f"{path}: tensor {name!r} lies outside the file (truncated?)")
        raw = body[start:end]
        if dtype == "BF16":
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            array = bits.view(np.float32)
        elif dtype in _NUMPY:
            array = np.frombuffer(raw, _NUMPY[dtype])
        else:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        count = int(np.prod(shape)) if shape else 1
        if array.size != count:
            raise SafetensorsError(f"{path}: tensor {name!r} holds {array.size} values, shape {shape} needs {count}")
        out[name] = array.reshape(shape).copy()
    return out


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bit patterns, round to nearest even (NaN kept NaN)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], *,
                      bf16: bool = False, metadata: dict[str, str] | None = None) -> None:
    """Write tensors in sorted name order; floating tensors as BF16 when `bf16`."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if bf16 and array.dtype.kind == "f":
            blob, code = float32_to_bf16_bits(array.astype(np.float32)).tobytes(), "BF16"
        else:
            if array.dtype not in _CODES:
                raise SafetensorsError(f"tensor {name!r}: unsupported dtype {array.dtype}")
            blob, code = np.ascontiguousarray(array).tobytes(), _CODES[array.dtype]
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in chunks:
            f.write(blob)
