"""``@nki.jit`` kernels on trnsim: trace, schedule, run.

Calling a kernel with numpy arrays runs it on the virtual chip and returns its outputs, as NKI's
baremetal and simulator calls do; :func:`run` returns the outputs together with the cycle
report. A call goes through three steps:

1. **Trace.** The kernel function runs once with its array arguments as HBM input tensors; each
   ``nki.isa`` call (and each ``nki.language`` op, lowered to them) emits one instruction into
   a kernel builder whose SBUF/PSUM never runs out (:func:`trnsim.schedule.unbounded_kernel`).
   Tensors it returns become outputs; inputs it writes become outputs too (and are updated in
   place in the caller's arrays, as ``nki.simulate`` does). An SPMD grid (``kernel[2, 4]``)
   traces each program in turn into the same kernel, on one NeuronCore, with
   ``nl.program_id`` set; HBM tensors a program allocates are shared by all of them.
2. **Schedule.** :func:`trnsim.schedule.schedule` lays the tiles out within SBUF/PSUM capacity
   and list-schedules the instructions over their dependencies, as the Neuron compiler
   schedules and allocates a kernel (``schedule=False`` keeps the program order).
3. **Simulate.** :meth:`trnsim.Chip.run`: values from the datapath, cycles from the engines.

The chip is ``config=`` (of ``jit``, of the call), else ``NEURON_PLATFORM_TARGET_OVERRIDE``
(``trn1|gen2``, ``trn2|gen3``, ``trn3|gen4``), else trn2.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..sim.chip import Chip
from ..config import ChipConfig, load_config
from ..isa import HbmAP, KernelError
from ..builder.kernel import Kernel as BuilderKernel, gc_paused
from ..native.dtypes import get_dtype
from ..sim.report import KernelReport
from ..sim.list_schedule import ScheduleStats, schedule, unbounded_kernel
from ._core import PACKAGE_DIR, NkiError, NkiTensor, Trace, Store, is_whole, nki_dtype

__all__ = ["JitKernel", "jit", "run", "trace", "simulate", "simulate_kernel", "baremetal", "benchmark", "NkiRun",
           "Traced", "TensorSpec", "tensor_spec"]

_TARGETS = {"trn1": "trn1", "gen2": "trn1", "inf2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3",
            "gen4": "trn3"}


@dataclass(frozen=True)
class TensorSpec:
    """An input known by shape and dtype only, for timing-only runs (no values)."""

    shape: tuple[int, ...]
    dtype: str


def tensor_spec(shape: Sequence[int], dtype: Any = "float32") -> TensorSpec:
    """An argument for :func:`trace` / ``run(..., timing_only=True)`` that stands for an array."""
    return TensorSpec(tuple(int(n) for n in shape), get_dtype(nki_dtype(dtype)).name)


@dataclass
class Traced:
    """A traced and scheduled kernel: ``kernel`` runs on a Chip; ``traced`` is the program order
    with unbounded memory; ``outputs`` are the returned tensors' names, in the structure the
    kernel returned (a name, a tuple of names, or None)."""

    kernel: BuilderKernel
    traced: BuilderKernel
    config: ChipConfig
    inputs: dict[str, np.ndarray]
    outputs: Any
    written_inputs: dict[str, Any]
    schedule_stats: ScheduleStats


@dataclass
class NkiRun:
    """What :func:`run` returns: the outputs (numpy arrays, in the structure the kernel returned;
    None when timing-only) and the cycle report of the scheduled kernel."""

    outputs: Any
    report: KernelReport
    traced: Traced

    @property
    def schedule_stats(self) -> ScheduleStats:
        return self.traced.schedule_stats


def target_config(config: Any) -> ChipConfig:
    if config is not None:
        return load_config(config)
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip().lower()
    if env:
        if env not in _TARGETS:
            raise NkiError(f"NEURON_PLATFORM_TARGET_OVERRIDE={env!r}: expected trn1|gen2, trn2|gen3 or trn3|gen4")
        return load_config(_TARGETS[env])
    return load_config("trn2")


def _where(tb: Any) -> str:
    """``file.py:LINE`` of the innermost frame of ``tb`` outside trnsim (the kernel's line)."""
    for fr in reversed(traceback.extract_tb(tb)):
        if not os.path.abspath(fr.filename).startswith(PACKAGE_DIR + os.sep):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return ""


def _internal(tb: Any) -> bool:
    """Did the exception come from trnsim's own code (its innermost frame)?"""
    frames = traceback.extract_tb(tb)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep)


class JitKernel:
    """An ``@nki.jit`` kernel. Call it with arrays to run it on trnsim; ``kernel[grid]`` launches
    an SPMD grid; :meth:`run` and :meth:`trace` give the report and the instruction stream."""

    def __init__(self, fn: Callable[..., Any], *, grid: tuple[int, ...] = (), schedule: bool = True,
                 config: Any = None, **options: Any):
        if not callable(fn):
            raise NkiError(f"nki.jit expects a function, got {type(fn).__name__}")
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.fn = fn
        self.grid = grid
        self.schedule = schedule
        self.config = config
        self.options = options  # mode=, platform_target=, ... (accepted; trnsim has one mode)
        self.last_run: NkiRun | None = None

    def __repr__(self) -> str:
        return f"nki.jit({self.fn.__name__}{'' if not self.grid else list(self.grid)})"

    def __getitem__(self, grid: Any) -> "JitKernel":
        if not isinstance(grid, tuple):
            grid = (grid,)
        for g in grid:
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
                raise NkiError(f"{self.fn.__name__}[{grid}]: an SPMD grid is positive integers (multi-core LNC=2 "
                               f"launches with nl.nc are not supported by trnsim.nki)")
        return JitKernel(self.fn, grid=tuple(int(g) for g in grid), schedule=self.schedule, config=self.config,
                      **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs).outputs

    # ---- tracing -----------------------------------------------------------------------------
    def programs(self) -> list[tuple[int, ...]]:
        """The SPMD programs of the launch grid, in launch order (``[()]`` without a grid)."""
        return list(itertools.product(*(range(g) for g in self.grid))) if self.grid else [()]

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], cfg: ChipConfig,
               programs: Sequence[int] | None) -> tuple[Any, ...]:
        """Run the kernel function once per program (``programs``: indices into
        :meth:`programs`, default all) into one unbounded, unscheduled builder kernel."""
        name = getattr(self.fn, "__name__", "kernel")
        k0 = unbounded_kernel(name, cfg)
        try:
            sig = inspect.signature(self.fn)
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise NkiError(f"{name}: {e}") from None
        inputs: dict[str, np.ndarray] = {}
        call_args: dict[str, Any] = {}
        for pname, value in bound.arguments.items():
            kind = sig.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                call_args[pname] = tuple(_arg(k0, f"{pname}{i}", v, inputs) for i, v in enumerate(value))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                call_args[pname] = {k: _arg(k0, k, v, inputs) for k, v in value.items()}
            else:
                call_args[pname] = _arg(k0, pname, value, inputs)
        pos, kw = [], {}
        for pname, v in call_args.items():
            kind = sig.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                pos.extend(v)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                kw.update(v)
            elif kind is inspect.Parameter.KEYWORD_ONLY:
                kw[pname] = v
            else:
                pos.append(v)
        shared: list[Store] = []
        every = self.programs()
        chosen = every if programs is None else [every[i] for i in programs]
        ret: Any = None
        sources: list[str] = []
        extra: dict[int, set[int]] = {}
        constants: dict[str, np.ndarray] = {}
        with gc_paused():  # tracing builds a builder kernel: see trnsim.kernel.gc_paused
            for pid in chosen:
                tr = Trace(k0, pid, self.grid)
                tr.shared_hbm = shared  # type: ignore[attr-defined]
                tr.source_lines = sources
                tr.extra_deps = extra
                tr.constants = constants
                tr.inputs = inputs
                with tr:
                    try:
                        ret = self.fn(*pos, **kw)
                        tr.flush()
                    except NkiError as e:
                        msg = str(e)
                        where = _where(e.__traceback__)
                        located = re.match(r"^[^\s:]+\.py:\d+: ", msg) is not None  # already names its line
                        raise NkiError(msg if not where or located else f"{where}: {msg}") from None
                    except KernelError as e:
                        raise NkiError(f"{_where(e.__traceback__)}: {e}".lstrip(": ")) from None
                    except Exception as e:
                        if _internal(e.__traceback__):
                            raise  # a trnsim bug, not the kernel's: keep the traceback
                        first = str(e).split("\n", 1)[0]
                        raise NkiError(f"{_where(e.__traceback__)}: {type(e).__name__}: {first}".lstrip(": ")) from e
        inputs.update(constants)
        outputs = _mark_outputs(name, ret)
        written = {}
        for ins in k0.instructions:
            for ap in ins.writes:
                if isinstance(ap, HbmAP) and ap.tensor.kind == "input":
                    ap.tensor.kind = "inout"
        for pname, value in bound.arguments.items():
            t = k0.tensors.get(pname)
            if t is not None and t.kind == "inout":
                written[pname] = value
        k0.source_lines = sources  # type: ignore[attr-defined]
        return k0, inputs, outputs, written, extra

    def trace(self, *args: Any, config: Any = None, programs: Sequence[int] | None = None, **kwargs: Any) -> Traced:
        """Trace and schedule the kernel for these arguments (arrays or :func:`tensor_spec`);
        ``programs`` (indices into :meth:`programs`) traces only those programs of the grid, as
        one physical core of a logical core runs its share of an LNC=2 launch."""
        cfg = target_config(config if config is not None else self.config)
        k0, inputs, outputs, written, extra = self._trace(args, kwargs, cfg, programs)
        try:
            sched = schedule(k0, extra_deps={i: sorted(d) for i, d in extra.items()}, reorder=self.schedule)
        except NkiError:
            raise
        except KernelError as e:  # the kernel does not fit SBUF/PSUM in any order
            raise NkiError(str(e)) from None
        return Traced(sched, k0, cfg, inputs, outputs, written, sched.schedule_stats)  # type: ignore[attr-defined]

    def output_specs(self, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        """What the kernel returns for these arguments, as :class:`TensorSpec` in the structure
        it returns them (None for a kernel that returns nothing): traced, not scheduled or
        simulated (what a framework needs to allocate the outputs of a call)."""
        cfg = target_config(config if config is not None else self.config)
        k0, _, outputs, _, _ = self._trace(args, kwargs, cfg, None)
        return restructure(outputs, {n: TensorSpec(t.shape, t.dtype.name) for n, t in k0.tensors.items()})

    def run(self, *args: Any, config: Any = None, timing_only: bool = False, **kwargs: Any) -> NkiRun:
        """Trace, schedule and simulate: outputs (numpy) and the cycle report."""
        t = self.trace(*args, config=config, **kwargs)
        if not timing_only and any(isinstance(v, TensorSpec) for v in t.inputs.values()):
            raise NkiError(f"{self.fn.__name__}: tensor_spec arguments carry no values; run with timing_only=True")
        result = Chip(t.config).run(t.kernel, None if timing_only else t.inputs, timing_only=timing_only)
        outs = None
        if not timing_only:
            outs = restructure(t.outputs, result.outputs or {})
            for pname, arr in t.written_inputs.items():  # inputs the kernel wrote: updated in place
                if isinstance(arr, np.ndarray) and arr.dtype == result[pname].dtype and arr.flags.writeable:
                    np.copyto(arr, result[pname].reshape(arr.shape))
        r = NkiRun(outs, result.report, t)
        self.last_run = r
        return r


def _arg(k: BuilderKernel, name: str, value: Any, inputs: dict[str, Any]) -> Any:
    """A kernel argument as the kernel sees it: arrays become HBM input tensors."""
    if isinstance(value, TensorSpec):
        shape, dt = value.shape, nki_dtype(value.dtype)
        arr: Any = value
    elif isinstance(value, np.ndarray) or (hasattr(value, "__array__") and hasattr(value, "shape")
                                           and not isinstance(value, (int, float))):
        arr = np.asarray(value)
        if arr.dtype.kind == "b":
            arr = arr.astype(np.uint8)
        try:
            dt = get_dtype(arr.dtype)
        except ValueError:
            raise NkiError(f"argument '{name}' is a {arr.dtype} array; NKI tensors are float32, bfloat16, float16, "
                           f"fp8, int8/16/32 or uint8/32: cast it") from None
        shape = arr.shape if arr.ndim else (1,)
        arr = arr.reshape(shape)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (np.ndarray, TensorSpec)) for v in value):
        return type(value)(_arg(k, f"{name}{i}", v, inputs) for i, v in enumerate(value))
    else:
        return value  # a compile-time value: passed as is
    st = Store("hbm", tuple(shape), dt, name)
    st.tensor = k.input(name, st.shape, dt)
    inputs[name] = arr
    return NkiTensor.full(st)


def _mark_outputs(name: str, ret: Any) -> Any:
    """Mark the HBM tensors the kernel returned as outputs; their names, in ``ret``'s structure."""
    if ret is None:
        return None
    if isinstance(ret, (tuple, list)):
        return type(ret)(_mark_outputs(name, r) for r in ret)
    if isinstance(ret, dict):
        return {k: _mark_outputs(name, v) for k, v in ret.items()}
    if not isinstance(ret, NkiTensor):
        raise NkiError(f"{name} returned {type(ret).__name__}; a kernel returns HBM tensors (nl.ndarray(..., "
                       f"buffer=nl.shared_hbm)), a tuple of them, or None")
    if ret._pending is not None:
        raise NkiError(f"{name} returned {ret.name} ({ret.buffer}); return whole HBM tensors (store on-chip tiles to "
                       f"one first)")
    st = ret._store()
    if st.kind != "hbm" or not is_whole(ret) or st.tensor is None:
        raise NkiError(f"{name} returned {ret.name} ({ret.buffer}); return whole HBM tensors (store on-chip "
                       f"tiles to one first)")
    if st.tensor.kind in ("input", "inout"):
        raise NkiError(f"{name} returned its argument {ret.name}; a kernel returns HBM tensors it allocates "
                       f"(nl.ndarray(..., buffer=nl.shared_hbm)), and writes an argument it changes in place")
    if st.tensor.kind == "scratch":
        st.tensor.kind = "output"
    return st.tensor.name


def restructure(names: Any, values: dict[str, np.ndarray]) -> Any:
    if names is None:
        return None
    if isinstance(names, (tuple, list)):
        return type(names)(restructure(n, values) for n in names)
    if isinstance(names, dict):
        return {k: restructure(v, values) for k, v in names.items()}
    return values[names]


# ---- the NKI entry points -----------------------------------------------------------------------
def jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``@nki.jit`` / ``@nki.jit(mode=..., schedule=False, config="trn3")``: a :class:`JitKernel`."""
    if fn is None:
        return lambda f: JitKernel(f, **kwargs)
    return JitKernel(fn, **kwargs)


def as_kernel(kernel: Any) -> JitKernel:
    if isinstance(kernel, JitKernel):
        return kernel
    if callable(kernel):
        return JitKernel(kernel)
    raise NkiError(f"expected an @nki.jit kernel or a function, got {type(kernel).__name__}")


def run(kernel: Any, *args: Any, config: Any = None, timing_only: bool = False, **kwargs: Any) -> NkiRun:
    """Run ``kernel`` on trnsim: the outputs and the cycle report (:class:`NkiRun`)."""
    return as_kernel(kernel).run(*args, config=config, timing_only=timing_only, **kwargs)


def trace(kernel: Any, *args: Any, config: Any = None, **kwargs: Any) -> Traced:
    """Trace and schedule ``kernel`` for these arguments without running it."""
    return as_kernel(kernel).trace(*args, config=config, **kwargs)


def simulate_kernel(kernel: Any, *args: Any, **kwargs: Any) -> Any:
    """``neuronxcc.nki.simulate_kernel(kernel, *args)``: the outputs, computed on trnsim (which
    also times them: see ``kernel.last_run.report``)."""
    k = as_kernel(kernel)
    return k(*args, **kwargs)


def simulate(kernel: Any) -> Callable[..., Any]:
    """``nki.simulate(kernel)(*args)``: the outputs, computed on trnsim."""
    k = as_kernel(kernel)
    return k.__call__


def baremetal(kernel: Any = None, **options: Any) -> Any:
    """``nki.baremetal``: on trnsim, the same as calling the kernel (the virtual chip is the
    device)."""
    if kernel is None:
        return lambda f: as_kernel(f)
    return as_kernel(kernel)


class _Latency:
    def __init__(self, us: float):
        self.us = us

    def get_latency_percentile(self, percentile: float) -> float:
        """Latency in microseconds at ``percentile``: the simulation is deterministic, so every
        percentile is the kernel's simulated time."""
        if not 0 <= float(percentile) <= 100:
            raise NkiError(f"get_latency_percentile: percentile must be within 0..100, got {percentile!r}")
        return self.us


class _BenchmarkResult:
    def __init__(self, report: KernelReport):
        self.nc_latency = _Latency(report.total_us)
        self.report = report


class Benchmarked:
    """What ``nki.benchmark(...)(kernel)`` gives: call it with arrays; then ``benchmark_result
    .nc_latency.get_latency_percentile(50)`` is the simulated time in us. ``warmup``/``iters``
    change nothing (one simulation is exact); ``save_trace_name`` writes a Perfetto trace of
    the run (trnsim's Chrome trace format, not NTFF); no NEFF is written."""

    def __init__(self, kernel: JitKernel, options: dict[str, Any]):
        unknown = set(options) - {"warmup", "iters", "save_neff_name", "save_trace_name", "additional_compile_opt",
                                  "device_count", "mode"}
        if unknown:
            raise NkiError(f"nki.benchmark: unexpected argument '{sorted(unknown)[0]}'")
        self.kernel = kernel
        self.options = options
        self.benchmark_result: _BenchmarkResult | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self.kernel.run(*args, **kwargs)
        self.benchmark_result = _BenchmarkResult(r.report)
        path = self.options.get("save_trace_name")
        if path:
            from ..outputs.trace import write_trace

            write_trace(path, r.report)
        return r.outputs


def benchmark(kernel: Any = None, **options: Any) -> Any:
    """``nki.benchmark(warmup=, iters=, save_trace_name=)`` as a decorator (or called with the
    kernel): a :class:`Benchmarked` kernel whose result carries the simulated latency."""
    if kernel is None:
        return lambda f: Benchmarked(as_kernel(f), options)
    return Benchmarked(as_kernel(kernel), options)
