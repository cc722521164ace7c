"""trnsim: a cycle-approximate virtual AWS Trainium.

The public face is small::

    import trnsim
    chip = trnsim.Chip("trn2")
    k = chip.kernel("my_kernel")      # an NKI-like builder (trnsim.Kernel)
    ...
    result = chip.run(k, {"a": a})    # values and a KernelReport

Everything else is internal and may change.
"""

from .chip import Chip, RunResult
from .config import ChipConfig, ConfigError, load_config
from .isa import KernelError
from .kernel import Kernel, TilePool
from .native.dtypes import bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float16, float32, int32
from .report import KernelReport

__all__ = [
    "Chip",
    "ChipConfig",
    "ConfigError",
    "Kernel",
    "KernelError",
    "KernelReport",
    "RunResult",
    "TilePool",
    "load_config",
    "bfloat16",
    "float16",
    "float32",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e5m2",
    "int32",
]

__version__ = "0.1.0"
