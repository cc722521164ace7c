"""Where a neuron run's host wall time goes: a profiling mode of the simulator itself.

A program on the ``neuron`` device spends its wall time in: the CPU kernels that compute its
values, the native fast path around them (``csrc/neuron.cpp``), the Python path of the ops the
fast path steps aside for (:mod:`torch_bridge.values`, per op name), the device model placing
launches on the simulated timeline (:class:`trnsim.device.Device`), building and simulating the
kernels of new shapes (cost-cache misses), compiling graphs, running compiled graphs (their
regions' values on the host, and their other ops), and the program's own Python and autograd.
:func:`profile` measures each of the simulator's parts by its own clock (time spent
inside a part less the parts nested in it); what is left over is the fast path, the CPU kernels
it runs and the program itself, which the caller compares with the same program's CPU wall time
measured in the same run (``benchmarks/bench_zoo.py --split``)::

    with torch_bridge.hostprof.profile() as prof:
        step()
    print(prof.table())

It measures the simulator's host time, never the simulated time: cycles, values and the
device's reports are the same with it on or off. Off (the default), the only cost is one
attribute test per Python-path op.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .._torch import DYNAMO_COMPILE_MODULE, DYNAMO_COMPILE_NAME

__all__ = ["Profile", "profile", "active"]

active: "Profile | None" = None  # the profile being recorded (handed to values.host_profile too)

#: compiled graphs' regions computing their values on the host (RegionKernel, ForeachKernel calls)
REGIONS = "compiled regions (values)"
#: the rest of a compiled graph's run: its other ops (fast path or Python path, unless counted as
#: such), attention's values, the graph module's own Python
GRAPHS = "compiled graphs (other ops)"
#: torch.compile's own work: Dynamo tracing a frame, AOT autograd, the neuron backend partitioning
#: the graph and planning its regions (a backward graph's compile too, which AOT autograd makes at
#: the first backward); the kernels it builds and simulates are counted in theirs
COMPILE = "compile"

_clock = time.perf_counter


class Profile:
    """Exclusive host seconds per part, and calls per part, while recording."""

    def __init__(self, datapath: Callable[[], float] = lambda: 0.0) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.wall = 0.0
        self.fast_hits = 0  # ops the native fast path served
        # seconds in trnsim's C datapath called from the extension (the fast path's matmuls and
        # convolutions, compiled regions' matmul heads, attention's products): in the rest, no part counts it
        self.datapath = 0.0
        # seconds in the neuron backend's calls (AOT autograd, partitioning, planning: the device's
        # own count, Device.note_compile), within the ``compile`` part
        self.compile = 0.0
        self.simulated = 0  # kernels simulated (cost-cache misses)
        self._local = threading.local()
        self._lock = threading.Lock()
        #: the datapath's seconds so far (:func:`fastpath.datapath_seconds`), read around each part:
        #: the matmuls a part runs (a compiled graph's mm nodes, a region's head) are the ``datapath``
        #: row's, not the part's
        self._datapath = datapath

    def call(self, part: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``, its time less that of nested parts and of the datapath (its
        own row), counted as ``part``."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        frame = [0.0, 0.0]  # nested parts' seconds, and the datapath's within them
        stack.append(frame)
        datapath = self._datapath
        d0 = datapath()
        t0 = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = _clock() - t0
            dd = datapath() - d0
            stack.pop()
            if stack:
                stack[-1][0] += dt
                stack[-1][1] += dd
            with self._lock:
                self.seconds[part] = self.seconds.get(part, 0.0) + dt - frame[0] - (dd - frame[1])
                self.calls[part] = self.calls.get(part, 0) + 1

    def parts(self) -> list[tuple[str, float, int]]:
        """(part, seconds, calls), the largest first."""
        return sorted(((k, v, self.calls.get(k, 0)) for k, v in self.seconds.items()), key=lambda r: -r[1])

    def summary(self) -> dict[str, float]:
        """Seconds per group: ``python path`` (every op's Python kernel, its CPU kernel apart),
        ``cpu kernels (python path)``, ``device model``, ``build``, ``simulate``, ``compile`` and
        ``rest`` (the fast path with its CPU kernels and the datapath, autograd, the program)."""
        out: dict[str, float] = {}
        for k, v in self.seconds.items():
            group = "python path" if k.startswith("python ") else k
            out[group] = out.get(group, 0.0) + v
        out["rest"] = self.wall - sum(out.values())
        return out

    def rest(self) -> float:
        """The rest with the datapath apart: the fast path with its CPU kernels, autograd, the
        program's own Python (what :meth:`table` and :meth:`to_dict` show as the rest)."""
        return self.summary()["rest"] - self.datapath

    def to_dict(self) -> dict[str, Any]:
        """The split as plain data (``trnsim run --host-profile --json``): seconds of wall time,
        ops the fast path served, kernels simulated, the fast path's datapath seconds, the neuron
        backend's compile seconds (within the ``compile`` part), each part's exclusive seconds and
        calls (the Python path per op as ``python <op>``), and the rest (the fast path with its CPU
        kernels, autograd, the program; the datapath apart)."""
        return {"wall_s": self.wall, "fast_path_ops": self.fast_hits, "kernels_simulated": self.simulated,
                "datapath_s": self.datapath, "rest_s": self.rest(), "backend_compile_s": self.compile,
                "parts": [{"part": k, "seconds": v, "calls": c} for k, v, c in self.parts()]}

    def table(self, steps: int = 1, top: int = 12, cpu_wall: float | None = None) -> str:
        """The split as text, per step (``steps`` steps recorded); ``cpu_wall``: the same
        program's CPU wall per step, to set the rest against."""
        w = self.wall / steps
        lines = [f"    wall {w * 1e3:9.1f} ms/step   fast-path ops {self.fast_hits / steps:,.0f}/step, "
                 f"kernels simulated {self.simulated / steps:,.1f}/step"]

        def row(name: str, s: float, calls: int | None = None) -> None:
            c = f"{calls / steps:9.1f}" if calls is not None else " " * 9
            lines.append(f"    {name:38s} {s / steps * 1e3:9.1f} ms {100 * s / self.wall if self.wall else 0:5.1f}%"
                         f" {c}")

        s = self.summary()
        for group in ("build", "simulate", "device model", COMPILE, REGIONS, GRAPHS, "cpu kernels (python path)"):
            if s.get(group):
                row("compile (Dynamo, AOT, backend)" if group == COMPILE else group, s[group], self.calls.get(group))
                if group == COMPILE and self.compile > 0:  # the device's own count of its backend calls
                    row("  of which the backend, with AOT", min(self.compile, s[group]))
        py = [(k, v, c) for k, v, c in self.parts() if k.startswith("python ")]
        row("python path (all ops)", s.get("python path", 0.0), sum(c for _, _, c in py))
        for k, v, c in py[:top]:
            row("  " + k[len("python "):], v, c)
        if len(py) > top:
            row(f"  ({len(py) - top} more ops)", sum(v for _, v, _ in py[top:]), sum(c for _, _, c in py[top:]))
        if self.datapath:
            row("datapath (matmul values)", self.datapath)
        rest = self.rest()
        row("rest: fast path + CPU kernels + program", rest)
        if cpu_wall is not None:
            lines.append(f"    (the same program on CPU: {cpu_wall * 1e3:.1f} ms/step; the rest less that: "
                         f"{rest / steps * 1e3 - cpu_wall * 1e3:.1f} ms)")
        return "\n".join(lines)


GRAPH_MODULE = "torch_bridge.compile.graph"
_undo: list[tuple[Any, str, Any]] | None = None  # the recording profile's wrappers, to undo at its end


def _wrap_graphs(module: Any) -> None:
    """Time the compiled graphs' regions, their other ops and their compiles, if a profile is
    recording."""
    undo = _undo
    if undo is not None:
        _wrap(module.RegionKernel, "__call__", REGIONS, undo)
        _wrap(module.CompiledGraph, "__call__", GRAPHS, undo)
        _wrap(module.CompiledGraph, "__init__", COMPILE, undo)


def _wrap_dynamo(module: Any) -> None:
    """Time Dynamo's compile of a frame (tracing, AOT autograd, the backend), if a profile is
    recording and this torch has it where it had it (else it stays in the rest)."""
    undo = _undo
    if undo is not None and callable(module.__dict__.get(DYNAMO_COMPILE_NAME)):
        _wrap(module, DYNAMO_COMPILE_NAME, COMPILE, undo)


def _wrap(owner: Any, name: str, part: str, undo: list[tuple[Any, str, Any]]) -> None:
    original = owner.__dict__[name]

    def timed(*args: Any, **kwargs: Any) -> Any:
        prof = active
        if prof is None:
            return original(*args, **kwargs)
        return prof.call(part, original, args, kwargs)

    timed.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, timed)
    undo.append((owner, name, original))


@contextmanager
def profile() -> Iterator[Profile]:
    """Record where the host's wall time goes until the block ends (one at a time)."""
    global active, _undo
    if active is not None:
        raise RuntimeError("torch_bridge.hostprof.profile: a profile is recording already")
    from trnsim.sim.chip import Chip
    from trnsim.device import Device

    from .. import runtime
    from ..compile.foreach import ForeachKernel
    from ..eager import fastpath
    from ..eager import values
    from ..imports import after_import

    device = runtime.runtime().device
    device.now()  # launches logged before the profile are placed outside it
    undo: list[tuple[Any, str, Any]] = []
    for owner, name, part in ((Device, "kernels_of", "build"), (Chip, "run_spmd", "simulate"),
                              (Device, "_drain", "device model"), (Device, "launch", "device model"),
                              (Device, "launch_graph", "device model"), (Device, "host_op", "device model"),
                              (Device, "synchronize", "device model"), (Device, "now", "device model"),
                              (Device, "_settle_capture", "device model"),
                              (ForeachKernel, "__call__", REGIONS),
                              (values, "_cpu_call", "cpu kernels (python path)")):
        _wrap(owner, name, part, undo)
    _undo = undo
    # the compiled graphs' classes: wrapped now if the program has compiled, else when it first
    # does (importing the module now would register its custom ops in a program that never compiles)
    after_import(GRAPH_MODULE, _wrap_graphs)
    after_import(DYNAMO_COMPILE_MODULE, _wrap_dynamo)
    prof = Profile(fastpath.datapath_seconds)
    hits0, dp0, sim0 = fastpath.hits(), fastpath.datapath_seconds(), device.simulated
    comp0 = device.recorders[0].compile_seconds
    t0 = _clock()
    active = values.host_profile = prof
    try:
        yield prof
    finally:
        try:
            device.now()  # the launches logged meanwhile are placed inside it
        finally:
            active = values.host_profile = None
            _undo = None
            prof.wall = _clock() - t0
            for owner, name, original in reversed(undo):
                setattr(owner, name, original)
            prof.fast_hits = fastpath.hits() - hits0
            prof.datapath = fastpath.datapath_seconds() - dp0
            prof.simulated = device.simulated - sim0
            prof.compile = device.recorders[0].compile_seconds - comp0
