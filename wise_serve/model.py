"""The engine a server (or the load client's offline baseline) runs, from command-line arguments.

`--load-format dummy` builds a preset architecture (wise_core.config.PRESETS, e.g. ouro-1.4b)
with random weights made on the device, in seconds: the load benchmark's workload when no
checkpoint is at hand (as vLLM's `--load-format dummy`). `--q-scale S` multiplies q_proj by S,
which peaks a random model's attention so that WISE has a small support to find.
"""

from __future__ import annotations

import argparse
import zlib

import torch

from wise_core.checkpoint import expected_shapes
from wise_core.config import PRESETS, SpeculativeConfig, WiseConfig
from wise_serve.args import check_engine_arguments
from wise_torch.engine.llm import LLM
from wise_torch.loading import from_tensors, load_model
from wise_torch.model import OuroForCausalLM

DUMMY_STD = 0.02


def dummy_model(preset: str, *, dtype: torch.dtype, device: torch.device, q_scale: float = 1.0,
                seed: int = 0) -> OuroForCausalLM:
    """Random weights of a preset architecture, drawn on `device`: normal(0, 0.02) matrices from
    a generator seeded by the tensor's name and `seed` (the values benchmarks/throughput.py's
    random models hold), unit norms, zero gate bias; q_proj scaled by q_scale. No tokenizer
    (prompts are token ids)."""
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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def build_llm(args: argparse.Namespace) -> LLM:
    """The engine of `wise serve` from wise_serve.args.add_engine_arguments' arguments."""
    check_engine_arguments(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.load_format == "dummy":
        model = dummy_model(args.model, dtype=dtype, device=device, q_scale=args.q_scale, seed=args.seed or 0)
    else:
        model = load_model(args.model, dtype=dtype, device=device)
    uses_wise = args.wise or args.speculative == "wise"
    wise_config = WiseConfig(eta=args.eta, kernel=args.kernel) if uses_wise else None
    speculative = None if args.speculative is None else SpeculativeConfig(
        args.speculative, num_draft=args.num_draft, draft_loops=args.draft_loops)
    cuda_graphs = {"auto": "auto", "on": True, "off": False}[args.cuda_graphs]
    return LLM(model, wise_config=wise_config, num_pages=args.num_pages, page_size=args.page_size,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=cuda_graphs,
               kernel=None if uses_wise else args.kernel, seed=args.seed, speculative_config=speculative)
