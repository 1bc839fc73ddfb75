"""benchmarks/engine/program_memory.py on CPU: the first programs of each kind of a tiny engine's
start-up set are compiled and measured (its K/V pool aliased: the decode and prefill programs donate it), the
report written; an unknown kind, or XLA flags once jax is imported, refused."""

from __future__ import annotations

import importlib
import json

import pytest

from benchmarks.engine import program_memory


def test_the_start_up_set_is_measured_and_reported(tmp_path):
    data = program_memory.main(["--preset", "test-tiny", "--dtype", "float32", "--max-num-seqs", "4",
                                "--max-model-len", "256", "--num-pages", "16", "--most", "2", "--out", str(tmp_path)])
    rows = data["programs"]
    # each kind's first two: decode (4 rows, the widest: 256 tokens in pages of 128) and (1 row, 1 page); prefill; first tokens at 1 and 2 rows
    assert [(r["kind"], r["key"]) for r in rows if r["kind"] != "prefill"] == [
        ("decode", ["4", "2"]), ("decode", ["1", "1"]), ("first", ["1"]), ("first", ["2"])]
    assert [r["kind"] for r in rows].count("prefill") == 2
    pool = data["pool_gib"]
    for r in rows:
        assert r["compile_s"] > 0 and r["temp_gib"] >= 0
        if r["kind"] in ("decode", "prefill"):
            assert abs(r["alias_gib"] - pool) < 1e-6 * max(pool, 1), r      # the pool is updated in place
    assert json.loads((tmp_path / "program_memory.json").read_text())["programs"] == rows
    assert "| decode | 4 x " in (tmp_path / "program_memory.md").read_text()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        program_memory.main(["--kinds", "decode,verify", "--out", str(tmp_path)])
    importlib.import_module("jax")    # imported: flags given now would not apply
    with pytest.raises(SystemExit):
        program_memory.main(["--xla-flags=--xla_disable_hlo_passes=rematerialization", "--out", str(tmp_path)])
