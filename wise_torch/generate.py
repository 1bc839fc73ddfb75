"""Batched generation and forced decoding, run on the serving engine (`wise_torch.engine`).

Both add one request per prompt to an `LLM` whose pool holds every request at its longest
(so nothing is preempted), then step it to completion: chunked dense prefill, then decode
steps of one token per unfinished request (CUDA graphs on CUDA). A row leaves the batch when it
finishes (eos, token budget, or end of the forced continuation). The arguments, prompts, eos
and seed policy, requests, outputs and stats are `wise_core.generation`'s, shared with wise_jax.
"""

from __future__ import annotations

import dataclasses

import torch

from wise_core.generate_args import MODEL_EOS, check_seed, check_wise_config
from wise_core.generation import (ForcedOutput, GenerationOutput, check_positions, forced_pairs, generation_params,
                                  generation_stats, prompt_lists, run_forced, run_generate)
from wise_core.stats import GenerationStats
from wise_core.wise_config import WiseConfig
from wise_torch.engine.llm import LLM
from wise_torch.engine.sampler import seed_for
from wise_torch.model import OuroForCausalLM

__all__ = ["ForcedOutput", "GenerationOutput", "GenerationStats", "generate", "teacher_force"]

DEFAULT_PAGE_SIZE = 128
NO_TOKENIZER = "the model has no tokenizer; pass token ids"


def _engine(model: OuroForCausalLM, lengths: list[int], wise_config: WiseConfig | None, page_size: int,
            attention_backend: str) -> LLM:
    """An engine whose pool holds every request at its longest (`lengths`: prompt + new tokens of each)."""
    block_size = (wise_config or WiseConfig()).block_size
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 or page_size % block_size:
        raise ValueError(f"page_size must be a positive multiple of the block_size {block_size}, got {page_size!r}")
    return LLM(model, wise_config=wise_config, num_pages=sum(-(-n // page_size) for n in lengths),
               page_size=page_size, max_num_seqs=len(lengths), max_model_len=max(lengths),
               attention_backend=attention_backend, seed=0)


@torch.inference_mode()
def generate(model: OuroForCausalLM, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, stop: tuple[str, ...] = (),
             eos_token_id=MODEL_EOS, wise_config: WiseConfig | None = None,
             seed: int | None = None, return_logits: bool = False,
             page_size: int = DEFAULT_PAGE_SIZE, attention_backend: str = "auto") -> GenerationOutput:
    """Generate up to max_new_tokens per prompt (list of token-id lists, or strings with a tokenizer).

    Greedy at temperature 0, else sampling with min_p, top_k and top_p (`SamplingParams`; seed:
    reproducible samples; request i draws from seed_for(seed, i)); a row stops at eos_token_id
    (default: the model's; None: never early) or at a stop string (its text ends before it,
    `SamplingParams.stop`). With wise_config, decode runs WISE. attention_backend: the
    engine's (`EngineArgs`; docs/attention.md).
    """
    config = model.config
    sampling = generation_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 min_p=min_p, stop=stop, eos_token_id=eos_token_id, vocab_size=config.vocab_size,
                                 model_eos=config.eos_token_id)
    seed = check_seed(seed)
    wise_config = check_wise_config(wise_config, config.num_loops)
    ids = prompt_lists(prompts, config.vocab_size, model.tokenizer, "prompts", NO_TOKENIZER)
    lengths = check_positions(ids, [sampling.max_tokens] * len(ids), config.max_position_embeddings, "prompts")
    params = [sampling if seed is None else dataclasses.replace(sampling, seed=seed_for(seed, i))
              for i in range(len(ids))]
    llm = _engine(model, lengths, wise_config, page_size, attention_backend)
    outs, seqs = run_generate(llm, ids, params, keep_logits=return_logits)
    tokens = [o.token_ids for o in outs]
    return GenerationOutput(tokens=tokens, texts=None if model.tokenizer is None else [o.text for o in outs],
                            logits=[torch.stack(s.logits) for s in seqs] if return_logits else None,
                            stats=generation_stats(llm, sum(map(len, tokens))))


@torch.inference_mode()
def teacher_force(model: OuroForCausalLM, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  attention_backend: str = "auto") -> ForcedOutput:
    """Log-probabilities of forced continuations: prefill each context, then decode its
    continuation token by token (the decode step of `generate`, dense or WISE).

    context_ids, continuation_ids: one token-id sequence each, or lists of them (one per sequence).
    attention_backend: as in `generate`.
    """
    config = model.config
    wise_config = check_wise_config(wise_config, config.num_loops)
    contexts, continuations = forced_pairs(context_ids, continuation_ids, config.vocab_size, model.tokenizer,
                                           NO_TOKENIZER)
    lengths = check_positions(contexts, [len(c) for c in continuations], config.max_position_embeddings,
                              "context_ids")
    llm = _engine(model, lengths, wise_config, page_size, attention_backend)
    outs = run_forced(llm, contexts, continuations)
    return ForcedOutput(logprobs=[torch.tensor(o.logprobs, dtype=torch.float32) for o in outs],
                        stats=generation_stats(llm, sum(map(len, continuations))))
