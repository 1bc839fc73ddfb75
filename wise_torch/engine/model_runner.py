"""Runs the model for the engine: the paged cache, WISE state, decode as CUDA graphs, prefill
chunks, offload/restore of preempted sequences, and sampling.

Decode runs at a batch-size bucket (`decode_buckets`): the rows past the real ones are padding
rows that read and write only the scratch page. Inputs live in static buffers filled from
pinned host memory with one asynchronous copy per step; on CUDA each bucket's decode step
(every loop, dense or WISE) is captured once as a CUDA graph and replayed. Eager mode runs the
very same padded step, so it gives the same tokens. Sampling runs on the device and one
device-to-host read per phase brings back the tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from wise_core.config import WiseConfig
from wise_core.modes import DENSE
from wise_torch.attention import prepare_decode_attention
from wise_torch.engine.sampler import sample, seed_for
from wise_torch.engine.scheduler import Chunk
from wise_torch.engine.sequence import Sequence
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch, PrefillGroup
from wise_torch.model import OuroForCausalLM
from wise_torch.wise_state import WiseState


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step runs at: 1, 2, 4, 8, then multiples of 16, up to max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def min_splits_for(rows: int, kv_heads: int, programs: int = 256) -> int:
    """Splits per row (at least) for a decode step of `rows` rows to launch about `programs`
    programs (a power of two in [1, 16]); 1 once the rows alone fill the GPU."""
    want = max(programs // (rows * kv_heads), 1)
    return min(1 << (want.bit_length() - 1), 16)


class ModelRunner:
    _META = ("tokens", "positions", "seq_lens", "slot_mapping", "epochs")

    def __init__(self, model: OuroForCausalLM, *, wise_config: WiseConfig | None, num_pages: int, page_size: int,
                 max_num_seqs: int, max_model_len: int, use_graphs: bool, kernel: str, seed: int):
        config = model.config
        weight = model.head_weight
        self.model, self.config, self.device, self.dtype = model, config, weight.device, weight.dtype
        block_size = (wise_config or WiseConfig()).block_size
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        max_blocks = self.max_pages * page_size // block_size
        self.cache = PagedKVCache.for_model(config, num_pages=num_pages, page_size=page_size, dtype=self.dtype,
                                            device=self.device)
        self.buckets = decode_buckets(max_num_seqs)
        rows = self.buckets[-1]
        self.wise = None if wise_config is None else WiseState(wise_config, config, max_rows=rows,
                                                                max_blocks=max_blocks, device=self.device)
        # Per bucket, a decode attention whose rows split into enough programs to fill the GPU.
        self.attention = {}
        for b in self.buckets:
            self.attention[b] = prepare_decode_attention(
                kernel, max_batch=b, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim, max_blocks=max_blocks, block_size=block_size, dtype=self.dtype,
                device=self.device, min_splits=min_splits_for(b, config.num_key_value_heads))
        # Static decode inputs (graph inputs) and their pinned host staging.
        pin = self.device.type == "cuda"
        self.meta = torch.zeros(len(self._META), rows, dtype=torch.int64, device=self.device)
        self.host_meta = torch.zeros(len(self._META), rows, dtype=torch.int64, pin_memory=pin)
        self.page_table = torch.zeros(rows, self.max_pages, dtype=torch.int32, device=self.device)
        self.host_table = torch.zeros(rows, self.max_pages, dtype=torch.int32, pin_memory=pin)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.dense_modes = torch.full((rows,), DENSE, dtype=torch.int32, device=self.device)
        self.unused_support = torch.zeros(rows, config.num_attention_heads, max_blocks, dtype=torch.bool,
                                          device=self.device)
        self.use_graphs = use_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        self.next_epoch = 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # -- decode -----------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _batch(self, bucket: int) -> tuple[torch.Tensor, DecodeBatch]:
        m = self.meta[:, :bucket]
        return m[0], DecodeBatch(positions=m[1], seq_lens=self.seq_lens[:bucket], page_table=self.page_table[:bucket],
                                 slot_mapping=m[3], epochs=m[4])

    def _forward(self, bucket: int) -> torch.Tensor:
        self.seq_lens[:bucket].copy_(self.meta[2, :bucket])
        tokens, batch = self._batch(bucket)
        return self.model.decode_step(tokens, batch, self.cache, wise=self.wise, attention=self.attention[bucket],
                                      dense_modes=self.dense_modes, unused_support=self.unused_support)

    def _stage(self, seqs: list[Sequence], bucket: int) -> None:
        """Fill the host staging for `bucket` rows (padding rows: the scratch page) and copy it in."""
        scratch = self.cache.scratch_page
        meta, table = self.host_meta.numpy(), self.host_table.numpy()
        meta[:, :bucket] = np.array([[0], [0], [1], [scratch * self.page_size], [-1]])
        table[:bucket] = scratch
        for row, seq in enumerate(seqs):
            pos = len(seq.tokens) - 1
            meta[:, row] = (seq.tokens[-1], pos, pos + 1, self.cache.slot(seq.pages, pos), self.next_epoch)
            self.next_epoch += 1
            table[row, :len(seq.pages)] = seq.pages
        self.meta[:, :bucket].copy_(self.host_meta[:, :bucket], non_blocking=True)
        self.page_table[:bucket].copy_(self.host_table[:bucket], non_blocking=True)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode step (every loop) of each sequence's last token -> logits float32[len(seqs), vocab]."""
        bucket = self.bucket(len(seqs))
        self._stage(seqs, bucket)
        if not self.use_graphs:
            return self._forward(bucket)[:len(seqs)]
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:len(seqs)]

    def _capture(self, bucket: int) -> None:
        """Capture the decode step at `bucket` rows as a CUDA graph (after a warm-up that compiles
        the kernels; the WISE counters it touches are restored). Inputs are the staged rows."""
        saved = None if self.wise is None else self.wise.snapshot()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self._forward(bucket)
        self.graph_pool = graph.pool()
        if saved is not None:
            self.wise.restore(saved)
        self.graphs[bucket] = (graph, logits)

    # -- prefill ----------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run prompt chunks (dense, every plane stored) -> logits float32[completing chunks, vocab],
        in the order of `chunks` among those that complete their prompt."""
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
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        batch = PrefillBatch(
            positions=as_long(positions), slot_mapping=as_long(slots),
            groups=[PrefillGroup(start, length, count, as_long(index), as_long(pages))
                    for start, length, count, index, pages in meta],
            logit_index=as_long([first_token[i] + c.length - 1 for i, c in enumerate(chunks) if c.completes]))
        return self.model.prefill(as_long(ids), batch, self.cache)

    # -- preemption -------------------------------------------------------------------------
    def offload(self, seq: Sequence, pages: list[int]) -> None:
        """Copy the K/V of seq's cached tokens (every plane) to host memory."""
        n = -(-seq.num_cached // self.page_size)
        if n == 0:
            seq.offloaded = None
            return
        index = torch.tensor(pages[:n], device=self.device)
        seq.offloaded = (self.cache.k[:, index].cpu(), self.cache.v[:, index].cpu())

    def restore(self, seq: Sequence) -> None:
        """Copy an offloaded sequence's K/V back into its (new) pages."""
        k, v = seq.offloaded
        index = torch.tensor(seq.pages[:k.shape[1]], device=self.device)
        self.cache.k[:, index] = k.to(self.device)
        self.cache.v[:, index] = v.to(self.device)
        seq.offloaded = None

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
        """Next token of each sequence (its forced token when teacher-forced) and, when any
        sequence asks, log p of it. Keeps logits of sequences that ask. One host read."""
        temperatures, top_ps, generators = [], [], []
        for seq in seqs:
            p = seq.params
            temperatures.append(0.0 if seq.forced is not None else p.temperature)
            top_ps.append(p.top_p)
            if p.temperature > 0 and p.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(seed_for(p.seed, len(seq.tokens)))
            generators.append(seq.generator if p.seed is not None else self.generator)
        tokens = sample(logits, temperatures, top_ps, generators)
        forced = [i for i, s in enumerate(seqs) if s.forced is not None]
        if forced:
            tokens[torch.tensor(forced, device=self.device)] = torch.tensor(
                [seqs[i].forced[len(seqs[i].output)] for i in forced], device=self.device)
        nan = torch.isnan(logits).any(-1)
        want = [s.params.logprobs or s.forced is not None for s in seqs]
        rows = [tokens, nan.long()]
        logprobs = None
        if any(want):
            logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        for seq, row in zip(seqs, logits):
            if seq.keep_logits:
                seq.logits.append(row.cpu())
        host = torch.stack(rows).tolist()
        bad = [seqs[i].request_id for i, x in enumerate(host[1]) if x]
        if bad:
            raise FloatingPointError(f"the model's logits are NaN for request(s) {bad}")
        return host[0], None if logprobs is None else logprobs.tolist()
