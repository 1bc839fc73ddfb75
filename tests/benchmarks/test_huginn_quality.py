"""benchmarks.quality.huginn_quality on a random tiny byte-level Huginn checkpoint: the arms are
wired as they say (adaptive depth that never exits is dense decode at its maximum depth, one
that always exits runs one iteration), and the report is written."""

import dataclasses
import json

from benchmarks.quality import huginn_quality
from wise_core.checkpoint import Checkpoint, random_tensors, save_checkpoint
from wise_core.presets import PRESETS
from wise_core.tokenizer import byte_tokenizer

CONFIG = dataclasses.replace(PRESETS["test-tiny-huginn"], vocab_size=258, bos_token_id=256, eos_token_id=256,
                             pad_token_id=257)


def test_arms_and_report(tmp_path):
    path = save_checkpoint(tmp_path / "tiny", Checkpoint(CONFIG, random_tensors(CONFIG, seed=0, std=0.08),
                                                         byte_tokenizer()))
    out = tmp_path / "out"
    result = huginn_quality.main(["--model", str(path), "--out", str(out), "--n-contexts", "2", "--min-context",
                                  "16", "--max-context", "24", "--continuation", "4", "--greedy", "3",
                                  "--depths", "3", "--thresholds", "0", "100", "--quiet"])
    rows = {r["arm"]: r for r in result["rows"]}
    assert list(rows) == ["dense r=3", "WISE r=3", "adaptive KL<0 r<=3", "adaptive KL<100 r<=3"]
    never, always = rows["adaptive KL<0 r<=3"], rows["adaptive KL<100 r<=3"]
    assert never["mean_depth"] == 3 and never["bpb_diff"]["mean"] == 0.0       # the same float64 computation
    assert never["forced_tokens_changed"] == 0 and never["greedy_tokens_changed"] == 0
    assert always["mean_depth"] == 1                                         # exits after iteration 0
    assert rows["dense r=3"]["mean_depth"] == 3 and "bpb_diff" not in rows["dense r=3"]
    assert json.loads((out / "huginn_quality.json").read_text())["rows"][0]["arm"] == "dense r=3"
    assert "| WISE r=3 |" in (out / "huginn_quality.md").read_text()
