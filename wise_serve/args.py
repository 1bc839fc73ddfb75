"""Command-line arguments of `wise serve` (argparse only: building the parser imports no framework).

`--backend torch|jax` picks the engine (`wise_torch.LLM` or `wise_jax.LLM`); the flags of one
framework's features (speculative decoding and CUDA graphs: torch) are refused with the other
rather than ignored, as is an attention backend the framework does not have.
"""

from __future__ import annotations

import argparse

from wise_core.checkpoint import BUILTIN_MODELS, DEFAULT_MODEL
from wise_core.presets import PRESETS
from wise_core.engine.args import ATTENTION_BACKENDS
from wise_core.wise_config import WiseConfig

BACKENDS = ("torch", "jax")
MAX_REQUEST_SEQUENCES = 256     # prompts x n of one request
MAX_REQUEST_TOKENS = 1 << 20    # prompt + max_tokens over one request's sequences
READ_TIMEOUT = 15.0             # seconds for a request line and headers, or a body


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine settings (shared by `wise serve` and the load client's offline run)."""
    parser.add_argument("--backend", choices=BACKENDS, default="torch",
                        help="the engine's framework: torch (wise_torch.LLM) or jax (wise_jax.LLM) (default: torch)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint directory (HF Ouro layout) or built-in model: "
                             f"{', '.join(sorted(BUILTIN_MODELS))}; with --load-format dummy a preset: "
                             f"{', '.join(sorted(PRESETS))} (default: {DEFAULT_MODEL!r})")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of the preset --model (benchmarks; torch draws them on the "
                             "device, jax on the host)")
    parser.add_argument("--q-scale", type=float, default=1.0,
                        help="dummy weights: multiply q_proj by this, for peaked attention (default: 1)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="weights and activations (default: auto, bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU when there is one (default: auto)")
    parser.add_argument("--wise", action="store_true", help="decode with WISE (default: dense decode)")
    parser.add_argument("--eta", type=float, default=None,
                        help=f"WISE mass fraction kept per head (default: {WiseConfig.eta}); needs --wise")
    parser.add_argument("--attention-backend", default="auto",
                        choices=sorted({name for names in ATTENTION_BACKENDS.values() for name in names}),
                        help="what runs prefill and decode attention (docs/attention.md): torch auto, triton, fa4, "
                             "reference; jax auto, pallas, reference (default: auto, the fastest that runs here)")
    parser.add_argument("--speculative", choices=("wise", "loops"), default=None,
                        help="lossless speculative decoding (the output is dense decode's): drafts by WISE "
                             "(--eta sets it) or by the first --draft-loops loops (torch)")
    parser.add_argument("--num-draft", type=int, default=4, help="speculative: tokens drafted per round (default: 4)")
    parser.add_argument("--draft-loops", type=int, default=None,
                        help="--speculative loops: loops a draft runs (default: half the model's)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages in the pool (default: sized from free device memory; CPU: 1 GiB of K/V)")
    parser.add_argument("--page-size", type=int, default=128, help="tokens per KV page (default: 128)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests decoding at once (default: 256)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output tokens a request may hold (default: the model's limit, at most "
                             "the pool)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="prompt tokens one step prefills (chunked prefill; default: 8192)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the K/V of full prompt pages across requests with the same prefix "
                             "(default: on; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="CUDA-graph decode (torch; default: auto, on with CUDA)")
    parser.add_argument("--compile-ahead", action=argparse.BooleanOptionalAction, default=None,
                        help="jax: compile the engine's start-up set of step programs (the widest decode bucket, "
                             "the prefill and first-token programs of single prompts) before serving, and every "
                             "later program in the background while a step runs in a larger compiled one, so no "
                             "request waits for a compile (default: on; --no-compile-ahead: the engine's own "
                             "default, which on a CPU compiles each program when a step first needs it)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the generator of requests without a seed (default: random)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name requests give and /v1/models lists (default: --model)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template for /v1/chat/completions (default: the checkpoint's "
                             "chat_template.jinja or tokenizer_config.json's chat_template; none: chat answers 400)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free port)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="after SIGTERM, seconds in-flight requests may take to finish before they are "
                             "aborted (default: 30; a second SIGTERM aborts at once)")
    parser.add_argument("--max-request-sequences", type=int, default=MAX_REQUEST_SEQUENCES, metavar="N",
                        help=f"the most sequences (prompts x n) one request may ask for; more is a 400 "
                             f"(default: {MAX_REQUEST_SEQUENCES})")
    parser.add_argument("--max-request-tokens", type=int, default=MAX_REQUEST_TOKENS, metavar="N",
                        help=f"the most tokens (prompt + max_tokens, summed over its sequences) one request may ask "
                             f"for; more is a 400 (default: {MAX_REQUEST_TOKENS})")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT, metavar="SECONDS",
                        help=f"close a connection whose request line and headers (or an idle keep-alive connection) "
                             f"do not arrive within this many seconds; a body that does not is a 408 "
                             f"(default: {READ_TIMEOUT:g})")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")


def check_engine_arguments(args: argparse.Namespace) -> None:
    """Combinations argparse cannot check (ValueError naming the flag), the backend's among them."""
    if args.attention_backend not in ATTENTION_BACKENDS[args.backend]:
        raise ValueError(f"--attention-backend {args.attention_backend} is not one of the {args.backend} engine's "
                         f"(--backend {args.backend}: {', '.join(ATTENTION_BACKENDS[args.backend])})")
    if args.backend == "jax":
        for flag, given in (("--speculative", args.speculative is not None),
                            ("--cuda-graphs", args.cuda_graphs != "auto")):
            if given:
                raise ValueError(f"{flag} is a torch engine feature: drop it or use --backend torch")
    elif args.compile_ahead is not None:
        raise ValueError("--compile-ahead is a jax engine feature (torch captures a decode graph per bucket in "
                         "well under a second): drop it or use --backend jax")
    if args.eta is not None and not (args.wise or args.speculative == "wise"):
        raise ValueError("--eta needs --wise (or --speculative wise)")
    if args.wise and args.speculative == "loops":
        raise ValueError("--speculative loops decodes densely: drop --wise (--speculative wise drafts with WISE)")
    if args.speculative is None and (args.num_draft != 4 or args.draft_loops is not None):
        raise ValueError("--num-draft and --draft-loops need --speculative")
    if args.eta is None:
        args.eta = WiseConfig.eta
    if args.load_format == "dummy" and args.model not in PRESETS:
        raise ValueError(f"--load-format dummy needs --model to be a preset ({', '.join(sorted(PRESETS))}), "
                         f"got {args.model!r}")
    if args.q_scale != 1.0 and args.load_format != "dummy":
        raise ValueError("--q-scale applies to --load-format dummy only")
