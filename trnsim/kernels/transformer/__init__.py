"""The NKI library's transformer kernels as trnsim library kernels (contract: see below)."""

from . import attention_cte, attention_tkg, mlp, moe_tkg, oproj, qkv, rope, router  # noqa: F401
