"""Decode throughput of wise_jax's jit-compiled generate: dense and WISE, per kernel.

Models get random weights made on the device (`wise_jax.init_params`), in bf16: the small
built-in `random-tiny` shape and the Ouro-1.4B shape. Each variant runs generate once to
compile, then once timed (same bucket, no recompilation); every row decodes `--new-tokens`
tokens (no eos). Random weights give near-uniform attention, so WISE densities here say little
about real models; the timings measure the decode path.

    python benchmarks/jax_generate_bench.py                    # H200: 1K context x batch 64
    python benchmarks/jax_generate_bench.py --smoke            # tiny shapes, CPU

Writes <out>/jax_generate_bench[-<tag>].json and .md (machine, versions, date), after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the 1.4B cache is ~58 GB
ROOT = Path(__file__).resolve().parent
if str(ROOT.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402

import wise_jax  # noqa: E402
from wise_core.checkpoint import BUILTIN_MODELS  # noqa: E402
from wise_core.config import PRESETS, WiseConfig  # noqa: E402
from wise_jax.attention import resolve_kernel  # noqa: E402

VARIANTS = ("dense-reference", "dense-pallas", "wise-reference", "wise-pallas")


def model_config(name: str):
    if name in PRESETS:
        return PRESETS[name]
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]().config
    raise SystemExit(f"unknown model {name!r}: choose from {sorted(PRESETS) + sorted(BUILTIN_MODELS)}")


def environment() -> dict:
    device = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "device": f"{device.platform}: {device.device_kind}",
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "numpy": np.__version__}


def run_variant(params, config, prompts, variant: str, args) -> dict:
    mode, kernel = variant.split("-")
    wise_config = WiseConfig(kernel=kernel) if mode == "wise" else None
    kw = dict(max_new_tokens=args.new_tokens, eos_token_id=None, wise_config=wise_config,
              page_size=args.page_size, kernel=kernel)
    start = time.perf_counter()
    first = wise_jax.generate(params, config, prompts, **kw)
    first_s = time.perf_counter() - start
    timed = wise_jax.generate(params, config, prompts, **kw)
    stats = timed.stats
    steps = args.new_tokens - 1
    return {"mode": mode, "kernel": resolve_kernel(kernel),
            "first_call_s": round(first_s, 3), "compiles": first.stats["compiles"],
            "recompiles_timed": stats["compiles"], "prefill_s": round(stats["prefill_s"], 4),
            "decode_s": round(stats["decode_s"], 4),
            "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 1),
            "ms_per_step": round(1e3 * stats["decode_s"] / max(steps, 1), 3),
            "new_tokens": stats["new_tokens"], "fallbacks": stats["fallbacks"], "density": stats["density"]}


def write(results: dict, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = "jax_generate_bench" + (f"-{tag}" if tag else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    env = results["environment"]
    lines = [f"# wise_jax generate: decode throughput ({env['date']})", "",
             f"{env['device']} on {env['machine']}; python {env['python']}, jax {env['jax']}, "
             f"jaxlib {env['jaxlib']}. Random bf16 weights made on the device; one compile call, then "
             f"one timed call per variant. {results['settings']}", "",
             "| model | variant | batch | context | new | decode tok/s | ms/step | prefill s | first call s "
             "| density (reuse) | fallbacks | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        density = ", ".join(f"{d}: {x:.3f}" for d, x in (r.get("density") or {}).items() if x is not None)
        lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['context']} | {r['new']} | "
                     f"{r.get('decode_tokens_per_s', '')} | {r.get('ms_per_step', '')} | {r.get('prefill_s', '')} | "
                     f"{r.get('first_call_s', '')} | {density} | {'' if r.get('fallbacks') is None else r['fallbacks']} | "
                     f"{r.get('error', '')} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes that run on a CPU")
    parser.add_argument("--models", default=None, help="comma list (default: random-tiny,ouro-1.4b)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    args = parser.parse_args(argv)
    defaults = (("random-tiny", 2, 64, 4) if args.smoke else ("random-tiny,ouro-1.4b", 64, 1024, 64))
    args.models = args.models or defaults[0]
    args.batch = args.batch or defaults[1]
    args.context = args.context or defaults[2]
    args.new_tokens = args.new_tokens or defaults[3]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.smoke and args.tag == "":
        args.tag = "smoke"

    results = {"environment": environment(), "runs": [],
               "settings": f"page size {args.page_size}, dtype {args.dtype}, greedy, WISE eta "
                           f"{WiseConfig().eta} (discover {WiseConfig().discover_depths}, reuse "
                           f"{WiseConfig().reuse_depths})."}
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        config = dataclasses.replace(model_config(name), eos_token_id=None)
        params = wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=dtype)
        prompts = rng.integers(0, config.vocab_size, (args.batch, args.context)).tolist()
        for variant in variants:
            row = {"model": name, "variant": variant, "batch": args.batch, "context": args.context,
                   "new": args.new_tokens, "dtype": args.dtype}
            try:
                row.update(run_variant(params, config, prompts, variant, args))
            except Exception as e:  # one failing variant must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                traceback.print_exc()
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            write(results, args.out, args.tag)
        del params
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
