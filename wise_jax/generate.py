"""jit-compiled generation and forced decoding over the paged cache.

`generate` pads the batch and the lengths to buckets (powers of two), runs one jit-compiled
prefill, then one jit-compiled decode loop (`lax.while_loop`) that donates the cache. Compiled
programs are cached per bucket: the batch size, padded prompt length, padded new-token count,
page size, model and WISE configs, kernel and `return_logits`. Temperature, top-p, the eos id and
the actual token limit are traced values and never recompile. `trace_counts()` counts the traces
(each trace is one compilation); `stats["compiles"]` is the number a call caused.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from wise_core.config import ModelConfig, WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import model
from wise_jax import wise_state as ws
from wise_jax.attention import resolve_kernel
from wise_jax.loading import tokenizer_for
from wise_jax.params import Params
from wise_jax.sampling import sample

DEFAULT_PAGE_SIZE = 128
MIN_BUCKET = 16

_TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """Traces (= compilations) so far of each jit-compiled program: prefill, decode, forced."""
    return dict(_TRACES)


@dataclasses.dataclass
class GenerationOutput:
    """tokens: generated ids per prompt (ending with eos when it stopped there); texts: their
    decoding when a tokenizer is known; logits: per prompt float32[n_generated, vocab] when
    requested; stats: timings and WISE counters."""

    tokens: list[list[int]]
    texts: list[str] | None
    logits: list[np.ndarray] | None
    stats: dict


@dataclasses.dataclass
class ForcedOutput:
    """logprobs float32[n_continuation]: log p(continuation[i] | context, continuation[:i]); stats."""

    logprobs: np.ndarray
    stats: dict


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("config", "page_size", "max_pages"))
def _prefill(params: Params, tokens, lengths, *, config: ModelConfig, page_size: int, max_pages: int):
    """A fresh cache sized so no row can exhaust it (batch * max_pages pages), and its prefill."""
    _TRACES["prefill"] += 1
    batch = tokens.shape[0]
    cache = kvc.create(config, batch=batch, max_pages=max_pages, num_pages=batch * max_pages,
                       page_size=page_size, dtype=params.embed_tokens.dtype)
    return model.prefill(params, config, cache, tokens, lengths)


def _new_state(config: ModelConfig, wise_config: WiseConfig | None, cache: kvc.PagedKVCache, batch: int):
    if wise_config is None:
        return None
    return ws.create(wise_config, slots=batch, layers=config.num_hidden_layers,
                     heads=config.num_attention_heads, max_blocks=cache.capacity // wise_config.block_size)


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel", "max_new", "return_logits"),
                   donate_argnames=("cache",))
def _decode_loop(params: Params, cache, logits, request_ids, limit, eos, temperature, top_p, key, *,
                 config: ModelConfig, wise_config: WiseConfig | None, kernel: str, max_new: int,
                 return_logits: bool):
    """Sample from the prefill logits, then decode until every row hit eos or `limit` tokens.
    Returns (tokens int32[batch, max_new], counts int32[batch], logits or None, cache, state)."""
    _TRACES["decode"] += 1
    batch, vocab = logits.shape
    state = _new_state(config, wise_config, cache, batch)
    key, sub = jax.random.split(key)
    token = sample(logits, sub, temperature, top_p)
    out = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(token)
    out_logits = jnp.zeros((batch, max_new, vocab), jnp.float32).at[:, 0].set(logits) if return_logits else None
    done = (request_ids < 0) | (token == eos)
    counts = jnp.ones((batch,), jnp.int32)

    def cond(c):
        i, _, done = c[:3]
        return (i < limit) & ~jnp.all(done)

    def body(c):
        i, token, done, counts, out, out_logits, cache, state, key = c
        logits, cache, state = model.decode_step(params, config, cache, state, token, request_ids, ~done,
                                                 wise_config=wise_config, kernel=kernel)
        key, sub = jax.random.split(key)
        token = sample(logits, sub, temperature, top_p)
        out = out.at[:, i].set(token)
        if return_logits:
            out_logits = out_logits.at[:, i].set(logits)
        counts = counts + (~done).astype(jnp.int32)
        done = done | (token == eos)
        return i + 1, token, done, counts, out, out_logits, cache, state, key

    carry = (jnp.asarray(1, jnp.int32), token, done, counts, out, out_logits, cache, state, key)
    _, _, _, counts, out, out_logits, cache, state, _ = jax.lax.while_loop(cond, body, carry)
    return out, counts, out_logits, cache, state


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel"), donate_argnames=("cache",))
def _forced_loop(params: Params, cache, logits, continuation, limit, *, config: ModelConfig,
                 wise_config: WiseConfig | None, kernel: str):
    """Log-probs of the forced continuation int32[1, n]: the first from the prefill logits, each
    next one from a decode step fed the previous forced token. Returns (float32[n], cache, state)."""
    _TRACES["forced"] += 1
    state = _new_state(config, wise_config, cache, 1)
    request_ids = jnp.zeros((1,), jnp.int32)
    active = jnp.ones((1,), bool)

    def logprob(logits, token):
        return jax.nn.log_softmax(logits[0])[token]

    out = jnp.zeros(continuation.shape[1], jnp.float32).at[0].set(logprob(logits, continuation[0, 0]))

    def body(c):
        i, out, cache, state = c
        logits, cache, state = model.decode_step(params, config, cache, state, continuation[:, i - 1],
                                                 request_ids, active, wise_config=wise_config, kernel=kernel)
        return i + 1, out.at[i].set(logprob(logits, continuation[0, i])), cache, state

    _, out, cache, state = jax.lax.while_loop(lambda c: c[0] < limit, body,
                                              (jnp.asarray(1, jnp.int32), out, cache, state))
    return out, cache, state


def _check_ids(ids: Sequence[int], config: ModelConfig, what: str) -> list[int]:
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"{what} holds token ids {bad[:5]} outside the vocabulary (size {config.vocab_size})")
    return ids


def _setup(config: ModelConfig, wise_config: WiseConfig | None, kernel: str | None, page_size: int) -> str:
    """Validate the decode settings; return the resolved kernel name."""
    if wise_config is not None:
        wise_config.validate_for(config.total_ut_steps)
    block_size = (wise_config or WiseConfig()).block_size
    if not isinstance(page_size, int) or page_size <= 0 or page_size % block_size:
        raise ValueError(f"page_size must be a positive multiple of block_size {block_size}, got {page_size!r}")
    name = kernel if kernel is not None else (wise_config.kernel if wise_config is not None else "auto")
    return resolve_kernel(name)


def _counters(state: ws.WiseState | None, wise_config: WiseConfig | None) -> dict:
    if state is None:
        return {"fallbacks": 0, "density": {}}
    density = np.asarray(state.density())
    return {"fallbacks": int(state.fallbacks),
            "density": {d: float(x) for d, x in zip(wise_config.reuse_depths, density)}}


def _check_pool(cache: kvc.PagedKVCache) -> None:
    if bool(cache.overflowed):
        raise kvc.PoolExhaustedError("a page reservation did not fit the bucket's page pool")


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int] | str], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             eos_token_id: int | None = None, wise_config: WiseConfig | None = None,
             key: jax.Array | None = None, return_logits: bool = False,
             tokenizer: Tokenizer | None = None, page_size: int = DEFAULT_PAGE_SIZE,
             kernel: str | None = None) -> GenerationOutput:
    """Generate up to `max_new_tokens` per prompt; dense decode, or WISE with `wise_config`.

    prompts: token-id lists, or strings when a tokenizer is given or registered for `config`
    (`load_model` registers the checkpoint's; strings are encoded with `tokenizer.encode(s).ids`).
    eos_token_id None -> config.eos_token_id; a row stops after emitting it (-1: never stop).
    temperature 0 is greedy; otherwise sampling with top-p, using `key` (default PRNGKey(0)).
    kernel: decode-attention kernel (default: wise_config.kernel, or 'auto' when dense).
    """
    tokenizer = tokenizer if tokenizer is not None else tokenizer_for(config)
    if isinstance(prompts, str) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of token-id lists or strings")
    encoded = []
    for n, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= or load the model with "
                                 "wise_jax.load_model from a checkpoint that has one")
            prompt = tokenizer.encode(prompt).ids
        encoded.append(_check_ids(prompt, config, f"prompt {n}"))
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    for n, prompt in enumerate(encoded):
        if len(prompt) + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt {n} is too long: {len(prompt)} tokens + max_new_tokens {max_new_tokens} "
                             f"exceeds max_position_embeddings {config.max_position_embeddings}")
    kernel = _setup(config, wise_config, kernel, page_size)
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    eos = -1 if eos is None else int(eos)
    key = jax.random.PRNGKey(0) if key is None else key

    batch = bucket(len(encoded), minimum=1)
    seq = bucket(max(map(len, encoded)))
    max_new = bucket(max_new_tokens)
    max_pages = -(-(seq + max_new) // page_size)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    tokens = np.full((batch, seq), pad, np.int32)
    lengths = np.ones((batch,), np.int32)
    for row, prompt in enumerate(encoded):
        tokens[row, :len(prompt)] = prompt
        lengths[row] = len(prompt)
    request_ids = np.where(np.arange(batch) < len(encoded), np.arange(batch), -1).astype(np.int32)

    traces = sum(_TRACES.values())
    start = time.perf_counter()
    logits, cache = _prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), config=config,
                             page_size=page_size, max_pages=max_pages)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out, counts, out_logits, cache, state = _decode_loop(
        params, cache, logits, jnp.asarray(request_ids), jnp.asarray(max_new_tokens, jnp.int32),
        jnp.asarray(eos, jnp.int32), jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
        key, config=config, wise_config=wise_config, kernel=kernel, max_new=max_new,
        return_logits=return_logits)
    out = np.asarray(out)
    decode_s = time.perf_counter() - start
    _check_pool(cache)

    counts = np.asarray(counts)[:len(encoded)]
    generated = [out[row, :counts[row]].tolist() for row in range(len(encoded))]
    logits_out = None
    if return_logits:
        out_logits = np.asarray(out_logits)
        logits_out = [out_logits[row, :counts[row]] for row in range(len(encoded))]
    texts = None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=True) for t in generated]
    decoded = int((counts - 1).sum())
    stats = {"prefill_s": prefill_s, "decode_s": decode_s,
             "decode_tokens_per_s": decoded / decode_s if decode_s > 0 else 0.0,
             "new_tokens": int(counts.sum()), **_counters(state, wise_config),
             "compiles": sum(_TRACES.values()) - traces, "kernel": kernel,
             "bucket": {"batch": batch, "prompt": seq, "new_tokens": max_new, "page_size": page_size}}
    return GenerationOutput(generated, texts, logits_out, stats)


def teacher_force(params: Params, config: ModelConfig, context_ids: Sequence[int],
                  continuation_ids: Sequence[int], *, wise_config: WiseConfig | None = None,
                  page_size: int = DEFAULT_PAGE_SIZE, kernel: str | None = None) -> ForcedOutput:
    """Prefill `context_ids`, then decode `continuation_ids` forced (the decode step of `generate`).
    Returns per-token log-probs of the continuation and stats (timings, WISE counters)."""
    context = _check_ids(context_ids, config, "context_ids")
    continuation = _check_ids(continuation_ids, config, "continuation_ids")
    if len(context) + len(continuation) > config.max_position_embeddings:
        raise ValueError(f"context ({len(context)}) + continuation ({len(continuation)}) tokens exceed "
                         f"max_position_embeddings {config.max_position_embeddings}")
    kernel = _setup(config, wise_config, kernel, page_size)
    seq, n = bucket(len(context)), bucket(len(continuation))
    max_pages = -(-(seq + n) // page_size)
    tokens = np.zeros((1, seq), np.int32)
    tokens[0, :len(context)] = context
    forced = np.zeros((1, n), np.int32)
    forced[0, :len(continuation)] = continuation

    traces = sum(_TRACES.values())
    start = time.perf_counter()
    logits, cache = _prefill(params, jnp.asarray(tokens), jnp.asarray([len(context)], jnp.int32),
                             config=config, page_size=page_size, max_pages=max_pages)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    logprobs, cache, state = _forced_loop(params, cache, logits, jnp.asarray(forced),
                                          jnp.asarray(len(continuation), jnp.int32), config=config,
                                          wise_config=wise_config, kernel=kernel)
    logprobs = np.asarray(logprobs)[:len(continuation)]
    decode_s = time.perf_counter() - start
    _check_pool(cache)
    stats = {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": len(continuation),
             **_counters(state, wise_config), "compiles": sum(_TRACES.values()) - traces, "kernel": kernel}
    return ForcedOutput(logprobs, stats)
