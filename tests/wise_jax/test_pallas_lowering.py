"""The Pallas decode kernels lower for CUDA, and their Triton IR compiles for sm90, on a CPU.

Interpret mode (test_pallas_decode.py) checks what the kernels compute; these tests check what
the H200 will compile, at Ouro-1.4B attention shapes: jax lowers each pallas_call to Triton IR
without a GPU (jax <= 0.10 hands that IR to XLA; from 0.11 lowering also compiles it, which
needs the CUDA plugin, so there the GPU tests cover it), and the Triton compiler (the `triton`
package) takes that IR through to a cubin for sm90.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from wise_jax.kernels import pallas_decode
from wise_jax.kernels.pallas_decode import config_for

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or jax.__version_info__ >= (0, 11),
    reason="cross-lowering for CUDA is checked on a CPU machine with jax <= 0.10")

SHAPES = {  # batch, heads, kv_heads, head_dim, page_size, max_pages, dtype
    "ouro-1k-x64": (64, 16, 16, 128, 128, 8, jnp.bfloat16),
    "gqa-d64-f32": (4, 8, 2, 64, 32, 40, jnp.float32),
    "huginn-1k-x32": (32, 55, 55, 96, 128, 8, jnp.bfloat16),  # head_dim 96: 128-lane tiles, padded lanes masked
}


def lower_for_cuda(name, fused_finish=False, fp8=False):
    """fp8: K/V pages of uint8 codes with float32 scales (the call's k_scale, v_scale)."""
    batch, heads, kv_heads, head_dim, page_size, max_pages, dtype = SHAPES[name]
    num_pages = batch * max_pages
    n_blocks = max_pages * page_size // 32
    config = dataclasses.replace(config_for(head_dim, dtype), fused_finish=fused_finish)
    pages = (num_pages, page_size, kv_heads, head_dim)
    args = (jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),
            jax.ShapeDtypeStruct(pages, jnp.uint8 if fp8 else dtype),
            jax.ShapeDtypeStruct(pages, jnp.uint8 if fp8 else dtype),
            jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, heads, n_blocks), jnp.bool_))
    args += (jax.ShapeDtypeStruct(pages[:-1], jnp.float32),) * 2 if fp8 else ()

    def call(*a):  # validate=False: an engine's decode step (a host callback cannot be cross-lowered)
        scales = dict(k_scale=a[7], v_scale=a[8]) if fp8 else {}
        return pallas_decode.decode_attention(*a[:7], block_size=32, eta=0.95, return_mass=True,
                                              interpret=False, config=config, validate=False, **scales)

    jax.clear_caches()
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", list(SHAPES))
def test_lowers_to_triton_kernels(name):
    text = lower_for_cuda(name)
    assert text.count("__gpu$xla.gpu.triton") == 2  # the split and the finish kernel
    assert "wise_decode_split" in text and "wise_decode_finish" in text
    # Nothing else runs on the device: no memset, no copy (the K/V reshapes are bitcasts).
    ops = collections.Counter(re.findall(r"= \"?(\w+\.\w+)", text))
    assert ops == {"stablehlo.custom_call": 2, "stablehlo.reshape": 2}, ops
    fused = lower_for_cuda(name, fused_finish=True)
    assert fused.count("__gpu$xla.gpu.triton") == 1 and "wise_decode_finish" not in fused


def triton_ir(monkeypatch, lower):
    """{kernel name (wise_decode_NAME): its Triton IR, without debug info} of the pallas_calls
    lower() lowers; returns (that, lower()'s text)."""
    from jax._src.pallas.triton import lowering
    modules = {}
    lower_module = lowering.lower_jaxpr_to_triton_module

    def keep_ir(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        asm = result.module.operation.get_asm(enable_debug_info=False)
        modules[re.search(r"wise_decode_(\w+)", asm).group(1)] = asm
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", keep_ir)
    text = lower()
    return modules, text


def test_padded_head_dim_lanes_are_masked(monkeypatch):
    """huginn-0125's head_dim 96 runs 128-lane tiles: every bf16 access of 128 lanes (q, K, V in
    the split kernel, the output in the finish) carries a mask, so no lane past head_dim is read
    or written (the IR's flat pointers would reach the next head's values)."""
    modules, _ = triton_ir(monkeypatch, lambda: lower_for_cuda("huginn-1k-x32"))
    for name, kernel in (("split", 3), ("finish", 1)):
        accesses = re.findall(r"tt\.(load|store) ([^:\n]*) : tensor<(?:\d+x)*128x!tt\.ptr<bf16>>", modules[name])
        loads = [operands for op, operands in accesses if op == "load"]
        stores = [operands for op, operands in accesses if op == "store"]
        assert len(loads) >= kernel, (name, accesses)  # split: q, K, V; finish: the masked store's old values
        assert all(operands.count("%") >= 2 for operands in loads), (name, loads)        # pointer, mask
        assert all(operands.count("%") == 3 for operands in stores), (name, stores)     # pointer, value, mask
        assert len(stores) == (1 if name == "finish" else 0), (name, stores)


def compile_kernels_for_sm90(tmp_path, monkeypatch, lower, lowered: dict | None = None):
    """Run lower() (returns the lowered text) capturing each Pallas kernel's Triton IR, and
    compile each through to a cubin for sm90; returns the kernels' names (wise_decode_NAME).
    lowered: filled with {"ir": the kernels' Triton IR by name, "text": lower()'s text}."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    modules, text = triton_ir(monkeypatch, lower)
    if lowered is not None:
        lowered.update(ir=modules, text=text)
    launch = {name: (int(warps), int(stages)) for name, stages, warps in re.findall(
        r'name = "wise_decode_(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    assert sorted(launch) == sorted(modules)
    for name, asm in modules.items():
        path = tmp_path / f"{name}.ttir"
        path.write_text(asm)
        num_warps, num_stages = launch[name]
        kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        assert kernel.asm["cubin"], f"{name}: no cubin"
    return sorted(modules)


@pytest.mark.parametrize("name, fused_finish", [("ouro-1k-x64", False), ("ouro-1k-x64", True),
                                                ("huginn-1k-x32", False)])
def test_triton_ir_compiles_for_sm90(tmp_path, monkeypatch, name, fused_finish):
    kernels = compile_kernels_for_sm90(tmp_path, monkeypatch, lambda: lower_for_cuda(name, fused_finish))
    assert kernels == (["split"] if fused_finish else ["finish", "split"])


def test_fp8_pages_lower_and_compile_for_sm90(tmp_path, monkeypatch):
    """The split kernel reading fp8 pages (one-byte code loads, float32 scales, the e4m3fn
    decode in registers) through to a cubin for sm90, at Ouro-1.4B's shape (bf16 dots); nothing
    but the two kernels and the reshapes of the codes and scales runs on the device."""
    lowered = {}
    kernels = compile_kernels_for_sm90(tmp_path, monkeypatch, lambda: lower_for_cuda("ouro-1k-x64", fp8=True),
                                       lowered)
    assert kernels == ["finish", "split"]
    assert re.search(r"tt\.load [^\n]*tensor<(?:\d+x)*\d+x!tt\.ptr<i8>>", lowered["ir"]["split"])   # the codes
    ops = collections.Counter(re.findall(r"= \"?(\w+\.\w+)", lowered["text"]))
    assert ops == {"stablehlo.custom_call": 2, "stablehlo.reshape": 4}, ops


@pytest.mark.parametrize("list_launch", [False, True])
def test_mosaic_path_triton_kernels_compile_for_sm90(tmp_path, monkeypatch, list_launch):
    """mosaic_decode's Triton-lowered launches (the finish; with list_launch also the list)
    through to cubins."""
    from test_mosaic_decode import lower_for_cuda as lower_mosaic
    from wise_jax.kernels.mosaic_decode import MosaicConfig
    jax.clear_caches()
    config = MosaicConfig(list_launch=list_launch)
    kernels = compile_kernels_for_sm90(tmp_path, monkeypatch, lambda: lower_mosaic(20, 4096, config))
    assert kernels == (["finish", "list"] if list_launch else ["finish"])
