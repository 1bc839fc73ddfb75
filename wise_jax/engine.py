"""A small serving engine over `wise_jax.serving`: requests wait, are admitted into cache rows
(slots), decode together one token per step, and retire; the names mirror wise_torch's engine.

    llm = LLM(params, config, wise_config=WiseConfig(), max_num_seqs=64, max_model_len=2048)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=64))
    rid = llm.add_request(prompt, SamplingParams(...)); while llm.has_unfinished(): llm.step()

Scheduling. A step either admits (prefills) every waiting request that fits, oldest first, and
returns their first tokens, or decodes one token for every running request. A request is
admitted when a slot is free and the pages of its whole lifetime (prompt + max_tokens - 1 keys)
fit beside those of the running requests, so a running request never meets a full pool (pages
are still taken from the pool only as it grows); nothing is preempted (wise_torch's engine
preempts instead). A request that can never fit is a ValueError at `add_request`. A prompt is
prefilled whole (no chunking) in the step that admits it.

The step. One jit-compiled program per batch bucket, context bucket (`wise_core.buckets`) and
greedy / sampling, compiled lazily, the first time a step needs it. The batch bucket is the
smallest of 1, 2, 4, 8, 16, 32, ... holding the highest occupied slot (slots are taken lowest
first), so a step runs the rows in use, not max_num_seqs; the context bucket is the page-table
width of the longest running row after the step, a power-of-two rung, so a step costs what its
live context needs, not what max_model_len allows. The step runs `model.decode_step` (over a
mesh, `sharding.decode_step`: the heads split over its "tp" axis) over the bucket's rows (empty
ones are masked no-ops), sampling on the device (per row: temperature, top-p, its own PRNG
key), the stop rule (max_tokens, eos), and the release of finished rows' pages; the sampled
tokens stay on the device as the next step's input, and the host reads them
once per step (stop_token_ids are the host's: such a row is released before the next step).
The cache (`rows = max_num_seqs`) and the WISE state are created once per engine and donated to
every step. A pool that runs out anyway (a broken invariant) raises PoolExhaustedError in the
step that met it, which wrote nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from wise_core.buckets import batch_bucket, context_bucket, context_buckets, decode_buckets
from wise_core.config import ModelConfig, WiseConfig
from wise_core.detokenize import TextStream
from wise_core.generate_args import check_seed
from wise_core.request import (MAX_SEED, EngineStats, RequestOutput, SamplingParams,  # noqa: F401 (its names)
                               add_all, prompts_with_params)
from wise_core.tokenizer import encode_text
from wise_jax import kv_cache as kvc
from wise_jax import serving
from wise_jax import sharding
from wise_jax import wise_state as ws
from wise_jax.attention import resolve_kernel
from wise_jax.loading import load_model
from wise_jax.params import Params, stack_layers, unstack_layers
from wise_jax.sampling import sample
from wise_jax.serving import DEFAULT_PAGE_SIZE, TRACES

CPU_POOL_BYTES = 1 << 30       # num_pages=None on a CPU: a pool of at most 1 GiB
# num_pages=None on a GPU: the pool fills this share of the memory jax may allocate, less what is
# in use. XLA still warns that it cannot rematerialize a program below its limit (on an H200,
# 2026-12-04: 211.6 GiB counted against 123.9 GiB, as if the donated pool were held twice;
# benchmarks/results/h200-2026-12-04/README.md); the warning costs compile time, not memory.
GPU_POOL_FRACTION = 0.7


def seed_key(seed: int) -> jax.Array:
    """A raw PRNG key for a seed in [0, 2**63) (jax.random.PRNGKey keeps only the low 32 bits)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), seed >> 32)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "tokens", "remaining", "eos", "temperature", "top_p", "top_k", "min_p",
                                "keys"],
                   meta_fields=[])
@dataclasses.dataclass
class Batch:
    """Per cache row, on the device: slots int32 (request id, -1 empty); tokens int32 (the next
    decode input); remaining int32 (tokens the row may still emit); eos int32 (-1: none);
    temperature, top_p, min_p float32, top_k int32 (SamplingParams); keys uint32[rows, 2] (raw PRNG
    keys)."""

    slots: jax.Array
    tokens: jax.Array
    remaining: jax.Array
    eos: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    keys: jax.Array


def _empty_batch(rows: int) -> Batch:
    return Batch(slots=jnp.full((rows,), -1, jnp.int32), tokens=jnp.zeros((rows,), jnp.int32),
                 remaining=jnp.zeros((rows,), jnp.int32),
                 eos=jnp.full((rows,), -1, jnp.int32), temperature=jnp.zeros((rows,), jnp.float32),
                 top_p=jnp.ones((rows,), jnp.float32), top_k=jnp.zeros((rows,), jnp.int32),
                 min_p=jnp.zeros((rows,), jnp.float32), keys=jnp.zeros((rows, 2), jnp.uint32))


def _choose(logits, keys, temperature, filters, forced, *, sampling: bool):
    """Per row: the forced token where forced >= 0, else a sample (greedy where temperature is 0;
    with sampling=False every row is greedy and no sampling code runs); filters: (top_p, top_k,
    min_p) per row. Returns (token int32[rows],
    its log-prob float32[rows], the rows' next keys)."""
    split = jax.vmap(jax.random.split)(keys)                   # [rows, 2, 2]
    keys, sub = split[:, 0], split[:, 1]
    if sampling:
        sampled = jax.vmap(lambda l, k, t, p, tk, mp: sample(l[None], k, t, p, tk, mp)[0])(
            logits, sub, temperature, *filters)
    else:
        sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token = jnp.where(forced >= 0, forced, sampled)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=1)[:, 0]
    return token, logprob, keys


@functools.partial(jax.jit, static_argnames=("sampling",))
def _first_token(logits, key, temperature, filters, forced, *, sampling: bool):
    """_choose for one prefilled request: logits float32[vocab], filters (top_p, top_k, min_p)
    scalars -> (token, logprob, next key)."""
    TRACES["first_token"] += 1
    token, logprob, keys = _choose(logits[None], key[None], temperature[None], [f[None] for f in filters],
                                   forced[None], sampling=sampling)
    return token[0], logprob[0], keys[0]


@functools.partial(jax.jit, donate_argnames=("cache", "batch"))
def _admit(cache: kvc.PagedKVCache, batch: Batch, kv: serving.RequestKV, slot, row: Batch):
    """Insert a prefilled request into the empty row `slot` and set its Batch row (`row`: a Batch
    of scalars)."""
    TRACES["admit"] += 1
    cache = kvc.insert(cache, kv.k, kv.v, kv.length, slot)
    batch = jax.tree.map(lambda whole, one: whole.at[slot].set(one), batch, row)
    return cache, batch


@functools.partial(jax.jit, donate_argnames=("cache", "batch"))
def _release(cache: kvc.PagedKVCache, batch: Batch, slot):
    """Empty row `slot` (an abort, or a stop token the device does not watch for)."""
    TRACES["release"] += 1
    rows = jnp.arange(batch.slots.shape[0]) == slot
    return kvc.release(cache, rows), dataclasses.replace(batch, slots=jnp.where(rows, -1, batch.slots))


def _take_rows(cache: kvc.PagedKVCache, state, batch: Batch, forced, rows: int):
    """The first `rows` cache rows: their page table, lengths, WISE state and Batch rows (the
    K/V storage, the free-page stack and the counters are shared by every row)."""
    cache = dataclasses.replace(cache, page_table=cache.page_table[:rows], seq_lens=cache.seq_lens[:rows])
    if state is not None:
        state = dataclasses.replace(state, support=state.support[:, :rows], tag_request=state.tag_request[:, :rows],
                                    tag_position=state.tag_position[:, :rows], depths_run=state.depths_run[:, :rows])
    return cache, state, jax.tree.map(lambda x: x[:rows], batch), forced[:rows]


def _put_rows(whole: tuple, cache: kvc.PagedKVCache, state, batch: Batch):
    """Write the first rows (`_take_rows`, after a step) back into the whole (cache, state, batch)."""
    whole_cache, whole_state, whole_batch = whole
    rows = cache.seq_lens.shape[0]
    cache = dataclasses.replace(cache, page_table=whole_cache.page_table.at[:rows].set(cache.page_table),
                                seq_lens=whole_cache.seq_lens.at[:rows].set(cache.seq_lens))
    if state is not None:
        state = dataclasses.replace(state, **{
            name: getattr(whole_state, name).at[:, :rows].set(getattr(state, name))
            for name in ("support", "tag_request", "tag_position", "depths_run")})
    return cache, state, jax.tree.map(lambda w, x: w.at[:rows].set(x), whole_batch, batch)


@functools.partial(jax.jit, static_argnames=("config", "wise_config", "kernel", "unroll", "sampling", "keep_logits",
                                             "mesh", "rows", "width"),
                   donate_argnames=("cache", "state", "batch"))
def _step(params: Params, cache: kvc.PagedKVCache, state, batch: Batch, forced, *, config: ModelConfig,
          wise_config: WiseConfig | None, kernel: str, unroll, sampling: bool, keep_logits: bool, mesh=None,
          rows: int, width: int):
    """One decode step of the first `rows` rows, the batch bucket (module docstring; the rows
    past it are empty). forced int32[all rows]: a token to take instead of sampling (-1:
    sample). Returns (cache, state, batch, (token, logprob, done, overflowed, logits or None)),
    the outputs per row of the bucket; overflowed: the pool ran out (in this step or before), and
    this step wrote nothing."""
    TRACES["step"] += 1
    whole = (cache, state, batch)
    cache, state, batch, forced = _take_rows(cache, state, batch, forced, rows)
    logits, cache, state = sharding.decode_step(params, config, cache, state, batch.tokens, batch.slots,
                                                wise_config=wise_config, kernel=kernel, unroll=unroll, mesh=mesh,
                                                width=width)
    live = (batch.slots >= 0) & ~cache.overflowed
    token, logprob, keys = _choose(logits, batch.keys, batch.temperature, (batch.top_p, batch.top_k, batch.min_p),
                                   forced, sampling=sampling)
    remaining = batch.remaining - live.astype(jnp.int32)
    done = live & ((remaining <= 0) | (token == batch.eos))
    cache = kvc.release(cache, done)
    batch = dataclasses.replace(
        batch, slots=jnp.where(done, -1, batch.slots), tokens=jnp.where(live, token, batch.tokens),
        remaining=jnp.where(live, remaining, batch.remaining), keys=jnp.where(live[:, None], keys, batch.keys))
    cache, state, batch = _put_rows(whole, cache, state, batch)
    return cache, state, batch, (token, logprob, done, cache.overflowed, logits if keep_logits else None)


class _Request:
    """A request's host-side record. Its lifetime reservation: the keys it holds at most, prompt
    + max_tokens - 1 (the last token is never fed back)."""

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, eos: int, key: np.ndarray,
                 forced: list[int] | None, keep_logits: bool, page_size: int):
        self.id, self.prompt, self.params, self.eos, self.key = rid, prompt, params, eos, key
        self.forced, self.keep_logits = forced, keep_logits
        self.max_tokens = len(forced) if forced is not None else params.max_tokens
        self.pages = -(-(len(prompt) + self.max_tokens - 1) // page_size)
        self.tokens: list[int] = []
        self.dispatched = 0                      # tokens asked of the device (read or in flight)
        self.logprobs: list[float] = []
        self.logits: list[np.ndarray] = []
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text: TextStream | None = None      # its text, when stop strings are watched

    @property
    def sampling(self) -> bool:
        return self.forced is None and self.params.temperature > 0

    def add(self, token: int, logprob: float, logits) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.keep_logits:
            self.logits.append(np.asarray(logits))
        if self.text is not None and self.forced is None:
            self.text.add([token])
        if self.forced is None and (token == self.eos or token in self.params.stop_token_ids):
            self.finish_reason = "stop"
            self.stop_reason = None if token == self.eos else token
        elif self.text is not None and self.text.stopped:
            self.finish_reason, self.stop_reason = "stop", self.text.stop_reason
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"

    def next_forced(self) -> int:
        """The forced token of the next token asked of the device (-1: none)."""
        return self.forced[self.dispatched] if self.forced is not None and self.finish_reason is None else -1

    def output(self, tokenizer) -> RequestOutput:
        logprobs = list(self.logprobs) if self.params.logprobs or self.forced is not None else None
        cut = self.text.text if self.text is not None and self.text.stopped else None
        return RequestOutput(self.id, self.prompt, list(self.tokens), self.finish_reason is not None,
                             self.finish_reason, logprobs, tokenizer, self.stop_reason, cut)


class LLM:
    """The engine (module docstring).

    params, config: the model (`wise_jax.load_model`), or params a checkpoint directory or
    built-in model name and config None (loaded here with its tokenizer, in `dtype`: None is
    bfloat16 on a GPU, float32 otherwise); wise_config: WISE decode (None: dense);
    num_pages: pages in the pool (None: 70 % of the device memory less what is in use on a GPU, at most 1 GiB on
    a CPU, and never more than max_num_seqs * max_pages); page_size: tokens per page, a multiple
    of the WISE block size; max_num_seqs: cache rows (a step runs its batch bucket of them);
    max_model_len: prompt + output tokens a request may hold (None:
    config.max_position_embeddings); it sets the widest page table (a step reads only its
    context bucket); kernel: decode attention ('auto', 'reference',
    'pallas'; default wise_config.kernel or 'auto'); tokenizer: for string prompts and texts;
    attention: prefill attention (`wise_jax.prefill_attention`); layers: "unstacked" (default)
    decodes with one weight buffer per layer (`params.unstack_layers`: straight-line code, no
    per-layer weight copies; the engine makes that copy of stacked params once, and its decode
    step compiles slower) or "stacked" (a scan over the stacked weights), for params not yet
    in a mesh layout; unroll: layers per scan step of prefill and of a stacked decode step
    (True: all); seed: the key of requests without their own seed (None: a random one); mesh: a jax.sharding.Mesh with axis "tp" to shard the heads, the K/V
    pages and the WISE supports over (`wise_jax.sharding`; every device holds num_pages pages of
    its KV heads; `params` is then kept in the mesh layout, a `sharding.MeshParams`).
    """

    def __init__(self, params: Params | str | Path, config: ModelConfig | None = None, *,
                 wise_config: WiseConfig | None = None, num_pages: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, max_num_seqs: int = 64, max_model_len: int | None = None,
                 kernel: str | None = None, tokenizer: Tokenizer | None = None, attention: str = "auto",
                 layers: str = "unstacked", unroll: int | bool = 1, seed: int | None = None, mesh=None,
                 dtype=None):
        if isinstance(params, (str, Path)):
            if config is not None:
                raise ValueError("config comes from the checkpoint when the model is given by name or directory")
            if dtype is None:
                dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
            config, params, found = load_model(params, dtype=dtype, with_tokenizer=True,
                                               layers="unstacked" if layers == "unstacked" and mesh is None
                                               else "stacked")
            tokenizer = found if tokenizer is None else tokenizer
        elif dtype is not None:
            raise ValueError("dtype applies to a model loaded by name; these params are already built")
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        per_device = config if mesh is None else sharding.local_config(config, sharding.tp_size(mesh))
        if wise_config is not None:
            if not isinstance(wise_config, WiseConfig):
                raise TypeError(f"wise_config must be a WiseConfig or None, got {type(wise_config).__name__}")
            wise_config.validate_for(config.total_ut_steps)
        block_size = (wise_config or WiseConfig()).block_size
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 or page_size % block_size:
            raise ValueError(f"page_size must be a positive multiple of block_size {block_size}, got {page_size!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("num_pages", num_pages)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        seed = check_seed(seed)
        if layers not in ("unstacked", "stacked"):
            raise ValueError(f"layers must be 'unstacked' or 'stacked', got {layers!r}")
        dtype = (params.params if isinstance(params, sharding.MeshParams) else params).embed_tokens.dtype
        if mesh is not None:
            params = sharding.shard_params(config, params, mesh)
            if layers == "unstacked":
                params = sharding.unstack_mesh_params(params, mesh)
        elif isinstance(params, Params):   # MeshParams without a mesh: the step says what is wrong
            params = unstack_layers(params) if layers == "unstacked" else stack_layers(params)
        self.params, self.config, self.wise_config, self.tokenizer = params, config, wise_config, tokenizer
        self.mesh = mesh
        self.kernel = resolve_kernel(kernel if kernel is not None else (wise_config.kernel if wise_config else "auto"))
        self.page_size, self.attention, self.unroll = page_size, attention, unroll
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.max_pages = -(-self.max_model_len // page_size)
        self.widths = context_buckets(self.max_pages)
        self.row_buckets = decode_buckets(max_num_seqs)
        self._programs: set[tuple] = set()     # decode programs made: (sampling, keep_logits, rows, width)
        self._build_s = 0.0
        self.pool_sizing = f"num_pages={num_pages} as given"
        if num_pages is None:
            num_pages, self.pool_sizing = _default_num_pages(per_device, page_size, dtype, max_num_seqs * self.max_pages)
        self.num_pages = num_pages
        self.cache = sharding.create_cache(config, mesh, batch=max_num_seqs, max_pages=self.max_pages,
                                           num_pages=self.num_pages, page_size=page_size, dtype=dtype)
        self.state = None if wise_config is None else sharding.create_state(
            wise_config, mesh, slots=max_num_seqs, layers=config.num_hidden_layers, heads=config.num_attention_heads,
            max_blocks=self.cache.capacity // wise_config.block_size)
        self.batch = _empty_batch(max_num_seqs)
        self._sample_only = jnp.full((max_num_seqs,), -1, jnp.int32)
        self._free_slots = list(range(max_num_seqs))
        self._committed = 0
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}          # slot -> request
        self._requests: dict[int, _Request] = {}
        self._inflight = None                            # (outputs, rows) of the step launched last
        self._next_id = 0
        self._seed = random.randrange(MAX_SEED) if seed is None else seed
        self.reset_stats()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
                    forced: list[int] | None = None, keep_logits: bool = False) -> int:
        """Queue a request (token ids, or a string with a tokenizer) -> its request id. A request
        that can never fit (longer than max_model_len or the whole pool) is a ValueError here.
        forced: tokens fed instead of sampled ones, each scored (teacher forcing); keep_logits:
        keep each step's float32 logits."""
        return self._add(prompt, params, forced=forced, keep_logits=keep_logits)

    def _add(self, prompt, params: SamplingParams | None, *, forced=None, keep_logits=False,
             key: jax.Array | None = None) -> int:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = encode(prompt, self.config, self.tokenizer, "prompt")
        if forced is not None:
            forced = serving.check_ids(forced, self.config, "the forced continuation")
        rid = self._next_id
        if key is None:
            key = seed_key(params.seed) if params.seed is not None else jax.random.fold_in(seed_key(self._seed), rid)
        eos = -1 if params.ignore_eos or forced is not None or self.config.eos_token_id is None \
            else self.config.eos_token_id
        request = _Request(rid, ids, params, eos, np.asarray(key, np.uint32), forced, keep_logits, self.page_size)
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer, and this engine has none")
            request.text = TextStream(self.tokenizer, params.stop)
        limit = min(self.max_model_len, self.config.max_position_embeddings)
        if len(ids) + request.max_tokens > limit:
            raise ValueError(f"the request needs {len(ids)} prompt + {request.max_tokens} new tokens, more than "
                             f"{'max_model_len' if limit == self.max_model_len else 'max_position_embeddings'} "
                             f"({limit})")
        if request.pages > self.num_pages:
            raise ValueError(f"the request needs {request.pages} pages of {self.page_size} tokens, more than the "
                             f"pool's {self.num_pages}")
        self._next_id += 1
        self._waiting.append(request)
        self._requests[rid] = request
        return rid

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now and free its pages; its output so far, finish_reason 'abort'."""
        request = self._requests.get(request_id)
        if request is None or request.finish_reason is not None:
            raise KeyError(f"no unfinished request {request_id}")
        if request.slot is None:
            self._waiting.remove(request)
        else:
            self._free_row(request)
        request.finish_reason = "abort"
        self._retire(request)
        return request.output(self.tokenizer)

    def output(self, request_id: int) -> RequestOutput:
        """An unfinished request's output so far (a finished one's final output came from `step`)."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request {request_id}")
        return request.output(self.tokenizer)

    # -- the loop ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._inflight)

    def step(self) -> list[RequestOutput]:
        """Admit what fits, or else decode one token for every running request. Returns the
        requests that produced a token or finished.

        The host trails the device by one step: a decode step is launched before the previous
        one's tokens are read, so the host's bookkeeping runs while the device decodes. Rows the
        device finished (max_tokens, eos) are masked in the step already launched; a request
        that stops on a stop id, or is aborted, computes one more token there, which is dropped.
        Admission first reads the step in flight, and launches the next decode step when nothing
        more can be admitted."""
        produced = []
        if self._waiting and self._inflight is not None:
            produced = self._read(self._inflight)      # free slots and pages as the device has them
            self._inflight = None
        if self._waiting and self._fits(self._waiting[0]):
            produced += [r.output(self.tokenizer) for r in self._admit_waiting()]
            if not (self._waiting and self._fits(self._waiting[0])):
                self._inflight = self._launch()        # the running requests' next token, under way
            return produced
        start = time.perf_counter()
        launched = self._launch()
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            produced += self._read(previous)
        if launched is not None or previous is not None:
            self._decode_s += time.perf_counter() - start
        return produced

    def _launch(self):
        """Dispatch a decode step for the rows that may still produce a token; (outputs, rows)
        or None when none may."""
        rows = [(slot, r) for slot, r in self._running.items()
                if r.finish_reason is None and r.dispatched < r.max_tokens]
        if not rows:
            return None
        forced = self._sample_only
        if any(r.forced is not None for _, r in rows):
            host = np.full(self.batch.slots.shape, -1, np.int32)
            for slot, r in rows:
                host[slot] = r.next_forced()
            forced = jnp.asarray(host)
        # The keys of each row once this step appended its token: prompt + tokens fed so far.
        width = context_bucket(self.widths, max(-(-(len(r.prompt) + r.dispatched) // self.page_size) for _, r in rows))
        for _, r in rows:
            r.dispatched += 1
        program = dict(sampling=any(r.sampling for _, r in rows), keep_logits=any(r.keep_logits for _, r in rows),
                       rows=batch_bucket(self.row_buckets, max(slot for slot, _ in rows) + 1), width=width)
        start = time.perf_counter()
        traces = TRACES["step"]
        self.cache, self.state, self.batch, outputs = _step(
            self.params, self.cache, self.state, self.batch, forced, config=self.config,
            wise_config=self.wise_config, kernel=self.kernel, unroll=self.unroll, mesh=self.mesh, **program)
        if TRACES["step"] > traces:   # a program made for this step: its trace and compile
            self._build_s += time.perf_counter() - start
            self._programs.add(tuple(program.values()))
        self._decode_steps += 1
        return outputs, rows

    def _read(self, launched) -> list[RequestOutput]:
        """Read a launched step's tokens (waits for it) and retire the requests it finished."""
        outputs, rows = launched
        token, logprob, done, overflowed, logits = jax.device_get(outputs)
        if overflowed:  # cannot happen after lifetime admission: reported in the first step that reads it
            raise kvc.PoolExhaustedError("a decode step's pages did not fit the pool or its context bucket; it "
                                         "wrote nothing, nor any step after it")
        produced = []
        for slot, request in rows:
            if request.finish_reason is not None:   # stopped on a stop id, or aborted: the token is dropped
                continue
            _check_finite(logprob[slot], request)
            request.add(int(token[slot]), float(logprob[slot]), None if logits is None else logits[slot])
            if request.finish_reason is not None:
                if not done[slot]:           # a stop id the device does not watch for
                    self._free_row(request)
                self._retire(request)
            elif done[slot]:
                raise AssertionError(f"the device finished request {request.id}, the host did not")
            produced.append(request.output(self.tokenizer))
        self._decode_tokens += len(produced)
        self._generated_tokens += len(produced)
        return produced

    def _fits(self, request: _Request) -> bool:
        return bool(self._free_slots) and self._committed + request.pages <= self.num_pages

    def _admit_waiting(self) -> list[_Request]:
        admitted = []
        while self._waiting and self._fits(self._waiting[0]):
            request = self._waiting.popleft()
            start = time.perf_counter()
            logits, kv = serving.prefill(self.params, self.config, request.prompt, page_size=self.page_size,
                                         attention=self.attention, unroll=self.unroll, mesh=self.mesh)
            p = request.params
            token, logprob, key = _first_token(logits, jnp.asarray(request.key), jnp.float32(p.temperature),
                                               (jnp.float32(p.top_p), jnp.int32(p.top_k), jnp.float32(p.min_p)),
                                               jnp.int32(request.next_forced()),
                                               sampling=request.sampling)
            request.dispatched = 1
            _check_finite(logprob, request)
            request.add(int(token), float(logprob), logits if request.keep_logits else None)
            if request.finish_reason is not None:
                self._retire(request)
            else:
                request.slot = self._free_slots.pop(0)
                self._committed += request.pages
                self._running[request.slot] = request
                row = Batch(slots=jnp.int32(request.id), tokens=jnp.int32(request.tokens[-1]),
                            remaining=jnp.int32(request.max_tokens - 1), eos=jnp.int32(request.eos),
                            temperature=jnp.float32(p.temperature), top_p=jnp.float32(p.top_p),
                            top_k=jnp.int32(p.top_k), min_p=jnp.float32(p.min_p), keys=key)
                self.cache, self.batch = _admit(self.cache, self.batch, kv, jnp.int32(request.slot), row)
                if bool(self.cache.overflowed):  # cannot happen after lifetime admission: reported at once
                    raise kvc.PoolExhaustedError(
                        f"request {request.id}'s {int(kvc.pages_for(len(request.prompt), self.page_size))} prompt "
                        f"pages did not fit the pool; nothing was written")
            del kv
            self._prefill_s += time.perf_counter() - start
            self._prompt_tokens += len(request.prompt)
            self._generated_tokens += 1
            admitted.append(request)
        return admitted

    def _free_row(self, request: _Request) -> None:
        self.cache, self.batch = _release(self.cache, self.batch, jnp.asarray(request.slot, jnp.int32))

    def _retire(self, request: _Request) -> None:
        """A finished request leaves the engine: its slot and page budget come back."""
        if request.slot is not None:
            del self._running[request.slot]
            self._free_slots.append(request.slot)
            self._free_slots.sort()
            self._committed -= request.pages
            request.slot = None
        self._requests.pop(request.id, None)

    # -- batch use --------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion -> RequestOutput per prompt, in
        prompt order. params: one SamplingParams for all, or one per prompt."""
        ids = add_all(self, prompts_with_params(prompts, params, (jax.Array,)))
        return self.run_until_done(ids, use_tqdm=use_tqdm)

    def run_until_done(self, request_ids: list[int], *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until the given (unfinished) requests finish -> their final outputs, in the order
        given. KeyError for an id that is not an unfinished request (it would never finish)."""
        unknown = [r for r in request_ids if r not in self._requests]
        if unknown:
            raise KeyError(f"no unfinished request {unknown[0]}")
        wanted = [self._requests[i] for i in request_ids]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(wanted), desc="requests", unit="req", dynamic_ncols=True,
                       disable=None)   # None: no bar without a terminal
        while any(r.finish_reason is None for r in wanted):
            finished = sum(o.finished for o in self.step() if o.request_id in request_ids)
            if bar is not None:
                bar.update(finished)
        if bar is not None:
            bar.close()
        return [r.output(self.tokenizer) for r in wanted]

    # -- stats ------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the timing and token counters and the WISE counters."""
        self._prefill_s = self._decode_s = 0.0
        self._prompt_tokens = self._generated_tokens = self._decode_tokens = self._decode_steps = 0
        if self.state is not None:
            self.state = ws.reset_counters(self.state)

    def get_tokenizer(self):
        """The engine's tokenizer (None without one), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    def stats(self) -> EngineStats:
        """Pool, queue and counters (reads the device)."""
        return EngineStats(
            total_pages=self.num_pages, free_pages=int(self.cache.num_free), running=len(self._running),
            waiting=len(self._waiting), preemptions=0,
            fallbacks=None if self.state is None else int(self.state.fallbacks),
            density=None if self.state is None else self.state.density(self.wise_config),
            prompt_tokens=self._prompt_tokens, generated_tokens=self._generated_tokens, prefill_s=self._prefill_s,
            decode_s=self._decode_s, decode_steps=self._decode_steps, decode_tokens=self._decode_tokens,
            step_programs=len(self._programs), step_program_bound=4 * len(self.row_buckets) * len(self.widths), step_build_s=self._build_s,
            pool_sizing=self.pool_sizing)


def _check_finite(logprob, request: _Request) -> None:
    """A NaN log-prob means NaN logits (log_softmax spreads one NaN to every token): an error, as
    in wise_torch, never a token taken from them."""
    if np.isnan(logprob):
        raise FloatingPointError(f"the model's logits are NaN for request {request.id}")


def encode(prompt, config: ModelConfig, tokenizer: Tokenizer | None, what: str) -> list[int]:
    """Token ids, or a string through `tokenizer`, -> checked token ids (`serving.check_ids`)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"a string {what} needs a tokenizer: pass tokenizer= (a checkpoint's comes from "
                             "wise_jax.load_model(..., with_tokenizer=True))")
        prompt = encode_text(tokenizer, prompt, what)
    return serving.check_ids(prompt, config, what)


def _default_num_pages(config: ModelConfig, page_size: int, dtype, most: int) -> tuple[int, str]:
    """(pages, how they were sized) for num_pages=None."""
    per_page = kvc.page_bytes(config, page_size, dtype)
    device = jax.devices()[0]
    budget, rule = CPU_POOL_BYTES, f"at most {CPU_POOL_BYTES / 2**30:.0f} GiB of K/V on a {device.platform}"
    if device.platform == "gpu":
        memory = device.memory_stats() or {}
        if "bytes_limit" in memory:
            limit, used = memory["bytes_limit"], memory.get("bytes_in_use", 0)
            budget = max(0, int(GPU_POOL_FRACTION * limit) - used)
            rule = (f"{GPU_POOL_FRACTION:.0%} of the {limit / 2**30:.1f} GiB jax may allocate, less the "
                    f"{used / 2**30:.1f} GiB in use")
    pages = max(1, min(most, budget // per_page))
    if pages == most and most * per_page < budget:
        rule += f", capped at max_num_seqs x max_pages ({most})"
    return pages, f"{rule}: {pages} pages of {per_page} bytes"
