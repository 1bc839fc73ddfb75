"""The decode kernel compiles for the H200 (sm90) on a machine without a GPU.

CI runs the kernel only in Triton's interpreter, which accepts code the GPU compiler rejects; this
compiles the real launches (MHA bf16 at the benchmark's shape, GQA bf16 on tensor cores, fp32
with mass, huginn-0125's MHA of head_dim 96 on 128-lane tiles; each the split and the finish
kernel; and MHA and GQA bf16 over fp8 pages at `config_for(..., "fp8")`, their split kernel) to a
cubin in a subprocess without TRITON_INTERPRET, and checks the PTX for 16-byte K/V loads or
copies (the alignment hint), the absence of atomics (the launch boundary orders the merge) and,
with cuobjdump, that the benchmark's split kernels (and the fp8 ones) do not spill registers.
"""

from __future__ import annotations

import pytest
import torch

from triton_compile_cases import compile_offline, resources

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile it for real")

SCRIPT = r"""
from wise_torch.kernels import triton_decode as td

results = {}
for name, (batch, heads, kv_heads, dim, ctx, page, dtype, return_mass, fp8) in {
        "mha-bf16-d128": (10, 16, 16, 128, 8192, 128, torch.bfloat16, False, False),
        "gqa-bf16-d128": (4, 16, 4, 128, 2048, 64, torch.bfloat16, False, False),
        "gqa-fp32-d64": (4, 4, 2, 64, 1024, 32, torch.float32, True, False),
        "mha-bf16-d96": (8, 55, 55, 96, 4096, 128, torch.bfloat16, False, False),
        "mha-bf16-d128-fp8": (10, 16, 16, 128, 8192, 128, torch.bfloat16, False, True),
        "gqa-bf16-d128-fp8": (4, 16, 4, 128, 2048, 64, torch.bfloat16, False, True)}.items():
    blocks = ctx // 32
    q = torch.empty(batch, heads, dim, dtype=dtype)
    k = torch.empty(batch * ctx // page, page, kv_heads, dim, dtype=torch.uint8 if fp8 else dtype)
    scales = dict(k_scale=torch.empty(k.shape[:-1]), v_scale=torch.empty(k.shape[:-1])) if fp8 else {}
    support = torch.zeros(batch, heads, blocks, dtype=torch.bool)
    ws = td.DecodeWorkspace.allocate(batch, heads, kv_heads, dim, blocks, dtype=dtype, device="cpu",
                                     config=td.config_for(dim, dtype, "fp8" if fp8 else "auto"))
    ints = lambda *shape: torch.zeros(shape, dtype=torch.int32)
    launches = td.kernel_launches(
        q, k, torch.empty_like(k), ints(batch, ctx // page), ints(batch), ints(batch), support,
        ws.out[:batch], ws.mass[:batch], ws, scale=dim ** -0.5, eta=0.95, return_mass=return_mass, **scales)
    for launch in launches[:1] if fp8 else launches:     # fp8 pages change the split kernel only
        c = compiled(launch)
        ptx = c.asm["ptx"]
        wide = ptx.count("ld.global.v4.b32") + len(re.findall(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx))
        results[f"{name}/{launch[0].fn.__name__}"] = dict(
            cubin=len(c.asm["cubin"]), wide_loads=wide, atomics=ptx.count("atom."), usage=usage_of(c.asm["cubin"]))
print(json.dumps(results))
"""


def test_resources_refuses_what_it_cannot_read():
    line = "Function _split_kernel:\n REG:96 STACK:0 SHARED:0 LOCAL:8 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    assert resources(line) == {"REG": 96, "STACK": 0, "SHARED": 0, "LOCAL": 8}
    for garbage in ("", "cuobjdump fatal: Could not open input file"):
        with pytest.raises(ValueError, match="did not parse"):
            resources(garbage)


def test_kernel_compiles_for_sm90():
    results = compile_offline(SCRIPT)
    want = [f"{name}/{kernel}" for name in ("gqa-bf16-d128", "gqa-fp32-d64", "mha-bf16-d128", "mha-bf16-d96")
            for kernel in ("_finish_kernel", "_split_kernel")]
    want += ["mha-bf16-d128-fp8/_split_kernel", "gqa-bf16-d128-fp8/_split_kernel"]
    assert sorted(results) == sorted(want)
    for name, facts in results.items():
        assert facts["cubin"] > 0, name
        assert facts["atomics"] == 0, f"{name}: the launch boundary orders the merge, no atomics"
    # The benchmark's launch, Huginn's and fp8 pages': registers, no spills to local memory.
    for name in ("mha-bf16-d128", "mha-bf16-d96", "mha-bf16-d128-fp8", "gqa-bf16-d128-fp8"):
        split = results[f"{name}/_split_kernel"]
        usage = resources(split["usage"])
        assert usage["REG"] > 0 and usage["LOCAL"] == 0 and usage["STACK"] == 0, (name, usage)
        if name.endswith("fp8"):
            continue
        # [64 keys, 128 dims] bf16 K and V tiles over 128 threads: 8 rows of 16 bytes each per thread,
        # loaded to registers (ld.global.v4) or copied to shared memory (cp.async of 16 bytes); head_dim
        # 96's tiles are 128 lanes wide, the lane mask constant over each 16-byte vector.
        assert split["wide_loads"] >= 16, (name, split)
