"""RunReport: where a PyTorch run's simulated device time went, per op and kernel. Data only;
``trnsim run`` renders it (``str(report)`` gives a plain-text table for scripts).

Per row (one op lowered to one kernel): calls, simulated time (launch overhead + kernel time,
summed over calls) and its share of the total, each engine's busy share of the kernel time, HBM
bytes, MFU (matmul FLOPs over that time at the bf16 peak of the device: a logical NeuronCore, i.e.
``chip.lnc`` physical cores; each op's kernel is simulated on one physical core, so with LNC=2 an
op's MFU is at most 50% — the second core's idle share is real), and the bound: the engine or the
DMA/HBM path busiest during the row's kernels, or ``launch`` when launch overhead is most of the
row's time. ``generic`` rows used the bridge's
generic streaming kernel rather than a library kernel; ``view`` rows cost launch overhead only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trnsim import ChipConfig

from .timeline import Collector, TraceEvent, launch_ticks

__all__ = ["RunReport", "OpRow", "build_run_report"]


@dataclass(frozen=True)
class OpRow:
    op: str
    kernel: str
    generic: bool
    calls: int
    time_us: float
    share_percent: float
    launch_us: float
    engine_percent: dict[str, float]  # busy / kernel time, per engine and "DMA"
    hbm_bytes: int
    matmul_flops: int
    mfu_percent: float
    bound: str


@dataclass(frozen=True)
class RunReport:
    config: str
    devices: dict[int, float]  # device index -> simulated span in us (first launch to last finish)
    rows: tuple[OpRow, ...]  # busiest first
    total_us: float  # sum of row times (all streams, all devices)
    total_calls: int
    hbm_bytes: int
    matmul_flops: int
    mfu_percent: float
    events: tuple[TraceEvent, ...] = ()
    tick_hz: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("events")
        return d

    def row(self, op: str) -> OpRow:
        """The busiest row of ``op`` (KeyError if the op never ran)."""
        for r in self.rows:
            if r.op == op:
                return r
        raise KeyError(f"op '{op}' did not run on the neuron device in this report")

    def __str__(self) -> str:
        head = (f"neuron run report ({self.config}): {self.total_calls} op calls, {self.total_us:,.1f} us simulated, "
                f"HBM {self.hbm_bytes / 1e6:,.2f} MB, MFU {self.mfu_percent:.1f}%")
        ow = max([28] + [len(r.op) for r in self.rows])  # op names are whole: they are what users look up
        lines = [head, f"{'op':<{ow}} {'kernel':<28} {'calls':>6} {'time us':>11} {'share':>6} {'MFU':>6}  bound"]
        for r in self.rows:
            lines.append(f"{r.op:<{ow}} {r.kernel[:28]:<28} {r.calls:>6} {r.time_us:>11,.1f} "
                         f"{r.share_percent:>5.1f}% {r.mfu_percent:>5.1f}%  {r.bound}")
        return "\n".join(lines)


def _bound(engine_percent: dict[str, float], launch_share: float) -> str:
    if launch_share >= 50.0 or not engine_percent:
        return "launch"
    name, pct = max(engine_percent.items(), key=lambda kv: kv[1])
    if pct <= 0.0:
        return "launch"
    return "DMA/HBM" if name == "DMA" else name


def build_run_report(collector: Collector, config: ChipConfig) -> RunReport:
    hz = config.tick_hz
    peak = config.peak_flops_per_core("bf16") * config.chip.lnc  # a logical core's physical cores
    records = collector.records(launch_ticks(config))
    total_ticks = sum(r.ticks for r in records)
    rows = []
    for rec in records:
        kernel_ticks = rec.ticks - rec.launch_ticks
        engines = {name: 100.0 * busy / kernel_ticks for name, busy in rec.engine_busy_ticks.items()} \
            if kernel_ticks else {}
        if kernel_ticks:
            engines["DMA"] = 100.0 * rec.dma_busy_ticks / kernel_ticks
        seconds = rec.ticks / hz
        rows.append(OpRow(
            op=rec.op, kernel=rec.kernel, generic=rec.generic, calls=rec.calls, time_us=seconds * 1e6,
            share_percent=100.0 * rec.ticks / total_ticks if total_ticks else 0.0,
            launch_us=rec.launch_ticks / hz * 1e6, engine_percent=engines, hbm_bytes=rec.hbm_bytes,
            matmul_flops=rec.flops, mfu_percent=100.0 * rec.flops / (peak * seconds) if seconds else 0.0,
            bound=_bound(engines, 100.0 * rec.launch_ticks / rec.ticks if rec.ticks else 100.0),
        ))
    rows.sort(key=lambda r: (-r.time_us, r.op, r.kernel))
    flops = sum(r.matmul_flops for r in rows)
    seconds = total_ticks / hz
    spans = {d: (collector.last_tick[d] - collector.first_tick[d]) / hz * 1e6 for d in sorted(collector.first_tick)}
    return RunReport(
        config=config.name, devices=spans, rows=tuple(rows), total_us=seconds * 1e6,
        total_calls=sum(r.calls for r in rows), hbm_bytes=sum(r.hbm_bytes for r in rows), matmul_flops=flops,
        mfu_percent=100.0 * flops / (peak * seconds) if seconds else 0.0,
        events=tuple(collector.events or ()), tick_hz=hz,
    )
