"""benchmarks.gpu_tests without a GPU: parts balanced by FILE_SECONDS, a file's counts and named
failures and skips from its junit XML (written by a real pytest run), parity's counts from its
JSON record, and --summarize merging the parts' tables into one."""

import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks import gpu_tests

SECONDS = {"a.py": 300, "b.py": 200, "c.py": 150, "d.py": 100, "e.py": 90}


@pytest.fixture
def file_seconds(monkeypatch):
    monkeypatch.setattr(gpu_tests, "FILE_SECONDS", SECONDS)
    monkeypatch.setattr(gpu_tests, "DEFAULT_SECONDS", 60)


def load(group):
    return sum(gpu_tests.FILE_SECONDS.get(f, gpu_tests.DEFAULT_SECONDS) for f in group)


def test_split_parts_balances_the_seconds(file_seconds):
    files = sorted(SECONDS) + ["f.py", "g.py"]   # the last two count DEFAULT_SECONDS
    parts = gpu_tests.split_parts(files, 3)
    assert sorted(f for part in parts for f in part) == files   # each file in one part
    assert all(part == sorted(part) for part in parts)
    # Longest first, each to the lightest part (ties: the first): a | b, then e, g | c, then d, f.
    assert parts == [["a.py"], ["b.py", "e.py", "g.py"], ["c.py", "d.py", "f.py"]]
    assert list(map(load, parts)) == [300, 350, 310]
    assert gpu_tests.split_parts(list(reversed(files)), 3) == parts   # the order given does not matter


def test_split_parts_more_parts_than_files(file_seconds):
    parts = gpu_tests.split_parts(["a.py", "b.py"], 4)
    assert sorted(map(tuple, parts)) == [(), (), ("a.py",), ("b.py",)]


JUNIT_TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("needs a CUDA GPU")

def test_errors(broken):
    pass
'''


def test_junit_counts_of_a_real_pytest_run(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(JUNIT_TESTS))
    xml = tmp_path / "sample.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "test_sample.py", "-p", "no:cacheprovider",
                    f"--junitxml={xml}"], cwd=tmp_path, capture_output=True, timeout=120)
    counts = gpu_tests.junit_counts(xml)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == dict(
        passed=1, failed=1, errors=1, skipped=1)
    [failure, error] = counts["failures"]
    assert failure.startswith("test_sample::test_fails: ") and "one is not two" in failure
    assert error.startswith("test_sample::test_errors (error): ") and "fixture broke" in error
    assert counts["skips"] == ["test_sample::test_skips: needs a CUDA GPU"]


def parity_record(complete=True):
    row = dict(check="end-to-end", impl="torch-triton|jax-pallas", case="medium-random dense", dtype="float32")
    return dict(complete=complete, results=[
        dict(row, status="pass", detail="32 tokens identical"),
        dict(row, status="FAIL", detail="token 3 differs"),
        dict(row, impl="torch-fa4", status="skip", detail="No module named 'flash_attn'")])


def test_parity_counts_name_failures_skips_and_an_unfinished_run():
    counts = gpu_tests.parity_counts(parity_record())
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == dict(
        passed=1, failed=1, errors=0, skipped=1)
    assert counts["failures"] == ["end-to-end torch-triton|jax-pallas medium-random dense float32: token 3 differs"]
    assert counts["skips"] == ["end-to-end torch-fa4 medium-random dense float32: No module named 'flash_attn'"]
    unfinished = gpu_tests.parity_counts(parity_record(complete=False))
    assert unfinished["failures"][-1] == "parity did not reach every check (3 cases ran)"


def row(path, **counts):
    return dict(dict(file=path, exit=0, seconds=1.0, passed=0, failed=0, errors=0, skipped=0, failures=[],
                     skips=[]), **counts)


def test_summarize_merges_the_parts(tmp_path, monkeypatch, capsys):
    machine = dict(gpu="NVIDIA H100 80GB HBM3", python="3.12.3", commit="abc1234", date="2026-12-08T10:00:00Z")
    parts = {"gpu_tests_1": [row("tests/b.py", passed=3), row("tests/a.py", passed=2, skipped=1,
                                                                   skips=["tests.a::t: needs two GPUs"])],
             "gpu_tests_parity": [row(gpu_tests.PARITY, passed=100, failed=1, exit=1,
                                      failures=["end-to-end x: token 3 differs"])]}
    for name, rows in parts.items():
        (tmp_path / name).mkdir()
        gpu_tests.write(rows, machine, tmp_path / name)
    monkeypatch.setattr(sys, "argv", ["gpu_tests", "--summarize", *(str(tmp_path / n) for n in parts),
                                      "--out", str(tmp_path)])
    gpu_tests.main()
    merged = json.loads((tmp_path / "gpu_tests.json").read_text())
    assert [r["file"] for r in merged["files"]] == [gpu_tests.PARITY, "tests/a.py", "tests/b.py"]
    assert merged["machine"] == machine
    summary = (tmp_path / "gpu_tests.md").read_text()
    assert summary == capsys.readouterr().out.removesuffix("\n")
    assert "Total: 105 passed, 1 failed, 0 errors, 1 skipped in 3 files." in summary
    assert "- tests.a::t: needs two GPUs" in summary and "- end-to-end x: token 3 differs" in summary
