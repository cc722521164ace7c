"""Old module names of trnsim and torch_bridge, kept working after the layout moved them into
folders by layer (issue 23): ONE table, old dotted name -> new dotted name.

``import trnsim.kernel`` (or ``from trnsim.kernel import Kernel``, ``mock.patch("trnsim.sim.x")``,
a pickle naming ``trnsim.report.KernelReport``, a ``python -c`` line in a user's script) gets the
module object itself, the same one ``trnsim.builder.kernel`` names: an attribute set through either
name is seen through both, so monkeypatching keeps working. Nothing is copied and no file stays at
the old path (git follows each move as a rename).

The finder is installed by ``import trnsim`` (and so by ``import torch_bridge``, which imports
trnsim first). New code uses the new names; this table only grows when a module moves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["ALIASES", "RENAMED", "install", "resolve", "renamed"]

ALIASES: dict[str, str] = {
    # the model: config, isa, builder, memory, sim
    "trnsim.ledger": "trnsim.config.ledger",
    "trnsim.extras": "trnsim.config.extras",
    "trnsim.kernel": "trnsim.builder.kernel",
    "trnsim.bandwidth": "trnsim.memory.bandwidth",
    "trnsim.chip": "trnsim.sim.chip",
    "trnsim.report": "trnsim.sim.report",
    "trnsim.schedule": "trnsim.sim.list_schedule",
    # the simulator's C accelerators, apart from the numerics (trnsim.native.accel)
    "trnsim.native._sched": "trnsim.native.accel._sched",
    "trnsim.native._scan": "trnsim.native.accel._scan",
    "trnsim.native._deptrack": "trnsim.native.accel._deptrack",
    "trnsim.native._clone": "trnsim.native.accel._clone",
    # the device model
    "trnsim.costcache": "trnsim.device.costcache",
    "trnsim.ranks": "trnsim.device.ranks",
    # outputs
    "trnsim.trace": "trnsim.outputs.trace",
    "trnsim.run_trace": "trnsim.outputs.run_trace",
    "trnsim.metrics": "trnsim.sim.metrics",
    "trnsim.plot": "trnsim.outputs.plot",
    "trnsim.files": "trnsim.config.files",
    # the file writer and the metrics tables, moved below the simulator that writes with them
    # (a report's to_parquet imported upward from sim/ into outputs/)
    "trnsim.outputs.files": "trnsim.config.files",
    "trnsim.outputs.metrics": "trnsim.sim.metrics",
    # what estimates run (data, below torch_bridge)
    "trnsim.models": "trnsim.workload.models",
    "trnsim.estimate": "trnsim.workload.plan",
    "trnsim.buckets": "trnsim.workload.buckets",
    "trnsim.serve": "trnsim.workload.serve",
    "trnsim.training": "trnsim.workload.training",
    # the apps
    "trnsim.cli_base": "trnsim.cli.base",
    "trnsim.cli_estimate": "trnsim.cli.estimate",
    "trnsim.cli_serve": "trnsim.cli.serve",
    "trnsim.sweep_ray": "trnsim.sweep.on_ray",
    # collectives: the runner of collectives on the network (was "engine", a word the cores own)
    "trnsim.collectives.engine": "trnsim.collectives.runner",
    "trnsim.estimate_points": "trnsim.sweep.estimates",
    # the CLI's subcommands live in cli/ (validate/ is the ledger run, below the CLI)
    "trnsim.validate.cli": "trnsim.cli.validate",
    # torch_bridge: eager mechanisms, whole-op kernels, torch.neuron, distributed, timing-only
    "torch_bridge.values": "torch_bridge.eager.values",
    "torch_bridge.alloc": "torch_bridge.eager.alloc",
    "torch_bridge.memory": "torch_bridge.eager.memory",
    "torch_bridge.lowering": "torch_bridge.eager.lowering",
    "torch_bridge.tensore": "torch_bridge.eager.tensore",
    "torch_bridge.fastpath": "torch_bridge.eager.fastpath",
    "torch_bridge.autocast": "torch_bridge.eager.autocast",
    "torch_bridge.attention": "torch_bridge.ops.attention",
    "torch_bridge.moe": "torch_bridge.ops.moe",
    "torch_bridge.cells": "torch_bridge.ops.cells",
    "torch_bridge.nki": "torch_bridge.ops.nki",
    "torch_bridge.mx": "torch_bridge.ops.mx",
    "torch_bridge.device": "torch_bridge.neuron.module",
    "torch_bridge.profiler": "torch_bridge.neuron.profiler",
    "torch_bridge.generators": "torch_bridge.neuron.generators",
    "torch_bridge.hostprof": "torch_bridge.neuron.hostprof",
    "torch_bridge.distributed": "torch_bridge.dist.process_group",
    "torch_bridge.launch": "torch_bridge.dist.launch",
    "torch_bridge.timing_only": "torch_bridge.timing.fake",
    "torch_bridge.parallel": "torch_bridge.timing.parallel",
    "torch_bridge.estimate": "torch_bridge.timing.estimate",
    "torch_bridge.models": "torch_bridge.timing.models",
    "torch_bridge.estimate_kernels": "torch_bridge.timing.estimate_kernels",
    "torch_bridge.nxdi": "torch_bridge.timing.nxdi",
    "torch_bridge.serve_costs": "torch_bridge.timing.serve_costs",
    "torch_bridge.train_step": "torch_bridge.timing.train_step",
    "torch_bridge.fuse_regions": "torch_bridge.timing.fuse_regions",
}


#: Names renamed so that one name means one thing (issue 23), old dotted name -> new dotted name.
#: The module that held the old name answers for it (its module ``__getattr__`` calls
#: :func:`renamed`), so ``from trnsim.nki import Kernel`` keeps working; new code uses the new name.
RENAMED: dict[str, str] = {
    # a jitted NKI function, not the instruction-stream builder trnsim.Kernel
    "trnsim.nki.Kernel": "trnsim.nki.JitKernel",
    # runs collectives on the network; not an engine of a NeuronCore
    "trnsim.collectives.CollectiveEngine": "trnsim.collectives.CollectiveRunner",
    "trnsim.collectives.runner.CollectiveEngine": "trnsim.collectives.runner.CollectiveRunner",
    # which timeline simulate() runs (the C loop or the simpy processes); not an engine either
    "trnsim.sim.SIM_ENGINES": "trnsim.sim.TIMELINES",
}


def renamed(module: str, name: str) -> object:
    """The object an old name of ``module`` now has (:data:`RENAMED`); AttributeError when
    ``name`` is not an old name there (a module's ``__getattr__`` returns this)."""
    new = RENAMED.get(f"{module}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, _, attr = new.rpartition(".")
    return getattr(importlib.import_module(home), attr)


def resolve(name: str) -> str:
    """The current dotted name of module ``name`` (itself when it did not move)."""
    return ALIASES.get(name, name)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # the module itself, under its new name; the import system then files it under the old
        # name too (sys.modules and the parent package's attribute)
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already executed under its new name; the import system has just set __spec__ to the
        # alias's spec: give the module its own back (reload, pickle and -m read it)
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = ALIASES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


_FINDER = _AliasFinder()


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
