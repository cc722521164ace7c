"""KernelReport: what a kernel cost, as data. Rendering lives in the CLI.

Conventions (also in the README):

* Time starts at tick 0, when the first instruction may issue. ``total`` is the latency until
  the last result is visible in memory (the last DMA completed, or the last engine result
  drained) — not the sum of issue intervals.
* ``cycles`` means cycles of the TensorE clock (``core.tensor.clock``), the clock neuron-profile
  reports kernels in; per-engine busy figures are also given in that engine's own cycles.
* Busy time of an engine is the union of its instructions' intervals (TensorE: LoadStationary
  and MultiplyMoving); ``active_percent`` is busy / total, like neuron-profile's
  ``*_engine_active_time_percent``.
* ``mfu_estimated_percent`` = 2·MACs / (2·PEs·clock · total), neuron-profile's definition;
  ``hfu_estimated_percent`` weighs each matmul by its dtype's PE cost (fp32 x4, fp8 double-row
  x0.5), the BF16-equivalent "hardware FLOPs". Both are against the bf16 peak, so an fp8
  double-row stream shows MFU near 200%. ``mbu_estimated_percent`` is HBM bytes / total over
  the bandwidth one core can reach alone (its DMA engines, capped by its HBM stack);
  ``hbm_bytes_per_s`` is the achieved HBM bandwidth, to set beside the core's share.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, NamedTuple

from ..config import ChipConfig
from ..cores.base import ENGINE_TYPES, Segment
from ..isa import DmaCopy, Instruction, MatMul, MatMulMx, TileAP, Transpose

__all__ = ["KernelReport", "EngineStats", "DmaStats", "build_report", "kernel_figures", "KernelFigures", "union_length", "busiest", "bound_of",
           "RunReport", "OpRow", "CoreStats", "TraceEvent", "CollectiveStats"]


@dataclass(frozen=True)
class EngineStats:
    instructions: int
    busy_ticks: int
    busy_cycles: float  # in the engine's own clock
    busy_us: float
    active_percent: float


@dataclass(frozen=True)
class DmaStats:
    transfers: int
    busy_ticks: int  # any queue moving data (the union of the queues' transfer intervals)
    bytes: int  # moved by the DMA engines (a casting copy counts its wider side)
    average_bytes: float  # neuron-profile's dma_transfer_average_bytes
    active_percent: float  # any queue moving data
    achieved_bytes_per_s: float
    queues: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelReport:
    kernel: str
    config: str
    core: int
    tick_hz: int
    total_ticks: int
    total_cycles: float
    total_us: float
    engines: dict[str, EngineStats]
    dma: DmaStats
    instruction_counts: dict[str, int]
    hbm_read_bytes: int
    hbm_write_bytes: int
    sbuf_read_bytes: int
    sbuf_write_bytes: int
    psum_read_bytes: int
    psum_write_bytes: int
    matmul_flops: int
    achieved_flops_per_s: float
    mfu_estimated_percent: float
    hfu_estimated_percent: float
    mbu_estimated_percent: float
    hbm_bytes_per_s: float
    sbuf_peak_bytes: int
    psum_peak_bytes: int
    timeline: tuple[Segment, ...] = field(repr=False, compare=False, default=())
    # arithmetic the Vector/Scalar/GpSimd engines did (one FLOP per ALU op per element): what a
    # depthwise convolution's taps or a normalisation's sums cost when no matmul does them
    engine_flops: int = 0

    @property
    def total_ns(self) -> float:
        return self.total_ticks * 1e9 / self.tick_hz

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        else:
            d["timeline"] = [list(s) for s in self.timeline]
        return d

    def to_parquet(self, path: Any) -> Any:
        """Write this kernel's metrics as one Parquet row with neuron-profile's names (needs
        pyarrow: ``pip install 'trnsim[metrics]'``); see :mod:`trnsim.sim.metrics`."""
        from .metrics import write_kernel_metrics

        return write_kernel_metrics(path, [self])

    def segments(self, lane: str | None = None) -> list[Segment]:
        return [s for s in self.timeline if lane is None or s[0] == lane]

    @property
    def busy_ticks(self) -> dict[str, int]:
        """Busy ticks per engine (Sync included) and ``"DMA"`` (any queue moving data)."""
        out = {name: e.busy_ticks for name, e in self.engines.items()}
        out["DMA"] = self.dma.busy_ticks
        return out

    @property
    def bound(self) -> str:
        """What limits the kernel: see :func:`bound_of`."""
        return bound_of(self)


def busiest(busy: dict[str, float]) -> str:
    """The one definition of what bounds a piece of work: of the engines with a datapath (Sync,
    which only triggers DMAs, aside: ``Engine.datapath``) and the DMA system (``"DMA"``), the one
    busiest during it. The DMA system is named ``"DMA/HBM"``: its transfers are what HBM
    bandwidth limits."""
    best, top = "DMA/HBM", -1.0
    for name, value in busy.items():
        eng = ENGINE_TYPES.get(name)
        if eng is not None and not eng.datapath:
            continue
        if value > top:
            best, top = ("DMA/HBM" if name == "DMA" else name), value
    return best


def bound_of(report: KernelReport) -> str:
    """The resource that limits a kernel: its busiest engine or the DMA system (:func:`busiest`)."""
    return busiest({name: float(t) for name, t in report.busy_ticks.items()})


def union_length(intervals: Iterable[tuple[int, int]]) -> int:
    total = 0
    cur_lo = cur_hi = None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo  # type: ignore[operator]
            cur_lo, cur_hi = lo, hi
        elif hi > cur_hi:
            cur_hi = hi
    if cur_hi is not None:
        total += cur_hi - cur_lo  # type: ignore[operator]
    return total


_TIMELINE_ORDER = operator.itemgetter(2, 4, 0)  # a segment's start tick, instruction index, lane


def _engine_of_lane(lane: str) -> str:
    if lane.startswith("q"):
        return "DMA"
    return lane.split(" ")[0]


def matmul_flops(ins: MatMul) -> int:
    if isinstance(ins, MatMulMx):  # quad-packed: each partition carries four rows of K
        return 2 * 4 * ins.stationary.p_count * ins.stationary.free_size * ins.moving.free_size
    if ins.double_row:
        k = 2 * ins.stationary.p_count
        m, n = ins.stationary.dims[1][1], ins.moving.dims[1][1]
    else:
        k, m, n = ins.stationary.p_count, ins.stationary.free_size, ins.moving.free_size
    return 2 * k * m * n


class KernelFigures(NamedTuple):
    """What a report reads of a kernel's instructions alone (not of its timeline): the same for
    every core that runs the kernel, so worked out once per kernel (:func:`kernel_figures`)."""

    counts_engine: dict[str, int]
    queues: dict[str, tuple[int, int]]  # queue -> (transfers, bytes)
    dma_transfers: int
    dma_bytes: int
    counts: dict[str, int]
    bytes: dict[str, int]
    flops: int
    eng_flops: int
    hw_flops: float


def kernel_figures(instrs: list[Instruction], config: ChipConfig) -> KernelFigures:
    """What a report reads of ``instrs``, in one pass over them (every count in order of first
    appearance, the FLOPs summed in program order)."""
    counts_engine: dict[str, int] = {}
    counts: dict[str, int] = {}
    queues: dict[str, tuple[int, int]] = {}
    out = dict.fromkeys(("hbm_read", "hbm_write", "sbuf_read", "sbuf_write", "psum_read", "psum_write"), 0)
    kinds: dict[type, int] = {}  # 0 DMA copy, 1 matmul, 2 PE transpose, 3 other
    ndma = dma_bytes = flops = eng_flops = 0
    hw_flops = 0.0
    for ins in instrs:
        eng = ins.engine
        counts_engine[eng] = counts_engine.get(eng, 0) + 1
        op = ins.opcode
        counts[op] = counts.get(op, 0) + 1
        t = type(ins)
        kind = kinds.get(t)
        if kind is None:
            kind = kinds[t] = 0 if issubclass(t, DmaCopy) else 1 if issubclass(t, MatMul) else \
                2 if issubclass(t, Transpose) else 3
        if kind == 0:
            p = ins.plan  # type: ignore[attr-defined]
            b = p.bytes
            ndma += 1
            dma_bytes += b
            n, qb = queues.get(ins.queue, (0, 0))  # type: ignore[attr-defined]
            queues[ins.queue] = (n + 1, qb + b)  # type: ignore[attr-defined]
            out["hbm_read"] += p.hbm_read_bytes
            out["hbm_write"] += p.hbm_write_bytes
            out["sbuf_read"] += p.sbuf_read_bytes
            out["sbuf_write"] += p.sbuf_write_bytes
            continue
        for ap in ins.reads:
            if isinstance(ap, TileAP):
                out[f"{ap.space}_read"] += ap.nbytes
        for ap in ins.writes:
            if isinstance(ap, TileAP):
                out[f"{ap.space}_write"] += ap.nbytes
        if kind == 1:
            f = matmul_flops(ins)  # type: ignore[arg-type]
            flops += f
            rate = config.tensor_rate("mx" if isinstance(ins, MatMulMx) else ins.stationary.dtype.name)  # type: ignore[attr-defined]
            hw_flops += f / rate
        elif kind == 2:
            d = ins.data  # type: ignore[attr-defined]
            hw_flops += 2 * d.p_count * d.p_count * d.free_size
        else:
            eng_flops += _alu_flops(ins)
    return KernelFigures(counts_engine, queues, ndma, dma_bytes, counts, out, flops, eng_flops, hw_flops)


def build_report(kernel_name: str, instrs: list[Instruction], segments: list[Segment], total_ticks: int,
                 config: ChipConfig, core: int, sbuf_peak: int, psum_peak: int,
                 figures: KernelFigures | None = None) -> KernelReport:
    """The report of one core's run of a kernel; ``figures``: :func:`kernel_figures` of
    ``instrs``, when the caller has them."""
    if figures is None:
        figures = kernel_figures(instrs, config)
    tick_hz = config.tick_hz
    total = max(total_ticks, 1)
    seconds = total_ticks / tick_hz
    by_lane: dict[str, list[tuple[int, int]]] = {}
    for lane, _, s, e, _ in segments:
        spans = by_lane.get(lane)
        if spans is None:
            spans = by_lane[lane] = []
        spans.append((s, e))
    by_engine: dict[str, list[tuple[int, int]]] = {}
    for lane, spans in by_lane.items():  # an engine's lanes together (union_length sorts them)
        by_engine.setdefault(_engine_of_lane(lane), []).extend(spans)
    counts_engine = figures.counts_engine
    clocks = config.engine_clocks
    engines: dict[str, EngineStats] = {}
    for name in clocks:
        busy = union_length(by_engine.get(name, []))
        engines[name] = EngineStats(
            instructions=counts_engine.get(name, 0),
            busy_ticks=busy,
            busy_cycles=busy / config.ticks_per_cycle(name),
            busy_us=busy / tick_hz * 1e6,
            active_percent=100.0 * busy / total,
        )
    dma_bytes = figures.dma_bytes
    queues: dict[str, dict[str, float]] = {}
    for lane, (n, b) in figures.queues.items():
        queues[lane] = {"transfers": n, "bytes": b, "busy_us": 0.0}
    for lane in queues:
        queues[lane]["busy_us"] = union_length(by_lane.get(lane, ())) / tick_hz * 1e6
    dma_busy = union_length(by_engine.get("DMA", []))
    ndma = figures.dma_transfers
    dma = DmaStats(
        transfers=ndma,
        busy_ticks=dma_busy,
        bytes=dma_bytes,
        average_bytes=dma_bytes / ndma if ndma else 0.0,
        active_percent=100.0 * dma_busy / total,
        achieved_bytes_per_s=dma_bytes / seconds if seconds else 0.0,
        queues=queues,
    )
    counts = dict(figures.counts)
    b = figures.bytes
    flops, eng_flops, hw_flops = figures.flops, figures.eng_flops, figures.hw_flops
    peak = config.peak_flops_per_core("bf16")
    hbm_bytes = b["hbm_read"] + b["hbm_write"]
    return KernelReport(
        kernel=kernel_name,
        config=config.name,
        core=core,
        tick_hz=tick_hz,
        total_ticks=total_ticks,
        total_cycles=total_ticks / config.ticks_per_cycle("Tensor"),
        total_us=seconds * 1e6,
        engines=engines,
        dma=dma,
        instruction_counts=counts,
        hbm_read_bytes=b["hbm_read"],
        hbm_write_bytes=b["hbm_write"],
        sbuf_read_bytes=b["sbuf_read"],
        sbuf_write_bytes=b["sbuf_write"],
        psum_read_bytes=b["psum_read"],
        psum_write_bytes=b["psum_write"],
        matmul_flops=flops,
        achieved_flops_per_s=flops / seconds if seconds else 0.0,
        mfu_estimated_percent=100.0 * flops / (peak * seconds) if seconds else 0.0,
        hfu_estimated_percent=100.0 * hw_flops / (peak * seconds) if seconds else 0.0,
        mbu_estimated_percent=100.0 * hbm_bytes / (config.hbm_bandwidth_reachable * seconds) if seconds else 0.0,
        hbm_bytes_per_s=hbm_bytes / seconds if seconds else 0.0,
        sbuf_peak_bytes=sbuf_peak,
        psum_peak_bytes=psum_peak,
        timeline=tuple(sorted(segments, key=_TIMELINE_ORDER)),
        engine_flops=eng_flops,
    )


_ARITH = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "power"})


def _alu_flops(ins: Instruction) -> int:
    """FLOPs of one Vector/Scalar/GpSimd instruction: an arithmetic ALU op per element (copies,
    selects, comparisons and table-driven activations count none)."""
    ops = [getattr(ins, a, None) for a in ("op", "op0", "op1")]
    n = sum(1 for o in ops if isinstance(o, str) and o in _ARITH)
    if not n:
        return 0
    data = getattr(ins, "data", None) or getattr(ins, "data1", None)
    return n * data.p_count * data.free_size if data is not None else 0


# ---------------------------------------------------------------------------------------------
# RunReport: where a program's simulated device time went, per op (built by trnsim.device)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """One launch on the device timeline: the host issued it at ``issued``; it ran on ``core``'s
    ``stream`` from ``start`` to ``end`` (ticks). ``source`` is the Python line that launched it
    and ``call`` the host call it belongs to (-1: none), when the front end said
    (:meth:`trnsim.device.Device.set_context`); ``reports`` are the simulated kernels behind it,
    one per physical core (empty for a launch with no kernel, e.g. a collective)."""

    core: int
    stream: int
    op: str
    kernel: str
    issued: int
    start: int
    end: int
    source: str = ""
    call: int = -1
    reports: tuple[KernelReport, ...] = field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class CollectiveStats:
    """What a collective row of a run moved (a row of a collective launched by torch.distributed
    on the ``neuron`` backend). ``bytes`` is nccl-tests' S summed over calls; ``network_us`` this
    rank's time in the NeuronLink model, from the group's start (the last rank's arrival) to its
    completion, summed (the row's ``time_us`` adds the stretch from sharing the core's DMA with
    compute beside it); ``peer_wait_us`` the time this rank had arrived and the group had not;
    ``busbw`` in bytes/s, sum(S x factor) / network time (nccl-tests' definition); ``alone_us``
    the network time the same calls take with the group alone: each call is simulated beside the
    same call of its sibling groups (an SPMD program's other TP or DP groups, which share its
    links, HBM stacks and DMA engines), so ``network_us / alone_us`` is what sharing cost."""

    collective: str  # the NeuronLink model's name: all-reduce, all-gather, reduce-scatter, send-recv, ...
    algorithm: str
    ranks: int  # the group's size
    bytes: int
    network_us: float
    peer_wait_us: float
    busbw: float
    alone_us: float = 0.0

    @property
    def slowdown(self) -> float:
        """network time / the same calls' time alone (1.0: nothing beside them slowed them)."""
        return self.network_us / self.alone_us if self.alone_us > 0 else 1.0


@dataclass(frozen=True)
class OpRow:
    """One (op, kernel) of a run: its launches' device time and what the device did meanwhile."""

    op: str
    kernel: str
    generic: bool  # no library kernel expressed the op: the generic streaming kernel was charged
    calls: int
    time_us: float  # device time of its kernels, summed over calls (start to end of each)
    share_percent: float  # of the report's summed device time
    host_wait_us: float  # the device idle before these launches, waiting for the host to issue them
    engine_percent: dict[str, float]  # busy / time per engine and "DMA", over the physical cores used
    hbm_bytes: int
    matmul_flops: int
    mfu_percent: float  # matmul FLOPs / (bf16 peak of a logical core x time)
    bound: str  # "launch" where the device waited on the host longer than it worked, else busiest()
    #  (a collective: what held it back in the NeuronLink model: link, HBM, DMA, VectorE or latency)
    # a compiled region's row: the aten ops its one kernel fused and what they cost run eagerly
    fused_ops: tuple[str, ...] = ()
    eager_launches: int = 0  # launches the fused ops would take as eager kernels (over all calls)
    eager_hbm_bytes: int = 0  # HBM bytes they would move
    eager_time_us: float = 0.0  # device time they would take
    engine_flops: int = 0  # arithmetic on the Vector/Scalar/GpSimd engines (KernelReport.engine_flops)
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    dma_bytes: int = 0  # moved by the DMA engines of its kernels (a casting copy counts its wider side)
    source_line: str = ""  # the Python line whose launches of this row took the most device time, if tracked
    collective: CollectiveStats | None = None  # set on collective rows only (torch.distributed)

    @property
    def is_region(self) -> bool:
        return bool(self.fused_ops)


@dataclass(frozen=True)
class CoreStats:
    """One logical NeuronCore over a report's scope (microseconds of simulated time)."""

    elapsed_us: float  # from the scope's start to the core's last kernel end
    busy_us: float  # union of its kernels' intervals (streams that overlap count once)
    host_wait_us: float  # idle, waiting for the host to issue the next kernel
    launches: int
    device_us: float = 0.0  # its kernels' times summed: above busy_us by the time streams ran side by side

    @property
    def overlap_us(self) -> float:
        """Kernel time that ran beside another stream's kernel on this core."""
        return max(0.0, self.device_us - self.busy_us)


@dataclass(frozen=True)
class RunReport:
    """Where a run's simulated time went. Time figures are separate on purpose: ``elapsed_us``
    is simulated wall time (the scope's start to the last result, the host included);
    ``device_us`` sums device time over cores and streams (work that ran in parallel adds up)."""

    config: str
    rows: tuple[OpRow, ...]  # busiest first
    host_ops: dict[str, int]  # metadata-only ops (views, ...): run on the host, no device kernel
    cores: dict[int, CoreStats]  # logical core index -> its figures
    elapsed_us: float
    device_us: float  # sum of row times
    host_us: float  # host time spent issuing launches (dispatch, and waiting for room in a full queue)
    host_wait_us: float  # summed over cores: device idle waiting on the host
    launches: int  # ops that ran a kernel (or a launch with no work)
    hbm_bytes: int
    matmul_flops: int
    mfu_percent: float  # matmul FLOPs over the bf16 peak of the cores used, for the elapsed time
    events: tuple[TraceEvent, ...] = ()
    tick_hz: int = 1
    engine_flops: int = 0  # arithmetic on the Vector/Scalar/GpSimd engines (depthwise convolutions, norms, ...)
    dispatches: int = 0  # host dispatches: one per eager launch, one per graph launch (a compiled graph)
    graph_launches: int = 0  # dispatches that issued a graph of kernels
    compiled_graphs: int = 0  # graphs torch.compile compiled in this scope
    compile_seconds: float = 0.0  # their compile wall time (never charged to the device)
    contention_us: float = 0.0  # kernels' time added by sharing a core's engines with other streams' kernels

    @property
    def regions(self) -> tuple[OpRow, ...]:
        """The rows of compiled regions (one fused kernel each)."""
        return tuple(r for r in self.rows if r.is_region)

    @property
    def launches_saved(self) -> int:
        """Kernel launches the compiled regions' fused kernels saved against their ops run eagerly."""
        return sum(r.eager_launches - r.calls for r in self.regions)

    @property
    def hbm_bytes_saved(self) -> int:
        """HBM bytes the compiled regions' fused kernels saved against their ops run eagerly."""
        return sum(r.eager_hbm_bytes - r.hbm_bytes for r in self.regions)

    @property
    def host_only_calls(self) -> int:
        return sum(self.host_ops.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, events=()))  # events hold kernel reports: never deep-copied
        d.pop("events")
        d["host_only_calls"] = self.host_only_calls
        d["launches_saved"] = self.launches_saved
        d["hbm_bytes_saved"] = self.hbm_bytes_saved
        d["overlap_us"] = self.overlap_us
        return d

    @property
    def overlap_us(self) -> float:
        """Device time that ran beside another stream's kernel on the same core (summed over
        cores): why ``device_us`` can exceed the elapsed time."""
        return sum(c.overlap_us for c in self.cores.values())

    def to_parquet(self, path: Any) -> Any:
        """Write one row per (op, kernel) with neuron-profile's metric names as a Parquet file
        (needs pyarrow: ``pip install 'trnsim[metrics]'``); see :mod:`trnsim.sim.metrics`."""
        from .metrics import write_run_metrics

        return write_run_metrics(path, self)

    def row(self, op: str) -> OpRow:
        """The busiest row of ``op`` (KeyError if the op launched nothing in this report)."""
        for r in self.rows:
            if r.op == op:
                return r
        raise KeyError(f"op '{op}' launched no kernel on the neuron device in this report")

    def __str__(self) -> str:
        head = (f"neuron run report ({self.config}): {self.elapsed_us:,.1f} us elapsed, {self.launches} launches "
                f"({self.device_us:,.1f} us device time, {self.host_wait_us:,.1f} us waiting on the host), "
                f"{self.host_only_calls} host-only ops, HBM {self.hbm_bytes / 1e6:,.2f} MB, MFU {self.mfu_percent:.1f}%")
        ow = max([28] + [len(r.op) for r in self.rows])  # op names are whole: they are what users look up
        lines = [head, f"{'op':<{ow}} {'kernel':<28} {'calls':>6} {'time us':>11} {'share':>6} {'MFU':>6}  bound"]
        for r in self.rows:
            lines.append(f"{r.op:<{ow}} {r.kernel[:28]:<28} {r.calls:>6} {r.time_us:>11,.1f} "
                         f"{r.share_percent:>5.1f}% {r.mfu_percent:>5.1f}%  {r.bound}")
        return "\n".join(lines)
