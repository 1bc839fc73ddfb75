"""Decode-attention benchmark: the Triton WISE kernel per mode against cuDNN SDPA and FlashAttention-4.

    python -m benchmarks.kernels.kernel_bench                       # on an H200: Ouro-1.4B attention
    python -m benchmarks.kernels.kernel_bench --smoke --out DIR     # CPU: Triton interpreter, tiny shapes

Ouro-1.4B attention: 16 heads x head_dim 128, bf16, pages of 128 keys scattered over the pool,
every row at seq_len = ctx; (ctx, batch) = 1K x 64, 4K x 20, 8K x 10. Per call time from a CUDA
graph of `reps` calls replayed after warm-up (the smoke run times eager calls).

Rows (keys impl, mode, ctx, batch, density, us, tbps, config, [error]), tbps = K and V bytes
attended / time:
- impl "triton" (wise_torch.kernels.triton_decode, the table's launch): modes dense, discover,
  sparse (random blocks: round(density * blocks) per row and head), sparse-contiguous (the first
  blocks), discover+sparse (half the rows discover, half sparse);
- impl "triton-config": dense and sparse at 0.13 under other launch configurations (--no-sweep
  skips them);
- impl "sdpa-cudnn" (torch SDPA, cuDNN backend, contiguous K/V): dense, and mode contiguous: the
  first density * ctx keys, the floor of a sparse kernel at that density;
- impl "fa4" (flash_attn.cute paged decode, same pages), dense and contiguous, when importable;
- the rows of `benchmarks.kernels.bench_pallas.bench_pallas` when JAX has a GPU: impl "pallas"
  (the Triton-lowered Pallas kernel) and impl "mosaic" (its split kernel on Mosaic GPU), modes
  dense, discover, sparse, discover+sparse, and jax's paged attention; impl "pallas-best" is
  the faster of the two Pallas kernels per shape, mode and density (derived, for the targets).
Writes kernel_bench.json, kernel_bench.md (the standing against each target, the Pallas kernels
against Triton per mode and shape) and kernel_bench.png (time against density per shape) to
--out, rewritten after each shape.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import argparse
import dataclasses
import json
import math
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import report as rp
from wise_core import modes as M

BLOCK = 32
ETA = 0.95
DENSITIES = (0.05, 0.13, 0.25, 0.5, 1.0)
TARGET_DENSITY = 0.13
FULL = dict(shapes=((1024, 64), (4096, 20), (8192, 10)), heads=16, head_dim=128, page_size=128)
SMOKE = dict(shapes=((128, 2), (256, 1)), heads=2, head_dim=64, page_size=32)
# Targets: (name, numerator (impl, mode, density), denominator (impl, mode, density), bound).
TARGETS = (
    ("dense <= 1.15x cuDNN SDPA dense", ("triton", "dense", 1.0), ("sdpa-cudnn", "dense", 1.0), 1.15),
    ("discover <= 1.10x dense", ("triton", "discover", 1.0), ("triton", "dense", 1.0), 1.10),
    ("sparse @0.13 <= 0.25x cuDNN SDPA dense", ("triton", "sparse", TARGET_DENSITY),
     ("sdpa-cudnn", "dense", 1.0), 0.25),
    ("discover+sparse @0.13 <= 0.7x dense", ("triton", "discover+sparse", TARGET_DENSITY),
     ("triton", "dense", 1.0), 0.70),
) + tuple(
    (f"better Pallas {mode}{at} <= 1.00x Triton", ("pallas-best", mode, d), ("triton", mode, d), 1.00)
    for mode, d, at in (("dense", 1.0, ""), ("discover", 1.0, ""),
                        ("sparse", TARGET_DENSITY, " @0.13"),
                        ("discover+sparse", TARGET_DENSITY, " @0.13"))) + (
    ("better Pallas dense <= 1.05x cuDNN SDPA dense", ("pallas-best", "dense", 1.0),
     ("sdpa-cudnn", "dense", 1.0), 1.05),
    ("better Pallas sparse @0.13 <= 1.10x cuDNN SDPA @0.13 contiguous",
     ("pallas-best", "sparse", TARGET_DENSITY), ("sdpa-cudnn", "contiguous", TARGET_DENSITY), 1.10),
)
PALLAS_IMPLS = ("pallas", "mosaic")


def sweep_configs():
    """Launch configurations tried besides the table's (dense and sparse @0.13), most promising
    first (the sweep stops at its time budget). Registers per thread of the split kernel at
    8K x 10 from an offline sm90 compile (triton 3.6) in brackets; an SM holds 64K registers, so 4 warps at <= 128 registers
    run 4 programs per SM. min_splits > 1 gives rows listing few blocks (sparse ones) more,
    smaller splits. Without mha_dots the loop has no dot and Triton does not pipeline
    its loads, so num_stages changes nothing there and only 2 is tried."""
    from wise_torch.kernels.triton_decode import KernelConfig as C
    return [C(tile_n=64, split_keys=512, num_warps=4, num_stages=2),                   # [128] reductions
            C(tile_n=64, split_keys=512, num_warps=4, num_stages=3, mha_dots=True, min_splits=4),  # [162]
            C(tile_n=64, split_keys=512, num_warps=4, num_stages=2, min_splits=4),     # [96]
            C(tile_n=64, split_keys=512, num_warps=4, num_stages=2, mha_dots=True),    # [160]
            C(tile_n=64, split_keys=256, num_warps=4, num_stages=3, mha_dots=True),    # [162]
            C(tile_n=64, split_keys=1024, num_warps=4, num_stages=3, mha_dots=True),   # [162]
            C(tile_n=64, split_keys=256, num_warps=4, num_stages=2),                   # [128]
            C(tile_n=64, split_keys=1024, num_warps=4, num_stages=2),                  # [128]
            C(tile_n=64, split_keys=512, num_warps=8, num_stages=2),                   # [79]
            C(tile_n=128, split_keys=512, num_warps=8, num_stages=2),                  # [128]
            C(tile_n=128, split_keys=1024, num_warps=8, num_stages=2),                 # [128]
            C(tile_n=64, split_keys=512, num_warps=8, num_stages=3, mha_dots=True),    # [114]
            C(tile_n=64, split_keys=512, num_warps=4, num_stages=4, mha_dots=True),    # [162]
            C(tile_n=128, split_keys=1024, num_warps=4, num_stages=3, mha_dots=True),  # [227]
            C(tile_n=128, split_keys=1024, num_warps=8, num_stages=3, mha_dots=True),  # [157]
            C(tile_n=32, split_keys=256, num_warps=4, num_stages=3, mha_dots=True)]


@dataclasses.dataclass
class Timer:
    """Per-call microseconds: CUDA-graph replay of `reps` calls after warm-up, or eager on CPU."""

    device: str
    reps: int = 10
    replays: int = 20

    def __call__(self, fn) -> tuple[float, str]:
        if self.device != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6, "eager"
        fn()  # compile and warm up outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.reps):
                    fn()
            run, calls, method = graph.replay, self.reps * self.replays, "graph"
        except RuntimeError:  # not capturable: time eager calls instead
            traceback.print_exc()
            torch.cuda.synchronize()
            run, calls, method = fn, self.reps * self.replays, "eager"
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays if method == "graph" else calls):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / calls, method


def _row(impl, mode, ctx, batch, density, us, kv_bytes, config="", error=None):
    row = dict(impl=impl, mode=mode, ctx=ctx, batch=batch, density=density, us=us,
               tbps=kv_bytes / (us * 1e6) if us == us and us > 0 else float("nan"), config=config)
    if error is not None:
        row["error"] = error
    return row


def _attempt(rows, describe, measure):
    """Add measure()'s row; on failure a row with us = nan and the error (never raise)."""
    try:
        rows.append(measure())
    except Exception as e:  # one failed case must not stop the run
        traceback.print_exc()
        impl, mode, ctx, batch, density, config = describe
        rows.append(_row(impl, mode, ctx, batch, density, float("nan"), 0, config,
                         error=f"{type(e).__name__}: {e}"[:500]))


@dataclasses.dataclass
class Problem:
    """One (ctx, batch) shape: a paged cache, queries and the kernel's fixed inputs."""

    ctx: int
    batch: int
    heads: int
    head_dim: int
    page_size: int
    device: str
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        gen = torch.Generator(device="cpu").manual_seed(self.ctx + self.batch)
        pages = self.ctx // self.page_size
        shape = (self.batch * pages, self.page_size, self.heads, self.head_dim)
        to = dict(device=self.device, dtype=self.dtype)
        self.q = torch.randn(self.batch, self.heads, self.head_dim, generator=gen).to(**to)
        self.k_pages = torch.randn(shape, generator=gen).to(**to)
        self.v_pages = torch.randn(shape, generator=gen).to(**to)
        self.page_table = torch.randperm(self.batch * pages, generator=gen).reshape(self.batch, pages).to(
            device=self.device, dtype=torch.int32)
        self.seq_lens = torch.full((self.batch,), self.ctx, dtype=torch.int32, device=self.device)
        self.blocks = self.ctx // BLOCK

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block of one head."""
        return 2 * BLOCK * self.head_dim * self.k_pages.element_size()

    def support(self, density: float, contiguous: bool = False) -> torch.Tensor:
        """bool[batch, heads, blocks]: max(1, round(density * blocks)) blocks per row and head."""
        keep = max(1, round(density * self.blocks))
        if contiguous:
            rank = torch.arange(self.blocks).expand(self.batch, self.heads, -1)
        else:
            gen = torch.Generator(device="cpu").manual_seed(7)
            rank = torch.rand(self.batch, self.heads, self.blocks, generator=gen).argsort(-1).argsort(-1)
        return (rank < keep).to(self.device)

    def modes(self, name: str) -> torch.Tensor:
        half = torch.arange(self.batch) < self.batch // 2
        by_name = {"dense": torch.full((self.batch,), M.DENSE), "discover": torch.full((self.batch,), M.DISCOVER),
                   "sparse": torch.full((self.batch,), M.SPARSE),
                   "sparse-contiguous": torch.full((self.batch,), M.SPARSE),
                   "discover+sparse": torch.where(half, M.DISCOVER, M.SPARSE)}
        return by_name[name].to(device=self.device, dtype=torch.int32)

    def attended_bytes(self, modes: torch.Tensor, support: torch.Tensor) -> float:
        per_row = torch.where(modes == M.SPARSE, support.sum((1, 2)), self.heads * self.blocks)
        return float(per_row.sum()) * self.block_bytes


def bench_triton(rows, problem: Problem, densities, timer: Timer, configs, checks, notes,
                 sweep_seconds: float = math.inf) -> None:
    """Rows of the Triton kernel: every mode under configs[0], dense/sparse under the others
    while the time spent on them stays within `sweep_seconds`."""
    from wise_torch.kernels.triton_decode import DecodeWorkspace, all_blocks_support, decode_attention
    p = problem
    sweep_start = None
    for index, config in enumerate(configs):
        if index == 1:
            sweep_start = time.perf_counter()
        elif index and time.perf_counter() - sweep_start > sweep_seconds:
            notes.append(f"{p.ctx} x {p.batch}: sweep budget of {sweep_seconds:.0f} s spent, "
                         f"{len(configs) - index} of {len(configs) - 1} configurations not tried")
            break
        ws = DecodeWorkspace.allocate(p.batch, p.heads, p.heads, p.head_dim, p.blocks, dtype=p.dtype,
                                      device=p.device, config=config)
        impl = "triton" if index == 0 else "triton-config"
        cases = [("dense", 1.0), ("discover", 1.0)] + [
            (mode, d) for d in densities for mode in ("sparse", "sparse-contiguous", "discover+sparse")]
        if index:
            cases = [("dense", 1.0), ("sparse", TARGET_DENSITY)]
        for mode, density in cases:
            modes = p.modes(mode)
            support = p.support(density, contiguous=mode == "sparse-contiguous")

            def call(modes=modes, support=support):
                # validate=False as in the engine's step: the contract's checks sync with the host,
                # which a CUDA graph cannot capture (the checks run once in _check_triton)
                return decode_attention(p.q, p.k_pages, p.v_pages, p.page_table, p.seq_lens, modes, support,
                                        block_size=BLOCK, eta=ETA, workspace=ws, validate=False)

            def measure(mode=mode, density=density, modes=modes, support=support, call=call):
                kv_bytes = p.attended_bytes(modes, support)  # before discovery rows rewrite the support
                us, method = timer(call)
                if method == "eager" and p.device == "cuda":
                    notes.append(f"{p.ctx} x {p.batch} {impl} {mode}: not capturable, timed eagerly")
                return _row(impl, mode, p.ctx, p.batch, density, us, kv_bytes, f"{config} {method}")

            _attempt(rows, (impl, mode, p.ctx, p.batch, density, str(config)), measure)
        if index == 0:
            try:
                checks.update(_check_triton(p, ws, decode_attention, all_blocks_support))
            except Exception as e:  # report it, keep the timings
                traceback.print_exc()
                checks[f"{p.ctx}x{p.batch}"] = dict(error=f"{type(e).__name__}: {e}"[:500])


def _check_triton(p: Problem, ws, decode_attention, all_blocks_support) -> dict:
    """Bitwise mode equivalences and the dense output against SDPA (math on CPU, cuDNN on GPU)."""
    def run(mode, support):
        out, _ = decode_attention(p.q, p.k_pages, p.v_pages, p.page_table, p.seq_lens, p.modes(mode),
                                  support, block_size=BLOCK, eta=ETA, workspace=ws)
        return out.clone()

    every = all_blocks_support(p.seq_lens, p.heads, p.blocks, BLOCK)
    dense = run("dense", every.clone())
    k, v = _contiguous_kv(p, p.ctx)
    reference = _sdpa(p.q, k, v).float()
    return {f"{p.ctx}x{p.batch}": dict(
        dense_max_abs_err_vs_sdpa=float((dense.float() - reference).abs().max()),
        discover_bitwise_dense=bool(torch.equal(run("discover", every.clone()), dense)),
        sparse_all_blocks_bitwise_dense=bool(torch.equal(run("sparse", every.clone()), dense)))}


def _contiguous_kv(p: Problem, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `keys` keys of every row, contiguous [batch, heads, keys, head_dim]."""
    pages = -(-keys // p.page_size)
    k = p.k_pages[p.page_table[:, :pages].long()].flatten(1, 2)[:, :keys].transpose(1, 2).contiguous()
    v = p.v_pages[p.page_table[:, :pages].long()].flatten(1, 2)[:, :keys].transpose(1, 2).contiguous()
    return k, v


def _sdpa(q, k, v):
    """q: [batch, heads, head_dim] against contiguous k, v: [batch, heads, keys, head_dim]."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]
    return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


def bench_baselines(rows, p: Problem, densities, timer: Timer, notes) -> None:
    """cuDNN SDPA on contiguous K/V and FA4 on the same pages: dense and contiguous floors."""
    impl = "sdpa-cudnn" if p.device == "cuda" else "sdpa-cpu"
    for density in densities:
        keys = max(1, round(density * p.ctx))
        mode = "dense" if keys == p.ctx else "contiguous"

        def measure(keys=keys, mode=mode, density=density):
            k, v = _contiguous_kv(p, keys)
            us, method = timer(lambda: _sdpa(p.q, k, v))
            return _row(impl, mode, p.ctx, p.batch, density, us, 2 * k.numel() * k.element_size(), method)

        _attempt(rows, (impl, mode, p.ctx, p.batch, density, ""), measure)

    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # not installed: say so in the report
        note = f"FA4 skipped: flash_attn.cute does not import ({type(e).__name__}: {e})"[:300]
        notes.extend([note] if note not in notes else [])
        return
    for density in densities:
        keys = max(1, round(density * p.ctx))
        mode = "dense" if keys == p.ctx else "contiguous"

        def measure(keys=keys, mode=mode, density=density):
            used = torch.full((p.batch,), keys, dtype=torch.int32, device=p.device)
            q = p.q[:, None]
            us, method = timer(lambda: flash_attn_varlen_func(q, p.k_pages, p.v_pages, seqused_k=used,
                                                              page_table=p.page_table, return_lse=True))
            kv_bytes = 2 * p.batch * keys * p.heads * p.head_dim * p.k_pages.element_size()
            return _row("fa4", mode, p.ctx, p.batch, density, us, kv_bytes, method)

        _attempt(rows, ("fa4", mode, p.ctx, p.batch, density, ""), measure)


def bench_pallas_rows(shapes, densities, notes, **kwargs) -> list[dict]:
    """`benchmarks.kernels.bench_pallas`'s rows (kwargs: bench_pallas's), when JAX has a GPU."""
    try:
        import jax
        if jax.default_backend() != "gpu":
            note = f"Pallas skipped: JAX runs on {jax.default_backend()}, not a GPU"
            notes.extend([note] if note not in notes else [])
            return []
        from benchmarks.kernels.bench_pallas import bench_pallas
        return bench_pallas(shapes, densities, **kwargs)
    except Exception as e:  # the Pallas rows are optional
        traceback.print_exc()
        notes.append(f"Pallas failed: {type(e).__name__}: {e}"[:500])
        return []


def best_pallas_rows(rows) -> list[dict]:
    """Per (shape, mode, density), the faster of the Pallas kernels' rows as impl "pallas-best"
    (its config names the kernel)."""
    best = {}
    for r in rows:
        if r["impl"] in PALLAS_IMPLS and r["us"] == r["us"]:
            key = (r["ctx"], r["batch"], r["mode"], r["density"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    return [dict(r, impl="pallas-best", config=f"{r['impl']}: {r['config']}") for r in best.values()]


def _lookup(rows, ctx, batch, impl, mode, density):
    for r in rows:
        if (r["impl"], r["mode"], r["ctx"], r["batch"]) == (impl, mode, ctx, batch) \
                and math.isclose(r["density"], density) and r["us"] == r["us"]:
            return r["us"]
    return None


def standing(rows, shapes) -> list[dict]:
    """Each target per shape: measured ratio and pass/fail (None where a side is missing)."""
    out = []
    for name, num, den, bound in TARGETS:
        for ctx, batch in shapes:
            a, b = _lookup(rows, ctx, batch, *num), _lookup(rows, ctx, batch, *den)
            ratio = a / b if a is not None and b else None
            out.append(dict(target=name, ctx=ctx, batch=batch, ratio=ratio, bound=bound,
                            passed=None if ratio is None else ratio <= bound))
    return out


def best_configs(rows, kernel="triton") -> dict:
    """The sweep's verdict for `kernel` ("triton", "pallas", "mosaic": its table's rows and its
    "-config" rows): per (shape, mode) the fastest configuration, and per mode the
    configurations that do best on every shape at once (geometric mean of time / fastest)."""
    tried = {}  # (ctx, batch, mode) -> {config: us}
    for r in rows:
        density = {"dense": 1.0, "sparse": TARGET_DENSITY}.get(r["mode"])
        if r["impl"] in (kernel, f"{kernel}-config") and density is not None and r["us"] == r["us"] \
                and math.isclose(r["density"], density):
            config = r["config"].rsplit(" ", 1)[0] if kernel == "triton" else r["config"]  # without the timing
            tried.setdefault((r["ctx"], r["batch"], r["mode"]), {})[config] = r["us"]
    per_shape = []
    for (ctx, batch, mode), times in sorted(tried.items()):
        config, us = min(times.items(), key=lambda item: item[1])
        cudnn = _lookup(rows, ctx, batch, "sdpa-cudnn", "dense", 1.0)
        per_shape.append(dict(ctx=ctx, batch=batch, mode=mode, config=config, us=us,
                              table_us=_lookup(rows, ctx, batch, kernel, mode, 1.0 if mode == "dense" else TARGET_DENSITY),
                              vs_cudnn_dense=us / cudnn if cudnn else None))
    overall = []
    for mode in ("dense", "sparse"):
        shapes = [times for (_, _, m), times in sorted(tried.items()) if m == mode]
        everywhere = set.intersection(*(set(t) for t in shapes)) if shapes else set()
        scores = {c: math.exp(sum(math.log(t[c] / min(t.values())) for t in shapes) / len(shapes)) for c in everywhere}
        overall += [dict(mode=mode, config=c, geomean_slowdown=g) for c, g in sorted(scores.items(), key=lambda x: x[1])[:3]]
    return dict(per_shape=per_shape, overall=overall)


def pallas_against_triton(rows, shapes) -> list[dict]:
    """Per shape and mode (the Pallas rows' densities), Triton's time and each Pallas kernel's,
    with their ratios to Triton."""
    out = []
    cases = sorted({(r["mode"], r["density"]) for r in rows if r["impl"] in PALLAS_IMPLS})
    for ctx, batch in shapes:
        for mode, density in cases:
            triton_us = _lookup(rows, ctx, batch, "triton", mode, density)
            entry = dict(ctx=ctx, batch=batch, mode=mode, density=density, triton_us=triton_us)
            for impl in PALLAS_IMPLS:
                us = _lookup(rows, ctx, batch, impl, mode, density)
                entry[f"{impl}_us"] = us
                entry[f"{impl}_vs_triton"] = us / triton_us if us is not None and triton_us else None
            out.append(entry)
    return out


def markdown(report) -> str:
    env = report["environment"]
    lines = [f"# Decode-attention kernel benchmark ({report['date']})", "",
             f"Machine: {env['device']} ({env['host']}); torch {env['torch']}, triton {env['triton']}, "
             f"CUDA {env['cuda']}, jax {env['jax']}, flash-attn-4 {env['flash_attn_4']}. "
             f"Shapes: {env['heads']} heads x head_dim {env['head_dim']}, {env['dtype']}, pages of "
             f"{env['page_size']} keys; times per call from {env['timing']}.", "",
             "## Targets", "", "| target | ctx x batch | ratio | bound | result |", "|---|---|---|---|---|"]
    for t in report["standing"]:
        result = "n/a" if t["passed"] is None else ("pass" if t["passed"] else "FAIL")
        lines.append(f"| {t['target']} | {t['ctx']} x {t['batch']} | {rp.fmt(t['ratio'], '.3f')} | "
                     f"{t['bound']} | {result} |")
    if report.get("pallas_vs_triton"):
        lines += ["", "## Pallas kernels against Triton", "",
                  "Triton times are CUDA-graph replays; the Pallas kernels' are device spans per call "
                  "of a jitted chain of calls under the profiler, each call with its own support "
                  "(bench_pallas.py), same run.", "",
                  "| ctx x batch | mode | density | triton us | pallas us | mosaic us | pallas / triton "
                  "| mosaic / triton |", "|---|---|---|---|---|---|---|---|"]
        for e in report["pallas_vs_triton"]:
            lines.append(f"| {e['ctx']} x {e['batch']} | {e['mode']} | {e['density']:.2f} | "
                         f"{rp.fmt(e['triton_us'])} | {rp.fmt(e['pallas_us'])} | {rp.fmt(e['mosaic_us'])} | "
                         f"{rp.fmt(e['pallas_vs_triton'], '.3f')} | {rp.fmt(e['mosaic_vs_triton'], '.3f')} |")
    for kernel, best in [("triton", report["best_configs"])] + sorted(report.get("pallas_best_configs", {}).items()):
        if kernel != "triton" and not best["per_shape"]:
            continue
        title = "Launch configurations" if kernel == "triton" else f"Launch configurations: {kernel}"
        lines += ["", f"## {title}", "",
                  "Fastest configuration per shape and mode (the table's and the sweep's); ratio: its time "
                  "over cuDNN SDPA dense.", "",
                  "| ctx x batch | mode | table's us | fastest us | ratio | fastest config |", "|---|---|---|---|---|---|"]
        for b in best["per_shape"]:
            lines.append(f"| {b['ctx']} x {b['batch']} | {b['mode']} | {rp.fmt(b['table_us'])} | {rp.fmt(b['us'])} | "
                         f"{rp.fmt(b['vs_cudnn_dense'], '.3f')} | {b['config']} |")
        if best["overall"]:
            lines += ["", "One configuration for every shape (tried at all of them), per mode: the three with the "
                      "smallest geometric mean of time over the shape's fastest.", "",
                      "| mode | geomean slowdown | config |", "|---|---|---|"]
            lines += [f"| {o['mode']} | {o['geomean_slowdown']:.3f} | {o['config']} |" for o in best["overall"]]
    lines += ["", "## Checks", "", "```", json.dumps(report["checks"], indent=1), "```", ""]
    if report["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines += ["## All rows", "", "| impl | mode | ctx x batch | density | us | TB/s | config |",
              "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['impl']} | {r['mode']} | {r['ctx']} x {r['batch']} | {r['density']:.2f} | "
                     f"{rp.fmt(r['us'])} | {rp.fmt(r['tbps'], '.2f')} | {r.get('error') or r.get('config', '')} |")
    return "\n".join(lines) + "\n"


def plot(rows, shapes, path: Path) -> None:
    """Time against density, one panel per shape; dense times as horizontal lines."""
    plt = rp.pyplot()
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    curves = [("triton", "sparse"), ("triton", "sparse-contiguous"), ("triton", "discover+sparse"),
              ("sdpa-cudnn", "contiguous"), ("sdpa-cpu", "contiguous"), ("fa4", "contiguous"),
              ("pallas", "sparse"), ("pallas", "discover+sparse"), ("mosaic", "sparse"),
              ("mosaic", "discover+sparse")]
    levels = [("triton", "dense"), ("triton", "discover"), ("sdpa-cudnn", "dense"), ("sdpa-cpu", "dense"),
              ("fa4", "dense"), ("pallas", "dense"), ("mosaic", "dense")]
    for ax, (ctx, batch) in zip(axes[0], shapes):
        for impl, mode in curves:
            pts = sorted((r["density"], r["us"]) for r in rows if (r["impl"], r["mode"], r["ctx"], r["batch"])
                         == (impl, mode, ctx, batch) and r["us"] == r["us"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl} {mode}")
        for i, (impl, mode) in enumerate(levels):
            us = _lookup(rows, ctx, batch, impl, mode, 1.0)
            if us is not None:
                ax.axhline(us, linestyle="--", color=f"C{(len(curves) + i) % 10}", label=f"{impl} {mode}")
        ax.set(title=f"ctx {ctx} x batch {batch}", xlabel="support density", ylabel="us per call")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    rp.save_png(fig, path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=rp.RESULTS, help="directory for JSON, markdown, PNG")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the other launch configurations")
    parser.add_argument("--sweep-seconds", type=float, default=150.0,
                        help="time budget of the launch-configuration sweep, all shapes together")
    parser.add_argument("--no-pallas", action="store_true", help="skip benchmarks.kernels.bench_pallas's rows")
    parser.add_argument("--pallas-sweep-seconds", type=float, default=0.0,
                        help="time budget of each Pallas kernel's launch sweep per shape (0: none)")
    parser.add_argument("--pallas-chain", default="4,16",
                        help="lengths of the jitted chains that time a Pallas call (bench_pallas: the "
                             "longer one on a GPU, the difference of the two in the interpreters)")
    parser.add_argument("--no-jax-paged", action="store_true", help="skip jax's paged attention rows")
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                        help="support densities of the sparse modes (1.0 is the dense baselines')")
    parser.add_argument("--mosaic-config", action="append", default=[], metavar="NAME=VALUE,...",
                        help="a MosaicConfig to time after the default (dense and sparse; repeatable)")
    args = parser.parse_args(argv)
    mosaic_configs = []
    if args.mosaic_config:
        from benchmarks.kernels.bench_pallas import parse_mosaic_config
        try:
            mosaic_configs = [parse_mosaic_config(text) for text in args.mosaic_config]
        except ValueError as e:
            parser.error(str(e))
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        if not args.smoke:
            raise SystemExit("kernel_bench needs a CUDA GPU (use --smoke for a CPU check of the code paths)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from wise_torch.kernels.triton_decode import config_for

    setup = SMOKE if args.smoke else FULL
    shapes = setup["shapes"]
    densities = tuple(sorted({float(d) for d in args.densities.split(",")} | {1.0}))
    timer = Timer(device)
    table_config = config_for(setup["head_dim"], torch.bfloat16)
    configs = [table_config] + ([] if args.no_sweep else
                                [c for c in sweep_configs() if c != table_config][:2 if args.smoke else None])
    env = rp.environment("torch")
    report = dict(date=rp.now(), smoke=args.smoke,
                  environment=dict(env, device=env["device"] if device == "cuda" else env["cpu"],
                                   jax=rp.version("jax") or "absent",
                                   flash_attn_4=rp.version("flash-attn-4") or "absent", heads=setup["heads"], head_dim=setup["head_dim"], dtype="bfloat16",
                                   page_size=setup["page_size"],
                                   timing=f"CUDA-graph replay of {timer.reps} calls x {timer.replays}"
                                   if device == "cuda" else "one eager call (smoke)"),
                  table_config=str(table_config), rows=[], checks={}, notes=[], standing=[], best_configs={})
    rows = report["rows"]

    def pallas_rows(impl, ctx, batch):  # one Pallas kernel at one shape, then the report
        rows.extend(bench_pallas_rows(
            [(ctx, batch)], tuple(d for d in densities if d < 1.0), report["notes"], impls=(impl,),
            sweep=args.pallas_sweep_seconds > 0, sweep_seconds=args.pallas_sweep_seconds,
            chain=tuple(int(n) for n in args.pallas_chain.split(",")),
            jax_paged=impl == "pallas" and not args.no_jax_paged,
            mosaic_configs=mosaic_configs if impl == "mosaic" else ()))
        write_report(report, shapes, args.out)

    for ctx, batch in shapes:
        started = time.perf_counter()
        problem = Problem(ctx, batch, setup["heads"], setup["head_dim"], setup["page_size"], device)
        bench_baselines(rows, problem, densities, timer, report["notes"])
        bench_triton(rows, problem, densities, timer, configs, report["checks"], report["notes"],
                     args.sweep_seconds / len(shapes))
        del problem
        if device == "cuda":
            torch.cuda.empty_cache()
        write_report(report, shapes, args.out)  # a run cut short still leaves a report
        if device == "cuda" and not args.no_pallas:
            pallas_rows("pallas", ctx, batch)
        print(f"{ctx} x {batch} done in {time.perf_counter() - started:.0f} s", flush=True)
    if device == "cuda" and not args.no_pallas:  # the newest kernel last: what it does cannot cost the rest
        for ctx, batch in shapes:
            pallas_rows("mosaic", ctx, batch)
    print(write_report(report, shapes, args.out))
    return report


def write_report(report, shapes, out: Path) -> str:
    """kernel_bench.{json,md,png} in `out`; returns the markdown."""
    report["pallas_best_rows"] = best_pallas_rows(report["rows"])
    rows = report["rows"] + report["pallas_best_rows"]
    report["standing"] = standing(rows, shapes)
    report["best_configs"] = best_configs(report["rows"])
    report["pallas_vs_triton"] = pallas_against_triton(rows, shapes)
    report["pallas_best_configs"] = {k: best_configs(report["rows"], k) for k in PALLAS_IMPLS}
    return rp.write_report(out, "kernel_bench", report, markdown(report),
                           lambda path: plot(report["rows"], shapes, path))


if __name__ == "__main__":
    main()
