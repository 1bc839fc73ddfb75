"""The workload of the engine decode benchmarks: a cohort of `batch` requests of `context` random
prompt tokens (`parse_shapes`, `random_prompts`, `cohort_pages`), on a checkpoint or random weights
at a preset's shape drawn on the device, the queries scaled by --q-scale (`random_recipe`,
`random_model`, `load_model`, `prepare_model`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1024x64,4096x20' -> [(context, batch), ...], both positive."""
    shapes = []
    for item in text.split(","):
        context, _, batch = item.strip().partition("x")
        if not (context.isdigit() and batch.isdigit()) or int(context) < 1 or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not CONTEXTxBATCH with positive integers")
        shapes.append((int(context), int(batch)))
    return shapes


def parse_floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: q scales must be positive and finite")
    return values


def cohort_pages(context: int, batch: int, new_tokens: int, page_size: int) -> int:
    """Pages the cohort holds at its end: every request at context + new_tokens keys."""
    return batch * -(-(context + new_tokens) // page_size)


def query_rows(config, name: str) -> int:
    """The leading rows (axis 0) of HF tensor `name` that --q-scale multiplies, so that every
    query is q_scale times its unscaled value: all of Ouro's self_attn.q_proj.weight
    [heads * head_dim, hidden]; of Huginn's attn.Wqkv.weight [3 heads * head_dim, hidden] its first
    heads * head_dim rows (q's; k's and v's rows follow), of attn.qk_bias [2, 1, heads, head_dim]
    row 0 (q's bias; row 1 is k's); 0 for every other tensor."""
    if name.endswith(("self_attn.q_proj.weight", "attn.Wqkv.weight")):
        return config.num_attention_heads * config.head_dim
    return 1 if name.endswith("attn.qk_bias") else 0


def random_recipe(config) -> dict[str, list]:
    """How a worker draws a random model: HF tensor name -> [shape, init, q_rows] (init:
    `wise_core.checkpoint.random_init`; q_rows: `query_rows`). Made by the current tree, so a worker
    running the pre-engine tree draws the same tensors."""
    from wise_core.checkpoint import expected_shapes, random_init
    return {name: [list(shape), random_init(name), query_rows(config, name)]
            for name, shape in expected_shapes(config).items()}


def config_fields(config) -> dict:
    """The config as ModelConfig keyword arguments for a worker; an Ouro config's architecture and
    Huginn fields (at their defaults) left out, which the pre-engine tree's ModelConfig lacks."""
    from wise_core.model_config import HUGINN_FIELDS
    fields = dataclasses.asdict(config)
    if config.architecture == "ouro":
        for name in ("architecture",) + HUGINN_FIELDS:
            del fields[name]
    return fields


def random_hf_tensor(name: str, shape, init: str, q_rows: int, spec: dict, device):
    """The random HF tensor `name` (`random_recipe`): ones, zeros, or normal(0, std) from a
    generator seeded by crc32(name) + seed (so the fused and the pre-engine layouts hold the same
    values), its first q_rows rows multiplied by q_scale. float32."""
    import zlib
    import torch
    if init != "normal":
        return (torch.ones if init == "ones" else torch.zeros)(shape, device=device)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) + spec["seed"])
    t = torch.empty(shape, device=device).normal_(0.0, spec["std"], generator=g)
    t[:q_rows] *= spec["q_scale"]
    return t


def random_model(spec: dict, config):
    """Random weights drawn on the device (seconds, where writing and reading a 1.4B-parameter
    checkpoint per process takes minutes) as spec["tensors"] (`random_recipe`; made here when
    absent), for the engine's fused layout or the pre-engine one; a Huginn model through
    `wise_torch.from_tensors`."""
    import torch
    import wise_torch
    dtype, device = getattr(torch, spec["dtype"]), torch.device(spec["device"])
    recipe = spec.get("tensors") or random_recipe(config)
    weights = {n: random_hf_tensor(n, shape, init, q_rows, spec, device).to(dtype)
               for n, (shape, init, q_rows) in recipe.items()}
    if getattr(config, "architecture", "ouro") == "huginn":   # the pre-engine ModelConfig has no architecture
        return wise_torch.from_tensors(config, weights, dtype=dtype, device=device)
    with torch.device("meta"):
        model = wise_torch.OuroForCausalLM(config)
    fuse = getattr(wise_torch.model, "fused_state_dict", None)  # the pre-engine layout has no fused projections
    weights = fuse(weights) if fuse is not None else weights
    model.load_state_dict(weights, strict=True, assign=True)
    if hasattr(model, "build_rope_table"):
        model.build_rope_table()
    return model.requires_grad_(False).eval()


def load_model(spec: dict):
    """The model of the spec: a checkpoint (the queries scaled in the HF tensors, `query_rows`) or
    random weights."""
    import torch
    import wise_torch
    from wise_core.checkpoint import load_checkpoint
    from wise_core.model_config import ModelConfig
    if spec.get("random"):
        return random_model(spec, ModelConfig(**spec["random"]))
    checkpoint = load_checkpoint(spec["checkpoint"])
    tensors = dict(checkpoint.tensors)
    if spec["q_scale"] != 1.0:
        for name, tensor in tensors.items():
            rows = query_rows(checkpoint.config, name)
            if rows:
                tensors[name] = tensor.copy()
                tensors[name][:rows] *= spec["q_scale"]
    return wise_torch.from_tensors(checkpoint.config, tensors, tokenizer=checkpoint.tokenizer,
                                   dtype=getattr(torch, spec["dtype"]), device=spec["device"])


def random_prompts(spec: dict, vocab_size: int) -> list[list[int]]:
    """The cohort's prompts: spec["batch"] of spec["context"] random ids, seeded by the shape (the same for every arm)."""
    import torch
    context, batch = spec["context"], spec["batch"]
    g = torch.Generator().manual_seed(context * 1000 + batch)
    return torch.randint(0, vocab_size, (batch, context), generator=g).tolist()


def prepare_model(args) -> tuple:
    """(config, checkpoint or None, the config's fields for a worker or None): --model as given, or
    random --preset weights that each worker draws on its device (`random_model`)."""
    from wise_core.checkpoint import load_checkpoint
    from wise_core.presets import PRESETS
    if args.model:  # a directory as an absolute path: an old arm's worker runs in another folder
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        return load_checkpoint(model).config, model, None
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown --preset {args.preset!r}; one of {sorted(PRESETS)}")
    config = PRESETS[args.preset]
    if args.layers and config.architecture == "huginn":
        raise SystemExit("--layers overrides an Ouro preset's shared layers; a Huginn model has a prelude, a "
                         "core block and a coda")
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    return config, None, config_fields(config)
