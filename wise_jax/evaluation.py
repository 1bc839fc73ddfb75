"""Evaluate a decode arm -- dense, or any WiseConfig, any selection rule (Custom included) -- on
held-out text with the functional JAX model.

    pairs = evaluation.heldout_pairs(ids, context=256, continuation=32, count=64)
    dense = evaluation.evaluate(params, config, None, *pairs)
    arm = evaluation.evaluate(params, config, WiseConfig(selection=TopK(4)), *pairs, dense=dense)
    arm.bits_per_byte, arm.density, arm.tokens_changed, arm.nll_diff      # wise_core.evaluation.Arm

Each arm teacher-forces every continuation (`wise_jax.score`) and decodes `greedy_tokens`
greedy tokens after every context (`wise_jax.greedy`), in batches of contexts whose
continuations have one length, the contexts padded to whole pages. Both compile once per
(batch, shapes, WiseConfig): an equal WiseConfig -- rules compare by value, a Custom by its
function -- runs the compiled programs again.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from wise_core.evaluation import Arm
from wise_core.model_config import ModelConfig
from wise_core.generation import prompt_lists
from wise_core.wise_config import WiseConfig
from wise_jax.params import Params
from wise_jax.scoring import greedy, score
from wise_jax.serving import DEFAULT_PAGE_SIZE, prefill_bucket


def heldout_pairs(ids, *, context: int, continuation: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """`count` (context, continuation) pairs of `context` and `continuation` tokens cut from the
    token stream `ids` at evenly spaced offsets (the first at 0, the last ending at its end) ->
    (contexts, continuations)."""
    ids = np.asarray(ids)
    for name, value in (("context", context), ("continuation", continuation), ("count", count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if ids.ndim != 1 or len(ids) < context + continuation:
        raise ValueError(f"ids must be a 1-D token stream of at least context + continuation = "
                         f"{context + continuation} tokens, got shape {ids.shape}")
    starts = np.linspace(0, len(ids) - context - continuation, count).astype(int)
    return ([ids[s:s + context].tolist() for s in starts],
            [ids[s + context:s + context + continuation].tolist() for s in starts])


def _batches(lengths: list[int], batch: int) -> list[list[int]]:
    """Indices grouped by equal length (in order of first appearance), in chunks of `batch`."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        groups.setdefault(length, []).append(index)
    return [group[i:i + batch] for group in groups.values() for i in range(0, len(group), batch)]


def evaluate(params: Params, config: ModelConfig, wise_config: WiseConfig | None, contexts, continuations, *,
             greedy_tokens: int = 32, dense: Arm | None = None, tokenizer: Tokenizer | None = None,
             continuation_bytes: Sequence[int] | None = None, batch: int = 16, page_size: int = DEFAULT_PAGE_SIZE,
             kernel: str = "auto", seed: int = 0, confidence: float = 0.95) -> Arm:
    """One arm (wise_config None: dense) on held-out (context, continuation) pairs -> `Arm`.

    contexts, continuations: token-id lists (or strings, with `tokenizer`), one per pair.
    greedy_tokens: greedy tokens decoded after each context (no stop token), to compare with
    dense's (`dense`: that arm, e.g. this function's result for None). continuation_bytes: the
    bytes each continuation encodes (None: decoded by `tokenizer`, UTF-8; without a tokenizer
    one byte per token, a byte-level model). batch: contexts decoded together. kernel: the
    decode-attention kernel (`wise_jax.scoring.score`'s). seed, confidence: of the
    bootstrap intervals."""
    contexts = prompt_lists(contexts, config.vocab_size, tokenizer, "contexts", "pass tokenizer= to encode it")
    continuations = prompt_lists(continuations, config.vocab_size, tokenizer, "continuations",
                                 "pass tokenizer= to encode it")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if continuation_bytes is None:
        continuation_bytes = ([len(c) for c in continuations] if tokenizer is None else
                              [len(tokenizer.decode(c).encode("utf-8")) for c in continuations])
    if len(continuation_bytes) != len(continuations):
        raise ValueError(f"{len(continuation_bytes)} continuation_bytes for {len(continuations)} continuations")

    logprobs: list[np.ndarray | None] = [None] * len(contexts)
    tokens: list[list[int] | None] = [None] * len(contexts)
    counts = np.zeros((2, 0 if wise_config is None else len(wise_config.reuse_depths)))
    fallbacks = 0
    for rows in _batches([len(c) for c in continuations], batch):
        width = prefill_bucket(max(len(contexts[r]) for r in rows), page_size)   # whole pages: fewer shapes
        padded = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            padded[i, :len(contexts[r])] = contexts[r]
        lengths = np.array([len(contexts[r]) for r in rows], np.int32)
        forced = score(params, config, padded, np.array([continuations[r] for r in rows], np.int32), wise_config,
                       context_lengths=lengths, page_size=page_size, kernel=kernel)
        chosen = greedy(params, config, padded, greedy_tokens, wise_config, context_lengths=lengths,
                        page_size=page_size, kernel=kernel)
        for i, r in enumerate(rows):
            logprobs[r] = np.asarray(forced.logprobs[i])
            tokens[r] = np.asarray(chosen.tokens[i]).tolist()
        if wise_config is not None:
            for out in (forced, chosen):
                counts += np.stack([np.asarray(out.selected_blocks), np.asarray(out.causal_blocks)])
                fallbacks += int(out.fallbacks)
    density = None if wise_config is None else {
        depth: float(counts[0, i] / counts[1, i]) for i, depth in enumerate(wise_config.reuse_depths)}
    return Arm(wise_config, logprobs, np.asarray(continuation_bytes), tokens, density,
               None if wise_config is None else fallbacks, dense, seed, confidence)


def compare(params: Params, config: ModelConfig, arms: Sequence[WiseConfig], contexts, continuations,
            **settings) -> list[Arm]:
    """Dense, then each of `arms`, on the same pairs (`evaluate`, `settings` its keyword
    arguments) -> [dense, *arms], each WISE arm compared with dense."""
    dense = evaluate(params, config, None, contexts, continuations, **settings)
    return [dense] + [evaluate(params, config, wise, contexts, continuations, dense=dense, **settings)
                      for wise in arms]
