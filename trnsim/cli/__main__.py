"""``python -m trnsim.cli ...``: the ``trnsim`` command."""

import sys

from . import main

sys.exit(main())
