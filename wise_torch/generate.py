"""Batched generation and forced decoding, run on the serving engine (`wise_torch.engine`).

Both add one request per prompt to an `LLM` whose pool holds every request at its longest
(so nothing is preempted), then step it to completion: chunked dense prefill, then decode
steps of one token per unfinished request (CUDA graphs on CUDA). A row leaves the batch when it
finishes (eos, token budget, or end of the forced continuation).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

from wise_core.generate_args import (MODEL_EOS, check_max_new_tokens, check_sampling, check_seed, check_wise_config,
                                     resolve_eos)
from wise_core.sampling_params import SamplingParams
from wise_core.stats import GenerationStats
from wise_core.tokenizer import encode_text
from wise_core.wise_config import WiseConfig
from wise_torch.engine.llm import LLM
from wise_torch.engine.sampler import seed_for
from wise_torch.model import OuroForCausalLM


@dataclasses.dataclass
class GenerationOutput:
    """tokens: generated ids per prompt; texts: their decoded text (None without a tokenizer);
    logits: per prompt float32[n_generated, vocab] when asked for; stats."""

    tokens: list[list[int]]
    texts: list[str] | None
    logits: list[torch.Tensor] | None
    stats: GenerationStats


@dataclasses.dataclass
class ForcedOutput:
    """logprobs: per sequence float32[len(continuation)], log p(continuation[i] | context,
    continuation[:i]); stats."""

    logprobs: list[torch.Tensor]
    stats: GenerationStats


DEFAULT_PAGE_SIZE = 128


def _is_one_sequence(x) -> bool:
    """A single prompt (a string or a token-id sequence), not a list of them."""
    return isinstance(x, str) or (isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 1) or (
        isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, numbers.Integral) for t in x))


def _token_lists(model: OuroForCausalLM, sequences, what: str) -> list[list[int]]:
    """Validate a list of prompts (token-id sequences, or strings with a tokenizer) as id lists."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise TypeError(f"{what} must be a non-empty list of token-id lists or strings")
    out = []
    for i, seq in enumerate(sequences):
        if isinstance(seq, str):
            if model.tokenizer is None:
                raise ValueError(f"{what}[{i}] is a string but the model has no tokenizer; pass token ids")
            seq = encode_text(model.tokenizer, seq, f"{what}[{i}]")
        elif isinstance(seq, (np.ndarray, torch.Tensor)) and seq.ndim == 1:
            seq = seq.tolist()
        if not isinstance(seq, (list, tuple)) or not all(isinstance(t, numbers.Integral) for t in seq):
            raise TypeError(f"{what}[{i}] must be a string or a sequence of integer token ids, got {seq!r:.80}")
        if not seq:
            raise ValueError(f"{what}[{i}] is empty")
        seq = [int(t) for t in seq]
        bad = [t for t in seq if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"{what}[{i}] holds ids {bad[:5]} outside the vocabulary (size {model.config.vocab_size})")
        out.append(seq)
    return out


def _check_length(model: OuroForCausalLM, lengths: list[int], extra: list[int], what: str) -> None:
    limit = model.config.max_position_embeddings
    for i, (n, m) in enumerate(zip(lengths, extra)):
        if n + m > limit:
            raise ValueError(f"{what}[{i}]: {n} tokens + {m} more exceed max_position_embeddings ({limit})")


def _engine(model: OuroForCausalLM, sequences: list[list[int]], extra: list[int], wise_config: WiseConfig | None,
            page_size: int, kernel: str | None) -> LLM:
    """An engine whose pool holds every request at its longest."""
    block_size = (wise_config or WiseConfig()).block_size
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 or page_size % block_size:
        raise ValueError(f"page_size must be a positive multiple of the block_size {block_size}, got {page_size!r}")
    lengths = [len(s) + m for s, m in zip(sequences, extra)]
    return LLM(model, wise_config=wise_config, num_pages=sum(-(-n // page_size) for n in lengths),
               page_size=page_size, max_num_seqs=len(sequences), max_model_len=max(lengths), kernel=kernel, seed=0)


def _stats(llm: LLM, new_tokens: int) -> GenerationStats:
    s = llm.stats()
    return GenerationStats(prefill_s=s.prefill_s, prefill_tokens=s.prompt_tokens, decode_s=s.decode_s,
                           decode_tokens_per_s=s.decode_tokens_per_s, new_tokens=new_tokens,
                           fallbacks=s.fallbacks, density=s.density)


@torch.inference_mode()
def generate(model: OuroForCausalLM, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, stop: tuple[str, ...] = (),
             eos_token_id=MODEL_EOS, wise_config: WiseConfig | None = None,
             seed: int | None = None, return_logits: bool = False,
             page_size: int = DEFAULT_PAGE_SIZE, kernel: str | None = None) -> GenerationOutput:
    """Generate up to max_new_tokens per prompt (list of token-id lists, or strings with a tokenizer).

    Greedy at temperature 0, else sampling with min_p, top_k and top_p (`SamplingParams`; seed:
    reproducible samples; request i draws from seed_for(seed, i)); a row stops at eos_token_id
    (default: the model's; None: never early) or at a stop string (its text ends before it,
    `SamplingParams.stop`). With wise_config, decode runs WISE. kernel: the decode attention
    (default: wise_config.kernel, or "auto" for dense decode).
    """
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    temperature, top_p = check_sampling(temperature, top_p)
    seed = check_seed(seed)
    wise_config = check_wise_config(wise_config, model.config.num_loops)
    eos = resolve_eos(eos_token_id, model.config.vocab_size, model.config.eos_token_id)
    ids = _token_lists(model, prompts, "prompts")
    _check_length(model, [len(p) for p in ids], [max_new_tokens] * len(ids), "prompts")
    ends = dict(ignore_eos=True, stop_token_ids=() if eos is None else (eos,))
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p, stop=tuple(stop), seed=None if seed is None else seed_for(seed, i),
                             **ends) for i in range(len(ids))]
    llm = _engine(model, ids, [max_new_tokens] * len(ids), wise_config, page_size, kernel)
    requests = [llm.add_request(p, sp, keep_logits=return_logits) for p, sp in zip(ids, params)]
    seqs = [llm.sequences[r] for r in requests]
    outs = llm.run_until_done(requests)
    tokens = [o.token_ids for o in outs]
    texts = None if model.tokenizer is None else [o.text for o in outs]
    return GenerationOutput(tokens=tokens, texts=texts,
                            logits=[torch.stack(s.logits) for s in seqs] if return_logits else None,
                            stats=_stats(llm, sum(map(len, tokens))))


@torch.inference_mode()
def teacher_force(model: OuroForCausalLM, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  kernel: str | None = None) -> ForcedOutput:
    """Log-probabilities of forced continuations: prefill each context, then decode its
    continuation token by token (the decode step of `generate`, dense or WISE).

    context_ids, continuation_ids: one token-id sequence each, or lists of them (one per sequence).
    kernel: as in `generate`.
    """
    wise_config = check_wise_config(wise_config, model.config.num_loops)
    single = _is_one_sequence(context_ids)
    contexts = _token_lists(model, [context_ids] if single else context_ids, "context_ids")
    continuations = _token_lists(model, [continuation_ids] if single else continuation_ids, "continuation_ids")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    _check_length(model, [len(c) for c in contexts], [len(c) for c in continuations], "context_ids")
    llm = _engine(model, contexts, [len(c) for c in continuations], wise_config, page_size, kernel)
    requests = [llm.add_request(c, SamplingParams(max_tokens=len(f)), forced=f)
                for c, f in zip(contexts, continuations)]
    outs = llm.run_until_done(requests)
    n_scored = sum(map(len, continuations))
    return ForcedOutput(logprobs=[torch.tensor(o.logprobs, dtype=torch.float32) for o in outs],
                        stats=_stats(llm, n_scored))
