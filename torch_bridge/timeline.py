"""Simulated time of each NeuronCore: streams, events, the host's view, and op accounting.

Time is an integer count of the config's ticks (``config.tick_hz``). The host is modelled as
issuing instantly: an op launched on a stream starts when that stream's previous work is done
(and not before the last moment the host synchronized), occupies the stream for a launch
overhead plus its kernel's simulated time, and moves the stream's ready time on. Different
streams of one core run concurrently on the timeline (like CUDA streams); contention between
concurrent kernels for the core's engines is not modelled.

Values are computed eagerly, so "not yet complete" is only a statement about simulated time:
``Event.query()`` is False until the host has synchronized past the event, exactly as a CUDA
program would observe it if the host were infinitely fast.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from trnsim import ChipConfig, KernelReport

__all__ = ["LAUNCH_OVERHEAD_NS", "CoreClock", "OpRecord", "Collector", "TraceEvent"]

# Host-to-device launch cost charged before every op's kernel, in ns. No datasheet figure
# exists for the Neuron runtime's per-kernel launch; estimate: the same order as a CUDA kernel
# launch (a few microseconds), which eager-mode PyTorch on an accelerator always pays.
LAUNCH_OVERHEAD_NS = 4_000


@dataclass
class OpRecord:
    """Totals for one (op, kernel) pair in a report."""

    op: str
    kernel: str
    generic: bool
    calls: int = 0
    ticks: int = 0  # launch overhead + kernel time, summed over calls
    launch_ticks: int = 0
    engine_busy_ticks: dict[str, int] = field(default_factory=dict)
    dma_busy_ticks: int = 0
    hbm_bytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class TraceEvent:
    device: int
    stream: int
    op: str
    kernel: str
    start: int
    end: int


class Collector:
    """Counts launches for one report scope (the process-wide one, or a ``with`` block).

    ``add`` runs once per op call, so it only counts: launches of the same (op, kernel report)
    cost the same, and :meth:`records` turns the counts into totals when a report is built."""

    def __init__(self, trace: bool = False):
        self.counts: dict[tuple[str, str, bool, int], list[Any]] = {}  # -> [report or None, calls]
        self.events: list[TraceEvent] | None = [] if trace else None
        self.first_tick: dict[int, int] = {}
        self.last_tick: dict[int, int] = {}

    def add(self, device: int, stream: int, op: str, kernel: str, generic: bool, rep: KernelReport | None,
            start: int, end: int) -> None:
        key = (op, kernel, generic, id(rep))  # reports live in the kernel cache: their ids are stable
        entry = self.counts.get(key)
        if entry is None:
            self.counts[key] = [rep, 1]
        else:
            entry[1] += 1
        if start < self.first_tick.get(device, start + 1):
            self.first_tick[device] = start
        if end > self.last_tick.get(device, -1):
            self.last_tick[device] = end
        if self.events is not None:
            self.events.append(TraceEvent(device, stream, op, kernel, start, end))

    def records(self, launch_ticks: int) -> list[OpRecord]:
        """Totals per (op, kernel), each launch costing ``launch_ticks`` plus its kernel."""
        out: dict[tuple[str, str], OpRecord] = {}
        for (op, kernel, generic, _), (rep, calls) in self.counts.items():
            rec = out.get((op, kernel))
            if rec is None:
                rec = out[(op, kernel)] = OpRecord(op, kernel, generic)
            rec.calls += calls
            rec.launch_ticks += calls * launch_ticks
            rec.ticks += calls * (launch_ticks + (rep.total_ticks if rep is not None else 0))
            if rep is not None:
                for name, e in rep.engines.items():
                    rec.engine_busy_ticks[name] = rec.engine_busy_ticks.get(name, 0) + calls * e.busy_ticks
                rec.dma_busy_ticks += calls * round(rep.dma.active_percent * max(rep.total_ticks, 1) / 100)
                rec.hbm_bytes += calls * (rep.hbm_read_bytes + rep.hbm_write_bytes)
                rec.flops += calls * rep.matmul_flops
        return list(out.values())


class CoreClock:
    """One logical NeuronCore's timeline: per-stream ready times and the host's synchronized time."""

    def __init__(self, index: int):
        self.index = index
        self.ready: dict[int, int] = {0: 0}
        self.host = 0
        self.current_stream = 0

    def launch(self, stream: int, ticks: int) -> tuple[int, int]:
        """Occupy ``stream`` for ``ticks``; returns (start, end)."""
        start = max(self.ready.get(stream, 0), self.host)
        end = start + ticks
        self.ready[stream] = end
        return start, end

    def synchronize(self, stream: int | None = None) -> None:
        """The host waits for ``stream`` (or every stream) to finish."""
        if stream is None:
            self.host = max([self.host, *self.ready.values()])
        else:
            self.host = max(self.host, self.ready.get(stream, 0))

    def now(self) -> int:
        """The latest simulated time any work on this core reaches."""
        return max([self.host, *self.ready.values()])


_stream_ids = itertools.count(1)
_lock = threading.Lock()


def new_stream_id() -> int:
    with _lock:
        return next(_stream_ids)


def launch_ticks(config: ChipConfig) -> int:
    return config.ps_to_ticks(LAUNCH_OVERHEAD_NS * 1000)


def ticks_to_ms(config: ChipConfig, ticks: int) -> float:
    return ticks * 1e3 / config.tick_hz
