"""Generation and forced decoding, both on the serving engine (`wise_jax.engine.LLM`): one
decode path.

Each call makes an engine sized to its prompts: rows = the prompt count rounded up to a power
of two, the page-table width and the pool rounded up within 1/8 (`pool_bucket`), so calls of
similar sizes share the compiled decode step. Prompts prefill at whole pages (one compilation
per page count, `wise_jax.serving`). Temperature, top-p, eos and the token limits are data and
never recompile. `trace_counts()` counts the traces (= compilations) of each program. The
arguments, prompts, eos and seed policy, requests, outputs and stats are `wise_core.generation`'s,
shared with wise_torch.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from tokenizers import Tokenizer

from wise_core.generate_args import MODEL_EOS, check_wise_config
from wise_core.generation import (ForcedOutput, GenerationOutput, check_positions, forced_pairs, generation_params,
                                  generation_stats, prompt_lists, run_forced, run_generate)
from wise_core.model_config import ModelConfig
from wise_core.stats import GenerationStats
from wise_core.wise_config import WiseConfig
from wise_jax.engine import LLM
from wise_jax.params import Params
from wise_jax.serving import DEFAULT_PAGE_SIZE, trace_counts

__all__ = ["ForcedOutput", "GenerationOutput", "GenerationStats", "generate", "pool_bucket",
           "teacher_force", "trace_counts"]

NO_TOKENIZER = ("pass tokenizer= to encode it (a string needs a tokenizer; a checkpoint's comes from "
                "wise_jax.load_model(..., with_tokenizer=True))")


def pool_bucket(n: int) -> int:
    """n rounded up to a multiple of 2**(bit_length(n - 1) - 4) (n itself up to 16): less than
    1/8 above n, 8 values per power of two."""
    step = 1 << max(0, (n - 1).bit_length() - 4)
    return -(-n // step) * step


def _engine(params: Params, config: ModelConfig, lengths: list[int], *, wise_config, page_size,
            attention_backend, tokenizer, mesh) -> LLM:
    """An engine that holds every request at once (`lengths`: prompt + new tokens of each), so
    nothing is preempted."""
    pages = [-(-n // page_size) for n in lengths]
    rows = 1 << (len(lengths) - 1).bit_length()
    return LLM(params, config, wise_config=wise_config, page_size=page_size, max_num_seqs=rows,
               max_model_len=min(pool_bucket(max(pages)) * page_size, config.max_position_embeddings),
               num_pages=pool_bucket(sum(pages)), attention_backend=attention_backend, tokenizer=tokenizer,
               mesh=mesh, seed=0)


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int] | str], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             min_p: float = 0.0, stop: Sequence[str] = (), eos_token_id=MODEL_EOS, wise_config: WiseConfig | None = None,
             key: jax.Array | None = None, return_logits: bool = False,
             tokenizer: Tokenizer | None = None, page_size: int = DEFAULT_PAGE_SIZE,
             attention_backend: str = "auto", mesh=None) -> GenerationOutput:
    """Generate up to `max_new_tokens` per prompt; dense decode, or WISE with `wise_config`.

    prompts: token-id lists, or strings with `tokenizer` (`load_model(..., with_tokenizer=True)`
    returns a checkpoint's; strings are encoded with `tokenizer.encode(s).ids`).
    A row stops after emitting eos_token_id (default MODEL_EOS: config.eos_token_id; None: never
    early), or at a stop string (needs `tokenizer`; its text ends before it, `SamplingParams.stop`).
    Bad arguments are errors naming them (`wise_core.generation`).
    temperature 0 is greedy; otherwise sampling with min_p, top_k and top_p (`SamplingParams`);
    prompt i samples with the key fold_in(key, i) (key default PRNGKey(0)), so its tokens do not
    depend on the other prompts.
    attention_backend: the engine's (`EngineArgs`; docs/attention.md).
    mesh: a jax.sharding.Mesh with axis "tp" to split the heads over (`wise_jax.sharding`).
    """
    ids = prompt_lists(prompts, config.vocab_size, tokenizer, "prompts", NO_TOKENIZER)
    sampling = generation_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 min_p=min_p, stop=stop, eos_token_id=eos_token_id, vocab_size=config.vocab_size,
                                 model_eos=config.eos_token_id)
    wise_config = check_wise_config(wise_config, config.total_ut_steps)
    key = jax.random.PRNGKey(0) if key is None else key
    lengths = check_positions(ids, [sampling.max_tokens] * len(ids), config.max_position_embeddings, "prompts")
    llm = _engine(params, config, lengths, wise_config=wise_config, page_size=page_size,
                  attention_backend=attention_backend, tokenizer=tokenizer, mesh=mesh)
    outs, seqs = run_generate(llm, ids, [sampling] * len(ids), keep_logits=return_logits,
                              request_options=[dict(key=jax.random.fold_in(key, n)) for n in range(len(ids))])
    tokens = [o.token_ids for o in outs]
    logits = [np.stack(s.logits).astype(np.float32) for s in seqs] if return_logits else None
    texts = None if tokenizer is None else [o.text for o in outs]
    return GenerationOutput(tokens, texts, logits, generation_stats(llm, sum(map(len, tokens))))


def teacher_force(params: Params, config: ModelConfig, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  attention_backend: str = "auto", tokenizer: Tokenizer | None = None,
                  mesh=None) -> ForcedOutput:
    """Prefill each context, then decode its continuation forced (the engine's decode step, fed
    the continuation instead of samples).

    context_ids, continuation_ids: one token-id list (or string) each, or lists of them (one per
    sequence); strings need `tokenizer`; attention_backend, mesh: as in `generate`.
    Returns per-sequence log-probs float32[len(continuation)] and stats."""
    contexts, continuations = forced_pairs(context_ids, continuation_ids, config.vocab_size, tokenizer, NO_TOKENIZER)
    wise_config = check_wise_config(wise_config, config.total_ut_steps)
    lengths = check_positions(contexts, [len(c) for c in continuations], config.max_position_embeddings,
                              "context_ids")
    llm = _engine(params, config, lengths, wise_config=wise_config, page_size=page_size,
                  attention_backend=attention_backend, tokenizer=tokenizer, mesh=mesh)
    outs = run_forced(llm, contexts, continuations)
    logprobs = [np.asarray(o.logprobs, np.float32) for o in outs]
    return ForcedOutput(logprobs, generation_stats(llm, sum(map(len, continuations))))
