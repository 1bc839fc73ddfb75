"""The Ouro recurrent-depth decoder as pure functions.

Structure (docs/DESIGN.md "Model"): embed; `total_ut_steps` loops, each a `lax.scan` of the
sandwich-norm `decoder_layer` over the stacked layers followed by `model.norm`; the early-exit
gate on each loop's normed state; the head on the last loop. Every loop runs
(`early_exit_threshold` is not applied; `forward_with_exits` returns the exit probabilities).
Three callers share `run_loop` and differ only in how a layer attends: `forward` (dense causal,
differentiable), `prefill` (dense causal, writing the paged cache) and `decode_step` (one token
per row against the paged cache, dense or WISE).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from wise_core import modes as M
from wise_core.config import ModelConfig, WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.attention import decode_attention
from wise_jax.params import LayerParams, Params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., hidden] -> weight * (x * rsqrt(mean(x^2) + eps)): normalised in float32, cast back to
    x's dtype, then scaled (the HF Ouro order)."""
    x32 = x.astype(jnp.float32)
    y = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (weight.astype(x.dtype) * y).astype(x.dtype)


def rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions int32[batch, seq] -> (cos, sin) float32[batch, seq, head_dim] (split-half layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; x * cos + rotate_half(x) * sin in float32, x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def mlp(lp: LayerParams, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)). x: [batch, seq, hidden]."""
    return (jax.nn.silu(x @ lp.gate_proj) * (x @ lp.up_proj)) @ lp.down_proj


# attend(q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim], layer, carry)
#   -> (out [batch, seq, heads, head_dim], carry)
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def decoder_layer(lp: LayerParams, config: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Callable) -> tuple[jax.Array, Any]:
    """One sandwich-norm layer. lp: one layer's weights; h: [batch, seq, hidden];
    attend(q, k, v) -> (out, aux). Returns (h, aux)."""
    batch, seq, _ = h.shape
    heads, kv_heads, dim, eps = (config.num_attention_heads, config.num_key_value_heads,
                                 config.head_dim, config.rms_norm_eps)
    x = rms_norm(h, lp.input_layernorm, eps)
    q = apply_rope((x @ lp.q_proj).reshape(batch, seq, heads, dim), cos, sin)
    k = apply_rope((x @ lp.k_proj).reshape(batch, seq, kv_heads, dim), cos, sin)
    v = (x @ lp.v_proj).reshape(batch, seq, kv_heads, dim)
    a, aux = attend(q, k, v)
    h = h + rms_norm(a.reshape(batch, seq, heads * dim) @ lp.o_proj, lp.input_layernorm_2, eps)
    x = rms_norm(h, lp.post_attention_layernorm, eps)
    h = h + rms_norm(mlp(lp, x), lp.post_attention_layernorm_2, eps)
    return h, aux


def run_loop(params: Params, config: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
             attend: Attend, carry: Any = None, *, remat: bool = False) -> tuple[jax.Array, Any]:
    """One pass over the shared layers (a scan), then model.norm. h: [batch, seq, hidden].
    `carry` threads through every layer's `attend`. Returns (normed h, carry)."""
    def body(state, xs):
        h, carry = state
        lp, layer = xs
        h, carry = decoder_layer(lp, config, h, cos, sin, lambda q, k, v: attend(q, k, v, layer, carry))
        return (h, carry), None

    if remat:
        body = jax.checkpoint(body)
    layers = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
    (h, carry), _ = lax.scan(body, (h, carry), (params.layers, layers))
    return rms_norm(h, params.norm, config.rms_norm_eps), carry


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Dense causal attention, float32 softmax. q: [batch, seq, heads, dim]; k, v: [batch, seq,
    kv_heads, dim] -> [batch, seq, heads, dim]. Query head h reads KV head h // group."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * dim ** -0.5
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, dim)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens int32[...] -> [..., hidden]."""
    return params.embed_tokens[tokens]


def head(params: Params, h: jax.Array) -> jax.Array:
    """Normed hidden [..., hidden] -> float32 logits [..., vocab]."""
    w = params.embed_tokens.T if params.lm_head is None else params.lm_head
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def exit_gate(params: Params, h: jax.Array) -> jax.Array:
    """lambda = sigmoid(gate(h)) float32[...] for normed hidden h [..., hidden]."""
    z = jnp.dot(h, params.early_exit_gate, preferred_element_type=jnp.float32)[..., 0]
    return jax.nn.sigmoid(z + params.early_exit_gate_bias.astype(jnp.float32)[0])


def exit_probabilities(lambdas: jax.Array) -> jax.Array:
    """lambdas float32[loops, ...] -> p[loops, ...]: p_t = lambda_t * prod_{s<t}(1 - lambda_s),
    the last loop taking the remaining mass (so p sums to 1)."""
    remaining = jnp.ones_like(lambdas[0])
    probs = []
    for t in range(lambdas.shape[0] - 1):
        probs.append(lambdas[t] * remaining)
        remaining = remaining * (1.0 - lambdas[t])
    return jnp.stack(probs + [remaining])


def _dense_attend(q, k, v, layer, carry):
    return causal_attention(q, k, v), carry


def forward_with_exits(params: Params, config: ModelConfig, input_ids: jax.Array, *,
                       remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """input_ids int32[batch, seq] -> (logits float32[batch, seq, vocab] of the last loop,
    exit probabilities float32[loops, batch, seq]). Differentiable; `remat` recomputes each
    layer in the backward pass (only layer inputs are kept)."""
    batch, seq = input_ids.shape
    h = embed(params, input_ids)
    cos, sin = rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
                    config.head_dim, config.rope_theta)
    lambdas = []
    for _ in range(config.total_ut_steps):
        h, _ = run_loop(params, config, h, cos, sin, _dense_attend, remat=remat)
        lambdas.append(exit_gate(params, h))
    return head(params, h), exit_probabilities(jnp.stack(lambdas))


def forward(params: Params, config: ModelConfig, input_ids: jax.Array, *, remat: bool = False) -> jax.Array:
    """input_ids int32[batch, seq] -> logits float32[batch, seq, vocab] of the last loop."""
    return forward_with_exits(params, config, input_ids, remat=remat)[0]


def prefill(params: Params, config: ModelConfig, cache: kvc.PagedKVCache, tokens: jax.Array,
            lengths: jax.Array) -> tuple[jax.Array, kvc.PagedKVCache]:
    """Dense causal prefill of right-padded prompts into empty cache rows.

    tokens int32[batch, seq] (row b valid up to lengths[b]); lengths int32[batch] >= 1.
    Returns (logits float32[batch, vocab] at each row's last prompt token, cache)."""
    batch, seq = tokens.shape
    cache = kvc.reserve(cache, lengths)
    h = embed(params, tokens)
    cos, sin = rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
                    config.head_dim, config.rope_theta)
    for loop in range(config.total_ut_steps):
        def attend(q, k, v, layer, cache, loop=loop):
            plane = loop * config.num_hidden_layers + layer
            return causal_attention(q, k, v), kvc.write_prompt(cache, plane, k, v)
        h, cache = run_loop(params, config, h, cos, sin, attend, cache)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return head(params, last), cache


def decode_step(params: Params, config: ModelConfig, cache: kvc.PagedKVCache, state: ws.WiseState | None,
                tokens: jax.Array, request_ids: jax.Array, active: jax.Array, *,
                wise_config: WiseConfig | None, kernel: str) -> tuple[jax.Array, kvc.PagedKVCache, Any]:
    """Decode one token per row: append it to the cache (allocating a page at a page boundary)
    and run every loop; dense when wise_config is None, else WISE (state required).

    tokens, request_ids int32[batch]; active bool[batch] (rows WISE counters count).
    Returns (logits float32[batch, vocab], cache, state)."""
    batch = tokens.shape[0]
    positions = cache.seq_lens
    cache = kvc.reserve(cache, positions + 1)
    h = embed(params, tokens)[:, None]
    cos, sin = rope(positions[:, None], config.head_dim, config.rope_theta)
    if wise_config is None:  # every row DENSE; the block size only shapes the unused support
        dense = WiseConfig()
        dense_modes = jnp.full((batch,), M.DENSE, jnp.int32)
        no_support = jnp.zeros((batch, config.num_attention_heads,
                                cache.capacity // dense.block_size), bool)

    for loop in range(config.total_ut_steps):
        def attend(q, k, v, layer, carry, loop=loop):
            cache, state = carry
            plane = loop * config.num_hidden_layers + layer
            cache = kvc.write_token(cache, plane, k[:, 0], v[:, 0])
            k_pages, v_pages, page_table = kvc.plane_pages(cache, plane)
            if wise_config is None:
                out, _ = decode_attention(q[:, 0], k_pages, v_pages, page_table, cache.seq_lens, dense_modes,
                                          no_support, block_size=dense.block_size, eta=dense.eta,
                                          kernel=kernel)
            else:
                out, state = ws.wise_attention(state, wise_config, loop, layer, q[:, 0], k_pages, v_pages,
                                               page_table, cache.seq_lens, request_ids, active, kernel=kernel)
            return out[:, None], (cache, state)
        h, (cache, state) = run_loop(params, config, h, cos, sin, attend, (cache, state))
    return head(params, h[:, 0]), cache, state
