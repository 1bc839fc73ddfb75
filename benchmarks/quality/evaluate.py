"""WISE against dense decode: quality on held-out text, and F1/EM on question answering.

    python -m benchmarks.quality.evaluate text [--model NAME_OR_DIR] [--n-contexts 200] [--etas 0.9 0.95 0.99]
    python -m benchmarks.quality.evaluate qa --model DIR --data file.jsonl [--etas 0.95] [--limit N]
    python -m benchmarks.quality.evaluate text --smoke --out /tmp/q     # a few tiny contexts, for a check

`text` (the default): contexts of `--min-context`..`--max-context` tokens cut at seeded offsets
from the held-out stdlib files (`stdlib_corpus`; encoded with the model's tokenizer), each
followed by a `--continuation` of held-out text. Per eta it reports
- greedy agreement: WISE's and dense decode's greedy tokens (`--greedy` each, eos ignored) from
  the same context; the common prefix as a fraction of `--greedy`, and the rate of full matches;
- NLL difference: per context, the mean NLL (nats/token) of the teacher-forced continuation
  under WISE minus under dense decode, with a paired bootstrap 95% interval over contexts;
- density: the reused-union support density per reuse depth over all WISE decode steps (forced
  and greedy; jax: the selected over the causal blocks of every step, `wise_jax.evaluation`;
  torch: per-call densities weighted by their tokens), and the dense fallbacks.
Each setting is a `wise_core.evaluation.Arm`; with `--backend jax` it is decoded by
`wise_jax.evaluation.evaluate` (the functional model's `score` and `greedy`), with torch by the
engine's teacher_force and generate.
`qa`: greedy answers (`--max-new-tokens`, stopping at eos; the first line is the answer) to the
prompts of `qa_scoring.PROMPT_TEMPLATE`, scored by EM and token F1 for dense decode and WISE,
with the paired bootstrap interval of the F1 difference.

Writes JSON, markdown and (text) a plot of density and NLL difference against eta into `--out`.
Backend: wise_torch (default; attention_backend from `--kernel`, "auto" = Triton on GPU, reference on CPU)
or wise_jax (`--backend jax`); both give the same table. On 2 CPU cores a model of the built-in
size takes ~3 s per context and setting (dense or one eta): the default text run ~40 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.quality import qa_scoring, stdlib_corpus
from benchmarks import report as rp
from wise_core.checkpoint import DEFAULT_MODEL
from wise_core.evaluation import Arm, interval, paired_bootstrap
from wise_core.wise_config import WiseConfig


# -- backends ---------------------------------------------------------------------------------
class Backend:
    """A loaded model behind one interface: `forced` (teacher forcing) and `greedy` decoding,
    dense when wise_config is None, every arm's attention by `kernel` (the engines'
    attention_backend; jax's functional evaluation: its decode kernel). Both return
    (per-sequence results, stats dict)."""

    def __init__(self, name: str, model: str, dtype: str, kernel: str = "auto"):
        self.name, self.kernel = name, kernel
        if name == "torch":
            import torch
            import wise_torch
            self.lib = wise_torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
            self.model = wise_torch.load_model(model, dtype=getattr(torch, dtype), device=device)
            self.config, self.tokenizer = self.model.config, self.model.tokenizer
            self.device = f"{device} ({torch.cuda.get_device_name() if device == 'cuda' else platform.processor()})"
        elif name == "jax":
            import jax
            import jax.numpy as jnp
            import wise_jax
            self.lib = wise_jax
            gpu = jax.default_backend() == "gpu"
            dtype = dtype if dtype != "auto" else ("bfloat16" if gpu else "float32")
            self.config, self.params = wise_jax.load_model(model, dtype=getattr(jnp, dtype))
            self.tokenizer = wise_jax.load_tokenizer(model)
            self.device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
        else:
            raise ValueError(f"unknown backend {name!r} (torch or jax)")
        self.dtype = dtype

    def _args(self):
        return (self.model,) if self.name == "torch" else (self.params, self.config)

    @staticmethod
    def _stats(stats) -> dict:
        return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)

    def forced(self, contexts, continuations, wise_config):
        out = self.lib.teacher_force(*self._args(), contexts, continuations, wise_config=wise_config,
                                     attention_backend=self.kernel)
        return [np.asarray(lp, np.float64) for lp in out.logprobs], self._stats(out.stats)

    def arm(self, contexts, continuations, wise_config, *, greedy: int, batch: int, dense: Arm | None, seed: int,
            progress) -> Arm:
        """One setting on the pairs -> `wise_core.evaluation.Arm`: jax by `wise_jax.evaluation.evaluate`
        (the functional model; density pooled from the block counts), torch by the engine's
        teacher_force and generate (density: the calls' densities weighted by their tokens)."""
        if self.name == "jax":
            from wise_jax import evaluation
            out = evaluation.evaluate(self.params, self.config, wise_config, contexts, continuations,
                                      greedy_tokens=greedy, dense=dense, tokenizer=self.tokenizer, batch=batch,
                                      seed=seed, kernel=self.kernel)
            progress(len(contexts))
            return out
        logprobs, tokens, meter = [], [], DensityMeter()
        for sl in _batches(len(contexts), batch):
            forced, stats = self.forced(contexts[sl], continuations[sl], wise_config)
            meter.add(stats)
            chosen, stats = self.greedy(contexts[sl], greedy, wise_config, stop_at_eos=False)
            meter.add(stats)
            logprobs += forced
            tokens += chosen
            progress(sl.stop - sl.start)
        pooled = meter.result()
        return Arm(wise_config, logprobs, np.array([len(self.tokenizer.decode(c).encode("utf-8")) for c in continuations]),
                   tokens, None if wise_config is None else {int(d): v for d, v in pooled["density"].items()},
                   None if wise_config is None else pooled["fallbacks"], dense, seed)

    def greedy(self, prompts, max_new_tokens: int, wise_config, *, stop_at_eos: bool):
        kwargs = {} if stop_at_eos else {"eos_token_id": None}
        out = self.lib.generate(*self._args(), prompts, max_new_tokens=max_new_tokens,
                                wise_config=wise_config, attention_backend=self.kernel, **kwargs)
        return out.tokens, self._stats(out.stats)


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class DensityMeter:
    """Density per reuse depth and fallbacks, pooled over calls (densities weighted by tokens)."""

    def __init__(self):
        self.weighted: dict[int, float] = {}
        self.weights: dict[int, float] = {}
        self.fallbacks = 0

    def add(self, stats: dict) -> None:
        if stats.get("density") is None:
            return
        for depth, value in stats["density"].items():
            if value is not None:
                self.weighted[int(depth)] = self.weighted.get(int(depth), 0.0) + value * stats["new_tokens"]
                self.weights[int(depth)] = self.weights.get(int(depth), 0.0) + stats["new_tokens"]
        self.fallbacks += int(stats["fallbacks"] or 0)

    def result(self) -> dict:
        return {"density": {str(d): self.weighted[d] / self.weights[d] for d in sorted(self.weights)},
                "fallbacks": self.fallbacks}


# -- text: WISE vs dense on held-out stdlib source --------------------------------------------
def heldout_contexts(backend: Backend, args) -> list[tuple[list[int], list[int]]]:
    """Seeded (context, continuation) pairs from the held-out stdlib files, in the model's tokens."""
    if backend.tokenizer is None:
        raise SystemExit("the model has no tokenizer; the text run needs one to encode the held-out files")
    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    separator = backend.config.bos_token_id if backend.config.bos_token_id is not None else backend.config.eos_token_id
    stream = stdlib_corpus.token_stream(held, tokenizer=backend.tokenizer, separator=separator)
    return stdlib_corpus.sample_contexts(stream, args.n_contexts, args.min_context, args.max_context,
                                         args.continuation, seed=args.seed)


def run_text(backend: Backend, args) -> dict:
    pairs = heldout_contexts(backend, args)
    contexts, continuations = [p[0] for p in pairs], [p[1] for p in pairs]
    settings = [None] + [WiseConfig(eta=eta) for eta in args.etas]
    arms: dict[str, Arm] = {}
    seconds: dict[str, float] = {}
    with tqdm(total=len(settings) * len(pairs), desc="text", unit="ctx", disable=args.quiet) as bar:
        for wise in settings:
            key = "dense" if wise is None else f"{wise.eta:g}"
            bar.set_postfix(setting=key)
            start = time.perf_counter()
            arms[key] = backend.arm(contexts, continuations, wise, greedy=args.greedy, batch=args.batch,
                                    dense=arms.get("dense"), seed=args.seed, progress=bar.update)
            seconds[key] = time.perf_counter() - start

    dense_nll = arms["dense"].nll
    rows = []
    for eta in args.etas:
        arm = arms[f"{eta:g}"]
        prefix = arm.prefix_agreement
        rows.append({
            "eta": eta,
            "nll_diff": arm.nll_diff,
            "greedy_prefix_agreement": interval(paired_bootstrap(prefix, np.zeros_like(prefix), seed=args.seed)),
            "greedy_full_match": float(np.mean(prefix == 1.0)),
            "density": {str(d): v for d, v in arm.density.items()}, "fallbacks": arm.fallbacks,
            "seconds": round(seconds[f"{eta:g}"], 1),
            "per_context": {"nll": arm.nll.tolist(), "prefix_agreement": prefix.tolist()},
        })
    return {"rows": rows, "dense": {"nll_mean": float(dense_nll.mean()), "per_context_nll": dense_nll.tolist(),
                                    "seconds": round(seconds["dense"], 1)},
            "contexts": {"n": len(pairs), "lengths": [len(c) for c in contexts],
                         "continuation": args.continuation, "greedy": args.greedy}}


def text_markdown(result: dict) -> str:
    depths = sorted({d for row in result["rows"] for d in row["density"]}, key=int)
    head = ("| eta | greedy prefix agreement [95% CI] | full match | NLL WISE - dense, nats/token [95% CI] | "
            + " | ".join(f"density depth {d}" for d in depths) + " | fallbacks |")
    lines = [head, "|" + "---|" * (5 + len(depths))]
    for row in result["rows"]:
        a, n = row["greedy_prefix_agreement"], row["nll_diff"]
        lines.append(f"| {row['eta']:g} | {a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}] | "
                     f"{row['greedy_full_match']:.3f} | {n['mean']:+.5f} [{n['low']:+.5f}, {n['high']:+.5f}] | "
                     + " | ".join(f"{row['density'].get(d, float('nan')):.3f}" for d in depths)
                     + f" | {row['fallbacks']} |")
    c = result["contexts"]
    lines.append("")
    lines.append(f"{c['n']} held-out contexts of {min(c['lengths'])}-{max(c['lengths'])} tokens; "
                 f"{c['continuation']} teacher-forced tokens, {c['greedy']} greedy tokens; "
                 f"dense NLL {result['dense']['nll_mean']:.4f} nats/token.")
    return "\n".join(lines) + "\n"


def text_plot(result: dict, path: Path, title: str) -> None:
    plt = rp.pyplot()
    rows = result["rows"]
    etas = [r["eta"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for depth in sorted({d for r in rows for d in r["density"]}, key=int):
        ax1.plot(etas, [r["density"].get(depth, np.nan) for r in rows], "o-", label=f"reuse depth {depth}")
    ax1.set_xlabel("eta")
    ax1.set_ylabel("support density (selected / causal blocks)")
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend()
    means = np.array([r["nll_diff"]["mean"] for r in rows])
    err = np.array([[m - r["nll_diff"]["low"], r["nll_diff"]["high"] - m] for m, r in zip(means, rows)]).T
    ax2.errorbar(etas, means, yerr=err, fmt="o-", capsize=4)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xlabel("eta")
    ax2.set_ylabel("NLL WISE - dense (nats/token), 95% CI")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    rp.save_png(fig, path)


# -- qa: F1 / EM ------------------------------------------------------------------------------
def run_qa(backend: Backend, args) -> dict:
    examples = qa_scoring.load_jsonl(args.data, args.limit)
    if backend.tokenizer is None:
        raise SystemExit("the model has no tokenizer; QA prompts are text")
    limit = backend.config.max_position_embeddings - args.max_new_tokens
    prompts, kept, skipped = [], [], []
    for i, example in enumerate(examples):
        ids = backend.tokenizer.encode(example.prompt()).ids
        if len(ids) > limit:
            if not args.skip_too_long:
                raise SystemExit(f"example {i}: prompt of {len(ids)} tokens + {args.max_new_tokens} new tokens exceeds "
                                 f"max_position_embeddings {backend.config.max_position_embeddings} "
                                 "(pass --skip-too-long to skip such examples)")
            skipped.append(i)
            continue
        prompts.append(ids)
        kept.append(example)
    if not kept:
        raise SystemExit("every example is too long for the model")
    order = np.argsort([len(p) for p in prompts], kind="stable")  # batch prompts of similar length
    settings = [None] + [WiseConfig(eta=eta) for eta in args.etas]
    answers: dict[str, list[str]] = {}
    meters: dict[str, DensityMeter] = {}
    with tqdm(total=len(settings) * len(kept), desc="qa", unit="ex", disable=args.quiet) as bar:
        for wise in settings:
            key = "dense" if wise is None else f"{wise.eta:g}"
            answers[key], meters[key] = [""] * len(kept), DensityMeter()
            for sl in _batches(len(kept), args.batch):
                rows = order[sl]
                tokens, stats = backend.greedy([prompts[r] for r in rows], args.max_new_tokens, wise,
                                               stop_at_eos=True)
                meters[key].add(stats)
                for r, t in zip(rows, tokens):
                    answers[key][r] = qa_scoring.extract_answer(backend.tokenizer.decode(t))
                bar.update(len(rows))

    def scores(key):
        pairs = [qa_scoring.best_scores(a, list(ex.answers)) for a, ex in zip(answers[key], kept)]
        return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])

    dense_em, dense_f1 = scores("dense")
    rows = []
    for eta in args.etas:
        key = f"{eta:g}"
        em, f1 = scores(key)
        rows.append({"eta": eta, "em": float(em.mean()), "f1": float(f1.mean()),
                     "f1_diff": interval(paired_bootstrap(f1, dense_f1, seed=args.seed)),
                     "em_diff": interval(paired_bootstrap(em, dense_em, seed=args.seed)),
                     "same_answer": float(np.mean([a == b for a, b in zip(answers[key], answers["dense"])])),
                     **meters[key].result()})
    return {"rows": rows, "dense": {"em": float(dense_em.mean()), "f1": float(dense_f1.mean())},
            "examples": len(kept), "skipped_too_long": skipped, "prompt_template": qa_scoring.PROMPT_TEMPLATE,
            "answers": answers}


def qa_markdown(result: dict) -> str:
    d = result["dense"]
    lines = ["| decode | EM | F1 | F1 - dense [95% CI] | EM - dense [95% CI] | same answer as dense "
             "| density by depth |", "|---|---|---|---|---|---|---|",
             f"| dense | {d['em']:.4f} | {d['f1']:.4f} | | | | |"]
    for row in result["rows"]:
        f, e = row["f1_diff"], row["em_diff"]
        density = ", ".join(f"{k}: {v:.3f}" for k, v in row["density"].items())
        lines.append(f"| WISE eta {row['eta']:g} | {row['em']:.4f} | {row['f1']:.4f} | "
                     f"{f['mean']:+.4f} [{f['low']:+.4f}, {f['high']:+.4f}] | "
                     f"{e['mean']:+.4f} [{e['low']:+.4f}, {e['high']:+.4f}] | {row['same_answer']:.3f} | {density} |")
    lines.append("")
    lines.append(f"{result['examples']} examples ({len(result['skipped_too_long'])} skipped as too long).")
    return "\n".join(lines) + "\n"


# -- command line -----------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("text", "qa", "-h", "--help"):
        argv = ["text"] + argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="task", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or built-in model name")
    common.add_argument("--backend", choices=("torch", "jax"), default="torch")
    common.add_argument("--kernel", default="auto",
                        help="the engines' attention_backend (jax: the decode kernel of its functional evaluation)")
    common.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    common.add_argument("--batch", type=int, default=None, help="sequences per call")
    common.add_argument("--out", type=Path, default=rp.RESULTS)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    text = sub.add_parser("text", parents=[common], help="WISE vs dense on held-out stdlib source")
    text.add_argument("--etas", type=float, nargs="+", default=[0.9, 0.95, 0.99])
    text.add_argument("--n-contexts", type=int, default=200)
    text.add_argument("--min-context", type=int, default=1024)
    text.add_argument("--max-context", type=int, default=1984,
                      help="default: context + continuation stay within the built-in model's 2048 training tokens")
    text.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens per context")
    text.add_argument("--greedy", type=int, default=32, help="greedy tokens per context")
    text.add_argument("--smoke", action="store_true", help="4 short contexts, 2 etas: a quick check")
    qa = sub.add_parser("qa", parents=[common], help="EM/F1 on a HotpotQA/2Wiki-style JSON-lines file")
    qa.add_argument("--data", type=Path, required=True, help="JSON lines: question, context, answer(s)")
    qa.add_argument("--etas", type=float, nargs="+", default=[0.95])
    qa.add_argument("--limit", type=int, default=None, help="first N examples")
    qa.add_argument("--max-new-tokens", type=int, default=32)
    qa.add_argument("--skip-too-long", action="store_true",
                    help="skip (and count) prompts longer than the model's context instead of failing")
    args = ap.parse_args(argv)
    if args.task == "text" and args.smoke:
        args.n_contexts, args.min_context, args.max_context = 4, 96, 192
        args.continuation, args.greedy, args.etas = 12, 8, [0.5, 0.95]
    if args.batch is None:
        args.batch = 16 if args.task == "text" else 8
    for eta in args.etas:
        WiseConfig(eta=eta)  # validates eta
    positive = ["batch"] + (["n_contexts", "min_context", "continuation", "greedy"] if args.task == "text"
                            else ["max_new_tokens"])
    for name in positive:
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.task == "text" and args.max_context < args.min_context:
        ap.error("--max-context must be at least --min-context")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    backend = Backend(args.backend, args.model, args.dtype, args.kernel)
    result = run_text(backend, args) if args.task == "text" else run_qa(backend, args)
    model_name = Path(str(args.model)).name
    stem = f"quality_{args.task}_{model_name}" + (f"_{args.data.stem}" if args.task == "qa" else "")
    result.update({
        "task": args.task, "model": str(args.model), "backend": args.backend, "kernel": args.kernel,
        "dtype": backend.dtype, "device": backend.device,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_s": round(time.perf_counter() - started, 1),
    })
    table = text_markdown(result) if args.task == "text" else qa_markdown(result)
    header = (f"# WISE vs dense: {args.task}, model {args.model}\n\n{backend.device}, backend {args.backend}, "
              f"kernel {args.kernel}, {backend.dtype}, {result['date']}\n\n")
    plot = (lambda path: text_plot(result, path, f"WISE vs dense, {model_name}")) if args.task == "text" else None
    rp.write_report(args.out, stem, result, header + table, plot)
    print(table, end="")
    print(f"wrote {args.out / stem}.*", flush=True)
    return result


if __name__ == "__main__":
    main()
