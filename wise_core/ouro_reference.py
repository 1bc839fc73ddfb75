"""The numpy specification of the Ouro forward with its learned early exit, in float64.

Tensors are the HF checkpoint's (`wise_core.checkpoint.expected_shapes`). Per loop the shared
layers run (sandwich RMS norms, split-half RoPE, causal attention over the cached planes,
SwiGLU), then `model.norm`; that normed state feeds the next loop, the head and the exit gate
`lambda_t = sigmoid(early_exit_gate(h_t))`.

The exit rule (`exit_loops`), as the released modeling code applies `early_exit_threshold` at
inference (HF ByteDance/Ouro-1.4B `modeling_ouro.py`, `OuroForCausalLM.forward`, branch
`exit_threshold is not None`; read in a public copy of that file, LoopedLMs/ouro_rl
`ouro_rl/modeling/modeling_ouro.py`): the exit pdf is `p_t = lambda_t * remaining_t`,
`remaining_{t+1} = remaining_t * (1 - lambda_t)` (remaining_0 = 1), the last loop taking
`remaining` itself; `cumulative = cumsum(pdf)`; a token's exit loop is the first loop with
`cumulative >= threshold` (`argmax` of the mask), the last loop where none is; its logits are
the head on that loop's normed state. The released code computes every loop for every token
(prompt and generated alike) and only chooses which loop's state the head reads.

The project's rule (`prefill`, `decode`):
- `early_exit_threshold` 1.0 runs every loop and reads the last (the default; the released
  rule differs only where a float cumulative sum rounds to exactly 1.0 before the last loop).
- Prefill runs every loop for every prompt token, as the released code does; each token's
  logits are its exit loop's. Its K/V of every plane are the computed ones.
- Decode stops a token after its exit loop l: its logits are loop l's, and its K/V in the
  planes of loops l+1.. are the K/V it wrote at loop l, the latest computed iteration of the
  same position (the "latest-m4" lookup of the released Huginn code, applied to Ouro's loops).
  Later tokens read those planes. This is where decode departs from the released code, which
  keeps computing an exited token's later loops and saves no work.

An fp8 K/V cache (issue 50; `OuroCache(kv_quant=True)`, `generate(..., kv_quant=True)`): every
K/V a token appends is held as an fp8 cache gives it back, `dequantize(*quantize(float32(x)),
float32)` by `wise_core.kv_quant`'s rule, and every attention (prefill's too, a token's own key
included) reads those values; an exited token's K/V copied to later planes are copied as held,
not quantized again. What an engine with kv_cache_dtype="fp8" computes, in float64 elsewhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from wise_core import kv_quant as quant
from wise_core.checkpoint import validate_tensors
from wise_core.model_config import ModelConfig


def cumulative_exit(lambdas: np.ndarray) -> np.ndarray:
    """lambdas float[k, ...], the gate probabilities of loops 0..k-1 -> float[k, ...], the
    cumulative exit probability after each, summed as the released code does (each loop's
    p_t = lambda_t * remaining, then a running sum), in lambdas' dtype. For loops before the
    last (the last loop takes the remaining mass instead)."""
    lambdas = np.asarray(lambdas)
    remaining = np.ones_like(lambdas[0])
    total = np.zeros_like(lambdas[0])
    out = []
    for lam in lambdas:
        total = total + lam * remaining
        remaining = remaining * (1 - lam)
        out.append(total)
    return np.stack(out)


def exit_loops(lambdas: np.ndarray, threshold: float) -> np.ndarray:
    """lambdas float[loops, ...], every loop's gate probability -> int[...]: the loop each token
    exits after (module docstring): the first loop before the last whose cumulative exit
    probability reaches `threshold`, else the last; threshold 1.0: always the last."""
    lambdas = np.asarray(lambdas)
    loops = lambdas.shape[0]
    last = np.full(lambdas.shape[1:], loops - 1, np.int64)
    if threshold >= 1.0 or loops == 1:
        return last
    reached = cumulative_exit(lambdas[:-1]) >= np.asarray(threshold, lambdas.dtype)
    return np.where(reached.any(0), reached.argmax(0), last)


def fp8_round_trip(x: np.ndarray) -> np.ndarray:
    """K or V [..., kv_heads, head_dim] as an fp8 cache holds it, in float64:
    dequantize(quantize(float32(x)), float32) (`wise_core.kv_quant`)."""
    return quant.dequantize(*quant.quantize(np.asarray(x, np.float32)), np.float32).astype(np.float64)


@dataclasses.dataclass
class OuroCache:
    """K/V per plane `loop * num_hidden_layers + layer`: planes[plane] = (k, v), each float64
    [positions, kv_heads, head_dim]. kv_quant: hold every appended K/V as an fp8 cache returns
    it (`fp8_round_trip`; module docstring)."""

    planes: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    kv_quant: bool = False

    @property
    def length(self) -> int:
        return 0 if not self.planes else self.planes[0][0].shape[0]

    def append(self, plane: int, k: np.ndarray, v: np.ndarray, held: bool = False) -> None:
        """Append k, v [positions, kv_heads, head_dim] to `plane` (through `fp8_round_trip` with
        kv_quant, unless `held`: K/V read from this cache, appended as they are)."""
        if self.kv_quant and not held:
            k, v = fp8_round_trip(k), fp8_round_trip(v)
        if plane in self.planes:
            k0, v0 = self.planes[plane]
            k, v = np.concatenate([k0, k]), np.concatenate([v0, v])
        self.planes[plane] = (k, v)


def ouro_weights(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's tensors, checked against the config, as float64; a tied head's
    lm_head.weight is the embedding's."""
    if config.architecture != "ouro":
        raise ValueError(f"ouro_weights needs an Ouro config, got architecture {config.architecture!r}")
    validate_tensors(config, tensors)
    out = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x: [seq, heads, head_dim]; split-half rotation by position * inv_freq (float64)."""
    d = x.shape[-1]
    inv_freq = 1.0 / float(theta) ** (np.arange(0, d, 2) / d)
    angle = np.outer(positions, inv_freq)
    cos, sin = np.cos(np.concatenate([angle, angle], -1))[:, None], np.sin(np.concatenate([angle, angle], -1))[:, None]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """q: [seq, heads, d]; k, v: [n_keys, kv_heads, d] (keys at positions 0..n_keys-1) ->
    [seq, heads, d], causal; query head h reads KV head h // (heads // kv_heads)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where((np.arange(k.shape[0])[None, :] <= q_positions[:, None])[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def run_loop(config: ModelConfig, w: dict[str, np.ndarray], h: np.ndarray, positions: np.ndarray,
             cache: OuroCache, loop: int) -> np.ndarray:
    """One loop over the shared layers for tokens at `positions` (the cache holds the positions
    before them in every plane this loop writes), appending their K/V -> the normed state."""
    c, eps = config, config.rms_norm_eps
    n = h.shape[0]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, c.num_attention_heads, c.head_dim),
                 positions, c.rope_theta)
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, c.num_key_value_heads, c.head_dim),
                 positions, c.rope_theta)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, c.num_key_value_heads, c.head_dim)
        plane = loop * c.num_hidden_layers + layer
        cache.append(plane, k, v)
        a = attention(q, *cache.planes[plane], positions).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = h + rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        m = (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        h = h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
    return rms_norm(h, w["model.norm.weight"], eps)


def exit_gate(w: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """Normed states [n, hidden] -> lambda [n]."""
    z = h @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0]
    return 1 / (1 + np.exp(-z))


def prefill(config: ModelConfig, w: dict[str, np.ndarray], tokens, cache: OuroCache
            ) -> tuple[np.ndarray, np.ndarray]:
    """Every loop over `tokens` at the positions after the cache's -> (logits [n, vocab] of each
    token's exit loop, exit loops int[n]). w: `ouro_weights`."""
    tokens = np.asarray(tokens, np.int64)
    positions = np.arange(cache.length, cache.length + len(tokens))
    h = w["model.embed_tokens.weight"][tokens]
    states, lambdas = [], []
    for loop in range(config.total_ut_steps):
        h = run_loop(config, w, h, positions, cache, loop)
        states.append(h)
        lambdas.append(exit_gate(w, h))
    loops = exit_loops(np.stack(lambdas), config.early_exit_threshold)
    chosen = np.stack(states)[loops, np.arange(len(tokens))]
    return chosen @ w["lm_head.weight"].T, loops


def decode(config: ModelConfig, w: dict[str, np.ndarray], token: int, cache: OuroCache) -> tuple[np.ndarray, int]:
    """One generated token at position cache.length, stopping after its exit loop (module
    docstring) -> (logits [vocab] of that loop, the exit loop)."""
    layers, loops, threshold = config.num_hidden_layers, config.total_ut_steps, config.early_exit_threshold
    position = np.array([cache.length])
    h = w["model.embed_tokens.weight"][[token]]
    lambdas = []
    for loop in range(loops):
        h = run_loop(config, w, h, position, cache, loop)
        lambdas.append(exit_gate(w, h)[0])
        if loop < loops - 1 and threshold < 1.0 and cumulative_exit(np.array(lambdas))[-1] >= threshold:
            break
    for later in range(loop + 1, loops):   # the exit loop's K/V stand for the skipped loops'
        for layer in range(layers):
            k, v = cache.planes[loop * layers + layer]
            cache.append(later * layers + layer, k[-1:], v[-1:], held=True)
    return (h @ w["lm_head.weight"].T)[0], loop


def generate(config: ModelConfig, tensors: dict[str, np.ndarray], prompt, max_new_tokens: int,
             kv_quant: bool = False) -> tuple[list[int], list[int], np.ndarray]:
    """Greedy decoding -> (the max_new_tokens tokens after `prompt`, the exit loop and the logits
    [max_new_tokens, vocab] each came from: the last prompt token's, then each generated
    token's but the last). kv_quant: over an fp8 K/V cache (`OuroCache`'s)."""
    w = ouro_weights(config, tensors)
    cache = OuroCache(kv_quant=kv_quant)
    logits, loops = prefill(config, w, prompt, cache)
    rows, depths = [logits[-1]], [int(loops[-1])]
    tokens = [int(np.argmax(rows[-1]))]
    while len(tokens) < max_new_tokens:
        row, loop = decode(config, w, tokens[-1], cache)
        rows.append(row)
        depths.append(loop)
        tokens.append(int(np.argmax(row)))
    return tokens, depths, np.stack(rows)
