"""What a decode arm (dense, or a WiseConfig with any selection rule) does to held-out text, in
numbers, whichever framework decoded it: `Arm` holds one arm's per-context results and derives
bits per byte with a bootstrap interval, the NLL difference against dense with a paired
bootstrap interval, greedy tokens changed and greedy prefix agreement against dense. The
statistics (`paired_bootstrap`, `ratio_bootstrap`, `common_prefix`) are plain numpy.
`wise_jax.evaluation.evaluate` decodes an arm with the functional JAX model into an `Arm`; the
quality benchmark (benchmarks/quality/evaluate.py) and examples/selection_rules.py report them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from wise_core.wise_config import WiseConfig


def _resampled_means(values: list[np.ndarray], n_resamples: int, seed: int) -> list[np.ndarray]:
    """For each of `values` (float64[n] each, paired), its mean over `n_resamples` resamples of
    the n indices with replacement (the same indices for every array): float64[n_resamples] each."""
    n = values[0].size
    rng = np.random.default_rng(seed)
    out = [np.empty(n_resamples) for _ in values]
    chunk = max(1, 2_000_000 // n)  # bound the index matrix to ~16 MB
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        index = rng.integers(0, n, (stop - start, n))
        for mean, v in zip(out, values):
            mean[start:stop] = v[index].mean(1)
    return out


def _check_confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return (1.0 - confidence) / 2


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
    tail = _check_confidence(confidence)
    means, = _resampled_means([d], n_resamples, seed)
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(d.mean()), float(low), float(high)


def ratio_bootstrap(numerators, denominators, *, n_resamples: int = 10_000, confidence: float = 0.95,
                    seed: int = 0) -> tuple[float, float, float]:
    """sum(numerators) / sum(denominators) (e.g. bits over bytes of each context) and its
    percentile bootstrap interval, the samples (pairs) resampled with replacement."""
    num, den = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    if num.ndim != 1 or num.shape != den.shape or num.size == 0:
        raise ValueError(f"ratio_bootstrap takes two non-empty 1-D arrays of one length, got {num.shape} and "
                         f"{den.shape}")
    if not (den > 0).all():
        raise ValueError("ratio_bootstrap: every denominator must be positive")
    tail = _check_confidence(confidence)
    num_means, den_means = _resampled_means([num, den], n_resamples, seed)
    low, high = np.quantile(num_means / den_means, [tail, 1.0 - tail])
    return float(num.sum() / den.sum()), float(low), float(high)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def interval(mean_low_high: tuple[float, float, float]) -> dict:
    """(mean, low, high) -> {"mean", "low", "high"}."""
    return dict(zip(("mean", "low", "high"), mean_low_high))


@dataclasses.dataclass
class Arm:
    """One decode arm on held-out (context, continuation) pairs.

    wise_config: None for dense; logprobs: per context float32[len(continuation)], the forced
    continuation's log p (nats); continuation_bytes: per context, the bytes its continuation
    encodes (a byte-level tokenizer: its token count); greedy: per context the greedy tokens
    decoded after it; density: per reuse depth, selected / causal blocks over the arm's WISE
    decode steps (None for dense); fallbacks: reuse-depth fallbacks to dense (None for dense);
    dense: the dense arm to compare with (None: this is it, or none was run); seed, confidence:
    of the bootstrap intervals."""

    wise_config: WiseConfig | None
    logprobs: list[np.ndarray]
    continuation_bytes: np.ndarray
    greedy: list[list[int]]
    density: dict[int, float] | None
    fallbacks: int | None
    dense: "Arm | None" = None
    seed: int = 0
    confidence: float = 0.95

    @property
    def label(self) -> str:
        """'dense', or the WiseConfig's rule ('eta=0.95', 'top_k=4', a Custom rule's label)."""
        return "dense" if self.wise_config is None else self.wise_config.rule.describe()

    @property
    def nll(self) -> np.ndarray:
        """float64[contexts]: each context's mean NLL of its continuation, nats per token."""
        return np.array([-np.asarray(lp, np.float64).mean() for lp in self.logprobs])

    @property
    def bits(self) -> np.ndarray:
        """float64[contexts]: each continuation's total NLL in bits."""
        return np.array([-np.asarray(lp, np.float64).sum() / math.log(2) for lp in self.logprobs])

    @property
    def bits_per_byte(self) -> dict:
        """Bits per byte of the continuations (their bits over their bytes, pooled) with its
        bootstrap interval over contexts: {"mean", "low", "high"}."""
        return interval(ratio_bootstrap(self.bits, self.continuation_bytes, confidence=self.confidence,
                                        seed=self.seed))

    def _against_dense(self) -> "Arm":
        if self.dense is None:
            raise ValueError(f"arm {self.label!r} has no dense arm to compare with")
        if len(self.dense.greedy) != len(self.greedy):
            raise ValueError(f"arm {self.label!r} has {len(self.greedy)} contexts, its dense arm "
                             f"{len(self.dense.greedy)}")
        return self.dense

    @property
    def nll_diff(self) -> dict:
        """Mean over contexts of (this arm's NLL - dense's), nats per token, with its paired
        bootstrap interval: {"mean", "low", "high"}."""
        dense = self._against_dense()
        return interval(paired_bootstrap(self.nll, dense.nll, confidence=self.confidence, seed=self.seed))

    @property
    def prefix_agreement(self) -> np.ndarray:
        """float64[contexts]: the greedy tokens' common prefix with dense's, over the tokens decoded."""
        dense = self._against_dense()
        return np.array([common_prefix(a, b) / len(b) for a, b in zip(self.greedy, dense.greedy)])

    @property
    def tokens_changed(self) -> float:
        """The fraction of greedy token positions whose token differs from dense's."""
        dense = self._against_dense()
        return float(np.mean([x != y for a, b in zip(self.greedy, dense.greedy) for x, y in zip(a, b)]))

    def summary(self) -> dict:
        """The arm's numbers as a JSON-ready dict (the comparisons only with a dense arm)."""
        out = {"arm": self.label, "bits_per_byte": self.bits_per_byte, "nll_mean": float(self.nll.mean()),
               "density": None if self.density is None else {str(d): v for d, v in self.density.items()},
               "fallbacks": self.fallbacks}
        if self.dense is not None:
            out.update(nll_diff=self.nll_diff, tokens_changed=self.tokens_changed,
                       greedy_prefix_agreement=float(self.prefix_agreement.mean()))
        return out
