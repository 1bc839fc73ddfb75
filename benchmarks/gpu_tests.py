"""The `gpu`- and `cuda`-marked pytest suite (`-m "gpu or cuda"`: tests that need a GPU, and those that run on
one when there is one), each test file in a process of its own, and one summary table.

    python3 -m benchmarks.gpu_tests --part 1/4 --out OUTDIR       # one of four parts (~8 minutes each)
    python3 -m benchmarks.gpu_tests --files tests/wise_jax/test_jax_gpu.py --out OUTDIR
    python3 -m benchmarks.gpu_tests --parity 540 --out OUTDIR     # `python3 -m parity` as one row
    python3 -m benchmarks.gpu_tests --summarize OUTDIR [OUTDIR...] --out benchmarks/results/DIR

A CUDA fault, a poisoned context or a hung compile in one file cannot fail the files after it: each
runs as `pytest -m "gpu or cuda" FILE` in a fresh process under its own time limit (--file-timeout, or the
file's entry in FILE_SECONDS), with JAX's persistent compilation cache in OUTDIR/jax-cache so that
files sharing programs compile them once. The files are those where pytest collects a `gpu` test
(`--collect-only -m "gpu or cuda"`, run in a process of its own), split into parts by FILE_SECONDS so that a
part fits one ~9-minute run. Each file's junit XML gives its passed / failed / skipped counts and
every skip's reason; OUTDIR/gpu_tests.json and .md hold the table (one row a file, the failures
and skips named), with the machine, the versions, the date and the commit. --summarize merges the
JSON of several parts' OUTDIRs into one table. --parity SECONDS runs the parity suite (`python3 -m
parity`, full shapes) in a process of its own under that limit, after the files, as one more row:
its passed / failed / skipped cases from its JSON (OUTDIR/parity.json), the checks it did not reach
named as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEM = "gpu_tests"
# Seconds a file's gpu tests took on an H100 (2026-12-07) or are expected to take (compiles
# included): the parts are balanced by them; a file not named here counts DEFAULT_SECONDS.
# test_mosaic_decode.py: its first 8 gpu tests (about 11 kernel compiles) took 100 s; the 17 it
# has since issue 46 compile about 44 variants (it had about 120).
FILE_SECONDS = {
    "tests/wise_jax/test_mosaic_decode.py": 330,
    "tests/wise_jax/test_pallas_decode.py": 180,   # 150 on an H100 before its fp8 cases
    "tests/wise_jax/test_jax_gpu.py": 150,
    "tests/wise_jax/test_jax_selection_in_generate.py": 90,
    "tests/parity/test_kernels_in_generate_gpu.py": 120,
    "tests/parity/test_parity_gpu.py": 90,
    "tests/wise_torch/test_torch_gpu.py": 120,
    "tests/wise_torch/test_torch_speculative_gpu.py": 120,
    "tests/wise_torch/test_triton_decode.py": 120,   # 90 on an H100 before its fp8 cases
    "tests/parity/test_decode_contract.py": 120,   # the gpu suite's jax-tests part gave it 120 s
}
DEFAULT_SECONDS = 60
SELECT = "gpu or cuda"   # the tests the suite runs: needing a GPU, or running on one when there is one
PARITY = "python3 -m parity"   # the parity suite's row in the table


def collect(timeout: float) -> dict[str, int]:
    """{test file: number of gpu tests pytest collects in it}, from a collection in its own process."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", SELECT, "tests",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    counts: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        if "::" in line and line.startswith("tests/"):
            path = line.split("::", 1)[0]
            counts[path] = counts.get(path, 0) + 1
    if not counts:
        raise RuntimeError(f"pytest collected no gpu test (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    return counts


def split_parts(files: list[str], parts: int) -> list[list[str]]:
    """`files` in `parts` groups of about equal FILE_SECONDS (longest first, each to the lightest part)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for path in sorted(files, key=lambda f: (-FILE_SECONDS.get(f, DEFAULT_SECONDS), f)):
        lightest = loads.index(min(loads))
        groups[lightest].append(path)
        loads[lightest] += FILE_SECONDS.get(path, DEFAULT_SECONDS)
    return [sorted(g) for g in groups]


def junit_counts(xml: Path) -> dict:
    """passed / failed / errors / skipped counts and the failed and skipped tests (with reasons)."""
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    result = dict(passed=0, failed=0, errors=0, skipped=0, failures=[], skips=[])
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        failure, error, skip = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None:
            result["failed"] += 1
            result["failures"].append(f"{name}: {(failure.get('message') or '')[:300]}")
        elif error is not None:
            result["errors"] += 1
            result["failures"].append(f"{name} (error): {(error.get('message') or '')[:300]}")
        elif skip is not None:
            result["skipped"] += 1
            result["skips"].append(f"{name}: {(skip.get('message') or '')[:200]}")
        else:
            result["passed"] += 1
    return result


def run_logged(cmd: list[str], log: Path, timeout: float, extra_env: dict) -> int | str:
    """cmd from the project root, its output to `log` -> its exit status, or "timeout"."""
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **extra_env}).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def parity_counts(record: dict) -> dict:
    """passed / failed / errors / skipped counts and the failed and skipped cases (with their
    details) of a `python3 -m parity --json` record; a record of a run that did not reach every
    check says so among the failures."""
    result = dict(passed=0, failed=0, errors=0, skipped=0, failures=[], skips=[])
    for row in record["results"]:
        name = f"{row['check']} {row['impl']} {row['case']} {row['dtype']}"
        if row["status"] == "pass":
            result["passed"] += 1
        elif row["status"] == "skip":
            result["skipped"] += 1
            result["skips"].append(f"{name}: {(row.get('detail') or '')[:200]}")
        else:
            result["failed"] += 1
            result["failures"].append(f"{name}: {(row.get('detail') or '')[:300]}")
    if not record.get("complete", True):
        result["failures"].append(f"parity did not reach every check ({len(record['results'])} cases ran)")
    return result


def run_row(name: str, cmd: list[str], report: Path, read, log: Path, timeout: float, extra_env: dict) -> dict:
    """Run `cmd` in a process of its own (output to `log`) -> the table's row `name`: the counts
    `read(report)` gives, or a failure naming the log's end when the report is missing."""
    start = time.perf_counter()
    code = run_logged(cmd, log, timeout, extra_env)
    row = dict(file=name, exit=code, seconds=round(time.perf_counter() - start, 1))
    if report.exists():
        row.update(read(report))
    else:
        row.update(passed=0, failed=0, errors=0, skipped=0, skips=[],
                   failures=[f"no report (exit {code}); see {log.name}: "
                             + " | ".join(log.read_text(errors="replace").splitlines()[-5:])])
    if code == "timeout":
        row["failures"].append(f"{name} did not finish in {timeout:.0f} s (what came after its last report did "
                               "not run)")
    return row


def run_parity(out: Path, timeout: float, extra_env: dict) -> dict:
    """The parity suite (full shapes) in a process of its own -> its row of the table."""
    report = out / "parity.json"
    return run_row(PARITY, [sys.executable, "-m", "parity", "--json", str(report.resolve()), "--details", "failures"],
                   report, lambda r: parity_counts(json.loads(r.read_text())), out / "parity.log", timeout, extra_env)


def run_file(path: str, out: Path, timeout: float, extra_env: dict) -> dict:
    """`pytest -m "gpu or cuda" path` in a process of its own -> its row of the table."""
    stem = path.replace("/", "__").removesuffix(".py")
    xml = out / f"{stem}.xml"
    return run_row(path, [sys.executable, "-m", "pytest", "-q", "-m", SELECT, path, "-p", "no:cacheprovider", "-rfEs",
                          f"--junitxml={xml}"], xml, junit_counts, out / f"{stem}.log", timeout, extra_env)


def machine() -> dict:
    info = dict(python=platform.python_version(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    try:
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        info["gpu"] = "none"
    for name in ("torch", "triton", "jax"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "missing"
    try:
        import flash_attn.cute  # noqa: F401
        info["flash_attn_cute"] = "importable"
    except ImportError as e:
        info["flash_attn_cute"] = f"missing ({e})"
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip() or os.environ.get("WISE_COMMIT", "unknown")
    return info


def table(rows: list[dict], info: dict) -> str:
    total = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "errors", "skipped")}
    lines = ["# gpu tests, one process per file", "",
             f"{info.get('gpu')}; Python {info.get('python')}, torch {info.get('torch')}, triton {info.get('triton')}, "
             f"jax {info.get('jax')}; flash_attn.cute {info.get('flash_attn_cute')}; commit {info.get('commit')}; "
             f"{info.get('date')}", "",
             f"Total: {total['passed']} passed, {total['failed']} failed, {total['errors']} errors, "
             f"{total['skipped']} skipped in {len(rows)} files.", "",
             "| file | passed | failed | errors | skipped | seconds | exit |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | "
                     f"{r['seconds']} | {r['exit']} |")
    for title, key in (("Failures", "failures"), ("Skips (each with its reason)", "skips")):
        named = [f"- {item}" for r in rows for item in r[key]]
        if named:
            lines += ["", f"## {title}", ""] + named
    return "\n".join(lines) + "\n"


def write(rows: list[dict], info: dict, out: Path) -> None:
    (out / f"{STEM}.json").write_text(json.dumps(dict(machine=info, files=rows), indent=1))
    (out / f"{STEM}.md").write_text(table(rows, info))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", help="K/N: the K-th of N parts (1-based) of the collected files")
    p.add_argument("--files", nargs="+", help="these test files instead of the collected ones")
    p.add_argument("--file-timeout", type=float, help="seconds per file (default: 1.5 x its FILE_SECONDS)")
    p.add_argument("--summarize", nargs="+", type=Path, help="merge the gpu_tests.json of these OUTDIRs")
    p.add_argument("--parity", type=float, metavar="SECONDS",
                   help="also run `python3 -m parity` under this limit (alone unless --part or --files is given)")
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        parts = [json.loads((d / f"{STEM}.json").read_text()) for d in args.summarize]
        rows = sorted((r for part in parts for r in part["files"]), key=lambda r: r["file"])
        write(rows, parts[0]["machine"], args.out)
        print(table(rows, parts[0]["machine"]))
        return
    files = args.files
    if files is None and args.parity and not args.part:
        files = []
    if files is None:
        files = sorted(collect(timeout=300))
        if args.part:
            k, n = (int(x) for x in args.part.split("/"))
            groups = split_parts(files, n)
            if args.list:
                for i, g in enumerate(groups, 1):
                    print(f"part {i}/{n} ({sum(FILE_SECONDS.get(f, DEFAULT_SECONDS) for f in g)} s):", " ".join(g))
                return
            files = groups[k - 1]
    env = {"JAX_COMPILATION_CACHE_DIR": str((args.out / "jax-cache").resolve()),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    info, rows = machine(), []
    for path in files:
        timeout = args.file_timeout or 1.5 * FILE_SECONDS.get(path, DEFAULT_SECONDS)
        row = run_file(path, args.out, timeout, env)
        rows.append(row)
        print(f"{path}: {row['passed']} passed, {row['failed']} failed, {row['errors']} errors, "
              f"{row['skipped']} skipped, {row['seconds']} s, exit {row['exit']}", flush=True)
        write(rows, info, args.out)
    if args.parity:
        rows.append(run_parity(args.out, args.parity, env))
        row = rows[-1]
        print(f"{PARITY}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped, "
              f"{row['seconds']} s, exit {row['exit']}", flush=True)
    write(rows, info, args.out)


if __name__ == "__main__":
    main()
