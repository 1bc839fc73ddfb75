"""The decode kernel compiles for the H200 (sm90) on a machine without a GPU.

CI runs the kernel only in Triton's interpreter, which accepts code the GPU compiler rejects; this
compiles the real launches (MHA bf16 at the benchmark's shape, GQA bf16 on tensor cores, fp32
with mass, huginn-0125's MHA of head_dim 96 on 128-lane tiles; each the split and the finish
kernel) to a cubin in a subprocess without
TRITON_INTERPRET, and checks the PTX for 16-byte K/V loads or copies (the alignment hint), the
absence of atomics (the launch boundary orders the merge) and, with cuobjdump, that the
benchmark's split kernel does not spill registers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile it for real")

SCRIPT = r"""
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
from wise_torch.kernels import triton_decode as td

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def usage_of(cubin):
    # cuobjdump's resource usage of the cubin, as text (parsed by the test)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
    return done.stdout + done.stderr


results = {}
for name, (batch, heads, kv_heads, dim, ctx, page, dtype, return_mass) in {
        "mha-bf16-d128": (10, 16, 16, 128, 8192, 128, torch.bfloat16, False),
        "gqa-bf16-d128": (4, 16, 4, 128, 2048, 64, torch.bfloat16, False),
        "gqa-fp32-d64": (4, 4, 2, 64, 1024, 32, torch.float32, True),
        "mha-bf16-d96": (8, 55, 55, 96, 4096, 128, torch.bfloat16, False)}.items():
    blocks = ctx // 32
    q = torch.empty(batch, heads, dim, dtype=dtype)
    k = torch.empty(batch * ctx // page, page, kv_heads, dim, dtype=dtype)
    support = torch.zeros(batch, heads, blocks, dtype=torch.bool)
    ws = td.DecodeWorkspace.allocate(batch, heads, kv_heads, dim, blocks, dtype=dtype, device="cpu")
    ints = lambda *shape: torch.zeros(shape, dtype=torch.int32)
    launches = td.kernel_launches(
        q, k, torch.empty_like(k), ints(batch, ctx // page), ints(batch), ints(batch), support,
        ws.out[:batch], ws.mass[:batch], ws, scale=dim ** -0.5, eta=0.95, return_mass=return_mass)
    for kernel, grid, args, kwargs in launches:
        bound, spec, options = create_function_from_signature(kernel.signature, kernel.params, backend)(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
        compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
        ptx = compiled.asm["ptx"]
        wide = ptx.count("ld.global.v4.b32") + len(re.findall(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx))
        results[f"{name}/{kernel.fn.__name__}"] = dict(
            cubin=len(compiled.asm["cubin"]), wide_loads=wide, atomics=ptx.count("atom."),
            usage=usage_of(compiled.asm["cubin"]))
print(json.dumps(results))
"""


def resources(usage: str) -> dict[str, int]:
    """cuobjdump -res-usage text -> {"REG": registers per thread, "STACK", "SHARED", "LOCAL": bytes
    of local memory (spills)}; ValueError when it says none of them (a check that cannot read
    the usage must not pass)."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise ValueError(f"cuobjdump's resource usage did not parse: {usage[:300]!r}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, found.groups())))


def test_resources_refuses_what_it_cannot_read():
    line = "Function _split_kernel:\n REG:96 STACK:0 SHARED:0 LOCAL:8 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    assert resources(line) == {"REG": 96, "STACK": 0, "SHARED": 0, "LOCAL": 8}
    for garbage in ("", "cuobjdump fatal: Could not open input file"):
        with pytest.raises(ValueError, match="did not parse"):
            resources(garbage)


def test_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(results["skip"])
    assert sorted(results) == [f"{name}/{kernel}" for name in ("gqa-bf16-d128", "gqa-fp32-d64", "mha-bf16-d128",
                                                               "mha-bf16-d96")
                               for kernel in ("_finish_kernel", "_split_kernel")]
    for name, facts in results.items():
        assert facts["cubin"] > 0, name
        assert facts["atomics"] == 0, f"{name}: the launch boundary orders the merge, no atomics"
    # The benchmark's launch and Huginn's: registers, no spills to local memory.
    for name in ("mha-bf16-d128", "mha-bf16-d96"):
        split = results[f"{name}/_split_kernel"]
        usage = resources(split["usage"])
        assert usage["REG"] > 0 and usage["LOCAL"] == 0 and usage["STACK"] == 0, (name, usage)
        # [64 keys, 128 dims] bf16 K and V tiles over 128 threads: 8 rows of 16 bytes each per thread,
        # loaded to registers (ld.global.v4) or copied to shared memory (cp.async of 16 bytes); head_dim
        # 96's tiles are 128 lanes wide, the lane mask constant over each 16-byte vector.
        assert split["wide_loads"] >= 16, (name, split)
