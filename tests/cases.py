"""Inputs shared by the test modules of every package (tests/ is on the test path)."""

import numpy as np


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths (token ids below `vocab`), seeded."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]
