"""`python -m wise ARGS` is `wise ARGS`."""

import sys

from wise.cli import main

sys.exit(main())
