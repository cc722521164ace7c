"""trnsim: a cycle-approximate virtual AWS Trainium.

The public face is small::

    import trnsim
    chip = trnsim.Chip("trn2")
    k = chip.kernel("my_kernel")      # an NKI-like builder (trnsim.Kernel)
    ...
    result = chip.run(k, {"a": a})    # values and a KernelReport

Everything else is internal and may change.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sim.chip import Chip, RunResult
    from .config import ChipConfig, ConfigError, load_config
    from .isa import KernelError
    from .builder.kernel import Kernel, TilePool
    from .native.dtypes import bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float16, float32, int32
    from .sim.report import KernelReport

# The public names load with the module that defines them, on first use (PEP 562): importing a
# submodule (the ``trnsim`` command's trnsim.cli) does not load the simulator and its numerics
# first, so the command starts quickly and takes Ctrl-C as one line from its first instant.
_HOME = {"Chip": "sim.chip", "RunResult": "sim.chip", "ChipConfig": "config", "ConfigError": "config",
         "load_config": "config", "KernelError": "isa", "Kernel": "builder.kernel", "TilePool": "builder.kernel",
         "KernelReport": "sim.report", **{n: "native.dtypes" for n in ("bfloat16", "float8_e4m3", "float8_e4m3fn",
                                                                   "float8_e5m2", "float16", "float32", "int32")}}


def __getattr__(name: str) -> Any:
    import importlib

    home = _HOME.get(name)
    if home is None:
        if f"trnsim.{name}" in ALIASES:  # an old module name (trnsim.kernel): the moved module
            return importlib.import_module(f"trnsim.{name}")
        raise AttributeError(f"module 'trnsim' has no attribute '{name}'")

    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = list(_HOME)

# old module names (trnsim.kernel, torch_bridge.values, ...) of modules the layout moved into folders
from .compat import ALIASES  # noqa: E402
from .compat import install as _install_aliases  # noqa: E402

_install_aliases()

__version__ = "0.1.0"
