"""Runs the model for the engine: the coordinator of a rank's device side. It holds the paged
cache, the WISE state, the decode attention and the static buffers of a step, and runs decode
steps (`staging`: their inputs; `graphs`: as CUDA graphs), prefill chunks, the K/V copies of
preemption (`offload`) and sampling (`sampler.StepSampler`), each call mirrored on the other
tensor-parallel ranks (`follower`).

kv_cache_dtype "fp8": the pool holds e4m3fn codes and a float32 scale per (token, KV head)
(`wise_torch.kv_cache`); prefill and decode write them quantized and read them dequantized
through the reference attentions (attention_backend "auto" resolves to them; "triton", "fa4"
and the union arms refuse such a pool), and
preemption copies codes and scales as they are.

Decode runs at a (batch bucket, context bucket): `decode_buckets` sizes the rows (those past
the real ones are padding rows that read and write only the scratch page), `context_buckets`
the page-table width (`wise_core.buckets`), the smallest rung of a power-of-two ladder holding
the longest row's pages. The width sets what a step costs beside its keys -- the attention's
split grid and block selection, the WISE supports and counters it touches -- so a step costs
what its live context needs, not what max_model_len allows. A row's attention, selection and
support do not depend on the width (only blocks its keys reach are read), so a request that
grows across a rung, or sits beside a longer one, gets the very tokens of any other width. On
CUDA each (batch, context) bucket's decode step (every loop, dense or WISE) is captured as a
CUDA graph the first time a step needs it (lazily: a bounded number, len(decode_buckets) x
len(context_buckets), sharing one memory pool) and replayed. Eager mode runs the very same
padded step, so it gives the same tokens. Sampling runs on the device and one device-to-host
read per phase brings back the tokens.

The model is an OuroForCausalLM or a HuginnForCausalLM; the runner calls the same methods of
either: `planes(num_steps)` (the pool's planes for steps of that depth), `step_inputs(num_steps,
positions)` (its own keyword inputs of prefill and decode_step, made once before any graph:
Huginn's iteration count and per-position initial-state table, none for Ouro), `prefill`,
`decode_step` (a Huginn model's also with the engine's adaptive_depth, as `adaptive`, and its
adaptive_regroup, as `regroup`: eager only), `rope_rows`, `head_weight` and `tp`.

Tensor parallelism (`wise_torch.engine.distributed`): every rank has a runner over its shard.
Rank 0's runner, which alone samples, sends each device-side call with its host inputs to the
other ranks (`workers`) before running it; their `follower.Follower` runs the same call. A
decode step broadcasts rank 0's input tokens to every rank first, so a token still in flight
never passes through a host.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.buckets import batch_bucket, context_bucket, context_buckets, decode_buckets
from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence
from wise_core.engine.step_plan import DecodePlan, TagCounter
from wise_core.modes import DENSE
from wise_core.wise_config import WiseConfig
from wise_torch.attention import AttentionPlan, dense_decode_function, prefill_function, prepare_decode_attention
from wise_torch.engine.graphs import StepGraphs
from wise_torch.engine.inflight import PromptScores
from wise_torch.engine.offload import copy_in, copy_out, scrub
from wise_torch.engine.sampler import StepSampler
from wise_torch.engine.staging import DecodeStaging, PrefillInputs
from wise_torch.kv_cache import DecodeBatch, PagedKVCache
from wise_torch.model import OuroForCausalLM
from wise_torch.union_decode import resolve_wise_decode
from wise_torch.wise_state import WiseState


def min_splits_for(rows: int, kv_heads: int, programs: int = 2048) -> int:
    """The fewest splits per row (a power of two in [1, 16]) for a decode step of `rows` rows to
    launch about `programs` programs. Only rows listing few blocks -- short rows, and the sparse
    rows of the reuse loops -- are split further; long dense rows already have more splits
    than this (one per 512 keys), so their work is unchanged. A step of few rows thus keeps
    every SM busy, and a sparse row is not one long program."""
    want = max(programs // (rows * kv_heads), 1)
    return min(1 << (want.bit_length() - 1), 16)


class ModelRunner:
    """A rank's device side (module docstring). use_graphs: decode and speculation steps run as
    CUDA graphs (`step_graphs`; `graphs`: the decode steps', (batch bucket, context bucket) ->
    (graph, logits)), else eagerly. attention: what runs each phase's attention (the engine's
    `wise_torch.attention.attention_plan`, every rank the same)."""

    def __init__(self, model: OuroForCausalLM, *, wise_config: WiseConfig | None, num_pages: int, page_size: int,
                 max_num_seqs: int, max_model_len: int, use_graphs: bool, attention: AttentionPlan, seed: int,
                 num_steps: int | None = None, adaptive_depth: AdaptiveDepth | None = None,
                 adaptive_regroup: bool = False, kv_cache_dtype: str = "auto", workers=None):
        config = model.config
        # Tensor parallelism: the model's `tp` on every rank (None: one device); `workers` on rank
        # 0 (distributed.Workers), whose followers repeat its device-side calls (`_mirror`).
        self.tp, self.workers = model.tp, workers
        weight = model.head_weight
        self.model, self.config, self.device, self.dtype = model, config, weight.device, weight.dtype
        block_size = (wise_config or WiseConfig()).block_size
        self.page_size = page_size
        # What runs prefill ("sdpa", "fa4", "reference") and its varlen function (None: SDPA), and
        # the dense decode loops (None: the decode kernel).
        self.prefill_attention = attention.prefill
        self.prefill_fn = prefill_function(attention.prefill, self.device, self.dtype, kv_cache_dtype)
        self.dense_decode_fn = dense_decode_function(attention.dense_decode, self.device, self.dtype, kv_cache_dtype)
        self.max_pages = -(-max_model_len // page_size)
        positions = min(self.max_pages * page_size, config.max_position_embeddings)
        model.rope_rows(positions)   # before any graph
        max_blocks = self.max_pages * page_size // block_size
        # The depth of a step (Ouro: its loops; Huginn: core iterations, None its default) and the
        # model's own inputs of prefill and decode_step (static: made before any graph).
        self.num_steps = config.num_loops if num_steps is None else num_steps
        self.cache = PagedKVCache(planes=model.planes(self.num_steps), num_pages=num_pages, page_size=page_size,
                                  kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=self.dtype,
                                  device=self.device, kv_cache_dtype=kv_cache_dtype)
        self.step_inputs = model.step_inputs(self.num_steps, positions)
        # Decode's: those and Huginn's per-token adaptive depth (prefill runs every iteration),
        # regrouped (eager: `LLM`'s adaptive_regroup) or not.
        self.decode_inputs = self.step_inputs if adaptive_depth is None else dict(
            self.step_inputs, adaptive=adaptive_depth, **({"regroup": True} if adaptive_regroup else {}))
        self.buckets = decode_buckets(max_num_seqs)
        self.widths = context_buckets(self.max_pages)
        rows = self.buckets[-1]
        self.wise = None if wise_config is None else WiseState(wise_config, config, max_rows=rows,
                                                                max_blocks=max_blocks, device=self.device,
                                                                num_loops=self.num_steps)
        # Per batch bucket, a decode attention whose rows split into enough programs to fill the
        # GPU (one workspace shared by all, sized for the widest step).
        self.attention = prepare_decode_attention(
            attention.kernel, batches=self.buckets, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim, max_blocks=max_blocks,
            block_size=block_size, dtype=self.dtype,
            device=self.device, min_splits=lambda b: min_splits_for(b, config.num_key_value_heads),
            selection=None if wise_config is None else wise_config.selection, kv_cache_dtype=kv_cache_dtype)
        # What runs the WISE loops: the kernel above, or an arm of `wise_torch.union_decode`.
        if attention.wise_decode != "kernel" and wise_config is None:
            raise ValueError(f"wise_decode={attention.wise_decode!r} runs WISE loops; the engine has no wise_config")
        self.wise_decode = attention.wise_decode
        union = resolve_wise_decode(attention.wise_decode, self.device, self.dtype,
                                    None if wise_config is None else wise_config.selection, kv_cache_dtype)
        if union is not None:
            self.attention = dict.fromkeys(self.buckets, union)
        self.staging = DecodeStaging(rows, self.max_pages, self.device)
        self.sampler = StepSampler(max_num_seqs, self.device, seed)
        self.dense_modes = torch.full((rows,), DENSE, dtype=torch.int32, device=self.device)
        self.unused_support = torch.zeros(rows, config.num_attention_heads, max_blocks, dtype=torch.bool,
                                          device=self.device)
        # Early exit (Ouro's gate, Huginn's adaptive depth): loops the decoded tokens ran, decoded
        # tokens (`decode_step`); None without.
        self.loops_run = (torch.zeros(2, dtype=torch.int64, device=self.device)
                          if config.early_exit_threshold < 1.0 or adaptive_depth is not None else None)
        self.use_graphs = use_graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.step_graphs = StepGraphs(self.device, wise=self.wise, loops_run=self.loops_run,
                                      tensor_parallel=self.tp is not None)
        self.tags = TagCounter()   # the WISE token tags of decoded tokens (`wise_core.engine.step_plan`)

    def _mirror(self, name: str, *args) -> None:
        """On rank 0 under tensor parallelism: every worker's Follower runs `name(*args)` next."""
        if self.workers is not None:
            self.workers.send(name, *args)

    # -- decode -----------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return batch_bucket(self.buckets, n)

    def width(self, pages: int) -> int:
        """The context bucket (page-table width) of a step whose longest row holds `pages` pages."""
        return context_bucket(self.widths, pages)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step (every loop) of each sequence's last token -> logits float32[len(seqs), vocab]."""
        bucket, width = self.bucket(len(seqs)), self.width(max(len(seq.pages) for seq in seqs))
        meta, table = self._stage(seqs, bucket, width)
        self._mirror("decode", bucket, width, meta, table)
        return self.decode_staged(bucket, width)[:len(seqs)]

    def _stage(self, seqs: list[Sequence], bucket: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Stage the step plan of `seqs` at `bucket` rows of `width` pages (`DecodePlan`) -> its
        host views meta int64[6, bucket] and table int32[bucket, pages of the longest row]."""
        plan = DecodePlan.build(seqs, rows=bucket, width=width, page_size=self.page_size,
                                scratch_page=self.cache.scratch_page, tags=self.tags)
        return self.staging.stage(plan, max(len(seq.pages) for seq in seqs))

    def decode_staged(self, bucket: int, width: int) -> torch.Tensor:
        """Copy the staged inputs in and run the decode step at (`bucket` rows, `width` pages) ->
        logits float32[bucket, vocab]."""
        self.staging.copy_in(bucket, width)
        return self.run_step(self.graphs, (bucket, width), lambda: self._forward(bucket, width))

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        """The decode step over the static inputs (a CUDA graph's body) -> logits float32[bucket, vocab]."""
        rows, seq_lens = self.staging.rows(bucket), self.staging.seq_lens[:bucket]
        seq_lens.copy_(rows.seq_lens)
        tokens = torch.where(rows.tokens >= 0, rows.tokens, self.sampler.next_token[rows.seq_slots])
        if self.tp is not None:
            self.tp.broadcast(tokens)   # rank 0 samples: its tokens are every rank's
        batch = DecodeBatch(positions=rows.positions, seq_lens=seq_lens, page_table=self.staging.table(bucket, width),
                            slot_mapping=rows.slot_mapping, tags=rows.tags)
        return self.model.decode_step(tokens, batch, self.cache, wise=self.wise, attention=self.attention[bucket],
                                      dense_modes=self.dense_modes, unused_support=self.unused_support,
                                      dense_attention=self.dense_decode_fn, loops_run=self.loops_run,
                                      **self.decode_inputs)

    def run_step(self, graphs: dict, key: tuple, fn: Callable):
        """fn() (a decode or speculation step over the static inputs) -> its output: eagerly
        where graphs are off, else through `step_graphs` (its graph in `graphs`, captured the
        first time `key` is needed; eager where that capture failed)."""
        if not self.use_graphs:
            return fn()
        return self.step_graphs.run(graphs, key, fn)

    # -- prefill ----------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk]) -> tuple[torch.Tensor, PromptScores | None]:
        """Run prompt chunks (dense, every plane stored) -> (logits float32[completing chunks,
        vocab], in the order of `chunks` among those that complete their prompt; the prompt
        scores of the chunks that score positions (`Chunk.scored`), or None)."""
        inputs = PrefillInputs.pack(chunks, self.cache)
        self._mirror("prefill", inputs)
        logits = self.run_prefill(inputs)
        if not inputs.score_index:
            return logits, None
        logits, scored = logits
        return logits, self.sampler.score_prompt(scored, [c for c in chunks if c.scored])

    def run_prefill(self, inputs: PrefillInputs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Every rank: the prefill of `inputs` -> logits at its logit_index, and when its
        score_index is not empty (logits at logit_index, logits at score_index)."""
        ids, batch = inputs.device_inputs(self.cache, varlen=self.prefill_fn is not None)
        return self.model.prefill(ids, batch, self.cache, attention=self.prefill_fn, **self.step_inputs)

    # -- preemption -------------------------------------------------------------------------
    def offload(self, seq: Sequence, pages: list[int]) -> None:
        """Copy the K/V of seq's cached tokens (every plane; every rank its heads'; an fp8 pool's
        codes and scales) to host memory."""
        n = -(-seq.num_cached // self.page_size)
        if n == 0:
            seq.offloaded = None
            return
        self._mirror("offload", seq.request_id, pages[:n])
        seq.offloaded = copy_out(self.cache, pages[:n])

    def restore(self, seq: Sequence) -> None:
        """Copy an offloaded sequence's K/V back, as they were, into its (new) pages."""
        stored = seq.offloaded
        pages = seq.pages[:stored[0].shape[1]]
        self._mirror("restore", seq.request_id, pages)
        copy_in(self.cache, pages, stored)
        seq.offloaded = None

    def forget(self, seq: Sequence) -> None:
        """A sequence leaves the engine: the workers drop their copies of its K/V if it is offloaded."""
        if seq.offloaded is not None:
            self._mirror("forget", seq.request_id)

    def scrub(self, pages: list[int]) -> None:
        """`pages` as an empty pool holds them on every rank: zero K/V (an fp8 pool's quantized
        zeros), each rank over its shard (`offload.scrub`)."""
        self._mirror("scrub", pages)
        scrub(self.cache, pages)

    # -- WISE and early-exit counters --------------------------------------------------------
    def wise_density(self) -> dict[int, float | None]:
        """WiseState.density over every rank's heads (each rank counts its own)."""
        self._mirror("wise_density")
        return self.wise.density(None if self.tp is None else self.tp.all_reduce)

    def mean_decode_depth(self) -> float | None:
        """Loops (Huginn: core iterations) a decoded token ran on average (Ouro's early exit,
        Huginn's adaptive depth; None without, or before any). Padding rows are not counted, nor
        a graph capture's warm-up (`StepGraphs.capture` restores the counts)."""
        if self.loops_run is None:
            return None
        loops, tokens = self.loops_run.tolist()
        return loops / tokens if tokens else None

    def reset_wise_counters(self) -> None:
        """WiseState.reset_counters on every rank."""
        self._mirror("reset_wise_counters")
        self.wise.reset_counters()
