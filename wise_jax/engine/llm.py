"""`LLM`: the serving engine in JAX, the device side of `wise_core.engine.LLMEngine`.

    llm = LLM(params, config, wise_config=WiseConfig(), max_num_seqs=64, max_model_len=2048)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=64))
    rid = llm.add_request(prompt, SamplingParams(...)); while llm.has_unfinished(): llm.step()

The host side -- continuous batching, pages taken as a request grows, chunked prefill,
preemption, stop rules, outputs and stats -- is `wise_core.engine`, shared with wise_torch; the
names mirror wise_torch's engine. This module runs what it plans on the device:

The decode step. The host lays it out (`wise_core.engine.step_plan.DecodePlan`, as torch's
engine does): compacted rows -- row i is the step's i-th sequence, the batch bucket the smallest
of 1, 2, 4, 8, 16, 32, ... holding them -- at the context bucket of the longest row's pages
(`wise_core.buckets`), each row's token (or -1: its sequence slot's token still on the device,
`next_token`, so the host never waits before launching), position, WISE token tag, sequence slot
and page table, every page the host's `BlockManager`'s (`decode_step(..., allocate=False)`: no
device allocator on this path). The program (`programs.decode`) runs `model.decode_step` (over a
mesh, `sharding.decode_step`: the heads split over its "tp" axis) and samples on the device
(`sampler`: logits processing -- logit_bias, min_tokens, penalties over the per-slot
`LogitsState` -- then temperature, top-p, top-k, min-p, the request's key folded with the token's
index, or the forced token; every parameter traced, so no value recompiles). One program per
(variant: greedy / sampling, kept logits, extras; rows; width), compiled ahead by
`compiler.StepPrograms`: on a GPU in the background, a step whose program is not compiled yet
running in a larger compiled one (docs/DESIGN.md).

Prefill. A step's prompt chunks are one program, a row each (`programs.prefill`, over
`chunked_prefill.prefill_chunks`), bucketed as (rows, tokens, width): every layer writes the
chunks' K/V into their requests' pages; a step whose chunks all open their prompts attends each
chunk's own keys through the prefill attention (`attention`: cuDNN's flash attention on a GPU),
one with a later chunk attends over the pages. (A Huginn model runs its chunks one program each.)
The first tokens of the prompts that complete are one more program (`programs.first_tokens`),
sampled as decode rows are. A step with a chunk that scores prompt positions
(SamplingParams.prompt_logprobs, `Chunk.scored`) runs the variant that also returns the logits
of every position (`all_logits`), ranked on the device (`score_prompt`).

Preemption offloads: a preempted request's pages of every plane are copied to host memory and
written back into its new pages when it resumes, so it continues with the same tokens.

kv_cache_dtype="fp8" (`EngineArgs`): the pool holds K/V as e4m3fn codes and a float32 scale per
(token, KV head) (`kv_cache`, `wise_core.kv_quant`): prefill and decode write them quantized,
every attention reads them dequantized to the model's dtype (prefill's own chunk's keys too), a
preemption copies codes and scales as they are. Pages are smaller (1 byte a value + 4 a (token,
KV head) scale), so num_pages=None holds about 1.9x the tokens of bf16 (3.8x float32) in the
same memory. attention_backend "auto" decodes with the reference on every backend, "pallas" with
the Pallas kernel, which reads fp8 pages (`wise_jax.kernels.choice`: never Mosaic). Ouro models
only (a Huginn model's is refused).

WISE tags a row's supports with the step plan's token tag (docs/DESIGN.md "WISE state"): the
tag the step passes to `model.decode_step` is issued once per decoded token (int32, modulo
2**31), beside its position.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
from tokenizers import Tokenizer

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.buckets import batch_bucket, context_bucket, context_buckets, decode_buckets
from wise_core.engine import EngineArgs, LLMEngine
from wise_core.engine.args import check_adaptive_depth, check_exit_iterations, cpu_pool, pool_pages
from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence, logits_rows
from wise_core.engine.step_plan import DecodePlan, TagCounter
from wise_core.huginn_reference import initial_state, num_planes
from wise_core.model_config import ModelConfig
from wise_core.sampling_params import MAX_SEED, SamplingParams
from wise_jax import checks
from wise_jax import huginn
from wise_jax import kv_cache as kvc
from wise_jax import serving
from wise_jax import sharding
from wise_jax import wise_state as ws
from wise_jax.attention import attention_plan
from wise_jax.loading import load_model
from wise_jax.params import Params, stack_layers, unstack_layers
from wise_jax.sampling import LogitsState
from wise_jax.engine.inflight import InFlight
from wise_jax.engine.programs import (DEFAULT_VARIANT, Chunks, FirstVariant, PrefillVariant, Rows, StepVariant,
                                      decode, first_tokens, prefill, read_pages, restore_pages, score_prompt,
                                      set_logits_rows, spec_of, write_pages)
from wise_jax.engine.sampler import Draw, Processing, draw_of, processing_of
from wise_jax.engine.compiler import StepPrograms


# num_pages=None on a GPU: the pool fills this share of the memory jax may allocate, less what is
# in use. XLA still warns that it cannot rematerialize a program below its limit (on an H200,
# 2026-12-04: 211.6 GiB counted against 123.9 GiB, as if the donated pool were held twice;
# benchmarks/results/h200-2026-12-04/README.md); the warning costs compile time, not memory.
GPU_POOL_FRACTION = 0.7
COMPILATION_CACHE = Path("~/.cache/wise/jax-compilation")   # compilation_cache="auto" on a GPU


def _rows(x: jax.Array, rows: int) -> jax.Array:
    """x's first `rows` rows (axis 0), zero rows appended where it has fewer."""
    if x.shape[0] == rows:
        return x
    if x.shape[0] > rows:
        return x[:rows]
    return jnp.concatenate([x, jnp.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)])


def seed_key(seed: int) -> jax.Array:
    """A raw PRNG key for a seed in [0, 2**63) (jax.random.PRNGKey keeps only the low 32 bits)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), seed >> 32)


class LLM(LLMEngine):
    """The engine (module docstring; the host side is `wise_core.engine.LLMEngine`).

    params, config: the model (`wise_jax.load_model`), or params a checkpoint directory or
    built-in model name and config None (loaded here with its tokenizer, in `dtype`: None is
    bfloat16 on a GPU, float32 otherwise). engine_args: `wise_core.engine.EngineArgs`
    (wise_config, num_pages, page_size, max_num_seqs, max_model_len, max_num_batched_tokens,
    attention_backend ('auto', 'pallas', 'reference': what runs prefill and decode,
    `wise_jax.attention.attention_plan`, docs/attention.md's table), seed, enable_prefix_caching,
    kv_cache_dtype ('auto', 'fp8': module docstring)), the same arguments and defaults as
    wise_torch.LLM's; num_pages=None fills GPU_POOL_FRACTION of the memory jax may allocate less
    what is in use on a GPU, CPU_POOL_BYTES on a CPU, never more than max_num_seqs x the pages of
    max_model_len. tokenizer: for string prompts and texts; unroll: layers per scan step of
    prefill and of a stacked decode step (True: all); mesh: a jax.sharding.Mesh with axis "tp"
    to shard the heads, the K/V pages and the WISE supports over
    (`wise_jax.sharding`; every device holds num_pages pages of its KV heads; `params` is then
    kept in the mesh layout, a `sharding.MeshParams`).

    A Huginn model (`huginn.HuginnParams` and its config) runs `num_steps` core iterations per
    token (None: its total_ut_steps): the pool holds `num_planes(config, num_steps)` planes, a
    WiseConfig's depths index core iterations (each < num_steps), and every token starts from
    the initial state of its position with seed 0 (`wise_core.huginn_reference.initial_state`,
    a table on the device), so a request's tokens do not depend on its batch, chunking or
    preemption; without a mesh. An Ouro model runs its num_loops (num_steps None or that).
    adaptive_depth: a Huginn model's per-token adaptive depth in decode, as wise_torch.LLM's
    (`AdaptiveDepth`; None: every token runs num_steps iterations): each decode step passes it
    to `huginn.decode_step`, whose rows that exit ride along held (static shapes); prefill runs
    every iteration, as the released code's. `stats().mean_decode_depth` is the mean of the
    iterations decoded tokens ran. With WISE, a row that exited still runs the later
    iterations' discovery and reuse attention (held state, outputs discarded, counted in the
    density): its tokens are those of the exit, its later iterations' K/V its exit iteration's.
    An Ouro model exits by its config's early_exit_threshold: adaptive_depth is an error there.

    The decode step runs each run of loops of one role as a scan of one loop body
    (`model.decode_step`'s scan_loops): `scan_loops = False` in a subclass compiles every loop
    straight-line instead (a measurement's other arm). It decodes with one weight buffer per
    layer (`layers = "unstacked"`: `params.unstack_layers`, straight-line code, no per-layer
    weight copies; the engine makes that copy of stacked params once, and its decode step
    compiles slower); `layers = "stacked"` in a subclass scans over the stacked weights
    instead (another measurement's arm; params not yet in a mesh layout).
    """

    ARRAY_TYPES = (jax.Array,)
    scan_loops = True
    layers = "unstacked"

    def __init__(self, params: Params | str | Path, config: ModelConfig | None = None, *,
                 tokenizer: Tokenizer | None = None, unroll: int | bool = 1, mesh=None, dtype=None,
                 num_steps: int | None = None, adaptive_depth: AdaptiveDepth | None = None,
                 background_compile: bool | None = None, compilation_cache: str | Path | None = "auto",
                 **engine_args):
        args, layers = EngineArgs(**engine_args), self.layers
        use_compilation_cache(compilation_cache)
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
        self.num_steps = self._huginn_steps(params, config, num_steps, mesh)    # None: an Ouro model
        if self.num_steps is None:
            checks.params(params, config)
        self.adaptive_depth = check_adaptive_depth(adaptive_depth, config)
        if self.num_steps is not None:
            check_exit_iterations(self.adaptive_depth, self.num_steps)
            if args.kv_cache_dtype == "fp8":
                raise ValueError("kv_cache_dtype='fp8' is not implemented for Huginn models yet (Ouro models run it)")
        planes = None if self.num_steps is None else num_planes(config, self.num_steps)
        args.checked_for(config.total_ut_steps if self.num_steps is None else self.num_steps,
                         config.max_position_embeddings,
                         None if self.num_steps is None else f"num_steps={self.num_steps} core iterations")
        if layers not in ("unstacked", "stacked"):
            raise ValueError(f"layers must be 'unstacked' or 'stacked', got {layers!r}")
        per_device = config if mesh is None else sharding.local_config(config, sharding.tp_size(mesh))
        dtype = params.wte.dtype if self.num_steps is not None else (
            params.params if isinstance(params, sharding.MeshParams) else params).embed_tokens.dtype
        if mesh is not None:
            params = sharding.shard_params(config, params, mesh)
            if layers == "unstacked":
                params = sharding.unstack_mesh_params(params, mesh)
        elif isinstance(params, Params):   # MeshParams without a mesh: the step says what is wrong
            params = unstack_layers(params) if layers == "unstacked" else stack_layers(params)
        self.params, self.config, self.wise_config, self.mesh = params, config, args.wise_config, mesh
        plan = attention_plan(args.attention_backend, config.head_dim, args.kv_cache_dtype)
        self.kernel, self.attention = plan.kernel, plan.prefill    # the decode kernel, the prefill attention
        self.kv_cache_dtype, self.dtype, self.unroll = args.kv_cache_dtype, dtype, unroll
        num_pages, sizing = args.num_pages, f"num_pages={args.num_pages} as given"
        if num_pages is None:
            num_pages, sizing = _default_num_pages(per_device, args.page_size, dtype, args.max_num_seqs
                                                   * args.pages_per_request(config.max_position_embeddings), planes,
                                                   args.kv_cache_dtype)
        if args.kv_cache_dtype == "fp8":
            sizing += (f"; kv_cache_dtype='fp8': K/V as 1-byte e4m3fn codes and a float32 scale per (token, KV "
                       f"head), pages of {kvc.page_bytes(per_device, args.page_size, dtype, planes, 'fp8')} bytes "
                       f"(of {kvc.page_bytes(per_device, args.page_size, dtype, planes)} in "
                       f"{jnp.dtype(dtype).name})")
        # The storage of the pool (its page table is each step's, the host's bookkeeping), made
        # before the host's free list: a pool too large for the memory is refused (with the bytes
        # it needs) before anything is allocated.
        self.cache = sharding.create_cache(config, mesh, batch=1, max_pages=1, num_pages=num_pages,
                                           page_size=args.page_size, dtype=dtype, planes=planes,
                                           kv_cache_dtype=args.kv_cache_dtype)
        self._start(args, num_pages=num_pages, pool_sizing=sizing,
                    max_model_len=args.model_len(config.max_position_embeddings, num_pages), tokenizer=tokenizer,
                    vocab_size=config.vocab_size, eos_token_id=config.eos_token_id)
        self.max_pages = -(-self.max_model_len // self.page_size)
        self.widths = context_buckets(self.max_pages)
        self.row_buckets = decode_buckets(args.max_num_seqs)
        self._loops_run = [0, 0]     # early exit: loops the decoded tokens ran, decoded tokens (`decode`)
        # Huginn: each position's initial state, read on the device by prefill and decode.
        self.state_table = None if planes is None else jnp.asarray(
            initial_state(config, np.arange(self.max_pages * self.page_size), 0), dtype)
        self.state = None if args.wise_config is None else sharding.create_state(
            args.wise_config, mesh, slots=args.max_num_seqs, layers=config.loop_layers,
            heads=config.num_attention_heads, max_blocks=self.max_pages * self.page_size // args.block_size)
        self.next_token = self._on_mesh(jnp.zeros((args.max_num_seqs,), jnp.int32))
        self.tags = TagCounter()     # the WISE token tags of decoded tokens
        # The decode programs: compiled ahead from these abstract arguments (their shapes never
        # change), on a background thread when background_compile (None: on a GPU), starting
        # with the largest bucket of the default variant, which holds every step of it.
        self._arg_specs = spec_of((self.params, self.cache, self.state, self.next_token, self.state_table), mesh)
        background = jax.default_backend() == "gpu" if background_compile is None else background_compile
        self.programs = StepPrograms(self._compile_step, background=background)
        self.prefill_programs = StepPrograms(self._compile_prefill, background=background)
        self.first_programs = StepPrograms(self._compile_first_tokens, background=background)
        # The start-up set (`startup_set`), compiled in this order on each kind's background thread.
        self.startup = self.startup_set(args.max_num_batched_tokens)
        for programs, keys in zip((self.programs, self.prefill_programs, self.first_programs), self.startup):
            programs.start(keys)
        self.logits_state: LogitsState | None = None     # made when a request first needs it
        self._logits_owner: dict[int, Sequence] = {}       # slot -> the sequence its logits state rows are of
        self._seed = random.randrange(MAX_SEED) if args.seed is None else args.seed

    def startup_set(self, max_num_batched_tokens: int) -> tuple[list, list, list]:
        """The programs compiled ahead, (decode, prefill, first-token) keys: the largest decode
        bucket of the default variant (it holds every step of that variant) and one row at every
        width (a lone request's steps: in the largest bucket a CPU computes every row for it); the
        prefill of one prompt opening at each width a chunk may take (a step of several runs them
        one by one until its own compiles), then of a later chunk of a prompt longer than one
        step's chunk, a whole chunk at each wider width (it holds every later chunk there); greedy
        first tokens at every batch bucket. (A Huginn model prefills chunk by chunk outside them.)"""
        decode = [(DEFAULT_VARIANT, self.row_buckets[-1], self.widths[-1])] + [
            (DEFAULT_VARIANT, 1, w) for w in self.widths if (1, w) != (self.row_buckets[-1], self.widths[-1])]
        prefill = []
        if self.num_steps is None:
            chunk = context_bucket(self.widths, min(self.max_pages, -(-max_num_batched_tokens // self.page_size)))
            prefill = ([(PrefillVariant(self.attention, False), 1, w, w) for w in self.widths if w <= chunk]
                       + [(PrefillVariant(None, False), 1, chunk, w) for w in self.widths if w > chunk])
        return decode, prefill, [(FirstVariant(False, False), rows) for rows in self.row_buckets]

    @staticmethod
    def _huginn_steps(params, config: ModelConfig, num_steps, mesh) -> int | None:
        """A Huginn model's core iterations per token, checked (num_steps None: its
        total_ut_steps); None for an Ouro model (num_steps None or its loops)."""
        if config.architecture != "huginn":
            if num_steps not in (None, config.total_ut_steps):
                raise ValueError(f"an Ouro model runs its {config.total_ut_steps} loops every step, got "
                                 f"num_steps={num_steps!r} (num_steps sets a Huginn model's core iterations)")
            return None
        if not isinstance(params, huginn.HuginnParams):
            raise TypeError(f"a Huginn config takes HuginnParams (wise_jax.huginn), got {type(params).__name__}")
        if mesh is not None:
            raise ValueError("a mesh runs Ouro models only; this is a Huginn model")
        return huginn.check_num_steps(config.total_ut_steps if num_steps is None else num_steps)

    def add_request(self, prompt, params: SamplingParams | None = None, *, forced: list[int] | None = None,
                    keep_logits: bool = False, key: jax.Array | None = None) -> int:
        """`LLMEngine.add_request`; key: the request's raw PRNG key (uint32[2]; `generate` gives
        prompt n fold_in(key, n)) instead of its seed's or the engine's."""
        request_id = super().add_request(prompt, params, forced=forced, keep_logits=keep_logits)
        if key is not None:     # completion i > 0 of an n > 1 request: fold_in(key, i)
            for i, seq in enumerate(self._request(request_id)):
                seq.generator = np.asarray(key if i == 0 else jax.random.fold_in(key, i), np.uint32)
        return request_id

    # -- the device side (LLMEngine's hooks) -------------------------------------------------
    def _new_sequence(self, seq: Sequence) -> None:
        """The request's key: its seed's, else the engine seed's folded with the request id."""
        p = seq.params
        key = seed_key(p.seed) if p.seed is not None else jax.random.fold_in(seed_key(self._seed), seq.request_id)
        seq.generator = np.asarray(key, np.uint32)

    def _launch_decode(self, seqs: list[Sequence]) -> InFlight:
        extras = self._extras(seqs)
        variant = StepVariant(sampling=any(s.forced is None and s.params.temperature > 0 for s in seqs),
                              keep_logits=any(s.keep_logits for s in seqs), extras=extras)
        program, (rows, width) = self.programs.choose(
            variant, batch_bucket(self.row_buckets, len(seqs)),
            context_bucket(self.widths, max(len(seq.pages) for seq in seqs)))
        plan = DecodePlan.build(seqs, rows=rows, width=width, page_size=self.page_size,
                                scratch_page=self.cache.scratch_page, tags=self.tags)
        padded: list[Sequence | None] = list(seqs) + [None] * (rows - len(seqs))
        self.cache, self.state, self.next_token, logits_state, outputs = program(
            self.params, self.cache, self.state, self.next_token, Rows.of(plan), draw_of(padded),
            processing_of(padded) if extras else None, self.logits_state if extras else None, self.state_table)
        if extras:
            self.logits_state = logits_state
        return InFlight([(seq, seq.expect()) for seq in seqs], outputs, list(range(len(seqs))),
                         loops_run=self._loops_run)

    def _compile_step(self, key) -> Callable:
        """The decode program of `key` = (StepVariant, rows, width), compiled ahead of its first
        step (`compiler.StepPrograms`; may run on its background thread)."""
        variant, rows, width = key
        logits_state = self._logits_state_spec() if variant.extras else None
        static = dict(config=self.config, wise_config=self.wise_config, kernel=self.kernel, unroll=self.unroll,
                      mesh=self.mesh, num_steps=self.num_steps, adaptive=self.adaptive_depth,
                      sampling=variant.sampling, keep_logits=variant.keep_logits, rows=rows, width=width,
                      scan_loops=self.scan_loops)
        params, cache, state, next_token, state_table = self._arg_specs
        per_step = spec_of((Rows.spec(rows, width), Draw.spec(rows),
                            Processing.spec(rows) if variant.extras else None), self.mesh)
        return decode.lower(params, cache, state, next_token, *per_step, logits_state, state_table,
                            **static).compile()

    def wait_compiles(self) -> None:
        """Wait for every background compile requested so far (the start-up set's included)."""
        for programs in self._program_sets():
            programs.wait()

    def close(self) -> None:
        """Drop the background compiles not started yet (as wise_torch.LLM's close, the engine's
        resources let go; a program compiling finishes). Also run when the LLM is
        garbage-collected."""
        for programs in self._program_sets():
            programs.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _program_sets(self) -> tuple[StepPrograms, ...]:
        """The compiled programs by kind: decode, prefill, first tokens."""
        return self.programs, self.prefill_programs, self.first_programs

    def _logits_state_spec(self):
        return spec_of(jax.eval_shape(lambda: LogitsState.create(self.args.max_num_seqs, self.config.vocab_size)),
                       self.mesh)

    def _compile_prefill(self, key) -> Callable:
        """The prefill program of `key` = (PrefillVariant, rows, tokens in pages, width in pages)."""
        variant, rows, pages, width = key
        params, cache = self._arg_specs[:2]
        chunks = spec_of(Chunks.spec(rows, pages * self.page_size, width), self.mesh)
        return prefill.lower(params, cache, chunks, config=self.config, attention=variant.attention,
                             unroll=self.unroll, mesh=self.mesh, all_logits=variant.all_logits).compile()

    def _compile_first_tokens(self, key) -> Callable:
        """The first-token program of `key` = (FirstVariant, rows)."""
        variant, rows = key
        next_token = self._arg_specs[3]
        per_step = spec_of((jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32),
                            jax.ShapeDtypeStruct((rows,), jnp.int32), Draw.spec(rows),
                            Processing.spec(rows) if variant.extras else None), self.mesh)
        return first_tokens.lower(next_token, *per_step, self._logits_state_spec() if variant.extras else None,
                                  sampling=variant.sampling).compile()

    def _on_mesh(self, tree):
        """`tree` replicated on the mesh (as is without one): the decode programs, compiled ahead,
        take every argument on the mesh they run on."""
        if self.mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def _extras(self, seqs: list[Sequence]) -> bool:
        """Whether a step over `seqs` processes logits or reports ranked logprobs; if so, the
        logits state exists and holds the rows of every processed sequence among them.

        Without such a row the step runs with processing and logits state None: the program of
        a step of default requests is the one it was before logits processing existed (a
        separate compiled program is made for steps with extras)."""
        if not any(s.params.logprobs is not None or (s.forced is None and s.params.processed) for s in seqs):
            return False
        if self.logits_state is None:
            self.logits_state = self._on_mesh(LogitsState.create(self.args.max_num_seqs, self.config.vocab_size))
        for seq in seqs:
            if seq.forced is None and seq.params.processed and self._logits_owner.get(seq.slot) is not seq:
                self.logits_state = set_logits_rows(self.logits_state, jnp.int32(seq.slot),
                                                     *logits_rows(seq, self.config.vocab_size))
                self._logits_owner[seq.slot] = seq
        return True

    def _launch_prefill(self, chunks: list[Chunk]) -> InFlight:
        """The step's chunks, a row each: an Ouro model's in one program (`programs.prefill`), a
        Huginn model's one program per chunk; then the first token of every prompt that
        completes, one program for the step (`programs.first_tokens`)."""
        extras = self._extras([c.seq for c in chunks if c.completes])
        rows = batch_bucket(self.row_buckets, len(chunks))
        all_logits = any(c.scored > 0 for c in chunks)    # the logits of every position, for prompt scores
        last, every = (self._prefill_chunks if self.num_steps is None else self._prefill_huginn)(
            chunks, rows, all_logits)
        prompt_rows, prompt = [], []
        for r, chunk in enumerate(chunks):
            if chunk.scored > 0:
                seq = chunk.seq
                following = np.zeros(every[r].shape[0], np.int32)    # each position's next prompt token
                following[:chunk.scored] = seq.prompt[chunk.start + 1:chunk.start + 1 + chunk.scored]
                prompt.append(score_prompt(every[r], jnp.asarray(following)))
                prompt_rows.append((seq, chunk.start + 1, chunk.scored))
        at = [r for r, chunk in enumerate(chunks) if chunk.completes]
        if not at:
            return InFlight([], (np.zeros(0, np.int32), np.zeros(0), np.zeros(0, bool), None, None, None), [],
                             prompt_rows, prompt)
        padded: list[Sequence | None] = [c.seq if c.completes else None for c in chunks]
        sampling = any(seq is not None and seq.forced is None and seq.params.temperature > 0 for seq in padded)
        # The program may hold more rows than the step (a larger compiled bucket): padding rows
        # (no slot, zero logits) write and count nothing.
        program, (program_rows,) = self.first_programs.choose(FirstVariant(sampling, extras), rows)
        padded += [None] * (program_rows - len(chunks))
        last = _rows(last, program_rows)
        slots = np.array([-1 if seq is None else seq.slot for seq in padded], np.int32)
        self.next_token, logits_state, (token, logprob, nan, top) = program(
            self.next_token, last, self._on_mesh(slots), draw_of(padded), processing_of(padded) if extras else None,
            self.logits_state if extras else None)
        if extras:
            self.logits_state = logits_state
        seqs = [chunks[r].seq for r in at]
        keep = any(seq.keep_logits for seq in seqs)
        return InFlight([(seq, seq.expect()) for seq in seqs], (token, logprob, nan, last if keep else None, top, None),
                        at, prompt_rows, prompt)

    def _prefill_chunks(self, chunks: list[Chunk], rows: int, all_logits: bool) -> tuple:
        """An Ouro model's chunks in one program, bucketed as (rows, tokens, width): tokens and
        width each a context bucket (pages) -> (logits float32[rows, vocab] after each row's last
        token, the logits at every position [rows, tokens, vocab] or None). A step whose chunks
        all open their prompts attends through the engine's prefill attention."""
        page_size = self.page_size
        pages = context_bucket(self.widths, -(-max(c.length for c in chunks) // page_size))
        width = context_bucket(self.widths, max(-(-(c.start + c.length) // page_size) for c in chunks))
        variant = PrefillVariant(self.attention if all(c.start == 0 for c in chunks) else None, all_logits)
        found = self.prefill_programs.find(variant, rows, pages, width)
        waiting = found is None and self.prefill_programs.background and len(chunks) > 1 and not all_logits
        single = self.prefill_programs.find(variant, 1, pages, width) if waiting else None
        if single is not None:
            # Rows are independent: while the step's own program compiles in the background, its
            # chunks run one by one in the compiled program of one chunk.
            last = [self._run_prefill(single, [chunk])[:1] for chunk in chunks]
            return _rows(jnp.concatenate(last), rows), None
        logits = self._run_prefill(found or self.prefill_programs.choose(variant, rows, pages, width), chunks)
        # A larger compiled bucket runs more rows than the step's: the step's rows are the first.
        return (_rows(logits[0], rows), _rows(logits[1], rows)) if all_logits else (_rows(logits, rows), None)

    def _run_prefill(self, chosen: tuple, chunks: list[Chunk]):
        """Run `chunks` in the prefill program `chosen` = (program, (rows, pages, width)) -> its
        logits (`programs.prefill`'s), the cache updated."""
        program, (rows, pages, width) = chosen
        batch = Chunks.of(chunks, rows=rows, seq=pages * self.page_size, width=width, page_size=self.page_size,
                          scratch_page=self.cache.scratch_page, pad_id=self.config.pad_token_id or 0)
        logits, self.cache = program(self.params, self.cache, self._on_mesh(batch))
        return logits

    def _prefill_huginn(self, chunks: list[Chunk], rows: int, all_logits: bool) -> tuple:
        """A Huginn model's chunks, one program each (a first chunk: `huginn.prefill`, its K/V
        then written into its pages; a later one: `huginn.prefill_chunk` over the pages) -> as
        `_prefill_chunks`, the logits at every position a list (a row's, or None)."""
        last, every = [], []
        for chunk in chunks:
            seq = chunk.seq
            tokens = seq.prompt[chunk.start:chunk.start + chunk.length]
            padded = np.zeros(serving.prefill_bucket(len(tokens), self.page_size), np.int32)
            padded[:len(tokens)] = tokens
            length = jnp.int32(len(tokens))
            if chunk.start == 0:
                logits, k, v = huginn.prefill(self.params, self.config, jnp.asarray(padded), length,
                                              self.state_table[:len(padded)], num_steps=self.num_steps,
                                              all_logits=all_logits)
                n = k.shape[1] // self.page_size
                shape = (k.shape[0], n, self.page_size) + k.shape[2:]
                self.cache = write_pages(self.cache, k.reshape(shape), v.reshape(shape),
                                          jnp.asarray(seq.pages[:n], jnp.int32))
            else:
                pages = context_bucket(self.widths, len(seq.pages))     # the pages its prompt holds so far
                table = np.full(pages, self.cache.scratch_page, np.int32)
                table[:len(seq.pages)] = seq.pages[:pages]
                logits, k, v = huginn.prefill_chunk(self.params, self.config, self.cache.k, self.cache.v,
                                                    jnp.asarray(padded), jnp.int32(chunk.start), length,
                                                    jnp.asarray(table), self.state_table, num_steps=self.num_steps,
                                                    all_logits=all_logits)
                self.cache = dataclasses.replace(self.cache, k=k, v=v)
            logits, scores = logits if all_logits else (logits, None)
            last.append(logits)
            every.append(scores)
        last += [jnp.zeros_like(last[0])] * (rows - len(chunks))
        return jnp.stack(last), every

    def _offload(self, seq: Sequence, pages: list[int]) -> None:
        """The storage of the pages holding seq's cached keys, to host memory as the pool holds it
        (K, V and an fp8 pool's scales: `kv_cache.read_pages`)."""
        n = -(-seq.num_cached // self.page_size)
        seq.offloaded = jax.device_get(read_pages(self.cache, jnp.asarray(pages[:n], jnp.int32))) if n else None

    def _restore(self, seq: Sequence) -> None:
        """The offloaded storage written back, as it is, into seq's new pages."""
        stored = seq.offloaded
        self.cache = restore_pages(self.cache, stored, jnp.asarray(seq.pages[:stored[0].shape[1]], jnp.int32))
        seq.offloaded = None

    def _build_seconds(self) -> float:
        """Seconds steps waited for programs to compile (background compiles cost a step nothing
        and are not counted)."""
        return sum(p.stats()["compile_blocked_s"] for p in self._program_sets())

    def _scrub(self, pages: list[int]) -> None:
        """Zero the K/V of `pages` in every plane (a failed request's, before they go back)."""
        if not pages:
            return
        planes, _, page_size, kv_heads, head_dim = self.cache.k.shape
        zeros = jnp.zeros((planes, len(pages), page_size, kv_heads, head_dim), self.dtype)   # an fp8 pool: quantized
        self.cache = write_pages(self.cache, zeros, zeros, jnp.asarray(pages, jnp.int32))

    def _device_stats(self) -> dict:
        state = self.state
        programs = self.programs.stats()
        every = [p.stats() for p in self._program_sets()]
        return dict(fallbacks=None if state is None else int(state.fallbacks),
                    density=None if state is None else state.density(self.wise_config),
                    step_programs=programs["step_programs"],
                    step_program_bound=8 * len(self.row_buckets) * len(self.widths),
                    step_build_s=programs["compile_s"],
                    **{name: sum(s[name] for s in every)
                       for name in ("larger_bucket_steps", "compile_blocked_steps", "compile_blocked_s")},
                    mean_decode_depth=self._loops_run[0] / self._loops_run[1] if self._loops_run[1] else None)

    def _reset_device_counters(self) -> None:
        self._loops_run[:] = [0, 0]
        if self.state is not None:
            self.state = ws.reset_counters(self.state)


def use_compilation_cache(where: str | Path | None) -> None:
    """Turn on jax's persistent compilation cache, so a second engine start reuses the compiled
    programs: where "auto" -> on a GPU, COMPILATION_CACHE (unless jax's is set already, by
    JAX_COMPILATION_CACHE_DIR or jax.config); a directory -> that one; None -> jax's setting
    as it is. The setting is the process's (jax keeps one cache)."""
    if where is None:
        return
    if where == "auto":
        if jax.default_backend() != "gpu" or jax.config.jax_compilation_cache_dir:
            return
        where = COMPILATION_CACHE
    where = Path(where).expanduser()
    if jax.config.jax_compilation_cache_dir != str(where):
        where.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(where))


def _default_num_pages(config: ModelConfig, page_size: int, dtype, most: int,
                       planes: int | None = None, kv_cache_dtype: str = "auto") -> tuple[int, str]:
    """(pages, how they were sized) for num_pages=None (planes, kv_cache_dtype: the pool's,
    `kv_cache.create`'s: an fp8 pool's pages are smaller, so more of them fit)."""
    per_page = kvc.page_bytes(config, page_size, dtype, planes, kv_cache_dtype)
    device = jax.devices()[0]
    memory = (device.memory_stats() or {}) if device.platform == "gpu" else {}
    if "bytes_limit" not in memory:
        return cpu_pool(per_page, device.platform, most)
    limit, used = memory["bytes_limit"], memory.get("bytes_in_use", 0)
    return pool_pages(max(0, int(GPU_POOL_FRACTION * limit) - used), per_page,
                      f"{GPU_POOL_FRACTION:.0%} of the {limit / 2**30:.1f} GiB jax may allocate, less the "
                      f"{used / 2**30:.1f} GiB in use (the other {(1 - GPU_POOL_FRACTION) * limit / 2**30:.1f} GiB "
                      f"left for the compiled programs' temporaries)", most)
