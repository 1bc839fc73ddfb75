"""The Huginn recurrent-depth decoder (huginn-0125) as pure functions: the forward of
`wise_core.huginn_reference`.

embed * sqrt(hidden); the prelude; the core block `num_steps` times (a `lax.fori_loop`, the
trip count may be traced) on the recurrent state, each iteration first mixing [state, embedded
input] through the adapter; ln_f, the coda, ln_f, the head. Layers are sandwich blocks (norm
after each residual add). The parameters are the checkpoint's with the changes
`wise_torch.huginn` makes (`huginn_from_tensors`): q's and k's rows of each head reordered
from the released interleaved RoPE pairs to split halves (so `wise_jax.model.apply_rope`
applies the released rotation; q . k is unchanged), qk_bias as the bias of the fused qkv
projection (zero on v); linear weights stored [in, out].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wise_core.checkpoint import HUGINN_STACKS, huginn_layers, validate_tensors
from wise_core.config import ModelConfig
from wise_core.huginn_reference import initial_state
from wise_jax.model import apply_rope, check_input_ids, rms_norm, rope
from wise_jax.prefill_attention import causal_attention


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["qkv", "qkv_bias", "proj", "fc", "mlp_proj", "norm_1", "norm_2", "norm_3", "norm_4"],
                   meta_fields=[])
@dataclasses.dataclass
class BlockParams:
    """One sandwich block: qkv [hidden, 3 hidden] (q, k split-half ordered), qkv_bias [3 hidden]
    or None, proj [hidden, hidden], fc [hidden, 2 intermediate] (gate | up), mlp_proj
    [intermediate, hidden], norm_1..4 [hidden]."""

    qkv: jax.Array
    qkv_bias: jax.Array | None
    proj: jax.Array
    fc: jax.Array
    mlp_proj: jax.Array
    norm_1: jax.Array
    norm_2: jax.Array
    norm_3: jax.Array
    norm_4: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["wte", "prelude", "adapter", "core_block", "coda", "ln_f", "lm_head"], meta_fields=[])
@dataclasses.dataclass
class HuginnParams:
    """wte [vocab, hidden]; prelude, core_block, coda: tuples of BlockParams; adapter [2 hidden,
    hidden]; ln_f [hidden]; lm_head [hidden, vocab], or None when tied to wte."""

    wte: jax.Array
    prelude: tuple[BlockParams, ...]
    adapter: jax.Array
    core_block: tuple[BlockParams, ...]
    coda: tuple[BlockParams, ...]
    ln_f: jax.Array
    lm_head: jax.Array | None


def split_half_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows [heads * head_dim, ...] of one projection, each head's reordered from interleaved
    pairs (2j, 2j + 1) to split halves (j, j + head_dim / 2)."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return w.reshape(heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def huginn_from_tensors(config: ModelConfig, tensors: dict, dtype=jnp.float32) -> HuginnParams:
    """HuginnParams in `dtype` from HF-named numpy arrays (validated against `config`; a tied
    lm_head and freqs_cis are dropped)."""
    validate_tensors(config, tensors)
    heads, d, h = config.num_attention_heads, config.head_dim, config.hidden_size
    t = {name: np.asarray(a, np.float32) for name, a in tensors.items()}

    def array(x):
        return jnp.asarray(x, dtype)

    def block(prefix):
        q, k, v = np.split(t[prefix + "attn.Wqkv.weight"], 3)
        qkv = np.concatenate([split_half_rows(q, heads, d), split_half_rows(k, heads, d), v])
        bias = None
        if config.qk_bias:
            qb, kb = t[prefix + "attn.qk_bias"].reshape(2, h)
            bias = array(np.concatenate([split_half_rows(qb, heads, d), split_half_rows(kb, heads, d),
                                         np.zeros(h, np.float32)]))
        return BlockParams(array(qkv.T), bias, array(t[prefix + "attn.proj.weight"].T),
                           array(t[prefix + "mlp.fc.weight"].T), array(t[prefix + "mlp.proj.weight"].T),
                           *(array(t[prefix + f"norm_{i}.weight"]) for i in range(1, 5)))

    stacks = {stack: tuple(block(f"transformer.{stack}.{n}.") for s, n in huginn_layers(config) if s == stack)
              for stack in HUGINN_STACKS}
    lm_head = None if config.tie_word_embeddings else array(t["lm_head.weight"].T)
    return HuginnParams(array(t["transformer.wte.weight"]), stacks["prelude"],
                        array(t["transformer.adapter.weight"].T), stacks["core_block"], stacks["coda"],
                        array(t["transformer.ln_f.weight"]), lm_head)


def sandwich_block(bp: BlockParams, config: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """One layer over whole sequences, causal. x: [batch, seq, hidden]."""
    batch, seq, hidden = x.shape
    heads, d, eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
    qkv = rms_norm(x, bp.norm_1, eps) @ bp.qkv
    if bp.qkv_bias is not None:
        qkv = qkv + bp.qkv_bias
    q, k, v = (part.reshape(batch, seq, heads, d) for part in jnp.split(qkv, 3, axis=-1))
    a = causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    x = rms_norm(a.reshape(batch, seq, hidden) @ bp.proj + x, bp.norm_2, eps)
    gate, up = jnp.split(rms_norm(x, bp.norm_3, eps) @ bp.fc, 2, axis=-1)
    return rms_norm((jax.nn.silu(gate) * up) @ bp.mlp_proj + x, bp.norm_4, eps)


@functools.partial(jax.jit, static_argnames=("config",))
def _forward(params: HuginnParams, config: ModelConfig, input_ids: jax.Array, num_steps: jax.Array,
             state: jax.Array) -> jax.Array:
    batch, seq = input_ids.shape
    cos, sin = rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)), config.head_dim,
                    config.rope_theta)
    embedded = params.wte.at[input_ids].get(mode="fill", fill_value=jnp.nan) * config.embed_scale
    for bp in params.prelude:
        embedded = sandwich_block(bp, config, embedded, cos, sin)

    def step(_, x):
        x = jnp.concatenate([x, embedded], axis=-1) @ params.adapter
        for bp in params.core_block:
            x = sandwich_block(bp, config, x, cos, sin)
        return x

    x = rms_norm(lax.fori_loop(0, num_steps, step, state.astype(embedded.dtype)), params.ln_f, config.rms_norm_eps)
    for bp in params.coda:
        x = sandwich_block(bp, config, x, cos, sin)
    x = rms_norm(x, params.ln_f, config.rms_norm_eps)
    w = params.wte.T if params.lm_head is None else params.lm_head
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def forward(params: HuginnParams, config: ModelConfig, input_ids, *, num_steps: int | None = None, seed: int = 0,
            state=None) -> jax.Array:
    """input_ids int32[batch, seq] -> logits float32[batch, seq, vocab], the core block run
    num_steps times (default total_ut_steps) from `state` [batch, seq, hidden] (None: the seeded
    initial state of each position, `wise_core.huginn_reference.initial_state`)."""
    input_ids = jnp.asarray(input_ids)
    check_input_ids(config, input_ids, 2)
    num_steps = config.total_ut_steps if num_steps is None else num_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")
    batch, seq = input_ids.shape
    if state is None:
        state = np.broadcast_to(initial_state(config, np.arange(seq), seed), (batch, seq, config.hidden_size))
    elif tuple(np.shape(state)) != (batch, seq, config.hidden_size):
        raise ValueError(f"state must be [{batch}, {seq}, {config.hidden_size}], got {list(np.shape(state))}")
    return _forward(params, config, input_ids, jnp.int32(num_steps), jnp.asarray(state, params.wte.dtype))
