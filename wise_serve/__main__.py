"""`python -m wise_serve ARGS` is `wise serve ARGS`."""

import argparse
import sys

from wise_serve.args import add_serve_arguments
from wise_serve.cli import run

parser = argparse.ArgumentParser(prog="python -m wise_serve", description="serve OpenAI-compatible completions")
add_serve_arguments(parser)
args = parser.parse_args()
try:
    sys.exit(run(args))
except (ValueError, RuntimeError, OSError) as e:  # as `wise serve`: bad input, unknown model, port in use
    print(f"wise serve: error: {e}", file=sys.stderr)
    sys.exit(1)
