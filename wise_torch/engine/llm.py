"""`LLM`: the serving engine's front door (continuous batching over the paged cache).

    llm = wise_torch.LLM("ouro-py-3m", wise_config=WiseConfig())
    outs = llm.generate(["def add(a, b): return"], wise_torch.SamplingParams(max_tokens=32))

or step by step: `add_request`, `step` (the requests that produced a token or finished),
`has_unfinished`, `abort`, and `stats`. With `tensor_parallel_size=N` the model's heads are split
over N devices, one process each (`wise_torch.engine.distributed`); `close` (or a `with` block)
stops those processes.

kv_cache_dtype="fp8" (`EngineArgs`): the pool holds K/V as e4m3fn codes and a float32 scale per
(token, KV head) (`wise_torch.kv_cache`, `wise_core.kv_quant`): prefill and decode write them
quantized, every attention reads them dequantized to the model's dtype (prefill's own chunk's
keys too), a preemption copies codes and scales as they are. Pages are smaller (1 byte a value +
4 a (token, KV head) scale), so num_pages=None holds about 1.9x the tokens of bf16 (3.8x
float32) in the same memory. The attentions are the references: attention_backend "auto"
resolves to "reference" on every device; "triton", "fa4" and speculative decoding (its
verification kernel) are refused, as they do not read fp8 pages yet. Ouro models only (a Huginn
model's is refused).
"""

from __future__ import annotations

import dataclasses
import random
import weakref
from pathlib import Path

import torch

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.engine import EngineArgs, LLMEngine
from wise_core.engine.args import (check_adaptive_depth, check_exit_iterations, check_pool_fits, cpu_pool,
                                   host_available_bytes, pool_pages, positive_int)
from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch.attention import AttentionPlan, attention_plan
from wise_torch.engine import distributed
from wise_torch.engine.inflight import InFlight
from wise_torch.engine.model_runner import ModelRunner
from wise_torch.engine.speculative import Speculator
from wise_torch.huginn import HuginnForCausalLM
from wise_torch.kv_cache import PagedKVCache
from wise_torch.loading import load_model
from wise_torch.model import OuroForCausalLM

GPU_MEMORY_FRACTION = 0.9       # default pool on CUDA: this share of free memory ...
GPU_RESERVE_BYTES = 6 << 30     # ... less this much for activations, graphs and workspaces


def check_regroup(adaptive_regroup, adaptive_depth, wise_config, use_graphs: bool, cuda_graphs) -> None:
    """LLM's adaptive_regroup against its other arguments (checked already)."""
    if not isinstance(adaptive_regroup, bool):
        raise ValueError(f"adaptive_regroup must be True or False, got {adaptive_regroup!r}")
    if not adaptive_regroup:
        return
    if adaptive_depth is None:
        raise ValueError("adaptive_regroup regroups the rows of adaptive depth; pass adaptive_depth")
    if wise_config is not None:
        raise ValueError("adaptive_regroup runs without WISE (a row that exited still runs WISE's later "
                         "iterations); pass wise_config=None or adaptive_regroup=False")
    if use_graphs:
        raise ValueError(f"adaptive_regroup gathers the rows still running (dynamic shapes): it cannot run in "
                         f"a CUDA graph (cuda_graphs={cuda_graphs!r} on CUDA); pass cuda_graphs=False")


class LLM(LLMEngine):
    """Continuous-batching engine over one model (`wise_core.engine.LLMEngine`, the host side;
    this class adds the device side: `ModelRunner`, CUDA graphs, speculation, tensor parallelism).

    model: an OuroForCausalLM or a HuginnForCausalLM, a checkpoint directory or a built-in name
    (loaded in `dtype`, default bfloat16 on CUDA and float32 on CPU, on `device`, default CUDA
    when available). num_steps: a Huginn model's core iterations per token (None: its
    total_ut_steps); the pool holds `num_planes(config, num_steps)` planes, a WiseConfig's depths
    index core iterations (each < num_steps), and every token starts from the initial state of
    its position with seed 0 (`HuginnForCausalLM.step_inputs`), so a request's tokens do not
    depend on its batch, chunking or preemption. An Ouro model runs its num_loops (None or that
    number). Huginn runs without speculation and tensor parallelism.
    adaptive_depth: a Huginn model's per-token adaptive depth in decode (`AdaptiveDepth`, the
    released KL exit criterion; None: every token runs num_steps iterations): each decode step
    passes it to `HuginnForCausalLM.decode_step`, whose rows that exit ride along held (every
    iteration runs every row, static shapes: CUDA graphs as without it); prefill runs every
    iteration, as the released code's. `stats().mean_decode_depth` is the mean of the
    iterations decoded tokens ran. With WISE, a row that exited still runs the later
    iterations' discovery and reuse attention (held state, outputs discarded, counted in the
    density): its tokens are those of the exit, its later iterations' K/V its exit iteration's.
    An Ouro model exits by its config's early_exit_threshold: adaptive_depth is an error there.
    adaptive_regroup: run adaptive depth regrouped instead (`HuginnForCausalLM.decode_step(...,
    regroup=True)`): after each checked iteration only the rows still running run the later
    iterations (gathered: dynamic shapes), so a step costs the iterations its rows run, with
    the tokens and depths of riding along (mean_decode_depth counts the same). Torch only:
    wise_jax.LLM's steps are compiled with static shapes. An engine keyword, not an
    `AdaptiveDepth` field, because it says how this engine runs a step, not when a token
    exits (the config JAX shares). Eager only: an error with cuda_graphs=True or "auto" on
    CUDA (pass cuda_graphs=False), without adaptive_depth, and with WISE (a row that exited
    still runs WISE's later iterations; the model refuses it); Huginn has no speculation or
    tensor parallelism.
    engine_args: `wise_core.engine.EngineArgs` (wise_config, num_pages, page_size, max_num_seqs,
    max_model_len, max_num_batched_tokens, attention_backend, seed, enable_prefix_caching,
    kv_cache_dtype ("auto", "fp8": module docstring)), the same arguments and defaults as
    wise_jax.LLM's. attention_backend: "auto", "triton", "fa4" or "reference", what runs prefill,
    the dense decode loops and the WISE loops (`wise_torch.attention.attention_plan`,
    docs/attention.md's table; speculative drafts and verification run on its decode kernel);
    `stats().prefill_attention` and `stats().wise_decode` say what runs, `attention_plan` every
    phase (`wise_torch.attention.AttentionPlan`). num_pages=None sizes the
    pool from free device memory on CUDA (GPU_MEMORY_FRACTION of it less GPU_RESERVE_BYTES),
    CPU_POOL_BYTES of K/V on a CPU. cuda_graphs: True, False or "auto" (on CUDA).
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

    ARRAY_TYPES = (torch.Tensor,)

    def __init__(self, model: OuroForCausalLM | HuginnForCausalLM | str | Path, *, num_steps: int | None = None,
                 adaptive_depth: AdaptiveDepth | None = None, adaptive_regroup: bool = False,
                 cuda_graphs: bool | str = "auto",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 speculative_config: SpeculativeConfig | None = None, tensor_parallel_size: int = 1,
                 **engine_args):
        args = EngineArgs(**engine_args)
        if args.kv_cache_dtype == "fp8" and speculative_config is not None:
            raise ValueError("speculative decoding (its verification kernel) does not read kv_cache_dtype='fp8' "
                             "pages yet: pass kv_cache_dtype='auto' or speculative_config=None")
        positive_int("tensor_parallel_size", tensor_parallel_size)
        if tensor_parallel_size > 1 and speculative_config is not None:
            raise ValueError("speculative decoding does not run with tensor_parallel_size > 1")
        if isinstance(model, (str, Path)):
            device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            model = load_model(model, dtype=dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
                               device=device)
        elif not isinstance(model, (OuroForCausalLM, HuginnForCausalLM)):
            raise TypeError(f"model must be an OuroForCausalLM, a HuginnForCausalLM, a checkpoint directory or a "
                            f"built-in name, got {type(model).__name__}")
        elif dtype is not None or device is not None:
            raise ValueError("dtype and device apply to a model loaded by name; this model is already built")
        if isinstance(model, HuginnForCausalLM) and (speculative_config is not None or tensor_parallel_size > 1):
            raise ValueError("speculative decoding and tensor parallelism run Ouro models only; this is a Huginn "
                             "model")
        if isinstance(model, HuginnForCausalLM) and args.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype='fp8' is not implemented for Huginn models yet (Ouro models run it)")
        num_steps = model.config.num_loops if num_steps is None else num_steps
        model.planes(num_steps)   # checks num_steps against the model
        adaptive_depth = check_adaptive_depth(adaptive_depth, model.config)
        check_exit_iterations(adaptive_depth, num_steps)
        if speculative_config is not None:
            if model.config.early_exit_threshold < 1.0:
                raise ValueError(f"speculative decoding runs every loop; this model exits early "
                                 f"(early_exit_threshold {model.config.early_exit_threshold})")
            if not isinstance(speculative_config, SpeculativeConfig):
                raise TypeError(f"speculative_config must be a SpeculativeConfig or None, "
                                f"got {type(speculative_config).__name__}")
            if speculative_config.method == "wise" and args.wise_config is None:
                args = dataclasses.replace(args, wise_config=WiseConfig())
            speculative_config.verify_depth(model.config.num_loops, args.wise_config)
        args.checked_for(num_steps, model.config.max_position_embeddings,
                         None if isinstance(model, OuroForCausalLM) else f"num_steps={num_steps} core iterations")
        if cuda_graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
        self.device = model.head_weight.device
        if cuda_graphs is True and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        use_graphs = cuda_graphs is True or (cuda_graphs == "auto" and self.device.type == "cuda")
        check_regroup(adaptive_regroup, adaptive_depth, args.wise_config, use_graphs, cuda_graphs)
        self.tensor_parallel_size, self.workers = tensor_parallel_size, None
        if tensor_parallel_size > 1:
            self.workers, model = distributed.start(model, tensor_parallel_size)
            self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            self._build(model, args, num_steps=num_steps, adaptive_depth=adaptive_depth,
                        adaptive_regroup=adaptive_regroup, use_graphs=use_graphs, speculative_config=speculative_config)
        except BaseException:
            self.close()
            raise

    def _build(self, model: OuroForCausalLM | HuginnForCausalLM, args: EngineArgs, *, num_steps, adaptive_depth,
               adaptive_regroup, use_graphs, speculative_config) -> None:
        """The pool, host side and runner over `model` (under tensor parallelism rank 0's shard,
        the workers following); the arguments are __init__'s, checked."""
        config, weight = model.config, model.head_weight
        if self.workers is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()     # a whole model loaded by name is gone: its memory is free
        planes = model.planes(num_steps)
        page_bytes = PagedKVCache.page_bytes(config, args.page_size, weight.dtype, planes, args.kv_cache_dtype)
        num_pages, sizing = args.num_pages, f"num_pages={args.num_pages} as given"
        if num_pages is None:
            num_pages, sizing = self._default_pages(page_bytes, args.max_num_seqs * args.pages_per_request(
                config.max_position_embeddings))
        if args.kv_cache_dtype == "fp8":
            sizing += (f"; kv_cache_dtype='fp8': K/V as 1-byte e4m3fn codes and a float32 scale per (token, KV "
                       f"head), pages of {page_bytes} bytes (of "
                       f"{PagedKVCache.page_bytes(config, args.page_size, weight.dtype, planes)} in "
                       f"{str(weight.dtype).removeprefix('torch.')})")
        check_pool_fits(num_pages, page_bytes, *self._available_memory())
        max_model_len = args.model_len(config.max_position_embeddings, num_pages)
        self.model, self.wise_config = model, args.wise_config
        self._start(args, num_pages=num_pages, pool_sizing=sizing, max_model_len=max_model_len,
                    tokenizer=model.tokenizer, vocab_size=config.vocab_size, eos_token_id=config.eos_token_id)
        self.attention_plan = attention = self._attention_plan(args.attention_backend, weight.device, weight.dtype,
                                                               config.head_dim, args.kv_cache_dtype)
        settings = dict(wise_config=args.wise_config, num_pages=num_pages, page_size=args.page_size,
                        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, use_graphs=use_graphs,
                        attention=attention, seed=random.randrange(2 ** 63) if args.seed is None else args.seed,
                        num_steps=num_steps, adaptive_depth=adaptive_depth, adaptive_regroup=adaptive_regroup,
                        kv_cache_dtype=args.kv_cache_dtype)
        if self.workers is not None:
            self.workers.send("settings", settings)
        self.runner = ModelRunner(model, **settings, workers=self.workers)
        if self.workers is not None:
            self.workers.wait_ready()
        self.speculator = None
        if speculative_config is not None:
            self.speculator = Speculator(self.runner, self.blocks, speculative_config, kernel=attention.kernel)
            self.scheduler.lookahead = self.speculator.drafts_of
            self.scheduler.ready = self.speculator.ready

    def _attention_plan(self, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                        kv_cache_dtype: str) -> AttentionPlan:
        """What runs each phase's attention: `attention_plan` of the engine's attention_backend.
        A construction hook, not an option: a measurement's subclass replaces phases no backend
        names (benchmarks/engine/arms.py: the union decode arms, the packed reference prefill)."""
        return attention_plan(backend, device, dtype, head_dim, kv_cache_dtype)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); the engine cannot step
        afterwards. Also run when the LLM is garbage-collected or the program exits."""
        if self.workers is not None:
            self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _available_memory(self) -> tuple[int | None, str]:
        """(bytes free for the pool, which memory that is) on the model's device."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free, f"free on {self.device}"
        return host_available_bytes(), "of host memory available"

    def _default_pages(self, page_bytes: int, most: int) -> tuple[int, str]:
        """(pages, how they were sized) for num_pages=None."""
        if self.device.type != "cuda":
            return cpu_pool(page_bytes, "CPU", most)
        free, _ = torch.cuda.mem_get_info(self.device)
        return pool_pages(int(free * GPU_MEMORY_FRACTION - GPU_RESERVE_BYTES), page_bytes,
                          f"{GPU_MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB free less "
                          f"{GPU_RESERVE_BYTES / 2**30:.0f} GiB", most)

    # -- the device side (LLMEngine's hooks) -------------------------------------------------
    def _check_request(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.check_request(seq)

    def _speculate(self, seqs: list[Sequence], speculated: list[Sequence]) -> int | None:
        return None if self.speculator is None else self.speculator.decode(seqs, speculated)

    def _launch_decode(self, seqs: list[Sequence]) -> InFlight:
        return self.runner.sampler.sample(self.runner.decode(seqs), seqs)

    def _launch_prefill(self, chunks: list[Chunk]) -> InFlight:
        logits, prompt = self.runner.prefill(chunks)
        return self.runner.sampler.sample(logits, [c.seq for c in chunks if c.completes], prompt)

    def _offload(self, seq: Sequence, pages: list[int]) -> None:
        self.runner.offload(seq, pages)

    def _restore(self, seq: Sequence) -> None:
        self.runner.restore(seq)

    def _forget(self, seq: Sequence) -> None:
        self.runner.forget(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _build_seconds(self) -> float:
        return self.runner.step_graphs.capture_s

    def _scrub(self, pages: list[int]) -> None:
        """Zero the K/V of `pages` on every rank (an fp8 pool's quantized zeros)."""
        if pages:
            self.runner.scrub(pages)

    def _device_stats(self) -> dict:
        wise = self.runner.wise
        return dict(prefill_attention=self.runner.prefill_attention, wise_decode=self.runner.wise_decode,
                    mean_decode_depth=self.runner.mean_decode_depth(),
                    fallbacks=None if wise is None else wise.fallbacks,
                    density=None if wise is None else self.runner.wise_density(), **self._program_stats(),
                    **({} if self.speculator is None else self.speculator.stats()))

    def _reset_device_counters(self) -> None:
        if self.runner.loops_run is not None:
            self.runner.loops_run.zero_()
        if self.runner.wise is not None:
            self.runner.reset_wise_counters()

    def _program_stats(self) -> dict:
        """The EngineStats fields of the decode programs (CUDA graphs), speculation's included."""
        r, spec, step_graphs = self.runner, self.speculator, self.runner.step_graphs
        graphs, bound = len(r.graphs), len(r.buckets) * len(r.widths)
        if spec is not None:   # draft steps of two kinds per (batch, width), verification per (batch, width)
            graphs, bound = graphs + len(spec.graphs), bound * 4
        memory = 0
        if step_graphs.pool is not None:
            memory = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                         if tuple(s.get("segment_pool_id", ())) == tuple(step_graphs.pool))
        return dict(step_programs=graphs, step_program_bound=bound, step_build_s=step_graphs.capture_s,
                    step_memory_bytes=memory, failed_step_programs=tuple(step_graphs.eager_steps))

