"""Helpers of the tests that compile Triton kernels for the H200 (sm90) on a machine without a GPU
(a module, not a test file): `compile_offline(body)` runs `PRELUDE` and then `body`, a script that
prints its results as one JSON line, in a subprocess without TRITON_INTERPRET; `resources` reads
the cuobjdump resource usage it reports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PRELUDE = r"""
import json, os, re, subprocess, sys, tempfile
import torch
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as e:
    print(json.dumps({"skip": f"this triton has no offline compile API: {e}"}))
    sys.exit(0)

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compiled(launch):
    # a (kernel, grid, args, kwargs) launch compiled for the target
    kernel, grid, args, kwargs = launch
    bound, spec, options = create_function_from_signature(kernel.signature, kernel.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def usage_of(cubin):
    # cuobjdump's resource usage of the cubin, as text (parsed by the test: `resources`)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
    return done.stdout + done.stderr
"""
"""What every compile script starts with: the sm90 target and backend, `compiled(launch)` and
`usage_of(cubin)`; a Triton without the offline compile API prints {"skip": why} and exits."""


def compile_offline(body: str) -> dict:
    """The JSON results `PRELUDE + body` prints, run in a subprocess of the repository without
    TRITON_INTERPRET (the compiler, not the interpreter); a skip where Triton cannot compile
    offline."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


def resources(usage: str) -> dict[str, int]:
    """cuobjdump -res-usage text -> {"REG": registers per thread, "STACK", "SHARED", "LOCAL": bytes
    of local memory (spills)}; ValueError when it says none of them (a check that cannot read
    the usage must not pass)."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise ValueError(f"cuobjdump's resource usage did not parse: {usage[:300]!r}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, found.groups())))
