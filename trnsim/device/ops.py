"""What the device model is told and answers: a kernel named by its :class:`KernelSpec`, a
compiled region (:class:`FusedRegion`), a collective launch, the cost of an op (:class:`OpCost`),
and the :class:`LaunchLog` protocol of launches a front end logged natively."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Protocol, Sequence

from ..cores.base import datapath_engines
from ..sim.report import KernelReport

# The stream collectives run on (a logical core's CC cores drive their DMA, beside compute): a
# collective launched with Device.launch_collective waits for the compute issued before it.
COLLECTIVE_STREAM = -1


def collective_stream(lane: int) -> int:
    """The device stream of a core's CC stream ``lane`` (0: :data:`COLLECTIVE_STREAM`; NxD's
    multistream mode runs FSDP/DP collectives on lane 1): -1, -2, ..."""
    return COLLECTIVE_STREAM - lane


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


@dataclass(frozen=True)
class FusedRegion:
    """What one compiled region's kernel stands in for: the ``ops`` it fused (aten op names, in
    graph order) and what they cost run one by one as eager kernels (launches, HBM bytes, device
    ticks), so reports can say what fusing saved."""

    ops: tuple[str, ...]
    eager_launches: int
    eager_hbm_bytes: int
    eager_ticks: int


class CollectiveLaunch(NamedTuple):
    """What a collective launch moved, for its report row: the NeuronLink model's ``collective``
    and ``algorithm``, the group's size, nccl-tests' S (``nbytes``), this rank's time in the model
    (``network_ticks``, from the group's start to its completion) and the busbw factor."""

    collective: str
    algorithm: str
    ranks: int
    nbytes: int
    network_ticks: int
    busbw_factor: float
    bound: str  # what held the call back in the model: link, HBM, DMA, VectorE or latency
    alone_ticks: int = -1  # this rank's time had the group run alone (no sibling groups beside it); -1: it did


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
    region: FusedRegion | None = None  # set when the kernel runs a compiled region
    engine_flops: int = 0  # arithmetic on the Vector/Scalar/GpSimd engines
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    dma_bytes: int = 0
    collective: CollectiveLaunch | None = None  # set on a collective's launch (Device.collective_cost)

    @staticmethod
    def of_reports(label: str, generic: bool, reports: Sequence[KernelReport], dma_bytes_per_s: float) -> OpCost:
        """The cost of ``reports`` run side by side (one per physical core); ``dma_bytes_per_s``
        is what one core's DMA reaches (its engines, capped by its HBM stack)."""
        busy: dict[str, int] = {}
        for r in reports:
            for name, t in r.busy_ticks.items():
                busy[name] = busy.get(name, 0) + t
        demand = {name: t for name, t in busy.items() if name in datapath_engines()}
        demand["DMA"] = sum(-(-r.dma.bytes * r.tick_hz // int(dma_bytes_per_s)) for r in reports)
        reads, writes = sum(r.hbm_read_bytes for r in reports), sum(r.hbm_write_bytes for r in reports)
        return OpCost(label, generic, max(r.total_ticks for r in reports), busy, len(reports), reads + writes,
                      sum(r.matmul_flops for r in reports), demand, tuple(reports), hbm_read_bytes=reads,
                      hbm_write_bytes=writes, dma_bytes=sum(r.dma.bytes for r in reports),
                      engine_flops=sum(r.engine_flops for r in reports))


def no_work(label: str) -> OpCost:
    """A launch with nothing for the device to do (an empty matmul): it costs the host only."""
    return OpCost(label, False, 0, {}, 1, 0, 0, {})


class LaunchLog(Protocol):
    """Launches a front end made without calling :meth:`Device.launch` (the ``neuron`` device's
    native fast path), for the device to issue exactly as if they had been: each entry is
    (core, op, cost, (op, id(cost)), token) on the core's stream 0 with no launch context, or
    (core, op, None, None, 0) for a metadata-only op (:meth:`Device.host_op`), or (core, None,
    None, None, 0) for the host waiting for the core's work (:meth:`Device.synchronize` of that core,
    made where the entry stands: a front end's ``item()``). ``token`` is 0,
    or the graph capture (:meth:`Device.graph`, :meth:`Device.muted`) the launching thread was
    in, as the device told the log (``capture``) on that thread: the launch is collected there,
    as :meth:`Device.launch` inside the block collects it. The device takes them, in order,
    before it issues anything else or reads any time, and tells the log (``gate``) whether
    launches may be logged at all: only while nothing a launch depends on at the moment it is
    made (adaptive eager, a launch context, a stream other than the default) is in effect.
    A log may also offer ``place`` (the common case's placement, natively), ``take_captured``
    (a prefix of captured launches and host ops in bulk) and ``close(token, keep)`` (the end of a
    capture whose launches are all in the log, logged in its place: ``take`` gives it as (-1, None,
    None, None, token), where the device issues what the capture collected, or drops it for a
    muted block, as the block's end would have; False when it was not logged); the device uses
    them where they apply."""

    def pending(self) -> int: ...

    def take(self) -> Iterable[tuple[int, str, OpCost | None, Any, int]]: ...

    def gate(self, on: bool) -> None: ...

    def capture(self, token: int) -> None: ...
