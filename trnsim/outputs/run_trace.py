"""One trace of a run, from the framework down to the engines, on one time base.

A Chrome trace-event document (ui.perfetto.dev, chrome://tracing) built from a
:class:`~trnsim.report.RunReport` whose recorder kept its launches, and, when the run was
profiled with torch.profiler, the host trace torch.profiler exported. Processes, top to bottom:

* **the host process as torch.profiler recorded it** (its pid and threads): Python function
  events (``with_stack=True``), ``aten::`` ops, the ``neuron::<op>`` record of each neuron op,
  user annotations - unchanged except for their times (see below);
* **host (simulated)**: one ``dispatch`` lane, each launch's host dispatch in the device model
  (``host.dispatch`` per launch, ending when the host issued it; gaps are the host waiting);
* **neuron:N (config, simulated)**, one per logical NeuronCore: a lane per stream
  (``stream 0 (default)``, ``stream 3``, ``collectives``), one slice per launch named after its
  op, with the kernel, the Python source line that launched it and its issue/start/end ticks;
* **neuron:N engines, physical core P**, for expanded launches: the kernel's ``Kernel`` lane
  and its engine (``Tensor``, ``Vector``, ...) and DMA-queue (``qSyncIO0``, ...) lanes, as
  :mod:`trnsim.trace` draws a kernel, placed where the launch started.

Flows (arrows) go from each ``neuron::<op>`` host record to every device launch it issued (from
the simulated dispatch slice when there is no torch.profiler trace).

**One time base: simulated microseconds.** The device's slices are where the device model put
them. Host events are moved onto the same clock by a monotone piecewise-linear map anchored at
each launch: the end of an op's ``neuron::<op>`` record maps to the simulated tick its launch
was issued, and the profiler's start to the simulated host's time then; between anchors the
host's real time is scaled linearly (beyond them it runs at its real rate). So a host op always
ends before its kernel starts, the host's order and nesting are kept, and each moved slice keeps
its real duration in ``args["wall_dur_us"]``. The simulated host issues a launch every
``host.dispatch``; the real host (Python, the CPU kernels computing values) is usually slower, so
real time is compressed where the device model runs ahead of it.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..config.files import AtomicOutput
from ..sim.report import RunReport, TraceEvent
from .trace import lane_events, ticks_to_us

__all__ = ["HostCall", "run_trace_document", "write_run_trace", "SIM_HOST_PID", "device_pid", "engines_pid",
           "stream_tid", "FLOW_CATEGORY"]

SIM_HOST_PID = 1_000_000  # far above real pids, so the simulated processes never share one with the host
FLOW_CATEGORY = "neuron_launch"
_FLOW_BASE = 1 << 40  # above torch.profiler's own flow ids (forward/backward links are small integers)
_COLLECTIVE_STREAM = -1  # trnsim.device.COLLECTIVE_STREAM


def device_pid(core: int) -> int:
    """The trace process of logical core ``core``'s stream lanes."""
    return SIM_HOST_PID + 100 * (core + 1)


def engines_pid(core: int, physical: int) -> int:
    """The trace process of the expanded kernels' engine lanes on one physical core."""
    return device_pid(core) + 1 + physical


def stream_tid(stream: int) -> int:
    return stream + 2  # collectives (-1) first, then stream 0, 1, ...


def _stream_name(stream: int) -> str:
    if stream == _COLLECTIVE_STREAM:
        return "collectives"
    if stream < _COLLECTIVE_STREAM:
        return f"collectives (CC stream {_COLLECTIVE_STREAM - stream})"
    return "stream 0 (default)" if stream == 0 else f"stream {stream}"


@dataclass(frozen=True)
class HostCall:
    """One neuron op call the host made while profiling: its op ``label`` (torch.profiler shows
    it as ``neuron::<label>``) and the native id of the host thread that made it. A launch's
    :attr:`TraceEvent.call` is its index in the list of calls."""

    label: str
    thread: int


class _TimeMap:
    """Monotone piecewise-linear map from host (real) microseconds to simulated microseconds
    through anchor points; slope 1 outside them."""

    def __init__(self, anchors: Iterable[tuple[float, float]]):
        pts = sorted(anchors)
        self.real: list[float] = []
        self.sim: list[float] = []
        for r, s in pts:
            if self.sim and s < self.sim[-1]:
                s = self.sim[-1]  # keep it monotone (launches from threads racing each other)
            if self.real and r <= self.real[-1]:
                self.sim[-1] = max(self.sim[-1], s)
                continue
            self.real.append(r)
            self.sim.append(s)

    def __call__(self, t: float) -> float:
        real, sim = self.real, self.sim
        if not real:
            return t
        i = bisect.bisect_right(real, t)
        if i == 0:
            return sim[0] - (real[0] - t)
        if i == len(real):
            return sim[-1] + (t - real[-1])
        r0, r1, s0, s1 = real[i - 1], real[i], sim[i - 1], sim[i]
        return s0 + (s1 - s0) * (t - r0) / (r1 - r0)


def _match_calls(host_events: list[dict[str, Any]], calls: Sequence[HostCall]) -> dict[int, dict[str, Any]]:
    """call index -> its ``neuron::<op>`` record in the host trace. Records and calls are paired
    in order per host thread (a call enters its record just after it is counted), checking names;
    a call whose record is missing is skipped without shifting the others."""
    records: dict[Any, list[dict[str, Any]]] = {}
    for e in host_events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("neuron::"):
            records.setdefault(e.get("tid"), []).append(e)
    for evs in records.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    by_thread: dict[Any, list[int]] = {}
    for i, c in enumerate(calls):
        by_thread.setdefault(c.thread, []).append(i)
    out: dict[int, dict[str, Any]] = {}
    for thread, idxs in by_thread.items():
        evs = records.get(thread, [])
        j = 0
        for i in idxs:
            want = f"neuron::{calls[i].label}"
            for k in range(j, min(j + 8, len(evs))):
                if evs[k]["name"] == want:
                    out[i] = evs[k]
                    j = k + 1
                    break
    return out


SIMULATOR_FRAMES = ("trnsim/",)


def _without_simulator(events: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The host events less the Python calls of the simulator itself (``with_stack`` frames in
    trnsim's modules and everything they called): the work of simulating a kernel, which a real
    host would not do. Their callers (the neuron device's Python in torch_bridge) stay. Also
    returns how many were dropped."""
    parent: dict[Any, Any] = {}
    sim: set[Any] = set()
    for e in events:
        if e.get("cat") == "python_function":
            args = e.get("args", {})
            pid = args.get("Python id")
            parent[pid] = args.get("Python parent id")
            if str(e.get("name", "")).startswith(SIMULATOR_FRAMES):
                sim.add(pid)
    if not sim:
        return list(events), 0
    under: dict[Any, bool] = {}

    def inside(pid: Any) -> bool:
        chain = []
        while pid is not None and pid not in under:
            if pid in sim:
                under[pid] = True
                break
            chain.append(pid)
            pid = parent.get(pid)
        hit = under.get(pid, False) if pid is not None else False
        for p in chain:
            under[p] = hit
        return hit

    kept = [e for e in events if e.get("cat") != "python_function" or not inside(e.get("args", {}).get("Python id"))]
    return kept, len(events) - len(kept)


def _choose_expanded(report: RunReport, expand: Sequence[str], top: int) -> tuple[list[TraceEvent], list[str]]:
    """The launches to draw engine lanes for: the longest launch of each (op, kernel) named in
    ``expand`` (by op or kernel name) and of the ``top`` busiest rows that ran a kernel (all
    launches of one kernel run the same simulated instruction stream). Also the names in
    ``expand`` that matched nothing."""
    longest: dict[tuple[str, str], TraceEvent] = {}
    for e in report.events:
        if not e.reports:
            continue
        key = (e.op, e.kernel)
        best = longest.get(key)
        if best is None or e.end - e.start > best.end - best.start:
            longest[key] = e
    chosen: list[tuple[str, str]] = []
    missing = []
    for name in expand:
        keys = [k for k in longest if name in k]
        if not keys:
            missing.append(name)
        chosen += [k for k in keys if k not in chosen]
    n = 0
    for r in report.rows:
        if n >= top:
            break
        key = (r.op, r.kernel)
        if key in longest:
            n += 1
            if key not in chosen:
                chosen.append(key)
    return [longest[k] for k in chosen], missing


def run_trace_document(report: RunReport, host_trace: dict[str, Any] | None = None, calls: Sequence[HostCall] = (),
                       start: tuple[float, int] | None = None, dispatch_ticks: int | None = None,
                       expand: Sequence[str] = (), top: int = 0) -> dict[str, Any]:
    """The merged trace of ``report`` (its ``events``: a recorder that kept launches).

    ``host_trace`` is torch.profiler's exported Chrome trace of the same span (None: only the
    simulated host); ``calls`` the neuron op calls the launches' ``call`` indices refer to;
    ``start`` is (when profiling started on the host trace's clock in us, the simulated host's
    tick then): the first anchor of the time map; ``dispatch_ticks`` the
    host's cost per launch (None: the gap since the previous launch is drawn). ``expand`` and
    ``top`` choose the launches whose engine lanes are drawn (:func:`_choose_expanded`)."""
    hz = report.tick_hz
    host_events, dropped = _without_simulator((host_trace or {}).get("traceEvents", []))
    matched = _match_calls(host_events, calls) if host_events else {}
    by_call: dict[int, list[TraceEvent]] = {}
    for e in report.events:
        if e.call >= 0:
            by_call.setdefault(e.call, []).append(e)
    anchors: list[tuple[float, float]] = []
    if start is not None and host_events:
        anchors.append((start[0], ticks_to_us(start[1], hz)))
    source_of: dict[int, str] = {}  # id(host record) -> the line that called it
    for i, rec in matched.items():
        evs = by_call.get(i)
        if evs:
            anchors.append((rec["ts"] + rec.get("dur", 0), ticks_to_us(max(e.issued for e in evs), hz)))
            if evs[0].source:
                source_of[id(rec)] = evs[0].source
    tmap = _TimeMap(anchors)
    moved: list[dict[str, Any]] = []
    for orig in host_events:
        e = dict(orig)
        if "ts" in e and e.get("ph") != "M":
            ts = float(e["ts"])
            if e.get("ph") == "X":
                dur = float(e.get("dur", 0))
                e["ts"] = tmap(ts)
                e["dur"] = max(0.0, tmap(ts + dur) - e["ts"])
                e["args"] = {**e.get("args", {}), "wall_dur_us": dur}
                line = source_of.get(id(orig))
                if line:
                    e["args"]["source"] = line
            else:
                e["ts"] = tmap(ts)
        moved.append(e)
    index = {id(orig): k for k, orig in enumerate(host_events)}
    moved_of = {i: moved[index[id(rec)]] for i, rec in matched.items()}  # call -> its record, moved

    meta: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    meta.append({"ph": "M", "name": "process_name", "pid": SIM_HOST_PID, "args": {"name": "host (simulated)"}})
    meta.append({"ph": "M", "name": "process_sort_index", "pid": SIM_HOST_PID, "args": {"sort_index": SIM_HOST_PID}})
    meta.append({"ph": "M", "name": "thread_name", "pid": SIM_HOST_PID, "tid": 1, "args": {"name": "dispatch"}})
    for core in sorted({e.core for e in report.events}):
        pid = device_pid(core)
        meta.append({"ph": "M", "name": "process_name", "pid": pid,
                     "args": {"name": f"neuron:{core} ({report.config}, simulated)"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    for core, stream in sorted({(e.core, e.stream) for e in report.events}):
        pid, tid = device_pid(core), stream_tid(stream)
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": _stream_name(stream)}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    expanded, missing = _choose_expanded(report, expand, top)
    expanded_ids = {id(e) for e in expanded}
    flow = _FLOW_BASE
    prev_issue: int | None = None
    for e in report.events:
        args: dict[str, Any] = {"kernel": e.kernel, "issued_us": ticks_to_us(e.issued, hz),
                                "queued_us": ticks_to_us(e.start - e.issued, hz), "start_tick": e.start, "end_tick": e.end}
        if e.source:
            args["source"] = e.source
        if id(e) in expanded_ids:
            args["expanded"] = True
        lo = e.issued - dispatch_ticks if dispatch_ticks is not None else prev_issue
        dispatch = None
        if lo is not None and e.issued > lo:
            dispatch = {"ph": "X", "name": e.op, "cat": "dispatch", "pid": SIM_HOST_PID, "tid": 1,
                        "ts": ticks_to_us(lo, hz), "dur": ticks_to_us(e.issued - lo, hz),
                        "args": {"kernel": e.kernel, **({"source": e.source} if e.source else {})}}
            events.append(dispatch)
        prev_issue = e.issued
        dev = {"ph": "X", "name": e.op, "cat": "kernel", "pid": device_pid(e.core), "tid": stream_tid(e.stream),
               "ts": ticks_to_us(e.start, hz), "dur": ticks_to_us(e.end - e.start, hz), "args": args}
        events.append(dev)
        rec = moved_of.get(e.call) if e.call >= 0 else None
        src = (rec["pid"], rec["tid"], rec["ts"]) if rec is not None else \
            (SIM_HOST_PID, 1, dispatch["ts"]) if dispatch is not None else None
        if src is not None:
            flow += 1
            events.append({"ph": "s", "id": flow, "pid": src[0], "tid": src[1], "ts": src[2],
                           "cat": FLOW_CATEGORY, "name": "launch"})
            events.append({"ph": "f", "bp": "e", "id": flow, "pid": dev["pid"], "tid": dev["tid"], "ts": dev["ts"],
                           "cat": FLOW_CATEGORY, "name": "launch"})

    placed = []
    engine_procs: set[tuple[int, int]] = set()
    for e in expanded:
        for p, rep in enumerate(e.reports):
            engine_procs.add((e.core, p))
            placed.append((engines_pid(e.core, p), e.start, rep, e.op,
                           {"kernel": e.kernel, "cycles": rep.total_cycles, "config": rep.config,
                            **({"source": e.source} if e.source else {})}))
    for core, p in sorted(engine_procs):
        pid = engines_pid(core, p)
        meta.append({"ph": "M", "name": "process_name", "pid": pid,
                     "args": {"name": f"neuron:{core} engines, physical core {p} (expanded kernels)"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    lane_meta, lanes = lane_events(placed, hz)

    body = moved + meta + lane_meta + events + lanes
    low = min((e["ts"] for e in body if "ts" in e and e.get("ph") != "M"), default=0.0)
    shift = -low if low < 0 else 0.0
    if shift:  # Perfetto wants no negative times: everything moves together
        for e in body:
            if "ts" in e and e.get("ph") != "M":
                e["ts"] += shift
    other = {k: v for k, v in (host_trace or {}).items() if k != "traceEvents"}
    other.update({
        "generator": "trnsim",
        "config": report.config,
        "time_base": "simulated microseconds of the device model; host events moved onto it (trnsim.run_trace)",
        "time_shift_us": shift,
        "launches": len(report.events),
        "host_calls_matched": len(matched),
        "simulator_python_events_dropped": dropped,
        "expanded": [f"{e.op} ({e.kernel})" for e in expanded],
        "not_expanded": missing,
    })
    other["displayTimeUnit"] = "ns"
    return {"traceEvents": body, **other}


def write_run_trace(path: str | os.PathLike[str] | AtomicOutput, report: RunReport, **kwargs: Any) -> Path:
    """Write :func:`run_trace_document` of ``report`` through :class:`trnsim.config.files.AtomicOutput`
    (a temporary file renamed into place; ``path`` may be one reserved before the run)."""
    import json

    doc = run_trace_document(report, **kwargs)
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "trace")
    return out.commit(lambda f: json.dump(doc, f, separators=(",", ":")))
