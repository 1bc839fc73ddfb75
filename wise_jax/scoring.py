"""Forced and greedy decoding as pure, jittable functions over the paged functional API.

    out = wise_jax.score(params, config, context_ids, continuation_ids, wise_config=WiseConfig())
    out.logprobs            # float32[batch, m]: log p(continuation[:, i] | context, continuation[:, :i])
    out.density()           # float32[n_reuse]: selected / causal blocks of each reuse depth
    jax.grad(lambda p: wise_jax.score(p, config, c, x).logprobs.sum())(params)

The contexts are prefilled into a paged cache, a row each, by the engine's prefill program
(`chunked_prefill.prefill_chunks`); then one jitted `lax.scan` runs `model.decode_step` (the
unstacked layers, as the engine decodes) over the continuation, fed the continuation's tokens
(`score`) or each step's argmax (`greedy`). These are the engine's programs at the shapes
`teacher_force` runs them, so in float32 `score` gives `teacher_force`'s log-probs bitwise and
`greedy` the tokens of `generate(..., eos_token_id=None)` (tests/wise_jax/test_scoring.py),
when called as they are: inside another jit (or with traced context_lengths, which size the
prefill by context_ids' width) the programs differ and the results are equal within float32
rounding. Both differentiate (`jax.grad` through the model,
dense or WISE). A call compiles once per (shapes,
config, WiseConfig, page_size, kernel): an equal WiseConfig -- a rule equal by value, a `Custom`
of the same function -- reuses the compilation (`TRACES` counts them).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wise_core.buckets import context_bucket, context_buckets
from wise_core.model_config import ModelConfig
from wise_core.wise_config import WiseConfig
from wise_jax import checks
from wise_jax import chunked_prefill
from wise_jax import kv_cache as kvc
from wise_jax import model
from wise_jax import wise_state as ws
from wise_jax.attention import resolve_kernel
from wise_jax.params import Params, unstack_layers
from wise_jax.generation import pool_bucket
from wise_jax.serving import DEFAULT_PAGE_SIZE

TRACES: collections.Counter = collections.Counter()
"""Traces (= compilations) of the programs of `score` and `greedy`: "prefill" (the contexts),
"score" and "greedy" (the decode)."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logprobs", "tokens", "selected_blocks", "causal_blocks", "step_selected",
                                "step_causal", "fallbacks"], meta_fields=[])
@dataclasses.dataclass
class Decoded:
    """A forced or greedy decode of `batch` rows over m tokens.

    logprobs float32[batch, m]: log p of each token given the context and the tokens before it
    (float32 log_softmax of the logits, as the engine's); tokens int32[batch, m]: the tokens
    (the continuation, or the greedy choices). Under WISE (else None): selected_blocks,
    causal_blocks float32[n_reuse], in reuse_depths order: the WiseState counters after the
    decode (summed over rows, layers and heads: the blocks each reuse depth attended -- all
    causal blocks on a fallback -- and the causal blocks; what `teacher_force`'s stats.density
    divides); step_selected, step_causal float32[m - 1, n_reuse]: the same counts of each
    decode step (step i decodes token i and scores token i + 1; token 0 comes from the dense
    prefill); fallbacks int32[]: (token, layer) pairs that fell back to dense."""

    logprobs: jax.Array
    tokens: jax.Array
    selected_blocks: jax.Array | None
    causal_blocks: jax.Array | None
    step_selected: jax.Array | None
    step_causal: jax.Array | None
    fallbacks: jax.Array | None

    def density(self) -> jax.Array | None:
        """float32[n_reuse]: selected / causal blocks of each reuse depth over the decode (NaN
        where none was counted); None for a dense decode."""
        if self.selected_blocks is None:
            return None
        return self.selected_blocks / self.causal_blocks

    def step_density(self) -> jax.Array | None:
        """float32[m - 1, n_reuse]: each decode step's density (NaN where it counted none)."""
        if self.step_selected is None:
            return None
        return self.step_selected / self.step_causal


def _rows(ids, what: str) -> jax.Array:
    """Token ids [n] or [batch, n] -> int32[batch, n] (a named error for anything else)."""
    if isinstance(ids, (list, tuple)):
        ids = np.asarray(ids)
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or ids.ndim not in (1, 2) or ids.shape[-1] < 1:
        raise ValueError(f"{what} must be non-empty integer token ids [n] or [batch, n], got "
                         f"{checks.described(ids)}")
    ids = jnp.asarray(ids, jnp.int32)
    return ids if ids.ndim == 2 else ids[None]


def _checked(params, config: ModelConfig, context_ids, context_lengths, wise_config, page_size: int, kernel,
             tokens: int) -> tuple:
    """The arguments of `score` / `greedy` checked and normalised -> (context int32[batch, n],
    lengths int32[batch], the kernel's name); `tokens`: the tokens to decode after the context."""
    checks.params(params, config)
    context = _rows(context_ids, "context_ids")
    batch, n = context.shape
    if context_lengths is None:
        lengths = jnp.full((batch,), n, jnp.int32)
    else:
        lengths = jnp.asarray(context_lengths)
        if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.shape != (batch,):
            raise ValueError(f"context_lengths must be integers [batch={batch}], got {checks.described(lengths)}")
        lengths = lengths.astype(jnp.int32)
    model.check_input_ids(config, context, 2)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if n + tokens > config.max_position_embeddings:
        raise ValueError(f"a context of {n} tokens + {tokens} decoded exceed max_position_embeddings "
                         f"({config.max_position_embeddings})")
    known = _concrete(lengths)
    if known is not None and ((known < 1) | (known > n)).any():
        raise ValueError(f"context_lengths must be in [1, {n}] (context_ids' width), got {known.tolist()}")
    if wise_config is not None:
        checks.wise_config_for(wise_config, config, page_size)
    kernel = resolve_kernel(kernel, config.head_dim)
    return context, lengths, kernel


def score(params: Params, config: ModelConfig, context_ids, continuation_ids, wise_config: WiseConfig | None = None,
          *, context_lengths=None, page_size: int = DEFAULT_PAGE_SIZE, kernel: str = "auto") -> Decoded:
    """Teacher-force `continuation_ids` after `context_ids` -> `Decoded` (its logprobs and, under
    WISE, the reuse depths' block counts).

    context_ids int[batch, n] (or [n]: batch 1), each row's context its first context_lengths[b]
    tokens (int[batch], default n; traced is fine); continuation_ids int[batch, m] (or [m]), m >= 1.
    Dense when wise_config is None. kernel: the decode-attention kernel ("auto", "reference",
    "pallas": `wise_jax.attention.resolve_kernel`). Pure: jit it with config and wise_config
    static, or differentiate it (params may be traced). Every argument is checked first
    (`wise_jax.checks`; token ids by value when they are concrete)."""
    continuation = _rows(continuation_ids, "continuation_ids")
    context, lengths, kernel = _checked(params, config, context_ids, context_lengths, wise_config, page_size, kernel,
                                        continuation.shape[1])
    if continuation.shape[0] != context.shape[0]:
        raise ValueError(f"context_ids hold {context.shape[0]} rows, continuation_ids {continuation.shape[0]}")
    model.check_input_ids(config, continuation, 2)
    return _decode(unstack_layers(params), context, lengths, continuation, config=config, wise_config=wise_config,
                   page_size=page_size, kernel=kernel, steps=continuation.shape[1])


def greedy(params: Params, config: ModelConfig, context_ids, num_tokens: int, wise_config: WiseConfig | None = None,
           *, context_lengths=None, page_size: int = DEFAULT_PAGE_SIZE, kernel: str = "auto") -> Decoded:
    """Greedy decoding of `num_tokens` tokens after each context (no stop token) -> `Decoded`:
    .tokens int32[batch, num_tokens], .logprobs their log p. Arguments as `score`'s."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    context, lengths, kernel = _checked(params, config, context_ids, context_lengths, wise_config, page_size, kernel,
                                        num_tokens)
    return _decode(unstack_layers(params), context, lengths, None, config=config, wise_config=wise_config,
                   page_size=page_size, kernel=kernel, steps=num_tokens)


def _decode(params: Params, context, lengths, continuation, *, config: ModelConfig, wise_config, page_size: int,
            kernel: str, steps: int) -> Decoded:
    """`steps` tokens after each context (continuation int32[batch, steps] forced, or None:
    greedy) -> Decoded, by the engine's programs at the shapes `teacher_force` runs them
    (`generation._engine`): rows the batch rounded up to a power of two (the rows past it
    empty), each row the pages of the engine's max_model_len, the contexts prefilled in one
    program (`_prefill`: `chunked_prefill.prefill_chunks` into the cache) at the
    context bucket of the longest, then `_forced`. params: unstacked (`unstack_layers`), each
    layer's weights an argument of their own, as the engine's programs take them (slices of
    stacked weights made inside a program compile to other code, whose float32 results may
    differ in the last bit)."""
    batch, n = context.shape
    rows = 1 << (batch - 1).bit_length()
    pages = kvc.pages_for(min(pool_bucket(kvc.pages_for(n + steps, page_size)) * page_size,
                              config.max_position_embeddings), page_size)
    known = _concrete(lengths)
    longest = n if known is None else int(known.max())
    seq = context_bucket(context_buckets(pages), kvc.pages_for(longest, page_size)) * page_size
    tokens = jnp.zeros((rows, max(seq, n)), jnp.int32).at[:batch, :n].set(context)[:, :seq]
    lengths = jnp.zeros((rows,), jnp.int32).at[:batch].set(lengths)
    cache = kvc.create(config, batch=rows, max_pages=pages, num_pages=rows * pages, page_size=page_size,
                       dtype=params.embed_tokens.dtype)
    cache, _ = kvc.try_reserve(cache, lengths)
    logits, cache = _prefill(params, cache, tokens, lengths, cache.page_table[:, :seq // page_size], config=config)
    if continuation is not None:
        continuation = jnp.zeros((rows, steps), jnp.int32).at[:batch].set(continuation)
    out = _forced(params, cache, logits, continuation, jnp.arange(rows) < batch, config=config,
                  wise_config=wise_config, kernel=kernel, steps=steps)
    return dataclasses.replace(out, logprobs=out.logprobs[:batch], tokens=out.tokens[:batch])


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill(params: Params, cache: kvc.PagedKVCache, tokens, lengths, tables, *, config: ModelConfig):
    """The engine's prefill step program (`engine.programs.prefill`) of prompts that each start
    at position 0: tokens int32[rows, seq] (row r valid up to lengths[r]), tables int32[rows,
    seq / page_size] -> (logits float32[rows, vocab] after each prompt, the cache written)."""
    TRACES["prefill"] += 1
    logits, written = chunked_prefill.prefill_chunks(params, config, cache, tokens, jnp.zeros_like(lengths), lengths,
                                                     tables, attention="auto")
    return logits, dataclasses.replace(cache, k=written.k, v=written.v)


def _concrete(x) -> np.ndarray | None:
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _pick(logits, forced):
    """(token, its log p) of float32[batch, vocab] logits: the forced token (None: the argmax)."""
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32) if forced is None else forced
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=1)[:, 0]
    return token, logprob


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel", "steps"))
def _forced(params: Params, cache: kvc.PagedKVCache, logits, continuation, live, *, config: ModelConfig,
            wise_config, kernel: str, steps: int) -> Decoded:
    """The decode of `steps` tokens (the first from the prefill's logits float32[rows, vocab])
    over `cache`, one row per context (live bool[rows]; the others empty: masked no-ops), in a
    `lax.scan`; the WISE state tags a row's supports with its row and position."""
    TRACES["greedy" if continuation is None else "score"] += 1
    rows = logits.shape[0]
    state = None if wise_config is None else ws.create(
        wise_config, slots=rows, layers=config.num_hidden_layers, heads=config.num_attention_heads,
        max_blocks=cache.max_pages * cache.page_size // wise_config.block_size)
    tags = jnp.where(live, jnp.arange(rows, dtype=jnp.int32), -1)
    first, first_logprob = _pick(logits, None if continuation is None else continuation[:, 0])

    def step(carry, forced):
        cache, state, token = carry
        logits, cache, state = model.decode_step(params, config, cache, state, token, tags, wise_config=wise_config,
                                                 kernel=kernel)
        token, logprob = _pick(logits, forced)
        counts = None if state is None else (state.selected_blocks, state.causal_blocks)
        return (cache, state, token), (token, logprob, counts)

    forced = None if continuation is None else continuation[:, 1:].T
    (_, state, _), (tokens, logprobs, counts) = lax.scan(step, (cache, state, first), forced, length=steps - 1)
    tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
    logprobs = jnp.concatenate([first_logprob[:, None], logprobs.T], axis=1)
    if state is None:
        return Decoded(logprobs, tokens, None, None, None, None, None)
    before = [jnp.concatenate([jnp.zeros_like(c[:1]), c[:-1]]) for c in counts]   # the counters before each step
    return Decoded(logprobs, tokens, state.selected_blocks, state.causal_blocks, counts[0] - before[0],
                   counts[1] - before[1], state.fallbacks)
