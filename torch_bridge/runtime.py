"""The process-wide state of the `neuron` device: the chip config, per-core clocks, the kernel
cache and the report collectors. Created on first use; the config cannot change afterwards."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from trnsim import ChipConfig, KernelReport, load_config

from . import memory
from .lowering import Lowered, Lowering
from .timeline import Collector, CoreClock, launch_ticks

__all__ = ["Runtime", "runtime", "set_config", "is_initialized"]


class Runtime:
    """Everything the device needs once a config is chosen."""

    def __init__(self, config: ChipConfig):
        self.config = config
        self.lowering = Lowering(config)
        self.clocks = [CoreClock(i) for i in range(config.logical_cores)]
        self.launch = launch_ticks(config)
        self.collectors: list[Collector] = [Collector()]  # [0]: since start (or the last reset)
        memory.pool.configure(config.logical_cores, config.chip.hbm.capacity // config.logical_cores)

    @property
    def device_count(self) -> int:
        return len(self.clocks)

    def charge(self, device: int, op: str, lowered: Lowered) -> None:
        """Put one launch of ``lowered`` on the current stream of ``device``."""
        clock = self.clocks[device]
        rep: KernelReport | None = lowered.report
        ticks = self.launch + (rep.total_ticks if rep is not None else 0)
        stream = clock.current_stream
        start, end = clock.launch(stream, ticks)
        for c in self.collectors:
            c.add(device, stream, op, lowered.kernel, lowered.generic, rep, start, end)


_runtime: Runtime | None = None
_requested: tuple[Any, Any] | None = None


def is_initialized() -> bool:
    return _runtime is not None


def runtime() -> Runtime:
    """The device state, created from ``set_config``'s choice or ``TRNSIM_CONFIG`` (default trn2)."""
    global _runtime
    if _runtime is None:
        name, overrides = _requested or (os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2", None)
        _runtime = Runtime(load_config(name, overrides))
    return _runtime


def set_config(name_or_path: str | os.PathLike[str] | ChipConfig,
               overrides: Iterable[str] | Mapping[str, Any] | None = None) -> ChipConfig:
    """Choose the chip (config name, YAML path or ChipConfig, with dotted overrides) before first use."""
    global _requested
    if _runtime is not None:
        raise RuntimeError(f"torch.neuron.set_config: the neuron device is already in use with config "
                           f"'{_runtime.config.name}'; call set_config before the first neuron tensor or device query")
    cfg = load_config(name_or_path, overrides)  # check it now, so a bad name fails here
    _requested = (cfg, None)
    return cfg
