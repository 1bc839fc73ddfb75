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
import numbers
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
    """logprobs: per sequence float32[len(continuation)], log p(continuation[i] | context,
    continuation[:i]); stats."""

    logprobs: list[np.ndarray]
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
def _forced_loop(params: Params, cache, logits, continuation, limits, request_ids, *, config: ModelConfig,
                 wise_config: WiseConfig | None, kernel: str):
    """Log-probs of forced continuations int32[batch, n] (row b valid up to limits[b]): the first
    from the prefill logits, each next one from a decode step fed the previous forced token.
    Returns (float32[batch, n], cache, state)."""
    _TRACES["forced"] += 1
    batch, n = continuation.shape
    state = _new_state(config, wise_config, cache, batch)

    def logprob(logits, i):
        return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), continuation[:, i, None], axis=1)[:, 0]

    out = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(logprob(logits, 0))

    def body(c):
        i, out, cache, state = c
        active = (i < limits) & (request_ids >= 0)
        logits, cache, state = model.decode_step(params, config, cache, state, continuation[:, i - 1],
                                                 request_ids, active, wise_config=wise_config, kernel=kernel)
        return i + 1, out.at[:, i].set(logprob(logits, i)), cache, state

    _, out, cache, state = jax.lax.while_loop(lambda c: c[0] < jnp.max(limits), body,
                                              (jnp.asarray(1, jnp.int32), out, cache, state))
    return out, cache, state


def _check_ids(ids: Sequence[int], config: ModelConfig, what: str) -> list[int]:
    if not all(isinstance(t, numbers.Integral) for t in ids):
        raise TypeError(f"{what} must be a string or a sequence of integer token ids, got {ids!r:.80}")
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


def _stats(prefill_s: float, prefill_tokens: int, decode_s: float, new_tokens: int, decode_tokens: int,
           state: ws.WiseState | None, wise_config: WiseConfig | None, traces: int, kernel: str) -> dict:
    """The stats dict of generate / teacher_force (the fields of wise_torch's GenerationStats,
    plus compiles and kernel); fallbacks and density are None without WISE."""
    return {"prefill_s": prefill_s, "prefill_tokens": prefill_tokens, "decode_s": decode_s,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "new_tokens": new_tokens,
            "fallbacks": None if state is None else int(state.fallbacks),
            "density": None if state is None else state.density(wise_config),
            "compiles": sum(_TRACES.values()) - traces, "kernel": kernel}


def _check_pool(cache: kvc.PagedKVCache) -> None:
    if bool(cache.overflowed):
        raise kvc.PoolExhaustedError("a page reservation did not fit the bucket's page pool")


def _encode(prompts, config: ModelConfig, tokenizer: Tokenizer | None, what: str) -> list[list[int]]:
    """Token-id lists or strings -> checked token-id lists."""
    if isinstance(prompts, str) or not len(prompts):
        raise ValueError(f"{what} must be a non-empty list of token-id lists or strings")
    encoded = []
    for n, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"string {what} need a tokenizer: pass tokenizer= or load the model with "
                                 "wise_jax.load_model from a checkpoint that has one")
            prompt = tokenizer.encode(prompt).ids
        elif isinstance(prompt, (np.ndarray, jax.Array)):
            prompt = np.asarray(prompt).tolist()
        encoded.append(_check_ids(prompt, config, f"{what}[{n}]"))
    return encoded


def _padded(sequences: list[list[int]], batch: int, width: int, pad: int) -> np.ndarray:
    """Right-padded int32[batch, width]; rows past len(sequences) are a single pad token."""
    out = np.full((batch, width), pad, np.int32)
    for row, ids in enumerate(sequences):
        out[row, :len(ids)] = ids
    return out


def _lengths(sequences: list[list[int]], batch: int) -> np.ndarray:
    out = np.ones((batch,), np.int32)
    out[:len(sequences)] = [len(s) for s in sequences]
    return out


def _request_ids(n: int, batch: int) -> np.ndarray:
    """Row r serves request r; padding rows are -1."""
    return np.where(np.arange(batch) < n, np.arange(batch), -1).astype(np.int32)


class _ConfigEos:
    def __repr__(self) -> str:
        return "<config's eos>"


CONFIG_EOS = _ConfigEos()


def generate(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int] | str], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             eos_token_id: int | None | _ConfigEos = CONFIG_EOS, wise_config: WiseConfig | None = None,
             key: jax.Array | None = None, return_logits: bool = False,
             tokenizer: Tokenizer | None = None, page_size: int = DEFAULT_PAGE_SIZE,
             kernel: str | None = None) -> GenerationOutput:
    """Generate up to `max_new_tokens` per prompt; dense decode, or WISE with `wise_config`.

    prompts: token-id lists, or strings when a tokenizer is given or registered for `config`
    (`load_model` registers the checkpoint's; strings are encoded with `tokenizer.encode(s).ids`).
    A row stops after emitting eos_token_id (default: config.eos_token_id; None: never early).
    temperature 0 is greedy; otherwise sampling with top-p, using `key` (default PRNGKey(0)).
    kernel: decode-attention kernel (default: wise_config.kernel, or 'auto' when dense).
    """
    tokenizer = tokenizer if tokenizer is not None else tokenizer_for(config)
    encoded = _encode(prompts, config, tokenizer, "prompts")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    for n, prompt in enumerate(encoded):
        if len(prompt) + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompts[{n}] is too long: {len(prompt)} tokens + max_new_tokens {max_new_tokens} "
                             f"exceed max_position_embeddings {config.max_position_embeddings}")
    kernel = _setup(config, wise_config, kernel, page_size)
    eos = config.eos_token_id if eos_token_id is CONFIG_EOS else eos_token_id
    eos = -1 if eos is None else int(eos)
    key = jax.random.PRNGKey(0) if key is None else key

    batch, seq, max_new = bucket(len(encoded), minimum=1), bucket(max(map(len, encoded))), bucket(max_new_tokens)
    max_pages = -(-(seq + max_new) // page_size)
    pad = config.pad_token_id if config.pad_token_id is not None else 0

    traces = sum(_TRACES.values())
    start = time.perf_counter()
    logits, cache = _prefill(params, jnp.asarray(_padded(encoded, batch, seq, pad)),
                             jnp.asarray(_lengths(encoded, batch)), config=config, page_size=page_size,
                             max_pages=max_pages)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out, counts, out_logits, cache, state = _decode_loop(
        params, cache, logits, jnp.asarray(_request_ids(len(encoded), batch)),
        jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos, jnp.int32),
        jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32), key,
        config=config, wise_config=wise_config, kernel=kernel, max_new=max_new, return_logits=return_logits)
    out = np.asarray(out)
    decode_s = time.perf_counter() - start
    _check_pool(cache)

    counts = np.asarray(counts)[:len(encoded)]
    tokens = [out[row, :counts[row]].tolist() for row in range(len(encoded))]
    logits_out = None
    if return_logits:
        out_logits = np.asarray(out_logits)
        logits_out = [out_logits[row, :counts[row]] for row in range(len(encoded))]
    texts = None if tokenizer is None else [tokenizer.decode(t) for t in tokens]
    stats = _stats(prefill_s, sum(map(len, encoded)), decode_s, int(counts.sum()), int((counts - 1).sum()),
                   state, wise_config, traces, kernel)
    stats["bucket"] = {"batch": batch, "prompt": seq, "new_tokens": max_new, "page_size": page_size}
    return GenerationOutput(tokens, texts, logits_out, stats)


def teacher_force(params: Params, config: ModelConfig, context_ids, continuation_ids, *,
                  wise_config: WiseConfig | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                  kernel: str | None = None, tokenizer: Tokenizer | None = None) -> ForcedOutput:
    """Prefill each context, then decode its continuation forced (the decode step of `generate`).

    context_ids, continuation_ids: one token-id list (or string) each, or lists of them (one per
    sequence); strings use `tokenizer`, or the one registered for `config` by `load_model`.
    Returns per-sequence log-probs float32[len(continuation)] and stats."""
    tokenizer = tokenizer if tokenizer is not None else tokenizer_for(config)
    single = isinstance(context_ids, str) or (len(context_ids) > 0 and np.ndim(context_ids[0]) == 0)
    contexts = _encode([context_ids] if single else context_ids, config, tokenizer, "context_ids")
    continuations = _encode([continuation_ids] if single else continuation_ids, config, tokenizer,
                            "continuation_ids")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    for n, (a, b) in enumerate(zip(contexts, continuations)):
        if len(a) + len(b) > config.max_position_embeddings:
            raise ValueError(f"context_ids[{n}] ({len(a)} tokens) + continuation ({len(b)}) exceed "
                             f"max_position_embeddings {config.max_position_embeddings}")
    kernel = _setup(config, wise_config, kernel, page_size)
    batch = bucket(len(contexts), minimum=1)
    seq, n = bucket(max(map(len, contexts))), bucket(max(map(len, continuations)))
    max_pages = -(-(seq + n) // page_size)

    traces = sum(_TRACES.values())
    start = time.perf_counter()
    logits, cache = _prefill(params, jnp.asarray(_padded(contexts, batch, seq, 0)),
                             jnp.asarray(_lengths(contexts, batch)), config=config, page_size=page_size,
                             max_pages=max_pages)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    limits = np.zeros((batch,), np.int32)
    limits[:len(continuations)] = [len(c) for c in continuations]
    logprobs, cache, state = _forced_loop(params, cache, logits, jnp.asarray(_padded(continuations, batch, n, 0)),
                                          jnp.asarray(limits), jnp.asarray(_request_ids(len(contexts), batch)),
                                          config=config, wise_config=wise_config, kernel=kernel)
    logprobs = np.asarray(logprobs)
    decode_s = time.perf_counter() - start
    _check_pool(cache)
    scored = sum(map(len, continuations))
    return ForcedOutput([logprobs[row, :len(c)] for row, c in enumerate(continuations)],
                        _stats(prefill_s, sum(map(len, contexts)), decode_s, scored, scored - len(contexts),
                               state, wise_config, traces, kernel))
