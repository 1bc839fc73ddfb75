"""`generate` and `teacher_force` over the engine protocol, written once for both frameworks
(`wise_torch.generate`, `wise_jax.generate`): their prompts, eos and seed policy, the requests
they run, their outputs and stats. A framework supplies its model's engine (sized so that every
request fits at once: nothing is preempted), its random stream per prompt, and its arrays.

Prompts are token-id lists (`wise_core.tokenizer.check_token_ids`) or strings through the
tokenizer. The eos policy (`generation_params`): eos_token_id MODEL_EOS (the default) stops at
the model config's eos_token_id, an id stops at that id instead, None never stops early. The
seed policy: prompt i samples from its own random stream drawn from the call's seed and i (torch:
`SamplingParams.seed = seed_for(seed, i)`; jax: the key `fold_in(key, i)`), so its tokens do not
depend on the other prompts.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence as SequenceABC

from wise_core.generate_args import check_max_new_tokens, check_sampling, resolve_eos
from wise_core.sampling_params import SamplingParams
from wise_core.stats import GenerationStats
from wise_core.tokenizer import check_token_ids, encode_text


@dataclasses.dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (ending with eos when it stopped there); texts: their
    decoded text (None without a tokenizer); logits: per prompt float32[n_generated, vocab] (the
    framework's arrays: torch.Tensor, numpy.ndarray) when asked for; stats."""

    tokens: list[list[int]]
    texts: list[str] | None
    logits: list | None
    stats: GenerationStats


@dataclasses.dataclass
class ForcedOutput:
    """logprobs: per sequence float32[len(continuation)] (the framework's arrays), log
    p(continuation[i] | context, continuation[:i]); stats."""

    logprobs: list
    stats: GenerationStats


def prompt_lists(prompts, vocab_size: int, tokenizer, what: str, no_tokenizer: str) -> list[list[int]]:
    """A non-empty list of prompts (token ids, or strings through `tokenizer`) -> their token-id
    lists, each checked (`check_token_ids`). Errors name `what`[i]: a TypeError for what is not
    a list, a ValueError for an empty one; a string without a tokenizer is a ValueError saying
    `no_tokenizer` (the caller's remedy)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, SequenceABC) or hasattr(prompts, "ndim"):
        raise TypeError(f"{what} must be a non-empty list of token-id lists or strings, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError(f"{what} must be a non-empty list of token-id lists or strings, got an empty one")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{what}[{i}] is a string: {no_tokenizer}")
            prompt = encode_text(tokenizer, prompt, f"{what}[{i}]")
        out.append(check_token_ids(prompt, vocab_size, f"{what}[{i}]"))
    return out


def is_one_sequence(x) -> bool:
    """A single prompt (a string, a 1-D array, or a non-empty sequence of integers), not a list of them."""
    if isinstance(x, str):
        return True
    if hasattr(x, "ndim"):
        return x.ndim == 1
    return isinstance(x, SequenceABC) and len(x) > 0 and all(
        isinstance(t, numbers.Integral) or getattr(t, "ndim", None) == 0 for t in x)


def forced_pairs(context_ids, continuation_ids, vocab_size: int, tokenizer, no_tokenizer: str
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """teacher_force's (contexts, continuations): one sequence each, or lists of them (one per
    sequence), checked as `prompt_lists`; as many continuations as contexts."""
    single = is_one_sequence(context_ids)
    contexts = prompt_lists([context_ids] if single else context_ids, vocab_size, tokenizer, "context_ids",
                            no_tokenizer)
    continuations = prompt_lists([continuation_ids] if single else continuation_ids, vocab_size, tokenizer,
                                 "continuation_ids", no_tokenizer)
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    return contexts, continuations


def check_positions(sequences: list[list[int]], extra: list[int], max_positions: int, what: str) -> list[int]:
    """Each sequence's tokens + its `extra` (new or forced) tokens, checked to fit the model's
    max_positions (a ValueError naming `what`[i]) -> those totals."""
    totals = []
    for i, (seq, more) in enumerate(zip(sequences, extra)):
        if len(seq) + more > max_positions:
            raise ValueError(f"{what}[{i}]: {len(seq)} tokens + {more} more exceed max_position_embeddings "
                             f"({max_positions}): too long")
        totals.append(len(seq) + more)
    return totals


def generation_params(*, max_new_tokens, temperature, top_p, top_k, min_p, stop, eos_token_id, vocab_size: int,
                      model_eos: int | None) -> SamplingParams:
    """The SamplingParams of every prompt of a `generate` call (its arguments checked, errors
    naming them), with the eos policy (module docstring): the model's eos stops as eos; another
    id replaces it as a stop id; None never stops early."""
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    temperature, top_p = check_sampling(temperature, top_p)
    eos = resolve_eos(eos_token_id, vocab_size, model_eos)
    replaced = eos != model_eos
    return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          stop=tuple(stop), ignore_eos=replaced, stop_token_ids=(eos,) if replaced and eos is not None
                          else ())


def run_generate(llm, prompts: list[list[int]], params: list[SamplingParams], *, keep_logits: bool,
                 request_options: list[dict] | None = None) -> tuple[list, list]:
    """Add prompt i with params[i] (and request_options[i], the framework's add_request options)
    to `llm`, an engine that holds them all at once, and step it to the end -> (their final
    RequestOutputs, their Sequences: their kept logits when keep_logits)."""
    options = request_options or [{}] * len(prompts)
    requests = [llm.add_request(p, sp, keep_logits=keep_logits, **o) for p, sp, o in zip(prompts, params, options)]
    seqs = [llm.sequences[r] for r in requests]     # they leave llm.sequences when they finish
    return llm.run_until_done(requests), seqs


def run_forced(llm, contexts: list[list[int]], continuations: list[list[int]]) -> list:
    """Each context prefilled, then its continuation decoded forced (each token scored), on
    `llm` (holding them all at once) -> their final RequestOutputs (logprobs per continuation token)."""
    return llm.run_until_done([llm.add_request(c, SamplingParams(max_tokens=len(f)), forced=f)
                               for c, f in zip(contexts, continuations)])


def generation_stats(llm, new_tokens: int) -> GenerationStats:
    """The call's GenerationStats from its engine's stats; new_tokens: generated or scored."""
    s = llm.stats()
    return GenerationStats(prefill_s=s.prefill_s, prefill_tokens=s.prompt_tokens, decode_s=s.decode_s,
                           decode_tokens_per_s=s.decode_tokens_per_s, new_tokens=new_tokens,
                           fallbacks=s.fallbacks, density=s.density)
