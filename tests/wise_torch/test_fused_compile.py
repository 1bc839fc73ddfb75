"""The fused kernels compile for the H200 (sm90) on a machine without a GPU.

CI runs them only in Triton's interpreter; this compiles the real launches at Ouro-1.4B shapes
(bf16; fp32 and a GQA RoPE besides) to cubins in a subprocess without TRITON_INTERPRET and
checks the PTX for what the numerics rest on: no fused multiply-add outside libdevice (fp
contraction off: every product and sum rounded once, as torch's eager kernels do), IEEE division
in SiLU, and for speed 16-byte global loads and no register spills.
"""

from __future__ import annotations

import pytest
import torch

from triton_compile_cases import compile_offline, resources

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile it for real")

SCRIPT = r"""
from wise_torch.kernels import fused as F


def launches(dtype, n=64, hidden=2048, inter=5632, heads=16, kv_heads=16, head_dim=128):
    x = torch.empty(n, hidden, dtype=dtype)
    w = torch.empty(hidden, dtype=dtype)
    ints = torch.empty(n, dtype=torch.int64)
    plane = torch.empty(200, 128, kv_heads, head_dim, dtype=dtype)
    qkv = torch.empty(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    return {
        "rms_norm": F.rms_norm_launch(x, w, 1e-6, torch.empty_like(x)),
        "add_rms_norm": F.add_rms_norm_launch(x, x, w, w, w, 1e-6, torch.empty_like(x), torch.empty_like(x)),
        "rope_store_kv": F.rope_store_kv_launch(qkv, ints, torch.empty(4096, head_dim), plane, plane, ints,
                                                torch.empty(n, heads, head_dim, dtype=dtype),
                                                heads=heads, kv_heads=kv_heads, head_dim=head_dim),
        "silu_mul": F.silu_mul_launch(torch.empty(n, 2 * inter, dtype=dtype), torch.empty(n, inter, dtype=dtype)),
    }


cases = {f"bf16/{k}": v for k, v in launches(torch.bfloat16).items()}
cases.update({f"fp32/{k}": v for k, v in launches(torch.float32).items()})
cases["bf16-gqa-d64/rope_store_kv"] = launches(torch.bfloat16, heads=8, kv_heads=2, head_dim=64)["rope_store_kv"]
results = {}
for name, launch in cases.items():
    c = compiled(launch)
    ptx = c.asm["ptx"]
    results[name] = dict(
        cubin=len(c.asm["cubin"]), usage=usage_of(c.asm["cubin"]),
        fma=len(re.findall(r"\bfma\.[a-z.]*f32", ptx)),
        div_rn=ptx.count("div.rn.f32"), div_approx=len(re.findall(r"div\.(full|approx)", ptx)),
        wide_loads=ptx.count("ld.global.v4"), atomics=ptx.count("atom."))
print(json.dumps(results))
"""


def test_fused_kernels_compile_for_sm90():
    results = compile_offline(SCRIPT)
    ops = ("rms_norm", "add_rms_norm", "rope_store_kv", "silu_mul")
    assert sorted(results) == sorted([f"{d}/{op}" for d in ("bf16", "fp32") for op in ops]
                                     + ["bf16-gqa-d64/rope_store_kv"])
    for name, facts in results.items():
        assert facts["cubin"] > 0 and facts["atomics"] == 0, (name, facts)
        usage = resources(facts.pop("usage"))
        assert usage["LOCAL"] == usage["STACK"] == 0, f"{name} spills to local memory: {usage}"
        assert facts["div_approx"] == 0, f"{name}: approximate division: {facts}"
        if not name.endswith("silu_mul"):  # libdevice's expf uses fma internally
            assert facts["fma"] == 0, f"{name}: a product and sum fused (fp contraction on): {facts}"
        if name.startswith("bf16/"):  # 16-byte loads: 8 bf16 per thread per access
            assert facts["wide_loads"] >= 2, (name, facts)
    for dtype in ("bf16", "fp32"):
        assert results[f"{dtype}/silu_mul"]["div_rn"] > 0  # IEEE division, as torch's x / (1 + exp(-x))
