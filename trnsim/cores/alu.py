"""Shared numerics of the Vector, Scalar and GpSimd engines.

These engines compute in fp32 internally with free casts on input and output (datasheet §4.3):
operands are widened to fp32, the op runs in fp32 (transcendental functions are evaluated in
float64 and rounded once to fp32), and the result is rounded to the destination dtype with
round-to-nearest-even. Integer and bitwise ops on integer tiles run in integer arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..isa import ACTIVATIONS, ALU_OPS, BITWISE_OPS, REDUCE_OPS, TileAP
from ..native.cast import to_dtype
from ..native.dtypes import Dtype

__all__ = ["store", "load_f32", "alu", "operand", "activation_values"]


def load_f32(mem: Any, ap: TileAP) -> np.ndarray:
    """The tile as a 2-D fp32 array [partitions, free elements]."""
    v = mem.view(ap)
    return v.reshape(ap.p_count, -1).astype(np.float32, copy=False)


def store(mem: Any, ap: TileAP, values: np.ndarray) -> None:
    """Round ``values`` to ``ap``'s dtype and write them (shape [P, free] or ap.shape)."""
    dst = mem.view(ap)
    dst[...] = to_dtype(np.asarray(values), ap.dtype).reshape(dst.shape)


def operand(mem: Any, x: float | TileAP | None, like: TileAP, int_mode: bool = False) -> Any:
    """An immediate, or a per-partition [P,1] tile as a column: fp32, or int64 in integer mode."""
    if isinstance(x, TileAP):
        return load_any(mem, x, int_mode).reshape(like.p_count, 1)
    v = 0 if x is None else x
    return np.int64(v) if int_mode else np.float32(v)


def _is_int(*dts: Dtype) -> bool:
    return all(not d.is_float for d in dts)


def alu(op: str, a: Any, b: Any, int_mode: bool) -> np.ndarray:
    fn = ALU_OPS[op]
    if int_mode or op in BITWISE_OPS:
        out = fn(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
        return np.asarray(out).astype(np.int64)
    with np.errstate(all="ignore"):
        out = fn(np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32))
    return np.asarray(out).astype(np.float32)


def load_any(mem: Any, ap: TileAP, int_mode: bool) -> np.ndarray:
    v = mem.view(ap).reshape(ap.p_count, -1)
    return v.astype(np.int64) if int_mode else v.astype(np.float32, copy=False)


def activation_values(func: str, x: np.ndarray) -> np.ndarray:
    fn, _ = ACTIVATIONS[func]
    with np.errstate(all="ignore"):
        return np.asarray(fn(x.astype(np.float64)), dtype=np.float64).astype(np.float32)


def _integral(x: Any) -> bool:
    """An operand integer arithmetic takes as it is: none, an integer tile, or a whole number."""
    if x is None:
        return True
    if isinstance(x, TileAP):
        return not x.dtype.is_float
    return float(x).is_integer()


def int_mode_for(*aps: TileAP) -> bool:
    return _is_int(*(a.dtype for a in aps))


class ElementwiseExec:
    """``execute`` methods shared by every engine that runs elementwise instructions."""

    def exec_TensorCopy(self, ins: Any, mem: Any) -> None:
        src = mem.view(ins.data).reshape(ins.data.p_count, -1)
        if ins.dst.dtype.is_float or not ins.data.dtype.is_float:
            vals = src if not ins.dst.dtype.is_float else src.astype(np.float32, copy=False)
        else:
            vals = src.astype(np.float32)
        store(mem, ins.dst, vals)

    def exec_TensorTensor(self, ins: Any, mem: Any) -> None:
        im = int_mode_for(ins.dst, ins.data1, ins.data2)
        a = load_any(mem, ins.data1, im)
        b = load_any(mem, ins.data2, im)
        store(mem, ins.dst, alu(ins.op, a, b, im))

    def exec_TensorScalar(self, ins: Any, mem: Any) -> None:
        # integer arithmetic only where every operand is an integer: a fractional immediate or a
        # float [P,1] operand is fp32 arithmetic (int tile * 0.5 cut the 0.5 to 0; an NKI hunt)
        im = int_mode_for(ins.dst, ins.data) and _integral(ins.operand0) and \
            (ins.op1 is None or _integral(ins.operand1))
        x = load_any(mem, ins.data, im)
        o0 = operand(mem, ins.operand0, ins.data, im)
        x = alu(ins.op0, o0, x, im) if ins.reverse0 else alu(ins.op0, x, o0, im)
        if ins.op1 is not None:
            o1 = operand(mem, ins.operand1, ins.data, im)
            x = alu(ins.op1, o1, x, im) if ins.reverse1 else alu(ins.op1, x, o1, im)
        store(mem, ins.dst, x)

    def exec_TensorReduce(self, ins: Any, mem: Any) -> None:
        im = int_mode_for(ins.dst, ins.data)
        v = mem.view(ins.data)
        v = v.astype(np.int64) if im else v.astype(np.float32)
        axes = tuple(ins.axes)  # free axes are 1-based, numpy axis 0 is the partition axis
        with np.errstate(all="ignore"):
            r = REDUCE_OPS[ins.op](v, axis=axes)
        if ins.negate:
            r = -r
        store(mem, ins.dst, np.asarray(r).reshape(ins.dst.p_count, -1))

    def exec_Memset(self, ins: Any, mem: Any) -> None:
        dst = mem.view(ins.dst)
        fill = np.int64(ins.value) if not ins.dst.dtype.is_float else np.float32(ins.value)
        dst[...] = to_dtype(np.full(dst.shape, fill), ins.dst.dtype)
