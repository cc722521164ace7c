"""TensorE: the 128x128 systolic PE array (weight stationary), reading SBUF, writing PSUM.

Each ``nc_matmul`` is two hardware instructions (datasheet §4.2): **LoadStationary** (LS) caches
the stationary operand in the array, then **MultiplyMoving** (MM) streams the moving operand
through it. The timing model (datasheet §7, §12.1; lessons-from-peers "issue interval and latency
are different things"):

* MM occupies the array for its issue interval ``max(min(MIN_ISSUE, M), N)`` PE cycles
  (N = moving free size, M = stationary free size), x ``fp32_cost_multiplier`` for fp32. FP8
  double-row contracts 2K rows in the same cycles.
* LS costs ``ceil(M / load_stationary_speedup)`` cycles and is skipped when the same stationary
  tile is still loaded. With ``overlap_load_stationary`` it runs in the background of the
  previous MM (it may start once that MM has started); without it, it waits until the previous
  result has drained (SCALE-Sim's weight-stationary schedule).
* Results are visible in PSUM ``pe_rows + pe_cols - 2`` cycles after the MM ends (fill and
  drain). That latency sits on the dependency path of *other* engines only: accumulating
  matmuls into the same PSUM bank pipeline back to back.
* Power ramp (Trn2/Trn3): after an idle gap of ``throttle_idle_reset``, the array starts at
  ``throttle_initial_util`` of its rate and ramps linearly to 100% over ``throttle_ramp``.

Numbers come from the native datapath (:mod:`trnsim.native`), bit-identical to its numpy
reference.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import numpy as np

from ..config import ChipConfig
from ..isa import Instruction, MatMul, MatMulMx, Transpose
from ..native import convert, matmul as native_matmul
from ..native.cast import to_dtype
from .base import Engine, Numbering, Segment, first_uses, register_engine

LS_LANE = "Tensor (LS)"


@register_engine
class TensorEngine(Engine):
    name = "Tensor"
    runs = Engine.runs | {MatMul, MatMulMx, Transpose}
    aliases = ("pe",)
    column, title, color = 0, "TensorE", "#4c72b0"
    pipelines_own_results = True

    @classmethod
    def lanes(cls) -> tuple[str, ...]:
        return (cls.name, LS_LANE)

    def __init__(self, config: ChipConfig):
        super().__init__(config)
        t = config.core.tensor
        self.ls_free = 0          # LS unit free from
        self.last_mm_start = 0    # the LS of the next MM may start once this MM started
        self.last_mm_ready = 0    # ... or, without overlap, once its result drained
        self.last_mm_end = -10**30
        self.ramp_start: int | None = None
        self.drain_cycles = t.pe_rows + t.pe_cols - 2
        self.ramp_ticks = config.ps_to_ticks(t.throttle_ramp)
        self.idle_reset_ticks = config.ps_to_ticks(t.throttle_idle_reset)
        self._cycles: dict[tuple[Any, ...], tuple[int, int]] = {}  # shape_cycles by operand shapes

    # ---- timing ----------------------------------------------------------------------------
    def shape_cycles(self, ins: MatMul | Transpose) -> tuple[int, int]:
        """(LS cycles, MM cycles) at full rate."""
        t = self.config.core.tensor
        if isinstance(ins, Transpose):
            # data goes in as the stationary [P, F], identity streams as moving [P, P]
            m, n = ins.data.free_size, ins.data.p_count
            mult = 1
        else:
            if ins.double_row:
                m, n = ins.stationary.dims[1][1], ins.moving.dims[1][1]
            else:
                m, n = ins.stationary.free_size, ins.moving.free_size
            mult = t.fp32_cost_multiplier if ins.stationary.dtype.name == "float32" else 1
        ls = math.ceil(m / t.load_stationary_speedup) * mult if ins.load_stationary else 0
        mm = max(min(t.min_issue_cycles, m), n) * mult
        return ls, mm

    #: what :meth:`shape_cycles` depends on, per instruction type (the key of its cache)
    KEY_MATMUL = operator.attrgetter("opcode", "stationary.dims", "moving.dims", "stationary.dtype.name",
                                     "double_row", "load_stationary")
    KEY_TRANSPOSE = operator.attrgetter("opcode", "data.p_count", "data.free_size", "load_stationary")
    #: what it depends on for matmuls of one type none of which is double-row (cheaper to build
    #: than the dims: the free sizes are all it reads of the operand shapes then)
    KEY_MATMUL_SINGLE_ROW = operator.attrgetter("stationary.free_size", "moving.free_size", "stationary.dtype.name",
                                                "load_stationary")

    def cached_cycles(self, ins: MatMul | Transpose) -> tuple[int, int]:
        """:meth:`shape_cycles`, worked out once per operand geometry: they depend on the
        operand shapes alone, and a matmul kernel repeats a few."""
        key = (self.KEY_TRANSPOSE if isinstance(ins, Transpose) else self.KEY_MATMUL)(ins)
        cycles = self._cycles.get(key)
        if cycles is None:
            cycles = self._cycles[key] = self.shape_cycles(ins)
        return cycles

    #: the operand views themselves (by identity) and the flags: finer than the geometry, and
    #: cheaper to read when a kernel reuses its views (the operand objects are not touched)
    #: (the simulator's C scan numbers instructions by these attributes' identity, then asks
    #: for the cycles of one instruction per number: a subclass whose shape_cycles reads more
    #: must list it here)
    OPERANDS_MATMUL: tuple[str, ...] = ("stationary", "moving", "load_stationary", "double_row")
    OPERANDS_TRANSPOSE: tuple[str, ...] = ("data", "load_stationary")
    KEY_OPERANDS_MATMUL = operator.attrgetter(*OPERANDS_MATMUL)
    KEY_OPERANDS_TRANSPOSE = operator.attrgetter(*OPERANDS_TRANSPOSE)

    def cycles_by_shape(self, instrs: Sequence[MatMul | Transpose], transpose: bool
                        ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """:meth:`shape_cycles` of many instructions of one type (Transpose or not), in bulk:
        (for each instruction the number of its operand geometry, (LS, MM) cycles per geometry).
        In a big batch whose first thousand share their operand views (a matmul kernel's tiles),
        the instructions are numbered by those views first and the geometry read once per
        distinct operands (the same numbers, fewer objects touched)."""
        ident = self.KEY_OPERANDS_TRANSPOSE if transpose else self.KEY_OPERANDS_MATMUL
        n, head = len(instrs), min(len(instrs), 1024)
        if n >= 4096:  # big enough that a failed try (the first thousand are all distinct) costs little
            numbering = Numbering()
            vid = np.empty(n, dtype=np.int64)
            vid[:head] = np.fromiter(map(numbering.__getitem__, map(ident, instrs[:head])), dtype=np.int64,
                                     count=head)
            if len(numbering) * 4 <= head:  # reused: number the rest the same way
                vid[head:] = np.fromiter(map(numbering.__getitem__, map(ident, instrs[head:])), dtype=np.int64,
                                         count=n - head)
                ids, cycles = self._cycles_by_geometry([instrs[j] for j in first_uses(vid).tolist()], transpose)
                return ids[vid], cycles
        return self._cycles_by_geometry(instrs, transpose)

    def _cycles_by_geometry(self, instrs: Sequence[MatMul | Transpose], transpose: bool
                            ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        if transpose:
            key = self.KEY_TRANSPOSE
        elif any(map(operator.attrgetter("double_row"), instrs)):
            key = self.KEY_MATMUL
        else:
            key = self.KEY_MATMUL_SINGLE_ROW
        numbering = Numbering()
        ids = np.fromiter(map(numbering.__getitem__, map(key, instrs)), dtype=np.int64, count=len(instrs))
        return ids, [self.shape_cycles(instrs[j]) for j in first_uses(ids).tolist()]  # an instruction of each geometry

    def utilisation_limit(self, t_start: int) -> float:
        tc = self.config.core.tensor
        if tc.throttle_initial_util >= 1.0:
            return 1.0
        if self.ramp_start is None or t_start - self.last_mm_end >= self.idle_reset_ticks:
            self.ramp_start = t_start
        if self.ramp_ticks == 0:
            return 1.0
        frac = (t_start - self.ramp_start) / self.ramp_ticks
        return min(1.0, tc.throttle_initial_util + (1.0 - tc.throttle_initial_util) * frac)

    def plan(self, ins: Instruction, t_dep: int, t_first: int) -> tuple[int, int, int, list[Segment]]:
        if not isinstance(ins, (MatMul, Transpose)):
            return super().plan(ins, t_dep, t_first)
        t = self.config.core.tensor
        tpc = self.tpc
        ls_cycles, mm_cycles = self.cached_cycles(ins)
        segs: list[Segment] = []
        if ls_cycles:
            gate = self.last_mm_start if t.overlap_load_stationary else self.last_mm_ready
            ls_start = max(t_first, self.ls_free, gate)
            ls_end = ls_start + ls_cycles * tpc
            self.ls_free = ls_end
            segs.append((LS_LANE, "LoadStationary", ls_start, ls_end, ins.index))
        else:
            ls_start = ls_end = t_dep
        mm_start = max(ls_end, self.free, t_dep)
        util = self.utilisation_limit(mm_start)
        mm_ticks = mm_cycles * tpc if util >= 1.0 else math.ceil(mm_cycles * tpc / util)
        mm_end = mm_start + mm_ticks
        ready = mm_end + self.drain_cycles * tpc
        self.free = mm_end
        self.last_mm_start = mm_start
        self.last_mm_ready = ready
        self.last_mm_end = mm_end
        label = "Transpose" if isinstance(ins, Transpose) else "MultiplyMoving"
        segs.append((self.name, label, mm_start, mm_end, ins.index))
        return (ls_start if ls_cycles else mm_start), mm_end, ready, segs

    # ---- numbers ---------------------------------------------------------------------------
    def exec_MatMul(self, ins: MatMul, mem: Any) -> None:
        st = mem.view(ins.stationary)
        mv = mem.view(ins.moving)
        if ins.double_row:
            st = st.reshape(st.shape[0] * 2, st.shape[2])
            mv = mv.reshape(mv.shape[0] * 2, mv.shape[2])
        else:
            st = st.reshape(st.shape[0], -1)
            mv = mv.reshape(mv.shape[0], -1)
        k = st.shape[0]
        dst = mem.view(ins.dst)
        if ins.dst.dtype.name == "float32":
            out = dst.reshape(dst.shape[0], -1)
            if np.shares_memory(out, dst):
                native_matmul(st, mv, out=out, accumulate=ins.accumulate, k_chunk=k)
                return
            tmp = np.array(out)
            native_matmul(st, mv, out=tmp, accumulate=ins.accumulate, k_chunk=k)
            dst[...] = tmp.reshape(dst.shape)
            return
        # bf16 PSUM (NC-v4): upcast, add, downcast with round-to-nearest-even
        res = native_matmul(st, mv, k_chunk=k)
        if ins.accumulate:
            res = (dst.reshape(res.shape).astype(np.float32) + res).astype(np.float32)
        dst[...] = convert(res, ins.dst.dtype.name).reshape(dst.shape)

    def exec_MatMulMx(self, ins: MatMulMx, mem: Any) -> None:
        st = mx_dequantize(mem.view(ins.stationary), ins.stationary.dtype.name, mem.view(ins.stationary_scale))
        mv = mx_dequantize(mem.view(ins.moving), ins.moving.dtype.name, mem.view(ins.moving_scale))
        k = st.shape[0]
        dst = mem.view(ins.dst)
        res = native_matmul(st, mv, k_chunk=k)  # one instruction: K = 4 x partitions, fp32 in a fixed order
        if ins.accumulate:
            res = (dst.reshape(res.shape).astype(np.float32) + res).astype(np.float32)
        dst[...] = (res if ins.dst.dtype.name == "float32" else convert(res, ins.dst.dtype.name)).reshape(dst.shape)

    def exec_Transpose(self, ins: Transpose, mem: Any) -> None:
        data = mem.view(ins.data).reshape(ins.data.p_count, -1)
        dst = mem.view(ins.dst)
        vals = data.T
        if ins.dst.dtype != ins.data.dtype:
            vals = to_dtype(vals.astype(np.float32), ins.dst.dtype)
        dst[...] = vals.reshape(dst.shape)


def mx_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The four values packed in each element of an MX x4 array [P, F]: float32 [P, F, 4], value
    j (at the element's byte or nibble j) being K group j."""
    import ml_dtypes

    raw = np.ascontiguousarray(raw)
    if dtype == "float4_e2m1fn_x4":
        nib = np.stack([(raw >> (4 * j)) & 0xF for j in range(4)], axis=-1).astype(np.uint8)
        return nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    fp8 = ml_dtypes.float8_e5m2 if dtype == "float8_e5m2_x4" else ml_dtypes.float8_e4m3fn
    return raw.view(np.uint8).reshape(raw.shape + (4,)).view(fp8).astype(np.float32)


def mx_dequantize(raw: np.ndarray, dtype: str, scales: np.ndarray) -> np.ndarray:
    """[4P, F] float32 of an MX operand: value (p, f, j) is K row ``j*P + p``, times the E8M0
    scale ``2**(s - 127)`` of its 32-value group (8 partitions x 4), stored at partition
    ``32*(p//32) + (p%32)//8`` of the scale tile (datasheet §4.2). Exact in fp32 unless the
    scaled value under- or overflows fp32."""
    vals = mx_values(raw.reshape(raw.shape[0], -1), dtype)
    p, f = vals.shape[:2]
    rows = 32 * (np.arange(p) // 32) + (np.arange(p) % 32) // 8
    s = np.asarray(scales).reshape(scales.shape[0], -1)[rows].astype(np.int32)
    mult = np.where(s == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), s - 127).astype(np.float32))
    deq = (vals * mult[:, :, None]).astype(np.float32)
    return np.ascontiguousarray(np.transpose(deq, (2, 0, 1)).reshape(4 * p, f))
