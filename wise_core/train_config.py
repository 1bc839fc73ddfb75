"""Hyper-parameters of a training run (`wise_jax.train`) and the `wise train` flags, framework-free."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

OBJECTIVES = ("ouro", "last", "huginn")
ORDERS = ("random", "sequential")
ATTENTIONS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a run. batch: windows per micro-batch (global, split over devices);
    accum: micro-batches per optimiser step; max_steps / minutes: the horizon (at least one).
    objective "huginn" (a Huginn model): its core iterations per step are drawn around the model's
    total_ut_steps (the released mean_recurrence) and the last min(drawn, backprop_depth) of them
    get gradient (the released mean_backprop_depth); see `wise_jax.train`."""

    objective: str = "ouro"
    beta: float = 0.05
    backprop_depth: int = 2
    batch: int = 32
    accum: int = 1
    seq_len: int = 2048
    lr: float = 2e-3
    final_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_steps: int | None = None
    minutes: float | None = None
    seed: int = 0
    order: str = "random"
    compute_dtype: str = "bfloat16"
    attention: str = "xla"
    remat: bool = False
    checkpoint_every: int = 0
    eval_every_s: float = 15.0
    eval_windows: int = 64
    final_eval_windows: int = 512
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        for name in ("batch", "accum", "seq_len", "warmup", "backprop_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr", "clip", "eval_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_steps is None and self.minutes is None:
            raise ValueError("give a horizon: max_steps, minutes or both")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")


FIELD_HELP = {
    "objective": "ouro: the exit-weighted loss with an entropy bonus (the gate trains); last: the last loop's "
                 "loss; huginn: a Huginn model's loss at a drawn depth",
    "beta": "ouro objective: weight of the exit distribution's entropy",
    "backprop_depth": "huginn objective: the last core iterations that get gradient",
    "batch": "windows per micro-batch (over all devices)",
    "accum": "micro-batches per optimiser step (gradient accumulation)",
    "seq_len": "tokens per window (each window reads seq_len + 1 tokens)",
    "lr": "peak learning rate (AdamW)",
    "final_lr_ratio": "the cosine schedule ends at this fraction of the peak",
    "warmup": "optimiser steps of linear warm-up",
    "weight_decay": "AdamW decoupled weight decay (matrices only)",
    "clip": "global gradient-norm clip",
    "b1": "AdamW beta1", "b2": "AdamW beta2", "eps": "AdamW epsilon",
    "max_steps": "optimiser steps to run (give this or --minutes, or both)",
    "minutes": "wall-clock budget in minutes (give this or --max-steps, or both)",
    "seed": "seed of the initial weights and of the data order",
    "order": "random: windows at random offsets; sequential: the next non-overlapping windows",
    "compute_dtype": "dtype of the forward and backward passes (the weights stay float32)",
    "attention": "xla: plain causal attention; cudnn: cuDNN's fused attention (GPU)",
    "remat": "recompute each loop's activations in the backward pass (less memory)",
    "checkpoint_every": "save a resumable checkpoint every this many steps (0: only at the end)",
    "eval_every_s": "seconds between held-out evaluations",
    "eval_windows": "held-out windows per periodic evaluation",
    "final_eval_windows": "held-out windows of the final evaluation",
    "peak_flops": "the devices' peak FLOP/s, to report model FLOPs utilisation (default: none reported)",
}
"""The `wise train --help` line of each TrainConfig field (its default is appended)."""


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """`wise train` flags: data, output, and every TrainConfig field (same name, dashes)."""
    parser.add_argument("--data", required=True, type=Path,
                        help="training tokens: a directory of text files, a .npy id array, or a file of bytes")
    parser.add_argument("--heldout", type=Path, default=None,
                        help="held-out tokens (default: the last --heldout-fraction of --data)")
    parser.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="without --heldout, this last fraction of --data is held out (default: 0.05)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (model, metrics, checkpoints)")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="config.json of the shape to train (default: the built-in 3M byte-level shape)")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true", help=FIELD_HELP[field.name])
        else:
            kind = {"int": int, "float": float, "str": str}[field.type.split(" |")[0]]
            choices = {"objective": OBJECTIVES, "order": ORDERS, "attention": ATTENTIONS}.get(field.name)
            default = "" if field.default is None else f" (default: {field.default})"
            parser.add_argument(flag, type=kind, default=field.default, choices=choices,
                                help=FIELD_HELP[field.name] + default)
