"""Decode attention over a paged cache: the jnp reference of every mode, the selection rule,
the dispatcher to the Pallas kernels (`wise_jax.kernels.choice` picks which), and what the
engine's attention_backend runs in each phase (`attention_plan`, docs/attention.md's table).

Modes (`wise_core.modes`, per row): DENSE attends every key < seq_len; DISCOVER attends densely,
records block mass and returns support' = select_blocks(mass); DISCOVER_UNION ORs that selection
into the support held; SPARSE attends only the keys of supported blocks. Every mode runs the
same masked code path, so a SPARSE row whose support holds every causal block, and a DISCOVER
row, are bitwise equal to DENSE. `wise_jax.decode_check.check_call` is the contract's check at
the public entry of both implementations (docs/DESIGN.md).

An fp8 K/V cache (`kv_cache.create(..., kv_cache_dtype="fp8")`): k_pages and v_pages are uint8
e4m3fn codes and `k_scale`, `v_scale` float32 [num_pages, page_size, kv_heads] their scales
(`wise_core.kv_quant`). The reference gathers a row's pages and dequantizes them to q's dtype,
then runs the same code as over unquantized pages, so its output, mass and selection are those of
attention over the dequantized K/V; the Pallas kernel (`pallas_decode`) dequantizes each tile in
registers by the same arithmetic, so its call is bitwise its call on the dequantized pages. The
Mosaic kernel does not read fp8 pages: kernel (attention_backend) "auto" runs the reference for
such a cache on every backend, and "pallas" the Pallas kernel (`resolve_kernel`,
`attention_plan`, `kernels.choice`).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
from jax import lax

from wise_core import modes as M
from wise_core import selection as rules
from wise_core.engine.args import ATTENTION_BACKENDS
from wise_core.kv_quant import check_kv_cache_dtype
from wise_jax import kv_quant
from wise_jax.decode_check import check_call

KERNELS = ("auto", "reference", "pallas")
"""The decode kernels (`decode_attention(kernel=)`): "auto" (`resolve_kernel`), the jnp
reference, and the Pallas kernels (`wise_jax.kernels.choice`: Mosaic GPU on Hopper where it
takes the call, the Triton lowering elsewhere)."""
JAX_BACKENDS = ATTENTION_BACKENDS["jax"]


def select_blocks(mass: jax.Array, rule, context: rules.SelectionContext | None = None) -> jax.Array:
    """mass: float[..., n_blocks] (non-negative) -> bool[..., n_blocks] support chosen by `rule`:
    a `wise_core.selection` rule (static), or an eta value (a number or an array, may be traced:
    the eta rule) (`wise_core.reference.select_blocks`). context: the `SelectionContext` (jax
    arrays) a Custom(..., context=True) rule reads; its rank is filled here.

    Blocks are ranked by float32 mass descending (ties to the lower index); the first is always
    kept. Eta: keep the block at rank r iff the mass ranked before it is < eta * total."""
    mass = mass.astype(jnp.float32)
    mass = jnp.where(mass < jnp.finfo(jnp.float32).tiny, jnp.float32(0), mass)  # flush subnormals
    order = jnp.argsort(-mass, axis=-1, stable=True)
    ranked = jnp.take_along_axis(mass, order, axis=-1)
    running = jnp.cumsum(ranked, axis=-1)
    total = running[..., -1:]
    if not isinstance(rule, rules.SelectionRule) or isinstance(rule, rules.Eta):
        eta = rule.eta if isinstance(rule, rules.Eta) else rule
        before = jnp.concatenate([jnp.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
        keep_ranked = before < jnp.float32(eta) * total
    elif isinstance(rule, rules.TopK):
        keep_ranked = jnp.broadcast_to(jnp.arange(mass.shape[-1]) < rule.k, mass.shape)
    elif isinstance(rule, rules.Threshold):
        keep_ranked = (ranked >= jnp.float32(rule.fraction) * total) & (ranked > 0)
    else:
        if context is not None:
            context = dataclasses.replace(context, rank=jnp.argsort(order, axis=-1).astype(jnp.int32))
        chosen = rule.choose(mass, context)
        if getattr(chosen, "shape", None) != mass.shape or getattr(chosen, "dtype", None) != jnp.bool_:
            got = f"{chosen.dtype}{list(chosen.shape)}" if hasattr(chosen, "shape") else type(chosen).__name__
            raise ValueError(f"selection rule {rule.describe()!r} returned {got}; it must return "
                             f"bool{list(mass.shape)}")
        keep_ranked = jnp.take_along_axis(chosen, order, axis=-1)
    keep_ranked = keep_ranked.at[..., 0].set(True)  # never empty
    return jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)


def update_support(modes: jax.Array, support: jax.Array, selected: jax.Array) -> jax.Array:
    """support' of a decode call: `selected` for DISCOVER rows, support | selected for
    DISCOVER_UNION rows, support elsewhere. modes int32[batch]; support, selected bool[batch, heads, blocks]."""
    row = modes[:, None, None]
    return jnp.where(row == M.DISCOVER, selected, jnp.where(row == M.DISCOVER_UNION, support | selected, support))


def causal_blocks(seq_lens: jax.Array, block_size: int, n_blocks: int) -> jax.Array:
    """seq_lens: int32[batch] -> bool[batch, n_blocks], blocks holding a key < seq_len."""
    return jnp.arange(n_blocks, dtype=jnp.int32)[None, :] * block_size < seq_lens[:, None]


def decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, modes, support, *,
                               block_size: int, eta: float, scale: float | None = None,
                               return_mass: bool = False, validate: bool = True, reuse: bool = False,
                               k_scale=None, v_scale=None):
    """One query token per row over a paged cache, every mode (see the module docstring).

    q: [batch, heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim];
    page_table int32[batch, max_pages]; seq_lens int32[batch]; modes int32[batch];
    support bool[batch, heads, max_blocks] with max_blocks = max_pages * page_size // block_size.
    Returns out [batch, heads, head_dim] (q's dtype), support' and, with return_mass, the block
    mass float32[batch, heads, max_blocks] (zeros past seq_len; that of the attended keys).
    Scores and softmax are float32. validate: also check the values (`check_call`). reuse: a
    reuse loop's call, no row discovers (`decode_attention`). k_scale, v_scale: None, or an fp8
    cache's scales float32 [num_pages, page_size, kv_heads], k_pages and v_pages then its uint8
    codes: the gathered pages are dequantized to q's dtype (`kv_quant.dequantize`) before the
    same arithmetic (module docstring).
    """
    seq_lens = check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support,
                          block_size=block_size, eta=eta, validate=validate, reuse=reuse,
                          k_scale=k_scale, v_scale=v_scale)
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    n_keys = page_table.shape[1] * page_size
    n_blocks = n_keys // block_size
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale

    k, v = k_pages[page_table], v_pages[page_table]
    if k_scale is not None:    # an fp8 cache: the row's pages dequantized
        k = kv_quant.dequantize(k, k_scale[page_table], q.dtype)
        v = kv_quant.dequantize(v, v_scale[page_table], q.dtype)
    k = k.reshape(batch, n_keys, kv_heads, head_dim)
    v = v.reshape(batch, n_keys, kv_heads, head_dim)
    qg = q.reshape(batch, kv_heads, group, head_dim)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST).reshape(batch, heads, n_keys) * scale

    causal = causal_blocks(seq_lens, block_size, n_blocks)                         # [batch, n_blocks]
    sparse = (modes == M.SPARSE)[:, None, None]
    blocks = causal[:, None, :] & jnp.where(sparse, support, True)                # [batch, heads, n_blocks]
    keys = jnp.repeat(blocks, block_size, axis=-1) & (jnp.arange(n_keys) < seq_lens[:, None, None])
    scores = jnp.where(keys, scores, -jnp.inf)
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    # A value past a row's keys is read as 0, never as what a page's earlier holder left there:
    # 0 x NaN would make the row NaN although its softmax weight there is 0.
    held = (jnp.arange(n_keys) < seq_lens[:, None])[:, :, None, None]
    out = jnp.einsum("bkgs,bskd->bkgd", probs.reshape(batch, kv_heads, group, n_keys),
                     jnp.where(held, v.astype(jnp.float32), 0.0), precision=lax.Precision.HIGHEST)
    out = out.reshape(batch, heads, head_dim).astype(q.dtype)

    mass = probs.reshape(batch, heads, n_blocks, block_size).sum(-1)
    new_support = update_support(modes, support, select_blocks(mass, eta))
    return (out, new_support, mass) if return_mass else (out, new_support)


def resolve_kernel(kernel: str, head_dim: int | None = None, kv_cache_dtype: str = "auto") -> str:
    """'auto' -> 'pallas' on a GPU when the Pallas kernel takes q/K/V of `head_dim`
    (`pallas_decode.takes`: a power of two or a multiple of 16; None: not known, any; the Mosaic
    kernel that `kernels.choice` may run instead needs a multiple of 64, else the Pallas one
    runs), 'reference' otherwise; other names are checked. The callers that run attention pass
    head_dim, so 'auto' never picks a kernel that refuses it. kv_cache_dtype "fp8" (pages of
    e4m3fn codes and scales): 'auto' -> 'reference' on every backend; 'pallas' runs
    `pallas_decode`, which reads them (`kernels.choice` never gives them to the Mosaic kernel)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown JAX decode-attention kernel {kernel!r}; choose one of {KERNELS}")
    if kv_cache_dtype != "auto":
        check_kv_cache_dtype(kv_cache_dtype)
        return "pallas" if kernel == "pallas" else "reference"
    if kernel != "auto":
        return kernel
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return "reference"
    if head_dim is None:
        return "pallas"
    from wise_jax.kernels.pallas_decode import takes
    return "pallas" if takes(head_dim) else "reference"


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What the JAX engine runs in each phase (docs/attention.md's table; `attention_plan`).
    kernel: the decode kernel of every decode loop, dense and WISE ("pallas" or "reference",
    `attention_impl`); prefill: the prefill attention of chunks that open their prompts
    (`wise_jax.prefill_attention.causal_attention`'s implementation: "auto", cuDNN where it
    takes the call, else "chunked"; or "chunked")."""

    kernel: str
    prefill: str


def attention_plan(backend: str, head_dim: int, kv_cache_dtype: str = "auto") -> AttentionPlan:
    """The phases of `backend` for q/K/V of `head_dim` (the one place the JAX engine's attention
    is chosen; docs/attention.md): "auto": the decode kernel `resolve_kernel("auto")` picks (the
    Pallas kernels on a GPU for a head_dim they take, else the reference), prefill "auto";
    "pallas": the Pallas kernels, prefill "auto"; "reference": the jnp decode reference and
    the chunked jnp prefill. kv_cache_dtype "fp8": "auto" decodes with the reference, "pallas"
    with the Pallas kernel that reads fp8 pages (`kernels.choice`: never Mosaic)."""
    if backend not in JAX_BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of wise_jax's ({', '.join(JAX_BACKENDS)})")
    kernel = resolve_kernel(backend, head_dim, kv_cache_dtype)
    return AttentionPlan(kernel=kernel, prefill="chunked" if backend == "reference" else "auto")


def attention_impl(kernel: str, head_dim: int | None = None, kv_cache_dtype: str = "auto"):
    """The decode_attention function named by `kernel` for q/K/V of `head_dim` and pages of
    `kv_cache_dtype` (`resolve_kernel`; imports the Pallas kernel lazily)."""
    if resolve_kernel(kernel, head_dim, kv_cache_dtype) == "reference":
        return decode_attention_reference
    try:
        importlib.import_module("wise_jax.kernels.pallas_decode")
    except ImportError as e:
        raise ImportError(f"kernel='pallas' needs wise_jax.kernels.pallas_decode.decode_attention, which "
                          f"cannot be imported ({e}); use kernel='reference'") from e
    from wise_jax.kernels.choice import decode_attention as pallas_decode_attention  # which Pallas kernel
    return pallas_decode_attention


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size: int,
                     eta: float, scale: float | None = None, return_mass: bool = False,
                     kernel: str = "auto", validate: bool = True, reuse: bool = False,
                     selection: rules.SelectionRule | None = None,
                     selection_context: rules.SelectionContext | None = None, k_scale=None, v_scale=None):
    """decode_attention_reference's contract, run by `kernel` ('reference', 'pallas' or 'auto').
    reuse: a call of WISE's reuse loops: every row SPARSE or DENSE (checked with validate), most
    of them SPARSE; support' is the support held and the mass zeros, as for any row that does
    not discover. The Mosaic GPU kernel then runs a launch for mostly SPARSE rows (several heads
    a program or longer splits, `mosaic_decode.launch_config`) and merges a row's splits in its
    split kernel, with no finish launch; outputs stay within the kernel's rounding bounds (a
    DISCOVER row's output is NaN there when not validated: outside the contract).
    selection: a rule other than eta (`wise_core.selection`; None or `Eta`: the eta rule of
    `eta`, computed inside the call): the call returns its block mass and the discovery rows'
    supports are the rule's selection of it (`update_support`), so every kernel runs any rule
    unchanged; selection_context: what a Custom(..., context=True) rule reads (`wise_state`
    builds it for each loop and layer). k_scale, v_scale: an fp8 cache's scales, k_pages and
    v_pages its codes (module docstring): 'auto' runs the reference, 'pallas' the Pallas kernel
    (`resolve_kernel`)."""
    if isinstance(selection, rules.Eta):
        eta, selection = selection.eta, None
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (an fp8 cache's scales) or both be None")
    if k_scale is None:
        fn, scales = attention_impl(kernel, q.shape[-1]), {}
    else:
        fn, scales = attention_impl(kernel, q.shape[-1], "fp8"), dict(k_scale=k_scale, v_scale=v_scale)
    if selection is None or reuse:  # a reuse call discovers nothing
        return fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
                  scale=scale, return_mass=return_mass, validate=validate, reuse=reuse, **scales)
    out, _, mass = fn(q, k_pages, v_pages, page_table, seq_lens, modes, support, block_size=block_size, eta=eta,
                      scale=scale, return_mass=True, validate=validate, reuse=reuse, **scales)
    new_support = update_support(modes, support, select_blocks(mass, rules.as_rule(selection), selection_context))
    return (out, new_support, mass) if return_mass else (out, new_support)
