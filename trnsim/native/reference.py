"""The TensorE matmul datapath, defined in numpy: the oracle the C core is tested against.

This module is the (living) definition of the numbers a NeuronCore's TensorE produces. It is
written to be read, not to be fast; :mod:`trnsim.native` dispatches to a C core that must match
it bit for bit (``tests/native/test_native.py``).

**Inputs.** Operands are numpy arrays already in their dtype: float32, float16, bfloat16,
float8_e4m3 (IEEE-like, has Inf), float8_e4m3fn (OCP, no Inf) or float8_e5m2, as ml_dtypes
defines them. The two operands may have different dtypes. Each element is widened to fp32, which
is exact for every one of these formats.

**One matmul instruction** computes ``stationary[K, M]ᵀ @ moving[K, N] -> [M, N]`` for
``K <= k_chunk`` (128 partitions normally, 256 for fp8 "double-row"; the caller decides).
The contraction accumulates in fp32 in a fixed order, and every multiply-accumulate is fused:
the exact ``acc + s*v`` is rounded once to fp32 with round-to-nearest-even (IEEE ``fmaf``)::

    acc = +0.0
    for k in 0 .. K-1:
        acc = fl32(acc + s[k, m] * v[k, n])      # one rounding per MAC

For 16- and 8-bit inputs the product is exact in fp32 (at most 11+11 significand bits), so a
fused MAC gives the same bits as a separate multiply and add; only bf16 products that overflow
or underflow fp32 differ. For fp32 inputs the fusing is a modelling choice: the datasheet says
only "FP32 inside the array" and "FP32 at ¼ rate", and the PE array's fp32 rounding is not
published. One rounding per MAC is the most accurate choice and the one a CPU runs fastest.

**A GEMM longer than one chunk** is a PSUM accumulation group. K is split into consecutive
chunks of ``k_chunk`` rows; each chunk is one instruction computed as above from ``acc = +0.0``.
The first chunk's result overwrites the output (with ``accumulate=True`` it is added to the fp32
values already in ``out``), and every later chunk's result is added in chunk order::

    out = fl32(out + chunk_result)

K = 0 counts as one empty chunk whose result is +0.0.

**NaN.** Any NaN in the matmul result is returned as the default quiet NaN, bit pattern
0x7FC00000. (Which NaN payload an IEEE operation propagates is left open by the standard and
differs between implementations of the same operation; fixing it makes the result a function
of the inputs alone.)

**Output** is fp32, as PSUM holds it. :func:`convert` rounds fp32 to a narrower format with
round-to-nearest-even and exactly the overflow, NaN and subnormal behaviour of
``np.ndarray.astype`` with ml_dtypes (numpy's own for float16): overflow gives Inf for bf16,
fp16, fp8_e4m3 and fp8_e5m2 and NaN for fp8_e4m3fn (values that round to the largest finite
number stay finite); NaN stays NaN. A conversion between two narrow formats goes through fp32
(exact widening, then one rounding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trnsim.native.dtypes import FLOAT_DTYPES, Dtype, get_dtype

__all__ = ["matmul", "fma32", "convert", "widen", "CANONICAL_NAN_BITS"]

#: Bit pattern of the one NaN the matmul datapath returns.
CANONICAL_NAN_BITS = 0x7FC00000
_CANONICAL_NAN = np.array(CANONICAL_NAN_BITS, dtype=np.uint32).view(np.float32)


def _float_dtype(dtype: Any, what: str) -> Dtype:
    """The registry entry of a float format, or a ValueError naming ``what``."""
    try:
        d: Dtype | None = get_dtype(dtype)
    except ValueError:
        if isinstance(dtype, str):
            raise
        d = None
    if d is None or not d.is_float:
        expected = ", ".join(f.short for f in FLOAT_DTYPES)
        shown = dtype if isinstance(dtype, (str, Dtype)) else np.dtype(dtype).name
        raise ValueError(f"{what} dtype {shown} is not a float format: expected one of {expected}")
    return d


def check_operands(
    stationary: Any,
    moving: Any,
    out: np.ndarray | None,
    accumulate: bool,
    k_chunk: int,
) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """Validate matmul arguments; return the operands as arrays and (K, M, N).

    Shared by the reference and the native core so both reject the same inputs with the same
    messages.
    """
    s = np.asarray(stationary)
    v = np.asarray(moving)
    if s.ndim != 2:
        raise ValueError(f"stationary must be 2-D [K, M], got shape {s.shape}")
    if v.ndim != 2:
        raise ValueError(f"moving must be 2-D [K, N], got shape {v.shape}")
    _float_dtype(s.dtype, "stationary")
    _float_dtype(v.dtype, "moving")
    if s.shape[0] != v.shape[0]:
        raise ValueError(
            "stationary and moving must have the same K (partition) extent, "
            f"got {s.shape[0]} and {v.shape[0]}"
        )
    if isinstance(k_chunk, bool) or not isinstance(k_chunk, (int, np.integer)) or k_chunk < 1:
        raise ValueError(f"k_chunk must be a positive int, got {k_chunk!r}")
    K, M = s.shape
    N = v.shape[1]
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out (the PSUM tile to add to)")
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (M, N):
            got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
            raise ValueError(f"out must be a float32 array of shape {(M, N)}, got {got}")
        if not out.flags.writeable:
            raise ValueError("out must be writeable")
        if np.may_share_memory(out, s) or np.may_share_memory(out, v):
            raise ValueError("out must not share memory with stationary or moving")
    return s, v, K, M, N


def widen(x: np.ndarray) -> np.ndarray:
    """Any supported float array -> float32 (exact for every supported format)."""
    return np.asarray(x).astype(np.float32)


_F32_OVERFLOW_STEP = 2.0**128  # the "next float" above FLT_MAX, to find the midpoint below it


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """``fl32(a*b + c)`` with one rounding (IEEE ``fmaf``), elementwise on broadcast fp32 arrays.

    Emulated in float64 because numpy has no fused multiply-add: the product of two fp32 values
    is exact in fp64 (24+24 significand bits <= 53, exponents within range), and the sum
    ``s = c + a*b`` is rounded once in fp64 with its exact error ``e`` recovered by TwoSum
    (``s + e == c + a*b`` exactly). Rounding ``s`` to fp32 is then correct except when ``s`` is
    exactly halfway between two fp32 neighbours and ``e != 0``: the exact value lies off the
    midpoint, on the side of ``e``. No other double rounding exists, since every fp32 midpoint
    (subnormal ones too) is an fp64 number and fp64 rounding is monotone. Non-finite sums are
    rounded plainly: Inf and NaN propagate as IEEE says, without an error term.
    """
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        p = a64 * b64  # exact
        s = c64 + p
        r = s.astype(np.float32)
        # TwoSum: the exact error of s = c + p (valid for finite operands).
        pv = s - c64
        e = (c64 - (s - pv)) + (p - pv)
        r64 = r.astype(np.float64)
        below = r64 < s  # r is the lower neighbour of s; else the upper (or s itself)
        other = np.nextafter(r, np.where(below, np.float32(np.inf), np.float32(-np.inf)))
        other64 = other.astype(np.float64)
        # r (or its neighbour) is Inf when s rounds past FLT_MAX: use 2^128 for the midpoint.
        r_m = np.where(np.isinf(r64), np.copysign(_F32_OVERFLOW_STEP, r64), r64)
        o_m = np.where(np.isinf(other64), np.copysign(_F32_OVERFLOW_STEP, other64), other64)
        tie = np.isfinite(s) & (s != r64) & (s == (r_m + o_m) * 0.5) & (e != 0)
        lo = np.where(below, r, other)
        hi = np.where(below, other, r)
        fixed = np.where(e > 0, hi, lo)
    return np.where(tie, fixed, r).astype(np.float32)


def convert(x: Any, dtype: Any) -> np.ndarray:
    """Round ``x`` (fp32 or any supported float format) to ``dtype``; returns a new array.

    Round-to-nearest-even with ml_dtypes' (numpy's for float16) overflow, NaN and subnormal
    behaviour; narrow-to-narrow goes through fp32. ``dtype`` is anything :func:`get_dtype`
    accepts.
    """
    target = _float_dtype(dtype, "target")
    a = np.asarray(x)
    _float_dtype(a.dtype, "source")
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(np.float32).astype(target.np_dtype)


def matmul(
    stationary: np.ndarray,
    moving: np.ndarray,
    *,
    out: np.ndarray | None = None,
    accumulate: bool = False,
    k_chunk: int = 128,
) -> np.ndarray:
    """``stationary[K, M]ᵀ @ moving[K, N]`` as the TensorE computes it; float32 [M, N].

    Args:
        stationary: [K, M] array in any supported float format (the loaded weights).
        moving: [K, N] array in any supported float format (the streamed operand).
        out: optional float32 [M, N] array (the PSUM tile); written and returned.
        accumulate: add the first chunk to ``out`` instead of overwriting it.
        k_chunk: rows of K per matmul instruction (partitions).

    See the module docstring for the exact rules.
    """
    s, v, K, M, N = check_operands(stationary, moving, out, accumulate, k_chunk)
    s32 = widen(s)
    v32 = widen(v)
    if out is None:
        out = np.empty((M, N), dtype=np.float32)

    with np.errstate(all="ignore"):
        chunk_starts = range(0, K, k_chunk) if K > 0 else [0]
        for c, k0 in enumerate(chunk_starts):
            # One instruction: a fresh fp32 accumulator, k in order, one rounding per MAC.
            acc = np.zeros((M, N), dtype=np.float32)
            for k in range(k0, min(k0 + k_chunk, K)):
                acc = fma32(s32[k][:, None], v32[k][None, :], acc)
            # PSUM accumulation group: overwrite on the first chunk, then add in issue order.
            if c == 0 and not accumulate:
                out[...] = acc
            else:
                out[...] = out + acc
    out[np.isnan(out)] = _CANONICAL_NAN
    return out
