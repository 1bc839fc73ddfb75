"""Helpers shared by the torch engine tests (a module, not a test file: not collected)."""

import torch


def prompts_of(lengths, vocab, seed=0):
    """Random prompts of the given lengths (token ids below `vocab`), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
