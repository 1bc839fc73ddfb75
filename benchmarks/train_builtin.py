"""Train the built-in Ouro-architecture model on the Python standard library's source (JAX).

    python benchmarks/train_builtin.py --out /tmp/ouro-py-3m --minutes 5   # on an H200
    python benchmarks/train_builtin.py --smoke --out /tmp/ouro-smoke       # CPU, under a minute

Data: `stdlib_corpus` (byte tokens, files held out by a hash of their path). Each step samples
`--batch` windows of `--seq-len` + 1 tokens at random offsets of the training stream.

Objective (Ouro, stage I; the early-exit gate is trained): per token, the expected cross-entropy
over loops under the gate's exit distribution p_t, minus `--beta` times the entropy of p
(`sum_t p_t * CE_t - beta * H(p)`). The model's output is the last loop (`early_exit_threshold`
1.0), so held-out loss and bits per byte are reported for every loop and quoted for the last.
Bits per byte: mean NLL in bits over targets that are bytes (ids < 256).

Training: bf16 compute with float32 master weights, AdamW (decoupled weight decay on matrices,
global-norm clipping), linear warmup then a cosine decay over the wall-clock budget (the run
stops by itself once `--minutes` of training have passed). On a GPU attention is cuDNN's fused
kernel; if it does not compile or run, training falls back to `wise_jax`'s XLA attention with
per-layer rematerialisation, then without it at half the batch.

Writes into `--out`: the checkpoint in the HF Ouro layout (config.json, model.safetensors in bf16,
tokenizer.json), train_log.json (history, final metrics, machine, versions, date) and
loss_curve.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_HERE = Path(__file__).resolve().parent  # runnable as a script from anywhere: the repo and benchmarks/
sys.path[:0] = [p for p in (str(_HERE.parent), str(_HERE)) if p not in sys.path]
import stdlib_corpus  # noqa: E402

import wise_jax  # noqa: E402
from wise_core.checkpoint import Checkpoint, save_checkpoint  # noqa: E402
from wise_core.config import ModelConfig  # noqa: E402
from wise_core.tokenizer import byte_tokenizer  # noqa: E402
from wise_jax import model as wm  # noqa: E402
from wise_jax.prefill_attention import causal_attention_reference  # noqa: E402

MODEL = ModelConfig(
    vocab_size=258, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, rope_theta=10_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=4, early_exit_threshold=1.0,
    tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=257)
SMOKE_MODEL = dataclasses.replace(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=32)
N_BYTES = 256  # ids below are bytes


# -- model ------------------------------------------------------------------------------------
def dense_attend(q, k, v, layer, carry):
    """wise_jax's full-matrix causal attention (plain XLA), as a `run_loop` attend function."""
    return causal_attention_reference(q, k, v), carry


def cudnn_attend(q, k, v, layer, carry):
    """cuDNN fused causal attention (GPU only; bf16), as a `run_loop` attend function."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), carry


ATTENTION = {"xla": dense_attend, "cudnn": cudnn_attend}


def loop_losses(params: wise_jax.Params, config: ModelConfig, tokens: jax.Array, *,
                attend: Callable = dense_attend, remat: bool = False) -> tuple[jax.Array, jax.Array]:
    """Per-loop cross-entropy and exit distribution of next-token prediction.

    tokens: int32[batch, seq + 1] -> (ce float32[loops, batch, seq], p float32[loops, batch, seq]).
    The loop structure is `wise_jax.forward_with_exits` with the head applied after every loop.
    """
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


def to_compute(params: wise_jax.Params) -> wise_jax.Params:
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


# -- optimiser --------------------------------------------------------------------------------
class AdamState(NamedTuple):
    count: jax.Array
    mu: wise_jax.Params
    nu: wise_jax.Params


def adam_init(params: wise_jax.Params) -> AdamState:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return AdamState(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))


def decays(params: wise_jax.Params) -> wise_jax.Params:
    """Per leaf, whether weight decay applies: matrices yes, norms and biases no."""
    def rule(path, leaf):
        name = jax.tree_util.keystr(path)
        return "norm" not in name and "bias" not in name
    return jax.tree_util.tree_map_with_path(rule, params)


def adamw(params, grads, state: AdamState, lr, *, weight_decay: float, clip: float,
          b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8):
    """One AdamW step with global-norm gradient clipping. Returns (params, state, grad_norm)."""
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** count

    def update(p, m, v, decay):
        return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + (weight_decay * p if decay else 0.0))

    return jax.tree.map(update, params, mu, nu, decays(params)), AdamState(count, mu, nu), grad_norm


def learning_rate(step: int, progress: float, *, peak: float, warmup: int, final_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` to `peak * final_ratio` as the
    budget `progress` (0..1) is spent."""
    cosine = final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return peak * min(1.0, (step + 1) / max(warmup, 1)) * cosine


# -- steps ------------------------------------------------------------------------------------
def windows(stream: jax.Array, offsets: jax.Array, length: int) -> jax.Array:
    """stream: uint16[n] (on device), offsets: int32[batch] -> int32[batch, length]."""
    return jax.vmap(lambda o: lax.dynamic_slice(stream, (o,), (length,)))(offsets).astype(jnp.int32)


def make_train_step(config: ModelConfig, *, seq_len: int, beta: float, weight_decay: float, clip: float,
                    attention: str = "xla", remat: bool = False):
    """jit step(params, opt, stream, offsets, lr) -> (params, opt, metrics); params/opt donated."""
    attend = ATTENTION[attention]

    def loss_fn(params, tokens):
        ce, p = loop_losses(to_compute(params), config, tokens, attend=attend, remat=remat)
        return ouro_objective(ce, p, beta), (ce[-1].mean(), p.mean(axis=(1, 2)))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt, stream, offsets, lr):
        tokens = windows(stream, offsets, seq_len + 1)
        (loss, (ce_last, exit_p)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        params, opt, grad_norm = adamw(params, grads, opt, lr, weight_decay=weight_decay, clip=clip)
        return params, opt, {"loss": loss, "ce_last": ce_last, "exit_p": exit_p, "grad_norm": grad_norm}

    return step


def make_eval_step(config: ModelConfig, attention: str = "xla"):
    """jit eval(params, tokens int32[batch, seq + 1]) -> (nll_sum float32[loops], n_bytes,
    exit_p_sum float32[loops]), summed over byte targets."""
    attend = ATTENTION[attention]

    @jax.jit
    def evaluate(params, tokens):
        ce, p = loop_losses(to_compute(params), config, tokens, attend=attend)
        is_byte = (tokens[:, 1:] < N_BYTES).astype(jnp.float32)
        return (jnp.sum(ce * is_byte, axis=(1, 2)), jnp.sum(is_byte),
                jnp.sum(p * is_byte, axis=(1, 2)))

    return evaluate


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """int32[count', seq_len + 1]: up to `count` non-overlapping windows spread evenly over the stream."""
    total = len(stream) // (seq_len + 1)
    if total == 0:
        raise ValueError(f"held-out stream ({len(stream)} tokens) is shorter than one window of {seq_len + 1}")
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(np.int64))
    return np.stack([stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in picks]).astype(np.int32)


def held_out_metrics(evaluate, params, data: np.ndarray, batch: int) -> dict:
    """Per-loop held-out NLL (nats/byte), bits per byte of the last loop, mean exit distribution."""
    nll, n, exit_p = 0.0, 0.0, 0.0
    for start in range(0, len(data), batch):
        s, c, e = evaluate(params, jnp.asarray(data[start:start + batch]))
        nll, n, exit_p = nll + np.asarray(s, np.float64), n + float(c), exit_p + np.asarray(e, np.float64)
    per_loop = (nll / n).tolist()
    return {"heldout_nll_per_loop": per_loop, "heldout_bpb": per_loop[-1] / math.log(2),
            "heldout_exit_p": (exit_p / n).tolist(), "heldout_bytes": int(n)}


# -- run --------------------------------------------------------------------------------------
def progress_record(step: int, tokens_per_step: int, elapsed: float, window: list[dict], heldout: dict) -> dict:
    """One history entry (training metrics averaged over `window`, the steps since the last), printed."""
    record = {"step": step, "tokens": step * tokens_per_step, "wall_s": round(elapsed, 2)}
    if window:
        record["train_loss"] = float(np.mean([w["loss"] for w in window]))
        record["train_ce_last"] = float(np.mean([w["ce_last"] for w in window]))
        record["train_exit_p"] = np.mean([w["exit_p"] for w in window], axis=0).tolist()
        record["grad_norm"] = float(np.mean([w["grad_norm"] for w in window]))
    record.update(heldout)
    rate = record["tokens"] / elapsed if elapsed > 0 else 0.0
    print(f"step {step:6d}  tokens {record['tokens'] / 1e6:7.1f}M  "
          f"train {record.get('train_ce_last', math.nan) / math.log(2):.3f}  "
          f"held-out {record['heldout_bpb']:.3f} bits/byte  {rate / 1e3:7.1f}K tok/s  {elapsed:5.0f}s", flush=True)
    return record


def init_state(config: ModelConfig, seed: int):
    params = wise_jax.init_params(config, jax.random.PRNGKey(seed), jnp.float32, std=0.02)
    return params, adam_init(params)


def candidates(batch: int) -> list[tuple[str, bool, int]]:
    """(attention, remat, batch) settings to try in order."""
    if jax.default_backend() == "gpu":
        return [("cudnn", False, batch), ("xla", True, batch), ("xla", False, max(1, batch // 2))]
    return [("xla", False, batch)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (checkpoint, log, plot)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="training wall-clock budget, from the first step after compilation; start-up, "
                         "compilation and the final evaluation come on top (default 5, smoke 0.25)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--final-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200, help="warmup steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    ap.add_argument("--beta", type=float, default=0.05, help="entropy weight of the exit distribution")
    ap.add_argument("--eval-every", type=float, default=15.0, help="seconds between held-out evaluations")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows per periodic evaluation")
    ap.add_argument("--final-eval-windows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, short context, few files: a CPU check of the whole script")
    args = ap.parse_args(argv)
    if args.minutes is None:
        args.minutes = 0.25 if args.smoke else 5.0
    if args.smoke:
        args.batch, args.seq_len, args.warmup = min(args.batch, 4), min(args.seq_len, 256), 10
        args.eval_every, args.eval_windows, args.final_eval_windows = 4.0, 8, 16
    for name in ("minutes", "batch", "seq_len", "lr", "eval_every", "eval_windows", "final_eval_windows"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    return args


@dataclasses.dataclass
class Setting:
    """How training runs: attention implementation, rematerialisation, batch, the jitted step."""

    attention: str
    remat: bool
    batch: int
    step: Callable


def pick_setting(config: ModelConfig, args, stream: jax.Array, sample: Callable) -> Setting:
    """The first of `candidates` whose step compiles and runs with a finite loss."""
    for attention, remat, batch in candidates(args.batch):
        params, opt = init_state(config, args.seed)
        step = make_train_step(config, seq_len=args.seq_len, beta=args.beta, weight_decay=args.weight_decay,
                               clip=args.clip, attention=attention, remat=remat)
        try:
            t = time.perf_counter()
            _, _, metrics = step(params, opt, stream, sample(batch), jnp.float32(0.0))
            if not np.isfinite(float(metrics["loss"])):
                raise FloatingPointError(f"first-step loss is {float(metrics['loss'])}")
        except Exception as e:  # compile or runtime failure (no cuDNN, out of memory): next setting
            print(f"attention {attention}, remat {remat}, batch {batch} failed: {str(e).splitlines()[0][:300]}",
                  flush=True)
            continue
        print(f"attention {attention}, remat {remat}, batch {batch}: first step (compile) "
              f"{time.perf_counter() - t:.1f}s", flush=True)
        return Setting(attention, remat, batch, step)
    raise SystemExit("no training setting compiled and ran; see the errors above")


def train(config: ModelConfig, args, setting: Setting, stream: jax.Array, sample: Callable,
          evaluate: Callable, periodic: np.ndarray):
    """The training loop under the wall-clock budget, evaluating every `--eval-every` seconds.
    Returns (params, history, steps, diverged_at_step or None, training seconds)."""
    params, opt = init_state(config, args.seed)
    budget = args.minutes * 60.0
    history, window, pending, step, diverged = [], [], None, 0, None
    start, last_eval = time.perf_counter(), -math.inf
    while True:
        elapsed = time.perf_counter() - start
        done = elapsed >= budget or (args.max_steps is not None and step >= args.max_steps)
        if done or elapsed - last_eval >= args.eval_every:
            if pending is not None:
                window.append(jax.device_get(pending))
                pending = None
            last_eval = elapsed
            history.append(progress_record(step, setting.batch * args.seq_len, elapsed, window,
                                           held_out_metrics(evaluate, params, periodic, setting.batch)))
            window = []
            if not math.isfinite(history[-1]["heldout_bpb"]):
                if len(history) < 2:
                    raise RuntimeError("the held-out loss of the initial weights is not finite")
                print("held-out loss is not finite: training diverged; keeping the weights of the "
                      f"evaluation at step {history[-2]['step']}", flush=True)
                params, diverged = last_good, step
                break
            last_good = jax.tree.map(jnp.copy, params)  # params are donated to the next step
        if done:
            break
        lr = learning_rate(step, elapsed / budget, peak=args.lr, warmup=args.warmup,
                           final_ratio=args.final_lr_ratio)
        params, opt, metrics = setting.step(params, opt, stream, sample(setting.batch), jnp.float32(lr))
        if pending is not None:  # read the previous step while this one runs: one step in flight
            window.append(jax.device_get(pending))
        pending, step = metrics, step + 1
    return params, history, step, diverged, time.perf_counter() - start


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = SMOKE_MODEL if args.smoke else MODEL
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")
    started = time.perf_counter()
    train_files, held_files = stdlib_corpus.split_files(stdlib_corpus.list_files())
    if args.smoke:
        train_files, held_files = train_files[:60], held_files[:20]
    train_np, held_np = stdlib_corpus.token_stream(train_files), stdlib_corpus.token_stream(held_files)
    if len(train_np) <= args.seq_len + 1:
        raise SystemExit(f"training stream ({len(train_np)} tokens) is shorter than one window")
    periodic = eval_windows(held_np, args.seq_len, args.eval_windows)
    final_data = eval_windows(held_np, args.seq_len, args.final_eval_windows)
    stream = jnp.asarray(train_np.astype(np.uint16))
    device = jax.devices()[0]
    print(f"device {device.device_kind} ({jax.default_backend()}); train {len(train_np):,} tokens, "
          f"held-out {len(held_np):,} tokens; files {len(train_files)}/{len(held_files)}", flush=True)
    rng = np.random.default_rng(args.seed)

    def sample(batch: int) -> jax.Array:
        return jnp.asarray(rng.integers(0, len(train_np) - args.seq_len - 1, size=batch), jnp.int32)

    setting = pick_setting(config, args, stream, sample)
    evaluate = make_eval_step(config, setting.attention)
    n_params = sum(x.size for x in jax.tree.leaves(wise_jax.abstract_params(config)))
    print(f"{n_params:,} parameters; batch {setting.batch} x {args.seq_len}; budget {args.minutes} min", flush=True)
    params, history, steps, diverged, train_s = train(config, args, setting, stream, sample, evaluate, periodic)

    final = held_out_metrics(evaluate, params, final_data, setting.batch)
    final.update({"steps": steps, "tokens_seen": steps * setting.batch * args.seq_len,
                  "train_s": round(train_s, 1), "heldout_windows": len(final_data), "diverged_at_step": diverged})
    print(f"final held-out: {final['heldout_bpb']:.4f} bits per byte (last loop) over {final['heldout_bytes']:,} "
          f"bytes; per loop nats {np.round(final['heldout_nll_per_loop'], 4).tolist()}", flush=True)

    out = Path(args.out)
    tensors = wise_jax.to_checkpoint_tensors(config, params)
    save_checkpoint(out, Checkpoint(config, tensors, byte_tokenizer(), "train_builtin"), bf16=True)
    log = {
        "model": config.to_dict(), "parameters": int(n_params),
        "objective": f"Ouro stage I: sum_t p_t CE_t - {args.beta} H(p); early-exit gate trained",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "attention": setting.attention, "remat": setting.remat, "batch": setting.batch,
        "corpus": {"stdlib": str(stdlib_corpus.stdlib_root()), "train_files": len(train_files),
                   "heldout_files": len(held_files), "train_tokens": int(len(train_np)),
                   "heldout_tokens": int(len(held_np)), "heldout_fraction": stdlib_corpus.HELD_OUT_FRACTION},
        "history": history, "final": final,
        "machine": {"device": device.device_kind, "backend": jax.default_backend(),
                    "platform": platform.platform(), "python": platform.python_version()},
        "versions": {name: importlib.metadata.version(name) for name in ("jax", "jaxlib", "numpy")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_s": round(time.perf_counter() - started, 1),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "README.md").write_text(model_card(log))
    plot(history, final, out / "loss_curve.png")
    print(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)", flush=True)
    return log


def model_card(log: dict) -> str:
    """A short README for the checkpoint directory, from the training log."""
    m, f, c = log["model"], log["final"], log["corpus"]
    per_loop = ", ".join(f"{x / math.log(2):.3f}" for x in f["heldout_nll_per_loop"])
    return (
        "# Built-in Ouro-architecture byte-level model\n\n"
        f"{log['parameters']:,} parameters: {m['num_hidden_layers']} shared layers x {m['total_ut_steps']} loops, "
        f"hidden {m['hidden_size']}, {m['num_attention_heads']} heads x {m['head_dim']}, MLP "
        f"{m['intermediate_size']}, byte vocabulary of {m['vocab_size']} (<|endoftext|> = 256), "
        f"RoPE theta {m['rope_theta']:g}. Weights in bf16.\n\n"
        f"Trained by `benchmarks/train_builtin.py` on the Python {log['machine']['python']} standard library's "
        f"`*.py` files ({c['train_files']} files, {c['train_tokens']:,} tokens; {c['heldout_files']} files held out "
        f"by path hash) for {f['steps']:,} steps, {f['tokens_seen']:,} tokens, {f['train_s']:.0f} s on "
        f"{log['machine']['device']} ({log['date']}), windows of {log['args']['seq_len']} tokens. Objective: "
        f"{log['objective']}.\n\n"
        f"Held-out bits per byte (last loop): **{f['heldout_bpb']:.3f}**; per loop: {per_loop}. "
        "History in `train_log.json`, curve in `loss_curve.png`.\n")


def plot(history: list[dict], final: dict, path: Path) -> None:
    """Held-out bits per byte per loop against tokens seen, with the training loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["tokens"] / 1e6 for r in history]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    loops = len(history[0]["heldout_nll_per_loop"])
    for t in range(loops):
        ax.plot(tokens, [r["heldout_nll_per_loop"][t] / math.log(2) for r in history],
                label=f"held-out, loop {t + 1}", lw=2 if t == loops - 1 else 1)
    trained = [(x, r["train_ce_last"] / math.log(2)) for x, r in zip(tokens, history) if "train_ce_last" in r]
    if trained:
        ax.plot(*zip(*trained), "k--", lw=1, label="train, last loop")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"final held-out {final['heldout_bpb']:.3f} bits/byte (last loop)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
