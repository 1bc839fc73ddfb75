"""`python -m parity` / `wise parity`: run the checks, print the table, optionally write JSON.

Only argparse is imported here; torch, jax and the checks load when the suite runs.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, as CI runs them on CPU (default: full shapes, bf16 "
                             "end to end on a GPU)")
    parser.add_argument("--json", metavar="PATH", help="also write the results, machine, versions and date here")
    parser.add_argument("--check", action="append", metavar="NAME",
                        help="run only this check (repeatable; see --list)")
    parser.add_argument("--details", choices=("failures", "all", "none"), default="failures",
                        help="detail lines under the table rows (default: under failures and skips)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")


def run(args: argparse.Namespace) -> int:
    """Run the suite for parsed arguments; 0 when nothing failed, 1 otherwise."""
    from parity import report
    from parity.checks import CHECKS, Result
    from parity.suite import Suite

    if args.list:
        for check in CHECKS.values():
            print(f"{check.name:22s} {check.summary}")
        return 0
    unknown = sorted(set(args.check or ()) - set(CHECKS))
    if unknown:
        print(f"parity: unknown check(s) {unknown}; choose from {sorted(CHECKS)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        suite = Suite(quick=args.quick)
    except RuntimeError as e:  # e.g. torch sees CUDA but JAX has no GPU backend
        print(f"parity: {e}", file=sys.stderr)
        return 2
    if suite.settings.device == "cpu" and not args.quick:
        print("parity: no GPU: full shapes run the Triton and Pallas kernels in their interpreters (slow); "
              "--quick runs the CI shapes", file=sys.stderr)
    results = [Result(None, detail=reason, check="implementations", impl=name, case="-", dtype="-")
               for name, reason in suite.unavailable.items()]
    names = args.check or list(CHECKS)
    for n, name in enumerate(names):
        check_start = time.perf_counter()
        found = CHECKS[name].run(suite)
        print(f"parity: {name}: {report.summary(found)} in {time.perf_counter() - check_start:.1f} s",
              file=sys.stderr, flush=True)
        results += found
        if args.json:  # after every check, so an interrupted run still leaves its results
            report.write_json(args.json, report.record(results, suite.settings, suite.unavailable,
                                                       time.perf_counter() - start, complete=n + 1 == len(names)))
    seconds = time.perf_counter() - start
    print(report.table(results, details=args.details))
    print(f"\n{report.summary(results)} in {seconds:.1f} s "
          f"({', '.join(i.name for i in suite.impls)} on torch {suite.settings.device})")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if all(r.passed is not False for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity", description=(
        "Check that the PyTorch and JAX implementations of wise compute the same thing, and that "
        "WISE with every block selected is exactly dense decode."))
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
