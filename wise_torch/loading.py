"""Building an eval-mode OuroForCausalLM (or, for a Huginn config, a HuginnForCausalLM) from a
checkpoint directory, a built-in model or numpy tensors. A directory is checked from its headers
first (`wise_core.checkpoint.open_checkpoint`), then each tensor is read memory-mapped by `safetensors.safe_open` onto the device and cast to
the model's dtype there, one tensor at a time. The parts of a fused weight (q/k/v, gate/up) are
read each through its own mapping, which is released once the fused weight is made, so their
file pages do not stay resident beside it: host memory stays near one copy of the model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import safetensors
import torch

from wise_core.checkpoint import (Checkpoint, CheckpointError, expected_shapes, load_checkpoint, open_checkpoint,
                                  validate_tensors)
from wise_core.model_config import ModelConfig
from wise_torch.huginn import HuginnForCausalLM, huginn_from_tensors
from wise_torch.model import OuroForCausalLM, fused_groups, fused_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(dtype) -> torch.dtype:
    """float32, bfloat16 or float16: as a torch dtype or by name (wise_jax.loading takes the
    same names)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be a floating dtype of {tuple(DTYPES)} (a torch dtype or its name), "
                     f"got {dtype!r}")


def _assemble(config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer) -> OuroForCausalLM:
    """The model with HF-named `weights` (every checkpoint tensor the model holds, already on its
    device and dtype; q/k/v and gate/up are fused here)."""
    with torch.device("meta"):
        model = OuroForCausalLM(config, tokenizer=tokenizer)
    model.load_state_dict(fused_state_dict(weights), strict=True, assign=True)
    model.build_rope_table()
    return model.requires_grad_(False).eval()


def _state_names(config: ModelConfig) -> set[str]:
    """The checkpoint names the model holds (all but a tied checkpoint's lm_head)."""
    return set(expected_shapes(config))


def _as_tensor(array) -> torch.Tensor:
    """A torch tensor as it is (on any device), or a torch view of a numpy array (ml_dtypes
    bfloat16 through its bits)."""
    if isinstance(array, torch.Tensor):
        return array
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], *, tokenizer=None,
                 dtype=torch.float32, device: torch.device | str = "cpu") -> OuroForCausalLM | HuginnForCausalLM:
    """An eval-mode model from HF-named numpy arrays or torch tensors (validated against `config`)."""
    dtype = model_dtype(dtype)
    if config.architecture == "huginn":
        return huginn_from_tensors(config, {name: _as_tensor(array) for name, array in tensors.items()},
                                   tokenizer=tokenizer, dtype=dtype, device=device)
    validate_tensors(config, tensors)
    names = _state_names(config)  # a tied checkpoint may carry lm_head.weight; the model has none
    weights = {name: _as_tensor(array).to(device=device, dtype=dtype)
               for name, array in tensors.items() if name in names}
    return _assemble(config, weights, tokenizer)


def load_model(path_or_name: str | Path, *, dtype=torch.float32,
               device: torch.device | str = "cpu") -> OuroForCausalLM | HuginnForCausalLM:
    """A checkpoint directory or built-in model name (wise_core.checkpoint) as an eval-mode model:
    an OuroForCausalLM, or a HuginnForCausalLM for a Huginn checkpoint (its tensors read into host
    memory first, `wise_torch.huginn.huginn_from_tensors`)."""
    dtype = model_dtype(dtype)
    device = torch.device(device)
    found = open_checkpoint(path_or_name)
    if found.config.architecture == "huginn":
        found = found if isinstance(found, Checkpoint) else load_checkpoint(path_or_name)
        return huginn_from_tensors(found.config, found.tensors, tokenizer=found.tokenizer, dtype=dtype, device=device)
    if isinstance(found, Checkpoint):
        return from_tensors(found.config, found.tensors, tokenizer=found.tokenizer, dtype=dtype, device=device)

    def read(path, names_in_file):
        try:
            with safetensors.safe_open(str(path), framework="pt", device=str(device)) as f:
                return {name: f.get_tensor(name).to(dtype=dtype) for name in names_in_file}
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"{path}: {e}") from None

    if found.config.architecture == "huginn":   # no fused weights to assemble from parts
        weights = {name: t for path, held in found.by_file().items() for name, t in read(path, held).items()}
        return huginn_from_tensors(found.config, weights, tokenizer=found.tokenizer, dtype=dtype, device=device)
    names = _state_names(found.config)
    path_of = {name: path for path, held in found.by_file().items() for name in held if name in names}
    groups = fused_groups(path_of).values()
    parts = {name for group in groups for name in group}
    weights: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(path_of.values()):   # memory-mapped: pages become resident on first use
        weights.update(read(path, [n for n, p in path_of.items() if p == path and n not in parts]))
    for group in groups:   # each part through its own mapping, released once its fused weight is made
        weights.update(fused_state_dict({name: read(path_of[name], [name])[name] for name in group}))
    return _assemble(found.config, weights, found.tokenizer)
