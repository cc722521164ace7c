"""The dtypes trnsim knows: one registry of names, aliases and numpy dtypes.

Every part of the simulator that takes a dtype from a user (a tile, a kernel argument, a config
value) resolves it here with :func:`get_dtype`, so ``"bf16"``, ``"bfloat16"``,
``ml_dtypes.bfloat16`` and ``np.dtype(ml_dtypes.bfloat16)`` all mean the same :class:`Dtype`.

The 8- and 16-bit float formats are ml_dtypes' (see DESIGN.md, "Numerics"):

- ``float8_e4m3``: IEEE-like e4m3, bias 7, has ±Inf (max finite 240);
- ``float8_e4m3fn``: OCP e4m3 "finite": no Inf, overflow gives NaN (max finite 448);
- ``float8_e5m2``: bias 15, has ±Inf (max finite 57344).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "Dtype",
    "get_dtype",
    "all_dtypes",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "uint32",
    "FLOAT_DTYPES",
    "PACKED_DTYPES",
    "float8_e5m2_x4",
    "float8_e4m3fn_x4",
    "float4_e2m1fn_x4",
]


@dataclass(frozen=True)
class Dtype:
    """One element type.

    Attributes:
        name: canonical name, equal to numpy's/ml_dtypes' name (``"bfloat16"``).
        np_dtype: the numpy dtype arrays of this type have.
        itemsize: bytes per element.
        is_float: True for the floating-point formats.
        short: the short name used in reports and error messages (``"bf16"``).
    """

    name: str
    np_dtype: np.dtype
    itemsize: int
    is_float: bool
    short: str

    def __str__(self) -> str:
        return self.name


def _make(np_type: type, short: str) -> Dtype:
    dt = np.dtype(np_type)
    return Dtype(
        name=dt.name,
        np_dtype=dt,
        itemsize=dt.itemsize,
        is_float=dt.kind == "f" or np_type in _ML_FLOATS,
        short=short,
    )


_ML_FLOATS = (
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
)

bfloat16 = _make(ml_dtypes.bfloat16, "bf16")
float16 = _make(np.float16, "fp16")
float32 = _make(np.float32, "fp32")
float8_e4m3 = _make(ml_dtypes.float8_e4m3, "fp8_e4m3")
float8_e4m3fn = _make(ml_dtypes.float8_e4m3fn, "fp8_e4m3fn")
float8_e5m2 = _make(ml_dtypes.float8_e5m2, "fp8_e5m2")
int8 = _make(np.int8, "int8")
uint8 = _make(np.uint8, "uint8")
int16 = _make(np.int16, "int16")
int32 = _make(np.int32, "int32")
uint32 = _make(np.uint32, "uint32")

# Order matters: it is the order error messages list the short names in.
_ALL: tuple[Dtype, ...] = (
    bfloat16,
    float16,
    float32,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    int8,
    uint8,
    int16,
    int32,
    uint32,
)

#: The formats the TensorE datapath reads and :func:`trnsim.native.convert` handles.
FLOAT_DTYPES: tuple[Dtype, ...] = tuple(d for d in _ALL if d.is_float)

_ALIASES: dict[str, tuple[str, ...]] = {
    "float32": ("fp32", "f32"),
    "float16": ("fp16", "f16", "half"),
    "bfloat16": ("bf16",),
    "float8_e4m3": ("fp8_e4m3", "f8e4m3", "e4m3"),
    "float8_e4m3fn": ("fp8_e4m3fn", "f8e4m3fn", "e4m3fn"),
    "float8_e5m2": ("fp8_e5m2", "f8e5m2", "e5m2"),
    "int8": ("i8", "s8"),
    "uint8": ("u8",),
    "int16": ("i16", "s16"),
    "int32": ("i32", "s32"),
    "uint32": ("u32",),
}

#: MX quad-packed types (NC-v4, datasheet §4.2): one element holds four fp8 (32 bits) or four
#: fp4 e2m1 (16 bits) values of consecutive K groups; arrays of them are raw uint32 / uint16.
#: Only nc_matmul_mx reads them; DMA moves them as bits.
float8_e5m2_x4 = Dtype("float8_e5m2_x4", np.dtype(np.uint32), 4, False, "mxfp8_e5m2")
float8_e4m3fn_x4 = Dtype("float8_e4m3fn_x4", np.dtype(np.uint32), 4, False, "mxfp8_e4m3fn")
float4_e2m1fn_x4 = Dtype("float4_e2m1fn_x4", np.dtype(np.uint16), 2, False, "mxfp4")
PACKED_DTYPES: tuple[Dtype, ...] = (float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)

_BY_NAME: dict[str, Dtype] = {}
for _d in _ALL:
    _BY_NAME[_d.name] = _d
    for _alias in _ALIASES[_d.name]:
        _BY_NAME[_alias] = _d
for _d in PACKED_DTYPES:
    _BY_NAME[_d.name] = _BY_NAME[_d.short] = _d
_BY_NP: dict[np.dtype, Dtype] = {d.np_dtype: d for d in _ALL}


def all_dtypes() -> tuple[Dtype, ...]:
    """Every registered dtype, in the order error messages list them."""
    return _ALL


def _unknown(what: object) -> ValueError:
    expected = ", ".join(d.short for d in _ALL)
    return ValueError(f"unknown dtype {what!r}: expected one of {expected}")


def get_dtype(x: str | np.dtype | type | Dtype) -> Dtype:
    """Resolve a name, alias, numpy dtype (or scalar type) or :class:`Dtype` to a :class:`Dtype`.

    Names are case-insensitive (``"BF16"`` works). Raises ``ValueError("unknown dtype 'xyz':
    expected one of bf16, fp16, fp32, ...")`` for anything else.
    """
    if isinstance(x, Dtype):
        return x
    if isinstance(x, str):
        d = _BY_NAME.get(x.strip().lower())
        if d is None:
            raise _unknown(x)
        return d
    if x is None:
        raise _unknown(x)
    try:
        dt = np.dtype(x)  # type: ignore[arg-type]
    except TypeError:
        raise _unknown(x) from None
    d = _BY_NP.get(dt)
    if d is None:
        raise _unknown(dt.name)
    return d
