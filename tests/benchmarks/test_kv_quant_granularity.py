"""benchmarks.quality.kv_quant_granularity: its grouped quantizer is the rule of
wise_core.kv_quant (one group per token and KV head gives the spec's values bitwise, a page of
one token too), the power-of-two arm's scales are powers of two, and a tiny run writes its
report with every arm and distribution."""

import json

import numpy as np

from benchmarks.quality import kv_quant_granularity as bench
from kv_quant_cases import random_kv, special_vectors
from wise_core import kv_quant as spec


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_grouped_quantizer_is_the_rule():
    x = random_kv((64, 4, 32), "magnitudes", seed=0)
    want = spec.dequantize(*spec.quantize(x), np.float32)
    assert np.array_equal(bits(bench.quantize_grouped(x, (-1,))), bits(want))
    assert np.array_equal(bits(bench.stored(x, "fp8 page", page_size=1)), bits(want))
    assert np.array_equal(bits(bench.stored(x[:1], "fp8 head", page_size=1)), bits(want[:1]))
    special = np.stack(list(special_vectors(16).values()))[:, None, :]
    got, want = bench.quantize_grouped(special, (-1,)), spec.dequantize(*spec.quantize(special), np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(bits(got)[~np.isnan(got)], bits(want)[~np.isnan(want)])


def test_page_scale_is_the_page_amax_and_pow2_scales_are_powers_of_two():
    x = random_kv((256, 2, 64), "outliers", seed=1)
    page = bench.stored(x, "fp8 page", page_size=128).reshape(2, 128, 2, 64)
    amax = np.abs(x.reshape(2, 128, 2, 64)).max(axis=(1, 3))
    # each page's amax gets code 448: read back to float32 rounding
    assert np.allclose(np.abs(page).max(axis=(1, 3)), amax, rtol=2.0 ** -21, atol=0)
    pow2 = bench.stored(x, "fp8 token pow2", page_size=128)
    err = np.abs(pow2 - x)
    assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * 2 * np.abs(x).max(-1, keepdims=True) / 448))
    assert not np.array_equal(pow2, bench.stored(x, "fp8 token", page_size=128))


def test_tiny_run_writes_the_report(tmp_path):
    result = bench.main(["--out", str(tmp_path), "--context", "256", "--page-size", "64", "--kv-heads", "2",
                         "--head-dim", "32", "--queries", "4", "--seeds", "2", "--quiet"])
    rows = {(r["dist"], r["q_scale"], r["arm"]): r for r in result["rows"]}
    assert len(rows) == len(bench.DISTS) * 2 * len(bench.ARMS)
    for dist in bench.DISTS:
        assert rows[(dist, 1.0, "bf16")]["whole"] < rows[(dist, 1.0, "fp8 token")]["whole"] < 0.5
        assert rows[(dist, 1.0, "fp8 token")]["k_err"] < 2.0 ** -4
    saved = json.loads((tmp_path / f"{bench.STEM}.json").read_text())
    assert saved["settings"]["context"] == 256 and len(saved["rows"]) == len(rows)
    text = (tmp_path / f"{bench.STEM}.md").read_text()
    assert "| outliers | 4 | fp8 page |" in text and "whole / fp8 token" in text
