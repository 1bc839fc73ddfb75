"""Live weights across frameworks: a torch model <-> JAX (config, params), through the HF-named
float32 tensors both frameworks read and write (`wise_torch.to_checkpoint_tensors`,
`wise_jax.to_checkpoint_tensors`). float32 holds bf16 and fp16 values exactly, so conversions
between models of one dtype are lossless.
"""

from __future__ import annotations

from parity import environment  # noqa: F401  (before triton and jax are imported)

import jax
import jax.numpy as jnp
import numpy as np
import torch

import wise_jax
import wise_torch
from wise_core.model_config import ModelConfig

DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16),
          "float16": (torch.float16, jnp.float16)}


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16' or 'float16' for a torch or JAX dtype."""
    for name, (torch_dtype, jax_dtype) in DTYPES.items():
        if dtype == torch_dtype or (not isinstance(dtype, torch.dtype) and jnp.dtype(dtype) == jnp.dtype(jax_dtype)):
            return name
    raise ValueError(f"no conversion for dtype {dtype!r} (supported: {', '.join(DTYPES)})")


def torch_to_jax(model: wise_torch.OuroForCausalLM, dtype: str | None = None) -> tuple[ModelConfig, wise_jax.Params]:
    """A torch model's live weights as JAX params (default: the model's dtype), on JAX's default device."""
    dtype = dtype or dtype_name(model.model.embed_tokens.weight.dtype)
    tensors = wise_torch.to_checkpoint_tensors(model)
    return model.config, wise_jax.from_checkpoint_tensors(model.config, tensors, DTYPES[dtype][1])


def jax_to_torch(config: ModelConfig, params: wise_jax.Params, dtype: str | None = None, *,
                 device: str = "cpu", tokenizer=None) -> wise_torch.OuroForCausalLM:
    """JAX params as an eval-mode torch model (default: the params' dtype) on `device`."""
    dtype = dtype or dtype_name(params.embed_tokens.dtype)
    tensors = {name: np.array(x) for name, x in wise_jax.to_checkpoint_tensors(config, params).items()}  # writable
    return wise_torch.from_tensors(config, tensors, tokenizer=tokenizer, dtype=DTYPES[dtype][0], device=device)


def torch_weights(model: wise_torch.OuroForCausalLM) -> dict[str, np.ndarray]:
    """HF-named float32 numpy tensors of a torch model."""
    return wise_torch.to_checkpoint_tensors(model)


def jax_weights(config: ModelConfig, params: wise_jax.Params) -> dict[str, np.ndarray]:
    """HF-named float32 numpy tensors of JAX params."""
    return wise_jax.to_checkpoint_tensors(config, params)


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bits of a float array, as unsigned integers (bitwise comparisons: -0.0 != 0.0)."""
    x = np.ascontiguousarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def tensor_differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    """Bitwise comparison of two named tensor sets: one line per missing, extra, reshaped or
    differing tensor (naming the first differing element), in name order; [] when identical."""
    lines = [f"{n}: missing" for n in sorted(set(want) - set(got))]
    lines += [f"{n}: unexpected" for n in sorted(set(got) - set(want))]
    for name in sorted(set(got) & set(want)):
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape or a.dtype != b.dtype:
            lines.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            continue
        bad = np.argwhere(bits(a) != bits(b))
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            lines.append(f"{name}: {len(bad)} of {a.size} values differ, first at {list(where)}: "
                         f"{a[where]!r} vs {b[where]!r}")
    return lines


def params_differences(a: wise_jax.Params, b: wise_jax.Params) -> list[str]:
    """Bitwise comparison of two Params pytrees leaf by leaf (named by jax.tree_util.keystr)."""
    def flat(params):
        return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def as_numpy(leaves):
        return {name: np.asarray(jnp.asarray(x, jnp.float32)) for name, x in leaves.items()}

    fa, fb = flat(a), flat(b)
    lines = [f"{name}: dtype {fa[name].dtype} vs {fb[name].dtype}" for name in sorted(set(fa) & set(fb))
             if fa[name].dtype != fb[name].dtype]
    return lines + tensor_differences(as_numpy(fa), as_numpy(fb))
