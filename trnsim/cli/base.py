"""What every ``trnsim`` subcommand module shares: the error for bad input outside configs and
kernels, and the console that prints stable text. Kept apart from :mod:`trnsim.cli` so that
subcommands living in modules of their own (:mod:`trnsim.cli_estimate`) need not import it back."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["UsageError", "Out"]


class UsageError(Exception):
    """Bad input outside configs and kernels (a file that cannot be written, a missing flag)."""


class Out:
    """A rich console that writes to stdout without the trailing padding rich adds to lines,
    so output is stable text (pinned by golden tests)."""

    def __init__(self, width: int = 100):
        import io

        from rich.console import Console

        self._buf = io.StringIO()
        color = sys.stdout.isatty()
        self._console = Console(file=self._buf, highlight=False, soft_wrap=False, width=width,
                                force_terminal=color, color_system="auto" if color else None)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._console.print(*args, **kwargs)
        text = self._buf.getvalue()
        self._buf.seek(0)
        self._buf.truncate()
        sys.stdout.write("".join(line.rstrip() + "\n" for line in text.splitlines()))
        sys.stdout.flush()
