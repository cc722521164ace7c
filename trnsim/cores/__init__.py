"""One module per engine, each registering itself (see :mod:`trnsim.cores.base`)."""

from . import gpsimd, scalar, sync, tensor, vector  # noqa: F401
from .base import ENGINE_TYPES, Engine, register_engine

__all__ = ["ENGINE_TYPES", "Engine", "register_engine"]
