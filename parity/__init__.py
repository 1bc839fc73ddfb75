"""The parity suite: the PyTorch and JAX implementations of wise compute the same thing.

Checks (`parity.checks.CHECKS`) run on a `parity.suite.Suite`; `main(argv)` is the command line
(`python -m parity`, `wise parity`). Importing this package loads no framework.
"""

from parity.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
