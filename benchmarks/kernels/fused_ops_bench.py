"""The fused decode-path kernels of wise_torch.layers against the eager torch chains they replace.

    python -m benchmarks.kernels.fused_ops_bench --out DIR            # on an H200: Ouro-1.4B shape, bf16
    python -m benchmarks.kernels.fused_ops_bench --smoke --out DIR    # CPU: Triton interpreter, tiny shapes

Per op and token count (1, 10, 20, 64 by default): microseconds per call of the fused Triton op
and of the torch chain of today's model (wise_torch.model's ops, op for op), each captured in a
CUDA graph of `--reps` calls and replayed `--replays` times after warm-up (the smoke run times
eager calls), the CUDA kernels per call (torch profiler), the fused op's bytes moved / time, and
the check of the fused output against the chain (bitwise or its largest difference in ulp).
Ops (Ouro-1.4B: hidden 2048, intermediate 5632, 16 heads x 128, pages of 128):
- rms_norm: HF RMSNorm;
- add_rms_norm: `h = residual + norm_2(x)`, `normed = next_norm(h)` (after attention and MLP);
- add_rms_norm+final: the same with `model.norm` between (a loop's last layer);
- rope_store_kv: split-half RoPE of q and k from a fused qkv (cos/sin per token precomputed for
  the chain, as the model does once per step), k and v written to a paged plane;
- silu_mul: `silu(gate) * up` of a fused gate/up projection.
The per-step estimate counts one decode step of Ouro-1.4B (24 layers x 4 loops = 96 planes): per
plane 1 rope_store_kv, 1 silu_mul, 2 add_rms_norm (one of them +final at each loop's last
layer), plus 1 rms_norm. Writes fused_ops_bench.json and fused_ops_bench.md to --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import report as rp

OURO = dict(hidden=2048, inter=5632, heads=16, kv_heads=16, head_dim=128, page_size=128, layers=24, loops=4)
SMOKE = dict(hidden=128, inter=256, heads=2, kv_heads=2, head_dim=64, page_size=32, layers=2, loops=4)
BATCHES = (1, 10, 20, 64)
SMOKE_BATCHES = (1, 3)
EPS = 1e-6
THETA = 1e6
OPS = ("rms_norm", "add_rms_norm", "add_rms_norm+final", "rope_store_kv", "silu_mul")


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be positive")
    return values


# -- the eager chains of today's model ------------------------------------------------------------------
def chain_rms_norm(x, weight):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def chain_apply_rope(x, cos, sin):
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


class Inputs:
    """Random inputs of one token count at one shape; K/V planes with scattered, unordered slots."""

    def __init__(self, shape: dict, n: int, dtype: torch.dtype, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed + n)
        s = self.shape = shape
        hidden, head_dim = s["hidden"], s["head_dim"]

        def randn(*size, scale=1.0):
            return (scale * torch.randn(*size, generator=g)).to(device=device, dtype=dtype)

        self.n = n
        self.x, self.residual = randn(n, hidden, scale=2), randn(n, hidden, scale=8)
        self.post, self.next, self.final = (randn(hidden, scale=0.3) + 1 for _ in range(3))
        self.qkv = randn(n, (s["heads"] + 2 * s["kv_heads"]) * head_dim, scale=2)
        self.gate_up = randn(n, 2 * s["inter"], scale=3)
        num_pages = n // s["page_size"] + 4
        self.positions = torch.randint(0, 8192, (n,), generator=g).to(device)
        self.slots = torch.randperm(num_pages * s["page_size"], generator=g)[:n].to(device)
        self.k_plane = randn(num_pages, s["page_size"], s["kv_heads"], head_dim)
        self.v_plane = randn(num_pages, s["page_size"], s["kv_heads"], head_dim)
        from wise_torch.layers import rope_table
        self.table = rope_table(8192, head_dim, THETA, device=device)
        cos, sin = self.table[self.positions].chunk(2, dim=-1)  # the model's per-step cos/sin
        self.cos, self.sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    def bytes_moved(self, op: str) -> int:
        """Bytes the fused op reads and writes (weights once)."""
        s, e = self.shape, self.x.element_size()
        n, hidden, head_dim = self.n, s["hidden"], s["head_dim"]
        if op == "rms_norm":
            return (2 * n + 1) * hidden * e
        if op.startswith("add_rms_norm"):
            weights = 3 if op.endswith("final") else 2
            return (4 * n + weights) * hidden * e
        if op == "rope_store_kv":
            qkv = (s["heads"] + 2 * s["kv_heads"]) * head_dim
            return n * (2 * qkv * e + head_dim * 4 + 16)  # read qkv, write q k v, cos/sin rows, position + slot
        return 3 * n * s["inter"] * e  # silu_mul

    def fused(self, op: str):
        from wise_torch import layers as L
        s = self.shape
        rope = dict(heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"], impl="triton")
        return {
            "rms_norm": lambda: L.rms_norm(self.x, self.post, EPS, impl="triton"),
            "add_rms_norm": lambda: L.add_rms_norm(self.x, self.residual, self.post, self.next, EPS, impl="triton"),
            "add_rms_norm+final": lambda: L.add_rms_norm(self.x, self.residual, self.post, self.next, EPS,
                                                         self.final, impl="triton"),
            "rope_store_kv": lambda: L.rope_store_kv(self.qkv, self.positions, self.table, self.k_plane,
                                                     self.v_plane, self.slots, **rope),
            "silu_mul": lambda: L.silu_mul(self.gate_up, impl="triton"),
        }[op]

    def chain(self, op: str):
        s = self.shape
        n, heads, kv_heads, head_dim = self.n, s["heads"], s["kv_heads"], s["head_dim"]
        inter = s["inter"]

        def add_norm(final):
            h = self.residual + chain_rms_norm(self.x, self.post)
            if final:
                h = chain_rms_norm(h, self.final)
            return h, chain_rms_norm(h, self.next)

        def rope():
            q, k, v = self.qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
            q = chain_apply_rope(q.view(n, heads, head_dim), self.cos, self.sin)
            k = chain_apply_rope(k.view(n, kv_heads, head_dim), self.cos, self.sin)
            self.k_plane.view(-1, kv_heads, head_dim).index_copy_(0, self.slots, k)
            self.v_plane.view(-1, kv_heads, head_dim).index_copy_(0, self.slots, v.view(n, kv_heads, head_dim))
            return q

        return {
            "rms_norm": lambda: chain_rms_norm(self.x, self.post),
            "add_rms_norm": lambda: add_norm(False),
            "add_rms_norm+final": lambda: add_norm(True),
            "rope_store_kv": rope,
            "silu_mul": lambda: F.silu(self.gate_up[:, :inter]) * self.gate_up[:, inter:],
        }[op]


def _flat(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def max_ulp(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of want's dtype spacing at |want|."""
    a = want.abs()
    spacing = (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).float()
    return float(((got.float() - want.float()).abs() / spacing).max()) if want.numel() else 0.0


def check(inputs: Inputs, op: str) -> dict:
    """The fused op against the chain on the same inputs (planes compared after both wrote them)."""
    planes = inputs.k_plane.clone(), inputs.v_plane.clone()
    want = _flat(inputs.chain(op)())
    chain_planes = inputs.k_plane.clone(), inputs.v_plane.clone()
    inputs.k_plane.copy_(planes[0])
    inputs.v_plane.copy_(planes[1])
    got = _flat(inputs.fused(op)())
    if op == "rope_store_kv":
        got += [inputs.k_plane, inputs.v_plane]
        want += list(chain_planes)
    bitwise = all(torch.equal(g, w) for g, w in zip(got, want))
    return dict(bitwise=bitwise, max_ulp=max(max_ulp(g, w) for g, w in zip(got, want)))


def count_kernels(fn) -> int | None:
    """CUDA kernels one call launches (torch profiler), None where the profiler is unavailable."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower())
    except Exception:  # a profiler failure loses the count, not the timing
        traceback.print_exc()
        return None


def per_step(rows: list[dict], shape: dict) -> list[dict]:
    """Per token count: the fused ops' and the chains' time in one decode step of the model."""
    planes = shape["layers"] * shape["loops"]
    counts = {"rms_norm": 1, "add_rms_norm": 2 * planes - shape["loops"], "add_rms_norm+final": shape["loops"],
              "rope_store_kv": planes, "silu_mul": planes}
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        here = {r["op"]: r for r in rows if r["tokens"] == n and "error" not in r}
        if set(here) != set(counts):
            continue
        fused = sum(here[op]["fused_us"] * c for op, c in counts.items()) / 1e3
        chain = sum(here[op]["chain_us"] * c for op, c in counts.items()) / 1e3
        kernels = {k: None if any(here[op][f"{k}_kernels"] is None for op in counts)
                   else sum(here[op][f"{k}_kernels"] * c for op, c in counts.items()) for k in ("fused", "chain")}
        out.append(dict(tokens=n, fused_ms=fused, chain_ms=chain, saved_ms=chain - fused,
                        fused_kernels=kernels["fused"], chain_kernels=kernels["chain"]))
    return out


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Fused decode-path ops ({report['date']})", "",
             f"{env['device']}; torch {env['torch']}, triton {env['triton']}; {report['dtype']}; shape "
             f"{report['shape']}; timing: {report['timing']}.", "",
             "| op | tokens | torch chain us | fused us | speedup | fused GB/s | kernels chain / fused | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['tokens']} | | | | | | error: {r['error']} |")
            continue
        kernels = f"{r['chain_kernels']} / {r['fused_kernels']}" if r["chain_kernels"] is not None else "n/a"
        verdict = "bitwise" if r["check"]["bitwise"] else f"max {r['check']['max_ulp']:.0f} ulp"
        lines.append(f"| {r['op']} | {r['tokens']} | {r['chain_us']:.1f} | {r['fused_us']:.1f} | "
                     f"{r['chain_us'] / r['fused_us']:.2f}x | {r['fused_gbps']:.0f} | {kernels} | {verdict} |")
    if report["per_step"]:
        lines += ["", "## One decode step of the model (these ops only)", "",
                  "| tokens | torch chains ms | fused ms | saved ms | kernels chain / fused |", "|---|---|---|---|---|"]
        for s in report["per_step"]:
            kernels = "n/a" if s["chain_kernels"] is None else f"{s['chain_kernels']} / {s['fused_kernels']}"
            lines.append(f"| {s['tokens']} | {s['chain_ms']:.2f} | {s['fused_ms']:.2f} | {s['saved_ms']:.2f} | "
                         f"{kernels} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=rp.RESULTS, help="directory for the JSON and markdown")
    parser.add_argument("--batches", type=parse_ints, default=None, help="token counts (default 1,10,20,64)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=50, help="graph replays timed")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Triton interpreter, eager timing")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("without a CUDA GPU only --smoke runs (the Triton kernels need CUDA or the interpreter)")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before wise_torch.kernels.fused is imported
    from benchmarks.kernels.kernel_bench import Timer

    shape = SMOKE if args.smoke else OURO
    batches = args.batches or (SMOKE_BATCHES if args.smoke else BATCHES)
    dtype = getattr(torch, args.dtype)
    timer = Timer(device, reps=args.reps, replays=args.replays)
    report = dict(
        date=rp.now(), host=platform.node(), dtype=args.dtype,
        shape=shape, timing="CUDA-graph replay" if device == "cuda" else "eager (CPU smoke)",
        environment=rp.environment("torch"), rows=[])
    print(f"{'op':>20} {'tokens':>6} {'chain us':>9} {'fused us':>9} {'speedup':>8} {'check':>10}")
    with torch.inference_mode():
        for n in batches:
            inputs = Inputs(shape, n, dtype, device)
            for op in OPS:
                row = dict(op=op, tokens=n)
                try:
                    row["check"] = check(inputs, op)
                    row["chain_us"], row["chain_timing"] = timer(inputs.chain(op))
                    row["fused_us"], row["fused_timing"] = timer(inputs.fused(op))
                    row["fused_gbps"] = inputs.bytes_moved(op) / (row["fused_us"] * 1e3)
                    row["chain_kernels"] = count_kernels(inputs.chain(op))
                    row["fused_kernels"] = count_kernels(inputs.fused(op))
                    verdict = "bitwise" if row["check"]["bitwise"] else f"{row['check']['max_ulp']:.0f} ulp"
                    print(f"{op:>20} {n:>6} {row['chain_us']:>9.1f} {row['fused_us']:>9.1f} "
                          f"{row['chain_us'] / row['fused_us']:>7.2f}x {verdict:>10}", flush=True)
                except Exception as e:  # one failed case must not stop the run
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                report["rows"].append(row)
    report["per_step"] = per_step(report["rows"], shape)
    print(rp.write_report(args.out, "fused_ops_bench", report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
