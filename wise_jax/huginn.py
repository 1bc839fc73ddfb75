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

`forward` (whole sequences), `prefill` (one prompt, returning every plane's K/V),
`prefill_chunk` (a prompt chunk continuing one in the paged cache: the serving engine's chunked
prefill, `wise_jax.engine.LLM`) and `decode_step` (one token per row against the paged cache,
`wise_jax.kv_cache` created with `num_planes` planes; dense, or WISE over the core iterations
with Ouro's `wise_jax.wise_state`: core iteration `step` and core layer n are the state's (loop,
layer), so `WiseConfig` depths index core iterations; the prelude and the coda attend densely)
share `run_model`; the plane layout is `wise_core.huginn_reference.plane_index`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wise_core.checkpoint import HUGINN_STACKS, huginn_layers, validate_tensors
from wise_core import modes as M
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.model_config import ModelConfig
from wise_core.wise_config import WiseConfig
from wise_core.huginn_reference import initial_state, num_planes, plane_index
from wise_jax import checks
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.attention import decode_attention
from wise_jax.chunked_prefill import prefix_attention
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


def split_half_rows(w, heads: int, head_dim: int):
    """Rows [heads * head_dim, ...] of one projection (numpy or jax), each head's reordered from
    interleaved pairs (2j, 2j + 1) to split halves (j, j + head_dim / 2)."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return w.reshape(heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def huginn_from_tensors(config: ModelConfig, tensors: dict, dtype=jnp.float32) -> HuginnParams:
    """HuginnParams in `dtype` from HF-named arrays (numpy, or jax arrays laid out where they
    lie: a model drawn on the device stays there; validated against `config`; a tied lm_head
    and freqs_cis are dropped). Each tensor is cast to dtype, then only moved: q's and k's rows
    split-half ordered, qk_bias as the fused qkv bias with zeros on v, linear weights [in, out]."""
    validate_tensors(config, tensors)
    heads, d, h = config.num_attention_heads, config.head_dim, config.hidden_size
    t = {name: jnp.asarray(a, dtype) for name, a in tensors.items()}

    def block(prefix):
        q, k, v = jnp.split(t[prefix + "attn.Wqkv.weight"], 3)
        qkv = jnp.concatenate([split_half_rows(q, heads, d), split_half_rows(k, heads, d), v])
        bias = None
        if config.qk_bias:
            qb, kb = t[prefix + "attn.qk_bias"].reshape(2, h)
            bias = jnp.concatenate([split_half_rows(qb, heads, d), split_half_rows(kb, heads, d), jnp.zeros_like(qb)])
        return BlockParams(qkv.T, bias, t[prefix + "attn.proj.weight"].T, t[prefix + "mlp.fc.weight"].T,
                           t[prefix + "mlp.proj.weight"].T, *(t[prefix + f"norm_{i}.weight"] for i in range(1, 5)))

    stacks = {stack: tuple(block(f"transformer.{stack}.{n}.") for s, n in huginn_layers(config) if s == stack)
              for stack in HUGINN_STACKS}
    lm_head = None if config.tie_word_embeddings else t["lm_head.weight"].T
    return HuginnParams(t["transformer.wte.weight"], stacks["prelude"], t["transformer.adapter.weight"].T,
                        stacks["core_block"], stacks["coda"], t["transformer.ln_f.weight"], lm_head)


def huginn_to_tensors(config: ModelConfig, params: HuginnParams) -> dict[str, np.ndarray]:
    """HuginnParams -> HF-named float32 numpy tensors (`huginn_from_tensors` undone: q's and k's
    rows back to interleaved RoPE pairs, linear weights [out, in], qk_bias from the fused bias)."""
    heads, d = config.num_attention_heads, config.head_dim
    undo = np.argsort(np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)]))

    def get(x):
        return np.asarray(jnp.asarray(x, jnp.float32))

    def interleaved(w):
        return w.reshape(heads, d, *w.shape[1:])[:, undo].reshape(w.shape)

    tensors = {"transformer.wte.weight": get(params.wte), "transformer.adapter.weight": get(params.adapter).T.copy(),
               "transformer.ln_f.weight": get(params.ln_f)}
    blocks = {stack: getattr(params, stack) for stack in HUGINN_STACKS}
    for stack, n in huginn_layers(config):
        bp, prefix = blocks[stack][n], f"transformer.{stack}.{n}."
        q, k, v = np.split(get(bp.qkv).T, 3)
        tensors[prefix + "attn.Wqkv.weight"] = np.concatenate([interleaved(q), interleaved(k), v])
        if config.qk_bias:
            qb, kb, _ = np.split(get(bp.qkv_bias), 3)
            tensors[prefix + "attn.qk_bias"] = np.stack([interleaved(qb), interleaved(kb)]).reshape(2, 1, heads, d)
        tensors[prefix + "attn.proj.weight"] = get(bp.proj).T.copy()
        tensors[prefix + "mlp.fc.weight"] = get(bp.fc).T.copy()
        tensors[prefix + "mlp.proj.weight"] = get(bp.mlp_proj).T.copy()
        for i in range(1, 5):
            tensors[prefix + f"norm_{i}.weight"] = get(getattr(bp, f"norm_{i}"))
    if params.lm_head is not None:
        tensors["lm_head.weight"] = get(params.lm_head).T.copy()
    validate_tensors(config, tensors)
    return tensors


def sandwich_block(bp: BlockParams, config: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array,
                   attend: Callable) -> tuple[jax.Array, Any]:
    """One layer. x: [batch, seq, hidden]; attend(q, k, v) -> (out, aux) with q, k, v, out
    [batch, seq, heads, head_dim]. Returns (x, aux)."""
    batch, seq, hidden = x.shape
    heads, d, eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
    qkv = rms_norm(x, bp.norm_1, eps) @ bp.qkv
    if bp.qkv_bias is not None:
        qkv = qkv + bp.qkv_bias
    q, k, v = (part.reshape(batch, seq, heads, d) for part in jnp.split(qkv, 3, axis=-1))
    a, aux = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    x = rms_norm(a.reshape(batch, seq, hidden) @ bp.proj + x, bp.norm_2, eps)
    gate, up = jnp.split(rms_norm(x, bp.norm_3, eps) @ bp.fc, 2, axis=-1)
    return rms_norm((jax.nn.silu(gate) * up) @ bp.mlp_proj + x, bp.norm_4, eps), aux


# attend(q, k, v, plane, carry, core) -> (out, carry); plane int32 (traced inside a fori_loop over
# the core iterations); core: (step, core layer) of a core-block layer, None in the prelude and coda
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any]]


def run_model(params: HuginnParams, config: ModelConfig, input_ids: jax.Array, state: jax.Array, cos: jax.Array,
              sin: jax.Array, num_steps, attend: Attend, carry: Any = None, *,
              runs: list[tuple[str, range]] | None = None, between: Callable | None = None) -> tuple[jax.Array, Any]:
    """input_ids int32[batch, seq], state [batch, seq, hidden] -> (the coda's normed output
    [batch, seq, hidden], carry): the prelude, num_steps core iterations, the coda, each layer
    attending through `attend(q, k, v, plane, carry, core)` with its plane
    (`wise_core.huginn_reference.plane_index`) and core None (prelude, coda) or (step, layer of
    the core block, role). The iterations: runs None, one `lax.fori_loop` (num_steps may be
    traced; role None); else runs [(role, steps)] cover range(num_steps) in order (a decode
    step's, `WiseConfig.role_runs`), each run a loop of one body with the step traced, or with
    `between` a Python loop (every step static): after iteration i, (x, carry) = between(i, new
    state, state before, carry, readout), where readout(x, carry) -> (the coda's normed output,
    carry) runs the coda on a state."""
    c = config

    def stack(blocks, x, carry, plane0, step=None, role=None):
        for n, bp in enumerate(blocks):
            core = None if step is None else (step, n, role)
            plane = plane0 + n if step is None else plane0 + step * len(blocks) + n
            x, carry = sandwich_block(bp, c, x, cos, sin,
                                      lambda q, k, v, plane=plane, core=core: attend(q, k, v, plane, carry, core))
        return x, carry

    embedded = params.wte.at[input_ids].get(mode="fill", fill_value=jnp.nan) * c.embed_scale
    embedded, carry = stack(params.prelude, embedded, carry, plane_index(c, "prelude", 0))

    def step(i, x_carry, role=None):
        x = jnp.concatenate([x_carry[0], embedded], axis=-1) @ params.adapter
        return stack(params.core_block, x, x_carry[1], plane_index(c, "core_block", 0), i, role)

    def readout(x, carry):
        x, carry = stack(params.coda, rms_norm(x, params.ln_f, c.rms_norm_eps), carry, plane_index(c, "coda", 0))
        return rms_norm(x, params.ln_f, c.rms_norm_eps), carry

    x_carry = (state.astype(embedded.dtype), carry)
    if runs is None:
        x_carry = lax.fori_loop(0, num_steps, step, x_carry)
    for role, steps in runs or ():
        if between is None and len(steps) > 1:
            x_carry = lax.fori_loop(steps.start, steps.stop, functools.partial(step, role=role), x_carry)
            continue
        for i in steps:
            new = step(i, x_carry, role)
            x_carry = new if between is None else between(i, new[0], x_carry[0], new[1], readout)
    return readout(*x_carry)


def head(params: HuginnParams, x: jax.Array) -> jax.Array:
    """Normed output [..., hidden] -> float32 logits [..., vocab] (the head tied to wte unless untied)."""
    w = params.wte.T if params.lm_head is None else params.lm_head
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def _forward(params: HuginnParams, config: ModelConfig, input_ids: jax.Array, num_steps: jax.Array,
             state: jax.Array) -> jax.Array:
    batch, seq = input_ids.shape
    cos, sin = rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)), config.head_dim,
                    config.rope_theta)

    def attend(q, k, v, plane, carry, core):
        return causal_attention(q, k, v), carry

    x, _ = run_model(params, config, input_ids, state, cos, sin, num_steps, attend)
    return head(params, x)


def check_num_steps(num_steps) -> int:
    """num_steps, a non-negative int (`checks.num_steps`)."""
    return checks.num_steps(num_steps)


def forward(params: HuginnParams, config: ModelConfig, input_ids, *, num_steps: int | None = None, seed: int = 0,
            state=None) -> jax.Array:
    """input_ids int32[batch, seq] -> logits float32[batch, seq, vocab], the core block run
    num_steps times (default total_ut_steps) from `state` [batch, seq, hidden] (None: the seeded
    initial state of each position, `wise_core.huginn_reference.initial_state`). params are
    checked against config (`checks.huginn_params`), input_ids as Ouro's (`check_input_ids`)."""
    checks.huginn_params(params, config)
    input_ids = jnp.asarray(input_ids)
    check_input_ids(config, input_ids, 2)
    num_steps = check_num_steps(config.total_ut_steps if num_steps is None else num_steps)
    batch, seq = input_ids.shape
    if state is None:
        state = np.broadcast_to(initial_state(config, np.arange(seq), seed), (batch, seq, config.hidden_size))
    elif tuple(np.shape(state)) != (batch, seq, config.hidden_size):
        raise ValueError(f"state must be [{batch}, {seq}, {config.hidden_size}], got {list(np.shape(state))}")
    return _forward(params, config, input_ids, jnp.int32(num_steps), jnp.asarray(state, params.wte.dtype))


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "all_logits"))
def prefill(params: HuginnParams, config: ModelConfig, tokens: jax.Array, length: jax.Array, state: jax.Array, *,
            num_steps: int, all_logits: bool = False) -> tuple:
    """Causal pass over one right-padded prompt, keeping the K/V of every plane
    (`wise_jax.model.prefill`'s contract). tokens int32[seq] (valid up to length, int32[] >= 1); state [seq, hidden].
    Returns (logits float32[vocab] at position length - 1, k, v [num_planes(config, num_steps),
    seq, heads, head_dim] in the params' dtype); all_logits: logits is (those, the logits
    float32[seq, vocab] at every position), as `wise_jax.model.prefill`. The arguments are
    checked against config and each other before anything is traced (`checks.huginn_prefill`)."""
    checks.huginn_prefill(params, config, tokens, length, state, num_steps)
    seq = tokens.shape[0]
    cos, sin = rope(jnp.arange(seq, dtype=jnp.int32)[None], config.head_dim, config.rope_theta)
    dtype = params.wte.dtype
    shape = (num_planes(config, num_steps), seq, config.num_attention_heads, config.head_dim)

    def attend(q, k, v, plane, buffers, core):
        buffers = tuple(lax.dynamic_update_index_in_dim(b, x[0].astype(dtype), plane, 0)
                        for b, x in zip(buffers, (k, v)))
        return causal_attention(q, k, v), buffers

    x, (k, v) = run_model(params, config, tokens[None], state[None], cos, sin, num_steps, attend,
                          (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
    return _last_logits(params, x[0], length, all_logits), k, v


def _last_logits(params: HuginnParams, x: jax.Array, length: jax.Array, all_logits: bool):
    """The logits after position length - 1 of x [seq, hidden] (all_logits: and at every position)."""
    last = head(params, lax.dynamic_index_in_dim(x, length - 1, 0, keepdims=False))
    return (last, head(params, x)) if all_logits else last


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "all_logits"),
                   donate_argnames=("k_pages", "v_pages"))
def prefill_chunk(params: HuginnParams, config: ModelConfig, k_pages: jax.Array, v_pages: jax.Array,
                  tokens: jax.Array, start: jax.Array, length: jax.Array, table: jax.Array, state_table: jax.Array,
                  *, num_steps: int, all_logits: bool = False) -> tuple:
    """A prompt chunk continuing one already in the paged cache (`wise_jax.chunked_prefill`'s
    contract, its `prefix_attention`): tokens int32[seq] (seq a multiple of page_size, valid up
    to `length`) at positions [start, start + seq) of one request, each from the initial state
    of its position, state_table[position] (state_table [>= start + length, hidden]); every
    plane's K/V written into the request's pages `table` int32[pages] (padding positions: the
    scratch page), each query attending over the request's keys up to its position. k_pages,
    v_pages: the storage [planes, num_pages + 1, page_size, heads, head_dim] (donated). Returns
    (logits float32[vocab] after the chunk's last token, k_pages, v_pages); all_logits as
    `prefill`'s. The arguments are checked against config, num_steps and each other before
    anything is traced (`checks.huginn_prefill_chunk`)."""
    checks.huginn_prefill_chunk(params, config, k_pages, v_pages, tokens, start, length, table, state_table,
                                num_steps)
    seq = tokens.shape[0]
    page_size, scratch = k_pages.shape[2], k_pages.shape[1] - 1
    positions = start + jnp.arange(seq, dtype=jnp.int32)
    valid = jnp.arange(seq) < length
    page = jnp.where(valid, table[jnp.minimum(positions // page_size, table.shape[0] - 1)], scratch)
    offset, keys = positions % page_size, table.shape[0] * page_size
    cos, sin = rope(positions[None], config.head_dim, config.rope_theta)

    def attend(q, k, v, plane, pages, core):
        pages = tuple(store.at[plane, page, offset].set(x[0].astype(store.dtype)) for store, x in zip(pages, (k, v)))
        context = [store[plane, table].reshape((keys,) + store.shape[3:]) for store in pages]
        return prefix_attention(q[0], *context, positions, start + length, page_size)[None], pages

    x, (k_pages, v_pages) = run_model(params, config, tokens[None], state_table[positions][None], cos, sin, num_steps,
                                      attend, (k_pages, v_pages))
    return _last_logits(params, x[0], length, all_logits), k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "kernel", "wise_config", "adaptive", "allocate",
                                             "scan_loops"))
def decode_step(params: HuginnParams, config: ModelConfig, cache: kvc.PagedKVCache, tokens: jax.Array,
                state: jax.Array, tags: jax.Array, *, num_steps: int, kernel: str = "auto",
                wise_config: WiseConfig | None = None, wise_state: ws.WiseState | None = None,
                adaptive: AdaptiveDepth | None = None, allocate: bool = True, scan_loops: bool = True):
    """One decode token per cache row (`wise_jax.model.decode_step`'s contract): tokens int32[batch]
    at each row's position seq_lens, state [batch, hidden] (the initial recurrent state), tags
    int32[batch] (each row's WISE token tag, `wise_core.engine.step_plan`; -1: an empty row, a
    masked no-op).
    The cache holds num_planes(config, >= num_steps) planes. wise_config: WISE over the core
    iterations (its depths index them, each < num_steps) with `wise_state` (`wise_state.create`
    with layers = the core block's); None: every plane dense. Each run of core iterations of one
    role (`WiseConfig.role_runs`; all of them without WISE) is one loop body, the step traced;
    with adaptive depth, or scan_loops False, every iteration is straight-line.
    adaptive: per-token adaptive depth (`wise_core.huginn_reference`'s; `wise_torch.huginn`'s
    decode_step: rows that exited ride along held, their later iterations' K/V their exit
    iteration's). allocate: as `wise_jax.model.decode_step`'s. Returns (logits float32[batch,
    vocab] (garbage for masked rows), cache, wise_state), and with adaptive also the iterations
    each row ran, int32[batch]. Every argument is checked against config, num_steps, wise_config
    and the others before anything is traced (`checks.huginn_decode_step`)."""
    checks.huginn_decode_step(params, config, cache, tokens, state, tags, num_steps, wise_config, wise_state,
                              adaptive)
    batch = tokens.shape[0]
    active = tags >= 0
    positions = cache.seq_lens
    grow = active & ~cache.overflowed
    cache, live = kvc.grow_rows(cache, grow, allocate=allocate)
    seq_lens = jnp.where(live, cache.seq_lens, 1)
    cos, sin = rope(positions[:, None], config.head_dim, config.rope_theta)
    dense = WiseConfig()
    modes = jnp.full((batch,), M.DENSE, jnp.int32)
    support = jnp.zeros((batch, config.num_attention_heads, cache.capacity // dense.block_size), bool)

    def attend(q, k, v, plane, carry, core):
        cache, wise_state = carry
        cache = kvc.write_token(cache, plane, k[:, 0], v[:, 0], live)
        k_pages, v_pages, page_table = kvc.plane_pages(cache, plane)
        if wise_config is None or core is None:
            out, _ = decode_attention(q[:, 0], k_pages, v_pages, page_table, seq_lens, modes, support,
                                      block_size=dense.block_size, eta=dense.eta, kernel=kernel, validate=False)
            return out[:, None], (cache, wise_state)
        step, layer, role = core
        if layer == 0 and role == "reuse":   # every layer's counts at once
            wise_state = ws.count_reuse(wise_state, wise_config, step, seq_lens, tags, live,
                                        cache.capacity // wise_config.block_size)
        out, wise_state = ws.wise_attention(wise_state, wise_config, step, layer, q[:, 0], k_pages, v_pages,
                                            page_table, seq_lens, tags, live, kernel=kernel, validate=False,
                                            count=False, role=role)
        return out[:, None], (cache, wise_state)

    exits = AdaptiveExits(params, config, num_steps, adaptive, live)
    runs = [("dense", range(num_steps))] if wise_config is None else wise_config.role_runs(num_steps)
    if not scan_loops:
        runs = [(role, range(i, i + 1)) for role, steps in runs for i in steps]
    x, (cache, wise_state) = run_model(params, config, tokens[:, None], state[:, None], cos, sin, num_steps, attend,
                                       (cache, wise_state), runs=runs, between=None if adaptive is None else exits)
    logits = head(params, x[:, 0])
    return (logits, cache, wise_state) if adaptive is None else (logits, cache, wise_state, exits.last + 1)


class AdaptiveExits:
    """The exits of one decode step, run between its unrolled core iterations (`run_model`'s
    between): rows exit on the released KL criterion (`AdaptiveDepth`) and ride along held."""

    def __init__(self, params: HuginnParams, config: ModelConfig, num_steps: int, adaptive: AdaptiveDepth | None,
                 live: jax.Array):
        self.params, self.config, self.num_steps, self.adaptive, self.live = params, config, num_steps, adaptive, live
        self.exited = jnp.zeros(live.shape, bool)
        self.last = jnp.full(live.shape, num_steps - 1, jnp.int32)
        self.previous = None

    def __call__(self, i, new, old, carry, readout):
        x = jnp.where(self.exited[:, None, None], old, new)
        cache, wise_state = carry
        cache = hold_exited(cache, self.config, self.exited & self.live, self.last, i)
        if self.adaptive.min_steps <= i < self.num_steps - 1:
            out, (cache, wise_state) = readout(x, (cache, wise_state))
            log_p = jax.nn.log_softmax(head(self.params, out[:, 0]), axis=-1)
            previous = (jnp.full_like(log_p, -np.log(log_p.shape[-1])) if self.previous is None else self.previous)
            now = ~self.exited & ((jnp.exp(previous) * (previous - log_p)).sum(-1) < self.adaptive.threshold)
            self.last = jnp.where(now, i, self.last)
            self.exited, self.previous = self.exited | now, log_p
        return x, (cache, wise_state)


def hold_exited(cache: kvc.PagedKVCache, config: ModelConfig, exited: jax.Array, last: jax.Array,
                step: int) -> kvc.PagedKVCache:
    """The released "latest-m4" lookup, written ahead: iteration `step`'s K/V of each row that
    exited (bool[batch], live rows only: after iteration last[row] < step) becomes its
    iteration-last K/V, at its newest position (`kv_cache.write_token`'s slot; other rows touch
    only the scratch page)."""
    position = jnp.maximum(cache.seq_lens - 1, 0)
    page = jnp.take_along_axis(cache.page_table, (position // cache.page_size)[:, None], axis=1)[:, 0]
    page = jnp.where(exited, page, cache.scratch_page)
    offset = position % cache.page_size
    core = config.n_layers_in_recurrent_block
    k, v = cache.k, cache.v
    for n in range(core):
        source = plane_index(config, "core_block", n, 0) + last * core
        target = plane_index(config, "core_block", n, step)
        k = k.at[target, page, offset].set(k[source, page, offset])
        v = v.at[target, page, offset].set(v[source, page, offset])
    return dataclasses.replace(cache, k=k, v=v)
