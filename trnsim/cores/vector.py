"""VectorE: elementwise, reductions and PSUM evacuation; 128 lanes, one per partition.

Costs are the published "estimated instruction cost" formulas (datasheet §7) in VectorE cycles,
divided by the NC-v3/v4 performance modes (§4.3) when their conditions hold:

* 4x (``perf_mode_fast``): tensor_copy / tensor_scalar, SBUF to SBUF, 16-bit float in and out,
  unit innermost stride;
* 2x (``perf_mode_mid``): the same ops when not contiguous or when one side is PSUM, and
  tensor_tensor with both inputs in SBUF and every tensor 16-bit float.

A dependent instruction sees the result ``dependency_latency_cycles`` after the end, so a
chain of tiny dependent ops runs at ~100 cycles each (§7, S8).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..isa import (ALU_OPS, CopyPredicated, Dropout, FindIndex8, Instruction, Max8, Memset, RangeSelect, Reciprocal,
                   ScalarTensorTensor, TensorCopy, TensorReduce, TensorScalar, TensorTensor, TensorTensorScan, TileAP,
                   dropout_keep)
from .alu import ElementwiseExec, alu, load_any, load_f32, operand, store
from .base import Engine, register_engine, view_fields as _v


def is16(ap: TileAP) -> bool:
    return ap.dtype.is_float and ap.dtype.itemsize == 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@register_engine
class VectorEngine(ElementwiseExec, Engine):
    name = "Vector"
    aliases = ("dve",)
    column, title, color = 1, "VectorE", "#55a868"

    @classmethod
    def max_free(cls, config: Any, space: str) -> int | None:
        vec = config.core.vector
        return vec.max_free_psum if space == "psum" else vec.max_free_sbuf
    cost_fields = {
        TensorCopy: _v("dst", "data"),
        TensorScalar: _v("dst", "data") + ("op0", "op1"),
        TensorTensor: _v("dst", "data1", "data2") + ("op",),
        TensorReduce: _v("dst", "data") + ("op",),
        Memset: _v("dst") + ("value",),
        TensorTensorScan: _v("data0") + ("op0", "op1"),
        ScalarTensorTensor: _v("dst", "data", "operand1") + ("op0", "op1"),
        CopyPredicated: _v("dst", "predicate") + ("src",),  # src: a view (by identity) or a number
        RangeSelect: _v("data") + ("cmp0", "cmp1"),
        Dropout: _v("data"),
        Reciprocal: _v("data"),
        Max8: _v("data"),
        FindIndex8: _v("data"),
    }
    runs = Engine.runs | set(cost_fields)

    def perf_copy(self, dst: TileAP, src: TileAP) -> int:
        v = self.config.core.vector
        if is16(dst) and is16(src):
            if dst.space == src.space == "sbuf" and dst.is_contiguous() and src.is_contiguous():
                return v.perf_mode_fast
            return v.perf_mode_mid
        if "psum" in (dst.space, src.space):
            return v.perf_mode_mid
        return 1

    def cycles(self, ins: Instruction) -> int:
        v = self.config.core.vector
        mi = v.min_ii_cycles
        if isinstance(ins, (TensorCopy, TensorScalar)):
            n = ins.data.free_size
            return max(mi, ceil_div(n, self.perf_copy(ins.dst, ins.data)))
        if isinstance(ins, TensorTensor):
            a, b, d = ins.data1, ins.data2, ins.dst
            n = a.free_size
            spaces = {a.space, b.space}
            bf16_fast = (spaces == {"sbuf"} and all(x.dtype.name == "bfloat16" for x in (a, b, d))
                         and ins.op in ("add", "multiply", "subtract") and a.is_contiguous() and b.is_contiguous())
            k = 1 if spaces == {"sbuf", "psum"} or bf16_fast else 2
            perf = v.perf_mode_mid if spaces == {"sbuf"} and all(is16(x) for x in (a, b, d)) else 1
            return max(mi, ceil_div(k * n, perf))
        if isinstance(ins, TensorReduce):
            n = ins.data.free_size
            half = ins.data.dtype.name == "bfloat16" and ins.dst.dtype.name == "bfloat16" and ins.op in ("add", "max")
            return max(mi, ceil_div(n, 2) if half else n)
        if isinstance(ins, Memset):
            n = ins.dst.free_size
            return max(mi, ceil_div(n, 2) if ins.value == 0 and is16(ins.dst) else n)
        # the rest: nki.isa's "estimated instruction cost" (datasheet §7, S16), floored at MIN_II
        if isinstance(ins, TensorTensorScan):
            return max(mi, 2 * ins.data0.free_size)
        if isinstance(ins, ScalarTensorTensor):
            n = ins.data.free_size
            bf16 = all(x.dtype.name == "bfloat16" for x in (ins.dst, ins.data, ins.operand1))
            fast = bf16 and ins.op0 == "subtract" and ins.op1 == "multiply" and n % 2 == 0
            return max(mi, n if fast else 2 * n)
        if isinstance(ins, CopyPredicated):
            n = ins.dst.free_size
            both_sbuf = isinstance(ins.src, TileAP) and ins.src.space == ins.predicate.space == "sbuf"
            return max(mi, 2 * n if both_sbuf else n)
        if isinstance(ins, (RangeSelect, Dropout)):  # "dropout, range_select: N" (datasheet §7, S16)
            return max(mi, ins.data.free_size)
        if isinstance(ins, Reciprocal):
            return max(mi, 8 * ins.data.free_size)
        if isinstance(ins, (Max8, FindIndex8)):  # "max8, nc_find_index8: N" (datasheet §7, S16)
            return max(mi, ins.data.free_size)
        return super().cycles(ins)

    def latency_cycles(self, ins: Instruction) -> int:
        return self.config.core.vector.dependency_latency_cycles

    # ---- numbers of the instructions beyond the core set (fp32 inside, one rounding out) -------
    def exec_TensorTensorScan(self, ins: TensorTensorScan, mem: Any) -> None:
        a = load_f32(mem, ins.data0)
        b = load_f32(mem, ins.data1)
        prev = np.broadcast_to(operand(mem, ins.initial, ins.data0), (a.shape[0], 1)).reshape(-1)
        out = np.empty_like(a)
        for i in range(a.shape[1]):
            x = alu(ins.op0, prev, a[:, i], False) if ins.reverse0 else alu(ins.op0, a[:, i], prev, False)
            x = alu(ins.op1, b[:, i], x, False) if ins.reverse1 else alu(ins.op1, x, b[:, i], False)
            out[:, i] = prev = x
        store(mem, ins.dst, out)

    def exec_ScalarTensorTensor(self, ins: ScalarTensorTensor, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        o0 = operand(mem, ins.operand0, ins.data)
        o1 = load_f32(mem, ins.operand1)
        x = alu(ins.op0, o0, x, False) if ins.reverse0 else alu(ins.op0, x, o0, False)
        x = alu(ins.op1, o1, x, False) if ins.reverse1 else alu(ins.op1, x, o1, False)
        store(mem, ins.dst, x)

    def exec_CopyPredicated(self, ins: CopyPredicated, mem: Any) -> None:
        pred = load_any(mem, ins.predicate, not ins.predicate.dtype.is_float) != 0
        if ins.reverse:
            pred = ~pred
        dst = mem.view(ins.dst).reshape(ins.dst.p_count, -1)
        if isinstance(ins.src, TileAP):
            src = mem.view(ins.src).reshape(ins.src.p_count, -1)
            vals = np.where(pred, src, dst)  # src and dst share a dtype: bits move unchanged
        else:
            vals = np.where(pred, np.float32(ins.src), dst.astype(np.float32))
        store(mem, ins.dst, vals)

    def exec_RangeSelect(self, ins: RangeSelect, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        idx = (ins.range_start + np.arange(x.shape[1], dtype=np.float32))[None, :]
        b0 = load_f32(mem, ins.bound0).reshape(-1, 1)
        b1 = load_f32(mem, ins.bound1).reshape(-1, 1)
        keep = ALU_OPS[ins.cmp0](idx, b0) & ALU_OPS[ins.cmp1](idx, b1)
        out = np.where(keep, x, np.float32(ins.on_false)).astype(np.float32)
        store(mem, ins.dst, out)
        if ins.reduce_res is not None:
            store(mem, ins.reduce_res, out.max(axis=1).reshape(-1, 1))

    def exec_Dropout(self, ins: Dropout, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        counters = ins.offset + np.arange(x.shape[0], dtype=np.int64)[:, None] * ins.row_stride \
            + np.arange(x.shape[1], dtype=np.int64)[None, :]
        store(mem, ins.dst, np.where(dropout_keep(ins.seed, counters, ins.prob), x, np.float32(0.0)))

    def exec_Max8(self, ins: Max8, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        store(mem, ins.dst, -np.sort(-x, axis=1, kind="stable")[:, :8])

    def exec_FindIndex8(self, ins: FindIndex8, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        v = load_f32(mem, ins.vals)
        hit = x[:, None, :] == v[:, :, None]  # [P, 8, N]
        idx = np.where(hit.any(axis=2), hit.argmax(axis=2), 0xFFFFFFFF).astype(np.uint32)
        dst = mem.view(ins.dst)
        dst[...] = idx.view(dst.dtype).reshape(dst.shape)  # bits as they are (int32: -1 when not found)

    def exec_Reciprocal(self, ins: Reciprocal, mem: Any) -> None:
        with np.errstate(all="ignore"):
            store(mem, ins.dst, (np.float32(1.0) / load_f32(mem, ins.data)).astype(np.float32))
