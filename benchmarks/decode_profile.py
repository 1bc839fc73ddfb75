"""Where a decode step's time goes: one CUDA-graph replay of the engine's decode step, profiled.

    python benchmarks/decode_profile.py --shapes 1024x64,1024x1 --q-scale 8 --out DIR     # on an H200

Random Ouro-1.4B-shape bf16 weights (drawn as benchmarks/throughput.py draws them), a cohort of
C requests of L prompt tokens prefilled in one step and decoded until the graph of the cohort's
bucket is captured; then one step is profiled (torch.profiler, CUDA activity) for dense and WISE.
Kernels are grouped: GEMM (cuBLAS), decode attention (split / finish), fused ops (wise_torch
layers), WISE bookkeeping and other elementwise work. Also the step's wall time on the host
(schedule, stage, replay, sample, read). Writes decode_profile.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent), str(_HERE)) if p not in sys.path]

import torch  # noqa: E402

import throughput  # noqa: E402
import wise_torch  # noqa: E402
from wise_core.config import PRESETS, WiseConfig  # noqa: E402

GROUPS = (("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce", "sm90_xmma", "cublas")),
          ("attention split", ("_split_kernel",)), ("attention finish", ("_finish_kernel",)),
          ("fused ops", ("_rms_norm", "_add_rms_norm", "_rope_store_kv", "_silu_mul")))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def profile(model, context: int, batch: int, wise: bool) -> dict:
    llm = wise_torch.LLM(model, wise_config=WiseConfig() if wise else None, page_size=128, max_num_seqs=batch,
                         num_pages=throughput.cohort_pages(context, batch, 16, 128) + 1,
                         max_model_len=context + 16, max_num_batched_tokens=context * batch)
    g = torch.Generator().manual_seed(context * 1000 + batch)
    for p in torch.randint(0, model.config.vocab_size, (batch, context), generator=g).tolist():
        llm.add_request(p, wise_torch.SamplingParams(max_tokens=16, ignore_eos=True))
    with torch.inference_mode():
        for _ in range(6):
            llm.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
        step_ms = 1e3 * (time.perf_counter() - start) / 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.step()
            torch.cuda.synchronize()
    groups: dict[str, dict] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA or not e.count:
            continue
        g = groups.setdefault(group_of(e.key), dict(us=0.0, kernels=0))
        g["us"] += e.self_device_time_total
        g["kernels"] += e.count
    density = llm.stats().density
    return dict(context=context, batch=batch, arm="wise" if wise else "dense", step_ms=step_ms,
                kernel_ms=sum(g["us"] for g in groups.values()) / 1e3,
                kernels=sum(g["kernels"] for g in groups.values()), density=density,
                groups={k: dict(ms=v["us"] / 1e3, kernels=v["kernels"]) for k, v in sorted(groups.items())})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=throughput.parse_shapes, default=throughput.parse_shapes("1024x64,1024x1"))
    p.add_argument("--q-scale", type=float, default=8.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    config = PRESETS["ouro-1.4b"]
    spec = dict(dtype="bfloat16", device="cuda", std=0.02, seed=0, q_scale=args.q_scale)
    model = throughput._random_model(spec, config)
    rows = [profile(model, c, b, wise) for c, b in args.shapes for wise in (False, True)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_profile.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, q_scale=args.q_scale, rows=rows), indent=2))
    names = sorted({k for r in rows for k in r["groups"]})
    lines = [f"# One decode step, profiled ({torch.cuda.get_device_name()}, torch {torch.__version__}, q_proj x "
             f"{args.q_scale:g})", "", "ms of kernel time per group (kernels); step ms = host wall time per step.", "",
             "| ctx x batch | arm | step ms | kernel ms | kernels | " + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    for r in rows:
        cells = [f"{r['groups'][n]['ms']:.2f} ({r['groups'][n]['kernels']})" if n in r["groups"] else "" for n in names]
        lines.append(f"| {r['context']} x {r['batch']} | {r['arm']} | {r['step_ms']:.2f} | {r['kernel_ms']:.2f} | "
                     f"{r['kernels']} | " + " | ".join(cells) + " |")
    (args.out / "decode_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
