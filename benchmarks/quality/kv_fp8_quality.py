"""The fp8 K/V cache's cost in quality (issue 50): held-out text through the engine with
`kv_cache_dtype="fp8"` against the model's dtype ("auto"), dense and WISE.

    python -m benchmarks.quality.kv_fp8_quality [--model ouro-py-3m] [--backend torch] [--n-contexts 64] --out DIR
    python -m benchmarks.quality.kv_fp8_quality --smoke --out /tmp/q      # 3 short contexts: a check

Contexts of `--min-context`..`--max-context` tokens cut at seeded offsets from the held-out stdlib
files (`stdlib_corpus`, the model's tokenizer), each followed by `--continuation` held-out
tokens. Four arms, each one engine (`LLM(model, kv_cache_dtype=..., wise_config=...)` of the
chosen framework, its attention_backend "auto": the reference on CPU and for every fp8 arm) that
teacher-forces every continuation (`wise_core.generation.run_forced`) and then decodes `--greedy`
tokens greedily from every context (eos ignored): dense and WISE (`--eta`), each with the K/V
cache in the model's dtype and in fp8. Per arm:
- bits per byte of the continuations (their NLL in bits over their UTF-8 bytes, pooled) with a
  bootstrap 95 % interval over contexts (`wise_core.evaluation.Arm.bits_per_byte`);
- the change in bits per byte against the same decode in the model's dtype and against dense in
  the model's dtype, paired bootstrap 95 % intervals over contexts (`ratio_bootstrap` of the
  per-context bit differences over the bytes);
- greedy tokens changed against the same decode in the model's dtype: the share of positions
  whose token differs, the share past the position where the two greedy decodes part (1 - the
  common prefix over the tokens decoded), and the share of contexts whose tokens are all equal;
- WISE's support density per reuse depth (selected over causal blocks, over the engine's WISE
  decode steps, forced and greedy) and its dense fallbacks, with and without fp8: whether
  quantization moves the selection.

Huginn is not covered: its engines refuse kv_cache_dtype="fp8" and its numpy reference
(`wise_core.huginn_reference.HuginnCache`) has no fp8 cache, unlike Ouro's
(`wise_core.ouro_reference.OuroCache(kv_quant=True)`).

Writes kv_fp8_quality.json (every per-context value, settings, machine, versions, date) and
kv_fp8_quality.md into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks import report as rp
from benchmarks.quality import stdlib_corpus
from wise_core.checkpoint import TRAINED_MODEL
from wise_core.evaluation import Arm, interval, ratio_bootstrap
from wise_core.generation import run_forced
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig

ARMS = (("dense", "auto"), ("dense", "fp8"), ("wise", "auto"), ("wise", "fp8"))   # (decode, kv_cache_dtype)


def load(backend: str, model: str, dtype: str):
    """(make_llm(**engine_args) -> the framework's LLM over the loaded model, config, tokenizer,
    dtype name, device description). dtype "auto": bfloat16 on a GPU, float32 otherwise."""
    if backend == "torch":
        import torch
        import wise_torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        loaded = wise_torch.load_model(model, dtype=getattr(torch, dtype), device=device)
        where = f"{device} ({torch.cuda.get_device_name() if device == 'cuda' else platform.machine()})"
        return (lambda **kw: wise_torch.LLM(loaded, **kw)), loaded.config, loaded.tokenizer, dtype, where
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        import wise_jax
        dtype = dtype if dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
        config, params = wise_jax.load_model(model, dtype=getattr(jnp, dtype))
        where = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
        return ((lambda **kw: wise_jax.LLM(params, config, **kw)), config, wise_jax.load_tokenizer(model), dtype,
                where)
    raise ValueError(f"unknown backend {backend!r} (torch or jax)")


def heldout_pairs(config, tokenizer, args) -> list[tuple[list[int], list[int]]]:
    """Seeded (context, continuation) pairs from the held-out stdlib files, in the model's tokens."""
    if tokenizer is None:
        raise SystemExit("the model has no tokenizer; the held-out text needs one")
    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    separator = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
    stream = stdlib_corpus.token_stream(held, tokenizer=tokenizer, separator=separator)
    return stdlib_corpus.sample_contexts(stream, args.n_contexts, args.min_context, args.max_context,
                                         args.continuation, seed=args.seed)


def run_arm(make_llm, pairs, wise_config: WiseConfig | None, kv_cache_dtype: str, args) -> dict:
    """One arm on every pair: {"logprobs": per context float64[continuation], "greedy": per
    context the greedy tokens, "density", "fallbacks" (the engine's, over its WISE decode steps;
    None when dense), "seconds"}."""
    longest = max(len(c) + max(len(f), args.greedy) for c, f in pairs)
    page_size = 32
    llm = make_llm(wise_config=wise_config, kv_cache_dtype=kv_cache_dtype, attention_backend="auto",
                   num_pages=args.batch * -(-longest // page_size), page_size=page_size, max_num_seqs=args.batch,
                   max_model_len=longest, seed=args.seed)
    start = time.perf_counter()
    forced = run_forced(llm, [c for c, _ in pairs], [f for _, f in pairs])
    ids = [llm.add_request(c, SamplingParams(max_tokens=args.greedy, ignore_eos=True)) for c, _ in pairs]
    greedy = {o.request_id: list(o.token_ids) for o in llm.run_until_done(ids)}
    stats = llm.stats()
    if stats.preemptions:
        raise RuntimeError(f"the arm's pool preempted {stats.preemptions} requests: size it for --batch")
    return {"logprobs": [np.asarray(o.logprobs, np.float64) for o in forced], "greedy": [greedy[i] for i in ids],
            "density": None if stats.density is None else {int(d): v for d, v in stats.density.items()},
            "fallbacks": stats.fallbacks, "seconds": time.perf_counter() - start}


def bpb_change(arm: Arm, base: Arm) -> dict:
    """Bits per byte of `arm` minus `base`'s on the same contexts, paired bootstrap 95 % interval."""
    return interval(ratio_bootstrap(arm.bits - base.bits, arm.continuation_bytes, seed=arm.seed))


def greedy_change(arm: Arm, base: Arm) -> dict:
    """Greedy tokens of `arm` against `base`'s: positions changed, positions past the parting
    point, contexts all equal (shares)."""
    against = dataclasses.replace(arm, dense=base)
    prefix = against.prefix_agreement
    return {"tokens_changed": against.tokens_changed, "past_parting": float(1 - prefix.mean()),
            "all_equal": float(np.mean(prefix == 1.0))}


def evaluate(make_llm, config, tokenizer, args, progress=print) -> dict:
    """Every arm of ARMS on the held-out pairs -> the report's data (module docstring)."""
    pairs = heldout_pairs(config, tokenizer, args)
    byte_counts = np.array([len(tokenizer.decode(f).encode("utf-8")) for _, f in pairs])
    arms, runs = {}, {}
    for decode, kv in ARMS:
        wise_config = None if decode == "dense" else WiseConfig(eta=args.eta)
        run = run_arm(make_llm, pairs, wise_config, kv, args)
        runs[decode, kv] = run
        arms[decode, kv] = Arm(wise_config, run["logprobs"], byte_counts, run["greedy"], run["density"],
                               run["fallbacks"], seed=args.seed)
        bpb = arms[decode, kv].bits_per_byte["mean"]
        progress(f"{decode} {kv}: {run['seconds']:.0f} s, bits per byte {bpb:.4f}", flush=True)
    rows = []
    for decode, kv in ARMS:
        arm, same, dense = arms[decode, kv], arms[decode, "auto"], arms["dense", "auto"]
        rows.append({"decode": decode, "kv_cache_dtype": kv, "bits_per_byte": arm.bits_per_byte,
                     "change_against_model_dtype": None if kv == "auto" else bpb_change(arm, same),
                     "change_against_dense": None if (decode, kv) == ("dense", "auto") else bpb_change(arm, dense),
                     "greedy_against_model_dtype": None if kv == "auto" else greedy_change(arm, same),
                     "density": None if arm.density is None else {str(d): v for d, v in arm.density.items()},
                     "fallbacks": arm.fallbacks, "seconds": round(runs[decode, kv]["seconds"], 1),
                     "per_context": {"bits": arm.bits.tolist(), "greedy": arm.greedy}})
    return {"rows": rows, "contexts": {"n": len(pairs), "lengths": [len(c) for c, _ in pairs],
                                       "continuation_bytes": byte_counts.tolist(),
                                       "continuation": args.continuation, "greedy": args.greedy}}


def _ci(x: dict | None, spec: str = "+.4f") -> str:
    return "" if x is None else f"{x['mean']:{spec}} [{x['low']:{spec}}, {x['high']:{spec}}]"


def markdown(result: dict) -> str:
    depths = sorted({d for row in result["rows"] if row["density"] for d in row["density"]}, key=int)
    head = ["decode", "K/V cache", "bits per byte [95 % CI]", "change against the model's dtype [95 % CI]",
            "change against dense, model's dtype [95 % CI]", "greedy tokens changed / past parting / contexts equal"]
    head += [f"density depth {d}" for d in depths] + ["fallbacks"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        g = row["greedy_against_model_dtype"]
        greedy = "" if g is None else (f"{100 * g['tokens_changed']:.1f} % / {100 * g['past_parting']:.1f} % / "
                                       f"{100 * g['all_equal']:.0f} %")
        density = [f"{row['density'][d]:.3f}" if row["density"] and row["density"].get(d) is not None else ""
                   for d in depths]
        kv = result["dtype"] if row["kv_cache_dtype"] == "auto" else "fp8"
        fallbacks = "" if row["fallbacks"] is None else str(row["fallbacks"])
        lines.append("| " + " | ".join([row["decode"], kv, _ci(row["bits_per_byte"], ".4f"),
                                        _ci(row["change_against_model_dtype"]), _ci(row["change_against_dense"]),
                                        greedy] + density + [fallbacks]) + " |")
    c = result["contexts"]
    lines += ["", f"{c['n']} held-out contexts of {min(c['lengths'])}-{max(c['lengths'])} tokens; "
                  f"{c['continuation']} teacher-forced tokens ({sum(c['continuation_bytes'])} bytes) and "
                  f"{c['greedy']} greedy tokens each; WISE eta {result['args']['eta']:g}."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=TRAINED_MODEL, help="checkpoint directory or built-in model name")
    ap.add_argument("--backend", choices=("torch", "jax"), default="torch")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the model's: auto is bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--eta", type=float, default=0.95)
    ap.add_argument("--n-contexts", type=int, default=64)
    ap.add_argument("--min-context", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens per context")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens per context")
    ap.add_argument("--batch", type=int, default=16, help="requests an engine runs at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="3 contexts of 64-96 tokens, 8 forced and 8 greedy tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n_contexts, args.min_context, args.max_context, args.continuation, args.greedy = 3, 64, 96, 8, 8
    for name in ("n_contexts", "min_context", "continuation", "greedy", "batch"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_context < args.min_context:
        ap.error("--max-context must be at least --min-context")
    WiseConfig(eta=args.eta)      # checks eta
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    make_llm, config, tokenizer, dtype, device = load(args.backend, args.model, args.dtype)
    result = evaluate(make_llm, config, tokenizer, args)
    result.update({"model": str(args.model), "backend": args.backend, "dtype": dtype, "device": device,
                   "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "environment": rp.environment(args.backend), "date": rp.now(),
                   "total_s": round(time.perf_counter() - started, 1)})
    header = (f"# fp8 K/V cache against the model's dtype: held-out text, model {args.model}\n\n"
              f"{device}, backend {args.backend}, model dtype {dtype}, {result['date']}\n\n")
    args.out.mkdir(parents=True, exist_ok=True)
    text = rp.write_report(args.out, "kv_fp8_quality", result, header + markdown(result))
    print(text, end="")
    return result


if __name__ == "__main__":
    main()
