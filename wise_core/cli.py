"""The `wise` command line. Backends (torch, jax) are imported only when a command runs.

Subcommands are listed in `COMMANDS` (name -> (help, add_arguments, run)); `run(args)` returns
the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys

from wise_core.checkpoint import BUILTIN_MODELS, DEFAULT_MODEL
from wise_core.config import KERNELS, WiseConfig
from wise_core.generate_args import check_sampling, check_seed
from wise_core.tokenizer import encode_text

DTYPES = ("float32", "bfloat16", "float16")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint directory (HF Ouro layout) or built-in model name: "
                             f"{', '.join(sorted(BUILTIN_MODELS))} (default: {DEFAULT_MODEL!r}; "
                             f"'ouro-py-3m' is a small model trained on Python source, 'random-tiny' "
                             f"has random weights)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    parser.add_argument("--backend", choices=("torch", "jax"), default="torch", help="framework (default: torch)")
    parser.add_argument("--wise", action="store_true", help="decode with WISE (default: dense decode)")
    parser.add_argument("--eta", type=float, default=None,
                        help=f"WISE mass fraction kept per head (needs --wise; default: {WiseConfig.eta})")
    parser.add_argument("--kernel", choices=KERNELS, default=None,
                        help="WISE decode-attention kernel (needs --wise; default: auto, the framework's GPU "
                             "kernel on GPU, the reference on CPU)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: float32)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU when there is one (default: auto)")


def _generate_torch(args, wise_config: WiseConfig | None):
    import torch

    import wise_torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    model = wise_torch.load_model(args.model, dtype=args.dtype, device=device)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer.json; `wise generate` needs one")
    ids = encode_text(model.tokenizer, args.prompt, "--prompt")
    out = wise_torch.generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, eos_token_id=model.config.eos_token_id,
                              wise_config=wise_config, seed=args.seed)
    return out, len(ids)


def _generate_jax(args, wise_config: WiseConfig | None):
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax

        import wise_jax
    except ImportError as e:
        raise RuntimeError(f"--backend jax needs jax and the wise_jax package: {e}") from e
    if args.device == "cuda" and jax.default_backend() != "gpu":
        raise RuntimeError(f"--device cuda: jax runs on {jax.default_backend()!r}, not a GPU")
    config, params, tokenizer = wise_jax.load_model(args.model, dtype=args.dtype, with_tokenizer=True)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer.json; `wise generate` needs one")
    ids = encode_text(tokenizer, args.prompt, "--prompt")
    out = wise_jax.generate(params, config, [ids], max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, eos_token_id=config.eos_token_id,
                            wise_config=wise_config, key=jax.random.PRNGKey(args.seed), tokenizer=tokenizer)
    return out, len(ids)


def wise_settings(args) -> WiseConfig | None:
    """The WiseConfig of --wise, --eta and --kernel; --eta or --kernel without --wise is an error
    (dense decode would ignore them)."""
    given = [name for name, value in (("--eta", args.eta), ("--kernel", args.kernel)) if value is not None]
    if not args.wise:
        if given:
            raise ValueError(f"{' and '.join(given)} set WISE decode; add --wise (dense decode does not use them)")
        return None
    settings = {"eta": args.eta, "kernel": args.kernel}
    return WiseConfig(**{name: value for name, value in settings.items() if value is not None})


def run_generate(args) -> int:
    wise_config = wise_settings(args)
    check_sampling(args.temperature, args.top_p)
    check_seed(args.seed)
    backend = _generate_torch if args.backend == "torch" else _generate_jax
    out, prompt_tokens = backend(args, wise_config)
    print(args.prompt + out.texts[0])
    stats = out.stats  # GenerationStats, the same fields in both frameworks
    line = (f"prefill: {prompt_tokens} tokens in {stats.prefill_s:.3f} s ({prompt_tokens / stats.prefill_s:.1f} "
            f"tokens/s); decode: {stats.new_tokens - 1} tokens in {stats.decode_s:.3f} s "
            f"({stats.decode_tokens_per_s:.1f} tokens/s)")
    if wise_config is not None:
        density = ", ".join(f"loop {d}: {x:.3f}" for d, x in (stats.density or {}).items() if x is not None)
        line += f"; WISE eta {wise_config.eta}: fallbacks {stats.fallbacks}, density {density or 'n/a'}"
    print(f"[{args.backend}] {line}", file=sys.stderr)
    return 0


def add_parity_arguments(parser: argparse.ArgumentParser) -> None:
    from parity import add_arguments  # argparse only: no framework is imported here

    add_arguments(parser)


def run_parity(args) -> int:
    import parity

    return parity.run(args)


COMMANDS = {
    "generate": ("generate text from a prompt, dense or with WISE", add_generate_arguments, run_generate),
    "parity": ("check that the torch and JAX implementations agree (python -m parity)", add_parity_arguments,
               run_parity),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wise", description="Working-set (WISE) decode for recurrent-depth language models.")
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
    except (ValueError, RuntimeError) as e:  # bad input, unknown model, exhausted pool, missing backend
        print(f"wise {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
