"""`python -m wise_serve ARGS` is `wise serve ARGS`."""

import sys

from wise_core.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
