"""Built-in kernels written with the public builder API, and the registry the CLI runs them from.

Importing this package registers every built-in kernel (each module registers its own).
"""

from . import (attention, bmm_packed, conv, depthwise, elementwise, embedding, foreach, fused, matmul,  # noqa: F401
               matmul_mx, moe, moe_backward, mx_quantize, norm, reduce, transformer, transpose)
from .registry import KERNELS, KernelEntry, build_spec, get_kernel, kernel_names, register_kernel, split_spec

__all__ = ["KERNELS", "KernelEntry", "build_spec", "get_kernel", "kernel_names", "register_kernel", "split_spec"]
