"""How fine the scales of an fp8 K/V cache must be: attention outputs with K and V quantized
to float8 e4m3fn by `wise_core.kv_quant`'s rule at several scale granularities (issue 50).

    python -m benchmarks.quality.kv_quant_granularity --out DIR [--context 4096] [--seeds 4]

Per trial: K, V float32 [context, kv_heads, head_dim] (head_dim 128, 8 KV heads, pages of 128
tokens), 16 query vectors per KV head; the reference is float64 attention softmax(q k^T /
sqrt(d)) v over every key with the float32 K/V; each arm stores K and V its way, dequantizes
them to float32 and attends the same way. The figures: the relative error of the outputs,
||O' - O|| / ||O|| over every query and head (mean over seeds), the median and 99th percentile
of each (query, head)'s ||o' - o|| / ||o||, and the relative error of the stored K and V
themselves (||x' - x|| / ||x|| over the whole cache).

Arms (the fp8 ones all use the rule's rounding: scale = RN(amax * RN(1/448)), values x * RN(1 /
scale) rounded to e4m3fn, `wise_core.kv_quant`):
- `bf16`: K/V rounded to bfloat16, what the cache holds today (the floor to compare with);
- `fp8 token`: one scale per (token, KV head): `wise_core.kv_quant.quantize` itself;
- `fp8 page`: one scale per (page of `--page-size` tokens, KV head), amax over the whole page
  (the best a page scale can do: a decode step would have to fix it before the page is full,
  or rewrite the page);
- `fp8 head`: one scale per KV head over the whole context (a per-tensor scale, as calibrated
  static scales are);
- `fp8 token pow2`: per (token, KV head), the scale rounded up to a power of two (E8M0-style
  scales: x / scale exact), for reference.

K/V distributions (`--dists`):
- `normal`: N(0, 1);
- `outliers`: N(0, 1) with 4 of the 128 channels x10 in every token (the same channels in K and
  V, per KV head), as real keys have;
- `outliers+tokens`: outliers, and each token's K and V multiplied by its own log-normal
  magnitude (sigma 1): tokens of unequal norms in one page (attention sinks, say).
Queries are N(0, 1) x `--q-scale` (1: a flat softmax over the context; 4: a peaked one).

Writes kv-quant-granularity.json (every trial's numbers, settings, machine, versions, date) and
kv-quant-granularity.md into `--out`. A few seconds on a CPU at the defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks import report as rp
from wise_core import kv_quant as spec

ARMS = ("bf16", "fp8 token", "fp8 page", "fp8 head", "fp8 token pow2")
DISTS = ("normal", "outliers", "outliers+tokens")
STEM = "kv-quant-granularity"


def quantize_grouped(x: np.ndarray, axes: tuple[int, ...], pow2: bool = False) -> np.ndarray:
    """x float32 quantized by the rule with one scale per group: amax over `axes` (head_dim among
    them); returns the dequantized float32 values. pow2: the scale rounded up to a power of two."""
    finite = np.isfinite(x)
    amax = np.max(np.where(finite, np.abs(x), np.float32(0)), axis=axes, keepdims=True)
    scale = amax * spec.INV_E4M3_MAX
    scale = np.where(scale >= np.float32(spec.MIN_SCALE), scale, np.float32(1)).astype(np.float32)
    if pow2:
        scale = np.ldexp(np.float32(1), np.ceil(np.log2(scale)).astype(np.int32)).astype(np.float32)
    inv = np.float32(1) / scale
    codes = np.where(finite, spec.encode_e4m3fn((x * inv).astype(np.float32)), np.uint8(spec.NAN_CODE))
    return spec.decode_e4m3fn(codes) * scale


def stored(x: np.ndarray, arm: str, page_size: int) -> np.ndarray:
    """What the arm's cache reads back for x float32 [context, kv_heads, head_dim], as float32."""
    if arm == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if arm == "fp8 token":
        return spec.dequantize(*spec.quantize(x), np.float32)
    if arm == "fp8 token pow2":
        return quantize_grouped(x, (-1,), pow2=True)
    if arm == "fp8 page":
        n, kv_heads, head_dim = x.shape
        pages = x.reshape(n // page_size, page_size, kv_heads, head_dim)
        return quantize_grouped(pages, (1, 3)).reshape(x.shape)
    if arm == "fp8 head":
        return quantize_grouped(x, (0, 2))
    raise ValueError(f"unknown arm {arm!r} (choose from {ARMS})")


def kv(dist: str, context: int, kv_heads: int, head_dim: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """K and V float32 [context, kv_heads, head_dim] of a distribution of `DISTS`."""
    k, v = (rng.standard_normal((context, kv_heads, head_dim)) for _ in range(2))
    if dist in ("outliers", "outliers+tokens"):
        for h in range(kv_heads):
            channels = rng.choice(head_dim, 4, replace=False)
            k[:, h, channels] *= 10.0
            v[:, h, channels] *= 10.0
    if dist == "outliers+tokens":
        k *= np.exp(rng.standard_normal((context, kv_heads, 1)))
        v *= np.exp(rng.standard_normal((context, kv_heads, 1)))
    elif dist not in ("normal", "outliers"):
        raise ValueError(f"unknown distribution {dist!r} (choose from {DISTS})")
    return k.astype(np.float32), v.astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 softmax(q k^T / sqrt(d)) v per KV head: q [kv_heads, queries, d], k, v [n, kv_heads, d]
    -> [kv_heads, queries, d]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("hqd,nhd->hqn", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqn,nhd->hqd", p, v)


def relative(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    """||a - b|| / ||b|| over `axis` (every value by default), float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def trial(dist: str, q_scale: float, seed: int, args) -> dict:
    """One draw of K, V and q: per arm the output errors (every (head, query)'s and the whole
    output's) and the stored K and V's errors."""
    rng = np.random.default_rng(seed)
    k, v = kv(dist, args.context, args.kv_heads, args.head_dim, rng)
    q = (q_scale * rng.standard_normal((args.kv_heads, args.queries, args.head_dim))).astype(np.float32)
    want = attention(q, k, v)
    out = {}
    for arm in args.arms:
        k2, v2 = stored(k, arm, args.page_size), stored(v, arm, args.page_size)
        got = attention(q, k2, v2)
        out[arm] = dict(per_query=relative(got, want, axis=-1).ravel(), whole=float(relative(got, want)),
                        k_err=float(relative(k2, k)), v_err=float(relative(v2, v)))
    return out


def run(args) -> dict:
    rows = []
    for dist in args.dists:
        for q_scale in args.q_scale:
            trials = [trial(dist, q_scale, seed, args) for seed in range(args.seeds)]
            for arm in args.arms:
                per_query = np.concatenate([t[arm]["per_query"] for t in trials])
                rows.append(dict(dist=dist, q_scale=q_scale, arm=arm,
                                 whole=float(np.mean([t[arm]["whole"] for t in trials])),
                                 median=float(np.median(per_query)), p99=float(np.quantile(per_query, 0.99)),
                                 k_err=float(np.mean([t[arm]["k_err"] for t in trials])),
                                 v_err=float(np.mean([t[arm]["v_err"] for t in trials])),
                                 trials=[{key: value for key, value in t[arm].items() if key != "per_query"}
                                         for t in trials]))
    settings = {name: getattr(args, name) for name in ("context", "kv_heads", "head_dim", "page_size", "queries",
                                                         "seeds", "q_scale", "dists", "arms")}
    return dict(date=rp.now(), environment=rp.environment(), settings=settings, rows=rows)


def markdown(result: dict) -> str:
    s = result["settings"]
    env = result["environment"]
    lines = [f"# fp8 K/V scale granularity ({result['date']})", "",
             f"`python -m benchmarks.quality.kv_quant_granularity` on {env['cpu']} ({env['cpu_count']} cores), "
             f"Python {env['python']}. Context {s['context']} keys, {s['kv_heads']} KV heads x head_dim "
             f"{s['head_dim']}, pages of {s['page_size']}, {s['queries']} queries per KV head, {s['seeds']} seeds. "
             "Attention output against float64 attention over the float32 K/V: whole = ||O' - O|| / ||O|| over "
             "every query and head (mean over seeds); median and p99 of each (query, head)'s ||o' - o|| / ||o|| "
             "(p99 is led by outputs that nearly cancel, ||o|| small); K err / V err: ||x' - x|| / ||x|| of the "
             "stored cache. Arms and distributions: the module's docstring.", ""]
    header = ["K/V", "q scale", "arm", "output err, whole", "per query, median", "per query, p99", "K err",
              "V err", "whole / fp8 token"]
    body = []
    for row in result["rows"]:
        token = next(r for r in result["rows"] if r["dist"] == row["dist"] and r["q_scale"] == row["q_scale"]
                     and r["arm"] == "fp8 token")
        body.append([row["dist"], rp.fmt(row["q_scale"], "g"), row["arm"], rp.fmt(row["whole"], ".2e"),
                     rp.fmt(row["median"], ".2e"), rp.fmt(row["p99"], ".2e"), rp.fmt(row["k_err"], ".2e"),
                     rp.fmt(row["v_err"], ".2e"), rp.fmt(row["whole"] / token["whole"], ".2f")])
    lines += rp.table(header, body)
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--context", type=int, default=4096, help="keys (a multiple of --page-size)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--queries", type=int, default=16, help="query vectors per KV head")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--q-scale", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--dists", nargs="+", choices=DISTS, default=list(DISTS))
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.context % args.page_size:
        ap.error(f"--context {args.context} is not a multiple of --page-size {args.page_size}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    text = rp.write_report(args.out, STEM, result, markdown(result))
    if not args.quiet:
        print(text)
    return result


if __name__ == "__main__":
    main()
