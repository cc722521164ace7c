"""``python -m trnsim ...``: the ``trnsim`` command (as ``python -m trnsim.cli``)."""

import sys

from .cli import main

sys.exit(main())
