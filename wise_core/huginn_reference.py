"""The numpy specification of the Huginn forward (huginn-0125's architecture), in float64.

Tensors are the HF checkpoint's (`wise_core.checkpoint.huginn_shapes`). For tokens t at
positions p:

    e = prelude(wte[t] * sqrt(hidden))                   # n_layers_in_prelude layers
    x = s0                                               # the initial state, `initial_state`
    repeat num_steps times:                              # the core block, weights shared
        x = core_block(adapter @ [x, e])                 # adapter: [hidden, 2 hidden]
    logits = wte @ ln_f(coda(ln_f(x)))                   # ln_f twice; the head tied to wte

Every layer is a sandwich block: x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x)))
with RMS norms (eps rms_norm_eps); attn adds qk_bias to q and k, then RoPE on interleaved pairs
(dims 2j, 2j + 1 rotate by the angle float32(p * f_j), f_j = theta ** (-2j / head_dim) rounded
to float32: the released code's float32 table, whose float32 power may differ from f_j by an
ulp), causal softmax attention scaled by head_dim ** -0.5; mlp is proj(silu(gate) * up) with
fc's rows [gate; up].

K/V is cached per plane (`plane_index`): one per prelude layer, one per coda layer, one per
(core iteration, core layer); a call appends its positions to the planes it runs. A call deeper
than an earlier one would read core planes that lack the earlier positions: that is an error.

Adaptive depth (`huginn_forward(..., adaptive=AdaptiveDepth)`, one token a call): the released
KL criterion (`AdaptiveDepth`); the coda and head run after each checked iteration without
caching the coda's K/V, and once more, cached, on the exit state. A token that exits after
iteration e writes its iteration-e K/V into the planes of iterations e + 1.. too: a later token
reading it at iteration j reads iteration min(j, e), the latest it computed at that core layer,
which is the released "latest-m4" lookup, with no lookup at read time.

WISE decode (`huginn_forward(..., wise=WiseConfig)`, one token a call): depths are core
iterations. `WiseConfig.discover_depths` and `reuse_depths` index iterations 0..num_steps-1; the
support is per (token, core layer, head), OR-ed over the discovery iterations; a reuse
iteration attends only it; an iteration in neither set, and every prelude and coda layer, attends
densely. Here every discovery iteration runs before the first reuse one (`WiseConfig` orders
them, and a depth >= num_steps is an error), so a token's support is always complete; the
frameworks' decode states fall back to dense where it is not, as for Ouro.

The initial state (`initial_state`): "like-init" is what the released code uses at inference
(init_scale 1): a normal truncated at 3 standard deviations, std sqrt(2 / (5 hidden)), times
sqrt(hidden); here drawn per position from numpy's generator seeded with (seed, position), so a
token's state does not depend on how its prompt is split into calls. "zero" starts from zeros
(the released code's init_scale 0).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from wise_core import reference as wise_ref
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.checkpoint import huginn_layers, validate_tensors
from wise_core.model_config import ModelConfig
from wise_core.ouro_reference import rms_norm
from wise_core.wise_config import WiseConfig


def plane_index(config: ModelConfig, stack: str, layer: int, step: int = 0) -> int:
    """The K/V plane of a layer: the prelude's layers first, then the coda's, then the core
    block's layers of iteration 0, 1, ... (a cache for fewer iterations keeps every prelude and
    coda plane where it is)."""
    prelude, core, coda = config.n_layers_in_prelude, config.n_layers_in_recurrent_block, config.n_layers_in_coda
    if stack == "prelude":
        return layer
    if stack == "coda":
        return prelude + layer
    return prelude + coda + step * core + layer


def num_planes(config: ModelConfig, max_steps: int) -> int:
    """Planes of a cache for up to max_steps core iterations."""
    return config.n_layers_in_prelude + config.n_layers_in_coda + max_steps * config.n_layers_in_recurrent_block


@dataclasses.dataclass
class HuginnCache:
    """K/V per plane (`plane_index`): planes[plane] = (k, v), each [positions, kv_heads, head_dim]
    float64; length: positions seen (every call runs the prelude, so its planes hold them all);
    depths: the core iterations each position computed (fewer than the call's num_steps where
    it exited early: its later iterations' planes then hold its last computed iteration's K/V)."""

    planes: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    length: int = 0
    depths: list[int] = dataclasses.field(default_factory=list)


def truncated_normal(rng: np.random.Generator, size: int, bound: float = 3.0) -> np.ndarray:
    """Standard normal draws conditioned on |z| <= bound: out-of-range draws are drawn again."""
    z = rng.standard_normal(size)
    bad = np.abs(z) > bound
    while bad.any():
        z[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(z) > bound
    return z


def initial_state(config: ModelConfig, positions, seed: int = 0) -> np.ndarray:
    """The core block's initial state at `positions` -> [len(positions), hidden] float64 (see the
    module docstring: config.state_init "like-init" or "zero"). seed: a non-negative int."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    positions = np.asarray(positions)
    if config.state_init == "zero":
        return np.zeros((len(positions), config.hidden_size))
    scale = config.state_std * config.embed_scale
    return np.stack([truncated_normal(np.random.default_rng((seed, int(p))), config.hidden_size) * scale
                     for p in positions]).reshape(len(positions), config.hidden_size)


def huginn_weights(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's tensors (any float dtype, bf16 included), checked against the config, as
    float64; the tied head's lm_head.weight is wte's."""
    if config.architecture != "huginn":
        raise ValueError(f"huginn_weights needs a Huginn config, got architecture {config.architecture!r}")
    validate_tensors(config, tensors)
    out = {name: np.asarray(t, np.float64) for name, t in tensors.items() if name != "freqs_cis"}
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x: [seq, heads, head_dim]; rotates interleaved pairs (2j, 2j + 1) by position * inv_freq[j]."""
    d = x.shape[-1]
    inv_freq = (float(theta) ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    angle = np.outer(positions.astype(np.float32), inv_freq).astype(np.float64)  # float32 angles, as released
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """q: [seq, heads, d]; k, v: [n_keys, heads, d] (keys at positions 0..n_keys-1) -> [seq, heads, d],
    causal: query at position p reads keys <= p."""
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    causal = np.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = np.where(causal[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def sandwich_block(config: ModelConfig, w: dict[str, np.ndarray], prefix: str, x: np.ndarray,
                   positions: np.ndarray, cache: HuginnCache, key: int, attend: Callable | None = None
                   ) -> np.ndarray:
    """One layer (weights `prefix`*) on x: [seq, hidden], appending its K/V to `cache` plane `key`.
    attend(q, k, v) -> out [seq, heads, d] (None: causal `attention`)."""
    eps, heads, d = config.rms_norm_eps, config.num_attention_heads, config.head_dim
    seq = x.shape[0]
    qkv = rms_norm(x, w[prefix + "norm_1.weight"], eps) @ w[prefix + "attn.Wqkv.weight"].T
    q, k, v = (part.reshape(seq, heads, d) for part in np.split(qkv, 3, axis=-1))
    if config.qk_bias:
        bias = w[prefix + "attn.qk_bias"]
        q, k = q + bias[0, 0], k + bias[1, 0]
    q, k = rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta)
    old_k, old_v = cache.planes.get(key, (np.zeros((0, heads, d)), np.zeros((0, heads, d))))
    k, v = np.concatenate([old_k, k]), np.concatenate([old_v, v])
    cache.planes[key] = (k, v)
    out = attention(q, k, v, positions) if attend is None else attend(q, k, v)
    attn = out.reshape(seq, heads * d) @ w[prefix + "attn.proj.weight"].T
    x = rms_norm(x + attn, w[prefix + "norm_2.weight"], eps)
    gate, up = np.split(rms_norm(x, w[prefix + "norm_3.weight"], eps) @ w[prefix + "mlp.fc.weight"].T, 2, axis=-1)
    mlp = (gate / (1.0 + np.exp(-gate)) * up) @ w[prefix + "mlp.proj.weight"].T
    return rms_norm(x + mlp, w[prefix + "norm_4.weight"], eps)


def wise_attend(wise: WiseConfig, supports: dict[int, np.ndarray], step: int, layer: int) -> Callable | None:
    """The attention of core layer `layer` at iteration `step` of one decode token under WISE
    (None: dense, an iteration in neither depth set): `attend(q [1, heads, d], k, v)` for
    `sandwich_block`. A discovery iteration attends densely and stores the selection of its
    block mass (`wise_core.reference.select_blocks` with `wise.rule`; every causal block with
    all_blocks) in supports[layer] bool[heads, n_blocks], OR-ed onto the earlier discovery
    iterations' of this token; a reuse iteration attends only supports[layer]."""
    role = wise.depth_role(step)
    if role == "dense":
        return None

    def attend(q, k, v):
        if role == "reuse":
            out, _ = wise_ref.attention(q[0], k, v, block_size=wise.block_size, support=supports[layer])
            return out[None]
        out, mass = wise_ref.attention(q[0], k, v, block_size=wise.block_size)
        selected = (wise_ref.all_blocks(k.shape[0], wise.block_size, mass.shape[:1], mass.shape[-1])
                    if wise.all_blocks else wise_ref.select_blocks(mass, wise.rule))
        supports[layer] = selected if step == wise.discover_depths[0] else supports[layer] | selected
        return out[None]
    return attend


def huginn_forward(config: ModelConfig, weights: dict[str, np.ndarray], tokens, *, num_steps: int | None = None,
                   cache: HuginnCache | None = None, seed: int = 0, state: np.ndarray | None = None,
                   wise: WiseConfig | None = None, adaptive: AdaptiveDepth | None = None) -> np.ndarray:
    """Logits [seq, vocab] float64 of `tokens` (ints) at positions cache.length onwards, running the
    core block num_steps times (default config.total_ut_steps). weights: `huginn_weights`.
    cache: appended to (None: a fresh one, discarded). state: the initial state [seq, hidden]
    (None: `initial_state` at these positions with `seed`). wise: decode one token with WISE
    over the core iterations (see the module docstring; its depths must be < num_steps).
    adaptive: decode one token with per-token adaptive depth (`AdaptiveDepth`; at most num_steps
    iterations; cache.depths records how many ran). Prefill runs every iteration (the released
    code's do_not_exit_in_prefill): a prompt's tokens then do not depend on how it is chunked."""
    tokens = np.asarray(tokens)
    num_steps = config.total_ut_steps if num_steps is None else num_steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")
    if tokens.ndim != 1 or len(tokens) == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D array of integer ids, got {tokens.dtype} {tokens.shape}")
    if wise is not None:
        wise.validate_for(num_steps, f"num_steps={num_steps} core iterations")
        if len(tokens) != 1:
            raise ValueError(f"WISE decodes one token a call, got {len(tokens)} tokens (prefill densely)")
    if adaptive is not None and len(tokens) != 1:
        raise ValueError(f"adaptive depth decodes one token a call, got {len(tokens)} tokens (prefill runs every "
                         f"iteration)")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(f"token ids must be in [0, {config.vocab_size}), got {tokens.min()}..{tokens.max()}")
    cache = HuginnCache() if cache is None else cache
    held = {step: len(cache.planes.get(plane_index(config, "core_block", 0, step), ((),))[0])
            for step in range(num_steps)}
    short = [step for step, n in held.items() if n != cache.length]
    if short:
        raise ValueError(f"core iteration {short[0]} holds K/V for {held[short[0]]} of the {cache.length} cached "
                         f"positions (earlier calls ran fewer iterations): a deeper call needs adaptive-compute "
                         f"lookups, which the reference does not specify")
    positions = np.arange(cache.length, cache.length + len(tokens))
    if positions[-1] >= config.max_position_embeddings:
        raise ValueError(f"position {positions[-1]} is past max_position_embeddings "
                         f"({config.max_position_embeddings})")
    if state is None:
        state = initial_state(config, positions, seed)
    elif np.shape(state) != (len(tokens), config.hidden_size):
        raise ValueError(f"state must be [{len(tokens)}, {config.hidden_size}], got {np.shape(state)}")
    w, eps = weights, config.rms_norm_eps

    supports: dict[int, np.ndarray] = {}

    def run(stack, x, step=0):
        for name, n in huginn_layers(config):
            if name == stack:
                attend = wise_attend(wise, supports, step, n) if wise is not None and stack == "core_block" else None
                x = sandwich_block(config, w, f"transformer.{stack}.{n}.", x, positions, cache,
                                   plane_index(config, stack, n, step), attend)
        return x

    def head(x):
        x = run("coda", rms_norm(x, w["transformer.ln_f.weight"], eps))
        return rms_norm(x, w["transformer.ln_f.weight"], eps) @ w["lm_head.weight"].T

    embedded = run("prelude", w["transformer.wte.weight"][tokens] * config.embed_scale)
    x = np.asarray(state, np.float64)
    previous = None
    steps = num_steps
    for step in range(num_steps):
        x = run("core_block", np.concatenate([x, embedded], -1) @ w["transformer.adapter.weight"].T, step)
        if adaptive is not None and step >= adaptive.min_steps and step < num_steps - 1:
            previous, exits = kl_exit(peek(cache, config, lambda: head(x)), previous, adaptive.threshold)
            if exits:
                steps = step + 1
                break
    for step in range(steps, num_steps):       # "latest-m4": the last computed iteration's K/V
        for n in range(config.n_layers_in_recurrent_block):
            k, v = cache.planes[plane_index(config, "core_block", n, steps - 1)]
            old_k, old_v = cache.planes.get(plane_index(config, "core_block", n, step), (k[:0], v[:0]))
            cache.planes[plane_index(config, "core_block", n, step)] = (
                np.concatenate([old_k, k[-1:]]), np.concatenate([old_v, v[-1:]]))
    logits = head(x)
    cache.length += len(tokens)
    cache.depths += [steps] * len(tokens)
    return logits


def peek(cache: HuginnCache, config: ModelConfig, fn: Callable) -> np.ndarray:
    """fn() with the coda's planes as they were before it (a check's coda run is not cached)."""
    coda = [plane_index(config, "coda", n) for n in range(config.n_layers_in_coda)]
    held = {p: cache.planes.get(p) for p in coda}
    out = fn()
    for p, kv in held.items():
        if kv is None:
            cache.planes.pop(p, None)
        else:
            cache.planes[p] = kv
    return out


def kl_exit(logits: np.ndarray, previous: np.ndarray | None, threshold: float) -> tuple[np.ndarray, bool]:
    """The released KL criterion on the last position's logits [seq, vocab]: (its log
    probabilities, whether KL(previous || them) < threshold); previous None: uniform."""
    z = logits[-1] - logits[-1].max()
    log_p = z - np.log(np.exp(z).sum())
    if previous is None:
        previous = np.full_like(log_p, -np.log(log_p.shape[0]))
    return log_p, float((np.exp(previous) * (previous - log_p)).sum()) < threshold
