"""The decode projections at a few rows: cuBLAS (`F.linear`) against a Triton skinny kernel
(`gemv`, below) over a sweep of launches, as a share of HBM bandwidth.

    python -m benchmarks.kernels.gemv_bench --out DIR          # on an H200

The kernel: program p of the grid [cdiv(n, block_n)] owns output columns [p * block_n, (p + 1) *
block_n) of every row (at most MAX_ROWS); it walks k in `block_k` tiles, loading a [block_n,
block_k] tile of w (contiguous in k) and the rows' [16, block_k] slice of x (rows padded to 16
for the tensor-core dot, masked to zero), accumulates x w^T in float32 and rounds once. No split
over k: a row's result never depends on the other rows.

Shapes: Ouro-1.4B's qkv, o, gate_up, down projections and the LM head, bf16, at m = 1, 2, 4, 8
rows. A call's time is the replay time of a CUDA graph of `--chain` calls, each on its own weight
tensor (so no call finds its weights in L2), divided by the calls; GB/s counts the weight bytes.
Per shape the sweep's best launch at m = 1 and m = 8, and what one decode step's projections
(24 layers x 4 loops + the LM head) would take with each. Writes gemv_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks import report as rp

MAX_ROWS = 8   # the most rows a call takes


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch shape: output columns and k per tile, warps, pipeline stages."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"GemvConfig needs block_n, block_k >= 16 (tensor-core dots), got {self}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


DEFAULT = GemvConfig()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = cols < n
    row_ok = rows < m
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)                     # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                     # [M_PAD, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes this call: 2-D x of 1..MAX_ROWS rows and w of one dtype on one
    device, both contiguous in k."""
    return (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype and x.device == weight.device and x.stride(1) == 1 and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
         config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x: [m, k] (m <= MAX_ROWS), weight: [n, k] -> x @ weight^T [m, n] in x's dtype (float32
    accumulation, one rounding), into `out` when given ([m, n], contiguous in n)."""
    if not supports(x, weight):
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, k] and weight [n, k] of one dtype and device, contiguous "
                         f"in k; got x {tuple(x.shape)} {x.dtype} {x.device}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} {weight.device}")
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] of {x.dtype}, contiguous in n; got {tuple(out.shape)} {out.dtype}")
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M_PAD=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


HBM = 4.3e12
SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}
PER_STEP = {"qkv": 96, "o": 96, "gate_up": 96, "down": 96, "lm_head": 1}
CONFIGS = [GemvConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, (w, s) in itertools.product((16, 32, 64), (256, 512), ((4, 3), (4, 4), (8, 4)))]


def time_chain(fn, chain: int, replays: int = 20) -> float:
    """us per call of fn(i) for i in range(chain), replayed as one CUDA graph."""
    for i in range(chain):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(chain):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * chain)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    rows_out = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.chain)]
        gbytes = n * k * 2
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(args.chain)]
            arms = [("cublas", None, lambda i: torch.matmul(x, weights[i].T, out=outs[i]))]
            if m == 1:
                arms.append(("cublas-mv", None, lambda i: torch.mv(weights[i], x[0], out=outs[i][0])))
            sweep = CONFIGS if m in (rows_list[0], rows_list[-1]) else []
            arms += [("triton", c, (lambda c: lambda i: gemv(x, weights[i], outs[i], config=c))(c)) for c in sweep]
            if not sweep:
                arms.append(("triton", GemvConfig(), lambda i: gemv(x, weights[i], outs[i])))
            want = F.linear(x.float(), weights[0].float())
            for impl, config, fn in arms:
                try:
                    fn(0)
                    err = ((outs[0].float() - want).abs().max() / want.abs().max()).item()
                    us = time_chain(fn, args.chain)
                    row = dict(shape=name, n=n, k=k, m=m, impl=impl, config=None if config is None else vars(config),
                               us=us, gbps=gbytes / us / 1e3, share=gbytes / (us * 1e-6) / HBM, max_rel_err=err)
                except Exception as e:  # a launch that does not compile is a row, not a stop
                    row = dict(shape=name, n=n, k=k, m=m, impl=impl, config=None if config is None else vars(config),
                               error=f"{type(e).__name__}: {e}"[:300])
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    report = dict(date=rp.now(), environment=rp.environment("torch"), rows=rows_out)
    rp.write_report(args.out, "gemv_bench", report, markdown(report, rows_list))
    return report


def markdown(report: dict, rows_list: list[int]) -> str:
    ok = [r for r in report["rows"] if "us" in r]
    env = report["environment"]
    out = [f"# Decode projections at few rows ({report['date']})", "", f"torch {env['torch']}; {env['device']}", "",
           "us per call (share of 4.3 TB/s); triton: the sweep's best launch (block_n, block_k, warps, stages).", "",
           "| shape | m | cuBLAS | cuBLAS mv | triton best | launch | triton / cuBLAS |", "|---|---|---|---|---|---|---|"]
    step = {impl: {m: 0.0 for m in rows_list} for impl in ("cublas", "triton")}
    for name in SHAPES:
        for m in rows_list:
            here = [r for r in ok if r["shape"] == name and r["m"] == m]
            cub = next((r for r in here if r["impl"] == "cublas"), None)
            mv = next((r for r in here if r["impl"] == "cublas-mv"), None)
            tri = min((r for r in here if r["impl"] == "triton"), key=lambda r: r["us"], default=None)
            if cub is None or tri is None:
                continue
            c = tri["config"]
            out.append(f"| {name} | {m} | {cub['us']:.1f} ({cub['share']:.0%}) | "
                       + (f"{mv['us']:.1f} ({mv['share']:.0%})" if mv else "") +
                       f" | {tri['us']:.1f} ({tri['share']:.0%}) | {c['block_n']}, {c['block_k']}, {c['num_warps']}, "
                       f"{c['num_stages']} | {tri['us'] / cub['us']:.3f} |")
            step["cublas"][m] += PER_STEP[name] * cub["us"] / 1e3
            step["triton"][m] += PER_STEP[name] * tri["us"] / 1e3
    out += ["", "One decode step's projections (96 of each layer projection + the LM head), ms:", "",
            "| m | cuBLAS | triton best per shape |", "|---|---|---|"]
    out += [f"| {m} | {step['cublas'][m]:.3f} | {step['triton'][m]:.3f} |" for m in rows_list]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
