"""FSDP2 on a device without storage resize."""

from __future__ import annotations

import torch

from .. import _torch

# ---------------------------------------------------------------------------------------------
# FSDP2 on a device without storage resize
# ---------------------------------------------------------------------------------------------


def _resize_works() -> bool:
    t = torch.empty(1, device="neuron")
    try:
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4)
        return True
    except (NotImplementedError, RuntimeError):
        return False


def patch_fsdp() -> None:
    """FSDP2 frees and re-allocates unsharded parameters by resizing their storage, which a
    Python PrivateUse1 device cannot do in torch 2.13: for neuron tensors the storage keeps its
    memory instead (the values are the same; the unsharded parameters stay counted in the
    device's memory). Nothing changes where the device can resize. FSDP is patched when it is
    imported (importing it takes seconds: a program without FSDP does not pay for it)."""
    if _resize_works():
        return
    from ..imports import after_import

    after_import(_torch.FSDP_PARAM_GROUP_MODULE, lambda _module: _patch_fsdp_now())


def _patch_fsdp_now() -> None:
    alloc, free = _torch.fsdp_storage()
    if getattr(alloc, "_neuron", False):
        return

    def alloc_storage(tensor: torch.Tensor) -> None:
        if tensor.device.type != "neuron":
            alloc(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.device.type != "neuron":
            free(tensor)

    alloc_storage._neuron = True  # type: ignore[attr-defined]
    _torch.patch_fsdp_storage(alloc_storage, free_storage)
