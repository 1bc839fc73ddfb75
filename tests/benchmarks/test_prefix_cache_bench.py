"""benchmarks/engine/prefix_cache.py runs end to end at a tiny size and reports what it measured."""

import json

from benchmarks.engine import prefix_cache


def test_shared_prefix_workload_reports_hits_and_equal_tokens(tmp_path):
    # 3 requests of a 256-token prefix (2 full pages of 128) and 8 own tokens; a step's budget of
    # 264 tokens holds the first prompt alone, so the two later ones each find its 2 pages.
    prefix_cache.main(["--engines", "torch", "--requests", "3", "--prefix", "256", "--suffix", "8",
                       "--new-tokens", "2", "--max-num-batched-tokens", "264", "--repeats", "1",
                       "--out", str(tmp_path)])
    report = json.loads((tmp_path / "prefix_cache.json").read_text())
    rows = {r["arm"]: r for r in report["rows"]}
    assert "error" not in rows["on"] and "error" not in rows["off"], report
    assert rows["on"]["cache_hits"] == 2 * 256 and rows["off"]["cache_hits"] == 0
    assert rows["on"]["prompt_tokens"] == 3 * 264 - 2 * 256 and rows["off"]["prompt_tokens"] == 3 * 264
    assert rows["on"]["same_tokens"] == "yes" and len(rows["on"]["ttft_s"]) == 3
    assert "| torch | on | 280 | 512 |" in (tmp_path / "prefix_cache.md").read_text()
