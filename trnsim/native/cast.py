"""The casting rule every engine, DMA and the chip's input binding share.

Floats round to nearest even (through fp32, as the engines do); integers round to nearest even
and saturate at the type's range (NaN becomes 0). It lives beside the datapath's conversions so
memory and chip code need not reach up into an engine module for it.
"""

from __future__ import annotations

import numpy as np

from . import convert
from .dtypes import Dtype

__all__ = ["to_dtype"]


def to_dtype(values: np.ndarray, dt: Dtype) -> np.ndarray:
    """``values`` converted to ``dt`` by the rule above (unchanged if already ``dt``)."""
    if values.dtype == dt.np_dtype:
        return values
    if dt.is_float:
        if values.dtype.kind in "iub":
            values = values.astype(np.float32)
        return convert(values.astype(np.float32, copy=False), dt.name)
    info = np.iinfo(dt.np_dtype)
    if values.dtype.kind in "iub":
        return np.clip(values.astype(np.int64), info.min, info.max).astype(dt.np_dtype)
    v = np.rint(values.astype(np.float64))
    v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
    return np.clip(v, info.min, info.max).astype(dt.np_dtype)
