"""Numerics the library kernels' references share: input rounding and default tolerances.

A kernel's numpy reference is computed from the inputs *as the kernel saw them* (rounded to its
input dtype with round-to-nearest-even); outputs must match within a tolerance relative to the
largest reference magnitude.
"""

from __future__ import annotations

import numpy as np

from ..native import convert
from ..native.dtypes import get_dtype

__all__ = ["round_to", "default_tolerance"]

_DEFAULT_TOL = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}


def default_tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) for outputs of ``dtype``."""
    name = get_dtype(dtype).name
    return _DEFAULT_TOL.get(name, (1.5e-1, 1.5e-1))  # fp8 and friends


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (RNE) and widened back to float64: what a kernel's input holds."""
    dt = get_dtype(dtype)
    if not dt.is_float:
        return np.asarray(x).astype(dt.np_dtype).astype(np.float64)
    return np.asarray(convert(np.asarray(x, dtype=np.float32), dt.name)).astype(np.float64)
