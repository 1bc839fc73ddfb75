"""The one constructor of an engine, and the engine a server (or the load client's offline
baseline) runs, from command-line arguments.

`build_engine(backend, model, **engine_args)` is the front door `wise generate`, `wise serve` and
the benchmarks build an engine by: `wise_torch.LLM` or `wise_jax.LLM`, its options checked
before the framework loads (`wise_core.engine.backends`). `select_device(backend, device)` and
`engine_context(backend)` are the rest of what a caller of either backend needs: the device
checked (jax: its platform chosen before jax starts), and what the engine's steps run in.
`build_llm(args)` returns the `Engine` (`wise_core.engine.protocol`) of `--backend` with the same
engine arguments (`engine_arguments`). This is the one module of wise_serve that imports a
framework, each inside the function that needs it, so that `--backend jax` never imports torch
and `--backend torch` never imports jax; the rest of the server speaks to the engine through the
protocol only.

`--load-format dummy` builds a preset architecture (wise_core.presets.PRESETS, e.g. ouro-1.4b)
with random weights, in seconds: the load benchmark's workload when no checkpoint is at hand
(as vLLM's `--load-format dummy`). torch draws them on the device (`dummy_model`: the values
benchmarks/engine/throughput.py's random models hold); jax on the host (`wise_core.checkpoint.
random_tensors`), so the two backends' dummy weights differ. `--q-scale S` multiplies q_proj by
S, which peaks a random model's attention so that WISE has a small support to find.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
import zlib
from typing import Callable, ContextManager

from wise_core.checkpoint import expected_shapes, open_checkpoint, random_tensors
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_core.engine.backends import check_backend, check_engine_options
from wise_core.engine.protocol import Engine
from wise_serve.args import check_engine_arguments

log = logging.getLogger(__name__)

DUMMY_STD = 0.02


def build_engine(backend: str, model, **engine_args) -> Engine:
    """The engine of `backend` over `model`: `wise_torch.LLM(model, **engine_args)` for "torch",
    `wise_jax.LLM(model, **engine_args)` for "jax"; only that framework is imported.

    model: a checkpoint directory or built-in model name (the engine loads it, in `dtype`: a
    name of `wise_core.engine.backends.DTYPES` or the framework's dtype; torch on `device`), or
    the framework's model (torch: an OuroForCausalLM or HuginnForCausalLM; jax: its Params, with
    `config=`). engine_args: `EngineArgs`' fields and the backend's own options
    (`BACKEND_OPTIONS`). An unknown backend, an option the backend does not take, an unknown
    dtype name or an attention_backend the backend does not have is a ValueError naming it,
    before any framework loads."""
    check_engine_options(backend, engine_args)
    if backend == "torch":
        import torch

        from wise_torch.engine.llm import LLM

        if isinstance(engine_args.get("dtype"), str):
            engine_args["dtype"] = getattr(torch, engine_args["dtype"])
        return LLM(model, **engine_args)
    try:
        from wise_jax.engine import LLM
    except ImportError as e:
        raise RuntimeError(f"the jax backend needs jax and the wise_jax package: {e}") from e
    return LLM(model, **engine_args)


def select_device(backend: str, device: str):
    """The device of `device` ("auto": the GPU when there is one, "cpu", "cuda") for `backend`:
    torch -> a torch.device; jax -> None, its platform chosen (JAX_PLATFORMS=cpu for "cpu",
    set before jax starts its backends) and checked. A device the framework cannot run on is a
    RuntimeError naming it."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if check_backend(backend) == "torch":
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        return torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
    except ImportError as e:
        raise RuntimeError(f"the jax backend needs jax and the wise_jax package: {e}") from e
    platform = jax.default_backend()
    if device == "cuda" and platform != "gpu":
        raise RuntimeError(f"--device cuda: jax runs on {platform!r}, not a GPU")
    if device == "cpu" and platform != "cpu":
        raise RuntimeError(f"--device cpu: jax runs on {platform!r} (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r})")
    return None


def engine_context(backend: str) -> Callable[[], ContextManager]:
    """What an engine's steps run in: torch.inference_mode for torch (no autograd bookkeeping
    in the steps), nothing for jax."""
    if check_backend(backend) == "torch":
        import torch

        return torch.inference_mode
    return contextlib.nullcontext


def build_llm(args: argparse.Namespace) -> Engine:
    """The engine of `wise serve` from wise_serve.args.add_engine_arguments' arguments (checked
    first: a ValueError names a bad flag before any framework loads)."""
    check_engine_arguments(args)
    return _torch_engine(args) if args.backend == "torch" else _jax_engine(args)


def engine_arguments(args: argparse.Namespace) -> dict:
    """The `wise_core.engine.EngineArgs` of the flags (both backends take them)."""
    uses_wise = args.wise or args.speculative == "wise"
    return dict(wise_config=WiseConfig(eta=args.eta) if uses_wise else None,
                num_pages=args.num_pages, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                attention_backend=args.attention_backend, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of --model, read without a framework (a preset for dummy weights, else
    the checkpoint's config.json)."""
    return PRESETS[args.model] if args.load_format == "dummy" else open_checkpoint(args.model).config


def describe(args: argparse.Namespace) -> str:
    """How the engine decodes, for the server's start-up line."""
    if args.speculative is not None:
        return f"{args.backend}, dense output, speculative {args.speculative} drafts of {args.num_draft} tokens"
    return f"{args.backend}, " + (f"WISE eta {args.eta}" if args.wise else "dense")


# -- torch ------------------------------------------------------------------------------------------
def dummy_model(preset: str, *, dtype, device, q_scale: float = 1.0, seed: int = 0):
    """Random weights of a preset architecture, drawn on `device` (a torch.device) in `dtype`
    (a torch.dtype) -> an OuroForCausalLM: normal(0, 0.02) matrices from a generator seeded by
    the tensor's name and `seed` (the values benchmarks/engine/throughput.py's random models hold),
    unit norms, zero gate bias; q_proj scaled by q_scale. No tokenizer (prompts are token ids)."""
    import torch

    from wise_torch.loading import from_tensors

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} for --load-format dummy (presets: {', '.join(sorted(PRESETS))})")
    config = PRESETS[preset]
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(shape, device=device)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, device=device)
        else:
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) + seed)
            t = torch.empty(shape, device=device).normal_(0.0, DUMMY_STD, generator=g)
            if name.endswith("self_attn.q_proj.weight"):
                t *= q_scale
        tensors[name] = t.to(dtype)
    return from_tensors(config, tensors, dtype=dtype, device=device)


def _torch_engine(args: argparse.Namespace) -> Engine:
    device = select_device("torch", args.device)
    dtype = None if args.dtype == "auto" else args.dtype    # None: bfloat16 on CUDA, float32 otherwise
    speculative = None if args.speculative is None else SpeculativeConfig(
        args.speculative, num_draft=args.num_draft, draft_loops=args.draft_loops)
    options = dict(engine_arguments(args), cuda_graphs={"auto": "auto", "on": True, "off": False}[args.cuda_graphs],
                   speculative_config=speculative)
    if args.load_format != "dummy":
        return build_engine("torch", args.model, dtype=dtype, device=device, **options)
    import torch

    dtype = getattr(torch, dtype) if dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    model = dummy_model(args.model, dtype=dtype, device=device, q_scale=args.q_scale, seed=args.seed or 0)
    return build_engine("torch", model, **options)


# -- jax --------------------------------------------------------------------------------------------
def _jax_engine(args: argparse.Namespace) -> Engine:
    select_device("jax", args.device)
    dtype = None if args.dtype == "auto" else args.dtype    # None: bfloat16 on a GPU, float32 otherwise
    ahead = args.compile_ahead is not False
    options = dict(engine_arguments(args), background_compile=True if ahead else None)
    if args.load_format != "dummy":
        llm = build_engine("jax", args.model, dtype=dtype, **options)
    else:
        import jax

        import wise_jax

        config = PRESETS[args.model]      # a preset: check_engine_arguments
        tensors = random_tensors(config, seed=args.seed or 0, std=DUMMY_STD)
        for name, t in tensors.items():
            if name.endswith("self_attn.q_proj.weight"):
                t *= args.q_scale
        dtype = dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
        llm = build_engine("jax", wise_jax.from_checkpoint_tensors(config, tensors, dtype), config=config, **options)
    if ahead:   # before the server listens: its first requests find their programs compiled
        start = time.perf_counter()
        llm.wait_compiles()
        stats = llm.stats()
        log.info("compiled the start-up set ahead in %.1f s (%d decode programs, %.1f s of compiles in all)",
                 time.perf_counter() - start, stats.step_programs, stats.step_build_s)
    return llm
