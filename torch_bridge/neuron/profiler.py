"""``torch.neuron.profiler``: torch.profiler from the framework down to the engines.

Profile as usual, then export one trace that holds the host's Python and aten events (as
torch.profiler recorded them), the device's simulated stream lanes per NeuronCore, and the
engine and DMA-queue lanes of the kernels asked for, on one time base, with a flow from each
host op to its device kernels (:mod:`trnsim.run_trace` describes the lanes)::

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        loss = model(x).sum(); loss.backward()
    torch.neuron.profiler.export_trace(prof, "trace.json", expand=["addmm"], top=3)

    # or let each profiling cycle write it (a "{step}" in the path is the profiler's step)
    profile(..., on_trace_ready=torch.neuron.profiler.trace_handler("trace-{step}.json"))

How: while torch.profiler records, every neuron op call (:func:`traced`) is counted and tells the
device model its number, and the device model asks :func:`source_line` for each launch: the
innermost frame outside torch, torch_bridge and trnsim (for ops autograd runs on its worker
thread, the main thread's line, i.e. where ``backward()`` was called). So each launch knows its
host call and source line.
A recording session of the device model opens when torch.profiler starts and closes when it
stops (the hooks torch.autograd.profiler runs then, see :mod:`torch_bridge._torch`).

Outside torch.profiler, :func:`track_sources` turns on the source lines alone (``trnsim run
--metrics``: the report's rows name the line that took most of their device time).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trnsim.config.files import AtomicOutput
from trnsim.sim.report import RunReport
from trnsim.outputs.run_trace import HostCall, run_trace_document

from .. import _torch
from ..runtime import is_initialized, runtime

__all__ = ["export_trace", "trace_handler", "load_chrome_trace", "traced", "source_line", "track_sources", "last_session", "Session",
           "last_expand_missing"]

#: True while source lines are recorded without torch.profiler (``trnsim run --metrics``)
tracking = False
_lock = threading.Lock()


def track_sources(on: bool = True) -> None:
    """Record the Python source line of every neuron op's launches (outside torch.profiler too)."""
    global tracking
    tracking = on
    _update_hook()


def _update_hook() -> None:
    """The device model asks :func:`source_line` for each launch while lines are wanted."""
    if is_initialized():
        runtime().device.source_of = source_line if (tracking or _active is not None) else None


# ---- which line launched an op ----------------------------------------------------------------
def _package_dir(mod: Any) -> str:
    return os.path.dirname(os.path.abspath(mod.__file__)) + os.sep


import trnsim as _trnsim  # noqa: E402

_SKIP = (_package_dir(torch), os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, _package_dir(_trnsim))
_shown: dict[str, str] = {}


def _show(filename: str) -> str:
    """A source file as a user reads it: relative to the working directory when inside it, an
    installed package's file from its package (``transformers/activations.py``), else whole."""
    shown = _shown.get(filename)
    if shown is None:
        shown = filename
        try:
            rel = os.path.relpath(filename)
            if not rel.startswith(".."):
                shown = rel
            else:
                for root in sys.path:
                    if root and os.path.basename(root) in ("site-packages", "dist-packages") and \
                            filename.startswith(root.rstrip(os.sep) + os.sep):
                        shown = filename[len(root.rstrip(os.sep)) + 1:]
                        break
        except ValueError:
            pass
        _shown[filename] = shown
    return shown


_framework_code: set[Any] = set()  # code objects of torch, torch_bridge, trnsim (and <frozen ...>)
_user_code: dict[Any, str] = {}  # code object -> its file as shown


def _classify(code: Any) -> bool:
    """Whether ``code`` is the framework's (then skipped); remembered per code object."""
    name = code.co_filename
    if name.startswith(_SKIP) or name.startswith("<"):
        _framework_code.add(code)
        return True
    _user_code[code] = _show(name)
    return False


def _user_frame(frame: Any) -> str:
    # set/dict membership and attribute reads only, once each code object is known: the walk
    # makes no function call that torch.profiler's Python tracer would record as host work
    while frame is not None:
        code = frame.f_code
        if code not in _framework_code and (code in _user_code or not _classify(code)):
            return f"{_user_code[code]}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def source_line() -> str:
    """``file.py:line`` of the innermost frame outside torch, torch_bridge and trnsim that led
    here; on a thread with none (autograd's worker), the main thread's; "" if there is none."""
    line = _user_frame(sys._getframe(1))
    if line:
        return line
    main = threading.main_thread()
    if threading.current_thread() is main:
        return ""
    return _user_frame(sys._current_frames().get(main.ident))


# ---- recording sessions -------------------------------------------------------------------------
class Session:
    """The device model's recording of one torch.profiler session: every launch (with its host
    call and source line), the host calls, and where the session started on both clocks."""

    def __init__(self) -> None:
        rt = runtime()
        self.device = rt.device
        self.dispatch_ticks = rt.device.dispatch
        self.recorder = rt.device.open_scope(trace=True, sources=True)
        self.start_tick = self.recorder.start
        self.start_wall_ns = time.time_ns()  # torch.profiler's trace clock is wall time (baseTimeNanoseconds)
        self.start_perf_ns = time.perf_counter_ns()  # what torch.autograd.profiler.profile stamps its start with
        self.calls: list[HostCall] = []
        self.report: RunReport | None = None
        self._off_thread = self.device.simulate_off_thread
        self.device.simulate_off_thread = True  # the simulator's Python stays out of the host's trace

    def add_call(self, label: str) -> int:
        with _lock:
            self.calls.append(HostCall(label, threading.get_native_id()))
            return len(self.calls) - 1

    def close(self) -> None:
        if self.report is None:
            self.device.simulate_off_thread = self._off_thread
            self.report = self.device.close_scope(self.recorder)


_active: Session | None = None
_closed: list[Session] = []  # the latest closed sessions, newest last
_KEEP = 2


def _open() -> Session:
    global _active
    with _lock:
        if _active is None:
            _active = Session()
        _update_hook()
        return _active


def _close() -> None:
    global _active
    with _lock:
        sess, _active = _active, None
        if sess is None:
            return
        sess.close()
        _closed.append(sess)
        del _closed[:-_KEEP]
    _update_hook()


def on_profiler_start() -> None:
    """torch.profiler started recording: open a session if the neuron device is in use (else
    the first neuron op opens it)."""
    if is_initialized():
        _open()


def on_profiler_stop() -> None:
    _close()


def last_session() -> Session | None:
    """The session of the latest torch.profiler recording (the running one, else the last one)."""
    return _active or (_closed[-1] if _closed else None)


def _session_of(prof: Any) -> Session:
    """The closed session that recorded ``prof`` (the one that started just before it did)."""
    started = getattr(getattr(prof, "profiler", prof), "profiling_start_time_ns", None)
    sessions = list(_closed)
    if not sessions:
        raise RuntimeError("torch.neuron.profiler: no torch.profiler session ran neuron ops to export; profile "
                           "a block that uses the neuron device, and export after it ends")
    if started is None:
        return sessions[-1]
    before = [s for s in sessions if s.start_perf_ns <= started]
    return before[-1] if before else sessions[0]


# ---- the op wrapper -------------------------------------------------------------------------------
def traced(label: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` for neuron op ``label`` while torch.profiler records: a
    ``neuron::<label>`` record, and its launches tied to it (their source line comes from the
    device model's ``source_of`` hook, at the launch)."""
    dev = runtime().device
    sess = _active or _open()
    prev = dev.set_context("", sess.add_call(label))
    try:
        with _torch.RecordFunctionFast(f"neuron::{label}"):
            return fn(*args, **kwargs)
    finally:
        dev.restore_context(prev)


# ---- exporting --------------------------------------------------------------------------------------
def export_trace(prof: Any, path: str | os.PathLike[str] | AtomicOutput, *, expand: Sequence[str] = (),
                 top: int = 3) -> Path:
    """Write the merged trace of a finished torch.profiler session ``prof`` to ``path``.

    ``expand`` names ops or kernels whose engine and DMA-queue lanes are drawn (the longest
    launch of each); ``top`` adds the busiest ``top`` (op, kernel) rows of the session. The file
    is written through :class:`trnsim.config.files.AtomicOutput`; a path that cannot be written is a
    :class:`trnsim.config.files.OutputError`."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"torch.neuron.profiler: top={top!r}: expected a number of kernels >= 0")
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "trace")
    try:
        sess = _session_of(prof)
        with tempfile.TemporaryDirectory(prefix="trnsim-profile-") as tmp:
            host_file = os.path.join(tmp, "host.json")
            prof.export_chrome_trace(host_file)
            host = load_chrome_trace(host_file)
        assert sess.report is not None
        base = host.get("baseTimeNanoseconds")
        start = ((sess.start_wall_ns - base) / 1e3, sess.start_tick) if isinstance(base, int) else None
        doc = run_trace_document(sess.report, host, sess.calls, start, sess.dispatch_ticks, list(expand), top)
    except BaseException:
        out.discard()
        raise
    global _missing
    _missing = list(doc.get("not_expanded", []))
    return out.commit(lambda f: json.dump(doc, f, separators=(",", ":")))


_missing: list[str] = []


def last_expand_missing() -> list[str]:
    """The ``expand`` names the last exported trace found no launch of."""
    return list(_missing)


def load_chrome_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """torch.profiler's exported trace. Kineto writes event names unescaped, so a Python frame
    whose name holds a quote or backslash makes the file invalid JSON: such name lines are
    escaped and the file read again."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    lines = text.split("\n")
    for i, line in enumerate(lines):
        head, sep, rest = line.partition('"name": "')
        if not sep or head.strip():
            continue
        end = rest.rstrip()
        comma = end.endswith(",")
        inner = end[:-2] if comma else end[:-1]
        try:
            json.loads(f'"{inner}"')
        except json.JSONDecodeError:
            lines[i] = f'{head}"name": {json.dumps(inner)}{"," if comma else ""}'
    try:
        return json.loads("\n".join(lines))
    except json.JSONDecodeError as e:
        raise RuntimeError(f"torch.neuron.profiler: torch.profiler's trace is not valid JSON ({e}); export it "
                           f"with prof.export_chrome_trace to look at it") from None


def trace_handler(path: str | os.PathLike[str], *, expand: Sequence[str] = (), top: int = 3) -> Callable[[Any], None]:
    """An ``on_trace_ready`` for ``torch.profiler.profile``: each finished cycle writes its merged
    trace to ``path`` (``"{step}"`` in it becomes the profiler's step number)."""
    text = os.fspath(path)

    def handler(prof: Any) -> None:
        export_trace(prof, text.replace("{step}", str(getattr(prof, "step_num", 0))), expand=expand, top=top)
    return handler
