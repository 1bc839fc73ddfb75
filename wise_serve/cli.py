"""`wise serve`: parse the arguments, build the engine, serve until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from wise_serve.args import add_serve_arguments


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp").setLevel(max(logging.WARNING, logging.getLogger().level))
    from wise_serve.model import build_llm
    from wise_serve.server import serve

    llm = build_llm(args)
    asyncio.run(serve(llm, host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                      shutdown_timeout=args.shutdown_timeout))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wise serve", description="OpenAI-compatible completions server")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"wise serve: error: {e}", file=sys.stderr)
        return 1
