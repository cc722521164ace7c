"""Chip: run kernels on the virtual Trainium and get their values and their cost."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..config import ChipConfig, format_quantity, load_config
from ..cores.base import ENGINE_TYPES
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..native.cast import to_dtype
from ..memory.hbm import check_capacity
from ..memory.state import DeviceMemory
from ..native import convert
from .report import KernelFigures, KernelReport, build_report, kernel_figures
from . import CoreTimeline, simulate

__all__ = ["Chip", "RunResult", "check_host_memory", "host_available_bytes"]


def check_host_memory(kernel: Kernel, extra: int = 0) -> None:
    """A run with values holds the kernel's SBUF/PSUM (up to their high-water marks) and every HBM
    tensor in host memory, plus ``extra`` bytes the caller needs beside them (e.g. reference
    arrays): refuse a kernel the host cannot hold with a KernelError naming what takes the room,
    before allocating any of it."""
    c = kernel.config.core
    sbuf, psum = kernel.sbuf_high_water, kernel.psum_high_water
    need = c.sbuf.partitions * sbuf + c.psum.partitions * psum + kernel.hbm_bytes + extra
    avail = host_available_bytes()
    if avail is not None and need > avail:
        by = lambda n: format_quantity(n, "bytes")  # noqa: E731
        parts = f"SBUF {c.sbuf.partitions} x {by(sbuf)}, PSUM {c.psum.partitions} x {by(psum)}, HBM tensors " \
                f"{by(kernel.hbm_bytes)}" + (f", inputs and reference {by(extra)}" if extra else "")
        raise KernelError(f"kernel '{kernel.name}': computing its values needs {by(need)} of host memory ({parts}) "
                          f"but {by(avail)} is available; run it timing-only (timing_only=True, or without --check)")


def host_available_bytes() -> int | None:
    """Host memory available to allocate now, bytes (Linux MemAvailable; None if unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class RunResult:
    """What :meth:`Chip.run` returns: output arrays by name (None in timing-only mode) and the
    kernel's :class:`~trnsim.report.KernelReport`."""

    outputs: dict[str, np.ndarray] | None
    report: KernelReport

    def __getitem__(self, name: str) -> np.ndarray:
        if self.outputs is None:
            raise KeyError(f"no outputs in a timing-only run (asked for '{name}')")
        return self.outputs[name]


class Chip:
    """A simulated chip built from a config name (``"trn2"``), a YAML path, or a ChipConfig,
    with optional dotted overrides (``{"core.sbuf.partition_bytes": "256KiB"}``)."""

    def __init__(self, config: ChipConfig | str | os.PathLike[str] = "trn2",
                 overrides: Iterable[str] | Mapping[str, Any] | None = None):
        self.config = load_config(config, overrides)

    def kernel(self, name: str = "kernel") -> Kernel:
        """A new kernel builder targeting this chip's cores."""
        return Kernel(name, self.config)

    def run(self, kernel: Kernel, inputs: Mapping[str, Any] | None = None, *, timing_only: bool = False,
            core: int = 0) -> RunResult:
        """Simulate ``kernel`` on one NeuronCore.

        ``inputs`` maps each kernel input name to an array (any float/int array; it is rounded
        to the tensor's dtype with round-to-nearest-even). With ``timing_only=True`` no values
        are computed and ``inputs`` may be omitted; the cycles are the same either way.
        """
        self._check_kernel(kernel, core)
        values = None if timing_only else self._execute(kernel, inputs)
        idle = [Kernel("idle", self.config) for _ in range(core)]
        timelines = simulate(self.config, idle + [kernel])
        return RunResult(values, self._report(kernel, timelines[core], core))

    def execute(self, kernel: Kernel, inputs: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """The values ``kernel`` computes from ``inputs`` - the outputs :meth:`run` returns -
        without simulating its time: for a front end that costs the kernel separately (its cycles
        are the same for any values)."""
        self._check_kernel(kernel, 0)
        return self._execute(kernel, inputs)

    def run_spmd(self, kernels: Sequence[Kernel], inputs: Sequence[Mapping[str, Any]] | None = None, *,
                 timing_only: bool = False) -> list[RunResult]:
        """Run ``kernels[c]`` on core ``c`` at the same time (sharing HBM stacks), e.g. the two
        physical cores of an LNC=2 logical core."""
        kernels = list(kernels)
        for c, k in enumerate(kernels):
            self._check_kernel(k, c)
        if inputs is not None and len(inputs) != len(kernels):
            raise KernelError(f"run_spmd: {len(kernels)} kernels but {len(inputs)} input mappings; give one per kernel")
        outs = [None if timing_only else self._execute(k, None if inputs is None else inputs[c])
                for c, k in enumerate(kernels)]
        timelines = simulate(self.config, list(kernels))
        figures: dict[int, KernelFigures] = {}  # a kernel run on several cores is read once
        for k in kernels:
            if id(k) not in figures:
                figures[id(k)] = kernel_figures(k.instructions, self.config)
        return [RunResult(outs[c], self._report(k, tl, c, figures[id(k)]))
                for c, (k, tl) in enumerate(zip(kernels, timelines))]

    # ---- internals -------------------------------------------------------------------------
    def _report(self, kernel: Kernel, tl: CoreTimeline, core: int, figures: KernelFigures | None = None
                ) -> KernelReport:
        return build_report(kernel.name, kernel.instructions, tl.segments, tl.total_ticks, self.config, core,
                            kernel.sbuf_peak_bytes, kernel.psum_peak_bytes, figures)

    def _check_kernel(self, kernel: Kernel, core: int) -> None:
        if not isinstance(kernel, Kernel):
            raise TypeError(f"Chip.run expects a trnsim.Kernel, got {type(kernel).__name__}")
        if kernel.config.core != self.config.core:
            raise KernelError(
                f"kernel '{kernel.name}' was built for {kernel.config.name} cores but this chip is "
                f"{self.config.name}; build it with Kernel(..., config=chip.config)"
            )
        if isinstance(core, bool) or not isinstance(core, int) or not 0 <= core < self.config.chip.cores:
            raise KernelError(f"core {core!r} out of range: {self.config.name} has cores 0..{self.config.chip.cores - 1}")
        check_capacity(self.config, kernel.hbm_bytes, f"kernel '{kernel.name}'")

    def _execute(self, kernel: Kernel, inputs: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        if inputs is None:
            inputs = {}
        if not isinstance(inputs, Mapping):
            raise KernelError(f"inputs must map input names to arrays (e.g. {{'x': array}}), got {type(inputs).__name__}")
        ins_tensors = {n: t for n, t in kernel.tensors.items() if t.kind in ("input", "inout")}
        unknown = sorted(set(inputs) - set(ins_tensors))
        if unknown:
            raise KernelError(f"unknown input '{unknown[0]}' for kernel '{kernel.name}'; its inputs are "
                              f"{', '.join(ins_tensors) or '(none)'}")
        missing = [n for n in ins_tensors if n not in inputs]
        if missing:
            raise KernelError(f"missing input '{missing[0]}' for kernel '{kernel.name}' "
                              f"(shape {ins_tensors[missing[0]].shape}, {ins_tensors[missing[0]].dtype.short})")
        check_host_memory(kernel)
        try:
            mem = DeviceMemory(self.config, kernel.sbuf_high_water, kernel.psum_high_water)
            return self._run_values(kernel, inputs, mem)
        except MemoryError:
            raise KernelError(f"kernel '{kernel.name}': the host ran out of memory computing its values; run it "
                              f"timing-only (timing_only=True, or without --check)") from None

    def _run_values(self, kernel: Kernel, inputs: Mapping[str, Any], mem: DeviceMemory) -> dict[str, np.ndarray]:
        for name, t in kernel.tensors.items():
            if t.kind in ("input", "inout"):
                arr = np.asarray(inputs[name])
                if arr.dtype.kind not in "biuf" and arr.dtype != t.dtype.np_dtype:
                    raise KernelError(f"input '{name}' has dtype {arr.dtype}; expected numbers "
                                      f"(it is rounded to the tensor's {t.dtype.short})")
                if arr.shape != t.shape:
                    raise KernelError(f"input '{name}' has shape {arr.shape}, kernel '{kernel.name}' expects {t.shape}")
                if arr.dtype == t.dtype.np_dtype:
                    src = arr
                elif t.dtype.is_float and arr.dtype == np.float32:
                    src = convert(arr, t.dtype.name)
                elif t.dtype.is_float:
                    src = arr.astype(t.dtype.np_dtype)  # one rounding, straight from the source type
                else:
                    src = to_dtype(arr, t.dtype)  # round to nearest even, saturate
                mem.bind(t, src)
            else:
                mem.bind(t, None)
        engines = {name: cls(self.config) for name, cls in ENGINE_TYPES.items()}
        for ins in kernel.instructions:
            engines[ins.engine].execute(ins, mem)
        return {n: mem.hbm[t.uid].reshape(t.shape).copy() for n, t in kernel.tensors.items()
                if t.kind in ("output", "inout")}
