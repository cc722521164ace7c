"""The NKI library's transformer kernels as trnsim library kernels (contract: see below)."""

from . import attention_cte, attention_tkg, mlp, oproj, qkv, rope, router  # noqa: F401
