"""The bound each transformer kernel is measured against (HBM traffic or PE time at the chip's
rates, whichever is larger) and :func:`measure`, a kernel's simulated time against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


from ...config import ChipConfig


# ---------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """The least time a kernel can take on one logical core: its compulsory HBM bytes over the
    HBM bandwidth its physical cores reach, or its matmul FLOPs over TensorE's peak (bf16 rate;
    fp8 double-row twice that), whichever is longer."""

    hbm_bytes: int
    flops: int
    fp8_flops: int = 0

    def seconds(self, config: ChipConfig, cores: int) -> tuple[float, float]:
        """(HBM time, TensorE time) on ``cores`` physical cores sharing their HBM stack."""
        from ...memory.hbm import stack_bandwidth

        per_core = min(config.core.dma.engines * config.core.dma.engine_bandwidth,
                       float(stack_bandwidth(config)) / min(cores, _cores_per_stack(config)))
        t = config.core.tensor
        peak = 2.0 * t.pe_rows * t.pe_cols * t.clock * cores
        fp8_peak = peak * (2 if t.fp8_double_row else 1)
        return self.hbm_bytes / (per_core * cores), self.flops / peak + self.fp8_flops / fp8_peak

    def time(self, config: ChipConfig, cores: int) -> float:
        return max(self.seconds(config, cores))


def _cores_per_stack(config: ChipConfig) -> int:
    return max(1, config.chip.cores // config.chip.hbm.stacks)


def bound_fraction(bound: Bound, seconds: float, config: ChipConfig, cores: int) -> float:
    """The bound's time over the simulated time (1.0: at the bound)."""
    return bound.time(config, cores) / seconds if seconds else 0.0


#: kernel name -> its bound function ``(shape, dtype, params) -> Bound`` (each module adds its own)
BOUNDS: dict[str, Callable[[tuple[int, ...], str, Mapping[str, Any]], Bound]] = {}


@dataclass(frozen=True)
class Measured:
    """One logical core's simulated time for a kernel call, and how close it is to its bound."""

    kernel: str
    shape: tuple[int, ...]
    config: str
    cores: int
    seconds: float
    hbm_seconds: float   # the bound's HBM part
    pe_seconds: float    # the bound's TensorE part

    @property
    def bound_seconds(self) -> float:
        return max(self.hbm_seconds, self.pe_seconds)

    @property
    def fraction(self) -> float:
        return self.bound_seconds / self.seconds if self.seconds else 0.0

    @property
    def bound_by(self) -> str:
        return "HBM" if self.hbm_seconds >= self.pe_seconds else "TensorE"


def measure(kernel: str, shape: tuple[int, ...], params: Mapping[str, Any] | None = None, dtype: str = "bf16",
            config: ChipConfig | str = "trn2", lnc: int | None = None) -> Measured:
    """Simulate ``kernel`` (timing only) on one logical core - its LNC split rule's parts on the
    physical cores at once, sharing their HBM stack - and set the time beside its bound."""
    from ...sim.chip import Chip
    from ...config import load_config
    from ..registry import build_spec, get_kernel, split_parts

    cfg = load_config(config)
    n = cfg.chip.lnc if lnc is None else lnc
    merged = {**get_kernel(kernel).params, **(params or {})}
    parts = split_parts(kernel, tuple(shape), merged, n)
    kernels = [build_spec(kernel, s, dtype, cfg, {**merged, **own}) for s, own in parts]
    results = Chip(cfg).run_spmd(kernels, timing_only=True)
    seconds = max(r.report.total_ns for r in results) * 1e-9
    hbm, pe = BOUNDS[kernel](tuple(shape), dtype, merged).seconds(cfg, len(kernels))
    return Measured(kernel, tuple(shape), cfg.name, len(kernels), seconds, hbm, pe)
