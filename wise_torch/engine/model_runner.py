"""Runs the model for the engine: the paged cache, WISE state, decode as CUDA graphs, prefill
chunks, offload/restore of preempted sequences, and sampling.

Decode runs at a (batch bucket, context bucket): `decode_buckets` sizes the rows (those past
the real ones are padding rows that read and write only the scratch page), `context_buckets`
the page-table width (`wise_core.buckets`), the smallest rung of a power-of-two ladder holding the longest row's
pages. The width sets what a step costs beside its keys -- the attention's split grid and
block selection, the WISE supports and counters it touches -- so a step costs what its live
context needs, not what max_model_len allows. A row's attention, selection and support do not
depend on the width (only blocks its keys reach are read), so a request that grows across a
rung, or sits beside a longer one, gets the very tokens of any other width. Inputs live in
static buffers filled from pinned host memory with one asynchronous copy per step; on CUDA each
(batch, context) bucket's decode step (every loop, dense or WISE) is captured as a CUDA graph
the first time a step needs it (lazily: a bounded number, len(decode_buckets) x
len(context_buckets), sharing one memory pool) and replayed. Eager mode runs the very same
padded step, so it gives the same tokens. Sampling runs on the device and one device-to-host
read per phase brings back the tokens.

The model is an OuroForCausalLM or a HuginnForCausalLM; the runner calls the same methods of
either: `planes(num_steps)` (the pool's planes for steps of that depth), `step_inputs(num_steps,
positions)` (its own keyword inputs of prefill and decode_step, made once before any graph:
Huginn's iteration count and per-position initial-state table, none for Ouro), `prefill`,
`decode_step` (a Huginn model's also with the engine's adaptive_depth, as `adaptive`, and its
adaptive_regroup, as `regroup`: eager only), `rope_rows`,
`head_weight` and `tp`.

Tensor parallelism (`wise_torch.engine.distributed`): every rank has a runner over its shard
(its heads' K/V pages and WISE supports, the same pool layout). Rank 0's runner, which alone
samples, sends each device-side call with its host inputs to the other ranks (`workers`)
before running it; theirs run the same calls (`follow_decode`, `run_prefill`, ...). A decode
step broadcasts rank 0's input tokens to every rank first, so a token still in flight never
passes through a host.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.buckets import batch_bucket, context_bucket, context_buckets, decode_buckets
from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence
from wise_core.engine.step_plan import DecodePlan, TagCounter
from wise_core.modes import DENSE
from wise_core.wise_config import WiseConfig
from wise_torch.attention import prepare_decode_attention, resolve_dense_decode, resolve_prefill_attention
from wise_torch.union_decode import resolve_wise_decode
from wise_torch.engine.sampler import LogitsState, ranked, sample, seed_for
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch, PrefillGroup, VarlenPrefill
from wise_torch.model import OuroForCausalLM
from wise_torch.wise_state import WiseState

log = logging.getLogger(__name__)


def min_splits_for(rows: int, kv_heads: int, programs: int = 2048) -> int:
    """The fewest splits per row (a power of two in [1, 16]) for a decode step of `rows` rows to
    launch about `programs` programs. Only rows listing few blocks -- short rows, and the sparse
    rows of the reuse loops -- are split further; long dense rows already have more splits
    than this (one per 512 keys), so their work is unchanged. A step of few rows thus keeps
    every SM busy, and a sparse row is not one long program."""
    want = max(programs // (rows * kv_heads), 1)
    return min(1 << (want.bit_length() - 1), 16)


def end_capture(graph: torch.cuda.CUDAGraph, pool: tuple, device: torch.device) -> None:
    """End `graph`'s capture into `pool`. When CUDA reports the capture failed (an invalidated
    capture: it is over, with no graph), torch's capture_end raises before it stops routing the
    device's allocations to the pool and drops its reference to it; this does both (what
    `torch.cuda.use_mem_pool` does on leaving), then re-raises: a routing left in place would keep
    the caching allocator from ever processing its cross-stream events again."""
    try:
        graph.capture_end()
    except Exception:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):   # not routed: the capture never began
            torch._C._cuda_endAllocateToPool(index, pool)
            torch._C._cuda_releasePool(index, pool)
        raise


def describe_step(key: tuple) -> str:
    """A captured step's name for the log: decode's key is (batch bucket, context bucket),
    speculation's starts with its kind ("draft", "verify")."""
    if isinstance(key[0], str):
        return f"speculation {key}"
    return f"decode (batch bucket {key[0]} rows, context bucket {key[1]} pages)"


class InFlight:
    """What a step sampled, on its way to the host: the rows' (sequence, token index), and
    pinned host copies of the tokens (a NaN flag each), their log p (when asked), their rank and
    the most probable tokens (`ranked`, when asked), kept logits, and the prompt scores (`prompt`:
    prompt_rows [(sequence, first prompt token scored, count)] and `ranked` of those positions),
    enqueued after the sampling kernels; `read` and `read_prompt` wait for just those copies."""

    def __init__(self, rows: list, tokens: torch.Tensor, nan: torch.Tensor, logprobs: torch.Tensor | None,
                 logits: dict[int, torch.Tensor], top: tuple | None = None, prompt: tuple[list, tuple] | None = None):
        pin = tokens.device.type == "cuda"
        host = lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)  # noqa: E731
        self.rows = rows
        self._host = [host(t) for t in (tokens, nan, logprobs) + (top or ()) if t is not None]
        self.logits = {i: host(row) for i, row in logits.items()}
        self.prompt_rows, self._prompt = [], ()
        if prompt is not None:
            self.prompt_rows, self._prompt = prompt[0], tuple(host(t) for t in prompt[1])
        self.event = None
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def _wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> tuple[list[int], list[bool], list[float] | None, list[tuple] | None]:
        self._wait()
        host = [t.tolist() for t in self._host]
        return host[0], host[1], host[2] if len(host) > 2 else None, list(zip(*host[3:])) if len(host) > 3 else None

    def read_prompt(self) -> list[tuple]:
        self._wait()
        return list(zip(*(t.tolist() for t in self._prompt)))


class ModelRunner:
    _META = ("tokens", "positions", "seq_lens", "slot_mapping", "tags", "slots")

    def __init__(self, model: OuroForCausalLM, *, wise_config: WiseConfig | None, num_pages: int, page_size: int,
                 max_num_seqs: int, max_model_len: int, use_graphs: bool, kernel: str, seed: int,
                 prefill_attention: str = "auto", dense_decode: str = "kernel", wise_decode: str = "kernel",
                 num_steps: int | None = None, adaptive_depth: AdaptiveDepth | None = None,
                 adaptive_regroup: bool = False, workers=None):
        config = model.config
        # Tensor parallelism: the model's `tp` on every rank (None: one device); `workers` on rank
        # 0 (distributed.Workers), which follow its device-side calls.
        self.tp, self.workers = model.tp, workers
        self.offloaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # a worker's, by request id
        weight = model.head_weight
        self.model, self.config, self.device, self.dtype = model, config, weight.device, weight.dtype
        block_size = (wise_config or WiseConfig()).block_size
        self.page_size = page_size
        # What prefill attention runs ("sdpa", "fa4", "reference") and its varlen function (None: SDPA).
        self.prefill_attention, self.prefill_fn = resolve_prefill_attention(prefill_attention, self.device,
                                                                            self.dtype)
        self.dense_decode = dense_decode   # "kernel" or "fa4": what runs the dense decode loops
        self.dense_decode_fn = resolve_dense_decode(dense_decode, self.device, self.dtype)
        self.max_pages = -(-max_model_len // page_size)
        positions = min(self.max_pages * page_size, config.max_position_embeddings)
        model.rope_rows(positions)   # before any graph
        max_blocks = self.max_pages * page_size // block_size
        # The depth of a step (Ouro: its loops; Huginn: core iterations, None its default) and the
        # model's own inputs of prefill and decode_step (static: made before any graph).
        self.num_steps = config.num_loops if num_steps is None else num_steps
        self.cache = PagedKVCache(planes=model.planes(self.num_steps), num_pages=num_pages, page_size=page_size,
                                  kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=self.dtype,
                                  device=self.device)
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
            kernel, batches=self.buckets, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, max_blocks=max_blocks, block_size=block_size, dtype=self.dtype,
            device=self.device, min_splits=lambda b: min_splits_for(b, config.num_key_value_heads),
            selection=None if wise_config is None else wise_config.selection)
        # What runs the WISE loops: the kernel above, or an arm of `wise_torch.union_decode`.
        if wise_decode != "kernel" and wise_config is None:
            raise ValueError(f"wise_decode={wise_decode!r} runs WISE loops; the engine has no wise_config")
        self.wise_decode = wise_decode
        union = resolve_wise_decode(wise_decode, self.device, self.dtype,
                                    None if wise_config is None else wise_config.selection)
        if union is not None:
            self.attention = dict.fromkeys(self.buckets, union)
        # Static decode inputs (graph inputs) and their pinned host staging. The page table of a
        # step at (bucket, width) is the first bucket * width entries, as [bucket, width].
        pin = self.device.type == "cuda"
        # Two host stagings, used in turn: a step's copy may still be queued when the next step is
        # staged, never when the one after it is (the host has read that step's tokens by then).
        self.meta = torch.zeros(len(self._META), rows, dtype=torch.int64, device=self.device)
        self.page_table = torch.zeros(rows * self.max_pages, dtype=torch.int32, device=self.device)
        self.host_meta = [torch.zeros(len(self._META), rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_table = [torch.zeros(rows * self.max_pages, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.staged = 0
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # The last token sampled for each sequence slot: a decode row whose token is still in
        # flight (staged as -1) reads it here, so a step never waits for the host to see tokens.
        self.next_token = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self.dense_modes = torch.full((rows,), DENSE, dtype=torch.int32, device=self.device)
        self.unused_support = torch.zeros(rows, config.num_attention_heads, max_blocks, dtype=torch.bool,
                                          device=self.device)
        # Early exit (Ouro's gate, Huginn's adaptive depth): loops the decoded tokens ran, decoded
        # tokens (`decode_step`); None without.
        self.loops_run = (torch.zeros(2, dtype=torch.int64, device=self.device)
                          if config.early_exit_threshold < 1.0 or adaptive_depth is not None else None)
        self.use_graphs = use_graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Steps (decode: (bucket, width); speculation: its kind first) whose capture failed, with
        # the error: they run eagerly from then on (`run_step`).
        self.eager_steps: dict[tuple, str] = {}
        self.graph_pool = None
        self.capture_s = 0.0   # time spent capturing graphs (decode and speculation)
        self.tags = TagCounter()   # the WISE token tags of decoded tokens (`wise_core.engine.step_plan`)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.logits_state: LogitsState | None = None    # made when a processed request first samples

    # -- decode -----------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return batch_bucket(self.buckets, n)

    def width(self, pages: int) -> int:
        """The context bucket (page-table width) of a step whose longest row holds `pages` pages."""
        return context_bucket(self.widths, pages)

    @staticmethod
    def table_view(flat: torch.Tensor, bucket: int, width: int) -> torch.Tensor:
        """A page-table buffer as the [bucket, width] table of a step."""
        return flat[:bucket * width].view(bucket, width)

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        m = self.meta[:, :bucket]
        self.seq_lens[:bucket].copy_(m[2])
        tokens = torch.where(m[0] >= 0, m[0], self.next_token[m[5]])
        if self.tp is not None:
            self.tp.broadcast(tokens)   # rank 0 samples: its tokens are every rank's
        batch = DecodeBatch(positions=m[1], seq_lens=self.seq_lens[:bucket],
                            page_table=self.table_view(self.page_table, bucket, width), slot_mapping=m[3], tags=m[4])
        return self.model.decode_step(tokens, batch, self.cache, wise=self.wise, attention=self.attention[bucket],
                                      dense_modes=self.dense_modes, unused_support=self.unused_support,
                                      dense_attention=self.dense_decode_fn, loops_run=self.loops_run,
                                      **self.decode_inputs)

    def _next_staging(self, bucket: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The host staging of the next step as numpy views: meta int64[6, rows], table
        int32[bucket, width]."""
        self.staged += 1
        table = self.table_view(self.host_table[self.staged % 2], bucket, width)
        return self.host_meta[self.staged % 2].numpy(), table.numpy()

    def _stage(self, seqs: list[Sequence], bucket: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Fill the host staging with the step plan of `seqs` at `bucket` rows of `width` pages
        (`DecodePlan`: padding rows and the columns past a row's pages on the scratch page) ->
        its views meta int64[6, bucket] and table int32[bucket, pages of the longest row]."""
        plan = DecodePlan.build(seqs, rows=bucket, width=width, page_size=self.page_size,
                                scratch_page=self.cache.scratch_page, tags=self.tags)
        meta, table = self._next_staging(bucket, width)
        meta[:, :bucket] = (plan.tokens, plan.positions, plan.seq_lens, plan.slot_mapping, plan.tags, plan.seq_slots)
        table[:] = plan.page_table
        return meta[:, :bucket], table[:, :max(len(seq.pages) for seq in seqs)]

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step (every loop) of each sequence's last token -> logits float32[len(seqs), vocab]."""
        bucket, width = self.bucket(len(seqs)), self.width(max(len(seq.pages) for seq in seqs))
        meta, table = self._stage(seqs, bucket, width)
        if self.workers is not None:
            self.workers.send("follow_decode", bucket, width, meta, table)
        return self._decode_staged(bucket, width)[:len(seqs)]

    def follow_decode(self, bucket: int, width: int, meta: np.ndarray, table: np.ndarray) -> None:
        """A worker's decode step of rank 0's staged rows (`_stage`'s views). Its staging
        buffers alternate as rank 0's do: rank 0 stages a step only once it has read the tokens
        of the step two before, which needed every rank's collectives of that step, each after
        that rank's copy of its inputs; so no copy of a worker is still queued when its buffer is
        refilled."""
        host_meta, host_table = self._next_staging(bucket, width)
        host_meta[:, :bucket] = meta
        host_table[:] = self.cache.scratch_page
        host_table[:, :table.shape[1]] = table
        self._decode_staged(bucket, width)

    def _decode_staged(self, bucket: int, width: int) -> torch.Tensor:
        """Copy the staged inputs in and run the decode step at (`bucket` rows, `width` pages) ->
        logits float32[bucket, vocab]."""
        host_meta, host_table = self.host_meta[self.staged % 2], self.host_table[self.staged % 2]
        self.meta[:, :bucket].copy_(host_meta[:, :bucket], non_blocking=True)
        self.page_table[:bucket * width].copy_(host_table[:bucket * width], non_blocking=True)
        return self.run_step(self.graphs, (bucket, width), lambda: self._forward(bucket, width))

    def run_step(self, graphs: dict, key: tuple, fn):
        """fn() (a decode or speculation step over the static inputs) -> its output: the replay
        of its CUDA graph in `graphs`, captured the first time `key` is needed; eagerly where
        graphs are off or `key`'s capture failed (the eager step computes what the graph would)."""
        if not self.use_graphs or key in self.eager_steps:
            return fn()
        if key not in graphs:
            captured = self.capture(key, fn)
            if captured is None:
                return fn()
            graphs[key] = captured
        graph, out = graphs[key]
        graph.replay()
        return out

    def capture(self, key: tuple, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None] | None:
        """Capture fn() (a decode or speculation step over the static inputs) as a CUDA graph in
        the shared pool, after a warm-up that compiles the kernels -> (graph, fn's output); the
        WISE and early-exit counters the warm-up touches are restored. Under tensor parallelism
        every rank captures the same step in the same call: the warm-up's collectives pair up,
        and the captured ones run at each replay.

        A capture that fails (any exception in the warm-up or the capture) cannot take the
        engine down: it is ended and its partial graph dropped, the device synchronised (a lost
        CUDA context raises there), the counters restored, and `key` noted in `eager_steps` and
        logged -> None: the caller runs fn() eagerly, now and at every later step of `key`."""
        start = time.perf_counter()
        counters = self._save_counters()
        try:
            return self._warm_up_and_capture(fn)
        except Exception as error:
            self._abandon_capture(key, error)
            return None
        finally:
            self._restore_counters(counters)
            self.capture_s += time.perf_counter() - start

    def _save_counters(self) -> tuple[dict | None, torch.Tensor | None]:
        """Copies of the WISE state and the early-exit counts (None for those the engine lacks)."""
        return (None if self.wise is None else self.wise.snapshot(),
                None if self.loops_run is None else self.loops_run.clone())

    def _restore_counters(self, counters: tuple[dict | None, torch.Tensor | None]) -> None:
        wise, loops_run = counters
        if wise is not None:
            self.wise.restore(wise)
        if loops_run is not None:
            self.loops_run.copy_(loops_run)

    def _warm_up_and_capture(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """fn() once on a side stream (compiling its kernels), then captured there -> (graph, output)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.tp is not None:
            torch.cuda.synchronize(self.device)   # no collective of the warm-up is pending during the capture
        return self._record_graph(fn, stream)

    def _record_graph(self, fn, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """fn() captured on `stream` as a CUDA graph in the shared pool -> (graph, output). What
        `torch.cuda.graph` does, except that a capture that fails is ended before its error
        propagates (`end_capture`) and the current stream is restored either way.

        thread_local: a CUDA call from another thread of the process (JAX's runtime threads,
        when both frameworks share it) does not invalidate this capture, as it does in "global"
        mode."""
        pool = self.graph_pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except Exception:
                with contextlib.suppress(Exception):   # the capture's own error is fn's, raised below
                    end_capture(graph, pool, self.device)
                raise
            end_capture(graph, pool, self.device)
        self.graph_pool = pool
        return graph, out

    def _abandon_capture(self, key: tuple, error: Exception) -> None:
        """After a failed capture of step `key` (ended by `_record_graph`; its graph dropped with
        the frame): wait for the device (a lost CUDA context raises here, the capture's error
        chained), then note `key` as eager and log it -- once, as a step is captured once."""
        torch.cuda.synchronize(self.device)
        self.eager_steps[key] = f"{type(error).__name__}: {error}"
        log.warning("CUDA-graph capture of the %s step failed, so that step runs eagerly from now on "
                    "(the same tokens, without the graph's speed): %s", describe_step(key),
                    self.eager_steps[key])

    # -- prefill ----------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk]) -> tuple[torch.Tensor, tuple[list, tuple] | None]:
        """Run prompt chunks (dense, every plane stored) -> (logits float32[completing chunks,
        vocab], in the order of `chunks` among those that complete their prompt; the prompt
        scores of the chunks that score positions (`Chunk.scored`), `InFlight`'s prompt, or None)."""
        inputs = self._prefill_inputs(chunks)
        if self.workers is not None:
            self.workers.send("run_prefill", *inputs)
        logits = self.run_prefill(*inputs)
        if not inputs[-1]:
            return logits, None
        logits, scored = logits
        return logits, self.score_prompt(scored, [c for c in chunks if c.scored])

    def score_prompt(self, logits: torch.Tensor, chunks: list[Chunk]) -> tuple[list, tuple]:
        """The scores of `chunks`' scored positions (logits float32[positions, vocab], chunk by
        chunk) -> (prompt_rows, `ranked` of each position's next prompt token with the chunks'
        largest prompt_logprobs k)."""
        rows = [(c.seq, c.start + 1, c.scored) for c in chunks]
        tokens = torch.tensor([t for c in chunks for t in c.seq.prompt[c.start + 1:c.start + 1 + c.scored]],
                              dtype=torch.int64).to(self.device, non_blocking=True)
        k = min(max(c.seq.params.prompt_logprobs for c in chunks), logits.shape[1])
        return rows, ranked(logits, tokens, k)

    def _prefill_inputs(self, chunks: list[Chunk]) -> tuple:
        """The host inputs of `run_prefill` for `chunks` (lists of ints)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault((c.start, c.length), []).append(i)
        ids, positions, slots, offset = [], [], [], 0
        meta, first_token = [], {}
        for (start, length), members in groups.items():
            index = []
            for i in members:
                seq = chunks[i].seq
                first_token[i] = offset
                ids.extend(seq.prompt[start:start + length])
                positions.extend(range(start, start + length))
                slots.extend(self.cache.slot(seq.pages, p) for p in range(start, start + length))
                index.extend(range(offset, offset + length))
                offset += length
            n_pages = -(-(start + length) // self.page_size)
            pages = [chunks[i].seq.pages[:n_pages] for i in members]
            meta.append((start, length, len(members), index, pages))
        logit_index = [first_token[i] + c.length - 1 for i, c in enumerate(chunks) if c.completes]
        score_index = [first_token[i] + j for i, c in enumerate(chunks) for j in range(c.scored)]
        return ids, positions, slots, meta, logit_index, score_index

    def run_prefill(self, ids: list[int], positions: list[int], slots: list[int], groups: list[tuple],
                    logit_index: list[int], score_index: list[int]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Every rank: the prefill of flat prompt tokens `ids` at `positions` into cache `slots`,
        in groups (start, length, count, token index, pages) -> logits at `logit_index`, and when
        `score_index` is not empty (logits at logit_index, logits at score_index). A group's
        chunks hold consecutive runs of tokens, in the group order: the varlen chunks' order."""
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        varlen = None
        if self.prefill_fn is not None:
            varlen = VarlenPrefill.build([(start, length, p) for start, length, _, _, pages in groups for p in pages],
                                         page_size=self.page_size, scratch_page=self.cache.scratch_page,
                                         device=self.device)
        batch = PrefillBatch(
            positions=as_long(positions), slot_mapping=as_long(slots),
            groups=[] if varlen is not None else [PrefillGroup(start, length, count, as_long(index), as_long(pages))
                                                  for start, length, count, index, pages in groups],
            logit_index=as_long(logit_index), varlen=varlen, score_index=as_long(score_index) if score_index else None)
        return self.model.prefill(as_long(ids), batch, self.cache, attention=self.prefill_fn, **self.step_inputs)

    # -- preemption -------------------------------------------------------------------------
    def offload(self, seq: Sequence, pages: list[int]) -> None:
        """Copy the K/V of seq's cached tokens (every plane; every rank its heads') to host memory."""
        n = -(-seq.num_cached // self.page_size)
        if n == 0:
            seq.offloaded = None
            return
        if self.workers is not None:
            self.workers.send("offload_pages", seq.request_id, pages[:n])
        seq.offloaded = self.offload_pages(seq.request_id, pages[:n])

    def offload_pages(self, request_id: int, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of `pages` of every plane -> (k, v) [planes, len(pages), page_size, kv_heads,
        head_dim]; a worker keeps them under the request's id."""
        index = torch.tensor(pages, device=self.device)
        saved = (self.cache.k[:, index].cpu(), self.cache.v[:, index].cpu())
        if self.tp is not None and self.tp.rank > 0:
            self.offloaded[request_id] = saved
        return saved

    def restore(self, seq: Sequence) -> None:
        """Copy an offloaded sequence's K/V back into its (new) pages."""
        k, v = seq.offloaded
        pages = seq.pages[:k.shape[1]]
        if self.workers is not None:
            self.workers.send("restore_pages", seq.request_id, pages)
        self._copy_in(pages, k, v)
        seq.offloaded = None

    def restore_pages(self, request_id: int, pages: list[int]) -> None:
        """A worker's part of `restore`: its copies of the request's K/V into `pages`."""
        self._copy_in(pages, *self.offloaded.pop(request_id))

    def _copy_in(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(pages, device=self.device)
        self.cache.k[:, index] = k.to(self.device)
        self.cache.v[:, index] = v.to(self.device)

    def forget(self, seq: Sequence) -> None:
        """A sequence leaves the engine: the workers drop their copies of its K/V if it is offloaded."""
        if self.workers is not None and seq.offloaded is not None:
            self.workers.send("drop_offloaded", seq.request_id)

    def drop_offloaded(self, request_id: int) -> None:
        del self.offloaded[request_id]

    # -- WISE counters ----------------------------------------------------------------------
    def wise_density(self) -> dict[int, float | None]:
        """WiseState.density over every rank's heads (each rank counts its own)."""
        if self.workers is not None:
            self.workers.send("wise_density")
        return self.wise.density(None if self.tp is None else self.tp.all_reduce)

    def mean_decode_depth(self) -> float | None:
        """Loops (Huginn: core iterations) a decoded token ran on average (Ouro's early exit,
        Huginn's adaptive depth; None without, or before any). Padding rows are not counted, nor
        a graph capture's warm-up (`capture` restores the counts)."""
        if self.loops_run is None:
            return None
        loops, tokens = self.loops_run.tolist()
        return loops / tokens if tokens else None

    def reset_wise_counters(self) -> None:
        """WiseState.reset_counters on every rank."""
        if self.workers is not None:
            self.workers.send("reset_wise_counters")
        self.wise.reset_counters()

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], prompt: tuple[list, tuple] | None = None
               ) -> InFlight:
        """Sample each sequence's next token on the device (its forced token when
        teacher-forced), note it in the sequence slots' `next_token` and hold its place in the
        sequence; log p of it (under the raw logits) and the logits where asked. Nothing waits
        for the host. prompt: the step's prompt scores (`prefill`), copied out with the tokens.

        Runs eagerly, outside the decode step's CUDA graph, on the logits it returns. The rows
        of processed requests (`SamplingParams.processed`) go through `LogitsState.process`
        first; when no row is, the logits go to `sample` untouched and no logits state is read
        or made: a step of default requests does what it did before logits processing existed."""
        if not seqs:   # a step that samples nothing still marks when it is done
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return InFlight([], empty, empty.bool(), None, {}, prompt=prompt)
        temperatures, generators = [], []
        for seq in seqs:
            p = seq.params
            temperatures.append(0.0 if seq.forced is not None else p.temperature)
            if p.temperature > 0 and p.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(seed_for(p.seed, len(seq.tokens)))
            generators.append(seq.generator if p.seed is not None else self.generator)
        processed = [i for i, s in enumerate(seqs) if s.forced is None and s.params.processed]
        chosen_from = logits
        if processed:
            if self.logits_state is None:
                self.logits_state = LogitsState(len(self.next_token), logits.shape[1], self.device)
            index = torch.tensor(processed, device=self.device)
            chosen_from = logits.index_copy(0, index, self.logits_state.process(logits[index],
                                                                                [seqs[i] for i in processed]))
        tokens = sample(chosen_from, temperatures, [s.params for s in seqs], generators)
        forced = [i for i, s in enumerate(seqs) if s.forced is not None]
        if forced:
            tokens[torch.tensor(forced, device=self.device)] = torch.tensor(
                [seqs[i].forced[seqs[i].num_generated] for i in forced], device=self.device)
        if processed:
            self.logits_state.count([seqs[i] for i in processed], tokens[index])
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        self.next_token.index_copy_(0, slots, tokens)
        logprobs = top = None
        if any(s.params.logprobs is not None or s.forced is not None for s in seqs):
            logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        asked = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if asked:
            top = ranked(logits, tokens, min(max(asked), logits.shape[1]))[1:]
        kept = {i: logits[i] for i, s in enumerate(seqs) if s.keep_logits}
        rows = [(seq, seq.expect()) for seq in seqs]
        return InFlight(rows, tokens, torch.isnan(logits).any(-1), logprobs, kept, top, prompt)
