"""Memory of the JAX engine's compiled programs with the constructor defaults: the start-up set, one by one.

    python -m benchmarks.engine.program_memory --out benchmarks/results/DIR            # on a GPU
    python -m benchmarks.engine.program_memory --xla-flags=--xla_disable_hlo_passes=rematerialization --out DIR
    python -m benchmarks.engine.program_memory --preset test-tiny --dtype float32 --out /tmp/pm   # CPU smoke

`wise_jax.LLM(params, config)` with random weights (every other constructor argument at its default
unless given: --max-num-seqs, --max-model-len, --num-pages, --wise), background compiles off; then
each program of its start-up set (`LLM.startup_set`: decode, prefill, first tokens; --kinds picks,
--most N takes each kind's first N) compiled as the engine compiles it. Per program: the compile
seconds, XLA's memory analysis (arguments, the part aliased to outputs -- the K/V pool, donated --,
temporaries), and the rematerialization warnings XLA printed while compiling it (its estimate of the
program's memory against its limit: a program whose real buffers fit can still warn, when the
estimate counts the pool more than once). With the pool sizing the engine chose, it answers issue
45's "pool sizing that compiles without rematerialization": the largest temporaries against what
the sizing left for them. Writes program_memory.json and .md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report as rp

KINDS = ("decode", "prefill", "first")
REMAT = re.compile(r"Can't reduce memory use below ([\d.]+)GiB .*? only reduced to ([\d.]+)GiB")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="ouro-1.4b", help="model shape for random weights (wise_core PRESETS)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--wise", action="store_true", help="the engine with WiseConfig() (default: dense)")
    p.add_argument("--max-num-seqs", type=int, help="engine argument (default: the engine's)")
    p.add_argument("--max-model-len", type=int, help="engine argument (default: the engine's)")
    p.add_argument("--num-pages", type=int, help="engine argument (default: the engine's sizing)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    p.add_argument("--most", type=int, default=0, help="compile each kind's first N programs (0: all)")
    p.add_argument("--xla-flags", default="", help="XLA_FLAGS for this process (set before jax starts)")
    p.add_argument("--out", type=Path, required=True)
    return p


@contextlib.contextmanager
def captured_stderr():
    """What the process writes to file descriptor 2 meanwhile (XLA's C++ warnings), as a list of one str."""
    text: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace"))
            sys.stderr.write(text[0])


def measure(args) -> dict:
    import jax

    import wise_jax
    from wise_core.checkpoint import random_tensors
    from wise_core.presets import PRESETS
    from wise_core.wise_config import WiseConfig

    config = PRESETS[args.preset]
    params = wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=0, std=0.02), args.dtype)
    engine_args = {k: v for k, v in dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                         num_pages=args.num_pages).items() if v is not None}
    llm = wise_jax.LLM(params, config, wise_config=WiseConfig() if args.wise else None, background_compile=False,
                       compilation_cache=None, **engine_args)
    kinds = dict(zip(KINDS, zip((llm.programs, llm.prefill_programs, llm.first_programs), llm.startup)))
    rows = []
    for kind in args.kinds.split(","):
        programs, keys = kinds[kind]
        for key in keys[:args.most or None]:
            start = time.perf_counter()
            with captured_stderr() as err:
                compiled = programs._compile(key)
            seconds = time.perf_counter() - start
            memory = compiled.memory_analysis()
            warnings = REMAT.findall(err[0])
            rows.append(dict(kind=kind, key=[str(k) for k in key[1:]], variant=str(key[0]), compile_s=round(seconds, 2),
                             argument_gib=memory.argument_size_in_bytes / 2**30,
                             alias_gib=memory.alias_size_in_bytes / 2**30, temp_gib=memory.temp_size_in_bytes / 2**30,
                             remat_warnings=len(warnings),
                             remat_limit_gib=float(warnings[0][0]) if warnings else None,
                             remat_estimate_gib=float(warnings[0][1]) if warnings else None))
            print(rows[-1], flush=True)
    stats = llm.stats()
    return dict(date=rp.now(), environment=rp.environment("jax"), preset=args.preset, dtype=args.dtype,
                wise=args.wise, xla_flags=os.environ.get("XLA_FLAGS", ""), engine_args=engine_args,
                pool_sizing=stats.pool_sizing, pool_gib=2 * llm.cache.k.nbytes / 2**30,
                device=str(jax.devices()[0]), programs=rows)


def render(data: dict) -> str:
    rows = data["programs"]
    lines = [f"# Memory of the JAX engine's start-up programs ({data['date']})", "",
             f"{data['device']}; {data['preset']} random weights, {data['dtype']}, "
             f"{'WISE' if data['wise'] else 'dense'}; engine arguments {data['engine_args'] or 'the defaults'}; "
             f"XLA_FLAGS {data['xla_flags'] or '(none)'}.", "",
             f"Pool: {data['pool_gib']:.2f} GiB ({data['pool_sizing']}).", "",
             "Per program: compile seconds; XLA's memory analysis (arguments, of them aliased to outputs, "
             "temporaries); XLA's rematerialization warnings while compiling it (its limit and its estimate).", ""]
    lines += rp.table(["kind", "bucket", "variant", "compile s", "arguments GiB", "aliased GiB", "temporaries GiB",
                       "remat warnings", "limit GiB", "estimate GiB"],
                      [[r["kind"], " x ".join(r["key"]), r["variant"], rp.fmt(r["compile_s"]),
                        rp.fmt(r["argument_gib"], ".2f"), rp.fmt(r["alias_gib"], ".2f"), rp.fmt(r["temp_gib"], ".3f"),
                        r["remat_warnings"], rp.fmt(r["remat_limit_gib"], ".2f"), rp.fmt(r["remat_estimate_gib"], ".2f")]
                       for r in rows])
    if rows:
        worst = max(rows, key=lambda r: r["temp_gib"])
        lines += ["", f"Largest temporaries: {worst['temp_gib']:.3f} GiB ({worst['kind']} "
                      f"{' x '.join(worst['key'])}); programs that warned: "
                      f"{sum(r['remat_warnings'] > 0 for r in rows)} of {len(rows)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from {KINDS}")
    if args.xla_flags:
        if "jax" in sys.modules:
            parser.error("--xla-flags must be set before jax is imported: run this module in a process of its own")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    data = measure(args)
    text = rp.write_report(args.out, "program_memory", data, render(data))
    print(text)
    return data


if __name__ == "__main__":
    main()
