"""The TensorE matmul datapath, defined in numpy: the oracle the C core is tested against.

This module is the (living) definition of the numbers a NeuronCore's TensorE produces. It is
written to be read, not to be fast; :mod:`trnsim.native` dispatches to a C core that must match
it bit for bit (``tests/test_native.py``).

**Inputs.** Operands are numpy arrays already in their dtype: float32, float16, bfloat16,
float8_e4m3 (IEEE-like, has Inf), float8_e4m3fn (OCP, no Inf) or float8_e5m2, as ml_dtypes
defines them. The two operands may have different dtypes. Each element is widened to fp32, which
is exact for every one of these formats.

**One matmul instruction** computes ``stationary[K, M]ᵀ @ moving[K, N] -> [M, N]`` for
``K <= k_chunk`` (128 partitions normally, 256 for fp8 "double-row"; the caller decides).
Every product is an IEEE fp32 multiply with round-to-nearest-even; for 16- and 8-bit inputs it
is exact, except bf16 products that overflow or underflow fp32. The contraction accumulates in
fp32 in a fixed order, one rounding per multiply and one per add (no fused multiply-add)::

    acc = +0.0
    for k in 0 .. K-1:
        acc = fl32(acc + fl32(s[k, m] * v[k, n]))

**A GEMM longer than one chunk** is a PSUM accumulation group. K is split into consecutive
chunks of ``k_chunk`` rows; each chunk is one instruction computed as above from ``acc = +0.0``.
The first chunk's result overwrites the output (with ``accumulate=True`` it is added to the fp32
values already in ``out``), and every later chunk's result is added in chunk order::

    out = fl32(out + chunk_result)

K = 0 counts as one empty chunk whose result is +0.0.

**NaN.** Any NaN in the matmul result is returned as the default quiet NaN, bit pattern
0x7FC00000. (Which NaN payload an IEEE operation propagates is left open by the standard and
differs between a separate multiply-add and a fused one; fixing it makes the result a function
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

__all__ = ["matmul", "convert", "widen", "CANONICAL_NAN_BITS"]

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
            # One instruction: a fresh fp32 accumulator, k in order, mul and add rounded apart.
            acc = np.zeros((M, N), dtype=np.float32)
            for k in range(k0, min(k0 + k_chunk, K)):
                product = np.multiply.outer(s32[k], v32[k])  # fp32 [M, N], rounded once
                acc = acc + product  # rounded once
            # PSUM accumulation group: overwrite on the first chunk, then add in issue order.
            if c == 0 and not accumulate:
                out[...] = acc
            else:
                out[...] = out + acc
    out[np.isnan(out)] = _CANONICAL_NAN
    return out
