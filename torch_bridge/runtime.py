"""The process-wide state of the `neuron` device: the chip config and its trnsim device model.

Created on first use; the config cannot change afterwards. :func:`charge` is how every value
path puts its op on the device's timeline: a :class:`~trnsim.device.KernelSpec` from
:mod:`torch_bridge.lowering` (or an :class:`~trnsim.device.OpCost` already looked up), costed by
the device model and launched on the current stream of the op's logical NeuronCore.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from trnsim import ChipConfig, load_config
from trnsim.device import Device, KernelSpec, OpCost, no_work
from trnsim.device.costcache import CachedDevice, CostCache, device_cache_dir

from . import _torch
from .eager import memory

__all__ = ["Runtime", "Replay", "runtime", "set_config", "is_initialized", "check_env"]


class Replay:
    """Launches recorded once, as (op, cost) pairs in order, and host ops counted by name: what
    :meth:`Runtime.replay` charges again each time the computation they stand for runs (a fused
    op's composite, MoE's router backward)."""

    __slots__ = ("items", "host", "handles")

    def __init__(self, items: Iterable[tuple[str, OpCost]], host: Mapping[str, int] | None = None):
        self.items = list(items)
        self.host = dict(host or {})
        self.handles: Any = None  # the native log's handles for the items (made on the first replay; False: none)


class Runtime:
    """Everything the device needs once a config is chosen."""

    def __init__(self, config: ChipConfig):
        self.config = config
        check_env()
        try:
            cache = device_cache_dir()  # $TRNSIM_COST_CACHE: kernel costs shared across runs through the disk
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        self.device = Device(config) if cache is None else CachedDevice(config, CostCache(cache), lazy_reports=True)
        self._no_work: dict[str, OpCost] = {}
        self._native_launch = _no_native_launch
        self._native_batch: tuple[Any, Any] | None = None  # fastpath's (batch, launch_batch)
        if os.environ.get("TRNSIM_ADAPTIVE_EAGER", "").strip() == "1":  # torch.neuron.set_adaptive_eager's switch
            self.device.set_adaptive(True)
        memory.pool.configure(config.logical_cores, config.chip.hbm.capacity // config.logical_cores)
        from . import _native

        if _native.lib is not None:  # the native guard and hooks report the config's core count
            _native.lib.trnsim_set_device_count(config.logical_cores)
            from .eager import fastpath

            fastpath.attach(self.device, config.core.tensor.max_contraction)  # the native fast path's launches
            self._native_launch = fastpath.launch_kept
            self._native_batch = (fastpath.batch, fastpath.launch_batch)

    @property
    def device_count(self) -> int:
        return self.device.core_count

    def cost(self, spec: KernelSpec | None, label: str = "launch only") -> OpCost:
        """The cost of one launch of ``spec`` (None: a launch with no device work); the same
        object for the same spec or label (the device caches its costs)."""
        if spec is not None:
            return self.device.cost(spec)
        cost = self._no_work.get(label)
        if cost is None:
            cost = self._no_work[label] = no_work(label)
        return cost

    def charge(self, index: int, op: str, spec: KernelSpec | OpCost | None, label: str = "launch only") -> None:
        """Launch ``spec`` for ``op`` on the current stream of logical core ``index`` (None: a
        launch with no device work, shown as ``label``). Logged natively where the fast path's
        own launches are (its log is issued in order, exactly as :meth:`Device.launch` issues:
        ~1 us against ~12 us through the device model's Python), else launched on the device."""
        if _torch.tracing():
            return  # torch.compile ran the kernel while it traced (a constant, or a fake tensor's shapes)
        cost = spec if isinstance(spec, OpCost) else self.cost(spec, label)
        if not self._native_launch(index, op, cost):
            self.device.launch(index, op, cost)

    def replay(self, index: int, r: Replay) -> None:
        """Charge ``r``'s launches to logical core ``index`` and count its host ops, exactly as
        :meth:`charge` and :meth:`host_ops` would one by one: through the native log in one call
        where it takes them all (the same entries in the same order, ~1 us a launch less)."""
        batch = self._native_batch
        if r.handles is None:
            r.handles = (batch[0](r.items) if batch is not None else None) or False
        if not (r.handles and batch[1](index, r.handles)):  # type: ignore[index]
            for op, cost in r.items:
                self.charge(index, op, cost)
        if r.host:
            self.host_ops(r.host)

    def host_op(self, op: str) -> None:
        """A metadata-only op: counted in the report, no launch."""
        self.host_ops({op: 1})

    def host_ops(self, counts: dict[str, int]) -> None:
        """:meth:`host_op` for ``counts[op]`` ops of each name, in one call to the device."""
        if _torch.tracing() or not counts:
            return
        self.device.host_ops(counts)


def check_env() -> None:
    """The device's TRNSIM_* switches, refused in one line (a ConfigError naming the variable and
    what it takes) when the device is first used; a value they do not take was read as the
    default without a word (TRNSIM_FASTPATH=false left the fast path on). Not at ``import torch``:
    a bad setting must not break a CPU program."""
    from trnsim.config.loader import env_int

    env_int("TRNSIM_FASTPATH", 1, 0, 1, "0 (every op through the Python path) or 1 (the native fast path)")
    env_int("TRNSIM_ADAPTIVE_EAGER", 0, 0, 1, "1 (adaptive eager on) or 0")
    env_int("TRNSIM_HOST_CACHE_MB", 2048, 0, 1 << 30, "the megabytes of freed host memory kept for reuse (0: none)")


def _no_native_launch(core: int, op: str, cost: OpCost) -> bool:
    return False


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
        from .imports import run_pending

        run_pending()  # a module that was still running when the bridge loaded (imports.after_import)
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
