"""Registration of the ``neuron`` device with PyTorch (what the ``torch.backends`` entry point runs).

This module is the entry point's target rather than the package itself: when a program imports
``torch_bridge`` first, ``import torch`` inside it runs the entry point while the package is still
initialising, and only a submodule can be loaded at that moment.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _torch
from . import device as _device_module

__all__ = ["register", "autoload"]

_registered = False


class _Hooks(_torch.PrivateUse1Hooks):  # type: ignore[misc]
    """What PyTorch asks a PrivateUse1 backend before the first ``.to('neuron')``."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(_torch.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return _torch.PRIVATEUSE1


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


def register() -> None:
    """Register the ``neuron`` device with PyTorch (idempotent)."""
    global _registered
    if _registered:
        return
    from .registration import register_kernels

    torch.utils.rename_privateuse1_backend("neuron")
    _torch.register_device_module("neuron", _device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True,
                                                         for_packed_sequence=True)
    _torch.register_hooks(_Hooks())
    _torch.register_device_guard(_Guard())
    register_kernels()
    _torch.patch_storage_to(_storage_to)
    torch.accelerator.synchronize = _accelerator_synchronize(torch.accelerator.synchronize)
    from . import profiler
    from .compile.backend import divert_inductor

    _torch.hook_profiler(profiler.on_profiler_start, profiler.on_profiler_stop)
    divert_inductor()  # torch.compile's default (Inductor) on neuron tensors runs the neuron backend
    _register_distributed()
    _use_moe_kernel_on_import()
    _registered = True


def _create_process_group(opts: Any, backend_options: Any) -> Any:
    from .distributed import create_process_group  # the backend itself loads on first use

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
    from .moe import use_moe_kernel

    use_moe_kernel(module)


def _use_moe_kernel_on_import() -> None:
    from .imports import after_import

    after_import(MIXTRAL_MODULE, _use_moe_kernel)


def autoload() -> None:
    """The ``torch.backends`` entry point: runs inside ``import torch``."""
    register()
