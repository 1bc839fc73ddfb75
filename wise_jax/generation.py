"""Generation and forced decoding, both on the serving engine (`wise_jax.engine.LLM`): one
decode path.

Each call makes an engine sized to its prompts: rows = the prompt count rounded up to a power
of two, the page-table width and the pool rounded up within 1/8 (`pool_bucket`), so calls of
similar sizes share the compiled decode step. Prompts prefill at whole pages (one compilation
per page count, `wise_jax.serving`). Temperature, top-p, eos and the token limits are data and
never recompile. `trace_counts()` counts the traces (= compilations) of each program.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from tokenizers import Tokenizer

from wise_core.generate_args import (MODEL_EOS, check_max_new_tokens, check_sampling, check_wise_config,
                                     resolve_eos)
from wise_core.model_config import ModelConfig
from wise_core.stats import GenerationStats
from wise_core.wise_config import WiseConfig
from wise_jax.engine import LLM, SamplingParams, encode
from wise_jax.params import Params
from wise_jax.serving import DEFAULT_PAGE_SIZE, trace_counts

__all__ = ["ForcedOutput", "GenerationOutput", "GenerationStats", "generate", "pool_bucket",
           "teacher_force", "trace_counts"]


@dataclasses.dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (ending with eos when it stopped there); texts: their
    decoding when a tokenizer is known; logits: per prompt float32[n_generated, vocab] when
    requested; stats."""

    tokens: list[list[int]]
    texts: list[str] | None
    logits: list[np.ndarray] | None
    stats: GenerationStats


@dataclasses.dataclass
class ForcedOutput:
    """logprobs: per sequence float32[len(continuation)], log p(continuation[i] | context,
    continuation[:i]); stats."""

    logprobs: list[np.ndarray]
    stats: GenerationStats


def pool_bucket(n: int) -> int:
    """n rounded up to a multiple of 2**(bit_length(n - 1) - 4) (n itself up to 16): less than
    1/8 above n, 8 values per power of two."""
    step = 1 << max(0, (n - 1).bit_length() - 4)
    return -(-n // step) * step


def _engine(params: Params, config: ModelConfig, lengths: list[int], *, wise_config, page_size, kernel,
            tokenizer, mesh) -> LLM:
    """An engine that holds every request at once (`lengths`: prompt + new tokens of each), so
    nothing is preempted."""
    pages = [-(-n // page_size) for n in lengths]
    rows = 1 << (len(lengths) - 1).bit_length()
    return LLM(params, config, wise_config=wise_config, page_size=page_size, max_num_seqs=rows,
               max_model_len=min(pool_bucket(max(pages)) * page_size, config.max_position_embeddings),
               num_pages=pool_bucket(sum(pages)), kernel=kernel, tokenizer=tokenizer, mesh=mesh, seed=0)


def _stats(llm: LLM, new_tokens: int) -> GenerationStats:
    s = llm.stats()
    return GenerationStats(prefill_s=s.prefill_s, prefill_tokens=s.prompt_tokens, decode_s=s.decode_s,
                           decode_tokens_per_s=s.decode_tokens_per_s, new_tokens=new_tokens,
                           fallbacks=s.fallbacks, density=s.density)


def _prompt_list(prompts, what: str) -> list:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not len(prompts):
        raise ValueError(f"{what} must be a non-empty list of token-id lists or strings")
    return list(prompts)


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int] | str], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             min_p: float = 0.0, stop: Sequence[str] = (), eos_token_id=MODEL_EOS, wise_config: WiseConfig | None = None,
             key: jax.Array | None = None, return_logits: bool = False,
             tokenizer: Tokenizer | None = None, page_size: int = DEFAULT_PAGE_SIZE,
             kernel: str | None = None, mesh=None) -> GenerationOutput:
    """Generate up to `max_new_tokens` per prompt; dense decode, or WISE with `wise_config`.

    prompts: token-id lists, or strings with `tokenizer` (`load_model(..., with_tokenizer=True)`
    returns a checkpoint's; strings are encoded with `tokenizer.encode(s).ids`).
    A row stops after emitting eos_token_id (default MODEL_EOS: config.eos_token_id; None: never
    early), or at a stop string (needs `tokenizer`; its text ends before it, `SamplingParams.stop`). Bad arguments are errors naming them (`wise_core.generate_args`).
    temperature 0 is greedy; otherwise sampling with min_p, top_k and top_p (`SamplingParams`);
    prompt i samples with the key
    fold_in(key, i) (key default PRNGKey(0)), so its tokens do not depend on the other prompts.
    kernel: decode-attention kernel (default: wise_config.kernel, or 'auto' when dense).
    mesh: a jax.sharding.Mesh with axis "tp" to split the heads over (`wise_jax.sharding`).
    """
    prompts = _prompt_list(prompts, "prompts")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    temperature, top_p = check_sampling(temperature, top_p)
    wise_config = check_wise_config(wise_config, config.total_ut_steps)
    eos = resolve_eos(eos_token_id, config.vocab_size, config.eos_token_id)
    stops = () if eos is None or eos == config.eos_token_id else (eos,)
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, stop=tuple(stop), ignore_eos=eos != config.eos_token_id, stop_token_ids=stops)
    key = jax.random.PRNGKey(0) if key is None else key

    encoded = [encode(p, config, tokenizer, f"prompts[{n}]") for n, p in enumerate(prompts)]
    for n, ids in enumerate(encoded):
        if len(ids) + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompts[{n}] is too long: {len(ids)} tokens + max_new_tokens {max_new_tokens} "
                             f"exceed max_position_embeddings {config.max_position_embeddings}")
    llm = _engine(params, config, [len(ids) + max_new_tokens for ids in encoded], wise_config=wise_config,
                  page_size=page_size, kernel=kernel, tokenizer=tokenizer, mesh=mesh)
    requests = [llm.add_request(p, sampling, keep_logits=return_logits, key=jax.random.fold_in(key, n))
                for n, p in enumerate(encoded)]
    seqs = [llm.sequences[r] for r in requests]     # they leave llm.sequences when they finish
    outs = llm.run_until_done(requests)
    tokens = [o.token_ids for o in outs]
    logits = [np.stack(s.logits).astype(np.float32) for s in seqs] if return_logits else None
    texts = None if tokenizer is None else [o.text for o in outs]
    return GenerationOutput(tokens, texts, logits, _stats(llm, sum(map(len, tokens))))


def teacher_force(params: Params, config: ModelConfig, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  kernel: str | None = None, tokenizer: Tokenizer | None = None, mesh=None) -> ForcedOutput:
    """Prefill each context, then decode its continuation forced (the engine's decode step, fed
    the continuation instead of samples).

    context_ids, continuation_ids: one token-id list (or string) each, or lists of them (one per
    sequence); strings need `tokenizer`; mesh: as in `generate`.
    Returns per-sequence log-probs float32[len(continuation)] and stats."""
    single = isinstance(context_ids, str) or (len(context_ids) > 0 and np.ndim(context_ids[0]) == 0)
    contexts = _prompt_list([context_ids] if single else context_ids, "context_ids")
    continuations = _prompt_list([continuation_ids] if single else continuation_ids, "continuation_ids")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    wise_config = check_wise_config(wise_config, config.total_ut_steps)
    contexts = [encode(c, config, tokenizer, f"context_ids[{n}]") for n, c in enumerate(contexts)]
    continuations = [encode(c, config, tokenizer, f"continuation_ids[{n}]") for n, c in enumerate(continuations)]
    for n, (a, b) in enumerate(zip(contexts, continuations)):
        if len(a) + len(b) > config.max_position_embeddings:
            raise ValueError(f"context_ids[{n}] ({len(a)} tokens) + continuation ({len(b)}) exceed "
                             f"max_position_embeddings {config.max_position_embeddings}")
    llm = _engine(params, config, [len(a) + len(b) for a, b in zip(contexts, continuations)],
                  wise_config=wise_config, page_size=page_size, kernel=kernel, tokenizer=tokenizer, mesh=mesh)
    outs = llm.run_until_done([llm.add_request(a, forced=b) for a, b in zip(contexts, continuations)])
    logprobs = [np.asarray(o.logprobs, np.float32) for o in outs]
    return ForcedOutput(logprobs, _stats(llm, sum(map(len, continuations))))
