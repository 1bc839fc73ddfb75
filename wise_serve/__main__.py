"""`python -m wise_serve ...`: the same as `wise serve ...`."""

import sys

from wise_serve.cli import main

sys.exit(main())
