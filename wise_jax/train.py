"""Training of the Ouro model on optax and orbax, data-parallel over the devices present.

Objectives (`TrainConfig.objective`), per next-token target, over ce float32[loops, batch, seq]
(the head applied after every loop) and the exit distribution p of the gate:
  "ouro": sum_t p_t * ce_t - beta * H(p) (Ouro stage I: the early-exit gate is trained);
  "last": ce of the last loop (the gate gets no gradient).
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

from wise_core.config import ModelConfig
from wise_core.train_config import TrainConfig
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


# -- optimiser --------------------------------------------------------------------------------------
def decays(params: Params) -> Params:
    """Per leaf, whether weight decay applies: matrices yes, norms and biases no."""
    def rule(path, leaf):
        name = jax.tree_util.keystr(path)
        return "norm" not in name and "bias" not in name
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


def init_state(config: ModelConfig, train: TrainConfig) -> TrainState:
    """Random weights of seed `train.seed` (normal(0, 0.02) matrices) and a fresh optimiser."""
    params = init_params(config, jax.random.PRNGKey(train.seed), jnp.float32, std=0.02)
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
    ce_per_loop float32[loops] (mean nats), bits_per_byte float32[loops], exit_p, grad_norm."""
    if (train.batch % data_mesh.size):
        raise ValueError(f"batch {train.batch} is not a multiple of the {data_mesh.size} devices")
    attend, dtype = ATTENTION[train.attention], jnp.dtype(train.compute_dtype)
    tx = optimizer(train)
    split = NamedSharding(data_mesh, P(None, "data"))

    def micro(params, tokens):
        compute = jax.tree.map(lambda x: x.astype(dtype), params)
        ce, p = loop_losses(compute, config, tokens, attend=attend, remat=train.remat)
        bits, n_bytes = byte_bits(ce, tokens)
        return objective(train, ce, p), (ce.mean(axis=(1, 2)), bits, n_bytes, p.mean(axis=(1, 2)))

    grad_fn = jax.value_and_grad(micro, has_aux=True)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state: TrainState, stream, lr):
        offsets = window_offsets(train, state.key, state.position, n_tokens)
        tokens = windows(stream, offsets, train.seq_len + 1).reshape(train.accum, train.batch, -1)
        tokens = lax.with_sharding_constraint(tokens, split)

        def body(acc, tokens):
            return jax.tree.map(jnp.add, acc, grad_fn(state.params, tokens)), None

        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, state.params, tokens[0]))
        ((loss, (ce, bits, n_bytes, exit_p)), grads), _ = lax.scan(body, zero, tokens)
        scale = 1.0 / train.accum
        loss, ce, exit_p = loss * scale, ce * scale, exit_p * scale
        grads = jax.tree.map(lambda g: g * scale, grads) if train.accum > 1 else grads
        opt_state = state.opt_state
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(params, opt_state, state.step + 1, state.position + train.batch * train.accum, state.key)
        return new, {"loss": loss, "ce_per_loop": ce, "bits_per_byte": bits / n_bytes, "exit_p": exit_p,
                     "grad_norm": optax.tree.norm(grads)}

    return step


def make_eval_step(config: ModelConfig, train: TrainConfig):
    """jit eval(params, tokens int32[batch, seq + 1]) -> (nll bits float32[loops], byte targets,
    exit_p summed float32[loops]) over byte targets."""
    attend, dtype = ATTENTION[train.attention], jnp.dtype(train.compute_dtype)

    @jax.jit
    def evaluate(params, tokens):
        ce, p = loop_losses(jax.tree.map(lambda x: x.astype(dtype), params), config, tokens, attend=attend)
        bits, n = byte_bits(ce, tokens)
        is_byte = (tokens[:, 1:] < N_BYTES).astype(jnp.float32)
        return bits, n, jnp.sum(p * is_byte, axis=(1, 2))

    return evaluate


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """int32[count', seq_len + 1]: up to `count` non-overlapping windows spread evenly over the stream."""
    total = len(stream) // (seq_len + 1)
    if total == 0:
        raise ValueError(f"held-out stream ({len(stream)} tokens) is shorter than one window of {seq_len + 1}")
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(np.int64))
    return np.stack([stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in picks]).astype(np.int32)


def held_out_metrics(evaluate, params, data: np.ndarray, batch: int) -> dict:
    """Held-out bits per byte per loop, of the last loop, and the mean exit distribution."""
    bits, n, exit_p = 0.0, 0.0, 0.0
    for start in range(0, len(data), batch):
        s, c, e = evaluate(params, jnp.asarray(data[start:start + batch]))
        bits, n, exit_p = bits + np.asarray(s, np.float64), n + float(c), exit_p + np.asarray(e, np.float64)
    per_loop = (bits / n).tolist()
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
    flops = flops_per_token(config, train.seq_len) * tokens_per_step
    budget = None if train.minutes is None else train.minutes * 60.0

    def record(metrics, step: int, dt: float, lr: float, elapsed: float) -> dict:
        m = jax.device_get(metrics)
        entry = {"step": step, "lr": lr, "loss": float(m["loss"]), "ce_per_loop": m["ce_per_loop"].tolist(),
                 "bits_per_byte": m["bits_per_byte"].tolist(), "exit_p": m["exit_p"].tolist(),
                 "grad_norm": float(m["grad_norm"]), "step_s": dt, "wall_s": round(elapsed, 3),
                 "tokens_per_s": tokens_per_step / dt if dt > 0 else None}
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
                          **held_out_metrics(evaluate, state.params, periodic, train.batch)})
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


def write_metrics(out: Path, steps: list[dict], evals: list[dict], extra: dict | None = None) -> None:
    """out/metrics.json (every step, every evaluation) and out/loss_curve.png (matplotlib)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"steps": steps, "evals": evals, **(extra or {})}, indent=1) + "\n")
    plot(steps, evals, out / "loss_curve.png")


def plot(steps: list[dict], evals: list[dict], path: Path) -> None:
    """Training bits per byte per loop against steps, with the held-out last loop."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if steps:
        x = [s["step"] + 1 for s in steps]
        loops = len(steps[0]["bits_per_byte"])
        for t in range(loops):
            ax.plot(x, [s["bits_per_byte"][t] for s in steps], lw=2 if t == loops - 1 else 0.8,
                    label=f"train, loop {t + 1}")
    if evals:
        ax.plot([e["step"] for e in evals], [e["heldout_bpb"] for e in evals], "k--o", ms=3, label="held-out, last loop")
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
    final = held_out_metrics(make_eval_step(config, train), state.params,
                             eval_windows(heldout, train.seq_len, train.final_eval_windows), train.batch)
    tokens = int(state.step) * train.batch * train.accum * train.seq_len
    train_s = steps[-1]["wall_s"] if steps else 0.0
    rates = [s["mfu"] for s in steps[len(steps) // 10:] if s["mfu"] is not None]
    summary = {"model": config.to_dict(), "train": dataclasses.asdict(train), "steps_done": int(state.step),
               "tokens_seen": tokens, "train_s": train_s, "final": final, "devices": len(jax.devices()),
               "device": jax.devices()[0].device_kind, "mean_mfu": float(np.mean(rates)) if rates else None,
               "total_s": round(time.perf_counter() - started, 1)}
    log(f"final held-out: {final['heldout_bpb']:.4f} bits per byte (last loop) over {final['heldout_bytes']:,} bytes")
    save_checkpoint(out, Checkpoint(config, to_checkpoint_tensors(config, state.params), byte_tokenizer(), name),
                    bf16=True)
    write_metrics(out, steps, evals, {"summary": summary})
    return summary


BUILTIN_MODEL = ModelConfig(
    vocab_size=258, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, rope_theta=10_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=4, early_exit_threshold=1.0,
    tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=257)


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
    run(config, train, stream, heldout, args.out)
    return 0
