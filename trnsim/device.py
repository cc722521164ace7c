"""The device model: a chip's logical NeuronCores over time.

Every front end charges its work here - the ``neuron`` PyTorch device's eager ops, compiled
regions, timing-only runs, collectives - as *launches* of kernels whose cost the scheduler
(:mod:`trnsim.sim`) simulated once and this module caches. Only this module knows time across
kernels; only the scheduler knows time inside one. It needs no torch: a kernel is named by a
:class:`KernelSpec` (a library kernel, its shape, dtype and parameters: metadata, never values).

The model, in integer ticks of the chip config (``config.tick_hz``):

* **Host.** One host thread issues every launch. A launch costs the host ``host.dispatch`` (a
  config figure) and the host runs ahead of the device: it waits for the device only when the
  program synchronises (:meth:`Device.synchronize`: reading a value, copying to the host, an
  event's synchronize) or when ``host.max_inflight`` launches of a core are still unfinished (the
  runtime's queue is full). Metadata-only ops (views) launch nothing: :meth:`Device.host_op`
  counts them and they cost neither host nor device time.
* **Streams.** Each logical core has streams (0 is the default). A kernel starts when its
  stream's previous kernel has finished and the host has issued it, so the device idles,
  *waiting on the host*, when its kernels are shorter than the host's dispatch time.
* **LNC.** A logical core of LNC=2 runs each kernel on both of its physical cores: the op's work
  is split the way the library's SPMD kernels split it (the registry's ``split`` rule) and the
  halves are simulated together, sharing their HBM stack. A kernel that cannot be split runs on
  one physical core.
* **Concurrent streams share the core's engines** (an approximation). A kernel's demand on each
  resource (TensorE, VectorE, ScalarE, GpSimd, DMA: busy ticks from its simulation) is taken as
  spread evenly over its duration. A kernel that starts while kernels of other streams of its
  core are running is stretched until, for every resource, its own demand plus theirs within its
  window fits in the window (``lnc`` physical engines of each kind). Kernels already placed keep
  their times: the later launch absorbs the contention. So two TensorE-bound kernels on two
  streams take about as long as one after the other, while a TensorE-bound and a DMA-bound one
  overlap. Logical cores do not contend with each other (at LNC=2 each has its own HBM stack).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .chip import Chip
from .config import ChipConfig
from .isa import KernelError
from .kernel import Kernel
from .report import CoreStats, KernelReport, OpRow, RunReport, TraceEvent, busiest

__all__ = ["KernelSpec", "OpCost", "Device", "Recorder", "no_work", "COLLECTIVE_STREAM"]

# The stream collectives run on (a logical core's CC cores drive their DMA, beside compute): a
# collective launched with Device.launch_collective waits for the compute issued before it.
COLLECTIVE_STREAM = -1


@dataclass(frozen=True)
class KernelSpec:
    """The kernel an op lowers to, as metadata: a library kernel by ``kernel`` name (or
    ``"stream"``: :mod:`trnsim.kernels.generic`), its ``shape`` (the registry's dims), ``dtype``
    (a trnsim dtype name) and ``params`` (sorted name/value pairs). ``label`` is what reports show
    (default: the kernel's name), ``generic`` marks a kernel that stands in for an op no library
    kernel expresses, and ``fallback`` is tried when the kernel refuses the shape."""

    kernel: str
    shape: tuple[int, ...]
    dtype: str
    params: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    generic: bool = False
    fallback: KernelSpec | None = None

    @staticmethod
    def of(kernel: str, shape: Sequence[int], dtype: str, params: Mapping[str, Any] | None = None, *,
           label: str = "", generic: bool = False, fallback: KernelSpec | None = None) -> KernelSpec:
        return KernelSpec(kernel, tuple(int(d) for d in shape), dtype, tuple(sorted((params or {}).items())),
                          label, generic, fallback)

    @property
    def name(self) -> str:
        return self.label or self.kernel


@dataclass(frozen=True, eq=False)
class OpCost:
    """What one launch of a kernel costs on a logical core: its duration (``ticks``, the slowest
    physical core's kernel), each resource's busy ticks summed over the ``cores`` physical cores
    it ran on (engines by name, and ``"DMA"``: any queue moving data), HBM bytes and matmul FLOPs;
    ``reports`` are the simulated kernels' own reports (one per physical core).

    ``demand`` is what the kernel asks of each shared resource when streams run side by side: the
    engines' busy ticks, and for ``"DMA"`` the ticks its bytes take at the full bandwidth one core
    reaches (a queue can be active while moving a trickle, so active time overstates its share)."""

    kernel: str
    generic: bool
    ticks: int
    busy: dict[str, int]
    cores: int
    hbm_bytes: int
    matmul_flops: int
    demand: dict[str, int] = field(default_factory=dict)
    reports: tuple[KernelReport, ...] = field(default=(), repr=False)
    engine_flops: int = 0  # arithmetic on the Vector/Scalar/GpSimd engines

    @staticmethod
    def of_reports(label: str, generic: bool, reports: Sequence[KernelReport], dma_bytes_per_s: float) -> OpCost:
        """The cost of ``reports`` run side by side (one per physical core); ``dma_bytes_per_s``
        is what one core's DMA reaches (its engines, capped by its HBM stack)."""
        busy: dict[str, int] = {}
        for r in reports:
            for name, t in r.busy_ticks.items():
                busy[name] = busy.get(name, 0) + t
        demand = {name: t for name, t in busy.items() if name not in ("DMA", "Sync")}
        demand["DMA"] = sum(-(-r.dma.bytes * r.tick_hz // int(dma_bytes_per_s)) for r in reports)
        return OpCost(label, generic, max(r.total_ticks for r in reports), busy, len(reports),
                      sum(r.hbm_read_bytes + r.hbm_write_bytes for r in reports),
                      sum(r.matmul_flops for r in reports), demand, tuple(reports),
                      sum(r.engine_flops for r in reports))


def no_work(label: str) -> OpCost:
    """A launch with nothing for the device to do (an empty matmul): it costs the host only."""
    return OpCost(label, False, 0, {}, 1, 0, 0, {})


# ---------------------------------------------------------------------------------------------
# recording launches for reports
# ---------------------------------------------------------------------------------------------


class _CoreTally:
    """One core's figures within one recorder: launches, host wait, and the union of its kernels'
    intervals, kept as merged open intervals folded into ``busy`` once the host has passed them
    (new kernels never start before the host's issue time)."""

    __slots__ = ("launches", "wait", "busy", "open", "last_end")

    def __init__(self) -> None:
        self.launches = 0
        self.wait = 0
        self.busy = 0
        self.open: list[list[int]] = []
        self.last_end = 0

    def add(self, start: int, end: int, host: int) -> None:
        if end > self.last_end:
            self.last_end = end
        if end <= start:
            return
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
    ``add`` runs once per launch, so it only counts; :meth:`Device.report` makes the totals."""

    def __init__(self, start: int, trace: bool = False):
        self.start = start
        self.rows: dict[tuple[str, int], list[Any]] = {}  # (op, id(cost)) -> [cost, calls, ticks, wait]
        self.host_ops: dict[str, int] = {}
        self.cores: dict[int, _CoreTally] = {}
        self.host_ticks = 0
        self.events: list[TraceEvent] | None = [] if trace else None


# ---------------------------------------------------------------------------------------------
# the cores and the host
# ---------------------------------------------------------------------------------------------


class _Core:
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


def _overlap(lo: int, hi: int, b_start: int, b_end: int) -> float:
    """The fraction of [b_start, b_end) that falls inside [lo, hi)."""
    span = b_end - b_start
    if span <= 0:
        return 0.0
    return max(0, min(hi, b_end) - max(lo, b_start)) / span


def _shared_duration(ticks: int, demand: Mapping[str, int], others: list[tuple[int, int, int, dict[str, int]]],
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


class Device:
    """A chip's logical NeuronCores, their streams and the host that feeds them, with a cache of
    simulated kernel costs. Thread-safe: launches from several threads are serialised."""

    def __init__(self, config: ChipConfig):
        self.config = config
        self.chip = Chip(config)
        self.lnc = config.chip.lnc
        self.dispatch = config.ps_to_ticks(config.host.dispatch)
        self.host = 0  # the host's clock: when it will issue its next launch
        self.cores = [_Core(i, config.host.max_inflight) for i in range(config.logical_cores)]
        self.recorders: list[Recorder] = [Recorder(0)]  # [0]: since start (or the last reset)
        self._costs: dict[KernelSpec, OpCost] = {}
        self._rejected: set[KernelSpec] = set()
        self.simulated = 0  # kernels actually simulated (cost-cache misses)
        self._lock = threading.RLock()

    @property
    def core_count(self) -> int:
        return len(self.cores)

    # ---- costs -----------------------------------------------------------------------------
    def cost(self, spec: KernelSpec) -> OpCost:
        """The cost of one launch of ``spec``, simulated once per spec (timing only) and cached.
        A kernel that refuses the shape (``KernelError``) falls back to ``spec.fallback``."""
        hit = self._costs.get(spec)
        if hit is not None:
            return hit
        with self._lock:
            try:
                if spec in self._rejected:
                    raise KernelError(f"kernel '{spec.kernel}' refused {spec.shape}")
                cost = self._simulate(spec)
            except KernelError:
                if spec.fallback is None:
                    raise
                self._rejected.add(spec)
                cost = self.cost(spec.fallback)
            self._costs[spec] = cost
            return cost

    def kernels_of(self, spec: KernelSpec) -> list[Kernel]:
        """The kernels ``spec`` runs as on one logical core: one per physical core it uses."""
        from .kernels import build_spec, split_spec

        params = dict(spec.params)
        shapes = split_spec(spec.kernel, spec.shape, params, self.lnc)
        return [build_spec(spec.kernel, s, spec.dtype, self.config, params) for s in shapes]

    def _simulate(self, spec: KernelSpec) -> OpCost:
        kernels = self.kernels_of(spec)
        results = self.chip.run_spmd(kernels, timing_only=True)
        self.simulated += len(kernels)
        return OpCost.of_reports(spec.name, spec.generic, [r.report for r in results],
                                 self.config.hbm_bandwidth_reachable)

    def collective_cost(self, report: Any, rank: int) -> OpCost:
        """A simulated collective (:class:`trnsim.collectives.CollectiveReport`) as a launch on
        ``rank``'s logical core: from the rank's start to its completion, with the bytes its DMA
        engines moved as its DMA demand (so kernels on other streams of the core share DMA with
        it, and it with them)."""
        i = report.group.index(rank)
        ticks = report.end_ticks[i] - report.start_ticks[i]
        dma = report.dma_bytes.get(rank, 0)
        demand = {"DMA": -(-dma * self.config.tick_hz // int(self.config.hbm_bandwidth_reachable))}
        busy = {"DMA": min(ticks * self.lnc, demand["DMA"])}
        return OpCost(f"{report.collective}:{report.algorithm}", False, ticks, busy, self.lnc,
                      sum(report.hbm_bytes.values()) // max(1, len(report.group)), 0, demand)

    # ---- time ------------------------------------------------------------------------------
    def launch_collective(self, core: int, op: str, cost: OpCost, after: int | None = None) -> tuple[int, int]:
        """Issue a collective's launch on ``core``'s :data:`COLLECTIVE_STREAM`: it starts once the
        work already issued on compute stream ``after`` (default: the core's current stream)
        has finished, as a collective waits for the data it sends, and overlaps what is issued
        after it."""
        with self._lock:
            c = self.cores[core]
            self.stream_wait(core, COLLECTIVE_STREAM, c.ready.get(c.current_stream if after is None else after, 0))
            return self.launch(core, op, cost, stream=COLLECTIVE_STREAM)

    def launch(self, core: int, op: str, cost: OpCost, stream: int | None = None) -> tuple[int, int]:
        """Issue one launch of ``cost`` for ``op`` on ``core``'s ``stream`` (default: the core's
        current stream); returns its (start, end) ticks."""
        with self._lock:
            c = self.cores[core]
            s = c.current_stream if stream is None else stream
            host = self.host
            if len(c.inflight) >= c.max_inflight:  # the runtime's queue is full: wait for the oldest
                oldest = c.inflight.popleft()
                if oldest > host:
                    host = oldest
            host += self.dispatch
            host_ticks = host - self.host
            self.host = host
            ready = c.ready.get(s, 0)
            start = ready if ready > host else host
            wait = host - max(ready, c.busy_until)
            if wait < 0:
                wait = 0
            ticks = cost.ticks
            if s not in c.streams:
                c.streams.add(s)
            if len(c.streams) > 1:
                others = [b for b in c.bookings if b[0] != s and b[2] > start]
                if others:
                    ticks = _shared_duration(ticks, cost.demand, others, start, self.lnc)
            end = start + ticks
            c.ready[s] = end
            if end > c.busy_until:
                c.busy_until = end
            if ticks:
                c.bookings.append((s, start, end, cost.demand))
                c.inflight.append(end)
            key = (op, id(cost))
            for rec in self.recorders:
                row = rec.rows.get(key)
                if row is None:
                    rec.rows[key] = [cost, 1, ticks, wait]
                else:
                    row[1] += 1
                    row[2] += ticks
                    row[3] += wait
                tally = rec.cores.get(core)
                if tally is None:
                    tally = rec.cores[core] = _CoreTally()
                tally.launches += 1
                tally.wait += wait
                tally.add(start, end, host)
                rec.host_ticks += host_ticks
                if rec.events is not None:
                    rec.events.append(TraceEvent(core, s, op, cost.kernel, host, start, end))
            return start, end

    def host_op(self, op: str) -> None:
        """Count a metadata-only op: it runs on the host alone (no launch, no device time)."""
        with self._lock:
            for rec in self.recorders:
                rec.host_ops[op] = rec.host_ops.get(op, 0) + 1

    def synchronize(self, core: int | None = None, stream: int | None = None) -> None:
        """The host waits until ``stream`` of ``core`` (every stream; every core) has finished."""
        with self._lock:
            cores = self.cores if core is None else [self.cores[core]]
            for c in cores:
                ready = c.ready.values() if stream is None else [c.ready.get(stream, 0)]
                self.host = max(self.host, *ready)

    def wait_host_until(self, tick: int) -> None:
        """The host waits until simulated time ``tick`` (an event's synchronize)."""
        with self._lock:
            if tick > self.host:
                self.host = tick

    def stream_ready(self, core: int, stream: int) -> int:
        """When the last work issued on ``stream`` of ``core`` finishes."""
        return self.cores[core].ready.get(stream, 0)

    def stream_wait(self, core: int, stream: int, tick: int) -> None:
        """Work issued later on ``stream`` of ``core`` starts no earlier than ``tick``."""
        with self._lock:
            c = self.cores[core]
            c.ready[stream] = max(c.ready.get(stream, 0), tick)

    def now(self, core: int | None = None) -> int:
        """The latest simulated time the host or any work on ``core`` (every core) reaches."""
        cores = self.cores if core is None else [self.cores[core]]
        return max([self.host, *(t for c in cores for t in c.ready.values())])

    # ---- reports ---------------------------------------------------------------------------
    def open_scope(self, trace: bool = False) -> Recorder:
        """Start recording launches from now (a report scope); close it with :meth:`close_scope`."""
        with self._lock:
            rec = Recorder(self.host, trace)
            self.recorders.append(rec)
            return rec

    def close_scope(self, rec: Recorder) -> RunReport:
        with self._lock:
            self.recorders.remove(rec)
            return self.report(rec)

    def reset(self, trace: bool = False) -> None:
        """Start the whole-run recorder afresh (``trace``: keep every launch for a timeline)."""
        with self._lock:
            self.recorders[0] = Recorder(self.host, trace)

    def report(self, rec: Recorder | None = None) -> RunReport:
        """The :class:`RunReport` of ``rec`` (default: the whole run since start or reset)."""
        with self._lock:
            return self._build_report(rec or self.recorders[0])

    def _build_report(self, rec: Recorder) -> RunReport:
        cfg = self.config
        hz = cfg.tick_hz
        peak = cfg.peak_flops_per_core("bf16") * self.lnc  # a logical core: its physical cores' peak
        acc: dict[tuple[str, str], dict[str, Any]] = {}
        for (op, _), (cost, calls, ticks, wait) in rec.rows.items():
            a = acc.get((op, cost.kernel))
            if a is None:
                a = acc[(op, cost.kernel)] = {"generic": cost.generic, "calls": 0, "ticks": 0, "wait": 0,
                                              "lane_ticks": 0, "busy": {}, "hbm": 0, "flops": 0, "eflops": 0}
            a["calls"] += calls
            a["ticks"] += ticks
            a["wait"] += wait
            a["lane_ticks"] += ticks * cost.cores
            for name, t in cost.busy.items():
                a["busy"][name] = a["busy"].get(name, 0) + calls * t
            a["hbm"] += calls * cost.hbm_bytes
            a["flops"] += calls * cost.matmul_flops
            a["eflops"] += calls * cost.engine_flops
        device_ticks = sum(a["ticks"] for a in acc.values())
        rows = []
        for (op, kernel), a in acc.items():
            lane = a["lane_ticks"]
            engines = {n: 100.0 * b / lane for n, b in a["busy"].items()} if lane else {}
            seconds = a["ticks"] / hz
            bound = "launch" if a["wait"] >= a["ticks"] else busiest(engines)
            rows.append(OpRow(
                op=op, kernel=kernel, generic=a["generic"], calls=a["calls"], time_us=seconds * 1e6,
                share_percent=100.0 * a["ticks"] / device_ticks if device_ticks else 0.0,
                host_wait_us=a["wait"] / hz * 1e6, engine_percent=engines, hbm_bytes=a["hbm"],
                matmul_flops=a["flops"], mfu_percent=100.0 * a["flops"] / (peak * seconds) if seconds else 0.0,
                bound=bound, engine_flops=a["eflops"]))
        rows.sort(key=lambda r: (-r.time_us, r.op, r.kernel))
        end = max([self.host, *(t.last_end for t in rec.cores.values())])
        elapsed = end - rec.start
        cores = {i: CoreStats(elapsed_us=(t.last_end - rec.start) / hz * 1e6, busy_us=t.busy_ticks() / hz * 1e6,
                              host_wait_us=t.wait / hz * 1e6, launches=t.launches)
                 for i, t in sorted(rec.cores.items())}
        flops = sum(r.matmul_flops for r in rows)
        span = elapsed / hz * max(1, len(cores))
        return RunReport(
            config=cfg.name, rows=tuple(rows), host_ops=dict(sorted(rec.host_ops.items())), cores=cores,
            elapsed_us=elapsed / hz * 1e6, device_us=device_ticks / hz * 1e6, host_us=rec.host_ticks / hz * 1e6,
            host_wait_us=sum(t.wait for t in rec.cores.values()) / hz * 1e6,
            launches=sum(r.calls for r in rows), hbm_bytes=sum(r.hbm_bytes for r in rows), matmul_flops=flops,
            mfu_percent=100.0 * flops / (peak * span) if span else 0.0,
            events=tuple(rec.events or ()), tick_hz=hz, engine_flops=sum(r.engine_flops for r in rows))

