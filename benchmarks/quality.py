"""WISE against dense decode: quality metrics on held-out text, and QA F1/EM."""

from __future__ import annotations

import numpy as np


def paired_bootstrap(a, b, *, n_resamples: int = 10_000, confidence: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of the paired differences a - b and its percentile bootstrap interval.

    a, b: [n] per-sample values of two systems on the same samples.
    Returns (mean, low, high), the interval at `confidence`.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"paired samples must be 1-D of the same length, got {a.shape} and {b.shape}")
    d = a - b
    if d.size == 0:
        raise ValueError("paired_bootstrap needs at least one sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    chunk = max(1, 2_000_000 // d.size)  # bound the index matrix to ~16 MB
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        means[start:stop] = d[rng.integers(0, d.size, (stop - start, d.size))].mean(1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(d.mean()), float(low), float(high)
