"""`python -m parity` and `wise parity`: table, JSON record, exit status, check selection."""

import json

import parity
from parity.checks import CHECKS, Check, Measured, Task
from wise import cli

HEADER = ["check", "implementation", "case", "dtype", "measured", "bound", "unit", "status"]


def test_json_record(tmp_path, capsys):
    path = tmp_path / "out" / "parity.json"
    assert parity.main(["--quick", "--check", "selection-spec", "--check", "convert", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == HEADER and f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert data["passed"] is True and data["quick"] is True and data["complete"] is True and data["date"]
    assert [r["check"] for r in data["results"]] == ["selection-spec"] * 2 + ["convert"] * 4
    assert all(r["status"] == "pass" and r["bound"] == 0 and r["measured"] == 0 for r in data["results"])
    assert data["versions"]["torch"] and data["versions"]["jax"] and data["versions"]["python"]
    assert data["machine"]["torch_device"] in ("cpu", "cuda") and data["machine"]["jax_backend"]


def test_failure_exits_1_with_details(monkeypatch, capsys):
    planted = Check("planted", "always fails", lambda suite: [
        Task("torch-x", "case-y", "float32", lambda: Measured(False, 3.0, 1.0, "max |diff|", "row 7 is off"))])
    monkeypatch.setitem(CHECKS, "planted", planted)
    assert cli.main(["parity", "--quick", "--check", "planted"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["planted", "torch-x", "case-y", "float32", "3", "1", "max", "|diff|", "FAIL"]
    assert lines[3].strip() == "row 7 is off"


def test_list_and_unknown_check(capsys):
    assert cli.main(["parity", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(CHECKS)
    assert parity.main(["--check", "no-such-check"]) == 2
    assert "unknown check(s) ['no-such-check']" in capsys.readouterr().err
