"""Registration of the ``neuron`` device with PyTorch (what the ``torch.backends`` entry point runs).

This module is the entry point's target rather than the package itself: when a program imports
``torch_bridge`` first, ``import torch`` inside it runs the entry point while the package is still
initialising, and only a submodule can be loaded at that moment.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _native, _torch
from .eager import memory
from .neuron import module as _device_module

__all__ = ["register", "autoload"]

_registered = False


def _storage_to(original: Any) -> Any:
    """``torch.load``/``storage.to('neuron')`` allocate with ``UntypedStorage(n, device=...)``,
    which has no allocator behind it for PrivateUse1 (it segfaults): allocate through a tensor."""
    def _to(self: Any, device: Any, non_blocking: bool = False) -> Any:
        device = torch.device(device)
        if device.type != "neuron" or self.device == device:
            return original(self, device, non_blocking)
        storage = torch.empty(self.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
        storage.copy_(self, non_blocking)
        return storage
    return _to


def _accelerator_synchronize(original: Any) -> Any:
    """``torch.accelerator.synchronize`` asks the C++ device guard, which cannot synchronize a
    Python backend: route neuron to :func:`torch.neuron.synchronize`."""
    def synchronize(device: Any = None) -> None:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type == "neuron":
            idx = None if device is None else (device if isinstance(device, int) else torch.device(device).index)
            _device_module.synchronize(idx)
            return
        original(device)
    return synchronize


def _provisional_device_count() -> int:
    """The logical NeuronCores of the config the device will start with, read before the runtime
    exists: autograd sizes its per-device queues the first time any backward runs, CPU-only
    ones included, and reads the count once."""
    import os

    from trnsim import load_config

    try:
        return load_config(os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2").logical_cores
    except Exception:  # a bad TRNSIM_CONFIG: reported by the first neuron call, which loads it again
        return 1


def register() -> None:
    """Register the ``neuron`` device with PyTorch (idempotent). Raises
    :class:`~torch_bridge._native.NativeBuildError` (one line) when the native extension cannot be
    built, before anything is registered: CPU-only torch is then left as it was."""
    global _registered
    if _registered:
        return
    from .registration import register_kernels

    lib = _native.load()  # first: nothing is registered if it fails
    if lib.trnsim_register_hooks() != 0:
        raise _native.NativeBuildError("trnsim: another PrivateUse1 backend registered its hooks first; only one "
                                       "PrivateUse1 device can be used per process")
    torch.utils.rename_privateuse1_backend("neuron")
    _torch.register_device_module("neuron", _device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True,
                                                         for_packed_sequence=True)
    lib.trnsim_set_device_count(_provisional_device_count())
    memory.install_resize_allocator(lib)
    register_kernels()
    _torch.patch_storage_to(_storage_to)
    torch.accelerator.synchronize = _accelerator_synchronize(torch.accelerator.synchronize)
    from .neuron import profiler
    from .compile.backend import divert_inductor

    _torch.hook_profiler(profiler.on_profiler_start, profiler.on_profiler_stop)
    divert_inductor()  # torch.compile's default (Inductor) on neuron tensors runs the neuron backend
    _register_distributed()
    _use_moe_kernel_on_import()
    from .eager import settle

    settle.register()  # autograd's device threads finish what they hold before the interpreter finalizes
    _registered = True


def _create_process_group(opts: Any, backend_options: Any) -> Any:
    from .dist.process_group import create_process_group  # the backend itself loads on first use

    return create_process_group(opts, backend_options)


def _register_distributed() -> None:
    """Put the ``neuron`` process-group backend in torch's device-to-backend table, so
    ``init_process_group()`` and ``init_device_mesh("neuron", ...)`` choose it
    (:mod:`torch_bridge.distributed`)."""
    import torch.distributed as dist

    if dist.is_available() and "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", _create_process_group, extended_api=True, devices=["neuron"])


MIXTRAL_MODULE = "transformers.models.mixtral.modeling_mixtral"


def _use_moe_kernel(module: Any) -> None:
    """Transformers' Mixtral MoE block runs as one MoE op on neuron tensors (torch_bridge.moe,
    which defines the ops: loaded with the Mixtral model, not with torch)."""
    from .ops.moe import use_moe_kernel

    use_moe_kernel(module)


def _use_moe_kernel_on_import() -> None:
    from .imports import after_import

    after_import(MIXTRAL_MODULE, _use_moe_kernel)


_reported: list[str] = []


def register_or_report() -> bool:
    """:func:`register`, or, if the native extension cannot be built, its one-line message on
    stderr (once per process) and False: CPU-only torch is then left exactly as it was. This is
    what ``import torch`` (the entry point) and ``import torch_bridge`` run: neither may raise,
    since the entry point's failure would break ``import torch`` for every program."""
    try:
        register()
        return True
    except _native.NativeBuildError as e:
        _report(f"{e} (the neuron device is not registered; CPU-only torch is unaffected)")
        return False
    except Exception as e:  # a bug of ours: one line, and import torch still works
        _report(f"trnsim: registering the neuron device failed ({type(e).__name__}: {e}); the neuron device may "
                f"not work in this process, CPU-only torch is unaffected")
        return False


def _report(line: str) -> None:
    if not _reported:
        import sys

        _reported.append(line)
        print(line, file=sys.stderr)


def autoload() -> None:
    """The ``torch.backends`` entry point: runs inside ``import torch``."""
    register_or_report()
