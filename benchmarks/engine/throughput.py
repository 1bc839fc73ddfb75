"""Decode throughput of the serving engine (wise_torch.LLM): dense, WISE, FA4 and the pre-engine path.

    python -m benchmarks.engine.throughput --preset ouro-1.4b --shapes 1024x64,4096x20,8192x10 \\
        --q-scale 8,7.3,7 --old-src .old-src --out benchmarks/results/DIR            # on an H200
    python -m benchmarks.engine.throughput --preset test-tiny --dtype float32 --device cpu --kernel reference \\
        --shapes 64x3 --new-tokens 6 --old-src . --out /tmp/tp                         # CPU smoke
    python -m benchmarks.engine.throughput --preset huginn-0125 --num-steps 32 --kernel reference \\
        --shapes 1024x32,4096x8 --q-scale 3.1,2.83 --arms dense,wise,adaptive --out DIR # Huginn, on an H200

Method (the reference system's): a cohort of C concurrent requests of exactly L prompt tokens
(random ids, seed fixed per shape, the same for every arm), greedy, N output tokens each with
ignore_eos. The step loop is timed on the host: decode throughput counts only the tokens
generated after the step in which the whole cohort has its first token, over the time from that
step to the last; ms/step is that time over those steps; "prefill s" is the time from the first
add_request to that step. Each (shape, arm) runs in a fresh process (this module with --worker),
with an identical KV pool for every engine arm (num_pages = the cohort's pages + 1), one untimed
warm-up cohort (--warmup-tokens new tokens: compiles kernels, captures graphs) and --repeats timed
cohorts, all printed.

Arms:
- dense: the engine, Triton dense decode (`kernel=--kernel`, no WISE);
- wise: the engine with WISE (`WiseConfig(eta, kernel=--kernel)`);
- fa4: the engine with FlashAttention-4 for prefill and dense decode (`prefill_attention="fa4"`,
  `dense_decode="fa4"`) when `flash_attn.cute` imports (else a 'not importable' row);
- wise-fa4: WISE as the reference system's FlashAttention path runs it (`wise_decode="fa4-union"`:
  reuse rows over the page-granular head union of their support; not the decode contract), its
  dense loops and prefill on FA4 too;
- adaptive, wise-adaptive (Huginn only: an Ouro model exits by its config's early_exit_threshold):
  the dense / wise arm's engine with per-token adaptive depth
  (`adaptive_depth=AdaptiveDepth(threshold=--adaptive-threshold)`, the released KL exit criterion,
  min_steps 0, at most --num-steps iterations). Rows that exit ride along: every iteration still
  runs every row, so the arm's step does the fixed-depth arm's work plus the exit checks (the
  coda and the LM head after each iteration but the last). Also reported: the mean depth
  (`stats().mean_decode_depth`: core iterations a decoded token ran, this cohort's) and the
  tok/s over the fixed-depth arm of the same kind (adaptive: dense; wise-adaptive: wise); their
  tokens are the exits', so "differ" counts requests whose tokens differ from dense's (expected,
  not an error);
- adaptive-regroup (Huginn only): the adaptive arm regrouped by depth
  (`LLM(adaptive_regroup=True)`): after each checked iteration only the rows still running run
  the later iterations (the adaptive arm's tokens and depths). Its rows are gathered (dynamic
  shapes), so it runs eager: the arm sets cuda_graphs=False whatever --cuda-graphs says, and on
  a GPU its timing is not comparable with the graph-captured arms' (on CPU every arm is eager);
- spec-wise, spec-wise2, spec-wise-sparse, spec-loops (`--spec wise|wise2|wise-sparse|loops
  --num-draft K`): the engine with lossless speculative decoding (`speculative_arms`); also
  reported: acceptance, tokens per round, and how many
  requests' greedy tokens differ from the dense arm's (every engine arm is compared);
  `--accept-rate P,...` times them at set acceptances instead (spec-wise@P: real drafts and
  verification, a seeded Bernoulli(P) accept; tokens not the model's);
- old, old-wise: the pre-engine `wise_torch.generate` (dense / WISE), measured by running the old
  commit's own code, not a copy: a source tree of that commit (--old-src DIR; make one with
  `git archive OLD_COMMIT wise_core wise_torch | tar -x -C DIR`, or let --old-commit extract it
  when git history is at hand) goes first on the worker's path (PYTHONPATH). Its timing is generate's
  own (GenerationStats: decode after the batched prefill that gives every row its first token,
  tokens after those first ones), after one untimed warm-up call; it sizes its own KV pool
  (the cohort's pages exactly).

Workloads: --model DIR (a checkpoint or built-in name) or random weights at a preset's shape
(--preset, normal(0, --std) as `wise_core.checkpoint.random_init` says, drawn on the device by
each worker, every HF tensor from its own generator seeded by crc32(name) + seed, so every arm,
the pre-engine layout included, holds the same weights), with the queries multiplied by
--q-scale (one value, or one per shape) to give peaked attention (`random_recipe` says which rows:
Ouro's q_proj; Huginn's q rows of attn.Wqkv and q's half of attn.qk_bias).

Huginn (a Huginn --preset or --model: huginn-0125, test-tiny-huginn): every token runs
--num-steps core iterations (default the config's total_ut_steps; an Ouro model runs its loops,
and --num-steps, if given, must equal them); the wise arms use `huginn_wise_config(num_steps)`
(discovery on iterations 0 and 1, reuse on the rest; --eta, --kernel), wise-default
`huginn_wise_config(num_steps)` with every other setting at its default; the old and speculative
arms run Ouro only. The report states the WISE profile; the issue's targets are Ouro-1.4B's, and
a Huginn run is held to none.

Per arm and repeat: decode tok/s, ms/step, the roofline tok/s and the share of it reached,
the reuse-union density per reuse depth (LLM.stats(); the old path's GenerationStats), fallbacks,
preemptions, prefill time. Roofline per step = bytes / --hbm-tbps (4.3 TB/s), bytes = the weights
a step reads (`weight_bytes_per_step`: Ouro's layers, final norm and exit gate once per loop;
Huginn's prelude, coda and ln_f once, its core block and adapter once per core iteration; the LM
head once; from the checkpoint's tensor shapes) plus every plane's K and V at the cohort's mean
context L + N/2 (`kv_bytes_per_step`: Ouro's (loop, layer) planes, Huginn's `num_planes`; WISE:
reuse planes at the measured density). An adaptive arm's roofline is its fixed-depth arm's
(riding along, every iteration runs every row; its exit checks' reads are not counted, so its
share is against the fixed-depth step's bound; adaptive-regroup's step reads the same weights
per iteration run but fewer rows' K/V, and is held to the same bound). Writes throughput.json, throughput.md (with the
standing against the issue's targets) and throughput.png to --out, and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine import speculative_arms

# dense-default / wise-default: the engine as `LLM(model)` / `LLM(model, wise_config=WiseConfig())`
# build it (Huginn: num_steps=--num-steps, wise_config=huginn_wise_config(num_steps)), every other
# constructor argument at its default (pool, max_num_seqs, max_model_len, kernel).
ARMS = ("dense", "wise", "dense-default", "wise-default", "fa4", "wise-fa4", "old", "old-wise", "adaptive",
        "wise-adaptive", "adaptive-regroup")
# The adaptive-depth arms (Huginn only) and the fixed-depth arm each is compared with.
ADAPTIVE_ARMS = {"adaptive": "dense", "wise-adaptive": "wise", "adaptive-regroup": "dense"}
FA4_ARMS = ("fa4", "wise-fa4")
OLD_COMMIT = "bef25e92fbb27d035f3f9973f69047951c897363"  # the last commit before the engine
HBM_TBPS = 4.3
CUDA_GRAPHS = {"auto": "auto", "on": True, "off": False}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The issue's targets: WISE / dense decode tok/s per context, dense share of the roofline per
# context, the batch-1 step time, and the defaults' decode tok/s within this share of the tight arms'.
WISE_TARGETS = {1024: 1.30, 4096: 1.45, 8192: 1.50}
DENSE_SHARE_TARGETS = {1024: 0.75, 4096: 0.80, 8192: 0.80}
BATCH1_STEP_MS = 4.0
DEFAULTS_WITHIN = 0.97


def base_of(arm: str) -> str:
    """The dense arm an arm is compared with (wise-default: dense-default; old-wise: old)."""
    return {"old-wise": "old", "wise-default": "dense-default", "dense-default": "dense-default"}.get(arm, "dense")


# -- arguments ---------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1024x64,4096x20' -> [(context, batch), ...], both positive."""
    shapes = []
    for item in text.split(","):
        context, _, batch = item.strip().partition("x")
        if not (context.isdigit() and batch.isdigit()) or int(context) < 1 or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not CONTEXTxBATCH with positive integers")
        shapes.append((int(context), int(batch)))
    return shapes


def parse_floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: q scales must be positive and finite")
    return values


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
    from wise_core.config import AdaptiveDepth
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


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"arms must be distinct names of {ARMS}, got {text!r}")
    return arms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory or built-in name (default: random --preset weights)")
    p.add_argument("--preset", default="ouro-1.4b", help="model shape for random weights (wise_core PRESETS)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's num_hidden_layers (Ouro)")
    p.add_argument("--num-steps", type=int, help="a Huginn model's core iterations (default: total_ut_steps)")
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    p.add_argument("--q-scale", type=parse_floats, default=[1.0],
                   help="query multiplier: one value, or one per shape (e.g. 8,7.3,7)")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x64,4096x20,8192x10"),
                   help="CONTEXTxBATCH list: prompt tokens x concurrent requests")
    p.add_argument("--new-tokens", type=int, default=32, help="output tokens per request (>= 2)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="output tokens of the untimed warm-up cohort")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", type=parse_arms, default=[a for a in ARMS if a not in ADAPTIVE_ARMS],
                   help=f"comma-separated, of {ARMS} (default: all but the adaptive ones, which run Huginn only)")
    p.add_argument("--adaptive-threshold", type=parse_threshold, default=None,
                   help="KL exit threshold of the adaptive arms (default: AdaptiveDepth's, the released 1e-3)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel", default="triton", choices=("triton", "reference", "auto"),
                   help="decode attention of the dense and wise arms (and of the old ones)")
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--num-pages", type=int, default=0, help="KV pool of the engine arms (default: the cohort's + 1)")
    p.add_argument("--cuda-graphs", default="auto", choices=sorted(CUDA_GRAPHS), help="LLM(cuda_graphs=) of the engine arms")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="LLM(max_num_batched_tokens=): prompt tokens per step (default: the engine's)")
    p.add_argument("--old-src", type=Path, help="source tree of the pre-engine commit (wise_core, wise_torch)")
    p.add_argument("--old-commit", default=OLD_COMMIT, help="commit to extract with git when --old-src is not given")
    p.add_argument("--hbm-tbps", type=float, default=HBM_TBPS, help="memory bandwidth of the roofline")
    p.add_argument("--child-timeout", type=float, default=600, help="seconds per (shape, arm) process")
    p.add_argument("--out", type=Path, default=rp.RESULTS)
    speculative_arms.add_arguments(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one (shape, arm) from a JSON spec file
    return p


def check_args(parser: argparse.ArgumentParser, args) -> list[float]:
    """Validate the combination; returns the q scale of each shape."""
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode is timed after every request's first token)")
    if args.warmup_tokens < 1 or args.repeats < 1:
        parser.error("--warmup-tokens and --repeats must be >= 1")
    if not 0 < args.eta <= 1:
        parser.error(f"--eta must be in (0, 1], got {args.eta}")
    if args.page_size < 1 or args.num_pages < 0 or args.max_num_batched_tokens < 0 or args.hbm_tbps <= 0:
        parser.error("--page-size and --hbm-tbps must be positive, --num-pages and --max-num-batched-tokens >= 0")
    scales = args.q_scale
    if len(scales) == 1:
        scales = scales * len(args.shapes)
    if len(scales) != len(args.shapes):
        parser.error(f"--q-scale gives {len(args.q_scale)} values for {len(args.shapes)} shapes (give 1 or one each)")
    if args.num_pages:
        short = [(L, C) for L, C in args.shapes
                 if args.num_pages < cohort_pages(L, C, args.new_tokens, args.page_size)]
        if short:
            parser.error(f"--num-pages {args.num_pages} cannot hold the cohort of shapes {short}")
    return scales


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
    from wise_core.config import WiseConfig, huginn_wise_config
    if config.architecture == "huginn":
        return huginn_wise_config(num_steps, **settings)
    return WiseConfig(**settings)


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


# -- roofline arithmetic ------------------------------------------------------------------------------------
def cohort_pages(context: int, batch: int, new_tokens: int, page_size: int) -> int:
    """Pages the cohort holds at its end: every request at context + new_tokens keys."""
    return batch * -(-(context + new_tokens) // page_size)


# What a decode step reads of each architecture's weights, by HF tensor-name prefix: once per loop
# (Ouro) or core iteration (Huginn), and once per step; and the embedding (the tied head).
STEP_WEIGHTS = {
    "ouro": dict(per_depth=("model.layers.", "model.norm.", "model.early_exit_gate."), once=(),
                 embedding="model.embed_tokens.weight"),
    "huginn": dict(per_depth=("transformer.core_block.", "transformer.adapter."),
                   once=("transformer.prelude.", "transformer.coda.", "transformer.ln_f."),
                   embedding="transformer.wte.weight"),
}


def weight_bytes_per_step(config, dtype: str, batch: int, num_steps: int | None = None) -> int:
    """Weight bytes one decode step of `num_steps` depths (None: the config's total_ut_steps)
    reads (HF checkpoint shapes, `STEP_WEIGHTS`): Ouro's layers, final norm and exit gate once per
    loop; Huginn's prelude, coda and ln_f once, its core block and adapter once per core
    iteration; the LM head once; the batch's embedding rows."""
    from wise_core.checkpoint import expected_shapes
    shapes, parts = expected_shapes(config), STEP_WEIGHTS[config.architecture]
    steps = config.num_loops if num_steps is None else num_steps
    per_depth = sum(math.prod(s) for name, s in shapes.items() if name.startswith(parts["per_depth"]))
    once = sum(math.prod(s) for name, s in shapes.items() if parts["once"] and name.startswith(parts["once"]))
    head = math.prod(shapes[parts["embedding"] if config.tie_word_embeddings else "lm_head.weight"])
    return (steps * per_depth + once + head + batch * config.hidden_size) * DTYPE_BYTES[dtype]


def kv_bytes_per_step(config, dtype: str, batch: int, context: float, density: dict | None,
                      num_steps: int | None = None) -> float:
    """K and V bytes one decode step of `num_steps` depths (None: total_ut_steps) reads at
    `context` keys per request: every plane (Ouro: one per (loop, layer); Huginn: `num_planes`,
    the prelude's and coda's, dense, and one per (core iteration, core layer)), reuse depths'
    planes at their support density (density: {depth: fraction} or None = dense)."""
    steps = config.num_loops if num_steps is None else num_steps
    per_token = 2 * config.num_key_value_heads * config.head_dim * DTYPE_BYTES[dtype]
    depth_planes = sum((density or {}).get(depth, 1.0) for depth in range(steps)) * config.loop_layers
    if config.architecture == "huginn":
        from wise_core.huginn_reference import num_planes
        depth_planes += num_planes(config, steps) - steps * config.loop_layers   # the prelude's and coda's
    return depth_planes * batch * context * per_token


def roofline(config, dtype: str, context: int, batch: int, new_tokens: int, density: dict | None,
             hbm_tbps: float, num_steps: int | None = None) -> dict:
    """Bandwidth roofline of one decode step of the cohort (`num_steps` depths, None: the config's
    total_ut_steps): ms/step and tok/s."""
    mean_context = context + new_tokens / 2
    total = (weight_bytes_per_step(config, dtype, batch, num_steps)
             + kv_bytes_per_step(config, dtype, batch, mean_context, density, num_steps))
    seconds = total / (hbm_tbps * 1e12)
    return dict(bytes=total, ms_per_step=1e3 * seconds, tokens_per_s=batch / seconds)


# -- the step loop ------------------------------------------------------------------------------------------
def run_cohort(llm, prompts: list[list[int]], params, max_tokens: int, clock=time.perf_counter) -> dict:
    """Add the cohort, step until every request finished; time the steps after the one in which
    the whole cohort has its first token. Checks every request ends with exactly max_tokens;
    returns the requests' tokens too."""
    start = clock()
    ids = [llm.add_request(p, params) for p in prompts]
    lengths = dict.fromkeys(ids, 0)
    tokens_of = dict.fromkeys(ids)
    started = None
    tokens_at_start = steps = 0
    end = start
    while llm.has_unfinished():
        outputs = llm.step()
        end = clock()
        for out in outputs:
            if out.request_id in lengths:
                lengths[out.request_id] = len(out.token_ids)
                tokens_of[out.request_id] = list(out.token_ids)
        if started is not None:
            steps += 1
        elif all(lengths.values()):
            started, tokens_at_start = end, sum(lengths.values())
    wrong = {rid: n for rid, n in lengths.items() if n != max_tokens}
    if wrong:
        raise RuntimeError(f"requests ended with token counts {wrong}, expected {max_tokens} each (ignore_eos)")
    if started is None or steps == 0:
        raise RuntimeError("no decode step ran after the whole cohort had its first token")
    decode_s = end - started
    tokens = sum(lengths.values()) - tokens_at_start
    return dict(prefill_s=started - start, decode_s=decode_s, decode_tokens=tokens, decode_steps=steps,
                decode_tokens_per_s=tokens / decode_s, ms_per_step=1e3 * decode_s / steps,
                tokens=[tokens_of[rid] for rid in ids])


def stats_dict(stats) -> dict:
    """LLM.stats() as a JSON-able dict."""
    if dataclasses.is_dataclass(stats):
        raw = dataclasses.asdict(stats)
    elif isinstance(stats, dict):
        raw = dict(stats)
    else:
        raw = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return json.loads(json.dumps(raw, default=str))


# -- random weights ---------------------------------------------------------------------------------------------
def query_rows(config, name: str) -> int:
    """The leading rows (axis 0) of HF tensor `name` that --q-scale multiplies, so that every
    query is q_scale times its unscaled value: all of Ouro's self_attn.q_proj.weight
    [heads * head_dim, hidden]; of Huginn's attn.Wqkv.weight [3 heads * head_dim, hidden] its first
    heads * head_dim rows (q's; k's and v's rows follow), of attn.qk_bias [2, 1, heads, head_dim]
    row 0 (q's bias; row 1 is k's); 0 for every other tensor."""
    if name.endswith(("self_attn.q_proj.weight", "attn.Wqkv.weight")):
        return config.num_attention_heads * config.head_dim
    return 1 if name.endswith("attn.qk_bias") else 0


def random_recipe(config) -> dict[str, list]:
    """How a worker draws a random model: HF tensor name -> [shape, init, q_rows] (init:
    `wise_core.checkpoint.random_init`; q_rows: `query_rows`). Made by the current tree, so a worker
    running the pre-engine tree draws the same tensors."""
    from wise_core.checkpoint import expected_shapes, random_init
    return {name: [list(shape), random_init(name), query_rows(config, name)]
            for name, shape in expected_shapes(config).items()}


def config_fields(config) -> dict:
    """The config as ModelConfig keyword arguments for a worker; an Ouro config's architecture and
    Huginn fields (at their defaults) left out, which the pre-engine tree's ModelConfig lacks."""
    from wise_core.config import HUGINN_FIELDS
    fields = dataclasses.asdict(config)
    if config.architecture == "ouro":
        for name in ("architecture",) + HUGINN_FIELDS:
            del fields[name]
    return fields


# -- workers (one process per (shape, arm)) ---------------------------------------------------------------------
def _hf_tensor(name: str, shape, init: str, q_rows: int, spec: dict, device):
    """The random HF tensor `name` (`random_recipe`): ones, zeros, or normal(0, std) from a
    generator seeded by crc32(name) + seed (so the fused and the pre-engine layouts hold the same
    values), its first q_rows rows multiplied by q_scale. float32."""
    import zlib
    import torch
    if init != "normal":
        return (torch.ones if init == "ones" else torch.zeros)(shape, device=device)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) + spec["seed"])
    t = torch.empty(shape, device=device).normal_(0.0, spec["std"], generator=g)
    t[:q_rows] *= spec["q_scale"]
    return t


def random_model(spec: dict, config):
    """Random weights drawn on the device (seconds, where writing and reading a 1.4B-parameter
    checkpoint per process takes minutes) as spec["tensors"] (`random_recipe`; made here when
    absent), for the engine's fused layout or the pre-engine one; a Huginn model through
    `wise_torch.from_tensors`."""
    import torch
    import wise_torch
    dtype, device = getattr(torch, spec["dtype"]), torch.device(spec["device"])
    recipe = spec.get("tensors") or random_recipe(config)
    weights = {n: _hf_tensor(n, shape, init, q_rows, spec, device).to(dtype)
               for n, (shape, init, q_rows) in recipe.items()}
    if getattr(config, "architecture", "ouro") == "huginn":   # the pre-engine ModelConfig has no architecture
        return wise_torch.from_tensors(config, weights, dtype=dtype, device=device)
    with torch.device("meta"):
        model = wise_torch.OuroForCausalLM(config)
    fuse = getattr(wise_torch.model, "fused_state_dict", None)  # the pre-engine layout has no fused projections
    weights = fuse(weights) if fuse is not None else weights
    model.load_state_dict(weights, strict=True, assign=True)
    if hasattr(model, "build_rope_table"):
        model.build_rope_table()
    return model.requires_grad_(False).eval()


def _load_model(spec: dict):
    """The model of the spec: a checkpoint (the queries scaled in the HF tensors, `query_rows`) or
    random weights."""
    import torch
    import wise_torch
    from wise_core.checkpoint import load_checkpoint
    from wise_core.config import ModelConfig
    if spec.get("random"):
        return random_model(spec, ModelConfig(**spec["random"]))
    checkpoint = load_checkpoint(spec["checkpoint"])
    tensors = dict(checkpoint.tensors)
    if spec["q_scale"] != 1.0:
        for name, tensor in tensors.items():
            rows = query_rows(checkpoint.config, name)
            if rows:
                tensors[name] = tensor.copy()
                tensors[name][:rows] *= spec["q_scale"]
    return wise_torch.from_tensors(checkpoint.config, tensors, tokenizer=checkpoint.tokenizer,
                                   dtype=getattr(torch, spec["dtype"]), device=spec["device"])


def _prompts(spec: dict, vocab_size: int) -> list[list[int]]:
    import torch
    context, batch = spec["context"], spec["batch"]
    g = torch.Generator().manual_seed(context * 1000 + batch)
    return torch.randint(0, vocab_size, (batch, context), generator=g).tolist()


def _reset_counters(llm) -> bool:
    """Zero the engine's counters, which LLM.stats() reports since the engine started, so a
    cohort's stats are its own: `LLM.reset_stats` (WISE density and fallbacks on every
    tensor-parallel rank, the mean decode depth, the step counters), or, on an engine without it,
    the WISE counters alone; False where the engine has neither hook."""
    if hasattr(llm, "reset_stats"):
        llm.reset_stats()
        return True
    runner = getattr(llm, "runner", None)
    wise = getattr(runner, "wise", None)
    if wise is None or not hasattr(wise, "reset_counters"):
        return False
    (runner.reset_wise_counters if hasattr(runner, "reset_wise_counters") else wise.reset_counters)()
    return True


def _engine_worker(spec: dict) -> dict:
    arm = spec["arm"]
    if arm in FA4_ARMS:
        try:
            import flash_attn.cute  # noqa: F401
        except Exception as e:  # not installed, or installed without its CUDA parts
            return dict(status=f"not importable: {type(e).__name__}: {e}"[:300])
    import torch
    import wise_torch
    model = _load_model(spec)
    config, num_steps = model.config, spec.get("num_steps")   # None: the model's total_ut_steps
    steps = config.total_ut_steps if num_steps is None else num_steps
    speculating = speculative_arms.is_spec(arm)
    prompts = _prompts(spec, config.vocab_size)
    if arm.endswith("-default"):
        llm = wise_torch.LLM(model, num_steps=num_steps,
                             wise_config=wise_config_of(config, steps) if arm == "wise-default" else None)
    else:
        if speculating:
            configs = speculative_arms.engine_kwargs(arm, spec)
        else:
            configs = dict(wise_config=wise_config_of(config, steps, eta=spec["eta"], kernel=spec["kernel"])
                           if arm in ("wise", "wise-fa4", "wise-adaptive") else None)
        cuda_graphs = CUDA_GRAPHS[spec["cuda_graphs"]]
        if arm in ADAPTIVE_ARMS:
            from wise_core.config import AdaptiveDepth
            configs["adaptive_depth"] = AdaptiveDepth(threshold=spec["adaptive_threshold"])
        if arm == "adaptive-regroup":   # gathers rows (dynamic shapes): eager
            configs["adaptive_regroup"], cuda_graphs = True, False
        if arm in FA4_ARMS:
            configs.update(prefill_attention="fa4", dense_decode="fa4",
                           **({"wise_decode": "fa4-union"} if arm == "wise-fa4" else {}))
        kernel = spec["kernel"]
        extra = {"max_num_batched_tokens": spec["max_num_batched_tokens"]} if spec["max_num_batched_tokens"] else {}
        if spec.get("tensor_parallel_size", 1) > 1:   # benchmarks/engine/tp_scaling.py
            extra["tensor_parallel_size"] = spec["tensor_parallel_size"]
        llm = wise_torch.LLM(model, **configs, num_steps=num_steps, num_pages=spec["num_pages"],
                             page_size=spec["page_size"], max_num_seqs=spec["batch"],
                             cuda_graphs=cuda_graphs, kernel=kernel,
                             max_model_len=spec["context"] + max(spec["new_tokens"], spec["warmup_tokens"]), **extra)
    del model   # under tensor parallelism the engine holds rank 0's shard, not the whole model

    def cohort(tokens: int) -> dict:
        params = wise_torch.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        reset = _reset_counters(llm)
        before = speculative_arms.counters(llm.stats()) if speculating else None
        result = run_cohort(llm, prompts, params, tokens)
        if speculating:
            result.update(speculative_arms.cohort_fields(before, speculative_arms.counters(llm.stats())))
        stats = stats_dict(llm.stats())
        result.update(stats=stats, density=stats.get("density"), fallbacks=stats.get("fallbacks"),
                      counters="this cohort" if reset else "since the engine started",
                      preemptions=stats.get("preemptions"),
                      mean_depth=stats.get("mean_decode_depth") if arm in ADAPTIVE_ARMS else None,
                      pages_returned=stats.get("free_pages") == stats.get("total_pages"))
        return result

    with torch.inference_mode():
        cohort(spec["warmup_tokens"])
        repeats = [cohort(spec["new_tokens"]) for _ in range(spec["repeats"])]
    if hasattr(llm, "close"):
        llm.close()
    return dict(status="ok", repeats=repeats)


def _old_worker(spec: dict) -> dict:
    """The pre-engine generate, imported from the old source tree (first on the path: PYTHONPATH)."""
    import torch
    import wise_torch
    from wise_core.config import WiseConfig
    model = _load_model(spec)
    prompts = _prompts(spec, model.config.vocab_size)
    wise_config = WiseConfig(eta=spec["eta"], kernel=spec["kernel"]) if spec["arm"] == "old-wise" else None

    def run(tokens: int):
        return wise_torch.generate(model, prompts, max_new_tokens=tokens, eos_token_id=None, wise_config=wise_config,
                                   page_size=spec["page_size"], kernel=spec["kernel"])

    with torch.inference_mode():
        run(spec["warmup_tokens"])
        repeats = []
        for _ in range(spec["repeats"]):
            stats = run(spec["new_tokens"]).stats
            steps = spec["new_tokens"] - 1
            repeats.append(dict(prefill_s=stats.prefill_s, decode_s=stats.decode_s,
                                decode_tokens=stats.new_tokens - len(prompts), decode_steps=steps,
                                decode_tokens_per_s=stats.decode_tokens_per_s, ms_per_step=1e3 * stats.decode_s / steps,
                                density=stats.density, fallbacks=stats.fallbacks, preemptions=None,
                                pages_returned=None))
    return dict(status="ok", repeats=repeats)


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        result = (_old_worker if spec["arm"].startswith("old") else _engine_worker)(spec)
        if result["status"] == "ok":
            result["environment"] = rp.environment("torch")
    except Exception as e:  # reported in the row; the other arms go on
        traceback.print_exc()
        result = dict(status=f"error: {type(e).__name__}: {e}"[:800])
    Path(spec["result"]).write_text(json.dumps(result, default=str))


def run_worker(spec: dict, timeout: float, workdir: Path) -> dict:
    """Run one (shape, arm) in a fresh process; its result, or a row saying why there is none."""
    name = f"{spec['context']}x{spec['batch']}-{spec['arm']}"
    spec = dict(spec, result=str(workdir / f"{name}.result.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = rp.module_env(spec.get("old_src"), PYTHONUNBUFFERED="1")  # an old tree first on the path
    try:
        done = subprocess.run(rp.module_command("engine.throughput", "--worker", str(spec_path)),
                              cwd=workdir if spec.get("old_src") else None,
                              env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(status=f"error: timed out after {timeout:.0f} s")
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not Path(spec["result"]).exists():
        return dict(status=f"error: worker exited {done.returncode}: {log[-600:]}")
    result = json.loads(Path(spec["result"]).read_text())
    if result["status"] != "ok" and log:
        result["log_tail"] = log[-1500:]
    return result


# -- the run ----------------------------------------------------------------------------------------------------
def prepare_model(args) -> tuple:
    """(config, checkpoint or None, the config's fields for a worker or None): --model as given, or
    random --preset weights that each worker draws on its device (`random_model`)."""
    from wise_core.checkpoint import load_checkpoint
    from wise_core.config import PRESETS
    if args.model:  # a directory as an absolute path: an old arm's worker runs in another folder
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        return load_checkpoint(model).config, model, None
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown --preset {args.preset!r}; one of {sorted(PRESETS)}")
    config = PRESETS[args.preset]
    if args.layers and config.architecture == "huginn":
        raise SystemExit("--layers overrides an Ouro preset's shared layers; a Huginn model has a prelude, a "
                         "core block and a coda")
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    return config, None, config_fields(config)


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


def row_of(spec: dict, result: dict, repeat: int | None, config, args) -> dict:
    row = dict(context=spec["context"], batch=spec["batch"], q_scale=spec["q_scale"], arm=spec["arm"],
               repeat=repeat, status=result["status"])
    if repeat is None:
        return row
    r = result["repeats"][repeat]
    density = {int(k): v for k, v in (r.get("density") or {}).items() if v is not None} or None
    # A speculative arm's roofline is dense decode's (its output is), whatever its draft reads.
    roof = roofline(config, args.dtype, spec["context"], spec["batch"], args.new_tokens,
                    None if speculative_arms.is_spec(spec["arm"]) else density, args.hbm_tbps, spec.get("num_steps"))
    row.update({k: r.get(k) for k in ("decode_tokens_per_s", "ms_per_step", "prefill_s", "decode_tokens",
                                      "decode_steps", "fallbacks", "preemptions", "pages_returned", "counters",
                                      "acceptance_rate", "tokens_per_round", "tokens", "mean_depth")})
    row.update(density=density, roofline_tokens_per_s=roof["tokens_per_s"], roofline_ms_per_step=roof["ms_per_step"],
               roofline_share=r["decode_tokens_per_s"] / roof["tokens_per_s"])
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over repeats per (shape, arm), with WISE / dense, and per engine arm the requests whose
    greedy tokens (first repeat) differ from the dense arm's."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["repeat"] is not None:
            groups.setdefault((r["context"], r["batch"], r["arm"]), []).append(r)
    out = []
    for (context, batch, arm), rs in groups.items():
        mean = sum(r["decode_tokens_per_s"] for r in rs) / len(rs)
        spec = [r for r in rs if r.get("acceptance_rate") is not None]
        out.append(dict(context=context, batch=batch, arm=arm, decode_tokens_per_s=mean,
                        ms_per_step=sum(r["ms_per_step"] for r in rs) / len(rs),
                        roofline_tokens_per_s=rs[-1]["roofline_tokens_per_s"],
                        roofline_share=mean / rs[-1]["roofline_tokens_per_s"], density=rs[-1]["density"],
                        acceptance_rate=sum(r["acceptance_rate"] for r in spec) / len(spec) if spec else None,
                        tokens_per_round=sum(r["tokens_per_round"] for r in spec) / len(spec) if spec else None,
                        mean_depth=mean_depth(rs)))
    by_key = {(s["context"], s["batch"], s["arm"]): s for s in out}
    tokens = {key: rs[0].get("tokens") for key, rs in groups.items()}
    for s in out:
        dense = by_key.get((s["context"], s["batch"], base_of(s["arm"])))
        s["over_dense"] = s["decode_tokens_per_s"] / dense["decode_tokens_per_s"] if dense else None
        fixed = by_key.get((s["context"], s["batch"], ADAPTIVE_ARMS.get(s["arm"])))
        s["over_fixed"] = s["decode_tokens_per_s"] / fixed["decode_tokens_per_s"] if fixed else None
        mine, reference = (tokens.get((s["context"], s["batch"], arm)) for arm in (s["arm"], "dense"))
        set_acceptance = (speculative_arms.method_and_rate(s["arm"]) or (None, None))[1] is not None
        s["differ"] = None if mine is None or reference is None or set_acceptance else \
            speculative_arms.compare_tokens(reference, mine)["differ"]
    return out


def mean_depth(rows: list[dict]) -> float | None:
    """The mean over repeats of rows' mean decode depth (None where a row has none: not an adaptive arm)."""
    depths = [r.get("mean_depth") for r in rows]
    return None if not depths or None in depths else sum(depths) / len(depths)


def standing(summary: list[dict], architecture: str = "ouro") -> list[dict]:
    """The issue's targets, measured where the run has the numbers: the engine's and the
    speculative arms' (Ouro-1.4B's targets: none for a Huginn run)."""
    if architecture != "ouro":
        return []
    return engine_standing(summary) + speculative_arms.standing(summary)


def engine_standing(summary: list[dict], architecture: str = "ouro") -> list[dict]:
    """The decode targets of a summary's dense and wise arms, tight and default (one definition for
    the torch and JAX benchmarks): dense share of the roofline, the batch-1 step at 1K, WISE /
    dense at the batched shapes (WISE_TARGETS is keyed by context) and at batch 1 (>= 1), and
    each default arm's tok/s within DEFAULTS_WITHIN of its tight arm's. These are the issue's
    targets for Ouro-1.4B; a Huginn run (`architecture`) is held to none."""
    if architecture != "ouro":
        return []
    out = []
    by_key = {(s["context"], s["batch"], s["arm"]): s for s in summary}
    for s in summary:
        shape = f"{s['context']}x{s['batch']}"
        arm = s["arm"]
        if arm in ("dense", "dense-default"):
            share = DENSE_SHARE_TARGETS.get(s["context"], min(DENSE_SHARE_TARGETS.values()))
            if s["batch"] > 1:
                out.append(dict(target=f"{arm} >= {share:.0%} of the roofline", shape=shape,
                                value=s["roofline_share"], met=s["roofline_share"] >= share))
            if s["batch"] == 1 and s["context"] == 1024:
                out.append(dict(target=f"{arm}: batch 1 at 1K <= {BATCH1_STEP_MS} ms/step", shape=shape,
                                value=s["ms_per_step"], met=s["ms_per_step"] <= BATCH1_STEP_MS))
        if arm in ("wise", "wise-default") and s["over_dense"] is not None:
            bound = WISE_TARGETS.get(s["context"], 1.0) if s["batch"] > 1 else 1.0
            out.append(dict(target=f"{arm} / {base_of(arm)} >= {bound:.2f}", shape=shape, value=s["over_dense"],
                            met=s["over_dense"] >= bound))
        tight = by_key.get((s["context"], s["batch"], arm.removesuffix("-default")))
        if arm.endswith("-default") and tight is not None:
            ratio = s["decode_tokens_per_s"] / tight["decode_tokens_per_s"]
            out.append(dict(target=f"{arm} >= {DEFAULTS_WITHIN:.2f} x {tight['arm']}", shape=shape, value=ratio,
                            met=ratio >= DEFAULTS_WITHIN))
    return out


def density_text(density) -> str:
    """A density per reuse depth as '2: 0.287, 3: 0.287'; over more than four depths (Huginn's
    reuse iterations) their mean and range, '2..31: mean 0.201 (0.150 at 31 .. 0.260 at 2)'."""
    items = sorted((density or {}).items())
    if len(items) <= 4:
        return ", ".join(f"{d}: {x:.3f}" for d, x in items)
    low, high = min(items, key=lambda i: i[1]), max(items, key=lambda i: i[1])
    return (f"{items[0][0]}..{items[-1][0]}: mean {sum(x for _, x in items) / len(items):.3f} "
            f"({low[1]:.3f} at {low[0]} .. {high[1]:.3f} at {high[0]})")


def is_huginn(report: dict) -> bool:
    return (report.get("config") or {}).get("architecture") == "huginn"


def run_text(report: dict) -> str:
    """'; DEPTH per token; WISE profile: ...; adaptive depth: ...' of a report's header (each part
    where the report has it)."""
    steps, profile, adaptive = report.get("num_steps"), report.get("wise_profile"), report.get("adaptive_depth")
    parts = ([f"{steps} {'core iterations' if is_huginn(report) else 'loops'} per token"] if steps else []) \
        + ([f"WISE profile: {profile}"] if profile else []) + ([adaptive] if adaptive else [])
    return "".join(f"; {part}" for part in parts)


def targets_section(report: dict) -> list[str]:
    """The report's "Targets" section: the standing, or why a Huginn run has none."""
    lines = ["", "## Targets", ""]
    if is_huginn(report):
        return lines + ["The issue's targets are Ouro-1.4B's; this Huginn run is held to none (the figures above "
                        "are its result)."]
    lines += ["| target | shape | measured | met |", "|---|---|---|---|"]
    for t in report["standing"]:
        lines.append(f"| {t['target']} | {t['shape']} | {t['value']:.2f} | {'yes' if t['met'] else 'no'} |")
    return lines


def table(rows: list[dict]) -> list[str]:
    lines = ["| ctx x batch | q-scale | arm | repeat | decode tok/s | ms/step | roofline tok/s | share | "
             "density | prefill s | fallbacks | preemptions | mean depth |", "|" + "---|" * 13]
    for r in rows:
        head = f"| {r['context']} x {r['batch']} | {r['q_scale']:g} | {r['arm']} |"
        if r["repeat"] is None:
            lines.append(f"{head} | {r['status']} |" + " |" * 8)
            continue
        lines.append(f"{head} {r['repeat'] + 1} | {r['decode_tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                     f"{r['roofline_tokens_per_s']:.0f} | {r['roofline_share']:.0%} | {density_text(r['density'])} | "
                     f"{rp.fmt(r['prefill_s'], '.2f')} | {rp.fmt(r['fallbacks'], 'd')} | {rp.fmt(r['preemptions'], 'd')} | "
                     f"{rp.fmt(r.get('mean_depth'), '.2f')} |")
    return lines


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    a = report["args"]
    lines = [f"# Decode throughput ({report['date']})", "",
             f"{env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}; "
             f"model {report['model']}; {a['dtype']}; kernel {a['kernel']}; {a['new_tokens']} new tokens per request, "
             f"{a['repeats']} repeats after a {a['warmup_tokens']}-token warm-up; page size {a['page_size']}; "
             f"roofline at {a['hbm_tbps']} TB/s{run_text(report)}.", "", "## Every run", ""]
    lines += table(report["rows"])
    flagged = [f"{r['context']} x {r['batch']} {r['arm']} repeat {r['repeat'] + 1}: "
               + ", ".join(([f"{r['fallbacks']} fallbacks"] if r.get("fallbacks") else [])
                           + (["pages not all returned to the pool"] if r.get("pages_returned") is False else []))
               for r in report["rows"] if r["repeat"] is not None
               and (r.get("fallbacks") or r.get("pages_returned") is False)]
    if flagged:
        lines += ["", "Flagged: " + "; ".join(flagged) + "."]
    lines += ["", "## Mean over repeats", "",
              "over dense: decode tok/s over the engine dense arm's (old-wise: over old's). differ: requests "
              "whose greedy tokens differ from the dense arm's. Speculative arms: ms/step is per round, "
              "acceptance the drafts accepted, tok/round the tokens a request commits per round; "
              "spec-METHOD@P arms accept each draft with probability P (timing only: their tokens are not "
              "the model's, differ not counted). Adaptive arms: mean depth the core iterations a decoded token "
              "ran, over fixed their tok/s over the fixed-depth arm's (adaptive, adaptive-regroup: dense; "
              "wise-adaptive: wise); exited rows ride along, so every iteration still runs (adaptive-regroup: "
              "only the rows still running run the later iterations, eager, so on a GPU not comparable with "
              "graph-captured arms), and their tokens are the exits' (differ counts them; not an error).", "",
              "| ctx x batch | arm | decode tok/s | ms/step | share of roofline | over dense | density | differ | "
              "acceptance | tok/round | mean depth | over fixed |", "|" + "---|" * 12]
    for s in report["summary"]:
        lines.append(f"| {s['context']} x {s['batch']} | {s['arm']} | {s['decode_tokens_per_s']:.1f} | "
                     f"{s['ms_per_step']:.2f} | {s['roofline_share']:.0%} | {rp.fmt(s['over_dense'], '.2f')} | "
                     f"{density_text(s['density'])} | {rp.fmt(s.get('differ'), 'd')} | "
                     f"{rp.fmt(s.get('acceptance_rate'), '.3f')} | {rp.fmt(s.get('tokens_per_round'), '.2f')} | "
                     f"{rp.fmt(s.get('mean_depth'), '.2f')} | {rp.fmt(s.get('over_fixed'), '.2f')} |")
    return "\n".join(lines + targets_section(report)) + "\n"


def plot(report: dict, path: Path) -> None:
    """tok/s per arm, one panel per shape, each arm's roofline as a dash over its bar."""
    plt = rp.pyplot()
    shapes = sorted({(s["context"], s["batch"]) for s in report["summary"]})
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), squeeze=False)
    for ax, (context, batch) in zip(axes[0], shapes):
        here = [s for s in report["summary"] if (s["context"], s["batch"]) == (context, batch)]
        xs = range(len(here))
        ax.bar(xs, [s["decode_tokens_per_s"] for s in here], color="tab:blue")
        for x, s in zip(xs, here):
            ax.hlines(s["roofline_tokens_per_s"], x - 0.4, x + 0.4, colors="tab:red", linestyles="dashed")
            ax.text(x, s["decode_tokens_per_s"], f"{s['roofline_share']:.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [s["arm"] for s in here])
        ax.set_title(f"{context} x {batch}")
        ax.set_ylabel("decode tok/s")
    fig.suptitle("decode tok/s (bars; % of roofline) and bandwidth roofline (dashes)")
    fig.tight_layout()
    rp.save_png(fig, path)


def write_report(report: dict, out: Path) -> str:
    """throughput.json, .md and .png in out; the markdown."""
    return rp.write_report(out, "throughput", report, markdown(report), lambda path: plot(report, path))


def main(argv: list[str] | None = None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    scales = check_args(parser, args)
    workdir = Path(tempfile.mkdtemp(prefix="wise-throughput-"))
    try:
        config, checkpoint, fields = prepare_model(args)
        steps = check_depth(parser, args, config, [a for a in args.arms if a.startswith("old")]
                            + speculative_arms.arms_of(args), [a for a in args.arms if a in ADAPTIVE_ARMS])
        threshold = adaptive_threshold(args)
        old_src = prepare_old_src(args, workdir) if any(a.startswith("old") for a in args.arms) else None
        report = dict(date=rp.now(), host=platform.node(),
                      model=args.model or f"random {args.preset} (std {args.std}, seed 0)",
                      config=dataclasses.asdict(config), num_steps=steps,
                      wise_profile=wise_profile(config, steps, args.arms, args.eta),
                      adaptive_depth=adaptive_text(args.arms, threshold), old_src=old_src,
                      args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                      environment=None, rows=[])
        tensors = random_recipe(config) if fields is not None else None
        print(f"{'ctx x batch':>13} {'arm':>9} {'rep':>3} {'tok/s':>9} {'ms/step':>8} {'roof tok/s':>10} "
              f"{'share':>6} density", flush=True)
        for (context, batch), q_scale in zip(args.shapes, scales):
            num_pages = args.num_pages or cohort_pages(context, batch, args.new_tokens, args.page_size) + 1
            for arm in args.arms + speculative_arms.arms_of(args):
                spec = dict(arm=arm, context=context, batch=batch, q_scale=q_scale, checkpoint=checkpoint,
                            random=fields, tensors=tensors, num_steps=steps, std=args.std, seed=0,
                            dtype=args.dtype, device=args.device, kernel=args.kernel, eta=args.eta,
                            adaptive_threshold=threshold,
                            page_size=args.page_size, num_pages=num_pages, cuda_graphs=args.cuda_graphs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens, repeats=args.repeats,
                            num_draft=args.num_draft, draft_loops=args.draft_loops,
                            adaptive_draft=args.adaptive_draft, old_src=old_src if arm.startswith("old") else None)
                if arm.startswith("old") and old_src is None:
                    result = dict(status=f"error: no old source tree (--old-src, or git history with {args.old_commit})")
                else:
                    result = run_worker(spec, args.child_timeout, workdir)
                report["environment"] = report["environment"] or result.get("environment")
                if result["status"] != "ok":
                    report["rows"].append(dict(row_of(spec, result, None, config, args),
                                               log_tail=result.get("log_tail")))
                    print(f"{context:>6} x {batch:<4} {arm:>9}   {result['status'][:200]}", flush=True)
                for i in range(len(result.get("repeats", ()))):
                    row = row_of(spec, result, i, config, args)
                    report["rows"].append(row)
                    print(f"{context:>6} x {batch:<4} {arm:>9} {i + 1:>3} {row['decode_tokens_per_s']:>9.1f} "
                          f"{row['ms_per_step']:>8.2f} {row['roofline_tokens_per_s']:>10.0f} "
                          f"{row['roofline_share']:>6.0%} {density_text(row['density'])}"
                          + (f" mean depth {row['mean_depth']:.2f}" if row.get("mean_depth") is not None else "")
                          + (f" acceptance {row['acceptance_rate']:.3f}, {row['tokens_per_round']:.2f} tok/round"
                             if row.get("acceptance_rate") is not None else ""), flush=True)
                report["summary"] = summarize(report["rows"])
                report["standing"] = standing(report["summary"], config.architecture)
                write_report(report, args.out)  # after every arm: a run cut short still leaves a report
        print(markdown(report))
        return report
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
