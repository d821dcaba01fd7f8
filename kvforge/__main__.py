"""``python -m kvforge ...``: the ``kvforge`` command line."""

import sys

from kvforge.cli import main

sys.exit(main())
