"""Training of the Ouro model on optax and orbax, data-parallel over the devices present.

Objectives (`TrainConfig.objective`), per next-token target, over ce float32[loops, batch, seq]
(the head applied after every loop) and the exit distribution p of the gate:
  "ouro": sum_t p_t * ce_t - beta * H(p) (Ouro stage I: the early-exit gate is trained);
  "last": ce of the last loop (the gate gets no gradient);
  "huginn" (a Huginn model, `wise_jax.huginn`): ce of the coda's output after a number of core
  iterations drawn per step as the released recipe does (`recurrence_counts`: "poisson-lognormal-
  filling" around the model's total_ut_steps, the released mean_recurrence), of which only the last
  min(drawn, `backprop_depth`) get gradient (truncated backpropagation: the earlier ones run under
  stop_gradient), from a fresh "like-init" random state per micro-batch (`initial_states`).
Optimiser: optax, global-norm clipping then AdamW (decoupled weight decay on matrices, not on
norms or biases); the learning rate is a hyper-parameter held in the optimiser state
(`optax.inject_hyperparams`), set every step by `learning_rate`: linear warm-up times a cosine
from the peak to `final_lr_ratio` of it over the horizon (`max_steps`, or the wall-clock
budget `minutes`). Gradient accumulation: `accum` micro-batches per optimiser step, their
gradients averaged inside one jitted step (what optax.MultiSteps computes, without a host
round trip per micro-batch).
Data: a token stream (int[n], ids < vocab) on the devices; step s draws `batch * accum` windows
of seq_len + 1 tokens at offsets that are a function of (seed key, data position) only
("random"), or the next non-overlapping windows ("sequential"), inside the step.
State: params (float32 master weights; compute in `compute_dtype`), optimiser state, step,
data position and key (`TrainState`), saved by orbax every `checkpoint_every` steps; a run
restored from one continues bit for bit as the uninterrupted run when the horizon is in steps
(a wall-clock horizon makes the learning rate depend on elapsed time).
Parallelism: a 1-D `jax.sharding.Mesh` over all devices, axis "data": the windows are split
along the batch, params and optimiser state replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wise_core.checkpoint import random_tensors
from wise_core.huginn_reference import initial_state
from wise_core.model_config import ModelConfig
from wise_core.train_config import TrainConfig
from wise_jax import huginn as hg
from wise_jax import model as wm
from wise_jax.params import Params, init_params
from wise_jax.prefill_attention import causal_attention_reference

N_BYTES = 256  # byte tokenizer: ids below are bytes (bits per byte counts these targets)


# -- model and objective ----------------------------------------------------------------------------
def dense_attend(q, k, v, layer, carry):
    """Full-matrix causal attention (plain XLA), as a `run_loop` attend function."""
    return causal_attention_reference(q, k, v), carry


def cudnn_attend(q, k, v, layer, carry):
    """cuDNN fused causal attention (GPU only), as a `run_loop` attend function."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), carry


ATTENTION = {"xla": dense_attend, "cudnn": cudnn_attend}


def loop_losses(params: Params, config: ModelConfig, tokens: jax.Array, *, attend: Callable = dense_attend,
                remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """tokens int32[batch, seq + 1] -> (ce float32[loops, batch, seq], p float32[loops, batch, seq]):
    next-token cross-entropy after every loop and the gate's exit distribution."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, seq = inputs.shape
    h = wm.embed(params, inputs)
    cos, sin = wm.rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
                       config.head_dim, config.rope_theta)
    ces, lambdas = [], []
    for _ in range(config.total_ut_steps):
        h, _ = wm.run_loop(params, config, h, cos, sin, attend, remat=remat)
        logits = wm.head(params, h)
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        ces.append(jax.nn.logsumexp(logits, axis=-1) - target_logit)
        lambdas.append(wm.exit_gate(params, h))
    return jnp.stack(ces), wm.exit_probabilities(jnp.stack(lambdas))


def ouro_objective(ce: jax.Array, p: jax.Array, beta: float) -> jax.Array:
    """Mean over tokens of sum_t p_t * ce_t - beta * H(p). ce, p: float32[loops, batch, seq]."""
    entropy = -jnp.sum(jax.scipy.special.xlogy(p, p), axis=0)
    return jnp.mean(jnp.sum(p * ce, axis=0) - beta * entropy)


def objective(train: TrainConfig, ce: jax.Array, p: jax.Array) -> jax.Array:
    """The scalar loss of `train.objective`."""
    return ouro_objective(ce, p, train.beta) if train.objective == "ouro" else jnp.mean(ce[-1])


def byte_bits(ce: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(nll bits summed over byte targets float32[loops], byte targets float32[])."""
    is_byte = (tokens[:, 1:] < N_BYTES).astype(jnp.float32)
    return jnp.sum(ce * is_byte, axis=(1, 2)) / math.log(2), jnp.sum(is_byte)


# -- Huginn: sampled recurrence, truncated backpropagation ------------------------------------------
LOGNORMAL_SIGMA = 0.5  # the released sampler's log-normal sigma
DEPTH_KEY = 0x48   # folded into the data key for the per-step recurrence draw and initial states


def recurrence_counts(key: jax.Array, mean: int, backprop: int) -> tuple[jax.Array, jax.Array]:
    """The released "poisson-lognormal-filling" draw -> (iterations without gradient, with
    gradient), int32[] each: total = Poisson(rate) + 1 with rate log-normal (sigma 0.5) of mean
    max(mean, backprop); the last min(total, backprop) iterations get gradient."""
    k_rate, k_count = jax.random.split(key)
    mu = math.log(max(mean, backprop)) - LOGNORMAL_SIGMA ** 2 / 2
    rate = jnp.exp(mu + LOGNORMAL_SIGMA * jax.random.normal(k_rate, (), jnp.float32))
    total = jax.random.poisson(k_count, rate, (), jnp.int32) + 1
    return jnp.maximum(total - backprop, 0), jnp.minimum(total, backprop)


def initial_states(config: ModelConfig, key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """float32[batch, seq, hidden]: a fresh random initial state of every position, the released
    training's draw (`wise_core.huginn_reference.initial_state`'s distribution: "like-init", a
    normal truncated at 3 std of std state_std, times embed_scale; "zero": zeros)."""
    if config.state_init == "zero":
        return jnp.zeros((*shape, config.hidden_size), jnp.float32)
    z = jax.random.truncated_normal(key, -3.0, 3.0, (*shape, config.hidden_size), jnp.float32)
    return z * (config.state_std * config.embed_scale)


def huginn_parts(params: hg.HuginnParams, config: ModelConfig, input_ids: jax.Array, attend: Callable):
    """(embedded, iterate, readout) of `wise_jax.huginn.run_model`'s forward over whole sequences
    (causal attention through `attend`, a `run_loop` attend function): embedded [batch, seq, hidden]
    is the prelude's output; iterate(params, x, embedded) one core iteration (adapter, core block);
    readout(params, x) the coda's normed output."""
    batch, seq = input_ids.shape
    cos, sin = wm.rope(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)), config.head_dim,
                       config.rope_theta)

    def stack(blocks, x):
        for bp in blocks:
            x, _ = hg.sandwich_block(bp, config, x, cos, sin, lambda q, k, v: attend(q, k, v, None, None))
        return x

    def iterate(p, x, embedded):
        return stack(p.core_block, jnp.concatenate([x, embedded], axis=-1) @ p.adapter)

    def readout(p, x):
        eps = config.rms_norm_eps
        return wm.rms_norm(stack(p.coda, wm.rms_norm(x, p.ln_f, eps)), p.ln_f, eps)

    embedded = params.wte.at[input_ids].get(mode="fill", fill_value=jnp.nan) * config.embed_scale
    return stack(params.prelude, embedded), iterate, readout


def truncated_iterations(params: hg.HuginnParams, iterate: Callable, x: jax.Array, embedded: jax.Array,
                         free: jax.Array, grad: jax.Array, max_grad: int, *, remat: bool = False) -> jax.Array:
    """x after `free` core iterations without gradient (params, x and embedded held constant:
    stop_gradient; none when free is 0), then `grad` (int32[], at most max_grad) with gradient."""
    frozen, e_frozen = lax.stop_gradient((params, embedded))
    ran = lax.fori_loop(0, free, lambda _, x: iterate(frozen, x, e_frozen), lax.stop_gradient(x))
    x = jnp.where(free > 0, ran, x)
    step = jax.checkpoint(iterate) if remat else iterate

    def body(x, i):
        return lax.cond(i >= max_grad - grad, lambda x: step(params, x, embedded), lambda x: x, x), None

    return lax.scan(body, x, jnp.arange(max_grad))[0]


def huginn_losses(params: hg.HuginnParams, config: ModelConfig, tokens: jax.Array, state: jax.Array, free: jax.Array,
                  grad: jax.Array, max_grad: int, *, attend: Callable = dense_attend, remat: bool = False) -> jax.Array:
    """tokens int32[batch, seq + 1], state [batch, seq, hidden] -> ce float32[batch, seq]: next-token
    cross-entropy after free + grad core iterations, the last `grad` of them differentiated."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    embedded, iterate, readout = huginn_parts(params, config, inputs, attend)
    x = truncated_iterations(params, iterate, state.astype(embedded.dtype), embedded, free, grad, max_grad,
                             remat=remat)
    logits = hg.head(params, readout(params, x))
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def huginn_init(config: ModelConfig, seed: int) -> hg.HuginnParams:
    """Random float32 Huginn params: matrices normal(0, state_std) (std sqrt(2 / (5 hidden)), the
    scale the released "like-init" state is drawn at), unit norms, zero q / k biases."""
    tensors = random_tensors(config, seed=seed, std=config.state_std)
    tensors = {k: np.zeros_like(v) if k.endswith("qk_bias") else v for k, v in tensors.items()}
    return hg.huginn_from_tensors(config, tensors, jnp.float32)


def huginn_eval_depths(config: ModelConfig) -> tuple[int, ...]:
    """Fixed depths of the final held-out evaluation: 1, 2, half, the mean, twice the mean."""
    mean = config.total_ut_steps
    return tuple(sorted({1, 2, max(mean // 2, 1), mean, 2 * mean}))


# -- optimiser --------------------------------------------------------------------------------------
def decays(params: Params) -> Params:
    """Per leaf, whether weight decay applies: matrices yes, norms (Huginn's ln_f too) and biases no."""
    def rule(path, leaf):
        name = jax.tree_util.keystr(path)
        return "norm" not in name and "bias" not in name and "ln_f" not in name
    return jax.tree_util.tree_map_with_path(rule, params)


def optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the learning rate as an injected hyper-parameter."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=0.0, b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay, mask=decays)
    return optax.chain(optax.clip_by_global_norm(train.clip), adamw)


def learning_rate(train: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over `warmup` steps ((step + 1) / warmup), times a cosine from 1 to
    final_lr_ratio as `progress` (0..1) of the horizon is spent, times the peak."""
    cosine = train.final_lr_ratio + (1 - train.final_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return train.lr * min(1.0, (step + 1) / max(train.warmup, 1)) * cosine


# -- state and data ---------------------------------------------------------------------------------
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["params", "opt_state", "step", "position", "key"], meta_fields=[])
@dataclasses.dataclass
class TrainState:
    """params (float32); opt_state (optax); step int32[] (optimiser steps done); position
    int32[] (windows drawn); key uint32[2] (the data key)."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array
    position: jax.Array
    key: jax.Array


def check_objective(config: ModelConfig, train: TrainConfig) -> None:
    """Refuse an objective of the other architecture (objective "huginn" trains Huginn models only)."""
    if (config.architecture == "huginn") != (train.objective == "huginn"):
        raise ValueError(f"objective {train.objective!r} does not train a {config.architecture} model "
                         f"(Huginn models train with objective 'huginn', Ouro models with 'ouro' or 'last')")


def init_state(config: ModelConfig, train: TrainConfig) -> TrainState:
    """Random weights of seed `train.seed` (Ouro: normal(0, 0.02) matrices; Huginn: `huginn_init`)
    and a fresh optimiser."""
    check_objective(config, train)
    params = (huginn_init(config, train.seed) if config.architecture == "huginn"
              else init_params(config, jax.random.PRNGKey(train.seed), jnp.float32, std=0.02))
    return TrainState(params, optimizer(train).init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                      jax.random.fold_in(jax.random.PRNGKey(train.seed), 1))


def window_offsets(train: TrainConfig, key: jax.Array, position: jax.Array, n_tokens: int) -> jax.Array:
    """int32[batch * accum]: start offsets of the windows drawn at data `position`."""
    count, length = train.batch * train.accum, train.seq_len + 1
    if train.order == "random":
        return jax.random.randint(jax.random.fold_in(key, position), (count,), 0, n_tokens - length + 1, jnp.int32)
    windows = n_tokens // length
    return ((position + jnp.arange(count, dtype=jnp.int32)) % windows) * length


def windows(stream: jax.Array, offsets: jax.Array, length: int) -> jax.Array:
    """stream int[n], offsets int32[count] -> int32[count, length]."""
    return jax.vmap(lambda o: lax.dynamic_slice(stream, (o,), (length,)))(offsets).astype(jnp.int32)


def check_stream(config: ModelConfig, train: TrainConfig, stream: np.ndarray, name: str) -> None:
    """Refuse a stream that is not 1-D integers within the vocabulary or is shorter than a window."""
    stream = np.asarray(stream)
    if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(f"{name} stream must be a 1-D integer array, got {stream.dtype}{list(stream.shape)}")
    if len(stream) < train.seq_len + 1:
        raise ValueError(f"{name} stream ({len(stream)} tokens) is shorter than one window of {train.seq_len + 1}")
    if stream.min() < 0 or stream.max() >= config.vocab_size:
        raise ValueError(f"{name} stream holds ids outside [0, {config.vocab_size})")


def mesh() -> Mesh:
    """A 1-D mesh, axis "data", over every device."""
    return Mesh(np.array(jax.devices()), ("data",))


# -- steps ------------------------------------------------------------------------------------------
def make_train_step(config: ModelConfig, train: TrainConfig, n_tokens: int, data_mesh: Mesh):
    """jit step(state, stream, lr float32[]) -> (state, metrics); state donated. metrics: loss,
    ce_per_loop float32[loops] (mean nats), bits_per_byte float32[loops], exit_p, grad_norm; for
    Huginn loss, bits_per_byte float32[1] (at the drawn depth), depth and backprop (the drawn
    iteration counts, int32[]), grad_norm."""
    check_objective(config, train)
    if (train.batch % data_mesh.size):
        raise ValueError(f"batch {train.batch} is not a multiple of the {data_mesh.size} devices")
    attend, dtype = ATTENTION[train.attention], jnp.dtype(train.compute_dtype)
    tx = optimizer(train)
    split = NamedSharding(data_mesh, P(None, "data"))
    huginn = config.architecture == "huginn"

    def micro(params, tokens, key, counts):
        compute = jax.tree.map(lambda x: x.astype(dtype), params)
        if huginn:
            state = initial_states(config, key, tokens[:, 1:].shape)
            ce = huginn_losses(compute, config, tokens, state, *counts, train.backprop_depth, attend=attend,
                               remat=train.remat)
            bits, n_bytes = byte_bits(ce[None], tokens)
            return jnp.mean(ce), (bits, n_bytes)
        ce, p = loop_losses(compute, config, tokens, attend=attend, remat=train.remat)
        bits, n_bytes = byte_bits(ce, tokens)
        return objective(train, ce, p), (ce.mean(axis=(1, 2)), bits, n_bytes, p.mean(axis=(1, 2)))

    grad_fn = jax.value_and_grad(micro, has_aux=True)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state: TrainState, stream, lr):
        offsets = window_offsets(train, state.key, state.position, n_tokens)
        tokens = windows(stream, offsets, train.seq_len + 1).reshape(train.accum, train.batch, -1)
        tokens = lax.with_sharding_constraint(tokens, split)
        key = jax.random.fold_in(jax.random.fold_in(state.key, DEPTH_KEY), state.position)
        counts = (recurrence_counts(key, config.total_ut_steps, train.backprop_depth) if huginn
                  else (jnp.int32(0), jnp.int32(0)))
        micro_keys = jax.random.split(jax.random.fold_in(key, 1), train.accum)

        def body(acc, xs):
            return jax.tree.map(jnp.add, acc, grad_fn(state.params, *xs, counts)), None

        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            jax.eval_shape(grad_fn, state.params, tokens[0], micro_keys[0], counts))
        (loss_aux, grads), _ = lax.scan(body, zero, (tokens, micro_keys))
        scale = 1.0 / train.accum
        grads = jax.tree.map(lambda g: g * scale, grads) if train.accum > 1 else grads
        opt_state = state.opt_state
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(params, opt_state, state.step + 1, state.position + train.batch * train.accum, state.key)
        if huginn:
            loss, (bits, n_bytes) = loss_aux
            return new, {"loss": loss * scale, "bits_per_byte": bits / n_bytes, "depth": counts[0] + counts[1],
                         "backprop": counts[1], "grad_norm": optax.tree.norm(grads)}
        loss, (ce, bits, n_bytes, exit_p) = loss_aux
        return new, {"loss": loss * scale, "ce_per_loop": ce * scale, "bits_per_byte": bits / n_bytes,
                     "exit_p": exit_p * scale, "grad_norm": optax.tree.norm(grads)}

    return step


def make_eval_step(config: ModelConfig, train: TrainConfig):
    """jit eval(params, tokens int32[batch, seq + 1]) -> (nll bits float32[loops], byte targets,
    exit_p summed float32[loops]) over byte targets. Huginn: `make_huginn_eval_step`."""
    if config.architecture == "huginn":
        return make_huginn_eval_step(config, train)
    attend, dtype = ATTENTION[train.attention], jnp.dtype(train.compute_dtype)

    @jax.jit
    def evaluate(params, tokens):
        ce, p = loop_losses(jax.tree.map(lambda x: x.astype(dtype), params), config, tokens, attend=attend)
        bits, n = byte_bits(ce, tokens)
        is_byte = (tokens[:, 1:] < N_BYTES).astype(jnp.float32)
        return bits, n, jnp.sum(p * is_byte, axis=(1, 2))

    return evaluate


def make_huginn_eval_step(config: ModelConfig, train: TrainConfig, depths: tuple[int, ...] | None = None):
    """jit eval(params, tokens int32[batch, seq + 1]) -> (nll bits float32[depths], byte targets,
    zeros float32[depths]) over byte targets, at each fixed depth of `depths` (default the mean,
    total_ut_steps) from the seeded initial state (`wise_core.huginn_reference.initial_state`,
    seed 0: what `wise_jax.huginn.forward` starts from)."""
    attend, dtype = ATTENTION[train.attention], jnp.dtype(train.compute_dtype)
    depths = (config.total_ut_steps,) if depths is None else depths

    @jax.jit
    def evaluate(params, tokens):
        params = jax.tree.map(lambda x: x.astype(dtype), params)
        batch, seq = tokens[:, 1:].shape
        state = jnp.broadcast_to(jnp.asarray(initial_state(config, np.arange(seq)), jnp.float32),
                                 (batch, seq, config.hidden_size))
        ces = jnp.stack([huginn_losses(params, config, tokens, state, jnp.int32(d), jnp.int32(0), 0, attend=attend)
                         for d in depths])
        bits, n = byte_bits(ces, tokens)
        return bits, n, jnp.zeros(len(depths))

    return evaluate


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """int32[count', seq_len + 1]: up to `count` non-overlapping windows spread evenly over the stream."""
    total = len(stream) // (seq_len + 1)
    if total == 0:
        raise ValueError(f"held-out stream ({len(stream)} tokens) is shorter than one window of {seq_len + 1}")
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(np.int64))
    return np.stack([stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in picks]).astype(np.int32)


def held_out_metrics(evaluate, params, data: np.ndarray, batch: int, depths: tuple[int, ...] | None = None,
                     at: int | None = None) -> dict:
    """Held-out bits per byte per loop, of the last loop, and the mean exit distribution; for a
    Huginn `evaluate` (`make_huginn_eval_step` at `depths`), bits per byte per depth and at depth `at`."""
    bits, n, exit_p = 0.0, 0.0, 0.0
    for start in range(0, len(data), batch):
        s, c, e = evaluate(params, jnp.asarray(data[start:start + batch]))
        bits, n, exit_p = bits + np.asarray(s, np.float64), n + float(c), exit_p + np.asarray(e, np.float64)
    per_loop = (bits / n).tolist()
    if depths is not None:
        return {"heldout_depths": list(depths), "heldout_bpb_per_depth": per_loop,
                "heldout_bpb": per_loop[depths.index(at)], "heldout_depth": at, "heldout_bytes": int(n)}
    return {"heldout_bpb_per_loop": per_loop, "heldout_bpb": per_loop[-1],
            "heldout_exit_p": (exit_p / n).tolist(), "heldout_bytes": int(n)}


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward): the layer GEMMs and
    causal attention of every loop, the head and gate after every loop."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * q * seq_len  # QK^T and PV over the causal half of seq_len keys, 2 FLOPs a MAC
    per_loop = c.num_hidden_layers * (2 * layer + attention) + 2 * c.hidden_size * (c.vocab_size + 1)
    return 3.0 * c.total_ut_steps * per_loop


def huginn_flops_per_token(config: ModelConfig, train: TrainConfig, seq_len: int) -> float:
    """Model FLOPs of one trained Huginn token at the mean depth: the forward of the prelude, the
    core iterations, the coda and the head, and the backward (2 x forward) of all but the core
    iterations run without gradient."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2 * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    layer += 2 * q * seq_len
    core = c.n_layers_in_recurrent_block * layer + 2 * 2 * c.hidden_size * c.hidden_size
    rest = (c.n_layers_in_prelude + c.n_layers_in_coda) * layer + 2 * c.hidden_size * c.vocab_size
    grad = min(train.backprop_depth, c.total_ut_steps)
    return 3.0 * (rest + grad * core) + (c.total_ut_steps - grad) * core


# -- checkpoints ------------------------------------------------------------------------------------
def checkpoint_manager(directory: Path, every: int):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(Path(directory).resolve(), options=ocp.CheckpointManagerOptions(
        save_interval_steps=max(every, 1), max_to_keep=2, enable_async_checkpointing=False))


def save_state(manager, state: TrainState, meta: dict) -> None:
    """Save `state` (params, optimiser state, step, data position, key) and `meta` at its step."""
    import orbax.checkpoint as ocp

    manager.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()


def restore_state(manager, like: TrainState) -> tuple[TrainState, dict] | None:
    """The latest saved (state, meta) in `like`'s structure, or None when none is saved."""
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    got = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                        meta=ocp.args.JsonRestore()))
    return got["state"], got["meta"]


# -- the run ----------------------------------------------------------------------------------------
def train_loop(config: ModelConfig, train: TrainConfig, stream: np.ndarray, heldout: np.ndarray | None = None, *,
               checkpoint_dir: Path | None = None, stop_at: int | None = None,
               log: Callable[[str], None] = print) -> tuple[TrainState, list[dict], list[dict]]:
    """Train on `stream` until the horizon (or step `stop_at`, leaving the horizon and so the
    schedule as they are: an interrupted run), resuming from `checkpoint_dir`'s latest checkpoint
    when it holds one and saving there every `checkpoint_every` steps (and at the end).
    Returns (state, per-step metrics, held-out evaluations)."""
    check_stream(config, train, stream, "training")
    if heldout is not None:
        check_stream(config, train, heldout, "held-out")
    data_mesh = mesh()
    replicated = NamedSharding(data_mesh, P())
    dtype = jnp.uint16 if config.vocab_size <= 2 ** 16 else jnp.int32
    stream_dev = jax.device_put(jnp.asarray(np.asarray(stream).astype(dtype)), replicated)
    state, steps, evals, elapsed0 = init_state(config, train), [], [], 0.0
    manager = checkpoint_manager(checkpoint_dir, train.checkpoint_every) if checkpoint_dir else None
    if manager is not None and (restored := restore_state(manager, state)) is not None:
        state, meta = restored
        steps, evals, elapsed0 = meta["steps"], meta["evals"], meta["elapsed_s"]
        log(f"resumed at step {int(state.step)} from {checkpoint_dir}")
    state = jax.device_put(state, replicated)
    step_fn = make_train_step(config, train, len(stream), data_mesh)
    evaluate = make_eval_step(config, train)
    periodic = None if heldout is None else eval_windows(heldout, train.seq_len, train.eval_windows)
    tokens_per_step = train.batch * train.accum * train.seq_len
    huginn = config.architecture == "huginn"
    flops = (huginn_flops_per_token(config, train, train.seq_len) if huginn
             else flops_per_token(config, train.seq_len)) * tokens_per_step
    depths = dict(depths=(config.total_ut_steps,), at=config.total_ut_steps) if huginn else {}
    budget = None if train.minutes is None else train.minutes * 60.0

    def record(metrics, step: int, dt: float, lr: float, elapsed: float) -> dict:
        m = jax.device_get(metrics)
        entry = {"step": step, "lr": lr, **{k: v.tolist() for k, v in m.items()}, "step_s": dt,
                 "wall_s": round(elapsed, 3), "tokens_per_s": tokens_per_step / dt if dt > 0 else None}
        entry["mfu"] = (flops / dt / train.peak_flops) if train.peak_flops and dt > 0 else None
        return entry

    start, last_eval, pending, last_t = time.perf_counter() - elapsed0, -math.inf, None, None
    while True:
        step = int(state.step)
        elapsed = time.perf_counter() - start
        done = ((train.max_steps is not None and step >= train.max_steps) or (budget is not None and elapsed >= budget)
                or (stop_at is not None and step >= stop_at))
        if periodic is not None and (done or elapsed - last_eval >= train.eval_every_s):
            last_eval = elapsed
            evals.append({"step": step, "wall_s": round(elapsed, 3),
                          **held_out_metrics(evaluate, state.params, periodic, train.batch, **depths)})
            log(f"step {step:6d}  held-out {evals[-1]['heldout_bpb']:.4f} bits/byte")
        if done:
            break
        progress = step / train.max_steps if budget is None else elapsed / budget
        lr = learning_rate(train, step, progress)
        state, metrics = step_fn(state, stream_dev, jnp.float32(lr))
        if pending is not None:  # read the previous step while this one runs
            now = time.perf_counter()
            steps.append(record(pending[0], pending[1], now - last_t if last_t else 0.0, pending[2], now - start))
            last_t = now
        pending = (metrics, step, lr)
        if last_t is None:
            jax.block_until_ready(metrics)
            last_t = time.perf_counter()
        if manager is not None and train.checkpoint_every and (step + 1) % train.checkpoint_every == 0:
            now = time.perf_counter()
            steps.append(record(pending[0], pending[1], now - last_t, pending[2], now - start))
            pending, last_t = None, time.perf_counter()
            save_state(manager, state, {"steps": steps, "evals": evals, "elapsed_s": now - start})
    if pending is not None:
        now = time.perf_counter()
        steps.append(record(pending[0], pending[1], now - last_t, pending[2], now - start))
    if manager is not None and manager.latest_step() != int(state.step):
        save_state(manager, state, {"steps": steps, "evals": evals, "elapsed_s": time.perf_counter() - start})
        manager.close()
    return state, steps, evals


def write_metrics(out: Path, steps: list[dict], evals: list[dict], extra: dict | None = None,
                  log: Callable[[str], None] = print) -> None:
    """out/metrics.json (every step, every evaluation) and out/loss_curve.png (matplotlib; without
    it the plot is skipped with a note through `log`: metrics.json holds every number)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"steps": steps, "evals": evals, **(extra or {})}, indent=1) + "\n")
    try:
        import matplotlib
    except ImportError:
        log(f"{out / 'loss_curve.png'} not drawn: matplotlib is not installed (pip install matplotlib); "
            f"{out / 'metrics.json'} holds the curves")
        return
    plot(steps, evals, out / "loss_curve.png")


def plot(steps: list[dict], evals: list[dict], path: Path) -> None:
    """Training bits per byte per loop (Huginn: at each step's drawn depth) against steps, with the
    held-out last loop (Huginn: the mean depth)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if steps:
        x = [s["step"] + 1 for s in steps]
        loops = len(steps[0]["bits_per_byte"])
        for t in range(loops):
            ax.plot(x, [s["bits_per_byte"][t] for s in steps], lw=2 if t == loops - 1 else 0.8,
                    label=f"train, loop {t + 1}" if "depth" not in steps[0] else "train, at the drawn depth")
    if evals:
        where = f"depth {evals[0]['heldout_depth']}" if "heldout_depth" in evals[0] else "last loop"
        ax.plot([e["step"] for e in evals], [e["heldout_bpb"] for e in evals], "k--o", ms=3, label=f"held-out, {where}")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_tokens(path: Path) -> np.ndarray:
    """A token stream: a .npy array of ids, a directory of text files (each file's bytes after
    <|endoftext|> = 256, sorted paths), or any other file as its bytes."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"directory {path} holds no files")
        return np.concatenate([np.concatenate([[N_BYTES], np.frombuffer(p.read_bytes(), np.uint8)]).astype(np.int64)
                               for p in files])
    if path.suffix == ".npy":
        return np.load(path)
    return np.frombuffer(path.read_bytes(), np.uint8).astype(np.int64)


def probe(config: ModelConfig, train: TrainConfig, stream: np.ndarray) -> str | None:
    """None when one training step of `train` compiles and runs with a finite loss, else why not
    (a setting to fall back from: no cuDNN, out of memory)."""
    data_mesh = mesh()
    try:
        step = make_train_step(config, train, len(stream), data_mesh)
        stream_dev = jax.device_put(jnp.asarray(np.asarray(stream).astype(np.int32)), NamedSharding(data_mesh, P()))
        _, metrics = step(init_state(config, train), stream_dev, jnp.float32(0.0))
        loss = float(metrics["loss"])
    except Exception as e:  # compile or runtime failure of this setting
        return str(e).splitlines()[0][:300]
    return None if math.isfinite(loss) else f"first-step loss is {loss}"


def run(config: ModelConfig, train: TrainConfig, stream: np.ndarray, heldout: np.ndarray, out: Path, *,
        resume: bool = True, name: str = "wise_jax.train", log: Callable[[str], None] = print) -> dict:
    """train_loop with checkpoints under out/checkpoints (resumed from when `resume`), then the
    final held-out evaluation, the model in the HF layout (bf16) and metrics.json /
    loss_curve.png in `out`. Returns the run's summary (also in metrics.json)."""
    from wise_core.checkpoint import Checkpoint, save_checkpoint
    from wise_core.tokenizer import byte_tokenizer
    from wise_jax.params import to_checkpoint_tensors

    out = Path(out)
    checkpoints = out / "checkpoints"
    if not resume and checkpoints.exists():
        raise FileExistsError(f"{checkpoints} exists: pass resume to continue that run, or another out directory")
    started = time.perf_counter()
    state, steps, evals = train_loop(config, train, stream, heldout, checkpoint_dir=checkpoints, log=log)
    final_windows = eval_windows(heldout, train.seq_len, train.final_eval_windows)
    if config.architecture == "huginn":
        depths = huginn_eval_depths(config)
        final = held_out_metrics(make_huginn_eval_step(config, train, depths), state.params, final_windows,
                                 train.batch, depths, config.total_ut_steps)
    else:
        final = held_out_metrics(make_eval_step(config, train), state.params, final_windows, train.batch)
    tokens = int(state.step) * train.batch * train.accum * train.seq_len
    train_s = steps[-1]["wall_s"] if steps else 0.0
    rates = [s["mfu"] for s in steps[len(steps) // 10:] if s["mfu"] is not None]
    summary = {"model": config.to_dict(), "train": dataclasses.asdict(train), "steps_done": int(state.step),
               "tokens_seen": tokens, "train_s": train_s, "final": final, "devices": len(jax.devices()),
               "device": jax.devices()[0].device_kind, "mean_mfu": float(np.mean(rates)) if rates else None,
               "total_s": round(time.perf_counter() - started, 1)}
    where = f"depth {config.total_ut_steps}" if config.architecture == "huginn" else "last loop"
    log(f"final held-out: {final['heldout_bpb']:.4f} bits per byte ({where}) over {final['heldout_bytes']:,} bytes")
    tensors = (hg.huginn_to_tensors(config, state.params) if config.architecture == "huginn"
               else to_checkpoint_tensors(config, state.params))
    save_checkpoint(out, Checkpoint(config, tensors, byte_tokenizer(), name), bf16=True)
    write_metrics(out, steps, evals, {"summary": summary}, log=log)
    return summary


BUILTIN_MODEL = ModelConfig(
    vocab_size=258, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, rope_theta=10_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=4, early_exit_threshold=1.0,
    tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=257)

HUGINN_BUILTIN_MODEL = ModelConfig(
    vocab_size=258, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, rope_theta=10_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=4, tie_word_embeddings=True,
    bos_token_id=256, eos_token_id=256, pad_token_id=257, architecture="huginn", n_layers_in_prelude=1,
    n_layers_in_recurrent_block=2, n_layers_in_coda=1, state_init="like-init", qk_bias=True)
"""The built-in Huginn shape: a prelude of 1 layer, a core block of 2 iterated 4 times on average
(total_ut_steps, the released mean_recurrence), a coda of 1; hidden 256, 4 heads, MLP 704, bytes, the head tied."""


def main(args) -> int:
    """`wise train`: the CLI's arguments -> run()."""
    config = BUILTIN_MODEL
    if args.model_config is not None:
        config = ModelConfig.from_dict(json.loads(Path(args.model_config).read_text()))
    train = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    stream = read_tokens(args.data)
    if args.heldout is not None:
        heldout = read_tokens(args.heldout)
    else:
        if not 0 < args.heldout_fraction < 1:
            raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
        cut = int(len(stream) * (1 - args.heldout_fraction))
        stream, heldout = stream[:cut], stream[cut:]
    check_window_fits(args, train, stream, heldout)
    run(config, train, stream, heldout, args.out)
    return 0


def check_window_fits(args, train: TrainConfig, stream: np.ndarray, heldout: np.ndarray) -> None:
    """Each stream holds one window of --seq-len + 1 tokens at least, else a ValueError naming the
    flags that change it (before any compilation)."""
    if args.heldout is not None:
        held = (f"held-out (--heldout {args.heldout})", "a longer --heldout")
    else:
        held = (f"held-out (the last --heldout-fraction {args.heldout_fraction:g} of --data)",
                "a larger --heldout-fraction")
    for (what, remedy), tokens in (((f"training (--data {args.data})", "more text in --data"), stream),
                                   (held, heldout)):
        if len(tokens) < train.seq_len + 1:
            raise ValueError(f"the {what} stream holds {len(tokens)} tokens, fewer than one window of --seq-len "
                             f"{train.seq_len} + 1: pass --seq-len {max(len(tokens) - 1, 1)} or less, or {remedy}")
