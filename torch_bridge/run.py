"""``trnsim run script.py [args]``: run an unmodified PyTorch script on the virtual device.

The chip is fixed before the script starts, the script runs as ``__main__`` with its own
``sys.argv``, and what its neuron ops cost comes back as a :class:`RunReport`. With a trace
path the script runs under torch.profiler and one Perfetto trace holds the host's aten events
(and Python frames, with ``trace_stack``), the device's stream lanes and the engine lanes of
expanded kernels (:mod:`trnsim.run_trace`); ``metrics`` writes the report's rows as Parquet
(:mod:`trnsim.sim.metrics`, with each row's source line) and ``plot`` draws them
(:mod:`trnsim.plot`). Rendering the report is the CLI's job.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

from trnsim.config.files import AtomicOutput
from trnsim.sim.report import RunReport

__all__ = ["run_script", "compare_eager", "split_args", "write_op_trace", "RUN_OPTIONS", "RUN_FLAGS"]

RUN_OPTIONS = ("--config", "--set", "--trace", "--json", "--compare-eager", "--adaptive-eager", "--timing-only",
               "--metrics", "--plot", "--expand", "--expand-top", "--trace-stack", "--nproc", "--system", "--timeout",
               "--host-profile", "--cost-cache")
RUN_FLAGS = ("--json", "--compare-eager", "--adaptive-eager", "--timing-only", "--trace-stack",
             "--host-profile", "--cost-cache")  # options without a value
_REPEATED = ("--set", "--expand")


def split_args(rest: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split what follows the script path into the script's own arguments and trnsim's options
    (each of :data:`RUN_OPTIONS` takes a value but the :data:`RUN_FLAGS`; ``--set`` and
    ``--expand`` repeat); after ``--`` everything is the script's."""
    script_args: list[str] = []
    opts: dict[str, Any] = {"set": [], "expand": []}
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
                if eq:
                    raise ValueError(f"{name} takes no value (got {a!r})")
                opts[name[2:].replace("-", "_")] = True
                i += 1
                continue
            if not eq:
                if i + 1 >= len(items):
                    raise ValueError(f"{name} needs a value")
                val = items[i + 1]
                i += 1
            if name in _REPEATED:
                opts[name[2:]].append(val)
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
               trace: str | None = None, eager: bool = False, adaptive: bool = False, metrics: str | None = None,
               plot: str | None = None, expand: Sequence[str] = (), expand_top: int = 3,
               trace_stack: bool = False, quiet_stdout: bool = False, timing_only: bool = False,
               host_profile: list[Any] | None = None) -> tuple[int, RunReport]:
    """Run ``script`` with ``args`` on the neuron device; returns (exit status, report).

    ``eager`` runs every ``torch.compile``d function eagerly (``torch.compiler.set_stance(
    "force_eager")``); ``adaptive`` turns adaptive eager on; ``timing_only`` runs the script inside
    ``torch.neuron.timing_only()`` (an op that needs values stops it with one line naming the
    script's line and the op, status 1). A missing script raises FileNotFoundError; an exception
    in the script prints its traceback to stderr and gives status 1 (the report still covers what
    ran); ``sys.exit("message")`` prints the message and gives status 1, as ``python script.py``
    does. An output path that cannot be written (a FIFO, a device, a missing or read-only
    directory) or that needs a missing extra (pyarrow for ``metrics``, matplotlib for ``plot``) is
    refused with :class:`trnsim.config.files.OutputError` /
    :class:`trnsim.extras.MissingExtra` before the script starts. Under ``trace`` the script runs
    inside trnsim's torch.profiler session, so it must not start one of its own (torch allows one
    at a time); ``expand``/``expand_top`` choose the kernels whose engine lanes the trace draws;
    ``trace_stack`` adds torch.profiler's Python function events (``with_stack=True``: every
    Python call of the script, its imports included, so traces grow by orders of magnitude; the
    launches name their source line either way).
    With ``quiet_stdout`` the script's standard output goes to standard error (the caller
    prints data on stdout). ``host_profile``: a list the run's
    :class:`torch_bridge.neuron.hostprof.Profile` is appended to: the script runs under
    ``hostprof.profile()``, which splits the host's wall time into the simulator's parts (it reads
    the host's clock only: the report and the values are the same without it).
    """
    if quiet_stdout:
        with _StdoutToStderr():
            return run_script(script, args, config, overrides, trace, eager, adaptive, metrics, plot, expand,
                              expand_top, trace_stack, timing_only=timing_only, host_profile=host_profile)
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"{script}: a directory, not a Python script" if Path(script).is_dir()
                                else f"no such script: {script}")
    import contextlib

    import torch

    import torch_bridge
    import torch_bridge.compile
    from torch_bridge import runtime
    from torch_bridge.neuron import module as device, profiler
    from trnsim.config.files import reserve_all
    from trnsim.sim.metrics import reserve as reserve_metrics
    from trnsim.outputs.plot import reserve as reserve_plot

    torch_bridge.register()
    torch_bridge.compile.register()  # backend="neuron" by name, even in a checkout without the entry point
    if (config is not None or overrides) and not runtime.is_initialized():
        runtime.set_config(config or os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2", list(overrides))
    for i in range(device.device_count()):  # the report starts from an idle device
        device.synchronize(i)
    outputs = reserve_all([lambda: AtomicOutput(trace, "--trace") if trace else None,  # refused now, not after the run
                           lambda: reserve_metrics(metrics, "--metrics") if metrics else None,
                           lambda: reserve_plot(plot, "--plot") if plot else None])
    trace_out, metrics_out, plot_out = outputs
    runtime.runtime().device.reset(sources=metrics is not None)  # the report starts now
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
    prof = _profile(trace_stack) if trace is not None else contextlib.nullcontext()
    if host_profile is not None:
        from torch_bridge.neuron import hostprof

        host = hostprof.profile()
    else:
        host = contextlib.nullcontext()
    tracking = profiler.tracking
    profiler.track_sources(tracking or metrics is not None)
    try:
        with prof, host as recorded:
            if host_profile is not None:
                host_profile.append(recorded)
            try:
                with stance, (device.timing_only() if timing_only else contextlib.nullcontext()):
                    runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                status = _exit_status(e.code)
            except Exception as e:  # the user's script failed: show its traceback, keep the report
                from .timing.fake import TimingOnlyError

                if isinstance(e, TimingOnlyError):  # one line: where in the script, and which op
                    sys.stdout.flush()
                    print(f"trnsim run: {_where(e, path)}{e}", file=sys.stderr)
                else:
                    traceback.print_exc()
                status = 1
            finally:
                sys.argv, sys.path[:] = saved_argv, saved_path
                if saved_env is None:
                    os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
            for i in range(device.device_count()):  # queued launches are issued inside the session
                device.synchronize(i)
        profiler.track_sources(tracking)
        device.set_adaptive_eager(False)
        report = device.report()
        if trace_out is not None:
            profiler.export_trace(prof, trace_out, expand=expand, top=expand_top)
            missing = profiler.last_expand_missing()
            if missing:
                sys.stdout.flush()
                print(f"trnsim: note: --expand {', '.join(missing)}: no launch of such an op or kernel in the trace",
                      file=sys.stderr)
        if metrics_out is not None:
            report.to_parquet(metrics_out)
        if plot_out is not None:
            from trnsim.outputs.plot import plot_run

            plot_run(report, plot_out, title=f"{script} on {report.config}: per-op device time and engine use")
    finally:
        profiler.track_sources(tracking)
        for o in outputs:
            if o is not None:
                o.discard()
    return status, report


def _profile(stack: bool) -> Any:
    """The torch.profiler session ``--trace`` runs a script in: CPU activity (the host's aten and
    neuron::<op> events), with Python function events if ``stack``."""
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=stack)


def compare_eager(script: str, args: Sequence[str], config: str | None = None, overrides: Sequence[str] = (),
                  quiet_stdout: bool = False) -> tuple[int, RunReport, RunReport]:
    """Run ``script`` twice in this process, first with torch.compile turned off (every compiled
    function eager), then as written; returns (exit status, eager report, compiled report)."""
    status, eager = run_script(script, args, config, overrides, eager=True, quiet_stdout=quiet_stdout)
    if status:
        return status, eager, eager
    status, compiled = run_script(script, args, config, overrides, quiet_stdout=quiet_stdout)
    return status, eager, compiled


def _where(e: BaseException, script: Path) -> str:
    """``script.py:LINE: `` of the script's innermost frame in ``e``'s traceback ('' if none)."""
    target = str(script.resolve())
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if str(Path(frame.filename).resolve()) == target:
            line = frame.lineno
    return f"{script}:{line}: " if line is not None else ""


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


def write_op_trace(path: str | os.PathLike[str] | AtomicOutput, report: RunReport, expand: Sequence[str] = (),
                   top: int = 0) -> None:
    """The trace of a report that kept its launches (``report_scope(trace=True)``), without
    torch.profiler's host events: the simulated host's dispatch lane, the device's stream lanes
    and the engine lanes of ``expand``/``top`` kernels (:mod:`trnsim.run_trace`). Written through
    :class:`trnsim.config.files.AtomicOutput`; ``path`` may be one reserved before the run."""
    from trnsim.outputs.run_trace import write_run_trace

    write_run_trace(path, report, expand=list(expand), top=top)
