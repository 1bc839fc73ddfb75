"""Helpers of the Huginn forward tests of both frameworks (a module, not a test file)."""

import numpy as np

from wise_core import rounding
from wise_core.checkpoint import Checkpoint, load_checkpoint, random_tensors, save_checkpoint
from wise_core.config import PRESETS

TINY = PRESETS["test-tiny-huginn"]


def checkpoint(tmp_path, config=TINY):
    """A random HF-layout Huginn checkpoint written to and read back from tmp_path, its norm
    weights off 1."""
    tensors = random_tensors(config, seed=0, std=0.08)
    rng = np.random.default_rng(1)
    tensors = {k: v + np.float32(0.1) * rng.normal(size=v.shape).astype(np.float32) if "norm" in k else v
               for k, v in tensors.items()}
    save_checkpoint(tmp_path / "ckpt", Checkpoint(config, tensors))
    return load_checkpoint(tmp_path / "ckpt")


def bound(config, num_steps, want, keys):
    """`rounding.network_bound` of a float32 run against the float64 spec over the model's depth
    (prelude + core * steps + coda sublayers) and its longest reduction."""
    depth = config.n_layers_in_prelude + config.n_layers_in_recurrent_block * num_steps + config.n_layers_in_coda
    width = max(2 * config.hidden_size, config.intermediate_size, keys)
    return rounding.network_bound(scale=float(np.abs(want).max()), depth=depth, width=width)
