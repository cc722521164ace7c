"""Recording launches for reports: a :class:`Recorder` tallies, per core, the launches, the host's
waits and the union of the kernels' intervals between two points of a program."""

from __future__ import annotations

from typing import Any, Iterable

from ..sim.report import TraceEvent


# ---------------------------------------------------------------------------------------------
# recording launches for reports
# ---------------------------------------------------------------------------------------------


class CoreTally:
    """One core's figures within one recorder: launches, host wait, and the union of its kernels'
    intervals, kept as merged open intervals folded into ``busy`` once the host has passed them
    (new kernels never start before the host's issue time)."""

    __slots__ = ("launches", "wait", "busy", "open", "last_end", "ticks")

    def __init__(self) -> None:
        self.launches = 0
        self.wait = 0
        self.busy = 0
        self.open: list[list[int]] = []
        self.last_end = 0
        self.ticks = 0  # its kernels' times summed: above the union when streams ran side by side

    def add(self, start: int, end: int, host: int) -> None:
        if end > self.last_end:
            self.last_end = end
        if end <= start:
            return
        self.ticks += end - start
        live = self.open
        if not live or start >= live[-1][1]:  # the usual case: after every open interval
            while live and live[0][1] <= host:
                lo, hi = live.pop(0)
                self.busy += hi - lo
            live.append([start, end])
            return
        merged = [start, end]  # overlaps or precedes an open interval (another stream's kernel)
        keep = []
        for iv in live:
            if iv[1] < merged[0] or iv[0] > merged[1]:
                keep.append(iv)
            else:
                merged = [min(iv[0], merged[0]), max(iv[1], merged[1])]
        keep.append(merged)
        keep.sort()
        self.open = []
        for iv in keep:
            if iv[1] <= host:
                self.busy += iv[1] - iv[0]
            else:
                self.open.append(iv)

    def busy_ticks(self) -> int:
        return self.busy + sum(hi - lo for lo, hi in self.open)


class Recorder:
    """Counts launches for one report scope (the device's whole run, or a ``with`` block).
    ``add`` runs once per launch, so it only counts; :meth:`Device.report` makes the totals.
    ``trace`` keeps every launch (a timeline); ``sources`` sums each row's device ticks per
    source line (what :meth:`Device.set_context` or ``Device.source_of`` said launched it)."""

    def __init__(self, start: int, trace: bool = False, sources: bool = False):
        self.start = start
        # (op, id(cost)) -> [cost, calls, ticks, host wait, peer wait (collectives: waiting for the group)]
        self.rows: dict[tuple[str, int], list[Any]] = {}
        self._deferred: list[tuple[list[int], Any]] = []  # rows not yet in self.rows (defer_rows)
        self._deferred_n = 0
        self.host_ops: dict[str, int] = {}
        self.cores: dict[int, CoreTally] = {}
        self.host_ticks = 0
        self.contention_ticks = 0  # kernels' time added by sharing a core's engines with other streams
        self.dispatches = 0  # host dispatches: one per launch, one per graph launch
        self.graph_launches = 0
        self.compiled_graphs = 0
        self.compile_seconds = 0.0  # wall time, never charged to the device
        self.events: list[TraceEvent] | None = [] if trace else None
        self.sources: dict[tuple[str, int], dict[str, int]] | None = {} if sources else None

    def count_host_ops(self, counts: Iterable[tuple[str, int]]) -> None:
        """Add ``n`` host ops of each (name, n): the order they came in does not matter (a host op
        has no time), only each name's first appearance, which keeps its place in the dict."""
        got = self.host_ops
        for name, n in counts:
            got[name] = got.get(name, 0) + n

    def defer_rows(self, flat: list[int], table: Any) -> None:
        """Count launches later (:meth:`fold`): ``flat`` holds (handle, launches, ticks, host wait)
        per row, ``table[handle]`` is its (op, cost, row key). What a native placement gives: a
        step's dozen placements add their rows once, when a report reads them (or past
        :data:`DEFER_MAX` deferred ints), instead of a dict update per row per placement."""
        self._deferred.append((flat, table))
        self._deferred_n += len(flat)
        if self._deferred_n > DEFER_MAX:
            self.fold()

    def fold(self) -> None:
        """Add the deferred rows to :attr:`rows`, exactly as adding each in turn would: first
        appearances in order (a row's place in the dict), sums per row. Everything that reads or
        writes :attr:`rows` calls this first."""
        batches = self._deferred
        if not batches:
            return
        self._deferred, self._deferred_n = [], 0
        i = 0
        while i < len(batches):  # runs of batches from one table (there is one: the fast path's)
            table = batches[i][1]
            acc: dict[int, list[int]] = {}
            while i < len(batches) and batches[i][1] is table:
                flat = batches[i][0]
                for j in range(0, len(flat), 4):
                    a = acc.get(flat[j])
                    if a is None:
                        acc[flat[j]] = [flat[j + 1], flat[j + 2], flat[j + 3]]
                    else:
                        a[0] += flat[j + 1]
                        a[1] += flat[j + 2]
                        a[2] += flat[j + 3]
                i += 1
            self._add((table[h][2], table[h][1], n, ticks, wait) for h, (n, ticks, wait) in acc.items())

    def add_rows(self, rows: Any) -> None:
        """Count launches summed per report row: (row key, cost, launches, ticks, host wait) each."""
        self.fold()
        self._add(rows)

    def _add(self, rows: Any) -> None:
        table = self.rows
        for key, cost, n, ticks, wait in rows:
            row = table.get(key)
            if row is None:
                table[key] = [cost, n, ticks, wait, 0]
            else:
                row[1] += n
                row[2] += ticks
                row[3] += wait


DEFER_MAX = 1 << 16  # deferred row ints a recorder holds before it folds them (a bound on its memory)

# a launch's context: (the Python line that launched it, its host call; -1: none)
NO_CONTEXT = ("", -1)
