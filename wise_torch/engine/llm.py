"""`LLM`: the serving engine's front door (continuous batching over the paged cache).

    llm = wise_torch.LLM("ouro-py-3m", wise_config=WiseConfig())
    outs = llm.generate(["def fib(n):"], wise_torch.SamplingParams(max_tokens=32))

or step by step: `add_request`, `step` (the requests that produced a token or finished),
`has_unfinished`, `abort`, and `stats`. With `tensor_parallel_size=N` the model's heads are split
over N devices, one process each (`wise_torch.engine.distributed`); `close` (or a `with` block)
stops those processes.
"""

from __future__ import annotations

import numbers
import random
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from wise_core.config import SpeculativeConfig, WiseConfig
from wise_core.detokenize import TextStream
from wise_core.generate_args import check_seed
from wise_core.request import EngineStats, add_all, prompts_with_params
from wise_core.tokenizer import encode_text
from wise_torch.engine import distributed
from wise_torch.engine.block_manager import BlockManager
from wise_torch.engine.model_runner import InFlight, ModelRunner
from wise_torch.engine.scheduler import Scheduler, Step
from wise_torch.engine.sequence import RequestOutput, SamplingParams, Sequence, Status
from wise_torch.engine.speculative import Speculator
from wise_torch.kv_cache import PagedKVCache
from wise_torch.loading import load_model
from wise_torch.model import OuroForCausalLM

CPU_KV_BYTES = 1 << 30          # default pool on CPU: 1 GiB of K/V
GPU_MEMORY_FRACTION = 0.9       # default pool on CUDA: this share of free memory ...
GPU_RESERVE_BYTES = 6 << 30     # ... less this much for activations, graphs and workspaces


class LLM:
    """Continuous-batching engine over one model.

    model: an OuroForCausalLM, a checkpoint directory or a built-in name (loaded in `dtype`,
    default bfloat16 on CUDA and float32 on CPU, on `device`, default CUDA when available).
    wise_config: decode with WISE (None: dense). num_pages: pages in the pool (None: sized from
    free device memory on CUDA, CPU_KV_BYTES of K/V on CPU); page_size: tokens per page, a
    multiple of the WISE block size. max_num_seqs: requests decoding at once. max_model_len:
    prompt + output tokens a request may hold (default: the model's max_position_embeddings, at
    most the pool); sizes page tables and WISE block tables. max_num_batched_tokens: prompt
    tokens a step prefills (chunked prefill). cuda_graphs: True, False or "auto" (on CUDA).
    kernel: the decode attention ("auto", "reference", "triton"; default: wise_config.kernel).
    seed: the generator of requests without their own seed.
    speculative_config: lossless speculative decoding (`SpeculativeConfig`; method "wise" drafts
    with wise_config, default WiseConfig()): the output is dense decode's, the stats count
    acceptance. Forced continuations are not speculated.
    tensor_parallel_size: split the attention and KV heads and the MLP over this many devices
    (CUDA devices from the model's onward, NCCL; or CPU processes, gloo): the process that makes
    the LLM is rank 0 and spawns the others, each holding its heads' K/V pages and WISE supports
    and num_pages pages of them (`wise_torch.parallel`, `wise_torch.engine.distributed`). `model`
    is then rank 0's shard (its config holds the local heads); a model passed in stays whole.
    Not with speculative_config. The tokens are the single device's up to rounding: each
    all-reduce adds partial sums rounded to the model's dtype.
    """

    def __init__(self, model: OuroForCausalLM | str | Path, *, wise_config: WiseConfig | None = None,
                 num_pages: int | None = None, page_size: int = 128, max_num_seqs: int = 256,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                 cuda_graphs: bool | str = "auto", kernel: str | None = None, seed: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 speculative_config: SpeculativeConfig | None = None, tensor_parallel_size: int = 1):
        _positive_int("tensor_parallel_size", tensor_parallel_size)
        seed = check_seed(seed)
        if tensor_parallel_size > 1 and speculative_config is not None:
            raise ValueError("speculative decoding does not run with tensor_parallel_size > 1")
        if isinstance(model, (str, Path)):
            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            model = load_model(model, dtype=dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
                               device=device)
        elif not isinstance(model, OuroForCausalLM):
            raise TypeError(f"model must be an OuroForCausalLM, a checkpoint directory or a built-in name, "
                            f"got {type(model).__name__}")
        elif dtype is not None or device is not None:
            raise ValueError("dtype and device apply to a model loaded by name; this model is already built")
        if wise_config is not None and not isinstance(wise_config, WiseConfig):
            raise TypeError(f"wise_config must be a WiseConfig or None, got {type(wise_config).__name__}")
        if speculative_config is not None:
            if not isinstance(speculative_config, SpeculativeConfig):
                raise TypeError(f"speculative_config must be a SpeculativeConfig or None, "
                                f"got {type(speculative_config).__name__}")
            if speculative_config.method == "wise" and wise_config is None:
                wise_config = WiseConfig()
            speculative_config.verify_depth(model.config.num_loops, wise_config)
        config = model.config
        if wise_config is not None:
            wise_config.validate_for(config.num_loops)
        block_size = (wise_config or WiseConfig()).block_size
        _positive_int("page_size", page_size)
        if page_size % block_size:
            raise ValueError(f"page_size must be a multiple of the block_size {block_size}, got {page_size}")
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        weight = model.head_weight
        self.device = weight.device
        if cuda_graphs is True and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.tensor_parallel_size, self.workers = tensor_parallel_size, None
        if tensor_parallel_size > 1:
            self.workers, model = distributed.start(model, tensor_parallel_size)
            self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            self._build(model, wise_config=wise_config, num_pages=num_pages, page_size=page_size,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs, kernel=kernel,
                        seed=seed, speculative_config=speculative_config)
        except BaseException:
            self.close()
            raise

    def _build(self, model: OuroForCausalLM, *, wise_config, num_pages, page_size, max_num_seqs, max_model_len,
               max_num_batched_tokens, cuda_graphs, kernel, seed, speculative_config) -> None:
        """The pool, scheduler and runner over `model` (under tensor parallelism rank 0's shard,
        the workers following); the arguments are __init__'s, checked."""
        config, weight = model.config, model.head_weight
        if self.workers is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()     # a whole model loaded by name is gone: its memory is free
        page_bytes = PagedKVCache.page_bytes(config, page_size, weight.dtype)
        self.pool_sizing = f"num_pages={num_pages} as given"
        if num_pages is None:
            num_pages = self._default_pages(page_bytes)
        _positive_int("num_pages", num_pages)
        limit = config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, num_pages * page_size)
        _positive_int("max_model_len", max_model_len)
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings ({limit})")
        kernel = kernel if kernel is not None else (wise_config.kernel if wise_config is not None else "auto")
        self.model, self.wise_config, self.tokenizer = model, wise_config, model.tokenizer
        self.page_size, self.max_model_len = page_size, max_model_len
        self.blocks = BlockManager(num_pages, page_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        settings = dict(wise_config=wise_config, num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, use_graphs=cuda_graphs is True or (
                            cuda_graphs == "auto" and self.device.type == "cuda"),
                        kernel=kernel, seed=random.randrange(2 ** 63) if seed is None else seed)
        if self.workers is not None:
            self.workers.send("settings", settings)
        self.runner = ModelRunner(model, **settings, workers=self.workers)
        if self.workers is not None:
            self.workers.wait_ready()
        self.speculator = None
        if speculative_config is not None:
            self.speculator = Speculator(self.runner, self.blocks, speculative_config, kernel=kernel)
            self.scheduler.lookahead = self.speculator.drafts_of
            self.scheduler.ready = self.speculator.ready
        self.sequences: dict[int, Sequence] = {}
        self.inflight: list[InFlight] = []      # the step launched last, not read yet
        self.inflight_kind = self.previous_kind = None
        self.next_id = 0
        self.counters = dict(prompt_tokens=0, generated_tokens=0, prefill_s=0.0, decode_s=0.0, decode_steps=0,
                             decode_tokens=0)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); the engine cannot step
        afterwards. Also run when the LLM is garbage-collected or the program exits."""
        if self.workers is not None:
            self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _default_pages(self, page_bytes: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            pages = int((free * GPU_MEMORY_FRACTION - GPU_RESERVE_BYTES) // page_bytes)
            if pages < 1:
                raise ValueError(f"too little free device memory for one KV page ({page_bytes} bytes); "
                                 f"pass num_pages")
            self.pool_sizing = (f"{GPU_MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB free less "
                                f"{GPU_RESERVE_BYTES / 2**30:.0f} GiB: {pages} pages of {page_bytes} bytes")
            return pages
        pages = max(1, CPU_KV_BYTES // page_bytes)
        self.pool_sizing = f"{CPU_KV_BYTES / 2**30:.0f} GiB of K/V on a CPU: {pages} pages of {page_bytes} bytes"
        return pages

    # -- requests ---------------------------------------------------------------------------
    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model has no tokenizer; pass token ids")
            return encode_text(self.tokenizer, prompt)
        if isinstance(prompt, (np.ndarray, torch.Tensor)):
            if prompt.ndim != 1:
                raise ValueError(f"a prompt of token ids must be 1-D, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt must be a string or a sequence of integer token ids, got {prompt!r:.80}")
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams | None = None, *, forced: list[int] | None = None,
                    keep_logits: bool = False) -> int:
        """Queue a request (a string, or token ids) -> its request id. A request that can never
        fit (longer than max_model_len or the whole pool) is a ValueError here.
        forced: tokens fed instead of sampled ones, each scored (teacher forcing)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        for name, seq in (("prompt", ids), ("forced continuation", forced or [])):
            bad = [t for t in seq if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"the {name} holds ids {bad[:5]} outside the vocabulary (size {vocab})")
        eos = self.model.config.eos_token_id
        seq = Sequence(self.next_id, ids, params, frozenset(() if eos is None else (eos,)), arrival=self.next_id,
                       forced=None if forced is None else list(forced), keep_logits=keep_logits)
        if forced is not None and not forced:
            raise ValueError("the forced continuation is empty")
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer, and this engine has none")
            seq.text = TextStream(self.tokenizer, params.stop)
        if self.speculator is not None:
            self.speculator.check_request(seq)
        if seq.max_length > self.max_model_len:
            raise ValueError(f"the request needs {len(ids)} prompt + {seq.max_length - len(ids)} new tokens, more "
                             f"than max_model_len ({self.max_model_len})")
        # The last token generated is never fed back, so max_length - 1 keys are the most held.
        if self.blocks.pages_for(seq.max_length - 1) > self.blocks.num_pages:
            raise ValueError(f"the request needs {self.blocks.pages_for(seq.max_length - 1)} pages of "
                             f"{self.page_size} tokens, more than the pool's {self.blocks.num_pages}")
        self.next_id += 1
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request now and free its pages; its output so far, finish_reason "abort"."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            raise KeyError(f"no unfinished request {request_id}")
        self._remove(seq)
        seq.finish("abort")
        return RequestOutput.of(seq, self.tokenizer)

    def _remove(self, seq: Sequence) -> None:
        self.runner.forget(seq)
        self.scheduler.remove(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.inflight)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step (decode every running request one token, prefill chunks
        of waiting ones), then read the tokens of the step before it, which the device ran while
        this one was scheduled: returns the requests that produced a token or finished there.
        The host thus trails the device by one step: a request that stops on a stop token has
        run one more step, whose token is dropped."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        runner = self.runner
        for seq, pages in plan.preempted:
            runner.offload(seq, pages)
        for seq in plan.resumed:
            if seq.offloaded is not None:
                runner.restore(seq)
        launched: list[InFlight] = []
        spoken: list[Sequence] = []     # the sequences of a speculative round, their tokens read already
        made = None
        if plan.decode:
            if self.speculator is not None:       # a speculative round: drafts, verification, rollback, read
                made = self.speculator.decode(plan.decode, spoken)
                self.counters["generated_tokens"] += made
            else:
                logits = runner.decode(plan.decode)
                launched.append(runner.sample(logits, plan.decode))
                for seq in plan.decode:
                    seq.num_cached = len(seq.tokens) - 1
        if plan.chunks:
            logits = runner.prefill(plan.chunks)
            for chunk in plan.chunks:
                chunk.seq.num_cached = chunk.start + chunk.length
            launched.append(runner.sample(logits, [c.seq for c in plan.chunks if c.completes]))
            self.counters["prompt_tokens"] += sum(c.length for c in plan.chunks)
        if not launched and made is None and not self.inflight and self.scheduler.has_work() and not plan.preempted:
            raise RuntimeError("the scheduler made no progress although requests wait "
                               f"({self.blocks.num_free} of {self.blocks.num_pages} pages free)")
        previous, self.inflight = self.inflight, launched
        self.inflight_kind = ("prefill" if plan.chunks else "decode") if launched else None
        outputs = self._read(previous, spoken)
        # A step's host time is spent waiting for the device to finish the step before it (or
        # on this step's speculative round, which it reads).
        kind = "decode" if made is not None else self.previous_kind if previous else self.inflight_kind
        if kind == "decode":
            self.counters["decode_s"] += time.perf_counter() - start
            self.counters["decode_steps"] += 1
            self.counters["decode_tokens"] += made if made is not None else sum(
                len(f.rows) for f in previous or launched)
        elif kind == "prefill":
            self.counters["prefill_s"] += time.perf_counter() - start
        self.previous_kind = self.inflight_kind
        return outputs

    def _read(self, records: list[InFlight], spoken: list[Sequence]) -> list[RequestOutput]:
        """Read a finished step's tokens into their sequences; finished ones leave. `spoken`:
        sequences that produced tokens already (a speculative round reads its own)."""
        produced: dict[int, Sequence] = {seq.request_id: seq for seq in spoken}
        for record in records:
            tokens, nan, logprobs = record.read()
            for i, (seq, index) in enumerate(record.rows):
                if seq.status is Status.FINISHED:          # stopped or aborted meanwhile: the row ran for nothing
                    continue
                if nan[i]:
                    raise FloatingPointError(f"the model's logits are NaN for request {seq.request_id}")
                if logprobs is not None and (seq.params.logprobs or seq.forced is not None):
                    seq.logprobs.append(logprobs[i])
                if i in record.logits:
                    seq.logits.append(record.logits[i])
                seq.resolve(index, tokens[i])
                produced[seq.request_id] = seq
                self.counters["generated_tokens"] += 1
        outputs = []
        for seq in produced.values():
            if seq.status is Status.FINISHED:
                self._remove(seq)
                del self.sequences[seq.request_id]
            outputs.append(RequestOutput.of(seq, self.tokenizer))
        return outputs

    # -- batch use --------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion -> RequestOutput per prompt, in
        prompt order. params: one SamplingParams for all, or one per prompt."""
        ids = add_all(self, prompts_with_params(prompts, params, (torch.Tensor,)))
        return self.run_until_done(ids, use_tqdm=use_tqdm)

    def run_until_done(self, request_ids: list[int], *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until the given (unfinished) requests finish -> their final outputs, in the order
        given. KeyError for an id that is not an unfinished request (it would never finish)."""
        unknown = [r for r in request_ids if r not in self.sequences]
        if unknown:
            raise KeyError(f"no unfinished request {unknown[0]}")
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

    def get_tokenizer(self):
        """The engine's tokenizer (None without one), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    def stats(self) -> EngineStats:
        wise = self.runner.wise
        c = self.counters
        return EngineStats(
            total_pages=self.blocks.num_pages, free_pages=self.blocks.num_free,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.preemptions,
            fallbacks=None if wise is None else wise.fallbacks,
            density=None if wise is None else self.runner.wise_density(),
            prompt_tokens=c["prompt_tokens"], generated_tokens=c["generated_tokens"], prefill_s=c["prefill_s"],
            decode_s=c["decode_s"], decode_steps=c["decode_steps"], decode_tokens=c["decode_tokens"],
            pool_sizing=self.pool_sizing, **self._program_stats(),
            **({} if self.speculator is None else self.speculator.stats()))

    def _program_stats(self) -> dict:
        """The EngineStats fields of the decode programs (CUDA graphs), speculation's included."""
        r, spec = self.runner, self.speculator
        graphs, bound = len(r.graphs), len(r.buckets) * len(r.widths)
        if spec is not None:   # draft steps of two kinds per (batch, width), verification per (batch, width)
            graphs, bound = graphs + len(spec.graphs), bound * 4
        memory = 0
        if r.graph_pool is not None:
            memory = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                         if tuple(s.get("segment_pool_id", ())) == tuple(r.graph_pool))
        return dict(step_programs=graphs, step_program_bound=bound, step_build_s=r.capture_s,
                    step_memory_bytes=memory)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
