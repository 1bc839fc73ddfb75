"""Helpers of the Huginn forward tests of both frameworks (a module, not a test file)."""

import dataclasses

import numpy as np

from wise_core import rounding
from wise_core.checkpoint import Checkpoint, load_checkpoint, random_tensors, save_checkpoint
from wise_core.huginn_reference import HuginnCache, huginn_forward
from wise_core.presets import PRESETS
from wise_core.selection import TopK
from wise_core.wise_config import WiseConfig

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


# -- WISE decode over core iterations -------------------------------------------------------------
STEPS = 4
WISE = WiseConfig(block_size=16, eta=0.8, discover_depths=(0, 1), reuse_depths=(3,))
"""Discovery on iterations 0 and 1, iteration 2 dense, reuse on 3; 16-key blocks and eta 0.8 so a
random tiny model's supports leave blocks out of 4 to 6 causal ones."""
TOP2 = dataclasses.replace(WISE, selection=TopK(2))
PROMPT_LENS, NEW_TOKENS, SEED = (66, 77), 8, 5


def prompts(config=TINY):
    rng = np.random.default_rng(11)
    return [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENS]


def reference_generate(config, weights, prompt, wise, adaptive=None, depths=None):
    """Greedy tokens of the float64 spec: a dense prefill of `prompt`, then NEW_TOKENS decode steps
    (`huginn_forward(..., wise=wise, adaptive=adaptive)`, one token a call), STEPS iterations,
    initial state SEED. depths, if given, gets the iterations each decode step ran."""
    cache = HuginnCache()
    logits = huginn_forward(config, weights, prompt, num_steps=STEPS, cache=cache, seed=SEED)[-1]
    tokens = []
    for _ in range(NEW_TOKENS):
        tokens.append(int(np.argmax(logits)))
        logits = huginn_forward(config, weights, tokens[-1:], num_steps=STEPS, cache=cache, seed=SEED, wise=wise,
                                adaptive=adaptive)[0]
    if depths is not None:
        depths += cache.depths[len(prompt):]
    return tokens
