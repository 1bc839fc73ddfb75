"""Next-token choice on the device: logits processing (logit_bias, min_tokens, penalties), then
greedy, or sampling in log space with min-p, top-k and top-p; the logprobs reported. `StepSampler`
runs it for a step's sequences and hands back an `InFlight`."""

from __future__ import annotations

import numpy as np
import torch

from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence, logits_rows
from wise_torch.attention import select_blocks
from wise_torch.engine.inflight import InFlight, PromptScores

_GOLDEN = 0x9E3779B97F4A7C15


def seed_for(seed: int, position: int) -> int:
    """The generator seed of a seeded request's sample at `position` (independent of the batch)."""
    return (seed + (position + 1) * _GOLDEN) % (2 ** 63)


def sample(logits: torch.Tensor, temperatures: list[float], filters: list, generators: list[torch.Generator | None]
           ) -> torch.Tensor:
    """logits: float32[batch, vocab] -> int64[batch] on the logits' device. filters: per row
    anything with top_p, top_k and min_p (its SamplingParams).

    temperature 0 (or one that is 0 in float32, as in wise_jax): argmax (ties to the lower id).
    Otherwise Gumbel-max over (logits - max) / temperature: the scaled logits are <= 0, so no
    temperature overflows them (a tiny temperature is greedy, a huge one near-uniform),
    restricted by `scaled_logits`. Row i draws its noise from generators[i]. NaN logits stay NaN
    (argmax then points at one).
    """
    tokens = logits.argmax(-1)
    rows = [i for i, t in enumerate(temperatures) if np.float32(t) > 0]   # 0 in float32 (1e-50): greedy
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([temperatures[i] for i in rows], dtype=torch.float32, device=logits.device)
    z = scaled_logits(logits[index], temperature, [filters[i] for i in rows])
    u = torch.stack([torch.rand(z.shape[1], generator=generators[i], device=logits.device) for i in rows])
    tokens[index] = (z - torch.log(-torch.log(u))).argmax(-1)
    return tokens


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor, filters: list) -> torch.Tensor:
    """logits float32[rows, vocab], temperature float32[rows] (> 0), filters (top_p, top_k, min_p
    per row) -> (logits - max) / temperature, -inf outside each row's kept tokens: those of
    probability >= min_p x the largest, then the top_k most probable (ties to the lower id), then
    the top_p prefix of what is left (`SamplingParams`). The distribution `sample` draws from is
    their softmax."""
    z = (logits - logits.max(-1, keepdim=True).values) / temperature[:, None]
    for j, f in enumerate(filters):
        if f.min_p > 0:
            p = torch.softmax(z[j], -1)
            z[j] = torch.where(p >= f.min_p * p.max(), z[j], float("-inf"))
        if 0 < f.top_k < z.shape[1]:
            order = torch.sort(z[j], descending=True, stable=True).indices
            kept = torch.zeros_like(z[j], dtype=torch.bool).scatter_(0, order[:f.top_k], True)
            z[j] = torch.where(kept, z[j], float("-inf"))
        if f.top_p < 1.0:
            kept = select_blocks(torch.softmax(z[j], -1), f.top_p)
            z[j] = torch.where(kept, z[j], float("-inf"))
    return z


def process_logits(logits: torch.Tensor, prompt: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor,
                   stops: torch.Tensor, min_active: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
                   frequency: torch.Tensor) -> torch.Tensor:
    """The logits processing of `SamplingParams`, before temperature, in vLLM's order: logits
    float32[rows, vocab]; per row the request's logits state (prompt bool[rows, vocab]: in its
    prompt; counts int32[rows, vocab]: in its output; bias float32[rows, vocab]: logit_bias;
    stops bool[rows, vocab]: its stop ids), min_active bool[rows] (fewer than min_tokens made)
    and its penalties float32[rows] -> processed logits: bias added and the stop ids -inf where
    min_active; then the repetition penalty over the prompt's and the output's tokens (positive
    logits divided, negative multiplied), then frequency x count + presence x (count > 0)
    subtracted."""
    z = torch.where(min_active[:, None] & stops, float("-inf"), logits + bias)
    seen = prompt | (counts > 0)
    r = repetition[:, None]
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    return z - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def ranked(logits: torch.Tensor, tokens: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits float32[rows, vocab], tokens int64[rows] -> (log p of the tokens float32[rows];
    rank int64[rows]: the tokens at least as probable as the row's, itself included (1: the most
    probable); top ids int64[rows, k] and their log p float32[rows, k], most probable first, ties
    to the lower id), under log_softmax(logits)."""
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(1, tokens[:, None])
    rank = (logp >= chosen).sum(-1)
    if k == 0:
        return chosen[:, 0], rank, tokens[:, None][:, :0], logp[:, :0]
    top = torch.sort(logp, dim=-1, descending=True, stable=True)
    return chosen[:, 0], rank, top.indices[:, :k], top.values[:, :k]


class LogitsState:
    """Per sequence slot, on the device, what `process_logits` needs of a processed request
    (`SamplingParams.processed`): prompt bool, counts int32, bias float32 and stops bool
    [slots, vocab] (`logits_rows`). A slot's rows are written from the host when a processed
    request first samples in it (its first token, or after a preemption moved it), then its
    counts grow on the device with each token sampled (`count`), so a token still in flight is
    counted before the host reads it."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device):
        self.prompt = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(slots, vocab_size, dtype=torch.int32, device=device)
        self.bias = torch.zeros(slots, vocab_size, dtype=torch.float32, device=device)
        self.stops = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)
        self.owner: dict[int, Sequence] = {}     # slot -> the sequence its rows are of

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`process_logits` of `seqs` (processed requests, their rows of float32 `logits`)."""
        device = logits.device
        for seq in seqs:
            if self.owner.get(seq.slot) is not seq:
                for buffer, row in zip((self.prompt, self.counts, self.bias, self.stops),
                                       logits_rows(seq, logits.shape[1])):
                    buffer[seq.slot].copy_(torch.from_numpy(row))
                self.owner[seq.slot] = seq
        slots = torch.tensor([s.slot for s in seqs], device=device)
        min_active = torch.tensor([s.num_generated < s.params.min_tokens for s in seqs], device=device)
        penalties = torch.tensor([(s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty)
                                  for s in seqs], dtype=torch.float32, device=device)
        return process_logits(logits, self.prompt[slots], self.counts[slots], self.bias[slots], self.stops[slots],
                              min_active, *penalties.t())

    def count(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens int64[len(seqs)] just sampled for processed `seqs` join their counts."""
        slots = torch.tensor([s.slot for s in seqs], device=tokens.device)
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


class StepSampler:
    """A step's sampling for the engine, eagerly after the step's logits (outside any CUDA
    graph), on `device`: per sequence slot, the last token sampled (`next_token`
    int64[max_num_seqs]: a decode row whose token is still in flight reads it there, so a step
    never waits for the host to see tokens) and the logits state of processed requests
    (`logits_state`, made when a processed request first samples); the engine's generator
    (`generator`, seeded by `seed`) for requests without a seed of their own."""

    def __init__(self, max_num_seqs: int, device: torch.device, seed: int):
        self.device = device
        self.next_token = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.logits_state: LogitsState | None = None

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], prompt: PromptScores | None = None) -> InFlight:
        """Sample each sequence's next token from its row of logits float32[len(seqs), vocab]
        (its forced token when teacher-forced), note it in the sequence slots' `next_token` and
        hold its place in the sequence; log p of it (under the raw logits) and the logits where
        asked. Nothing waits for the host. prompt: the step's prompt scores, copied out with the
        tokens.

        The rows of processed requests (`SamplingParams.processed`) go through
        `LogitsState.process` first; when no row is, the logits go to `sample` untouched and no
        logits state is read or made."""
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

    def score_prompt(self, logits: torch.Tensor, chunks: list[Chunk]) -> PromptScores:
        """The scores of `chunks`' scored positions (logits float32[positions, vocab], chunk by
        chunk): `ranked` of each position's next prompt token with the chunks' largest
        prompt_logprobs k."""
        rows = [(c.seq, c.start + 1, c.scored) for c in chunks]
        tokens = torch.tensor([t for c in chunks for t in c.seq.prompt[c.start + 1:c.start + 1 + c.scored]],
                              dtype=torch.int64).to(self.device, non_blocking=True)
        k = min(max(c.seq.params.prompt_logprobs for c in chunks), logits.shape[1])
        return PromptScores(rows, ranked(logits, tokens, k))
