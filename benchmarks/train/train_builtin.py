"""Train a built-in model (Ouro or Huginn architecture) on the Python standard library's source (JAX).

    python -m benchmarks.train.train_builtin --out /tmp/ouro-py-3m --minutes 5   # on an H200
    python -m benchmarks.train.train_builtin --smoke --out /tmp/ouro-smoke       # CPU, under a minute
    python -m benchmarks.train.train_builtin --architecture huginn --out /tmp/huginn-py-3m --minutes 5

Data: `stdlib_corpus` (byte tokens, files held out by a hash of their path). Each step samples
`--batch` windows of `--seq-len` + 1 tokens at random offsets of the training stream.

Objective (Ouro, stage I; the early-exit gate is trained): per token, the expected cross-entropy
over loops under the gate's exit distribution p_t, minus `--beta` times the entropy of p
(`sum_t p_t * CE_t - beta * H(p)`). The model's output is the last loop (`early_exit_threshold`
1.0), so held-out loss and bits per byte are reported for every loop and quoted for the last.
Bits per byte: mean NLL in bits over targets that are bytes (ids < 256).

`--architecture huginn` trains `wise_jax.train.HUGINN_BUILTIN_MODEL` (prelude 1, core block 2,
coda 1) with objective "huginn": the next-token cross-entropy after a number of core iterations
drawn per step around the mean recurrence (the model's total_ut_steps, 4) by the released
"poisson-lognormal-filling" sampler, backpropagating through only the last `--backprop-depth`
(2) of them, from a fresh random "like-init" state; held-out bits per byte at fixed depths
(1, 2, 4, 8) from the seeded initial state.

Training is `wise_jax.train` (optax AdamW, global-norm clipping, warm-up then a cosine over the
wall-clock budget; orbax checkpoints under `--out`/checkpoints) with bf16 compute and float32
master weights. On a GPU attention is cuDNN's fused kernel; if it does not compile or run,
training falls back to XLA attention with per-layer rematerialisation, then without it at half
the batch.

Writes into `--out`: the checkpoint in the HF Ouro layout (config.json, model.safetensors in bf16,
tokenizer.json), metrics.json (every step, every evaluation, the summary), train_log.json (the
summary with corpus, machine, versions, date), loss_curve.png and a README.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
from pathlib import Path

import jax

from benchmarks import report as rp
from benchmarks.quality import stdlib_corpus
from wise_core.train_config import TrainConfig
from wise_jax import train as T

MODEL = T.BUILTIN_MODEL
SMOKE_MODEL = dataclasses.replace(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=32)
HUGINN_MODEL = T.HUGINN_BUILTIN_MODEL
HUGINN_SMOKE_MODEL = dataclasses.replace(HUGINN_MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                         n_layers_in_recurrent_block=1)
MODELS = {("ouro", False): MODEL, ("ouro", True): SMOKE_MODEL, ("huginn", False): HUGINN_MODEL,
          ("huginn", True): HUGINN_SMOKE_MODEL}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (checkpoint, log, plot)")
    ap.add_argument("--architecture", choices=("ouro", "huginn"), default="ouro",
                    help="ouro: the Ouro shape, objective ouro; huginn: the Huginn shape, objective huginn")
    ap.add_argument("--backprop-depth", type=int, default=2,
                    help="Huginn: core iterations backpropagated through (the last ones of each step's draw)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="training wall-clock budget (default 5, smoke 0.25); compilation and the final "
                         "evaluation come on top")
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
    ap.add_argument("--peak-flops", type=float, default=None, help="the device's peak FLOP/s, for MFU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, short context, few files: a CPU check of the whole script")
    args = ap.parse_args(argv)
    if args.minutes is None:
        args.minutes = 0.25 if args.smoke else 5.0
    if args.smoke:
        args.batch, args.seq_len, args.warmup = min(args.batch, 4), min(args.seq_len, 256), 10
        args.eval_every, args.eval_windows, args.final_eval_windows = 4.0, 8, 16
    return args


def candidates(batch: int) -> list[tuple[str, bool, int]]:
    """(attention, remat, batch) settings to try in order."""
    if jax.default_backend() == "gpu":
        return [("cudnn", False, batch), ("xla", True, batch), ("xla", False, max(1, batch // 2))]
    return [("xla", False, batch)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = MODELS[args.architecture, args.smoke]
    huginn = args.architecture == "huginn"
    train_files, held_files = stdlib_corpus.split_files(stdlib_corpus.list_files())
    if args.smoke:
        train_files, held_files = train_files[:60], held_files[:20]
    stream, heldout = stdlib_corpus.token_stream(train_files), stdlib_corpus.token_stream(held_files)
    train = None
    for attention, remat, batch in candidates(args.batch):
        setting = TrainConfig(
            objective=args.architecture, beta=args.beta, backprop_depth=args.backprop_depth, batch=batch, seq_len=args.seq_len, lr=args.lr,
            final_lr_ratio=args.final_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
            max_steps=args.max_steps, minutes=args.minutes, seed=args.seed, attention=attention, remat=remat,
            eval_every_s=args.eval_every, eval_windows=args.eval_windows,
            final_eval_windows=args.final_eval_windows, peak_flops=args.peak_flops)
        failure = T.probe(config, setting, stream)
        print(f"attention {attention}, remat {remat}, batch {batch}: {failure or 'runs'}", flush=True)
        if failure is None:
            train = setting
            break
    if train is None:
        raise SystemExit("no training setting compiled and ran; see the errors above")
    summary = T.run(config, train, stream, heldout, args.out, name="train_builtin")
    objective = (f"next-token CE after a drawn number of core iterations (poisson-lognormal-filling, mean "
                 f"{config.total_ut_steps}), backpropagated through the last {args.backprop_depth}; "
                 "a fresh like-init random state per window" if huginn else
                 f"Ouro stage I: sum_t p_t CE_t - {args.beta} H(p); early-exit gate trained")
    log = {**summary, "objective": objective,
           "corpus": {"stdlib": str(stdlib_corpus.stdlib_root()), "train_files": len(train_files),
                      "heldout_files": len(held_files), "train_tokens": int(len(stream)),
                      "heldout_tokens": int(len(heldout)), "heldout_fraction": stdlib_corpus.HELD_OUT_FRACTION},
           "machine": {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                       "platform": platform.platform(), "python": platform.python_version()},
           "versions": {n: rp.version(n) for n in ("jax", "jaxlib", "numpy", "optax", "orbax-checkpoint")},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out = Path(args.out)
    rp.write_json(out / "train_log.json", log)
    (out / "README.md").write_text(huginn_model_card(log) if huginn else model_card(log))
    return log


def model_card(log: dict) -> str:
    """A short README for the checkpoint directory, from the training log."""
    m, f, c = log["model"], log["final"], log["corpus"]
    per_loop = ", ".join(f"{x:.3f}" for x in f["heldout_bpb_per_loop"])
    return (
        "# Built-in Ouro-architecture byte-level model\n\n"
        f"{m['num_hidden_layers']} shared layers x {m['total_ut_steps']} loops, "
        f"hidden {m['hidden_size']}, {m['num_attention_heads']} heads x {m['head_dim']}, MLP "
        f"{m['intermediate_size']}, byte vocabulary of {m['vocab_size']} (<|endoftext|> = 256), "
        f"RoPE theta {m['rope_theta']:g}. Weights in bf16.\n\n"
        f"Trained by `benchmarks.train.train_builtin` (`wise_jax.train`) on the Python {log['machine']['python']} "
        f"standard library's `*.py` files ({c['train_files']} files, {c['train_tokens']:,} tokens; "
        f"{c['heldout_files']} files held out by path hash) for {log['steps_done']:,} steps, "
        f"{log['tokens_seen']:,} tokens, {log['train_s']:.0f} s on {log['machine']['device']} ({log['date']}), "
        f"windows of {log['train']['seq_len']} tokens. Objective: {log['objective']}.\n\n"
        f"Held-out bits per byte (last loop): **{f['heldout_bpb']:.3f}**; per loop: {per_loop}. "
        "Every step in `metrics.json`, curve in `loss_curve.png`.\n")


def huginn_model_card(log: dict) -> str:
    """A short README for a Huginn checkpoint directory, from the training log."""
    m, f, c = log["model"], log["final"], log["corpus"]
    per_depth = ", ".join(f"{d}: {x:.3f}" for d, x in zip(f["heldout_depths"], f["heldout_bpb_per_depth"]))
    return (
        "# Built-in Huginn-architecture byte-level model\n\n"
        f"A prelude of {m['n_layers_in_prelude']} layer(s), a core block of {m['n_layers_in_recurrent_block']} "
        f"layers iterated {m['mean_recurrence']} times by default, a coda of {m['n_layers_in_coda']}; hidden "
        f"{m['n_embd']}, {m['n_heads']} heads, MLP {m['intermediate_size']}, byte vocabulary of {m['vocab_size']} "
        f"(<|endoftext|> = 256), RoPE theta {m['rope_base']:g}, the head tied to the embedding. Weights in bf16.\n\n"
        f"Trained by `benchmarks.train.train_builtin --architecture huginn` (`wise_jax.train`) on the Python "
        f"{log['machine']['python']} standard library's `*.py` files ({c['train_files']} files, "
        f"{c['train_tokens']:,} tokens; {c['heldout_files']} files held out by path hash) for {log['steps_done']:,} "
        f"steps, {log['tokens_seen']:,} tokens, {log['train_s']:.0f} s on {log['machine']['device']} "
        f"({log['date']}), windows of {log['train']['seq_len']} tokens. Objective: {log['objective']}.\n\n"
        f"Held-out bits per byte at depth {f['heldout_depth']}: **{f['heldout_bpb']:.3f}**; per fixed depth: "
        f"{per_depth}. Every step in `metrics.json`, curve in `loss_curve.png`.\n")


if __name__ == "__main__":
    main()
