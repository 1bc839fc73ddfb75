"""The host side of both serving engines: requests, scheduling, the step loop, outputs, stats.

    class LLM(LLMEngine):             # wise_torch.LLM, wise_jax.LLM
        def __init__(...): ...; self._start(args, ...)
        def _launch_decode(self, seqs): ...      # the device side, below

`LLMEngine` holds the pool's bookkeeping (`BlockManager`), the `Scheduler`, the sequences and
the counters, and runs the step: schedule, offload the preempted and restore the resumed,
launch the decode rows and the prompt chunks (each sampled on the device), then read the
tokens of the step before, which the device ran while this one was scheduled. A framework
supplies only its device side, the methods marked "device side" below: run a decode step or
prefill chunks and sample (returning an `InFlight`), copy a preempted sequence's K/V out and
back, and its program and WISE counters.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from wise_core.detokenize import TextStream
from wise_core.engine.args import EngineArgs
from wise_core.engine.block_manager import BlockManager
from wise_core.engine.scheduler import Chunk, Scheduler
from wise_core.engine.sequence import Sequence, Status, output_of, ranked_entry
from wise_core.engine.single_thread import SingleThread, one_thread
from wise_core.outputs import RequestOutput
from wise_core.sampling_params import SamplingParams, add_all, prompts_with_params
from wise_core.stats import EngineStats
from wise_core.tokenizer import check_token_ids, encode_text

COUNTERS = ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "decode_steps", "decode_tokens")


class InFlight(Protocol):
    """What a launched step sampled, on its way to the host: rows [(sequence, token index)],
    logits {row: float32[vocab]} of the rows that keep them, and `read` (waits for the step) ->
    (tokens, NaN flag per row, log p per row or None, ranked or None: per row (the token's rank,
    the ids and log p of the most probable tokens, at least as many as any row's
    SamplingParams.logprobs), when a row asks for logprobs). prompt_rows: the prompt chunks the
    step scored [(sequence, first prompt token scored, count)] (`Chunk.scored`), and
    `read_prompt` -> per position scored, in that order, (log p of the prompt token, its rank,
    the ids and log p of the most probable tokens, at least SamplingParams.prompt_logprobs)."""

    rows: list
    logits: dict
    prompt_rows: list

    def read(self) -> tuple[list[int], list[bool], list[float] | None, list[tuple] | None]: ...

    def read_prompt(self) -> list[tuple]: ...


class LLMEngine:
    """Continuous batching over a paged KV cache (module docstring); see `EngineArgs` for the
    arguments every engine takes. One thread at a time: a second thread entering a public
    method while another is inside is a RuntimeError (`wise_core.engine.single_thread`). A
    request the engine finds broken (NaN logits) ends alone with finish_reason "error"."""

    ARRAY_TYPES: tuple[type, ...] = ()   # the framework's array types (refused as a list of prompts)

    def _start(self, args: EngineArgs, *, num_pages: int, pool_sizing: str, max_model_len: int, tokenizer,
               vocab_size: int, eos_token_id: int | None) -> None:
        """The host side over a pool of `num_pages` pages (args checked; pool_sizing says how
        the pool was sized)."""
        self.args, self.tokenizer, self.vocab_size, self.pool_sizing = args, tokenizer, vocab_size, pool_sizing
        self.eos_token_ids = frozenset(() if eos_token_id is None else (eos_token_id,))
        self.page_size, self.max_model_len = args.page_size, max_model_len
        self.blocks = BlockManager(num_pages, args.page_size, prefix_caching=args.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens)
        self.sequences: dict[int, Sequence] = {}    # every unfinished sequence, a completion's too
        self.groups: dict[int, list[Sequence]] = {}  # an unfinished n > 1 request's completions
        self.inflight: list[InFlight] = []      # the step launched last, not read yet
        self.inflight_kind = self.previous_kind = None
        self.next_id = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._single_thread = SingleThread(type(self).__module__.split(".")[0] + ".LLM")

    # -- requests ---------------------------------------------------------------------------
    @one_thread
    def add_request(self, prompt, params: SamplingParams | None = None, *, forced: list[int] | None = None,
                    keep_logits: bool = False) -> int:
        """Queue a request (a string, or token ids) -> its request id. A request that can never
        fit (longer than max_model_len or the whole pool) is a ValueError here. params.n > 1 queues
        n completions (sequences of their own) under the one id.
        forced: tokens fed instead of sampled ones, each scored (teacher forcing); keep_logits:
        keep each step's float32 logits."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._checked_ids(prompt, "prompt")
        if forced is not None:
            forced = self._checked_ids(forced, "forced continuation")
            if params.n > 1:
                raise ValueError(f"a forced continuation is scored once: SamplingParams.n must be 1, got {params.n}")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias names token ids {bad[:5]} outside the vocabulary "
                             f"(size {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids names token ids {bad[:5]} outside the vocabulary "
                             f"(size {self.vocab_size}): they could never stop the request")
        seqs = [Sequence(self.next_id + i, ids, params.completion(i) if params.n > 1 else params,
                         self.eos_token_ids, arrival=self.next_id + i, forced=forced, keep_logits=keep_logits)
                for i in range(params.n)]
        for seq in seqs:
            if params.stop:
                if self.tokenizer is None:
                    raise ValueError("SamplingParams.stop needs a tokenizer, and this engine has none")
                seq.text = TextStream(self.tokenizer, params.stop, min_tokens=params.min_tokens,
                                      include_stop=params.include_stop_str_in_output)
            self._check_request(seq)
        first = seqs[0]
        if first.max_length > self.max_model_len:
            raise ValueError(f"the request needs {len(ids)} prompt + {first.max_length - len(ids)} new tokens, more "
                             f"than max_model_len ({self.max_model_len})")
        # The last token generated is never fed back, so max_length - 1 keys are the most held.
        if self.blocks.pages_for(first.max_length - 1) > self.blocks.num_pages:
            raise ValueError(f"the request needs {self.blocks.pages_for(first.max_length - 1)} pages of "
                             f"{self.page_size} tokens, more than the pool's {self.blocks.num_pages}")
        if params.n > 1:
            self.groups[first.request_id] = seqs
            for seq in seqs:
                seq.group = first.request_id
            for seq in seqs[1:]:
                seq.parent = first
        for seq in seqs:
            self._new_sequence(seq)
            self.sequences[seq.request_id] = seq
            self.scheduler.add(seq)
        self.next_id += params.n
        return first.request_id

    def _checked_ids(self, prompt, what: str) -> list[int]:
        """A string (through the tokenizer) or token ids -> a non-empty list of ids in the
        vocabulary (`check_token_ids`), else an error naming the problem."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"the {what} is a string but the engine has no tokenizer; pass token ids")
            prompt = encode_text(self.tokenizer, prompt, what)
        return check_token_ids(prompt, self.vocab_size, f"the {what}")

    def _request(self, request_id: int) -> list[Sequence]:
        """The sequences of an unfinished request (its completions, for n > 1); KeyError if none."""
        if request_id in self.groups:
            return self.groups[request_id]
        seq = self.sequences.get(request_id)
        if seq is None or seq.group is not None:
            raise KeyError(f"no unfinished request {request_id}")
        return [seq]

    def _output(self, seqs: list[Sequence]) -> RequestOutput:
        """The output so far of a request's sequences (its completions, for n > 1); a finished
        n > 1 request leaves `groups`."""
        if len(seqs) == 1:
            return output_of(seqs[0], self.tokenizer)
        outs = [output_of(seq, self.tokenizer) for seq in seqs]
        finished = all(out.finished for out in outs)
        if finished:
            del self.groups[seqs[0].request_id]
        return dataclasses.replace(outs[0], finished=finished, completions=outs)

    @one_thread
    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now (every completion) and free its pages; its output so far,
        finish_reason "abort"."""
        seqs = self._request(request_id)
        for seq in seqs:
            if self.sequences.pop(seq.request_id, None) is not None:
                self._remove(seq)
                seq.finish("abort")
        return self._output(seqs)

    def _remove(self, seq: Sequence) -> None:
        self._forget(seq)
        self.scheduler.remove(seq)

    def output(self, request_id: int) -> RequestOutput:
        """An unfinished request's output so far (a finished one's final output came from `step`)."""
        return self._output(self._request(request_id))

    def prompt_token_ids(self, request_id: int) -> list[int]:
        """An unfinished request's prompt ids (the engine's list: read it, do not change it)."""
        return self._request(request_id)[0].prompt

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.inflight)

    # -- one step ---------------------------------------------------------------------------
    @one_thread
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step (decode every running request one token, prefill chunks
        of waiting ones), then read the tokens of the step before it, which the device ran while
        this one was scheduled: returns the requests that produced a token or finished there
        (a request whose logits were NaN finishes there alone, finish_reason "error", its pages
        scrubbed and freed).
        The host thus trails the device by one step: a request that stops on a stop token or
        string has run one more step, whose token is dropped."""
        start, built = time.perf_counter(), self._build_seconds()
        plan = self.scheduler.schedule()
        for seq, pages in plan.preempted:
            self._offload(seq, pages)
        for seq in plan.resumed:
            if seq.offloaded is not None:
                self._restore(seq)
        launched: list[InFlight] = []
        speculated: list[Sequence] = []     # the sequences of a speculative round, their tokens read already
        speculative_tokens = None
        if plan.decode:
            speculative_tokens = self._speculate(plan.decode, speculated)
            if speculative_tokens is None:
                launched.append(self._launch_decode(plan.decode))
                for seq in plan.decode:
                    seq.num_cached = len(seq.tokens) - 1
            else:
                self.counters["generated_tokens"] += speculative_tokens
        if plan.chunks:
            launched.append(self._launch_prefill(plan.chunks))
            for chunk in plan.chunks:
                chunk.seq.num_cached = chunk.start + chunk.length
                self.blocks.register(chunk.seq)     # its full prompt pages, for later requests
            self.counters["prompt_tokens"] += sum(c.length for c in plan.chunks)
        if (not launched and speculative_tokens is None and not self.inflight and self.scheduler.has_work()
                and not plan.preempted):
            raise RuntimeError("the scheduler made no progress although requests wait "
                               f"({self.blocks.num_free} of {self.blocks.num_pages} pages free)")
        previous, self.inflight = self.inflight, launched
        self.inflight_kind = ("prefill" if plan.chunks else "decode") if launched else None
        outputs = self._read(previous, speculated)
        # A step's host time is spent waiting for the device to finish the step before it (or
        # on this step's speculative round, which it reads).
        kind = "decode" if speculative_tokens is not None else self.previous_kind if previous else self.inflight_kind
        elapsed = time.perf_counter() - start - (self._build_seconds() - built)    # step programs built: apart
        if kind == "decode":
            self.counters["decode_s"] += elapsed
            self.counters["decode_steps"] += 1
            self.counters["decode_tokens"] += speculative_tokens if speculative_tokens is not None else sum(
                len(f.rows) for f in previous or launched)
        elif kind == "prefill":
            self.counters["prefill_s"] += elapsed
        self.previous_kind = self.inflight_kind
        return outputs

    def _read(self, records: list[InFlight], speculated: list[Sequence]) -> list[RequestOutput]:
        """Read a finished step's tokens into their sequences; finished ones leave. `speculated`:
        sequences that produced tokens already (a speculative round reads its own)."""
        produced: dict[int, Sequence] = {seq.request_id: seq for seq in speculated}
        for record in records:
            self._read_prompt(record)
            tokens, nan, logprobs, ranked = record.read()
            for i, (seq, index) in enumerate(record.rows):
                if seq.status is Status.FINISHED:          # stopped or aborted meanwhile: the row ran for nothing
                    continue
                if nan[i]:              # this request alone fails; the other rows keep their tokens
                    seq.fail(f"the model's logits are NaN for request {seq.request_id}")
                    produced[seq.request_id] = seq
                    continue
                if logprobs is not None and (seq.params.logprobs is not None or seq.forced is not None):
                    seq.logprobs.append(logprobs[i])
                if seq.params.logprobs is not None:
                    seq.ranked.append(ranked_entry(seq.params.logprobs, tokens[i], logprobs[i], *ranked[i]))
                if i in record.logits:
                    seq.logits.append(record.logits[i])
                seq.resolve(index, tokens[i])
                produced[seq.request_id] = seq
                self.counters["generated_tokens"] += 1
        requests = []
        for seq in produced.values():
            if seq.status is Status.FINISHED:
                if seq.finish_reason == "error":
                    self._scrub(self.blocks.uncached_sole_pages(seq))
                self._remove(seq)
                del self.sequences[seq.request_id]
            if seq.group is None:
                requests.append(seq)
            elif seq.group not in requests:
                requests.append(seq.group)
        return [self._output([r] if isinstance(r, Sequence) else self.groups[r]) for r in requests]

    @staticmethod
    def _read_prompt(record: InFlight) -> None:
        """A finished step's prompt scores into their sequences' prompt_ranked (NaN logits give
        NaN log p, reported as they are)."""
        if not record.prompt_rows:
            return
        scores = iter(record.read_prompt())
        for seq, first, count in record.prompt_rows:
            rows = [next(scores) for _ in range(count)]
            if seq.status is Status.FINISHED:                # aborted meanwhile
                continue
            if len(seq.prompt_ranked) != first - 1:
                raise RuntimeError(f"request {seq.request_id}'s prompt scores arrive out of order (position {first} "
                                   f"after {len(seq.prompt_ranked)})")
            k = seq.params.prompt_logprobs
            seq.prompt_ranked.extend(ranked_entry(k, token, *row)
                                     for token, row in zip(seq.prompt[first:first + count], rows))

    # -- batch use --------------------------------------------------------------------------
    @one_thread
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion -> RequestOutput per prompt, in
        prompt order. params: one SamplingParams for all, or one per prompt."""
        ids = add_all(self, prompts_with_params(prompts, params, self.ARRAY_TYPES))
        return self.run_until_done(ids, use_tqdm=use_tqdm)

    @one_thread
    def run_until_done(self, request_ids: list[int], *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until the given (unfinished) requests finish -> their final outputs, in the order
        given. KeyError for an id that is not an unfinished request (it would never finish)."""
        for r in request_ids:
            self._request(r)            # KeyError for an id that is not an unfinished request
        wanted = set(request_ids)
        final: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(wanted), desc="requests", unit="req", dynamic_ncols=True,
                       disable=None)   # None: no bar without a terminal
        while len(final) < len(wanted):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in request_ids]

    # -- stats ------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The engine's tokenizer (None without one), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    @one_thread
    def stats(self) -> EngineStats:
        """Pool, queue and counters (reads the device's counters)."""
        return EngineStats(
            total_pages=self.blocks.num_pages, free_pages=self.blocks.num_free,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.preemptions, pool_sizing=self.pool_sizing,
            prefix_cache_queries=self.blocks.query_tokens, prefix_cache_hits=self.blocks.hit_tokens,
            forked_prompt_tokens=self.blocks.forked_tokens, **self.counters,
            **self._device_stats())

    @one_thread
    def reset_stats(self) -> None:
        """Zero the timing and token counters and the WISE counters."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._reset_device_counters()

    # -- hooks of the framework (defaults: nothing to do) ----------------------------------
    def _check_request(self, seq: Sequence) -> None:
        """Refuse a request this engine cannot run (a ValueError naming why)."""

    def _new_sequence(self, seq: Sequence) -> None:
        """A request is accepted: set up its framework state (its random key, ...)."""

    def _speculate(self, seqs: list[Sequence], speculated: list[Sequence]) -> int | None:
        """A speculative round over the decode rows, read at once (their sequences added to
        `speculated`) -> the tokens it made; None: no speculation, the rows decode one token."""
        return None

    # -- the device side --------------------------------------------------------------------
    def _launch_decode(self, seqs: list[Sequence]) -> InFlight:
        """Launch one decode step of each sequence's last token (every loop) and sample its next
        token on the device; nothing waits for the host."""
        raise NotImplementedError

    def _launch_prefill(self, chunks: list[Chunk]) -> InFlight:
        """Launch the prompt chunks and sample the first token of those completing their prompt."""
        raise NotImplementedError

    def _offload(self, seq: Sequence, pages: list[int]) -> None:
        """Copy the K/V of seq's cached tokens (every plane) out of `pages`, the pages it held,
        into host memory (seq.offloaded; None when nothing is cached), before any later write."""
        raise NotImplementedError

    def _restore(self, seq: Sequence) -> None:
        """Copy seq.offloaded back into its (new) pages; seq.offloaded becomes None."""
        raise NotImplementedError

    def _forget(self, seq: Sequence) -> None:
        """A sequence leaves the engine: drop any device-side state held for it."""

    def _scrub(self, pages: list[int]) -> None:
        """A failed request's pages (`Sequence.fail`) go back to the pool: overwrite their K/V
        (every plane) with zeros after the steps already launched. The project's attentions read
        no value past a row's keys (docs/DESIGN.md, "No request can harm another"); this guards
        an attention that might (FlashAttention-4's) against the NaN the request left. Default:
        nothing."""

    def _device_stats(self) -> dict:
        """The EngineStats fields of the device side: fallbacks, density and the step programs'."""
        raise NotImplementedError

    def _build_seconds(self) -> float:
        """Seconds spent so far making step programs (capture, or trace and compile): a step does
        not count them as prefill or decode time (EngineStats.step_build_s reports them). Default:
        0.0, for a device side that does not measure them."""
        return 0.0

    def _reset_device_counters(self) -> None:
        """Zero the WISE counters."""
        raise NotImplementedError
