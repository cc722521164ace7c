"""The NKI library's transformer kernels as trnsim library kernels (contract: see below)."""

from . import mlp, qkv  # noqa: F401
