"""The NKI library's transformer kernels as trnsim library kernels (contract: see below)."""

from . import qkv  # noqa: F401
