"""The fp8 K/V cache's quantization rule in torch: `wise_core.kv_quant` (the numpy
specification, whose docstring states the rule) on tensors of any device, bitwise the same
codes, scales and dequantized values.

    quantize(x) -> (codes uint8 [..., kv_heads, head_dim], scales float32 [..., kv_heads])
    dequantize(codes, scales, dtype) -> dtype [..., kv_heads, head_dim]

The rounding to e4m3fn is torch's float32 -> torch.float8_e4m3fn cast (round to nearest even)
of values already saturated to +-448, viewed as uint8; non-finite entries are set to
`NAN_CODE` explicitly (torch's cast would saturate an infinity to 448).
"""

from __future__ import annotations

import torch

from wise_core import kv_quant as spec

INV_E4M3_MAX = float(spec.INV_E4M3_MAX)   # exactly the float32 constant C
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., kv_heads, head_dim] (float32, bfloat16 or float16) -> (codes uint8 [..., kv_heads,
    head_dim], scales float32 [..., kv_heads]) on x's device (`wise_core.kv_quant.quantize`)."""
    spec.check_quantize_input(tuple(x.shape), _name(x.dtype))
    x32 = x.float()
    finite = torch.isfinite(x32)
    amax = torch.where(finite, x32.abs(), 0.0).amax(-1)
    scale = amax * INV_E4M3_MAX
    scale = torch.where(scale >= spec.MIN_SCALE, scale, 1.0)
    inv = 1.0 / scale
    y = (x32 * inv.unsqueeze(-1)).clamp(-spec.E4M3_MAX, spec.E4M3_MAX)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.masked_fill(~finite, spec.NAN_CODE), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [..., kv_heads, head_dim], scales float32 [..., kv_heads] -> `dtype` (torch.float32,
    bfloat16 or float16): value(code) * scale in float32, rounded once to dtype
    (`wise_core.kv_quant.dequantize`)."""
    name = _name(dtype) if isinstance(dtype, torch.dtype) else repr(dtype)
    spec.check_dequantize_input(tuple(codes.shape), _name(codes.dtype), tuple(scales.shape), _name(scales.dtype),
                                name)
    values = codes.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
    return values.to(_DTYPES[name])
