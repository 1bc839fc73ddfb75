"""The arms of the engine decode benchmarks (`throughput`, `jax_generate_bench`): their names, the
arm each is compared with, the WISE profile and depth they run, the engines of the arms no
attention_backend names (`torch_engine_with`), and the pre-engine source tree the old arms import."""

from __future__ import annotations

import argparse
import math
import subprocess
from pathlib import Path

from benchmarks import report as rp

# dense-default / wise-default: the engine as `LLM(model)` / `LLM(model, wise_config=WiseConfig())`
# build it (Huginn: num_steps=--num-steps, wise_config=huginn_wise_config(num_steps)), every other
# constructor argument at its default (pool, max_num_seqs, max_model_len, attention_backend).
ARMS = ("dense", "wise", "dense-default", "wise-default", "fa4", "wise-fa4", "old", "old-wise", "adaptive",
        "wise-adaptive", "adaptive-regroup")
# The adaptive-depth arms (Huginn only) and the fixed-depth arm each is compared with.
ADAPTIVE_ARMS = {"adaptive": "dense", "wise-adaptive": "wise", "adaptive-regroup": "dense"}
FA4_ARMS = ("fa4", "wise-fa4")
OLD_COMMIT = "bef25e92fbb27d035f3f9973f69047951c897363"  # the last commit before the engine
CUDA_GRAPHS = {"auto": "auto", "on": True, "off": False}


def base_of(arm: str) -> str:
    """The dense arm an arm is compared with (wise-default: dense-default; old-wise: old)."""
    return {"old-wise": "old", "wise-default": "dense-default", "dense-default": "dense-default"}.get(arm, "dense")


def parse_arms(text: str) -> list[str]:
    """'dense,wise' -> ['dense', 'wise']: distinct names of ARMS."""
    arms = [a.strip() for a in text.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"arms must be distinct names of {ARMS}, got {text!r}")
    return arms


def parse_threshold(text: str) -> float:
    """An adaptive-depth KL threshold: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"the adaptive threshold must be finite and >= 0, got {text!r}")
    return value


def adaptive_threshold(args) -> float:
    """--adaptive-threshold, or AdaptiveDepth's default."""
    from wise_core.adaptive_depth import AdaptiveDepth
    return AdaptiveDepth().threshold if args.adaptive_threshold is None else args.adaptive_threshold


def adaptive_text(arms, threshold: float) -> str | None:
    """The adaptive arms' depth rule in words (None without one)."""
    if not any(a.split("+")[0] in ADAPTIVE_ARMS for a in arms):
        return None
    text = (f"adaptive depth: KL exit threshold {threshold:g}, min_steps 0; exited rows ride along (every "
            f"iteration runs every row), so an adaptive arm's roofline is its fixed-depth arm's")
    if "adaptive-regroup" in arms:
        text += ("; adaptive-regroup regroups by depth (only the rows still running run the later iterations), "
                 "eager (cuda_graphs=False): on a GPU its timing is not comparable with graph-captured arms' "
                 "(on CPU every arm is eager)")
    return text


def check_depth(parser: argparse.ArgumentParser, args, config, ouro_only: list[str] = (),
                huginn_only: list[str] = ()) -> int:
    """The depth of the run's steps: a Huginn model's --num-steps core iterations (default its
    total_ut_steps), an Ouro model's loops (--num-steps, if given, must equal them). Refuses the
    arms `ouro_only` on a Huginn model, `huginn_only` (the adaptive-depth arms) on an Ouro one."""
    if config.architecture != "huginn":
        if huginn_only:
            parser.error(f"arms {list(huginn_only)} run a Huginn model's adaptive depth; this Ouro model exits "
                         f"by its config's early_exit_threshold ({config.early_exit_threshold:g})")
        if args.num_steps not in (None, config.num_loops):
            parser.error(f"--num-steps sets a Huginn model's core iterations; this Ouro model runs its "
                         f"{config.num_loops} loops every step (got --num-steps {args.num_steps})")
        return config.num_loops
    if ouro_only:
        parser.error(f"arms {list(ouro_only)} run Ouro models only; this is a Huginn model")
    steps = config.total_ut_steps if args.num_steps is None else args.num_steps
    if steps < 1:
        parser.error(f"--num-steps must be >= 1, got {steps}")
    return steps


def wise_config_of(config, num_steps: int, **settings):
    """The WISE profile of the wise arms: Ouro's `WiseConfig` (discovery on loops 0 and 1, reuse on
    2 and 3), Huginn's `huginn_wise_config(num_steps)` (discovery on core iterations 0 and 1, reuse
    on 2 .. num_steps - 1); `settings`: the other fields (eta, kernel)."""
    from wise_core.wise_config import WiseConfig, huginn_wise_config
    if config.architecture == "huginn":
        return huginn_wise_config(num_steps, **settings)
    return WiseConfig(**settings)


def torch_engine_with(**phases) -> type:
    """`wise_torch.LLM` whose attention plan has `phases` replaced (fields of
    `wise_torch.attention.AttentionPlan`), through the engine's construction hook
    `LLM._attention_plan`: the arms no attention_backend names, wise_decode="fa4-union" (the
    reference system's FlashAttention WISE decode, `wise_torch.union_decode`), "reference-union"
    (the same in plain torch) and prefill="reference" (the packed varlen prefill in plain torch,
    FA4's oracle). The engine checks what it builds as for any plan (a union arm needs a
    wise_config; FA4 where it cannot run, and an fp8 cache, are errors)."""
    import dataclasses

    import wise_torch

    class ArmLLM(wise_torch.LLM):
        def _attention_plan(self, *args):
            return dataclasses.replace(super()._attention_plan(*args), **phases)

    ArmLLM.__name__ = ArmLLM.__qualname__ = f"LLM[{', '.join(f'{k}={v}' for k, v in phases.items())}]"
    return ArmLLM


def wise_profile(config, num_steps: int, arms, eta: float) -> str | None:
    """The WISE profile of a run's wise arms in words (None without one); wise-default's too where
    its eta (the default) differs from --eta."""
    wise = [a for a in arms if "wise" in a and not a.startswith("old")]
    if not wise:
        return None
    text = profile_text(wise_config_of(config, num_steps, eta=eta))
    default = wise_config_of(config, num_steps)
    if "wise-default" in wise and default.eta != eta:
        text += f" (wise-default: eta {default.eta:g})"
    return text


def profile_text(wise) -> str:
    """A WISE profile in words: which depths discover, which reuse, eta, block size."""
    def depths(ds):
        return f"{ds[0]}..{ds[-1]}" if len(ds) > 2 and list(ds) == list(range(ds[0], ds[-1] + 1)) \
            else ", ".join(map(str, ds))
    return (f"discovery on depths {depths(wise.discover_depths)}, reuse on {depths(wise.reuse_depths) or 'none'}, "
            f"eta {wise.eta:g}, blocks of {wise.block_size} tokens")


def prepare_old_src(args, workdir: Path, packages=("wise_core", "wise_torch")) -> str | None:
    """The old commit's source tree of `packages`: --old-src, or extracted with git; None if
    neither works."""
    if args.old_src is not None:
        missing = [d for d in packages if not (args.old_src / d).is_dir()]
        if missing:
            raise SystemExit(f"--old-src {args.old_src} lacks {missing}")
        return str(args.old_src.resolve())
    target = workdir / "old-src"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(rp.ROOT), "archive", args.old_commit, *packages],
                             capture_output=True)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return str(target)
