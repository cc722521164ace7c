"""What every ``trnsim`` subcommand module shares: the error for bad input outside configs and
kernels, and the console that prints stable text. Kept apart from :mod:`trnsim.cli` so that
subcommands living in modules of their own (:mod:`trnsim.cli_estimate`) need not import it back."""

from __future__ import annotations

import sys
from typing import Any

from ..outputs.files import AtomicOutput

__all__ = ["UsageError", "Out", "reserve_outputs", "say_written"]


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


def reserve_outputs(trace: str | None, metrics: str | None, plot: str | None) -> list[Any]:
    """The output files a command writes, each refused now (not after the run) when it cannot be
    written or needs an extra that is missing."""
    from ..outputs.files import reserve_all
    from ..outputs.metrics import reserve as reserve_metrics
    from ..outputs.plot import reserve as reserve_plot

    return reserve_all([lambda: AtomicOutput(trace, "--trace") if trace else None,
                        lambda: reserve_metrics(metrics, "--metrics") if metrics else None,
                        lambda: reserve_plot(plot, "--plot") if plot else None])


def say_written(console: Any, trace: str | None, metrics: str | None, plot: str | None) -> None:
    from rich.markup import escape

    if trace:
        console.print(f"Trace written to {escape(trace)} (open it in ui.perfetto.dev or chrome://tracing)")
    if metrics:
        console.print(f"Metrics written to {escape(metrics)} (Parquet)")
    if plot:
        console.print(f"Plot written to {escape(plot)}")
