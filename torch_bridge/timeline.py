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
    """Accumulates op records for one report scope (the process-wide one, or a ``with`` block)."""

    def __init__(self, trace: bool = False):
        self.records: dict[tuple[str, str], OpRecord] = {}
        self.events: list[TraceEvent] | None = [] if trace else None
        self.first_tick: dict[int, int] = {}
        self.last_tick: dict[int, int] = {}

    def add(self, device: int, stream: int, op: str, kernel: str, generic: bool, rep: KernelReport | None,
            start: int, end: int, launch: int) -> None:
        rec = self.records.get((op, kernel))
        if rec is None:
            rec = self.records[(op, kernel)] = OpRecord(op, kernel, generic)
        rec.calls += 1
        rec.ticks += end - start
        rec.launch_ticks += launch
        if rep is not None:
            for name, e in rep.engines.items():
                rec.engine_busy_ticks[name] = rec.engine_busy_ticks.get(name, 0) + e.busy_ticks
            rec.dma_busy_ticks += round(rep.dma.active_percent * max(rep.total_ticks, 1) / 100)
            rec.hbm_bytes += rep.hbm_read_bytes + rep.hbm_write_bytes
            rec.flops += rep.matmul_flops
        self.first_tick[device] = min(self.first_tick.get(device, start), start)
        self.last_tick[device] = max(self.last_tick.get(device, end), end)
        if self.events is not None:
            self.events.append(TraceEvent(device, stream, op, kernel, start, end))


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
