"""``python -m kvelastic``: the ``kvelastic`` command, for a Python whose scripts are not on PATH."""

import sys

from kvelastic.cli import main

sys.exit(main())
