"""Prefill throughput of the serving engine (wise_torch.LLM) by prefill attention: tokens/s and MFU.

    python3 -m benchmarks.engine.prefill_bench --out benchmarks/results/DIR                    # on an H200
    python3 -m benchmarks.engine.prefill_bench --preset test-tiny --dtype float32 --device cpu \\
        --shapes 64x3 --arms sdpa,reference,fa4 --budgets 32,whole --repeats 1 --out /tmp/pb   # CPU smoke

Method: a cohort of B requests of exactly L random prompt tokens (seeded per shape, the same for
every arm), max_tokens=1, added at once and stepped until every request has its token; the
time is the engine's prefill seconds (`stats().prefill_s`: host wall time around the
synchronised prefill calls) and the wall time of the whole loop. Each (shape, arm, budget)
builds a fresh engine (prefix caching off, a pool of exactly the cohort's pages, max_num_seqs
= B), runs one untimed warm-up cohort of other prompts (compiles FA4's kernels), then
--repeats timed cohorts; the best is reported, all are kept in the JSON.

Arms: the engine's prefill attention, set through `arms.torch_engine_with(prefill=ARM)` (the
attention plan's `prefill`; decode as attention_backend "auto" runs it): "sdpa": grouped SDPA
over K/V gathered from the pages, a dense mask for chunks after the first; "fa4": one
FlashAttention-4 varlen call per plane over the pages; "reference": that call in plain torch,
for CPU only. An arm that cannot run here
(fa4 without flash_attn.cute) gets a row saying why. Budgets: max_num_batched_tokens per step,
a number (2048: chunked prefill) or "whole" (max(8192, L): each prompt in one chunk).

MFU = model FLOPs / prefill_s / --peak-tflops (790 TFLOP/s, bf16 dense on an H200). Model FLOPs
per cohort: 2 x the matmul weights of a layer (qkv, o, gate/up, down) x layers x loops per
prompt token, 2 x hidden x vocab per prompt (the LM head at its last token), plus attention:
QK^T and PV, 4 x heads x head_dim per (query, key) pair, over the causal pairs L(L+1)/2 of each
prompt, every plane (the causal half, as FlashAttention's benchmarks count it). Each arm's
first tokens are compared with the first arm's ("same": how many requests agree). Writes
prefill_bench.json and prefill_bench.md to --out.
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine.arms import torch_engine_with
from benchmarks.engine.workload import random_model
from wise_core.presets import PRESETS

PEAK_TFLOPS = 790.0


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"1024x64,4096x20" -> [(1024, 64), (4096, 20)] (prompt length x requests)."""
    shapes = []
    for item in text.split(","):
        length, _, batch = item.partition("x")
        if not (length.isdigit() and batch.isdigit() and int(length) > 0 and int(batch) > 0):
            raise argparse.ArgumentTypeError(f"a shape is LENGTHxREQUESTS with positive integers, got {item!r}")
        shapes.append((int(length), int(batch)))
    return shapes


def parse_budgets(text: str) -> list[int | str]:
    budgets = []
    for item in text.split(","):
        if item != "whole" and not (item.isdigit() and int(item) > 0):
            raise argparse.ArgumentTypeError(f"a budget is a positive integer or 'whole', got {item!r}")
        budgets.append(item if item == "whole" else int(item))
    return budgets


def model_flops(config, length: int, batch: int) -> float:
    """FLOPs of prefilling `batch` prompts of `length` tokens (see the module docstring)."""
    c = config
    per_layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    planes = c.num_hidden_layers * c.num_loops
    linear = 2 * per_layer * planes * length
    attention = 4 * c.num_attention_heads * c.head_dim * length * (length + 1) // 2 * planes
    head = 2 * c.hidden_size * c.vocab_size
    return float(batch * (linear + attention + head))


def prompts_of(length: int, batch: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).tolist()


def run_cohort(llm, prompts: list[list[int]]) -> dict:
    """Prefill a cohort to its first tokens -> prefill_s, wall_s, steps, first tokens."""
    from wise_core.sampling_params import SamplingParams
    llm.reset_stats()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    first, steps = {}, 0
    while len(first) < len(ids):
        for out in llm.step():
            if out.token_ids:
                first.setdefault(out.request_id, out.token_ids[0])
        steps += 1
    wall = time.perf_counter() - start
    s = llm.stats()
    return dict(prefill_s=s.prefill_s, wall_s=wall, steps=steps, prompt_tokens=s.prompt_tokens,
                prefill_attention=s.prefill_attention, first_tokens=[first[i] for i in ids])


def measure(model, length: int, batch: int, arm: str, budget, *, page_size: int, repeats: int, seed: int) -> dict:
    """One (shape, arm, budget): a fresh engine, a warm-up cohort, `repeats` timed cohorts."""
    import torch
    tokens = max(8192, length) if budget == "whole" else budget
    pages = batch * -(-(length + 1) // page_size)
    llm = torch_engine_with(prefill=arm)(model, num_pages=pages, page_size=page_size, max_num_seqs=batch,
                                         max_model_len=length + 1, max_num_batched_tokens=tokens,
                                         enable_prefix_caching=False, cuda_graphs=False)
    try:
        vocab = model.config.vocab_size
        run_cohort(llm, prompts_of(length, batch, vocab, seed + 1))
        runs = [run_cohort(llm, prompts_of(length, batch, vocab, seed)) for _ in range(repeats)]
    finally:
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return dict(runs=runs, max_num_batched_tokens=tokens)


def row_of(config, length, batch, arm, budget, result, peak_tflops) -> dict:
    row = dict(length=length, batch=batch, arm=arm, budget=budget)
    if "error" in result:
        return {**row, "error": result["error"]}
    best = min(result["runs"], key=lambda r: r["prefill_s"])
    flops = model_flops(config, length, batch)
    return {**row, "max_num_batched_tokens": result["max_num_batched_tokens"], "ran": best["prefill_attention"],
            "prefill_s": best["prefill_s"], "wall_s": best["wall_s"], "steps": best["steps"],
            "tokens_per_s": length * batch / best["prefill_s"],
            "mfu": flops / best["prefill_s"] / (peak_tflops * 1e12), "model_tflop": flops / 1e12,
            "first_tokens": best["first_tokens"], "runs": result["runs"]}


def markdown(report: dict) -> str:
    a, env = report["args"], report["environment"]
    lines = [f"# Prefill throughput by prefill attention ({report['date']})", "",
             f"{env['device']}; torch {env['torch']}; flash-attn-4 {env['flash_attn_4']}; python {env['python']}. "
             f"Model {a['preset']} (random weights, {a['dtype']}), page size {a['page_size']}; best of "
             f"{a['repeats']} after a warm-up cohort; MFU at {a['peak_tflops']:g} TFLOP/s, attention FLOPs counted "
             f"(causal half).", "",
             "| L x B | arm | budget | ran | prefill s | tokens/s | MFU | steps | same first tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        shape = f"{r['length']} x {r['batch']}"
        if "error" in r:
            lines.append(f"| {shape} | {r['arm']} | {r['budget']} | — | {r['error'][:120]} | | | | |")
            continue
        lines.append(f"| {shape} | {r['arm']} | {r['budget']} | {r['ran']} | {r['prefill_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | {r['steps']} | {r.get('same', '')} |")
    ratios = chunked_over_whole(report["rows"])
    if ratios:
        lines += ["", "Chunked prefill against whole prompts (tokens/s of the chunked budget / whole):", "",
                  "| L x B | arm | budget | chunked / whole |", "|---|---|---|---|"]
        lines += [f"| {length} x {batch} | {arm} | {budget} | {ratio:.3f} |"
                  for (length, batch, arm, budget), ratio in ratios.items()]
    return "\n".join(lines) + "\n"


def chunked_over_whole(rows: list[dict]) -> dict:
    """(L, B, arm, budget) -> tokens/s at that numeric budget over tokens/s at 'whole'."""
    key = lambda r: (r["length"], r["batch"], r["arm"])  # noqa: E731
    whole = {key(r): r["tokens_per_s"] for r in rows if r["budget"] == "whole" and "error" not in r}
    return {(*key(r), r["budget"]): r["tokens_per_s"] / whole[key(r)]
            for r in rows if r["budget"] != "whole" and "error" not in r and key(r) in whole}


def environment() -> dict:
    """`benchmarks.report.environment` and the installed flash-attn-4 version."""
    return dict(rp.environment("torch"), flash_attn_4=rp.version("flash-attn-4") or "not installed")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,4096x20,8192x10,32768x2"))
    p.add_argument("--arms", default="sdpa,fa4", help="prefill attentions (sdpa, fa4, reference), comma-separated")
    p.add_argument("--budgets", type=parse_budgets, default=parse_budgets("2048,whole"))
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    model = random_model(dict(dtype=args.dtype, device=args.device, std=args.std, seed=args.seed, q_scale=1.0),
                         PRESETS[args.preset])
    rows = []
    for length, batch in args.shapes:
        for budget in args.budgets:
            first = None
            for arm in arms:
                try:
                    result = measure(model, length, batch, arm, budget, page_size=args.page_size,
                                     repeats=args.repeats, seed=args.seed + length)
                except Exception as e:  # noqa: BLE001 -- an arm that cannot run (or runs out of memory) is a row
                    result = {"error": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
                row = row_of(model.config, length, batch, arm, budget, result, args.peak_tflops)
                if "error" not in row:
                    first = first or row["first_tokens"]
                    row["same"] = f"{sum(a == b for a, b in zip(row['first_tokens'], first))}/{batch}"
                rows.append(row)
                print({k: v for k, v in row.items() if k not in ("first_tokens", "runs")}, flush=True)
    report = dict(date=rp.now(), environment=environment(),
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, rows=rows)
    rp.write_report(args.out, "prefill_bench", report, markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
