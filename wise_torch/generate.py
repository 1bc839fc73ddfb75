"""Batched generation and forced decoding over the paged cache, dense or with WISE.

Both run the same scheme: one dense prefill of every prompt (all planes of the cache written),
then decode steps of one token per active row through `OuroForCausalLM.decode_step`. Rows
leave the batch when they finish (eos, token budget, or end of the forced continuation).
"""

from __future__ import annotations

import dataclasses
import numbers
import time

import numpy as np
import torch

from wise_core.config import WiseConfig
from wise_torch.attention import prepare_decode_attention, select_blocks
from wise_torch.kv_cache import PagedKVCache
from wise_torch.model import OuroForCausalLM
from wise_torch.wise_state import WiseState


@dataclasses.dataclass
class GenerationStats:
    """Timings (seconds, device-synchronised) and WISE counters of one call.

    new_tokens: tokens produced (generate) or scored (teacher_force); decode_tokens_per_s counts
    the tokens of decode steps (the first token of each row comes from prefill). fallbacks and
    density (per reuse depth) are None without WISE.
    """

    prefill_s: float
    prefill_tokens: int
    decode_s: float
    decode_tokens_per_s: float
    new_tokens: int
    fallbacks: int | None
    density: dict[int, float | None] | None


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


class _ModelEos:
    def __repr__(self) -> str:
        return "<model's eos>"


MODEL_EOS = _ModelEos()
DEFAULT_PAGE_SIZE = 128


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Session:
    """Requests (ids 0..n-1) decoding together: their cache pages, WISE slots, and which are
    still active (`active`, in row order) at which length."""

    def __init__(self, model: OuroForCausalLM, max_tokens: list[int], wise_config: WiseConfig | None,
                 page_size: int, kernel: str | None):
        config, weight = model.config, model.model.embed_tokens.weight
        block_size = (wise_config or WiseConfig()).block_size
        if not isinstance(page_size, int) or page_size <= 0 or page_size % block_size:
            raise ValueError(f"page_size must be a positive multiple of the block_size {block_size}, got {page_size!r}")
        if wise_config is not None:
            wise_config.validate_for(config.num_loops)
        self.model, self.device = model, weight.device
        self.max_pages = -(-max(max_tokens) // page_size)
        max_blocks = self.max_pages * page_size // block_size
        self.cache = PagedKVCache.for_model(config, num_pages=sum(-(-n // page_size) for n in max_tokens),
                                            page_size=page_size, dtype=weight.dtype, device=self.device)
        self.wise = None if wise_config is None else WiseState(
            wise_config, config, max_slots=len(max_tokens), max_blocks=max_blocks, device=self.device)
        self.wise_slots: dict[int, int] = {}
        if kernel is None:
            kernel = "auto" if wise_config is None else wise_config.kernel
        self.attention = prepare_decode_attention(
            kernel, max_batch=len(max_tokens),
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            max_blocks=max_blocks, block_size=block_size, dtype=weight.dtype, device=self.device)

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Logits [n, vocab] after each prompt (request i is prompts[i])."""
        for rid, prompt in enumerate(prompts):
            self.cache.reserve(rid, len(prompt))
            if self.wise is not None:
                self.wise_slots[rid] = self.wise.acquire(rid)
        self.active = list(range(len(prompts)))
        self.lengths = [len(p) for p in prompts]
        width = max(self.lengths)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.int64).to(self.device)
        lengths = torch.tensor(self.lengths, dtype=torch.int64).to(self.device)
        table = self.cache.page_table(self.active, self.max_pages)
        return self.model.prefill(ids, lengths, self.cache, table)

    def advance(self, keep: list[int], tokens: torch.Tensor) -> torch.Tensor | None:
        """Finish the active requests whose rows are not in `keep`, then run the decode step on
        the others with `tokens[keep]` (tokens: int64[len(active)]) as their next token.
        Returns logits [len(keep), vocab], or None when no request is left."""
        kept = set(keep)
        for row, rid in enumerate(self.active):
            if row not in kept:
                self.finish(rid)
        if not keep:
            return None
        self.active = [self.active[r] for r in keep]
        seq_lens = []
        for rid in self.active:
            self.lengths[rid] += 1
            self.cache.reserve(rid, self.lengths[rid])
            seq_lens.append(self.lengths[rid])
        slots = None if self.wise is None else [self.wise_slots[r] for r in self.active]
        batch = self.cache.decode_batch(self.active, seq_lens, self.max_pages, wise_slots=slots)
        fed = tokens[torch.tensor(keep, device=self.device)]
        return self.model.decode_step(fed, batch, self.cache, wise=self.wise, kernel=self.attention)

    def finish(self, rid: int) -> None:
        self.cache.release(rid)
        if self.wise is not None:
            self.wise.release(self.wise_slots.pop(rid))

    def stats(self, prefill_s: float, prefill_tokens: int, decode_s: float, new_tokens: int,
              decode_tokens: int) -> GenerationStats:
        return GenerationStats(
            prefill_s=prefill_s, prefill_tokens=prefill_tokens, decode_s=decode_s,
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0, new_tokens=new_tokens,
            fallbacks=None if self.wise is None else self.wise.fallbacks,
            density=None if self.wise is None else self.wise.density())


def _is_token_list(x) -> bool:
    return (isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 1) or (
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
            seq = model.tokenizer.encode(seq).ids
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


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """logits: [batch, vocab] -> int64[batch]; greedy when temperature == 0. top-p keeps the
    smallest prefix of tokens ranked by probability that reaches top_p (the WISE rule)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        probs = probs * select_blocks(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def generate(model: OuroForCausalLM, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_token_id=MODEL_EOS, wise_config: WiseConfig | None = None,
             seed: int | None = None, return_logits: bool = False,
             page_size: int = DEFAULT_PAGE_SIZE, kernel: str | None = None) -> GenerationOutput:
    """Generate up to max_new_tokens per prompt (list of token-id lists, or strings with a tokenizer).

    Greedy at temperature 0, else sampling with top-p; a row stops at eos_token_id (default: the
    model's; None: never early). With wise_config, decode runs WISE. kernel: the decode
    attention (default: wise_config.kernel, or "auto" for dense decode).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    eos = model.config.eos_token_id if eos_token_id is MODEL_EOS else eos_token_id
    ids = _token_lists(model, prompts, "prompts")
    _check_length(model, [len(p) for p in ids], [max_new_tokens] * len(ids), "prompts")
    session = _Session(model, [len(p) + max_new_tokens for p in ids], wise_config, page_size, kernel)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=session.device).manual_seed(seed)

    start = _sync(session.device)
    logits = session.prefill(ids)
    next_tokens = sample(logits, temperature, top_p, generator)
    prefill_done = _sync(session.device)

    tokens: list[list[int]] = [[] for _ in ids]
    kept: list[list[torch.Tensor]] = [[] for _ in ids]
    while True:
        chosen = next_tokens.tolist()
        keep = []
        for row, rid in enumerate(session.active):
            tokens[rid].append(chosen[row])
            if return_logits:
                kept[rid].append(logits[row])
            if chosen[row] != eos and len(tokens[rid]) < max_new_tokens:
                keep.append(row)
        logits = session.advance(keep, next_tokens)
        if logits is None:
            break
        next_tokens = sample(logits, temperature, top_p, generator)
    end = _sync(session.device)

    new_tokens = sum(map(len, tokens))
    texts = None if model.tokenizer is None else [model.tokenizer.decode(t) for t in tokens]
    return GenerationOutput(
        tokens=tokens, texts=texts,
        logits=[torch.stack(k).float().cpu() for k in kept] if return_logits else None,
        stats=session.stats(prefill_done - start, sum(map(len, ids)), end - prefill_done, new_tokens,
                            new_tokens - len(ids)))


@torch.inference_mode()
def teacher_force(model: OuroForCausalLM, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  kernel: str | None = None) -> ForcedOutput:
    """Log-probabilities of forced continuations: prefill each context, then decode its
    continuation token by token (the decode step of `generate`, dense or WISE).

    context_ids, continuation_ids: one token-id sequence each, or lists of them (one per sequence).
    kernel: as in `generate`.
    """
    single = _is_token_list(context_ids)
    contexts = _token_lists(model, [context_ids] if single else context_ids, "context_ids")
    continuations = _token_lists(model, [continuation_ids] if single else continuation_ids, "continuation_ids")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    _check_length(model, [len(c) for c in contexts], [len(c) for c in continuations], "context_ids")
    session = _Session(model, [len(a) + len(b) for a, b in zip(contexts, continuations)], wise_config,
                       page_size, kernel)

    start = _sync(session.device)
    logits = session.prefill(contexts)
    prefill_done = _sync(session.device)
    scored: list[list[torch.Tensor]] = [[] for _ in contexts]
    step = 0
    while True:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([continuations[rid][step] for rid in session.active], device=session.device)
        picked = logprobs.gather(1, targets[:, None])[:, 0]
        keep = []
        for row, rid in enumerate(session.active):
            scored[rid].append(picked[row])
            if step + 1 < len(continuations[rid]):
                keep.append(row)
        logits = session.advance(keep, targets)
        if logits is None:
            break
        step += 1
    end = _sync(session.device)

    n_scored = sum(map(len, continuations))
    return ForcedOutput(logprobs=[torch.stack(s).cpu() for s in scored],
                        stats=session.stats(prefill_done - start, sum(map(len, contexts)), end - prefill_done,
                                            n_scored, n_scored - len(contexts)))
