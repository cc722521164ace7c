"""Allocation, copies and resizing on the `neuron` device.

New tensors get host memory counted against the virtual HBM (:mod:`torch_bridge.memory`). Copies
between host and device, and within the device, are real copies of the bytes, charged as DMA
kernels; a copy to the host makes the host wait for the device first (it needs the bytes), as
``.cpu()`` or ``.item()`` on an accelerator does.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch
from . import fastpath, lowering, memory
from ..runtime import runtime

__all__ = ["empty_memory_format", "empty_strided", "copy_from", "copy_from_and_resize", "resize_", "to_copy",
           "has_compatible_shallow_copy_type", "device_index"]

NEURON = "neuron"
_CPU_KEYS = _torch.CPU_KEYS


def _current_device() -> int:
    from ..neuron.module import current_device

    return current_device()


def device_index(device: Any) -> int:
    """The neuron core index ``device`` names (None or no index: the current device), checked."""
    if device is None:
        return _current_device()
    d = torch.device(device)
    idx = d.index if d.index is not None else _current_device()
    count = runtime().device_count
    if not 0 <= idx < count:
        raise RuntimeError(f"neuron:{idx} does not exist: the {runtime().config.name} config has {count} "
                           f"logical NeuronCores (neuron:0..neuron:{count - 1})")
    return idx


def empty_memory_format(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                         pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    if memory_format is torch.preserve_format:  # CPU's refusal (an allocation has nothing to preserve)
        raise RuntimeError("unsupported memory format Preserve")
    stride = None
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        stride = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format).stride()
    return memory.allocate(size, stride, dtype, device_index(device))


def empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:
    return memory.allocate(size, stride, dtype or torch.get_default_dtype(), device_index(device))


def copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    src_dev = self.device.type == NEURON
    dst_dev = dst.device.type == NEURON
    index = (self.device.index or 0) if src_dev else (dst.device.index or 0)
    dst_view = memory.cpu_view(dst) if dst_dev else dst
    src_view = memory.cpu_view(self) if src_dev else self
    dst_view.copy_(src_view)
    kind = "copy_d2d" if src_dev and dst_dev else "copy_h2d" if dst_dev else "copy_d2h"
    rt = runtime()
    if not _torch.tracing():  # a copy torch.compile makes while it traces is not the program's: nothing
        cost = rt.cost(lowering.copy_spec(kind, self, dst))  # charged, nothing taught (runtime.charge's rule)
        if dst_dev:  # within the device or from the host: the native fast path serves the signature from now on
            fastpath.teach("aten::_copy_from", "_copy_from", cost)
        rt.charge(index, "_copy_from", cost)
    if src_dev and not dst_dev and not (non_blocking and dst.is_pinned()):
        # device -> host: the host waits for the copy (and the work before it); into pinned
        # memory with non_blocking it does not (as on CUDA: synchronize before reading it)
        rt.device.synchronize(index)
    return dst


def copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    dst.resize_(self.shape)
    return copy_from(self, dst)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def resize_(self: torch.Tensor, size: Any, memory_format: Any = None) -> torch.Tensor:
    size = tuple(size)
    if memory_format is torch.preserve_format:  # CPU's refusal
        raise RuntimeError("Unsupported memory formatPreserve")
    if memory_format is None and size == tuple(self.shape):
        # CPU's resize to the sizes a tensor has is nothing: a strided view keeps its strides (they
        # were made contiguous here, so the view read other elements; found by difftest's long run)
        return self
    if memory_format not in (None, torch.contiguous_format):
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    else:
        stride = _contiguous_strides(size)
    numel = 1
    for s in size:
        numel *= s
    need = (self.storage_offset() + numel) * self.element_size() if numel else 0
    storage = self.untyped_storage()
    if need > storage.nbytes():
        # in place, as CPU grows its storage: every view of it sees the new memory (a new storage
        # here left the tensor's other views on the old one); the bytes it held are kept
        storage.resize_(int(need))
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, self, storage, self.storage_offset(), size, stride)
    return self


def has_compatible_shallow_copy_type(self: torch.Tensor, from_: torch.Tensor) -> bool:
    """Dense CPU and neuron tensors may take each other's place in ``.data =`` (as CPU and CUDA
    ones do). c10's default list of dense backends lacks PrivateUse1 and asks a PrivateUse1
    backend to say so here; without it ``Module.to("neuron")`` builds new Parameter objects and
    unties tied weights (an LM head sharing its embedding)."""
    return (self.layout == torch.strided and from_.layout == torch.strided
            and {self.device.type, from_.device.type} <= {"cpu", NEURON})


def to_copy(self: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> torch.Tensor:
    """``Tensor.to`` to or from neuron. A ``non_blocking`` copy to the host lands in pinned
    memory (as CUDA's does) and does not make the host wait for the device."""
    target = torch.device(device) if device is not None else self.device
    pin = bool(pin_memory) or (non_blocking and self.device.type == NEURON and target.type == "cpu")
    out = torch.empty_like(self, dtype=dtype or self.dtype, device=target,
                           memory_format=memory_format or torch.preserve_format, pin_memory=pin)
    out.copy_(self, non_blocking=non_blocking)
    return out
