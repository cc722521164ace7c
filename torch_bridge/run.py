"""``trnsim run script.py [args]``: run an unmodified PyTorch script on the virtual device.

The chip is fixed before the script starts, the script runs as ``__main__`` with its own
``sys.argv``, and what its neuron ops cost comes back as a :class:`RunReport` (and, with a
trace path, a Chrome/Perfetto timeline of op launches: one process per NeuronCore, one lane per
stream). Rendering is the CLI's job.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

from trnsim.files import AtomicOutput
from trnsim.report import RunReport

__all__ = ["run_script", "compare_eager", "split_args", "write_op_trace", "RUN_OPTIONS", "RUN_FLAGS"]

RUN_OPTIONS = ("--config", "--set", "--trace", "--json", "--compare-eager", "--adaptive-eager")
RUN_FLAGS = ("--json", "--compare-eager", "--adaptive-eager")  # options without a value


def split_args(rest: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split what follows the script path into the script's own arguments and trnsim's options
    (``--config``/``--set``/``--trace`` take a value, ``--json`` none); after ``--`` everything is
    the script's."""
    script_args: list[str] = []
    opts: dict[str, Any] = {"set": []}
    items = list(rest)
    i = 0
    while i < len(items):
        a = items[i]
        if a == "--":
            script_args.extend(items[i + 1:])
            break
        name, eq, val = a.partition("=")
        if name in RUN_OPTIONS:
            if name in RUN_FLAGS:
                opts[name[2:].replace("-", "_")] = True
                i += 1
                continue
            if not eq:
                if i + 1 >= len(items):
                    raise ValueError(f"{name} needs a value")
                val = items[i + 1]
                i += 1
            if name == "--set":
                opts["set"].append(val)
            else:
                opts[name[2:]] = val
        else:
            script_args.append(a)
        i += 1
    return script_args, opts


class _StdoutToStderr:
    """Everything written to standard output - ``print``, C libraries, child processes - goes to
    standard error instead, while the block runs (``trnsim run --json`` keeps stdout for JSON)."""

    def __enter__(self) -> None:
        sys.stdout.flush()
        self.saved_fd = os.dup(1)
        os.dup2(2, 1)
        self.saved = sys.stdout
        sys.stdout = sys.stderr

    def __exit__(self, *exc: Any) -> None:
        sys.stdout.flush()
        sys.stdout = self.saved
        os.dup2(self.saved_fd, 1)
        os.close(self.saved_fd)


def run_script(script: str, args: Sequence[str], config: str | None = None, overrides: Sequence[str] = (),
               trace: str | None = None, eager: bool = False, adaptive: bool = False,
               quiet_stdout: bool = False) -> tuple[int, RunReport]:
    """Run ``script`` with ``args`` on the neuron device; returns (exit status, report).

    ``eager`` runs every ``torch.compile``d function eagerly (``torch.compiler.set_stance(
    "force_eager")``); ``adaptive`` turns adaptive eager on. A missing script raises
    FileNotFoundError; an exception in the script prints its traceback to stderr and gives
    status 1 (the report still covers what ran); ``sys.exit("message")`` prints the message and
    gives status 1, as ``python script.py`` does. A trace path that cannot be written (a FIFO, a
    device, a missing or read-only directory) is refused with :class:`trnsim.files.OutputError`
    before the script starts. With ``quiet_stdout`` the script's standard output goes to
    standard error (the caller prints data on stdout).
    """
    if quiet_stdout:
        with _StdoutToStderr():
            return run_script(script, args, config, overrides, trace, eager, adaptive)
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    import contextlib

    import torch

    import torch_bridge
    import torch_bridge.compile
    from torch_bridge import device, runtime

    torch_bridge.register()
    torch_bridge.compile.register()  # backend="neuron" by name, even in a checkout without the entry point
    if (config is not None or overrides) and not runtime.is_initialized():
        runtime.set_config(config or os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2", list(overrides))
    for i in range(device.device_count()):  # the report starts from an idle device
        device.synchronize(i)
    device.reset_report(trace=trace is not None)
    out = AtomicOutput(trace, "--trace") if trace is not None else None  # refused now, not after the run
    device.set_adaptive_eager(adaptive)
    saved_argv, saved_path = sys.argv, list(sys.path)
    # Hugging Face accelerate (and so the Trainer) detects a neuron device only through AWS's own
    # torch_neuronx package; the device it should use otherwise is this variable, read by both
    saved_env = os.environ.get("ACCELERATE_TORCH_DEVICE")
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "neuron")
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    status = 0
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    try:
        try:
            with stance:
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            status = _exit_status(e.code)
        except Exception:  # the user's script failed: show its traceback, keep the report
            traceback.print_exc()
            status = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            if saved_env is None:
                os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        for i in range(device.device_count()):
            device.synchronize(i)
        device.set_adaptive_eager(False)
        report = device.report()
        if out is not None:
            write_op_trace(out, report)
    finally:
        if out is not None:
            out.discard()
    return status, report


def compare_eager(script: str, args: Sequence[str], config: str | None = None, overrides: Sequence[str] = (),
                  quiet_stdout: bool = False) -> tuple[int, RunReport, RunReport]:
    """Run ``script`` twice in this process, first with torch.compile turned off (every compiled
    function eager), then as written; returns (exit status, eager report, compiled report)."""
    status, eager = run_script(script, args, config, overrides, eager=True, quiet_stdout=quiet_stdout)
    if status:
        return status, eager, eager
    status, compiled = run_script(script, args, config, overrides, quiet_stdout=quiet_stdout)
    return status, eager, compiled


def _exit_status(code: object) -> int:
    """What ``python script.py`` does with ``sys.exit(code)``: None is 0, an int is itself,
    anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stdout.flush()
    print(code, file=sys.stderr)
    return 1


def write_op_trace(path: str | os.PathLike[str] | AtomicOutput, report: RunReport) -> None:
    """Chrome trace-event JSON of every launch: pid = NeuronCore, tid = stream, times in simulated
    us, and a ``host`` lane with each launch's dispatch (ending when the host issued it). Written
    through :class:`trnsim.files.AtomicOutput` (a temporary file renamed into place; symlinks
    followed, FIFOs and devices refused); ``path`` may be one reserved before the run."""
    events: list[dict[str, Any]] = []
    to_us = 1e6 / report.tick_hz
    host_pid = -1
    events.append({"ph": "M", "name": "process_name", "pid": host_pid, "args": {"name": "host (simulated)"}})
    events.append({"ph": "M", "name": "thread_name", "pid": host_pid, "tid": 0, "args": {"name": "dispatch"}})
    for dev in sorted({e.core for e in report.events}):
        events.append({"ph": "M", "name": "process_name", "pid": dev,
                       "args": {"name": f"neuron:{dev} ({report.config}, simulated)"}})
    for dev, stream in sorted({(e.core, e.stream) for e in report.events}):
        events.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": stream,
                       "args": {"name": "default stream" if stream == 0 else f"stream {stream}"}})
    prev_issue = None
    for e in report.events:
        if prev_issue is not None and e.issued > prev_issue:
            events.append({"ph": "X", "name": e.op, "cat": "dispatch", "pid": host_pid, "tid": 0,
                           "ts": prev_issue * to_us, "dur": (e.issued - prev_issue) * to_us})
        prev_issue = e.issued
        events.append({"ph": "X", "name": e.op, "cat": e.kernel, "pid": e.core, "tid": e.stream,
                       "ts": e.start * to_us, "dur": (e.end - e.start) * to_us,
                       "args": {"kernel": e.kernel, "issued_us": e.issued * to_us}})
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "trace")
    out.commit(lambda f: json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f))
