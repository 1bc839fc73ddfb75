"""Loading models and their tokenizers.

`load_model` returns `(config, params)`, or `(config, params, tokenizer)` with
`with_tokenizer=True`: a model's tokenizer is handed to its caller, never looked up by config
(two checkpoints may share a config and differ in their tokenizers). Pass it to `generate` /
`teacher_force` as `tokenizer=` for string prompts.

A checkpoint directory is checked from its headers first (`wise_core.checkpoint.open_checkpoint`);
then each tensor is read through `safetensors.safe_open` (numpy, BF16 as ml_dtypes.bfloat16)
a block of rows at a time, cast to the target dtype (and transposed, for linear weights) into
the host array of its Params leaf, which then goes to the device (on the CPU backend without a
copy): host memory holds the params and one leaf in assembly, never a tensor's widened copy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from pathlib import Path
from typing import Callable, ContextManager

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from tokenizers import Tokenizer

from wise_core import tokenizer as core_tokenizer
from wise_core.checkpoint import (BUILTIN_MODELS, Checkpoint, CheckpointError, CheckpointFiles, expected_shapes,
                                  load_checkpoint, open_checkpoint, validate_tensors)
from wise_core.model_config import ModelConfig
from wise_jax.huginn import HuginnParams, huginn_from_tensors
from wise_jax.params import LAYER_NAMES, LINEAR_FIELDS, LayerParams, Params, param_shapes

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def model_dtype(dtype) -> jnp.dtype:
    """float32, bfloat16 or float16: as a JAX / numpy dtype or by name (wise_torch.loading takes
    the same names)."""
    try:
        resolved = None if dtype is None or isinstance(dtype, bool) else jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be a floating dtype of {DTYPE_NAMES} (a JAX or numpy dtype or its name), "
                         f"got {dtype!r}")
    return resolved


# A tensor to read: (shape, read(start, stop) -> numpy rows [start, stop)).
Rows = tuple[tuple[int, ...], Callable[[int, int], np.ndarray]]
_BLOCK_ROWS = 256     # rows read at a time (a few hundred KB: stays in cache)
_TRANSPOSE_ROWS = 16  # rows per transposing copy: 5x faster than one strided copy on a CPU
_LOAD_THREADS = min(8, os.cpu_count() or 1)  # threads filling a stacked leaf's layers
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _host_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised 64-byte aligned array, which the CPU backend's device_put adopts
    without a copy (numpy aligns to 16 bytes)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _copy_into(dst: np.ndarray, tensor: Rows, transpose: bool) -> None:
    """dst[...] = tensor (.T when `transpose`), cast to dst's dtype, read a block of rows at a
    time (same dtypes: copied as raw bits)."""
    shape, read = tensor
    if tuple(dst.shape) != (tuple(shape[::-1]) if transpose else tuple(shape)):
        raise ValueError(f"a tensor of shape {tuple(shape)} does not fill an array of shape {dst.shape}")
    for start in range(0, shape[0], _BLOCK_ROWS):
        block = read(start, min(start + _BLOCK_ROWS, shape[0]))
        out = dst
        if block.dtype == dst.dtype:
            block, out = block.view(_UINT[block.dtype.itemsize]), dst.view(_UINT[dst.dtype.itemsize])
        if not transpose:
            out[start:start + len(block)] = block
            continue
        for i in range(0, len(block), _TRANSPOSE_ROWS):
            out[:, start + i:start + i + _TRANSPOSE_ROWS] = block[i:i + _TRANSPOSE_ROWS].T


def params_from_tensors(config: ModelConfig, opened: Callable[[str], ContextManager[Rows]],
                        dtype, *, layers: str = "stacked") -> Params:
    """Params of `dtype` from `opened(hf_name)`, a context holding (shape, read(start, stop))
    (tensors already checked against `config`). Each leaf is assembled on the host in `dtype`
    (linear weights transposed to [in, out], layers stacked), a block of rows at a time, then
    put on the device: whole, or one layer at a time with layers="unstacked" (the layout of
    `params.unstack_layers`)."""
    if layers not in ("stacked", "unstacked"):
        raise ValueError(f"layers must be 'stacked' or 'unstacked', got {layers!r}")
    dtype = np.dtype(dtype)
    shapes, hf_shapes = param_shapes(config), expected_shapes(config)

    def fill(out: np.ndarray, name: str, transpose: bool) -> None:
        with opened(name) as tensor:
            _copy_into(out, tensor, transpose)

    def put(name: str, shape: tuple[int, ...], transpose: bool = False) -> jax.Array:
        out = _host_array(shape, dtype)
        fill(out, name, transpose)
        return jax.device_put(out)

    def stacked(field: str) -> jax.Array | list[jax.Array]:
        out = _host_array(getattr(shapes.layers, field), dtype)

        def layer(n: int) -> None:
            start = 0
            for name in LAYER_NAMES[field]:  # a fused linear field: its parts side by side in [in, out]
                name = f"model.layers.{n}.{name}"
                if field in LINEAR_FIELDS:
                    width = hf_shapes[name][0]
                    fill(out[n, :, start:start + width], name, True)
                    start += width
                else:
                    fill(out[n], name, False)

        # Layers fill disjoint slices; numpy's copies release the GIL, so the transposes run in parallel.
        with concurrent.futures.ThreadPoolExecutor(_LOAD_THREADS) as pool:
            list(pool.map(layer, range(config.num_hidden_layers)))
        if layers == "unstacked":
            return [jax.device_put(out[n]) for n in range(config.num_hidden_layers)]
        return jax.device_put(out)

    leaves = {field: stacked(field) for field in LAYER_NAMES}
    return Params(
        embed_tokens=put("model.embed_tokens.weight", shapes.embed_tokens),
        layers=(LayerParams(**leaves) if layers == "stacked" else
                tuple(LayerParams(**{f: leaves[f][n] for f in LAYER_NAMES}) for n in range(config.num_hidden_layers))),
        norm=put("model.norm.weight", shapes.norm),
        early_exit_gate=put("model.early_exit_gate.weight", shapes.early_exit_gate, transpose=True),
        early_exit_gate_bias=put("model.early_exit_gate.bias", shapes.early_exit_gate_bias),
        lm_head=None if config.tie_word_embeddings else put("lm_head.weight", shapes.lm_head, transpose=True),
    )


def _in_memory(tensors: dict[str, np.ndarray]) -> Callable[[str], ContextManager[Rows]]:
    def opened(name: str) -> ContextManager[Rows]:
        x = np.asarray(tensors[name])
        return contextlib.nullcontext((x.shape, lambda start, stop: x[start:stop]))
    return opened


def from_checkpoint_tensors(config: ModelConfig, tensors: dict[str, np.ndarray],
                            dtype=jnp.float32) -> Params | HuginnParams:
    """HF-named numpy tensors (validated against `config`) -> Params of `dtype`, assembled as
    a checkpoint's are (each leaf filled in place on the host in `dtype`, no float32 widening);
    a Huginn config's -> `huginn.huginn_from_tensors`."""
    if config.architecture == "huginn":
        return huginn_from_tensors(config, tensors, model_dtype(dtype))
    validate_tensors(config, tensors)
    return params_from_tensors(config, _in_memory(tensors), dtype)


def _in_files(found: CheckpointFiles) -> Callable[[str], ContextManager[Rows]]:
    """Each tensor through its own `safe_open` (memory-mapped): closing it unmaps the file's
    pages, so the process never holds more than one tensor's mapped pages besides the params."""
    @contextlib.contextmanager
    def opened(name: str):
        path = found.tensors[name].path
        try:
            with safetensors.safe_open(str(path), framework="numpy") as f:
                rows = f.get_slice(name)
                yield tuple(rows.get_shape()), lambda start, stop: rows[start:stop]
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"{path}: tensor {name!r}: {e}") from None
    return opened


def load_model(path_or_name: str | Path, *, dtype=jnp.float32, with_tokenizer: bool = False,
               layers: str = "stacked"):
    """A checkpoint directory (HF Ouro or Huginn layout) or built-in model name -> (config, params
    of dtype), or (config, params, tokenizer or None) with `with_tokenizer`. layers="unstacked"
    loads the per-layer layout the serving engine decodes with (`params.unstack_layers`), so `LLM`
    makes no second copy of the weights. A Huginn checkpoint gives `wise_jax.huginn.HuginnParams`
    (`huginn.huginn_from_tensors`; `layers` does not apply)."""
    dtype = model_dtype(dtype)
    found = open_checkpoint(path_or_name)
    if found.config.architecture == "huginn":
        found = found if isinstance(found, Checkpoint) else load_checkpoint(path_or_name)
        params = huginn_from_tensors(found.config, found.tensors, dtype)
        return (found.config, params, found.tokenizer) if with_tokenizer else (found.config, params)
    tensors = _in_memory(found.tensors) if isinstance(found, Checkpoint) else _in_files(found)
    if found.config.architecture == "huginn":
        arrays = {}
        for name in found.tensors:
            with tensors(name) as (shape, rows):
                arrays[name] = np.asarray(rows(0, shape[0]))
        params = huginn_from_tensors(found.config, arrays, dtype)
    else:
        params = params_from_tensors(found.config, tensors, dtype, layers=layers)
    return (found.config, params, found.tokenizer) if with_tokenizer else (found.config, params)


def load_tokenizer(path_or_name: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory or built-in model (None when it has none)."""
    name = str(path_or_name)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]().tokenizer
    return core_tokenizer.load_tokenizer(Path(path_or_name))
