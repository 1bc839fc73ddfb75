"""benchmarks.quality.kv_fp8_quality's own arithmetic, on made-up arms (the engines' runs are the
module's, measured in benchmarks/results/cpu-2026-12-08): the paired bits-per-byte change, the
greedy tokens changed and the report's rows."""

import math

import numpy as np
import pytest

from benchmarks.quality import kv_fp8_quality as bench
from wise_core.evaluation import Arm
from wise_core.wise_config import WiseConfig


def arm(nats_per_token, greedy, density=None):
    """An arm of 3 contexts: 4 forced tokens each at the given NLL (nats), 8 bytes each."""
    logprobs = [np.full(4, -n) for n in nats_per_token]
    return Arm(None if density is None else WiseConfig(), logprobs, np.array([8, 8, 8]), greedy, density,
               None if density is None else 0)


def test_changes_are_paired_and_greedy_counts_the_parting():
    base = arm([1.0, 2.0, 3.0], [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    fp8 = arm([1.5, 2.0, 3.0], [[1, 2, 9, 4], [5, 6, 7, 8], [2, 1, 1, 1]])
    change = bench.bpb_change(fp8, base)
    assert change["mean"] == pytest.approx(4 * 0.5 / math.log(2) / 24)          # 0.5 nats x 4 tokens over 24 bytes
    assert change["low"] <= change["mean"] <= change["high"] and change["low"] >= 0
    greedy = bench.greedy_change(fp8, base)
    assert greedy == {"tokens_changed": pytest.approx(2 / 12), "past_parting": pytest.approx(1 - (2 / 4 + 1 + 0) / 3),
                      "all_equal": pytest.approx(1 / 3)}


def test_markdown_has_a_row_per_arm_and_the_densities():
    rows = []
    for decode, kv in bench.ARMS:
        ci = {"mean": 1.0, "low": 0.9, "high": 1.1}
        rows.append({"decode": decode, "kv_cache_dtype": kv, "bits_per_byte": ci,
                     "change_against_model_dtype": None if kv == "auto" else ci,
                     "change_against_dense": None if (decode, kv) == ("dense", "auto") else ci,
                     "greedy_against_model_dtype": None if kv == "auto" else
                     {"tokens_changed": 0.25, "past_parting": 0.5, "all_equal": 0.5},
                     "density": None if decode == "dense" else {"2": 0.4, "3": 0.3}, "fallbacks": 0})
    text = bench.markdown({"rows": rows, "dtype": "float32", "args": {"eta": 0.95},
                           "contexts": {"n": 2, "lengths": [300, 400], "continuation": 4, "continuation_bytes": [9, 7],
                                        "greedy": 8}})
    lines = text.splitlines()
    assert lines[0].endswith("| density depth 2 | density depth 3 | fallbacks |")
    assert lines[3].startswith("| dense | fp8 | 1.0000 [0.9000, 1.1000] | +1.0000 [+0.9000, +1.1000]")
    assert "25.0 % / 50.0 % / 50 %" in lines[3] and lines[5].endswith("| 0.400 | 0.300 | 0 |")
    assert "2 held-out contexts of 300-400 tokens; 4 teacher-forced tokens (16 bytes)" in text
