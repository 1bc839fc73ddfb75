"""The Ouro recurrent-depth decoder as pure functions.

Structure (docs/DESIGN.md "Model"): embed; `total_ut_steps` loops, each a `lax.scan` of the
sandwich-norm `decoder_layer` over the stacked layers (a Python loop over unstacked ones, see
`params.unstack_layers`) followed by `model.norm`; the early-exit gate on each loop's normed
state; the head on the last loop, or with `early_exit_threshold` < 1 on each token's exit loop
(`wise_jax.early_exit`: prefill and `forward` run every loop, decode stops a row after its exit
loop; `forward_with_exits` returns the last loop's logits and the exit probabilities).
Three callers share `run_loop` and differ only in how a layer attends: `forward` (causal,
differentiable), `prefill` (causal, one request, returning the K/V of every plane) and
`decode_step` (one token per cache row against the paged cache, dense or WISE). Whole-sequence
attention is `wise_jax.prefill_attention.causal_attention` (never a [seq, seq] score matrix).
Under tensor parallelism (`wise_jax.sharding`) these run per device at the local heads, and
`axis_name` names the mesh axis over which the o_proj and down_proj outputs are summed.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wise_core import modes as M
from wise_core.model_config import ModelConfig
from wise_core.wise_config import WiseConfig
from wise_jax import checks
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.attention import decode_attention
from wise_jax.early_exit import ExitState
from wise_jax.params import LayerParams, Params, stack_layers
from wise_jax.prefill_attention import causal_attention


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


def linear(x: jax.Array, w: jax.Array | tuple[jax.Array, ...]) -> jax.Array:
    """x @ w; a tuple w (see `params.split_projections`) runs one GEMM per part and concatenates."""
    if isinstance(w, tuple):
        return jnp.concatenate([x @ part for part in w], axis=-1)
    return x @ w


def mlp(lp: LayerParams, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up from one GEMM. x: [batch, seq, hidden]."""
    gate, up = jnp.split(linear(x, lp.gate_up_proj), 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ lp.down_proj


# attend(q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim], layer, carry)
#   -> (out [batch, seq, heads, head_dim], carry)
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def decoder_layer(lp: LayerParams, config: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Callable, axis_name: str | None = None) -> tuple[jax.Array, Any]:
    """One sandwich-norm layer. lp: one layer's weights; h: [batch, seq, hidden];
    attend(q, k, v) -> (out, aux). axis_name: psum the o_proj and down_proj outputs over this
    mesh axis (a device's heads and MLP columns give partial sums). Returns (h, aux)."""
    batch, seq, _ = h.shape
    heads, kv_heads, dim, eps = (config.num_attention_heads, config.num_key_value_heads,
                                 config.head_dim, config.rms_norm_eps)
    x = rms_norm(h, lp.input_layernorm, eps)
    q, k, v = jnp.split(linear(x, lp.qkv_proj), [heads * dim, (heads + kv_heads) * dim], axis=-1)
    q = apply_rope(q.reshape(batch, seq, heads, dim), cos, sin)
    k = apply_rope(k.reshape(batch, seq, kv_heads, dim), cos, sin)
    v = v.reshape(batch, seq, kv_heads, dim)
    a, aux = attend(q, k, v)
    o = a.reshape(batch, seq, heads * dim) @ lp.o_proj
    if axis_name is not None:
        o = lax.psum(o, axis_name)
    h = h + rms_norm(o, lp.input_layernorm_2, eps)
    x = rms_norm(h, lp.post_attention_layernorm, eps)
    m = mlp(lp, x)
    if axis_name is not None:
        m = lax.psum(m, axis_name)
    h = h + rms_norm(m, lp.post_attention_layernorm_2, eps)
    return h, aux


def run_loop(params: Params, config: ModelConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
             attend: Attend, carry: Any = None, *, remat: bool = False,
             unroll: int | bool = 1, axis_name: str | None = None, residual: bool = False) -> tuple:
    """One pass over the shared layers (a scan, `unroll` layers per scan step, True unrolling
    all; a Python loop over unstacked layers), then model.norm. h: [batch, seq, hidden]. `carry`
    threads through every layer's `attend`; axis_name: see `decoder_layer`. Returns (normed h,
    carry), with residual (normed h, carry, h before the norm)."""
    def body(state, xs):
        h, carry = state
        lp, layer = xs
        h, carry = decoder_layer(lp, config, h, cos, sin, lambda q, k, v: attend(q, k, v, layer, carry),
                                 axis_name)
        return (h, carry), None

    if remat:
        body = jax.checkpoint(body)
    unstacked = isinstance(params.layers, tuple)
    count = len(params.layers) if unstacked else jax.tree.leaves(params.layers)[0].shape[0]
    if count != config.num_hidden_layers:
        raise ValueError(f"params hold {count} layers, the config {config.num_hidden_layers}")
    if unstacked:  # `params.unstack_layers`: a static layer index
        for layer, lp in enumerate(params.layers):
            (h, carry), _ = body((h, carry), (lp, layer))
    else:
        layers = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
        (h, carry), _ = lax.scan(body, (h, carry), (params.layers, layers), unroll=unroll)
    normed = rms_norm(h, params.norm, config.rms_norm_eps)
    return (normed, carry, h) if residual else (normed, carry)


def check_input_ids(config: ModelConfig, input_ids, dims: int) -> None:
    """Raise ValueError (the messages of wise_torch's model) unless input_ids is an integer array
    of `dims` dims with at most max_position_embeddings positions and, when its values are
    concrete (not traced), every id in [0, vocab_size)."""
    dtype = getattr(input_ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or input_ids.ndim != dims:
        raise ValueError(f"input_ids must be an integer tensor with {dims} dims, got "
                         f"{dtype}{list(getattr(input_ids, 'shape', ()))}")
    if dims == 2 and input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_position_embeddings "
                         f"({config.max_position_embeddings})")
    try:
        ids = np.asarray(input_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: out-of-range ids embed as NaN (see `embed`)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"input_ids hold ids {sorted(set(bad.tolist()))[:5]} outside the vocabulary "
                         f"(size {config.vocab_size})")


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens int32[...] -> [..., hidden]; an id outside the vocabulary embeds as NaN (never
    clamped), so a traced bad id shows in the logits."""
    return params.embed_tokens.at[tokens].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)


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


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """segment_ids int[batch, seq] -> int32[batch, seq]: each token's index in its run of equal
    consecutive ids (0 where a row's id changes), the RoPE positions of sequences packed one after
    another, each as if it ran alone (`forward`'s positions)."""
    seq = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones(segment_ids.shape[:-1] + (1,), bool),
                              segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    return index - lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)


def _run(params: Params, config: ModelConfig, input_ids: jax.Array, positions, segment_ids, *, remat: bool,
         attention: str, exits: bool, return_hidden: bool) -> tuple:
    """The whole-sequence pass `forward` and `forward_with_exits` share, every loop for every
    token -> (the last loop's normed states [batch, seq, hidden], or each token's exit loop's
    with `exits` (early_exit_threshold < 1); the gate probabilities float32[loops, batch, seq];
    the states before model.norm after each loop [loops, batch, seq, hidden], or None)."""
    batch, seq = input_ids.shape
    h = embed(params, input_ids)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    cos, sin = rope(positions, config.head_dim, config.rope_theta)

    def attend(q, k, v, layer, carry):
        return causal_attention(q, k, v, implementation=attention, segment_ids=segment_ids), carry

    state = exits_for(config, h) if exits else None
    lambdas, hidden = [], []
    for loop in range(config.total_ut_steps):
        h, _, *residual = run_loop(params, config, h, cos, sin, attend, remat=remat, residual=return_hidden)
        hidden += residual
        lambdas.append(exit_gate(params, h))
        if state is not None:
            state = state.end_loop(loop, h, lambdas[-1])
    out = h if state is None else state.output(h)
    return out, jnp.stack(lambdas), jnp.stack(hidden) if return_hidden else None


def _checked(params, config, input_ids, positions, segment_ids, return_hidden) -> None:
    checks.params(params, config)
    check_input_ids(config, input_ids, 2)
    checks.forward_inputs(input_ids, positions, segment_ids, return_hidden)


def forward_with_exits(params: Params, config: ModelConfig, input_ids: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       return_hidden: bool = False, remat: bool = False, attention: str = "auto") -> tuple:
    """input_ids int32[batch, seq] -> (logits float32[batch, seq, vocab] of the last loop,
    exit probabilities float32[loops, batch, seq]); with return_hidden (logits, exit
    probabilities, hidden), hidden as `forward`'s. positions, segment_ids: as `forward`'s.
    Differentiable; `remat` recomputes each layer in the backward pass (only layer inputs are
    kept). attention: see `prefill_attention.causal_attention`. Bad ids and too-long sequences
    raise ValueError (`check_input_ids`); params that do not match config, and positions or
    segment_ids that do not match input_ids, raise (`checks.params`, `checks.forward_inputs`)."""
    _checked(params, config, input_ids, positions, segment_ids, return_hidden)
    h, lambdas, hidden = _run(params, config, input_ids, positions, segment_ids, remat=remat, attention=attention,
                              exits=False, return_hidden=return_hidden)
    logits, probs = head(params, h), exit_probabilities(lambdas)
    return (logits, probs, hidden) if return_hidden else (logits, probs)


def exits_for(config: ModelConfig, h: jax.Array) -> ExitState | None:
    """The early exit of rows of states like h [*rows, hidden]; None when every loop runs
    (early_exit_threshold 1)."""
    if config.early_exit_threshold >= 1.0:
        return None
    return ExitState.create(h, config.total_ut_steps, config.early_exit_threshold)


def forward(params: Params, config: ModelConfig, input_ids: jax.Array, *, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_hidden: bool = False, remat: bool = False,
            attention: str = "auto") -> jax.Array | tuple[jax.Array, jax.Array]:
    """input_ids int32[batch, seq] -> logits float32[batch, seq, vocab] of each token's exit loop
    (every loop runs; the last loop's when early_exit_threshold is 1).

    positions int[batch, seq] (None: 0..seq-1 in every row): each token's RoPE position, any
    integers (not checked against max_position_embeddings; the limit on seq stays).
    segment_ids int[batch, seq] (None: one segment a row): packed sequences, each token attending
    only to the earlier tokens of its own segment id (causal AND the same id); padding may be a
    segment of its own. Positions stay as given: to run each packed sequence as if alone, pass
    positions that restart at 0 in each segment (`segment_positions(segment_ids)`); with the
    default positions a row's later segments run at later positions (the same logits up to the
    float32 rounding of the RoPE angles, as attention depends only on position differences).
    With segment_ids, "auto" attention is the chunked jnp one on a GPU too (`prefill_attention`).
    return_hidden: returns (logits, hidden), hidden [loops, batch, seq, hidden] in the params'
    dtype: the residual stream after each loop's last layer, before model.norm. The logit lens of
    loop l is `head(params, rms_norm(hidden[l], params.norm, config.rms_norm_eps))`; that of the
    last loop (of each token's exit loop, early_exit_threshold < 1) is the logits; model.norm of
    hidden[l] is loop l + 1's input. The torch reference's forward (wise_torch) takes none of the
    three arguments.

    Checked as `forward_with_exits`; the defaults compute what they did before these arguments."""
    _checked(params, config, input_ids, positions, segment_ids, return_hidden)
    h, _, hidden = _run(params, config, input_ids, positions, segment_ids, remat=remat, attention=attention,
                        exits=config.early_exit_threshold < 1.0, return_hidden=return_hidden)
    logits = head(params, h)
    return (logits, hidden) if return_hidden else logits


def prefill(params: Params, config: ModelConfig, tokens: jax.Array, length: jax.Array, *,
            attention: str = "auto", unroll: int | bool = 1, axis_name: str | None = None,
            all_logits: bool = False) -> tuple:
    """Causal pass over one right-padded prompt, keeping the K/V of every plane.

    tokens int32[seq] (valid up to `length`, int32[] >= 1). Returns (logits float32[vocab] at
    position length - 1, of its exit loop (every loop runs for every token), k, v [planes, seq,
    kv_heads, head_dim] in the params' dtype); all_logits: logits is (those, the logits
    float32[seq, vocab] at every position, each of its token's exit loop), each its own product
    (a prompt's scores, SamplingParams.prompt_logprobs). The K/V buffers are written in place
    layer by layer (no per-loop copies). The layers always run
    as a scan (one quick compile per prompt bucket): unstacked weights are stacked here, one copy
    of the layer weights per call, small beside the prefill's own work. The arguments are
    checked against config (`checks.prefill`)."""
    checks.prefill(params, config, tokens, length)
    params = stack_layers(params)
    seq = tokens.shape[0]
    planes = config.total_ut_steps * config.num_hidden_layers
    h = embed(params, tokens[None])
    cos, sin = rope(jnp.arange(seq, dtype=jnp.int32)[None], config.head_dim, config.rope_theta)
    shape = (planes, seq, config.num_key_value_heads, config.head_dim)
    dtype = params.embed_tokens.dtype
    buffers = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    exits = exits_for(config, h[0])
    for loop in range(config.total_ut_steps):
        def attend(q, k, v, layer, buffers, loop=loop):
            plane = loop * config.num_hidden_layers + layer
            buffers = tuple(lax.dynamic_update_index_in_dim(b, x[0].astype(dtype), plane, 0)
                            for b, x in zip(buffers, (k, v)))
            return causal_attention(q, k, v, implementation=attention), buffers
        h, buffers = run_loop(params, config, h, cos, sin, attend, buffers, unroll=unroll, axis_name=axis_name)
        if exits is not None:                                    # every token's exit, as torch's
            exits = exits.end_loop(loop, h[0], exit_gate(params, h[0]))
    out = h[0] if exits is None else exits.output(h[0])          # each token's exit loop
    last = lax.dynamic_index_in_dim(out, length - 1, 0, keepdims=False)
    logits = (head(params, last), head(params, out)) if all_logits else head(params, last)
    return logits, buffers[0], buffers[1]


def decode_step(params: Params, config: ModelConfig, cache: kvc.PagedKVCache, state: ws.WiseState | None,
                tokens: jax.Array, tags: jax.Array, *, wise_config: WiseConfig | None, kernel: str,
                unroll: int | bool = 1, axis_name: str | None = None,
                width: int | None = None, return_depths: bool = False, allocate: bool = True,
                scan_loops: bool = True) -> tuple:
    """Decode one token per cache row: append it (allocating a page at a page boundary) and run
    every loop; dense when wise_config is None, else WISE (state required).

    tokens int32[batch]: the token at each row's position seq_lens; tags int32[batch]: each row's
    WISE token tag (`wise_core.engine.step_plan`), -1 for an empty row (a tag reused across steps,
    e.g. a request's id, is safe: `wise_jax.wise_state`). With early_exit_threshold < 1 a row stops
    after its exit loop (`wise_jax.early_exit`): its logits are that loop's and its K/V of the
    later loops that loop's; it rides along masked. An empty row is a masked no-op: it reserves
    nothing, writes only the scratch page, attends one scratch key and leaves its WISE state alone.
    When the pool cannot hold the step's new pages nothing is written, no row advances, and
    `cache.overflowed` is set (the caller reports it); a cache whose flag is already set is written
    no more. The attention inputs are built here by construction, so their values are not validated
    (no host callback per call). width: the step's context bucket, the page-table columns (and WISE
    support blocks) attention reads (None: all); a row that would need more pages than that does
    not fit (the step writes nothing, as for a full pool). A row's attention does not depend on it
    beyond its keys. Returns (logits float32[batch, vocab] (garbage for masked rows), cache,
    state), and with return_depths the loops each row ran, int32[batch] (its exit loop + 1).
    allocate=False: the page table already holds every active row's page for its new token (an
    engine's host allocator chose it, `wise_core.engine.step_plan`): nothing is taken from the free
    stack and no row overflows. scan_loops: each run of consecutive loops of one role (all loops
    dense; WISE's discovery loops, its reuse loops: `WiseConfig.role_runs`) runs as a `lax.scan` of
    one loop body, the plane index traced, so the program holds one copy of the layers per run, not
    per loop (a shorter compile); False: every loop straight-line, the same arithmetic. An fp8
    cache (`kv_cache`, kv_cache_dtype "fp8"): the new K/V are written quantized, an exited row's
    later planes take its exit loop's codes and scales, and attention reads the pages dequantized
    to the params' dtype (the reference kernel, `attention.resolve_kernel`). Every
    argument is checked against config, wise_config and the others before anything is traced
    (`checks.decode_step`)."""
    checks.decode_step(params, config, cache, state, tokens, tags, wise_config, width)
    batch = tokens.shape[0]
    active = tags >= 0
    positions = cache.seq_lens
    grow = active & ~cache.overflowed                 # a cache that overflowed once takes no more
    cache, live = kvc.grow_rows(cache, grow, width, allocate)
    pages = cache.max_pages if width is None else width
    seq_lens = jnp.where(live, cache.seq_lens, 1)    # a masked row attends its first key (scratch)
    h = embed(params, tokens)[:, None]
    cos, sin = rope(positions[:, None], config.head_dim, config.rope_theta)
    if wise_config is None:  # every row DENSE; the block size only shapes the unused support
        dense = WiseConfig()
        dense_modes = jnp.full((batch,), M.DENSE, jnp.int32)
        no_support = jnp.zeros((batch, config.num_attention_heads, pages * cache.page_size // dense.block_size), bool)

    layers = config.num_hidden_layers
    n_blocks = pages * cache.page_size // (dense.block_size if wise_config is None else wise_config.block_size)

    def one_loop(carry, loop, role):
        """Loop `loop` (a Python int, or a traced int32[] inside a scan) of role `role`."""
        h, cache, state, exits = carry
        if role == "reuse":       # every layer's counts at once
            ran = live if exits is None else live & ~exits.exited    # a row that exited is not counted
            state = ws.count_reuse(state, wise_config, loop, seq_lens, tags, ran, n_blocks)

        def attend(q, k, v, layer, carry):
            cache, state = carry
            plane = loop * layers + layer
            k, v = k[:, 0], v[:, 0]
            if exits is not None and not (isinstance(loop, int) and loop == 0):   # none exited before loop 0
                # entries, not values: an fp8 cache copies the earlier plane's codes and scales
                k, v = exits.store_kv(*kvc.encode(cache, k, v),
                                      *kvc.read_token(cache, jnp.maximum(plane - layers, 0), live))
            cache = kvc.write_token(cache, plane, k, v, live)
            k_pages, v_pages, page_table = kvc.plane_pages(cache, plane, width)
            scales = dict(zip(("k_scale", "v_scale"), kvc.plane_scales(cache))) if cache.quantized else {}
            if wise_config is None:
                out, _ = decode_attention(q[:, 0], k_pages, v_pages, page_table, seq_lens, dense_modes,
                                          no_support, block_size=dense.block_size, eta=dense.eta,
                                          kernel=kernel, validate=False, **scales)
            else:
                out, state = ws.wise_attention(state, wise_config, loop, layer, q[:, 0], k_pages, v_pages,
                                               page_table, seq_lens, tags, live, kernel=kernel, validate=False,
                                               count=False, role=role, **scales)
            return out[:, None], (cache, state)
        h, (cache, state) = run_loop(params, config, h, cos, sin, attend, (cache, state), unroll=unroll,
                                     axis_name=axis_name)
        if exits is not None:
            exits = exits.end_loop(loop, h[:, 0], exit_gate(params, h[:, 0]))
        return h, cache, state, exits

    carry = (h, cache, state, exits_for(config, h[:, 0]))
    runs = ([("dense", range(config.total_ut_steps))] if wise_config is None
            else wise_config.role_runs(config.total_ut_steps))
    for role, loops in runs:
        if scan_loops and len(loops) > 1:    # one compiled body for the run's loops
            carry, _ = lax.scan(lambda c, loop, role=role: (one_loop(c, loop, role), None), carry,
                                jnp.arange(loops.start, loops.stop, dtype=jnp.int32))
        else:
            for loop in loops:
                carry = one_loop(carry, loop, role)
    h, cache, state, exits = carry
    logits = head(params, h[:, 0] if exits is None else exits.output(h[:, 0]))
    if not return_depths:
        return logits, cache, state
    loops = config.total_ut_steps
    return logits, cache, state, jnp.full((batch,), loops, jnp.int32) if exits is None else exits.exit_loop + 1
