"""The `kv-quant` parity check: torch and JAX quantize the same K/V pages to the same fp8 bytes
and scales as each other and as the numpy specification (`wise_core.kv_quant`), bitwise, in
every cache dtype; and it fails, naming the array and the first differing value, when one
implementation computes x / scale by a division instead of the rule's multiplication by the
float32 reciprocal, or writes one byte otherwise. The fp8-pages rows' comparison of two engines'
pages (`parity.fp8.compare_pages`) fails on a misplaced vector or scale."""

import dataclasses

import numpy as np
import torch

from parity import kv_quant
from parity.checks import CHECKS
from parity.suite import Settings, Suite
from wise_core import kv_quant as spec


def kv_suite(quantizers=None) -> Suite:
    return Suite(dataclasses.replace(Settings.for_machine(quick=True), e2e=()), impls=[], quantizers=quantizers)


def test_kv_quant_rows_pass():
    results = CHECKS["kv-quant"].run(kv_suite())
    cases = kv_quant.kv_quant_cases(quick=True)
    assert len(results) == len(cases) * len(kv_quant.DTYPES) * 3
    failed = [f"{r.impl} {r.case} {r.dtype}: {r.detail}" for r in results if r.passed is not True]
    assert not failed, failed
    assert {r.impl for r in results} == {"torch|jax", "torch vs numpy-spec", "jax vs numpy-spec"}
    assert all(r.bound == 0 and r.measured == 0 for r in results)


def test_the_special_case_holds_what_it_names():
    special = next(c for c in kv_quant.kv_quant_cases(quick=True) if c.kind == "special")
    x = special.inputs("float32").reshape(-1, special.shape[-1])
    codes, scales = spec.quantize(x)
    assert scales[0] == scales[1] == scales[6] == 1.0 and codes[1].tolist() == [0x80] * special.shape[-1]
    assert np.all(codes[2] == spec.NAN_CODE) and np.all(codes[3] == spec.NAN_CODE)
    assert scales[5] == spec.MIN_SCALE and codes[8, :3].tolist() == [spec.NAN_CODE] * 3
    assert scales[10] == 1.0 and codes[10, 0] == 0x7E


def dividing_torch_quantizer() -> kv_quant.Quantizer:
    """torch computing y = x / scale (the division XLA would rewrite) instead of x * (1 / scale)."""
    def quantize(x):
        x32 = torch.from_numpy(np.asarray(x, np.float32).copy())
        _, scales = spec.quantize(x)
        y = (x32 / torch.from_numpy(scales).unsqueeze(-1)).clamp(-448, 448)
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8).masked_fill(~torch.isfinite(x32), spec.NAN_CODE)
        return codes.numpy(), scales
    honest = kv_quant.torch_quantizer("cpu")
    return kv_quant.Quantizer("torch", quantize, honest.dequantize)


def one_byte_off_jax_quantizer() -> kv_quant.Quantizer:
    honest = kv_quant.quantizers("cpu")["jax"]

    def quantize(x):
        codes, scales = honest.quantize(x)
        codes = codes.copy()
        codes.reshape(-1)[5] ^= 1
        return codes, scales
    return kv_quant.Quantizer("jax", quantize, honest.dequantize)


def test_a_division_fails_the_check_against_jax_and_the_spec():
    quantizers = kv_quant.quantizers("cpu") | {"torch": dividing_torch_quantizer()}
    results = CHECKS["kv-quant"].run(kv_suite(quantizers))
    failed = {(r.impl, r.case.split("-")[0], r.dtype) for r in results if r.passed is False}
    assert {("torch|jax", "edges", "float32"), ("torch vs numpy-spec", "edges", "float32")} <= failed
    assert not any(impl == "jax vs numpy-spec" for impl, _, _ in failed)
    bad = next(r for r in results if r.passed is False and r.impl == "torch vs numpy-spec" and "edges" in r.case)
    assert bad.detail.startswith("codes: ") and "values differ, first at" in bad.detail and bad.measured > 1000


def test_one_byte_off_fails_the_jax_rows_only():
    quantizers = kv_quant.quantizers("cpu") | {"jax": one_byte_off_jax_quantizer()}
    results = CHECKS["kv-quant"].run(kv_suite(quantizers))
    failed = [r for r in results if r.passed is False]
    assert failed and {r.impl for r in failed} == {"torch|jax", "jax vs numpy-spec"}
    assert len(failed) == 2 * len(kv_quant.kv_quant_cases(quick=True)) * len(kv_quant.DTYPES)
    assert all(r.measured >= 1 and r.detail.startswith("codes: 1 of ") for r in failed)


def fp8_pages(seed=0) -> list[dict]:
    """One request's pages as an engine holds them: 2 planes, 12 tokens, 2 KV heads of 16."""
    rng = np.random.default_rng(seed)
    pages = {}
    for name in ("k", "v"):
        pages[name], pages[f"{name}_scale"] = spec.quantize(rng.standard_normal((2, 12, 2, 16)).astype(np.float32))
    return [pages]


def test_fp8_pages_pass_within_a_rounding_and_fail_on_a_misplaced_vector():
    """`parity.fp8.compare_pages` (the fp8-pages rows): a value moved by one e4m3fn step or a scale by
    an ulp is within the bound; another token's vector in a slot, or a scale 10 % off, is not."""
    from parity import fp8
    want = fp8_pages()
    near = [{name: x.copy() for name, x in want[0].items()}]
    top = np.argmax(want[0]["k"][0, 3, 1] & 0x7F)                         # the vector's amax: its top code
    near[0]["k"][0, 3, 1, top] -= 1                                       # one step down
    near[0]["v_scale"][1, 5, 0] = np.nextafter(near[0]["v_scale"][1, 5, 0], np.float32(1))
    diff = fp8.compare_pages(near, want)
    assert (diff.codes, diff.scales, diff.values_far, diff.scales_far) == (1, 1, 0, 0)
    assert diff.fraction == 1 / (2 * want[0]["k"].size) and 0.5 < diff.largest_ratio < 1   # 32 s of 46 s
    moved = [{name: x.copy() for name, x in want[0].items()}]
    moved[0]["v"][1, 7], moved[0]["v_scale"][1, 7] = want[0]["v"][1, 8], want[0]["v_scale"][1, 8]
    diff = fp8.compare_pages(moved, want)
    assert diff.values_far > 0
    assert "first value beyond its bound at [plane, token, head, dim] [1, 7," in " ".join(diff.lines)
    scaled = [{name: x.copy() for name, x in want[0].items()}]
    scaled[0]["k_scale"][0, 0, 0] *= np.float32(1.1)
    assert fp8.compare_pages(scaled, want).scales_far == 1
