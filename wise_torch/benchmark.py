"""Prefill and decode throughput of `wise_torch.generate`: dense against WISE.

Runs a checkpoint (--model) or random weights of a preset's shape (--preset; random weights
give near-uniform attention at small --std, so WISE selects most blocks: the density column
says how sparse a run was). Every (shape, mode) runs twice and reports the second run (the
first compiles kernels). Results go to stdout and, with --out, to a JSON file.

    python -m wise_torch.benchmark --preset ouro-1.4b --shapes 1024x16,4096x8 --out bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import platform
import time

import torch

import wise_torch
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, WiseConfig


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1024x16,4096x8' -> [(context, batch), ...]."""
    shapes = []
    for item in text.split(","):
        context, _, batch = item.partition("x")
        if not (context.isdigit() and batch.isdigit()):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not CONTEXTxBATCH")
        shapes.append((int(context), int(batch)))
    return shapes


def build_model(args) -> wise_torch.OuroForCausalLM:
    dtype = getattr(torch, args.dtype)
    if args.model:
        return wise_torch.load_model(args.model, dtype=dtype, device=args.device)
    config = PRESETS[args.preset]
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    return wise_torch.from_tensors(config, random_tensors(config, seed=0, std=args.std), dtype=dtype,
                                   device=args.device)


def run_once(model, prompts, new_tokens: int, wise_config: WiseConfig | None, page_size: int,
             kernel: str) -> dict:
    start = time.perf_counter()
    out = wise_torch.generate(model, prompts, max_new_tokens=new_tokens, eos_token_id=None,
                              wise_config=wise_config, page_size=page_size, kernel=kernel)
    stats = out.stats
    steps = new_tokens - 1
    return {"prefill_s": stats.prefill_s, "prefill_tokens_per_s": stats.prefill_tokens / stats.prefill_s,
            "decode_s": stats.decode_s, "decode_step_ms": 1e3 * stats.decode_s / steps if steps else None,
            "decode_tokens_per_s": stats.decode_tokens_per_s, "fallbacks": stats.fallbacks,
            "density": stats.density, "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory or built-in name (default: random --preset weights)")
    parser.add_argument("--preset", default="ouro-1.4b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers of the preset")
    parser.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x16,4096x8"),
                        help="CONTEXTxBATCH list (default: 1024x16,4096x8)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eta", type=float, default=0.95)
    parser.add_argument("--kernel", default="auto", choices=("auto", "reference", "triton"))
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    model = build_model(args)
    config = model.config
    modes = {"dense": None,
             "wise-all-blocks": WiseConfig(eta=args.eta, kernel=args.kernel, all_blocks=True),
             "wise": WiseConfig(eta=args.eta, kernel=args.kernel)}
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "triton": importlib.metadata.version("triton"), "model": args.model or f"random {args.preset} (std {args.std})",
              "config": dataclasses.asdict(config), "dtype": args.dtype, "new_tokens": args.new_tokens,
              "eta": args.eta, "kernel": args.kernel, "page_size": args.page_size, "runs": []}
    print(f"{'context x batch':>16} {'mode':>16} {'prefill tok/s':>14} {'step ms':>9} {'decode tok/s':>13} density")
    for context, batch in args.shapes:
        g = torch.Generator().manual_seed(context * 1000 + batch)
        prompts = torch.randint(0, config.vocab_size, (batch, context), generator=g).tolist()
        for name, wise_config in modes.items():
            row = {"context": context, "batch": batch, "mode": name}
            try:
                run = (model, prompts, args.new_tokens, wise_config, args.page_size, args.kernel)
                run_once(*run)  # compile, warm up
                row.update(run_once(*run))
                density = ", ".join(f"{d}: {x:.3f}" for d, x in (row["density"] or {}).items())
                print(f"{context:>9} x {batch:<4} {name:>16} {row['prefill_tokens_per_s']:>14.0f} "
                      f"{row['decode_step_ms']:>9.2f} {row['decode_tokens_per_s']:>13.1f} {density}", flush=True)
            except Exception as e:  # keep measuring the other shapes and modes
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{context:>9} x {batch:<4} {name:>16} failed: {row['error']}", flush=True)
            report["runs"].append(row)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
