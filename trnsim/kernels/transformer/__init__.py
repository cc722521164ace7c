"""The NKI library's transformer kernels as trnsim library kernels (contract: see below)."""

from . import attention_tkg, mlp, oproj, qkv  # noqa: F401
