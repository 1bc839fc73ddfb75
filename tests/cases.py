"""Inputs shared by the test modules of every package (tests/ is on the test path)."""

import numpy as np


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths (token ids below `vocab`), seeded."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def held_slots(page_table, seq_lens, num_pages: int, page_size: int) -> np.ndarray:
    """bool[num_pages, page_size]: the slots holding one of a row's keys (row b's first
    seq_lens[b] keys, through its page_table row). The others are what a reused page's slots past
    its holder's keys may hold: a test puts NaN there."""
    held = np.zeros((num_pages, page_size), bool)
    for pages, n in zip(np.asarray(page_table).tolist(), np.asarray(seq_lens).tolist()):
        for i, page in enumerate(pages):
            held[page, :max(0, min(page_size, n - i * page_size))] = True
    return held
