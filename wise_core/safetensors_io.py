"""safetensors files: headers checked here, data read and written by the `safetensors` package.

`read_header` parses and checks a file's header without reading any tensor data, so a
malformed file is a SafetensorsError naming the file and the tensor; `read_tensors` and the
frameworks' loaders then read the data through `safetensors.safe_open` (memory-mapped). numpy
has no bfloat16 of its own: BF16 tensors are `ml_dtypes.bfloat16` arrays, exactly as stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
          "BOOL": np.dtype(np.bool_)}
FLOAT_DTYPES = frozenset(DTYPES[code] for code in ("F64", "F32", "F16", "BF16"))
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's limit


class SafetensorsError(ValueError):
    """A malformed safetensors file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, name, dtype and shape (from the header alone)."""

    path: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of one file, in offset order. Raises SafetensorsError naming the file and
    tensor for: a short file, a header that is not a JSON object, an entry without a known
    dtype, a shape of non-negative integers or two integer data offsets, a size that does not
    match the shape, data outside the file, overlapping or non-contiguous data."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise SafetensorsError(f"{path}: header length {header_len} exceeds the file size ({size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object")
    body = size - 8 - header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where} has a malformed header entry {info!r:.120} "
                                   f"(needs exactly dtype, shape and data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorsError(f"{where} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where} has shape {shape!r:.80}; a shape is a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{where} has data_offsets {offsets!r:.80}; they are two integers "
                                   f"0 <= start <= end")
        start, end = offsets
        if end > body:
            raise SafetensorsError(f"{where} lies outside the file (bytes {start}-{end} of a {body}-byte "
                                   f"data section: truncated?)")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - start != nbytes:
            raise SafetensorsError(f"{where} holds {end - start} bytes, its shape {shape} of {dtype} needs {nbytes}")
        entries.append((start, end, name, TensorInfo(path, name, DTYPES[dtype], tuple(shape))))
    entries.sort(key=lambda e: (e[0], e[1]))
    position, previous = 0, None
    for start, end, name, _ in entries:
        if start < position:
            raise SafetensorsError(f"{path}: tensor {name!r} (bytes {start}-{end}) overlaps tensor {previous!r}")
        if start > position:
            raise SafetensorsError(f"{path}: {start - position} unused bytes before tensor {name!r} "
                                   f"(tensors must be contiguous)")
        position, previous = end, name
    if position != body:
        raise SafetensorsError(f"{path}: {body - position} bytes after the last tensor are not described "
                               f"by the header")
    return {name: info for _, _, name, info in entries}


def read_tensors(path: str | Path, names=None) -> dict[str, np.ndarray]:
    """Tensors of one file (all, or `names`) as numpy arrays in their stored dtypes, after
    `read_header` has checked the file."""
    infos = read_header(path)
    names = list(infos) if names is None else list(names)
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in names}
    except safetensors.SafetensorError as e:
        raise SafetensorsError(f"{path}: {e}") from None


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray], *, bf16: bool = False,
                  metadata: dict[str, str] | None = None) -> None:
    """Write numpy tensors; floating ones as BF16 (rounded to nearest even) when `bf16`."""
    arrays = {}
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype not in DTYPES.values():
            raise SafetensorsError(f"tensor {name!r}: unsupported dtype {array.dtype}")
        if bf16 and array.dtype in FLOAT_DTYPES:
            array = array.astype(ml_dtypes.bfloat16)
        arrays[name] = np.ascontiguousarray(array)
    safetensors.numpy.save_file(arrays, str(path), metadata=dict(metadata or {"format": "pt"}))
