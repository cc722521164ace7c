"""Probe kernels: the small instruction streams published micro-measurements were taken on.

A profile in the Neuron docs often measures one thing (one DMA's duration, the interval between
dependent instructions) rather than a whole kernel. Each probe here builds that situation with
the public builder and reads the same quantity off the simulated timeline, so a ledger row can
name it (``predict: {how: probe, probe: dma_copy, ...}``). Every probe returns figures in base
units: seconds, bytes/s, percent.
"""

from __future__ import annotations

from typing import Any, Callable

from ..sim.chip import Chip
from ..config import ChipConfig
from ..isa import KernelError

__all__ = ["PROBES", "Figure"]

#: (dimension, value in the dimension's base unit)
Figure = tuple[str, float]


def _queue_spans(report: Any) -> list[tuple[int, int]]:
    return [(s, e) for lane, _, s, e, _ in report.timeline if lane.startswith("q")]


def dma_copy(cfg: ChipConfig, *, partitions: int = 128, bytes_per_partition: int = 4096, transfers: int = 1,
             queues: int = 1, dtype: str = "bf16") -> dict[str, Figure]:
    """``transfers`` HBM->SBUF copies of ``partitions`` x ``bytes_per_partition`` each, spread
    round-robin over ``queues`` DMA queues, on one core.

    Figures: ``transfer_time`` the longest single DMA-queue segment (what a profile shows as one
    DMA's duration), ``engine_rate`` a single transfer's bytes over that segment, ``bandwidth``
    all bytes over the span from the first queue segment's start to the last one's end, and
    ``latency`` the kernel's total (first issue to last data visible)."""
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}.get(dtype)
    if itemsize is None or bytes_per_partition % itemsize:
        raise KernelError(f"probe dma_copy: bytes_per_partition {bytes_per_partition} is not whole {dtype} elements")
    cols = bytes_per_partition // itemsize
    chip = Chip(cfg)
    k = chip.kernel("probe.dma_copy")
    src = k.input("x", (partitions, cols * transfers), dtype)
    dst = k.sbuf((partitions, cols * transfers), dtype)
    for i in range(transfers):
        k.dma_copy(dst[:, i * cols:(i + 1) * cols], src[:, i * cols:(i + 1) * cols], queue=i % queues)
    rep = chip.run(k, timing_only=True).report
    spans = _queue_spans(rep)
    hz = rep.tick_hz
    longest = max(e - s for s, e in spans) / hz
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / hz
    return {"transfer_time": ("time", longest),
            "engine_rate": ("bandwidth", partitions * bytes_per_partition / longest),
            "bandwidth": ("bandwidth", partitions * bytes_per_partition * transfers / span),
            "latency": ("time", rep.total_ticks / hz)}


def act_chain(cfg: ChipConfig, *, length: int = 32, partitions: int = 1, free: int = 1, fn: str = "identity",
              dtype: str = "fp32") -> dict[str, Figure]:
    """``length`` ScalarE activations, each reading the previous one's output (a read-after-write
    chain), on a ``[partitions, free]`` tile. Figure ``interval``: the mean time between the starts
    of consecutive instructions, the first excluded (it waits for the input DMA)."""
    if length < 3:
        raise KernelError("probe act_chain: length must be at least 3")
    chip = Chip(cfg)
    k = chip.kernel("probe.act_chain")
    x = k.input("x", (partitions, free), dtype)
    t = k.sbuf((partitions, free), dtype)
    k.dma_copy(t, x)
    bufs = [k.sbuf((partitions, free), dtype) for _ in range(2)]
    k.activation(bufs[0], fn, t, scale=2.0)
    for i in range(1, length):
        k.activation(bufs[i % 2], fn, bufs[(i - 1) % 2], scale=2.0)
    rep = chip.run(k, timing_only=True).report
    starts = sorted(s for _, _, s, _, _ in rep.segments("Scalar"))
    interval = (starts[-1] - starts[1]) / (len(starts) - 2) / rep.tick_hz
    return {"interval": ("time", interval), "latency": ("time", rep.total_ticks / rep.tick_hz)}


def launch_gap(cfg: ChipConfig, *, launches: int = 32, kernel: str = "binary", shape: tuple[int, ...] | list[int] = (128, 128),
               dtype: str = "bf16") -> dict[str, Figure]:
    """``launches`` back-to-back launches of one small library kernel from the host on logical
    core 0 (the device model of :mod:`trnsim.device`). Figures: ``interval``, the mean time between
    the starts of consecutive launches (the host's issue cost when the kernel is shorter than it),
    and ``kernel_time``, one launch's device time."""
    from ..device import Device, KernelSpec

    if launches < 3:
        raise KernelError("probe launch_gap: launches must be at least 3")
    dev = Device(cfg)
    cost = dev.cost(KernelSpec.of(kernel, tuple(shape), dtype))
    spans = [dev.launch(0, kernel, cost) for _ in range(launches)]
    starts = [s for s, _ in spans if s is not None]
    hz = cfg.tick_hz
    return {"interval": ("time", (starts[-1] - starts[1]) / (len(starts) - 2) / hz),
            "kernel_time": ("time", (spans[0][1] - spans[0][0]) / hz if spans[0] else 0.0)}


#: probe name -> function(config, **args) -> {figure: (dimension, value)}
PROBES: dict[str, Callable[..., dict[str, Figure]]] = {"dma_copy": dma_copy, "act_chain": act_chain,
                                                       "launch_gap": launch_gap}
