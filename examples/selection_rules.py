"""Selection rules on a model trained here: dense decode against WISE with eta 0.95 and top-k.

Trains a tiny byte-level Ouro (2 layers, 4 loops) with `wise_jax.train` on text (default: this
repository's README and design notes), then decodes the held-out tail three ways with the same
weights (loaded into wise_torch, whose eager engine needs no compilation on CPU; --decode jax
uses wise_jax): dense, WISE with the eta rule (WiseConfig(eta=0.95)) and WISE with the top-k rule
(WiseConfig(selection=TopK(k))). Prints, per arm: bits per byte of the held-out continuations
teacher-forced through the decode step, the density of the reuse loops (selected / causal
blocks), and the fraction of greedy tokens that differ from dense decode's (`wise_core.evaluation.Arm`;
the JAX arms decoded by `wise_jax.evaluation.evaluate`). `--rules` names other arms.

    python examples/selection_rules.py                 # ~300 steps, under a minute on a CPU
    python examples/selection_rules.py --steps 50 --top-k 1
    python examples/selection_rules.py --rules eta=0.9 threshold=0.05 --decode jax
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from wise_core.evaluation import Arm
from wise_core.model_config import ModelConfig
from wise_core.selection import Eta, parse
from wise_core.train_config import TrainConfig
from wise_core.wise_config import WiseConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelConfig(
    vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, max_position_embeddings=512, total_ut_steps=4,
    bos_token_id=256, eos_token_id=256, pad_token_id=257)
"""Byte-level: ids 0..255 are bytes, 256 / 257 BOS / pad (never in the text)."""


def read_text(paths: list[Path]) -> np.ndarray:
    """The files' bytes, concatenated, as int64 token ids."""
    return np.frombuffer(b"\n".join(p.read_bytes() for p in paths), np.uint8).astype(np.int64)


def train(stream: np.ndarray, steps: int, seq_len: int, seed: int):
    """(params, per-step metrics) of MODEL after `steps` steps of wise_jax.train on `stream` (float32,
    last-loop cross-entropy, AdamW with warm-up and cosine)."""
    from wise_jax import train as T
    config = TrainConfig(objective="last", batch=8, seq_len=seq_len, lr=3e-3, warmup=max(steps // 10, 1),
                         max_steps=steps, compute_dtype="float32", seed=seed, eval_every_s=1e9, eval_windows=8)
    state, metrics, _ = T.train_loop(MODEL, config, stream, log=lambda _: None)
    return state.params, metrics


def arms(block_size: int, rules: list[str]) -> list[WiseConfig | None]:
    """Dense, then WISE with each rule (`wise_core.selection.parse`: "eta=0.95", "top_k=3", ...)."""
    return [None] + [WiseConfig(block_size=block_size,
                                **({"eta": rule.eta} if isinstance(rule, Eta) else {"selection": rule}))
                     for rule in map(parse, rules)]


def decode_arm(params, wise: WiseConfig | None, contexts, forced, framework: str, dense: Arm | None) -> Arm:
    """One arm on the held-out pairs -> `wise_core.evaluation.Arm` (byte-level: a byte a token):
    jax by `wise_jax.evaluation.evaluate`; torch by its engine's teacher_force and generate."""
    if framework == "jax":
        from wise_jax import evaluation
        return evaluation.evaluate(params, MODEL, wise, contexts, forced, greedy_tokens=len(forced[0]), dense=dense,
                                   page_size=32, kernel="reference")
    import torch
    import wise_torch
    from wise_jax.params import to_checkpoint_tensors
    torch.set_num_threads(1)  # tiny shapes: one thread is as fast, and does not spin against JAX's
    tensors = {name: np.array(x) for name, x in to_checkpoint_tensors(MODEL, params).items()}  # writable copies
    model = wise_torch.from_tensors(MODEL, tensors)
    scored = wise_torch.teacher_force(model, contexts, forced, wise_config=wise, page_size=32,
                                      attention_backend="reference")
    greedy = wise_torch.generate(model, contexts, max_new_tokens=len(forced[0]), wise_config=wise, eos_token_id=None,
                                 page_size=32, attention_backend="reference")
    density = None if wise is None else {d: float(v) for d, v in scored.stats.density.items()}
    return Arm(wise, scored.logprobs, np.array([len(f) for f in forced]), greedy.tokens, density,
               None if wise is None else scored.stats.fallbacks, dense)


def evaluate(heldout: np.ndarray, params, *, context: int, continuation: int, sequences: int, block_size: int,
             rules: list[str], framework: str) -> list[dict]:
    """Per arm: held-out bits per byte (teacher-forced), reuse density averaged over the reuse
    depths (jax: of the forced and greedy decode, pooled; torch: of the forced decode), greedy
    tokens changed against dense."""
    from wise_jax.evaluation import heldout_pairs
    contexts, forced = heldout_pairs(heldout, context=context, continuation=continuation, count=sequences)
    rows, dense = [], None
    for wise in arms(block_size, rules):
        arm = decode_arm(params, wise, contexts, forced, framework, dense)
        dense = arm if dense is None else dense
        rows.append({"arm": "dense" if wise is None else f"wise {arm.label}",
                     "bits_per_byte": arm.bits_per_byte["mean"], "bits_per_byte_ci": arm.bits_per_byte,
                     "density": None if arm.density is None else float(np.mean(list(arm.density.values()))),
                     "tokens_changed": 0.0 if wise is None else arm.tokens_changed})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'arm':<16} {'bits/byte':>9} {'density':>8} {'tokens changed':>15}"]
    for r in rows:
        density = "1 (dense)" if r["density"] is None else f"{r['density']:.3f}"
        lines.append(f"{r['arm']:<16} {r['bits_per_byte']:>9.4f} {density:>8} {r['tokens_changed']:>15.3f}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, nargs="+", default=[ROOT / "README.md", ROOT / "docs" / "DESIGN.md"])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seq-len", type=int, default=64, help="training window (tokens)")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--context", type=int, default=48, help="held-out context per sequence (bytes)")
    parser.add_argument("--continuation", type=int, default=16, help="decoded bytes per sequence")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=3, help="blocks the top-k arm keeps per head")
    parser.add_argument("--rules", nargs="+", default=None,
                        help="the WISE arms' selection rules (default: eta=0.95 top_k=TOP_K), e.g. threshold=0.05")
    parser.add_argument("--decode", choices=("torch", "jax"), default="torch",
                        help="framework that decodes (torch: eager, no compilation on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("context", "continuation", "sequences"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer")
    for rule in args.rules or ():
        try:
            parse(rule)
        except ValueError as e:
            parser.error(str(e))
    if not 0 < args.heldout_fraction < 1:
        parser.error("--heldout-fraction must be in (0, 1)")
    stream = read_text(args.text)
    split = int(len(stream) * (1 - args.heldout_fraction))
    train_stream, heldout = stream[:split], stream[split:]
    if len(heldout) < args.context + args.continuation:
        parser.error(f"the held-out text ({len(heldout)} bytes) is shorter than --context + --continuation")

    start = time.perf_counter()
    params, metrics = train(train_stream, args.steps, args.seq_len, args.seed)
    print(f"trained {args.steps} steps on {len(train_stream)} bytes in {time.perf_counter() - start:.1f} s: "
          f"last-loop train bits/byte {metrics[0]['bits_per_byte'][-1]:.3f} -> {metrics[-1]['bits_per_byte'][-1]:.3f}")
    start = time.perf_counter()
    rows = evaluate(heldout, params, context=args.context, continuation=args.continuation,
                    sequences=args.sequences, block_size=args.block_size,
                    rules=args.rules or ["eta=0.95", f"top_k={args.top_k}"], framework=args.decode)
    print(f"held out: {args.sequences} sequences, {args.context} bytes of context, {args.continuation} decoded "
          f"({args.decode}, {time.perf_counter() - start:.1f} s)")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
