"""``torch.autocast("neuron", dtype)``: lower-precision TensorE ops, as on other accelerators."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _torch

__all__ = ["AUTOCAST_OPS", "register_autocast"]

NEURON = "neuron"
AUTOCAST_OPS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "conv1d", "conv2d", "conv3d",
                "addbmm", "_convolution", "prelu", "scaled_dot_product_attention")


def _autocast_kernel(op: Any) -> Callable[..., Any]:
    """Cast floating neuron operands to the autocast dtype, then run the op with autocast
    excluded (autograd records the casts)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dt = torch.get_autocast_dtype(NEURON)

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == NEURON and x.dtype != dt:
                return x.to(dt)
            if isinstance(x, (list, tuple)):
                return type(x)(cast(y) for y in x)
            return x
        with _torch.ExcludeDispatchKeyGuard(_torch.AUTOCAST_KEYS):
            return op(*cast(list(args)), **{k: cast(v) for k, v in kwargs.items()})
    return kernel


def register_autocast(impl: torch.library.Library, fallback: torch.library.Library,
                      hide: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Autocast kernels for :data:`AUTOCAST_OPS` (every overload); other ops fall through."""
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for name in AUTOCAST_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            impl.impl(f"{name}.{overload}" if overload != "default" else name, hide(_autocast_kernel(op)),
                      "AutocastPrivateUse1")
