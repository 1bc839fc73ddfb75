"""benchmarks/results keeps, per run, what a reader needs to check a figure -- the reports'
markdown and JSON, and a PNG where it helps -- and nothing else (no logs, compiler dumps,
diffs or scripts); INDEX.md, the one place for current numbers, points every row at a file
that exists. Both checks are shown to fail on planted input."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
REPORT_SUFFIXES = {".md", ".json", ".png"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def not_reports(files: list[str]) -> list[str]:
    """The files that are not a report's markdown, JSON or PNG."""
    return [f for f in files if Path(f).suffix not in REPORT_SUFFIXES]


def table_rows(markdown: str) -> list[str]:
    """The data rows of every table (not the header rows, not the separator rows)."""
    lines = markdown.splitlines()
    return [line for i, line in enumerate(lines)
            if line.startswith("|") and not line.startswith("|---")
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]


def index_problems(index: str, base: Path) -> list[str]:
    """Rows of `index` with no link, and links to files missing under `base`."""
    unlinked = [f"no link: {row[:80]}" for row in table_rows(index) if not LINK.search(row)]
    missing = [f"missing: {target}" for target in LINK.findall(index) if not (base / target.split("#")[0]).exists()]
    return unlinked + missing


def test_results_hold_reports_only():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    files = listing.stdout.split()
    assert len(files) > 100
    assert not_reports(files) == []


def test_every_index_row_points_to_a_file_that_exists():
    index = (RESULTS / "INDEX.md").read_text()
    assert len(table_rows(index)) > 30
    assert index_problems(index, RESULTS) == []


def test_the_checks_fail_on_a_log_a_dump_and_a_dangling_row(tmp_path):
    assert not_reports(["a/throughput.md", "a/throughput.json", "a/plot.png", "a/run.log", "a/k.ptx",
                        "a/probe.py", "a/fix.diff"]) == ["a/run.log", "a/k.ptx", "a/probe.py", "a/fix.diff"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.md").write_text("# report\n")
    index = ("| figure | value | folder |\n|---|---|---|\n| a | 1 | [run](run/report.md) |\n"
             "| b | 2 | [gone](gone/report.md) |\n| c | 3 | `run/` |\n")
    assert index_problems(index, tmp_path) == ["no link: | c | 3 | `run/` |", "missing: gone/report.md"]
