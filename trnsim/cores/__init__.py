"""One module per engine, each registering itself (see :mod:`trnsim.cores.base`).

Every module of this package is imported here, in name order, so a new engine is a new module:
nothing lists it. (Registration order numbers the engines for the simulation; alphabetical
imports give GpSimd, Vector - which scalar imports -, Scalar, Sync, Tensor, as before.)
"""

import importlib
import pkgutil

from .base import ENGINE_TYPES, Engine, register_engine

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")

__all__ = ["ENGINE_TYPES", "Engine", "register_engine"]
