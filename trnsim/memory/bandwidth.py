"""The one bandwidth primitive: a pipe booked first-come first-served (STYLE.md #6).

DMA engines' HBM stacks, NeuronLink links, switch ports and EFA NICs are all a
:class:`BandwidthPipe`. A pipe is a "free at" tick rather than a simpy resource: a user books
``nbytes`` from ``start`` and gets back the tick at which the pipe has served them. That is
exact for a FIFO server and costs one integer update per booking instead of a simpy event, so a
1 GiB collective is thousands of bookings, not a process per byte. Callers book at the
simulated time they are at (``env.now``), so the order of bookings is the order of arrival.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["BandwidthPipe"]


class BandwidthPipe:
    """A shared link or memory port served first-come first-served at ``bandwidth`` bytes/s
    (an exact fraction): a reservation from ``start`` ends ``bytes/bandwidth`` (rounded up to a
    whole tick) after the pipe frees up.

    ``bytes`` and ``busy_ticks`` accumulate what the pipe has served; with ``log`` set to a list,
    every booking appends ``(start, end)`` of its service (for trace lanes)."""

    __slots__ = ("num", "den", "tick_hz", "free", "bytes", "busy_ticks", "log", "name")

    def __init__(self, bandwidth: Fraction | int, tick_hz: int, name: str = ""):
        bw = bandwidth if type(bandwidth) is Fraction else Fraction(bandwidth)
        if bw.numerator <= 0:  # (a Fraction's denominator is positive; comparing it to 0 costs ~1 us)
            raise ValueError(f"bandwidth pipe '{name}': bandwidth must be positive, got {bw}")
        self.num = bw.numerator
        self.den = bw.denominator
        self.tick_hz = tick_hz
        self.free = 0
        self.bytes = 0
        self.busy_ticks = 0
        self.log: list[tuple[int, int]] | None = None
        self.name = name

    @property
    def bandwidth(self) -> Fraction:
        """Bytes per second, exact."""
        return Fraction(self.num, self.den)

    def ticks(self, nbytes: int) -> int:
        """Ticks to serve ``nbytes``, rounded up (a transfer is never shortened)."""
        return -(-nbytes * self.tick_hz * self.den // self.num)

    def reserve(self, nbytes: int, start: int) -> int:
        ticks = -(-nbytes * self.tick_hz * self.den // self.num)
        begin = self.free if self.free > start else start
        self.free = begin + ticks
        self.bytes += nbytes
        self.busy_ticks += ticks
        if self.log is not None:
            self.log.append((begin, self.free))
        return self.free
