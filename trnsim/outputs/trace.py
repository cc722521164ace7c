"""Chrome trace-event JSON of kernel timelines, for ui.perfetto.dev and chrome://tracing.

Layout, following Neuron Explorer's lanes: one process per NeuronCore, one thread (lane) per
engine in the engine table's order (each engine's ``lanes``: "Tensor", "Tensor (LS)", "Vector",
"Scalar", "GpSimd", "Sync") and per DMA queue
("qSyncIO0", "qGpSimdIO0", ...), plus a "Kernel" lane with one span per kernel.

A DMA queue keeps several transfers in flight, so its transfers overlap in time; trace viewers
draw overlapping complete events of one thread as (wrong) nesting. Such a queue is therefore
drawn on as many lanes as it has transfers in flight at once: "qSyncIO0", "qSyncIO0 (2)", ...
Every lane holds non-overlapping events, and the union of a queue's lanes is its busy time.

Several reports on one core are laid end to end in the order given (a core runs one kernel at a
time, e.g. the kernels of a torch graph); reports on different cores start together, as in
:meth:`trnsim.Chip.run_spmd`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from ..cores.base import ENGINE_TYPES, engine_names
from ..config.files import AtomicOutput
from ..sim.report import KernelReport

__all__ = ["trace_events", "trace_document", "write_trace", "lane_events", "tick_rate", "ticks_to_us"]

KERNEL_LANE = "Kernel"


def _sort_key(lane: str, order: dict[str, int]) -> tuple[int, str]:
    """Kernel first, then engine lanes in the engine table's order (``order``: :func:`_lane_order`),
    then DMA queues by name."""
    if lane == KERNEL_LANE:
        return (0, "")
    if lane in order:
        return (1 + order[lane], "")
    return (1 + len(order), lane)


def _lane_order() -> dict[str, int]:
    return {x: i for i, x in enumerate(x for n in engine_names() for x in ENGINE_TYPES[n].lanes())}


def ticks_to_us(ticks: int, tick_hz: int) -> float:
    """Simulated ticks as trace microseconds: the one conversion every trace event uses, so spans
    drawn by different writers (a launch and its expanded engine lanes) start at equal floats."""
    return ticks * 1e6 / tick_hz





def spread_lanes(segments: list[tuple[int, int, str, int]]) -> list[list[tuple[int, int, str, int]]]:
    """Split (start, end, label, index) segments over the fewest lanes with no overlap in any
    lane (greedy interval partitioning: each segment goes to the first lane already free)."""
    lanes: list[list[tuple[int, int, str, int]]] = []
    for seg in sorted(segments):
        for lane in lanes:
            if lane[-1][1] <= seg[0]:
                lane.append(seg)
                break
        else:
            lanes.append([seg])
    return lanes


def lane_events(placed: Iterable[tuple[int, int, KernelReport, str, dict[str, Any]]], tick_hz: int
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(thread metadata, events) of kernels placed on a timeline: each ``(pid, t0, report, name,
    args)`` draws ``report`` from tick ``t0`` in process ``pid`` - a ``Kernel`` lane span called
    ``name`` (with ``args``) and one lane per engine and DMA queue (see the module docstring).
    Processes are the caller's to name; thread ids are numbered per process from 1."""
    lanes: dict[tuple[int, str], list[tuple[int, int, str, int]]] = {}
    spans: list[tuple[int, int, int, str, dict[str, Any]]] = []
    for pid, t0, rep, name, args in placed:
        spans.append((pid, t0, t0 + rep.total_ticks, name, args))
        for lane, label, start, end, index in rep.timeline:
            lanes.setdefault((pid, lane), []).append((t0 + start, t0 + end, label, index))
    meta: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    per_pid: dict[int, int] = {}

    def tid_of(pid: int, name: str) -> int:
        key = (pid, name)
        if key not in tids:
            per_pid[pid] = per_pid.get(pid, 0) + 1
            tids[key] = per_pid[pid]
        return tids[key]

    named: list[tuple[int, str]] = []
    for pid, t0, t1, name, args in spans:
        tid = tid_of(pid, KERNEL_LANE)
        if (pid, KERNEL_LANE) not in named:
            named.append((pid, KERNEL_LANE))
        events.append({"ph": "X", "name": name, "cat": "kernel", "pid": pid, "tid": tid,
                       "ts": ticks_to_us(t0, tick_hz), "dur": ticks_to_us(t1 - t0, tick_hz), "args": args})
    order = _lane_order()
    for (pid, lane), segs in sorted(lanes.items(), key=lambda kv: (kv[0][0], _sort_key(kv[0][1], order))):
        for n, part in enumerate(spread_lanes(segs)):
            name = lane if n == 0 else f"{lane} ({n + 1})"
            tid = tid_of(pid, name)
            named.append((pid, name))
            for start, end, label, index in part:
                events.append({"ph": "X", "name": label, "cat": "dma" if lane.startswith("q") else "engine",
                               "pid": pid, "tid": tid, "ts": ticks_to_us(start, tick_hz), "dur": ticks_to_us(end - start, tick_hz),
                               "args": {"instruction": index, "label": label, "start_tick": start,
                                        "end_tick": end}})
    for pid, name in named:
        tid = tids[(pid, name)]
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})
    return meta, events


def tick_rate(reports: Iterable[KernelReport]) -> int:
    """The one tick rate of ``reports`` (1 if none); reports of different rates are refused."""
    rates = sorted({r.tick_hz for r in reports})
    if len(rates) > 1:
        raise ValueError(f"trace: reports use different tick rates {rates} Hz; trace one chip config at a time")
    return rates[0] if rates else 1


def trace_events(reports: Iterable[KernelReport]) -> list[dict[str, Any]]:
    """The trace events (metadata first) for ``reports``; see the module docstring. All reports
    must share one tick rate (one chip config's clocks), so their ticks lie on one time axis."""
    reports = list(reports)
    hz = tick_rate(reports)
    offset: dict[int, int] = {}  # per core: the tick where its next kernel starts
    configs: dict[int, str] = {}
    placed = []
    for rep in reports:
        t0 = offset.get(rep.core, 0)
        offset[rep.core] = t0 + rep.total_ticks
        configs.setdefault(rep.core, rep.config)
        placed.append((rep.core, t0, rep, rep.kernel, {"cycles": rep.total_cycles, "config": rep.config}))
    meta: list[dict[str, Any]] = []
    for core in sorted(configs):
        meta.append({"ph": "M", "name": "process_name", "pid": core, "tid": 0,
                     "args": {"name": f"NeuronCore {core} ({configs[core]})"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": core, "tid": 0, "args": {"sort_index": core}})
    lane_meta, events = lane_events(placed, hz)
    return meta + lane_meta + events


def trace_document(reports: KernelReport | Iterable[KernelReport]) -> dict[str, Any]:
    """The whole trace file's JSON document for ``reports``."""
    reps = [reports] if isinstance(reports, KernelReport) else list(reports)
    return {"traceEvents": trace_events(reps), "displayTimeUnit": "ns",
            "otherData": {"generator": "trnsim", "kernels": [r.kernel for r in reps]}}


def write_trace(path: str | os.PathLike[str] | AtomicOutput, reports: KernelReport | Iterable[KernelReport]) -> Path:
    """Write ``reports`` as a Chrome trace-event JSON file at ``path``.

    The file is written through :mod:`trnsim.config.files`: to a temporary name in the same directory,
    renamed into place (an error, or a reader opening it meanwhile, never sees half a trace), a
    symlink followed, a FIFO or device refused with an :class:`~trnsim.config.files.OutputError`.
    ``path`` may be an :class:`~trnsim.config.files.AtomicOutput` reserved before a long run."""
    doc = trace_document(reports)
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "trace")
    return out.commit(lambda f: json.dump(doc, f, separators=(",", ":")))
