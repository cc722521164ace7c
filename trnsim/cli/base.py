"""What every ``trnsim`` subcommand module shares: the error for bad input outside configs and
kernels, and the console that prints stable text. Kept apart from :mod:`trnsim.cli` so that
subcommands living in modules of their own (:mod:`trnsim.cli_estimate`) need not import it back."""

from __future__ import annotations

import os
import select
import sys
from typing import Any

from ..config.files import AtomicOutput

__all__ = ["UsageError", "Out", "emit", "reserve_outputs", "say_written"]


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
        emit("".join(line.rstrip() + "\n" for line in text.splitlines()), end="")


def emit(text: str, end: str = "\n") -> None:
    """Write ``text`` to stdout whole. A descriptor another process has made non-blocking (a pipe
    shared with the ranks of ``trnsim run --nproc``) makes ``print`` drop what does not fit the
    pipe, silently and with exit status 0; here a full pipe is waited on instead."""
    out = sys.stdout
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (captured in tests)
        out.write(text + end)
        out.flush()
        return
    out.flush()
    data = memoryview((text + end).encode(out.encoding or "utf-8", errors=out.errors or "strict"))
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            select.select([], [fd], [])


def reserve_outputs(trace: str | None, metrics: str | None, plot: str | None) -> list[Any]:
    """The output files a command writes, each refused now (not after the run) when it cannot be
    written or needs an extra that is missing."""
    from ..config.files import reserve_all
    from ..sim.metrics import reserve as reserve_metrics
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
