"""The fp8 K/V cache's quantization rule across frameworks (issue 50): the cases the `kv-quant`
check runs (K/V pages of random, key-like and special values, in each cache dtype) and the
three implementations behind one numpy interface (`quantizers`): the numpy specification
`wise_core.kv_quant`, `wise_torch.kv_quant` on the suite's device, `wise_jax.kv_quant`
jit-compiled on JAX's default device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

importlib.import_module("parity.environment")  # its settings, before triton and jax are imported

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from wise_core import kv_quant as spec
from wise_jax import kv_quant as jax_kv_quant
from wise_torch import kv_quant as torch_kv_quant

DTYPES = ("float32", "bfloat16", "float16")   # the cache dtypes: inputs of quantize, outputs of dequantize
_NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class KVQuantCase:
    """K or V pages [num_pages, page_size, kv_heads, head_dim]. kind: 'normal' (N(0, 1)),
    'keys' (a few head_dim channels x10 and each token's own magnitude, as real keys have) or
    'special' (normal pages with planted vectors: zeros, negative zeros, NaN, +-inf, subnormals,
    scales at and around MIN_SCALE, float32's largest values, e4m3fn ties) or 'edges'
    (`rounding_edges`: values whose x * inv lies next to an e4m3fn midpoint; float32 inputs
    keep that property, the lower dtypes' rounding of them mostly not)."""

    name: str
    shape: tuple[int, int, int, int]
    kind: str
    seed: int = 0

    @functools.lru_cache(maxsize=None)
    def _float32(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal(self.shape)
        head_dim = self.shape[-1]
        if self.kind == "keys":
            x[..., rng.choice(head_dim, max(1, head_dim // 32), replace=False)] *= 10.0
            x *= np.exp(rng.standard_normal(self.shape[:-1] + (1,)))
        elif self.kind == "special":
            x = x.reshape(-1, head_dim)
            threshold = np.float32(spec.MIN_SCALE / spec.INV_E4M3_MAX)
            midpoints = (spec.E4M3FN_VALUES[1:0x7F].astype(np.float64) + spec.E4M3FN_VALUES[:0x7E]) / 2
            planted = {0: 0.0, 1: -0.0, 2: np.nan, 3: np.inf, 4: 1e-40, 5: threshold, 6: threshold * 0.999,
                       7: np.finfo(np.float32).max}
            for row, value in planted.items():
                x[row] = value * np.where(np.arange(head_dim) % 2, -1.0, 1.0) if row > 3 else value
            x[8, :3] = [np.nan, np.inf, -np.inf]                 # among finite values
            x[9, 1::2] = 1e-40                                   # subnormals beside normals
            x[10] = np.resize(np.concatenate([[448.0], midpoints]), head_dim)   # scale 1: ties
            x = x.reshape(self.shape)
        elif self.kind == "edges":
            return rounding_edges(rng, int(np.prod(self.shape[:-1])), head_dim).reshape(self.shape)
        elif self.kind != "normal":
            raise ValueError(f"unknown kv-quant case kind {self.kind!r}")
        return x.astype(np.float32)

    def inputs(self, dtype: str) -> np.ndarray:
        """The pages in `dtype` (numpy; bfloat16 as ml_dtypes), rounded once from float32."""
        with np.errstate(over="ignore"):   # float16: float32's largest values become inf
            return self._float32().astype(_NUMPY[dtype])


def rounding_edges(rng: np.random.Generator, rows: int, head_dim: int) -> np.ndarray:
    """float32[rows, head_dim]: per row a random amax (first entry, sign random) and values x
    whose x * inv (inv = 1 / the row's scale) lies within a few float32 ulps of a midpoint between
    e4m3fn values, chosen where x / scale, a division in place of the rule's multiplication by
    the reciprocal, rounds to another code whenever one such x is among the candidates: a
    rounding difference of one float32 ulp anywhere in the rule shows in the codes here, where
    random values reveal it about once in a million."""
    values = spec.E4M3FN_VALUES[:0x7F].astype(np.float64)
    midpoints = (values[:-1] + values[1:]) / 2
    out = np.empty((rows, head_dim), np.float32)
    for r in range(rows):
        amax = np.float32(2.0 ** rng.uniform(-20, 20))
        scale = max(amax * spec.INV_E4M3_MAX, np.float32(spec.MIN_SCALE))
        inv = np.float32(1) / scale
        m = rng.choice(midpoints[midpoints < 440], head_dim - 1)
        centre = (m * scale).astype(np.float32).view(np.uint32).astype(np.int64)
        candidates = (centre[:, None] + np.arange(-3, 4)).astype(np.uint32).view(np.float32)   # [n, 7]
        by_product = spec.encode_e4m3fn((candidates * inv).astype(np.float32))
        by_quotient = spec.encode_e4m3fn((candidates / scale).astype(np.float32))
        closest = np.abs((candidates * inv).astype(np.float64) - m[:, None]).argmin(-1)
        pick = np.where((by_product != by_quotient).any(-1), (by_product != by_quotient).argmax(-1), closest)
        x = candidates[np.arange(head_dim - 1), pick]
        out[r, 0] = amax
        out[r, 1:] = x
    return out * np.where(rng.random((rows, head_dim)) < 0.5, np.float32(-1), np.float32(1))


def kv_quant_cases(quick: bool) -> tuple[KVQuantCase, ...]:
    """Pages of 64 keys, 2 KV heads of 64 on CPU; Ouro-1.4B's (pages of 128, 16 KV heads of 128)
    otherwise."""
    shape = (3, 64, 2, 64) if quick else (4, 128, 16, 128)
    return tuple(KVQuantCase(f"{kind}-{'x'.join(map(str, shape))}", shape, kind, seed)
                 for seed, kind in enumerate(("normal", "keys", "special", "edges")))


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """quantize(x numpy [..., kv_heads, head_dim]) -> (codes uint8, scales float32) numpy;
    dequantize(codes, scales, dtype name) -> float32 numpy holding the dtype's values exactly."""

    name: str
    quantize: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    dequantize: Callable[[np.ndarray, np.ndarray, str], np.ndarray]


def _spec_dequantize(codes, scales, dtype: str) -> np.ndarray:
    return spec.dequantize(codes, scales, dtype).astype(np.float32)


def _to_torch(x: np.ndarray, device: str) -> torch.Tensor:
    x = np.ascontiguousarray(x)
    if x.dtype == _NUMPY["bfloat16"]:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(x.copy()).to(device)


def torch_quantizer(device: str) -> Quantizer:
    def quantize(x):
        codes, scales = torch_kv_quant.quantize(_to_torch(x, device))
        return codes.cpu().numpy(), scales.cpu().numpy()

    def dequantize(codes, scales, dtype: str):
        out = torch_kv_quant.dequantize(_to_torch(codes, device), _to_torch(scales, device), getattr(torch, dtype))
        return out.float().cpu().numpy()
    return Quantizer("torch", quantize, dequantize)


_jax_quantize = jax.jit(jax_kv_quant.quantize)
_jax_dequantize = jax.jit(jax_kv_quant.dequantize, static_argnums=2)


def _jax_quantize_numpy(x):
    codes, scales = _jax_quantize(jnp.asarray(x))
    return np.asarray(codes), np.asarray(scales)


def _jax_dequantize_numpy(codes, scales, dtype: str):
    return np.asarray(_jax_dequantize(jnp.asarray(codes), jnp.asarray(scales), getattr(jnp, dtype)).astype(jnp.float32))


def quantizers(device: str) -> dict[str, Quantizer]:
    """name -> Quantizer: 'numpy-spec' first, then 'torch' (on `device`) and 'jax'."""
    return {"numpy-spec": Quantizer("numpy-spec", spec.quantize, _spec_dequantize),
            "torch": torch_quantizer(device),
            "jax": Quantizer("jax", _jax_quantize_numpy, _jax_dequantize_numpy)}
