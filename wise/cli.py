"""The `wise` command line. Backends (torch, jax) are imported only when a command runs.

Subcommands are listed in `COMMANDS` (name -> (help, add_arguments, run)); `run(args)` returns
the exit status. `wise generate` runs the engine of --backend (`wise_torch.LLM` or
`wise_jax.LLM`, built by `wise_serve.model.build_engine` and driven through the engine protocol
`wise_core.engine.protocol.Engine`) on one prompt
(--prompt TEXT, or - for standard input) or a batch (--prompt-file: one prompt a line, or JSONL
objects with a "prompt" field and an optional "max_tokens"; a UTF-8 byte-order mark is dropped,
blank lines are skipped), printing the text (--stream: as it comes; --logprobs: each token's
log p after it) or one JSON object per prompt (--json; its "index" is the prompt's line in the
file, from 0, so blank lines do not renumber the prompts after them); `wise serve` is the
completions server (wise_serve, either backend). Sampling flags (--top-p, --top-k, --min-p,
--seed) need --temperature > 0: greedy decoding, the default, would ignore them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from wise_core import __version__
from wise_core.checkpoint import BUILTIN_MODELS, DEFAULT_MODEL, open_checkpoint
from wise_core.detokenize import TextStream
from wise_core.engine.protocol import Engine
from wise_core.generate_args import check_sampling, check_seed
from wise_core.sampling_params import MAX_SEED, SamplingParams
from wise_core.tokenizer import encode_text
from wise_core.engine.args import ATTENTION_BACKENDS
from wise_core.wise_config import WiseConfig
from wise_serve.model import build_engine, engine_context, select_device

DTYPES = ("float32", "bfloat16", "float16")
MAX_NUM_SEQS = 256      # `wise generate`: requests decoding at once
PAGE_SIZE = 128


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint directory (HF Ouro layout) or built-in model name: "
                             f"{', '.join(sorted(BUILTIN_MODELS))} (default: {DEFAULT_MODEL!r}; "
                             f"'ouro-py-3m' is a small model trained on Python source, 'huginn-py-3m' "
                             f"its Huginn-architecture counterpart, 'random-tiny' has random weights)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text; '-' reads it from standard input (as is, newlines kept)")
    source.add_argument("--prompt-file",
                        help="a batch of prompts: one per line, or JSONL objects with a \"prompt\" field; "
                             "'-' reads standard input")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens to generate per prompt (default: 32; a JSONL prompt's \"max_tokens\" overrides "
                             "it); prompt + new tokens must fit the model's positions")
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch", help="framework (default: torch)")
    parser.add_argument("--wise", action="store_true", help="decode with WISE (default: dense decode)")
    parser.add_argument("--eta", type=float, default=None,
                        help=f"WISE mass fraction kept per head (needs --wise; default: {WiseConfig.eta})")
    parser.add_argument("--attention-backend", choices=attention_backend_names(), default="auto",
                        help="what runs prefill and decode attention (docs/attention.md): torch auto, triton, fa4, "
                             "reference; jax auto, pallas, reference (default: auto, the fastest that runs here)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy, the default (as SamplingParams; the server's "
                             "default is 1, as OpenAI's)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling mass (needs --temperature; default: 1.0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k most probable tokens (needs --temperature; default: 0, all)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a prompt's text before TEXT (repeat for several)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="sample among tokens of probability >= min_p x the largest (needs --temperature; "
                             "default: 0, all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (needs --temperature; default: 0); prompt i samples with seed + i")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: float32)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU when there is one (default: auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the torch backend (default: the physical cores, "
                             f"{physical_cores()} here; jax keeps XLA's own)")
    parser.add_argument("--logprobs", action="store_true",
                        help="print each generated token's log p under the model (natural log of its softmax, "
                             "before temperature and filters) after the text; with --json a \"logprobs\" list")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--stream", action="store_true",
                        help="print the text token by token as it is generated (one prompt)")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt: prompt, text, token_ids, finish_reason, stats")


def attention_backend_names() -> list[str]:
    """Every backend's attention_backend values (the engine refuses another framework's)."""
    return sorted({name for names in ATTENTION_BACKENDS.values() for name in names})


def physical_cores() -> int:
    """Physical CPU cores (distinct (package, core) pairs of /proc/cpuinfo; os.cpu_count() where
    that says nothing): more threads than cores contend on a shared machine."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    return len(cores) or os.cpu_count() or 1


# -- prompts ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of --prompt or --prompt-file: its text, max_tokens (None: --max-new-tokens),
    line (its 0-based line in the file; 0 for --prompt) and name (how errors name it)."""

    text: str
    max_tokens: int | None
    line: int
    name: str


def read_prompts(args) -> list[Prompt]:
    """The prompts of --prompt or --prompt-file (ValueError naming what is wrong)."""
    if args.prompt is not None:
        prompt = (sys.stdin.read() if args.prompt == "-" else args.prompt).removeprefix("\ufeff")
        if not prompt:
            raise ValueError("the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
        return [Prompt(prompt, None, 0, "--prompt")]
    name = "standard input" if args.prompt_file == "-" else args.prompt_file
    try:
        text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {name}: {e}") from None
    lines = [(n, line) for n, line in enumerate(text.removeprefix("\ufeff").splitlines()) if line.strip()]
    if not lines:
        raise ValueError(f"--prompt-file {name} holds no prompt")
    if not lines[0][1].lstrip().startswith("{"):
        return [Prompt(line, None, n, f"--prompt-file {name} line {n + 1}") for n, line in lines]
    return [_jsonl_prompt(line, n, f"--prompt-file {name} line {n + 1}") for n, line in lines]


def _jsonl_prompt(line: str, n: int, where: str) -> Prompt:
    """One JSONL line: an object with a non-empty string "prompt" and an optional positive
    integer "max_tokens" (other fields are the caller's, passed over)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise ValueError(f"{where}: expected an object with a non-empty string \"prompt\", got {line[:60]!r}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise ValueError(f"{where}: \"max_tokens\" must be a positive integer, got {json.dumps(max_tokens):.40}")
    return Prompt(obj["prompt"], max_tokens, n, where)


# -- the engine -----------------------------------------------------------------------------------------
def _engine(args, **engine_args) -> tuple[Engine, int | None]:
    """The --backend engine over --model, in --dtype on --device (`wise_serve.model.build_engine`)
    -> (the engine, the CPU threads torch runs on; None for jax, which keeps XLA's own)."""
    device = select_device(args.backend, args.device)
    threads = None
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads or physical_cores())
        threads = torch.get_num_threads()
        engine_args["device"] = device
    return build_engine(args.backend, args.model, dtype=args.dtype, **engine_args), threads


def _new_tokens(args, prompt: Prompt, prompt_tokens: int, max_positions: int) -> int:
    """The tokens to generate for `prompt` (its max_tokens, else --max-new-tokens), checked to fit
    the model's positions with its prompt (a ValueError naming the flag or the line)."""
    new = args.max_new_tokens if prompt.max_tokens is None else prompt.max_tokens
    if prompt_tokens + new > max_positions:
        given = f"--max-new-tokens {new}" if prompt.max_tokens is None else f"{prompt.name}'s \"max_tokens\" {new}"
        raise ValueError(f"{given}: {prompt.name} holds {prompt_tokens} tokens, and with {new} new tokens they pass "
                         f"the model's {max_positions} positions (max_position_embeddings); ask for at most "
                         f"{max(max_positions - prompt_tokens, 0)}")
    return new


def _generate(args, wise_config: WiseConfig | None, prompts: list[Prompt], on_text=None) -> tuple[list, dict]:
    """Run the prompts on the --backend engine -> (per prompt: dict of text, token_ids,
    finish_reason, logprobs (None without --logprobs), prompt_tokens, ttft_s, latency_s; the
    engine's stats as a dict). Prompt i samples with seed --seed + i, so its tokens do not depend
    on the other prompts. on_text(delta): called as the (single) prompt's text grows."""
    checkpoint = open_checkpoint(args.model)      # the tokenizer and the positions, before the engine loads
    tokenizer = checkpoint.tokenizer
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer.json; `wise generate` needs one")
    ids = [encode_text(tokenizer, p.text, p.name) for p in prompts]
    new = [_new_tokens(args, p, len(i), checkpoint.config.max_position_embeddings) for p, i in zip(prompts, ids)]
    max_num_seqs, page_size = min(len(ids), MAX_NUM_SEQS), PAGE_SIZE
    lengths = [len(p) + n for p, n in zip(ids, new)]
    # Every request at once: the pool they need (as wise_torch.generate); a larger batch queues
    # in a pool sized by the engine's default.
    num_pages = sum(-(-n // page_size) for n in lengths) if len(ids) <= max_num_seqs else None
    llm, threads = _engine(args, wise_config=wise_config, num_pages=num_pages, page_size=page_size,
                           max_num_seqs=max_num_seqs, max_model_len=max(lengths), seed=args.seed or 0,
                           attention_backend=args.attention_backend)
    requests = {}
    for i, prompt in enumerate(ids):
        params = SamplingParams(max_tokens=new[i], temperature=args.temperature, stop=tuple(args.stop),
                                seed=((args.seed or 0) + i) % MAX_SEED, logprobs=args.logprobs,
                                **sampling_filters(args))
        requests[llm.add_request(prompt, params)] = i
    results: list[dict | None] = [None] * len(ids)
    text = TextStream(tokenizer, tuple(args.stop), cut=False) if on_text is not None else None   # the engine cuts
    bar = None
    if len(ids) > 1:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ids), desc="prompts", unit="prompt", dynamic_ncols=True, file=sys.stderr,
                   disable=None)   # None: no bar without a terminal
    start, first = time.perf_counter(), {}
    with engine_context(args.backend)():
        while llm.has_unfinished():
            for out in llm.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                if text is not None:
                    text.add(out.token_ids[len(text.ids):])
                    if out.finished:
                        text.finish(out.text)
                    on_text(text.delta(final=out.finished))
                if out.finished:
                    i = requests[out.request_id]
                    results[i] = dict(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                                      logprobs=out.logprobs, prompt_tokens=len(ids[i]),
                                      token_texts=[tokenizer.decode([t], skip_special_tokens=False)
                                                   for t in out.token_ids] if args.logprobs else None,
                                      ttft_s=first[out.request_id] - start, latency_s=now - start)
                    if bar is not None:
                        bar.update(1)
    if bar is not None:
        bar.close()
    s = llm.stats()
    stats = dict(prefill_s=s.prefill_s, prefill_tokens=s.prompt_tokens, decode_s=s.decode_s,
                 decode_tokens=s.decode_tokens, decode_tokens_per_s=s.decode_tokens_per_s,
                 preemptions=s.preemptions, fallbacks=s.fallbacks, density=s.density, threads=threads,
                 step_programs=s.step_programs, step_build_s=s.step_build_s)
    return results, stats


def wise_settings(args) -> WiseConfig | None:
    """The WiseConfig of --wise and --eta; --eta without --wise is an error (dense decode would
    ignore it)."""
    if not args.wise:
        if args.eta is not None:
            raise ValueError("--eta set WISE decode; add --wise (dense decode does not use it)")
        return None
    return WiseConfig() if args.eta is None else WiseConfig(eta=args.eta)


SAMPLING_FLAGS = {"top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed"}


def sampling_filters(args) -> dict:
    """The SamplingParams filters given (top_p, top_k, min_p); the ones left out keep their defaults."""
    return {name: getattr(args, name) for name in ("top_p", "top_k", "min_p") if getattr(args, name) is not None}


def check_generate_arguments(args) -> None:
    """The flags of `wise generate` that need no model (ValueError naming the flag): values in
    range, an attention backend of the --backend engine, and no sampling flag without
    --temperature > 0 (greedy decoding would ignore it)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    check_sampling(args.temperature, 1.0 if args.top_p is None else args.top_p)
    SamplingParams(stop=tuple(args.stop), **{k: v for k, v in sampling_filters(args).items() if k != "top_p"})
    check_seed(args.seed)
    if args.attention_backend not in ATTENTION_BACKENDS[args.backend]:
        raise ValueError(f"--attention-backend {args.attention_backend} is not one of the {args.backend} engine's "
                         f"({', '.join(ATTENTION_BACKENDS[args.backend])})")
    given = [flag for name, flag in SAMPLING_FLAGS.items() if getattr(args, name) is not None]
    if given and not args.temperature > 0:
        raise ValueError(f"{' and '.join(given)} set sampling; add --temperature T > 0 (greedy decoding, the "
                         f"default, does not use {'them' if len(given) > 1 else 'it'})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")


def run_generate(args) -> int:
    wise_config = wise_settings(args)
    check_generate_arguments(args)
    prompts = read_prompts(args)
    if args.stream and len(prompts) > 1:
        raise ValueError("--stream prints one prompt's tokens as they come: give one --prompt")
    if args.stream and args.logprobs:
        raise ValueError("--logprobs prints each token's log p after the text: drop --stream (or use --json)")
    on_text = None
    if args.stream:
        started = []

        def on_text(delta: str) -> None:
            if not started:                    # the prompt, once the model runs
                started.append(print(prompts[0].text, end=""))
            print(delta, end="", flush=True)

    results, stats = _generate(args, wise_config, prompts, on_text)
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if args.json:
            per = {k: r[k] for k in ("ttft_s", "latency_s") if k in r}
            row = {"index": prompt.line, "prompt": prompt.text, "text": r["text"], "token_ids": r["token_ids"],
                   "finish_reason": r["finish_reason"]}
            if args.logprobs:
                row["logprobs"] = r["logprobs"]
            row["stats"] = dict(prompt_tokens=r["prompt_tokens"], completion_tokens=len(r["token_ids"]), **per,
                                batch=stats)
            print(json.dumps(row))
        elif args.stream:
            print()
        else:
            if len(prompts) > 1:
                print(f"### prompt {i + 1} of {len(prompts)} ({r['finish_reason']})")
            print(prompt.text + r["text"])
            if args.logprobs:
                print("# token id, log p, text")
                for token, logprob, piece in zip(r["token_ids"], r["logprobs"], r["token_texts"]):
                    print(f"{token:8d} {logprob:10.4f}  {piece!r}")
    prefill_tokens, prefill_s, decode_s = stats["prefill_tokens"], stats["prefill_s"], stats["decode_s"]
    line = (f"prefill: {prefill_tokens} tokens in {prefill_s:.3f} s ({prefill_tokens / prefill_s:.1f} tokens/s); "
            f"decode: {stats['decode_tokens']} tokens in {decode_s:.3f} s "
            f"({stats['decode_tokens_per_s']:.1f} tokens/s)")
    if len(prompts) > 1:
        line = f"{len(prompts)} prompts; " + line
    if stats["step_programs"]:
        line += f"; {stats['step_programs']} step program(s) built in {stats['step_build_s']:.3f} s"
    if wise_config is not None:
        density = ", ".join(f"loop {d}: {x:.3f}" for d, x in (stats.get("density") or {}).items() if x is not None)
        line += f"; WISE eta {wise_config.eta}: fallbacks {stats.get('fallbacks')}, density {density or 'n/a'}"
    print(f"[{args.backend}] {line}", file=sys.stderr)
    return 0


# -- other commands ---------------------------------------------------------------------------------------
def add_parity_arguments(parser: argparse.ArgumentParser) -> None:
    from parity import add_arguments  # argparse only: no framework is imported here

    add_arguments(parser)


def run_parity(args) -> int:
    import parity

    return parity.run(args)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from wise_serve.args import add_serve_arguments as add  # argparse only

    add(parser)


def run_serve(args) -> int:
    try:
        from wise_serve.cli import run
    except ImportError as e:
        raise RuntimeError(f"`wise serve` needs the serve extra (pip install 'wise[serve]'): {e}") from None
    return run(args)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from wise_core.train_config import add_train_arguments as add  # argparse only

    add(parser)


def run_train(args) -> int:
    from wise_jax.train import main

    return main(args)


COMMANDS = {
    "generate": ("generate text from prompts, dense or with WISE", add_generate_arguments, run_generate),
    "serve": ("serve OpenAI-compatible completions over HTTP (--backend torch or jax)", add_serve_arguments,
              run_serve),
    "parity": ("check that the torch and JAX implementations agree (python -m parity)", add_parity_arguments,
               run_parity),
    "train": ("train an Ouro-shaped model in JAX (optax, orbax checkpoints, resumable)", add_train_arguments,
              run_train),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wise", description="Working-set (WISE) decode for recurrent-depth language models.")
    parser.add_argument("--version", action="version", version=f"wise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, add_arguments, run) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as e:  # bad input, unknown model, exhausted pool, port in use
        print(f"wise {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
