"""Argument types the benchmarks share, so a bad number is refused by argparse (its usage line,
then ``error: argument --steps: expected a whole number from 1 to 1000, got '0'``, exit status 2)
instead of running with it: a benchmark given ``--steps 0`` used its default, ``--iters 0``
divided by zero, ``--samples 0`` reported a run of nothing as clean.

Scripts import it as a sibling: their directory is on ``sys.path`` when they run."""

from __future__ import annotations

import argparse
from typing import Callable


def whole(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``lo`` (to ``hi``)."""
    span = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, got {text!r}")
        return n
    return parse


def wholes(lo: int, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated whole numbers, each from ``lo`` (to ``hi``)."""
    one = whole(lo, hi)

    def parse(text: str) -> list[int]:
        try:
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e} (comma-separated)") from None
    return parse


def share(text: str) -> float:
    """An argparse ``type``: a number from 0 to 1."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return x

