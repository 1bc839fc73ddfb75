"""Lossless speculative decoding: a cheap draft, then one dense verification pass per round.

A round decodes a step's sequences (each with n tokens, n - 1 of them cached); d is the
verify depth (`SpeculativeConfig.verify_depth`), D the model's loop count.
1. Draft. Row i drafts k_i = min(num_draft, tokens it may still produce - 1) tokens (adaptive:
   num_draft replaced by `SpeculativeConfig.draft_count` of the request's decayed counts). Draft
   step j (j = 0..k_i) feeds x_j (x_0 the last committed token, then the drafted ones) at
   position n - 1 + j, as a decode step over the rows with k_i >= j (rows sorted by k_i, so they
   are a prefix): method "wise" runs its loops (`SpeculativeConfig.draft_end`: every loop, or
   the first draft_loops; discovery dense, reuse sparse), "loops" the loops before d, then the
   LM head; a step in which every row is at its last position runs
   only the loops before d. Each step stores its K/V in the planes it runs and saves the hidden
   state after loop d - 1 for verification. The drafted token is chosen on the device (argmax,
   or a sample of the draft distribution q) and fed to the next step: no host sync.
   Sparse discovery (`SpeculativeConfig.sparse_discovery`, d = 0): step 0 feeds the request's
   last verified token x_0 and runs as above, its discovery loops finding its support; every
   later step ("sparse") runs each loop, discovery loops included, on row r's support of x_0
   (found by the row's step 0 of this round: checked by its tag, else the loop attends
   densely), with the blocks of the round's later keys added (`WiseState.sparse_draft_modes`).
2. Verify. One pass over num_draft + 1 positions per row (past k_i: padding that writes the
   scratch slot) runs loops d..D-1 from the saved hidden states (`VerifyContext`): it rewrites
   those planes' K/V of the round's positions, and every position attends causally over its
   row's cache. The loops before d attended densely in the draft (DISCOVER is bitwise DENSE),
   so these are dense decode's logits (d = 0: every loop is recomputed).
3. Accept. Greedy: the longest prefix of drafts equal to the dense argmax, then the dense
   token after it. Sampling: draft j is kept with probability min(1, p_j / q_j) (p the dense
   distribution after temperature and top-p); the first rejected one is replaced by a sample of
   norm(max(p - q, 0)); a round that keeps every draft adds a sample of p. The output is then
   distributed as dense sampling. One host read per round brings back the tokens.
4. Roll back. Accepted positions have exact K/V in every plane; a sequence keeps the pages of
   its committed tokens only, the rest go back to the pool. K/V left at rejected positions lies
   past the row's keys and is rewritten before any query can reach it. WISE supports are
   tagged with the tag of the draft step that found them (fresh per step), so the support of
   a rejected token never matches a later one.
Seeded requests draw every random number from a generator seeded by (seed, position, purpose):
reproducible whatever runs beside them, and each draw decides at most one committed token.

Draft steps run as CUDA graphs per (batch bucket, step kind, context bucket), verification per
(batch bucket, context bucket) at num_draft + 1 positions per row, captured like the decode
graphs (lazily, `wise_torch.engine.graphs`) and sharing their memory pool; the context bucket is the
round's: the page-table width holding every row's pages, drafts included.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from wise_core.engine.block_manager import BlockManager
from wise_core.engine.sequence import PENDING, Sequence, Status
from wise_core.speculative_config import SpeculativeConfig
from wise_torch.engine.model_runner import ModelRunner, min_splits_for
from wise_torch.engine.sampler import scaled_logits, seed_for
from wise_torch.engine.staging import table_view
from wise_torch.kv_cache import DecodeBatch
from wise_torch.model import DecodeContext
from wise_torch.verification import VerifyBatch, VerifyContext, prepare_verify_attention

DRAFT, ACCEPT, RESIDUAL = 0, 1, 2   # purposes of a seeded request's random draws at one position
HISTORY_DECAY = 0.8                  # adaptive drafting: the weight of a request's earlier rounds


def draw_seed(seed: int, position: int, purpose: int) -> int:
    """Generator seed of a seeded request's draw for `purpose` at the token `position`."""
    return seed_for(seed, 3 * position + purpose)


@dataclasses.dataclass
class SpeculativeCounters:
    rounds: int = 0           # (sequence, round) pairs
    drafted: int = 0          # draft tokens proposed
    accepted: int = 0         # draft tokens the dense model agreed with


class Speculator:
    """Speculative rounds over a ModelRunner's cache, WISE state and decode attention."""

    # Rows of a draft step's metadata (the decode step's, plus where its hidden state goes).
    _TOKEN, _POSITION, _SEQ_LEN, _SLOT, _TAG, _HIDDEN = range(6)

    def __init__(self, runner: ModelRunner, blocks: BlockManager, config: SpeculativeConfig, *, kernel: str):
        if not isinstance(config, SpeculativeConfig):
            raise TypeError(f"speculative_config must be a SpeculativeConfig, got {type(config).__name__}")
        model, c = runner.model, runner.model.config
        self.runner, self.blocks, self.config, self.model = runner, blocks, config, model
        self.depth = config.verify_depth(c.num_loops, None if runner.wise is None else runner.wise.config)
        self.draft_end = config.draft_end(c.num_loops)
        self.num_draft = k = config.num_draft
        self.queries = q = k + 1
        rows = runner.buckets[-1]
        device = self.device = runner.device
        pin = device.type == "cuda"
        # One pinned staging buffer and one copy per round: every draft step's metadata
        # [queries, 6, rows], the verification's positions and slots [2, rows * queries], and
        # each row's draft count [rows].
        self.host = torch.zeros(q * 6 * rows + 2 * rows * q + rows, dtype=torch.int64, pin_memory=pin)
        self.staged = torch.zeros_like(self.host, device=device)
        self.meta, self.verify_meta, self.row_drafts = self._views(self.staged, rows)
        self.host_table = torch.zeros(rows * runner.max_pages, dtype=torch.int32, pin_memory=pin)
        self.page_table = torch.zeros(rows * runner.max_pages, dtype=torch.int32, device=device)
        # Graph inputs of a draft step, and of verification.
        self.step_meta = torch.zeros(6, rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.starts = torch.zeros(rows, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(rows * q, c.hidden_size, dtype=runner.dtype, device=device)
        self.verify_attention = prepare_verify_attention(
            kernel, batches=runner.buckets, queries=q, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, max_keys=runner.max_pages * runner.page_size, dtype=runner.dtype, device=device,
            min_splits=lambda b: min_splits_for(b, c.num_key_value_heads))
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.draw_generator = torch.Generator(device=device)
        # A measurement's set acceptance, (rate, numpy Generator): each draft token accepted with
        # that probability instead of by the model (benchmarks.engine.speculative_arms.set_acceptance).
        # None: lossless speculation.
        self.set_acceptance: tuple[float, np.random.Generator] | None = None
        self.counters = SpeculativeCounters()
        # Adaptive drafting: per request, drafts proposed and accepted, each round's added to the
        # earlier ones decayed by HISTORY_DECAY (recent rounds weigh most; counts of a request
        # that stopped drafting fade, so it tries again).
        self.history: dict[int, tuple[float, float]] = {}

    def stats(self) -> dict[str, int]:
        """The EngineStats fields of speculation."""
        c = self.counters
        return dict(spec_rounds=c.rounds, draft_tokens=c.drafted, accepted_tokens=c.accepted)

    def drafts_of(self, seq: Sequence) -> int:
        """Drafts of the sequence's next round (never more than it may still produce, less one):
        the keys a round writes past its last token. Adaptive: `SpeculativeConfig.draft_count`
        of the request's decayed counts."""
        k = self.num_draft
        if self.config.adaptive:
            k = self.config.draft_count(*self.history.get(seq.request_id, (0.0, 0.0)))
        return max(min(k, seq.max_length - len(seq.tokens) - 1), 0)

    def forget(self, seq: Sequence) -> None:
        self.history.pop(seq.request_id, None)

    @staticmethod
    def ready(seq: Sequence) -> bool:
        """A round starts from a token the host has read: a first token still in flight from
        prefill waits for the next step."""
        return seq.tokens[-1] != PENDING

    def check_request(self, seq: Sequence) -> None:
        if seq.forced is not None:
            raise ValueError("a forced continuation (teacher forcing) is scored, not speculated; "
                             "use an LLM without speculative_config")
        p = seq.params
        if p.processed or p.logprobs:
            raise ValueError("speculative decoding does not apply repetition/presence/frequency penalties, logit_bias, "
                             "min_tokens or top logprobs (SamplingParams.logprobs > 0); use an LLM without "
                             "speculative_config for these")

    # -- the model passes (graph bodies) -------------------------------------------------------------
    def _draft_forward(self, bucket: int, kind: str, width: int) -> torch.Tensor | None:
        """One draft step of `bucket` rows of `width` pages from step_meta: "full" (the draft's
        loops, `draft_end`, then the head), "sparse" (the same, every loop on the supports of
        the round's step 0: sparse discovery), "head" (the loops before the verify depth, then
        the head) or "partial" (those loops only) -> logits or None."""
        r, m, model = self.runner, self.step_meta[:, :bucket], self.model
        self.seq_lens[:bucket].copy_(m[self._SEQ_LEN])
        batch = DecodeBatch(positions=m[self._POSITION], seq_lens=self.seq_lens[:bucket],
                            page_table=table_view(self.page_table, bucket, width), slot_mapping=m[self._SLOT],
                            tags=m[self._TAG])
        verified = None
        if kind == "sparse":   # each row's step 0 fed its last verified token
            verified = (self.meta[0, self._TAG, :bucket], self.meta[0, self._POSITION, :bucket])
        ctx = DecodeContext(model.config, batch, r.cache, r.wise, r.attention[bucket], r.dense_modes[:bucket],
                            r.unused_support[:bucket], verified=verified)
        h = model.run_loops(model.model.embed_tokens(m[self._TOKEN]), ctx, range(self.depth))
        self.hidden.index_copy_(0, m[self._HIDDEN], h)
        if kind == "partial":
            return None
        if kind in ("full", "sparse"):
            h = model.run_loops(h, ctx, range(self.depth, self.draft_end))
        return model.logits(h)

    def _verify_forward(self, bucket: int, width: int) -> torch.Tensor:
        """Loops depth..D-1 densely for `bucket` rows of `width` pages x queries positions ->
        logits float32[bucket * queries, vocab]."""
        n = bucket * self.queries
        self.starts[:bucket].copy_(self.meta[0, self._POSITION, :bucket])
        batch = VerifyBatch(positions=self.verify_meta[0, :n], slot_mapping=self.verify_meta[1, :n],
                            page_table=table_view(self.page_table, bucket, width),
                            starts=self.starts[:bucket])
        ctx = VerifyContext(self.model.config.num_hidden_layers, batch, self.runner.cache,
                            self.verify_attention[bucket])
        return self.model.logits(self.model.run_loops(self.hidden[:n], ctx,
                                                      range(self.depth, self.model.config.num_loops)))

    def _run(self, key: tuple, fn):
        """fn() eagerly, or its CUDA graph (captured on first use, as the decode graphs are: its
        warm-up rewrites what the replay writes; a failed capture runs it eagerly from then on)."""
        return self.runner.run_step(self.graphs, key, fn)

    # -- one round ----------------------------------------------------------------------------------
    def _views(self, flat: torch.Tensor, rows: int):
        """The staging buffer as (draft steps' meta [queries, 6, rows], verification meta
        [2, rows * queries], draft counts [rows])."""
        q = self.queries
        meta, rest = flat[:q * 6 * rows], flat[q * 6 * rows:]
        return meta.view(q, 6, rows), rest[:2 * rows * q].view(2, rows * q), rest[2 * rows * q:]

    def _stage(self, seqs: list[Sequence], ks: list[int], bucket: int, width: int) -> None:
        """Every draft step's and the verification's metadata, one copy to the device."""
        r, q = self.runner, self.queries
        scratch_slot = r.cache.scratch_page * r.page_size
        meta, vmeta, drafts = (t.numpy() for t in self._views(self.host, self.meta.shape[2]))
        drafts[:len(ks)] = ks
        meta[:, :, :bucket] = np.array([0, 0, 1, scratch_slot, -1, 0])[None, :, None]
        meta[:, self._HIDDEN, :bucket] = np.arange(bucket)[None, :] * q + np.arange(q)[:, None]
        vmeta[0, :bucket * q], vmeta[1, :bucket * q] = 0, scratch_slot
        table = table_view(self.host_table, bucket, width).numpy()
        table[:] = r.cache.scratch_page
        for row, (seq, k) in enumerate(zip(seqs, ks)):
            table[row, :len(seq.pages)] = seq.pages
            first = len(seq.tokens) - 1
            meta[0, self._TOKEN, row] = seq.tokens[-1]
            for j in range(k + 1):
                pos = first + j
                slot = r.cache.slot(seq.pages, pos)
                meta[j, 1:5, row] = (pos, pos + 1, slot, r.tags.issue(1)[0])
                vmeta[:, row * q + j] = (pos, slot)
            vmeta[0, row * q + k + 1:(row + 1) * q] = first + k     # padding: a position the RoPE table holds
        self.staged.copy_(self.host, non_blocking=True)
        self.page_table[:bucket * width].copy_(self.host_table[:bucket * width], non_blocking=True)

    def decode(self, seqs: list[Sequence], produced: list[Sequence]) -> int:
        """One round for `seqs` (each `ready`): append each one's committed tokens (finishing
        it on a stop token or its budget), roll back the rest; add each to `produced`. Returns
        the tokens committed."""
        r = self.runner
        ks = [self.drafts_of(seq) for seq in seqs]
        order = sorted(range(len(seqs)), key=lambda i: -ks[i])   # stable: rows of step j are a prefix
        seqs, ks = [seqs[i] for i in order], [ks[i] for i in order]
        m, q = len(seqs), self.queries
        bucket, width = r.bucket(m), r.width(max(len(seq.pages) for seq in seqs))
        self._stage(seqs, ks, bucket, width)
        sampled = [i for i, seq in enumerate(seqs) if seq.params.temperature > 0]
        draft_probs = None
        if sampled:
            draft_probs = torch.zeros(len(sampled), self.num_draft, self.model.config.vocab_size,
                                      device=self.device)
        method_kind = "full" if self.config.method == "wise" else "head"
        for j in range(max(ks) + 1):
            active = sum(k >= j for k in ks)
            feeding = sum(k > j for k in ks)                 # rows whose step j drafts a token they verify
            b = r.bucket(active)
            kind = "partial" if not feeding else "sparse" if j and self.config.sparse_discovery else method_kind
            self.step_meta[:, :b].copy_(self.meta[j, :, :b])
            logits = self._run(("draft", b, kind, width), lambda b=b, kind=kind: self._draft_forward(b, kind, width))
            if feeding:
                self.meta[j + 1, self._TOKEN, :b] = logits.argmax(-1)
                if sampled:
                    self._sample_drafts(seqs, sampled, ks, j, logits, draft_probs)
        logits = self._run(("verify", bucket, width), lambda: self._verify_forward(bucket, width))
        logits = logits.view(bucket, q, -1)[:m]
        return self._accept(seqs, ks, sampled, logits, draft_probs, produced)

    # -- sampling -------------------------------------------------------------------------------------
    def _uniform(self, seq: Sequence, position: int, purpose: int, n: int) -> torch.Tensor:
        """n uniforms in [0, 1) for a request's `purpose` at `position` (its own seed, else the engine's generator)."""
        generator = self.runner.sampler.generator
        if seq.params.seed is not None:
            generator = self.draw_generator.manual_seed(draw_seed(seq.params.seed, position, purpose))
        return torch.rand(n, generator=generator, device=self.device)

    def _probs_inputs(self, seqs: list[Sequence], rows: list[int], repeat: int):
        temperature = torch.tensor([seqs[i].params.temperature for i in rows for _ in range(repeat)],
                                   dtype=torch.float32)
        filters = [seqs[i].params for i in rows for _ in range(repeat)]
        return temperature.to(self.device, non_blocking=True), filters

    def _index(self, xs: list[int]) -> torch.Tensor:
        index = torch.tensor(xs, dtype=torch.int64)
        return index.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else index

    def _sample_drafts(self, seqs, sampled, ks, j, logits, draft_probs) -> None:
        """Sample draft j + 1 of the sampled rows that verify it; keep its distribution q."""
        which = [s for s, i in enumerate(sampled) if ks[i] > j]
        if not which:
            return
        rows = [sampled[s] for s in which]
        temperature, filters = self._probs_inputs(seqs, rows, 1)
        index = self._index(rows)
        z = scaled_logits(logits[index], temperature, filters)
        u = torch.stack([self._uniform(seqs[i], len(seqs[i].tokens) + j, DRAFT, z.shape[1]) for i in rows])
        self.meta[j + 1, self._TOKEN, index] = (z - torch.log(-torch.log(u))).argmax(-1)
        draft_probs[self._index(which), j] = torch.softmax(z, -1)

    def _accept_sampled(self, seqs, sampled, logits, draft_probs, drafts, accepted, final) -> None:
        """Rejection sampling for the sampled rows: overwrite their accepted counts and final tokens."""
        s, q, k = len(sampled), self.queries, self.num_draft
        index = self._index(sampled)
        temperature, filters = self._probs_inputs(seqs, sampled, q)
        p = torch.softmax(scaled_logits(logits[index].flatten(0, 1), temperature, filters), -1).view(s, q, -1)
        d = drafts[index]                                                   # [s, k]
        p_d = p[:, :k].gather(2, d[..., None])[..., 0]
        q_d = draft_probs.gather(2, d[..., None])[..., 0]
        # Draft j + 1 and the token after j accepted drafts sit at position len(tokens) + j.
        u = torch.stack([self._uniform(seqs[i], len(seqs[i].tokens) + j, ACCEPT, 1)[0] for i in sampled
                         for j in range(k)]).view(s, k)
        valid = torch.arange(k, device=self.device)[None, :] < self.row_drafts[index][:, None]
        keep = (u * q_d < p_d) & valid                                      # u < p / q, q > 0 for a drawn token
        n_acc = keep.long().cumprod(1).sum(1)                               # [s]
        arange = torch.arange(s, device=self.device)
        p_a = p[arange, n_acc]
        rejected = (n_acc < valid.sum(1))[:, None]
        residual = torch.where(rejected, (p_a - draft_probs[arange, n_acc.clamp(max=k - 1)]).clamp(min=0), p_a)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)   # p == q up to rounding
        u = torch.stack([torch.stack([self._uniform(seqs[i], len(seqs[i].tokens) + j, RESIDUAL, residual.shape[1])
                                      for j in range(q)]) for i in sampled])
        u = u[arange, n_acc]
        accepted[index] = n_acc
        final[index] = (torch.log(residual) - torch.log(-torch.log(u))).argmax(-1)

    # -- acceptance and rollback ---------------------------------------------------------------------
    def _accept(self, seqs, ks, sampled, logits, draft_probs, produced) -> int:
        m, q, k = len(seqs), self.queries, self.num_draft
        target = logits.argmax(-1)                                          # [m, q]
        drafts = self.meta[1:, self._TOKEN, :m].t()                         # [m, k]
        j = torch.arange(q, device=self.device)
        valid = j[None, :k] < self.row_drafts[:m, None]
        if self.set_acceptance is None:
            accepted = ((drafts == target[:, :k]) & valid).long().cumprod(1).sum(1)
            final = target.gather(1, accepted[:, None])[:, 0]
            if sampled:
                self._accept_sampled(seqs, sampled, logits, draft_probs, drafts, accepted, final)
        else:   # a set acceptance: a seeded Bernoulli prefix per row, for timing
            rate, rng = self.set_acceptance
            keep = (rng.random((m, k)) < rate) & (np.arange(k)[None, :] < np.array(ks)[:, None])
            accepted = torch.from_numpy(keep.cumprod(1).sum(1)).to(self.device)
            final = target.gather(1, accepted[:, None])[:, 0]
        padded = torch.cat([drafts, drafts[:, :1]], 1)
        emitted = torch.where(j[None, :] < accepted[:, None], padded, final[:, None])
        nan = (torch.isnan(logits).any(-1) & (j[None, :] <= accepted[:, None])).any(-1)
        host = torch.cat([accepted[:, None], emitted, nan.long()[:, None]], 1).tolist()
        logprobs = ranks = None
        if any(seq.params.logprobs is not None for seq in seqs):
            logp = torch.log_softmax(logits, -1)
            chosen = logp.gather(2, emitted[..., None])
            logprobs, ranks = chosen[..., 0].tolist(), (logp >= chosen).sum(-1).tolist()
        committed = 0
        c = self.counters
        for i, (seq, row) in enumerate(zip(seqs, host)):
            if row[-1]:             # NaN logits: this request alone fails (`LLMEngine._read` removes it)
                seq.fail(f"the model's logits are NaN for request {seq.request_id}")
                produced.append(seq)
                continue
            n_acc = row[0]
            c.rounds += 1
            c.drafted += ks[i]
            c.accepted += n_acc
            if self.config.adaptive:
                drafted, accepted = self.history.get(seq.request_id, (0.0, 0.0))
                self.history[seq.request_id] = (HISTORY_DECAY * drafted + ks[i], HISTORY_DECAY * accepted + n_acc)
            for n, token in enumerate(row[1:n_acc + 2]):
                if seq.params.logprobs is not None:
                    seq.logprobs.append(logprobs[i][n])
                    seq.ranked.append({token: (logprobs[i][n], ranks[i][n])})
                if seq.keep_logits:
                    seq.logits.append(logits[i, n].cpu())
                seq.resolve(seq.expect(), token)
                committed += 1
                if seq.status is Status.FINISHED:
                    break
            seq.num_cached = len(seq.tokens) - 1
            self.blocks.trim(seq, seq.num_cached)
            produced.append(seq)
        return committed
