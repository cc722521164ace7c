"""ScalarE (ACT): ``activation`` = f(in*scale + bias) with an optional reduction, plus copies.

Cost ``max(MIN_II, N)`` ScalarE cycles (datasheet §7), ``+ MIN_II`` for the reduction
(ActReadAccumulator), divided by the NC-v4 16-bit performance mode. Functions are evaluated
from piece-wise polynomial tables grouped in sets; changing to a function of another set costs
a table load (``table_switch_cycles``, an estimate, §13).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..isa import ACTIVATIONS, Activation, DmaTranspose, Instruction, Memset, TensorCopy, TensorScalar
from .alu import ElementwiseExec, activation_values, load_f32, operand, store
from .base import Engine, register_engine, view_fields as _v
from .vector import ceil_div, is16


@register_engine
class ScalarEngine(ElementwiseExec, Engine):
    name = "Scalar"
    aliases = ("act", "activation")
    column, title, color = 2, "ScalarE", "#c44e52"
    cost_fields = {
        Activation: _v("dst", "data") + ("func", "reduce_op"),
        TensorCopy: _v("dst", "data"),
        TensorScalar: _v("dst", "data") + ("op0", "op1"),
        Memset: _v("dst"),
    }
    runs = Engine.runs | set(cost_fields) | {DmaTranspose}
    cost_state = ("table",)

    def __init__(self, config: Any):
        super().__init__(config)
        self.table: str | None = None  # activation table set currently loaded

    def cycles(self, ins: Instruction) -> int:
        s = self.config.core.scalar
        mi = s.min_ii_cycles
        if isinstance(ins, Activation):
            perf = s.perf_mode_16bit if is16(ins.dst) and is16(ins.data) else 1
            c = max(mi, ceil_div(ins.data.free_size, perf))
            if ins.reduce_op is not None:
                c += s.reduce_extra_cycles
            table = ACTIVATIONS[ins.func][1]
            if table is not None and table != self.table:
                c += s.table_switch_cycles
                self.table = table
            return c
        if isinstance(ins, (TensorCopy, TensorScalar)):
            perf = s.perf_mode_16bit if is16(ins.dst) and is16(ins.data) else 1
            return max(mi, ceil_div(ins.data.free_size, perf))
        if isinstance(ins, Memset):
            return max(mi, ins.dst.free_size)
        return super().cycles(ins)

    def latency_cycles(self, ins: Instruction) -> int:
        return self.config.core.scalar.dependency_latency_cycles

    def exec_Activation(self, ins: Activation, mem: Any) -> None:
        x = load_f32(mem, ins.data)
        scale = operand(mem, ins.scale, ins.data)
        bias = operand(mem, ins.bias, ins.data)
        with np.errstate(all="ignore"):
            y = (x * scale).astype(np.float32) + bias
        y = activation_values(ins.func, y.astype(np.float32))
        store(mem, ins.dst, y)
        if ins.reduce_res is not None:
            with np.errstate(all="ignore"):
                if ins.reduce_op == "add":
                    r = y.sum(axis=1, dtype=np.float32)
                elif ins.reduce_op == "max":
                    r = y.max(axis=1)
                else:
                    r = y.min(axis=1)
            store(mem, ins.reduce_res, r.reshape(-1, 1))
