"""GpSimd (Pool): 8 general-purpose SIMD cores, 16 partitions each; iota, affine_select and
elementwise work. Library instructions pay ``start_cycles`` (GPSIMD_START ~150, datasheet §7).
GpSimd cannot reach PSUM (the builder rejects it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..isa import ALU_OPS, AffineSelect, DmaGather, DmaScatter, DmaTranspose, Instruction, Iota, Memset, TensorCopy, TensorReduce, TensorScalar, TensorTensor
from .alu import ElementwiseExec, store
from .base import Engine, register_engine, view_fields as _v


def _affine_grid(p: int, dims: tuple[tuple[int, int], ...], base: int, cm: int, pattern: tuple[int, ...]) -> np.ndarray:
    shape = (p,) + tuple(n for _, n in dims)
    out = np.full(shape, base, dtype=np.int64)
    out += (cm * np.arange(p, dtype=np.int64)).reshape((p,) + (1,) * len(dims))
    for k, ((_, n), s) in enumerate(zip(dims, pattern)):
        sh = [1] * (1 + len(dims))
        sh[k + 1] = n
        out += (s * np.arange(n, dtype=np.int64)).reshape(sh)
    return out


@register_engine
class GpSimdEngine(ElementwiseExec, Engine):
    name = "GpSimd"
    aliases = ("pool",)
    column, title, color = 3, "GpSimd", "#8172b2"
    reaches_psum = False
    cost_fields = {
        Iota: _v("dst"),
        AffineSelect: _v("dst"),
        TensorTensor: _v("data1") + ("op",),
        TensorScalar: _v("data") + ("op0", "op1"),
        TensorCopy: _v("data"),
        TensorReduce: _v("data") + ("op",),
        Memset: _v("dst"),
    }
    #: the only engine that generates indirect descriptors (software DGE, datasheet §6)
    runs = Engine.runs | set(cost_fields) | {DmaTranspose, DmaGather, DmaScatter}

    def cycles(self, ins: Instruction) -> int:
        g = self.config.core.gpsimd
        if isinstance(ins, (Iota, AffineSelect)):
            return g.start_cycles + ins.dst.free_size
        if isinstance(ins, TensorTensor):
            return max(g.min_ii_cycles, 2 * ins.data1.free_size)
        if isinstance(ins, (TensorScalar, TensorCopy, TensorReduce)):
            return max(g.min_ii_cycles, ins.data.free_size)
        if isinstance(ins, Memset):
            return max(g.min_ii_cycles, ins.dst.free_size)
        return super().cycles(ins)

    def latency_cycles(self, ins: Instruction) -> int:
        return self.config.core.gpsimd.dependency_latency_cycles

    def exec_Iota(self, ins: Iota, mem: Any) -> None:
        grid = _affine_grid(ins.dst.p_count, ins.dst.dims, ins.base, ins.channel_multiplier, ins.pattern)
        store(mem, ins.dst, grid.reshape(ins.dst.p_count, -1))

    def exec_AffineSelect(self, ins: AffineSelect, mem: Any) -> None:
        grid = _affine_grid(ins.data.p_count, ins.data.dims, ins.offset, ins.channel_multiplier, ins.pattern)
        cond = ALU_OPS[ins.cmp](grid, 0).reshape(ins.data.p_count, -1)
        data = mem.view(ins.data).reshape(ins.data.p_count, -1).astype(np.float32)
        store(mem, ins.dst, np.where(cond, data, np.float32(ins.on_false)))
