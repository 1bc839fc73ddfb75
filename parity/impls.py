"""The implementations under test, behind one numpy interface.

`Impl(framework, kernel)` runs that framework's `decode_attention(..., kernel=kernel)` on numpy
inputs; `SELECTORS` are the selection rules (numpy specification, torch, jax). Implementations
are discovered from the frameworks' kernel lists, so a kernel added there (FlashAttention) is
checked once it is importable.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from parity import environment  # (before triton and jax are imported)

import jax
import jax.numpy as jnp
import numpy as np
import torch

from wise_core import reference as ref
from wise_core import selection as rules
from wise_jax import attention as jax_attention
from wise_torch import attention as torch_attention

if os.environ.get("TRITON_INTERPRET") == "1":
    environment.widen_interpreted_bf16_dots()


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One decode_attention call: out float32[batch, heads, head_dim] (exact copy of the output
    dtype's values), support bool[batch, heads, max_blocks], mass float32[batch, heads, max_blocks]."""

    out: np.ndarray
    support: np.ndarray
    mass: np.ndarray


@dataclasses.dataclass(frozen=True)
class Impl:
    """framework 'torch' or 'jax'; kernel as in `decode_attention(kernel=)` (also the engines'
    attention_backend of that name); device: torch's device."""

    framework: str
    kernel: str
    device: str = "cpu"

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.kernel}"

    def unavailable(self) -> str | None:
        """None when the kernel can run here, else why not."""
        try:
            if self.framework == "torch":
                torch_attention.resolve_kernel(self.kernel, self.device)
            else:
                jax_attention.attention_impl(self.kernel)
        except (ImportError, RuntimeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def reads_fp8(self) -> bool:
        """Whether the kernel reads fp8 pages (codes and scales) here: its framework's
        resolve_kernel accepts kv_cache_dtype 'fp8' for it."""
        try:
            if self.framework == "torch":
                torch_attention.resolve_kernel(self.kernel, self.device, None, "fp8")
            else:
                jax_attention.resolve_kernel(self.kernel, None, "fp8")
        except (ImportError, RuntimeError, ValueError):
            return False
        return True

    def to_device(self, inputs: dict[str, np.ndarray], dtype: str) -> dict:
        """The fixed inputs of a case (see `cases.AttentionCase.inputs`) as this framework's arrays
        on its device: q, k_pages, v_pages in `dtype`; page_table, seq_lens; for fp8 pages
        (`parity.fp8.Fp8AttentionCase.fp8_inputs`) k_pages, v_pages as their uint8 codes and
        k_scale, v_scale float32."""
        names = _FIXED + tuple(name for name in _SCALES if name in inputs)

        def dtype_of(name):
            return dtype if name in _FLOATS and inputs[name].dtype != np.uint8 else None
        if self.framework == "torch":
            return {name: torch.from_numpy(np.array(inputs[name])).to(
                self.device, getattr(torch, dtype_of(name)) if dtype_of(name) else None) for name in names}
        return {name: jnp.asarray(inputs[name], getattr(jnp, dtype_of(name)) if dtype_of(name) else None)
                for name in names}

    def decode(self, arrays: dict, modes: np.ndarray, support: np.ndarray, *, block_size: int,
               eta: float) -> Decoded:
        """decode_attention(kernel=self.kernel) on `to_device` arrays, per-row modes int32[batch]
        and support bool[batch, heads, max_blocks] (numpy; not modified)."""
        fixed = [arrays[name] for name in _FIXED]
        scales = {name: arrays[name] for name in _SCALES if name in arrays}   # fp8 pages
        if self.framework == "torch":
            out, new_support, mass = torch_attention.decode_attention(
                *fixed, torch.from_numpy(np.array(modes)).to(self.device),
                torch.from_numpy(np.array(support)).to(self.device), block_size=block_size, eta=eta,
                return_mass=True, kernel=self.kernel, **scales)
            return Decoded(out.float().cpu().numpy(), new_support.cpu().numpy(), mass.float().cpu().numpy())
        out, new_support, mass = _jax_decode(*fixed, jnp.asarray(modes), jnp.asarray(support), block_size=block_size,
                                             eta=eta, return_mass=True, kernel=self.kernel, **scales)
        return Decoded(np.asarray(out.astype(jnp.float32)), np.asarray(new_support), np.asarray(mass, np.float32))


# jit-compiled as inside generate: one compilation per shape, modes and support traced
_jax_decode = jax.jit(jax_attention.decode_attention, static_argnames=("block_size", "eta", "return_mass", "kernel"))
_FIXED = ("q", "k_pages", "v_pages", "page_table", "seq_lens")
_FLOATS = ("q", "k_pages", "v_pages")
_SCALES = ("k_scale", "v_scale")


def discover_impls(device: str) -> tuple[list[Impl], dict[str, str]]:
    """Every kernel both frameworks list: (runnable here, {name: why not} for the others)."""
    candidates = [Impl("torch", k, device) for k in torch_attention.TORCH_KERNELS if k != "auto"]
    candidates += [Impl("jax", k, device) for k in jax_attention.KERNELS if k != "auto"]
    found, missing = [], {}
    for impl in candidates:
        reason = impl.unavailable()
        if reason is None:
            found.append(impl)
        else:
            missing[impl.name] = reason
    return found, missing


def _context_fields(context: rules.SelectionContext, convert) -> rules.SelectionContext:
    """A numpy SelectionContext with its arrays converted by `convert`."""
    return dataclasses.replace(context, **{name: convert(np.asarray(getattr(context, name)))
                                           for name in ("seq_lens", "loop", "layer", "head", "block")})


def torch_selector(device: str):
    """wise_torch's select_blocks on `device`, as (mass (numpy), rule, context=None) -> support
    (numpy); rule: an eta number or a `wise_core.selection` rule; context: a numpy SelectionContext."""
    def select(mass: np.ndarray, rule, context: rules.SelectionContext | None = None) -> np.ndarray:
        if context is not None:
            context = _context_fields(context, lambda x: torch.from_numpy(x.copy()).to(device))
        return torch_attention.select_blocks(torch.from_numpy(np.array(mass)).to(device), rule, context).cpu().numpy()
    return select


_jax_select = jax.jit(jax_attention.select_blocks)  # eta traced: one compilation per mass shape
_jax_select_rule = jax.jit(jax_attention.select_blocks, static_argnums=1)  # a rule object: static


@functools.partial(jax.jit, static_argnames=("rule", "block_size"))
def _jax_select_context(mass, seq_lens, loop, layer, head, block, *, rule, block_size):
    """select_blocks with a SelectionContext whose arrays are traced, the loop and layer included
    (as a decode step's scan over loops and layers passes them)."""
    context = rules.SelectionContext(seq_lens=seq_lens, loop=loop, layer=layer, head=head, block=block,
                                     block_size=block_size)
    return jax_attention.select_blocks(mass, rule, context)


def jax_selector(mass: np.ndarray, rule, context: rules.SelectionContext | None = None) -> np.ndarray:
    """wise_jax's select_blocks (jit-compiled) on the default JAX device; rule: an eta number
    (traced) or a `wise_core.selection` rule (static); context: a numpy SelectionContext (its
    arrays traced)."""
    if context is not None:
        fields = _context_fields(context, jnp.asarray)
        return np.asarray(_jax_select_context(jnp.asarray(mass), fields.seq_lens, fields.loop, fields.layer,
                                              fields.head, fields.block, rule=rule, block_size=context.block_size))
    select = _jax_select_rule if isinstance(rule, rules.SelectionRule) else _jax_select
    return np.asarray(select(jnp.asarray(mass), rule))


def selectors(device: str) -> dict:
    """name -> select(mass float32[..., n_blocks], rule, context=None) -> bool[..., n_blocks] (rule:
    an eta number or a `wise_core.selection` rule; context: a numpy SelectionContext, which a
    Custom(..., context=True) rule reads); 'numpy-spec' first."""
    return {"numpy-spec": ref.select_blocks, "torch": torch_selector(device), "jax": jax_selector}


def jax_backend() -> str:
    return jax.default_backend()
