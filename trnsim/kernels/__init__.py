"""Built-in kernels written with the public builder API, and the registry the CLI runs them from."""

from .registry import KERNELS, KernelEntry, get_kernel, kernel_names, register_kernel

__all__ = ["KERNELS", "KernelEntry", "get_kernel", "kernel_names", "register_kernel"]
