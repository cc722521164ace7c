"""A logical core's timeline (per-stream ready times, kernels in flight, collectives waiting for
their group), how kernels of concurrent streams share the core's engines, and the launches a
graph capture collects."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator, Mapping, Sequence

from .ops import OpCost


# ---------------------------------------------------------------------------------------------
# the cores and the host
# ---------------------------------------------------------------------------------------------


class CoreTimeline:
    """One logical NeuronCore's timeline: per-stream ready times, the kernels still in flight."""

    def __init__(self, index: int, max_inflight: int):
        self.index = index
        self.ready: dict[int, int] = {0: 0}
        self.busy_until = 0
        self.current_stream = 0
        self.inflight: deque[int] = deque()
        self.max_inflight = max_inflight
        # the latest kernels as (stream, start, end, demand), for sharing engines across streams:
        # at most max_inflight of them are unfinished when the next one is issued
        self.bookings: deque[tuple[int, int, int, dict[str, int]]] = deque(maxlen=max_inflight + 1)
        self.streams: set[int] = set()  # streams that ever ran a kernel here
        # collectives issued but not yet placed (their start waits for the group): [arrival, host wait]
        self.pending: list[list[int]] = []

    def fold_until(self, host: int) -> int:
        """Up to when reports may fold this core's kernel intervals: the host's tick, or the
        earliest arrival of a collective still to be placed (it may be placed before the host)."""
        if not self.pending:
            return host
        return min(host, min(p[0] for p in self.pending))


def _overlap(lo: int, hi: int, b_start: int, b_end: int) -> float:
    """The fraction of [b_start, b_end) that falls inside [lo, hi)."""
    span = b_end - b_start
    if span <= 0:
        return 0.0
    return max(0, min(hi, b_end) - max(lo, b_start)) / span


def shared_duration(ticks: int, demand: Mapping[str, int], others: list[tuple[int, int, int, dict[str, int]]],
                     start: int, lanes: int) -> int:
    """How long a kernel of ``ticks`` and per-resource ``demand`` takes from ``start`` when
    ``others`` (kernels of other streams) run beside it on ``lanes`` engines of each kind: the
    least window W >= ticks in which, for every resource, its demand plus theirs inside the window
    fits in ``lanes * W`` (found by fixed-point iteration: W only grows and is bounded by the
    others' end)."""
    w = ticks
    for _ in range(64):
        need = ticks
        for res, own in demand.items():
            theirs = sum(d.get(res, 0) * _overlap(start, start + w, bs, be) for _, bs, be, d in others)
            need = max(need, -(-int(own + theirs) // lanes))
        if need <= w:
            return w
        w = need
    return w


class Capture(list):  # type: ignore[type-arg]
    """Launches collected by :meth:`Device.graph` (``keep``) or :meth:`Device.muted`."""

    def __init__(self, keep: bool, hosts: dict[str, int] | None = None):
        super().__init__()
        self.keep = keep
        self.token = 0  # the number the launch log knows it by (Device._collect)
        self.hosts = hosts  # Device.recorded's: the block's host ops, counted here instead of in the reports


LaunchItem = tuple[int, str, OpCost, int, tuple[str, int]]  # a collected launch: core, op, cost, stream, context


def stream_runs(items: Sequence[LaunchItem]) -> Iterator[tuple[int, int, list[tuple[str, OpCost, tuple[str, int]]]]]:
    """Consecutive launches on one (core, stream), as (core, stream, [(op, cost, context), ...])."""
    run: list[tuple[str, OpCost, tuple[str, int]]] = []
    key: tuple[int, int] | None = None
    for core, op, cost, s, ctx in items:
        if key != (core, s) and run:
            assert key is not None
            yield key[0], key[1], run
            run = []
        key = (core, s)
        run.append((op, cost, ctx))
    if run:
        assert key is not None
        yield key[0], key[1], run


def on_fresh_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a new thread (its result or exception comes back here)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run, name="trnsim-simulate", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
