"""Vector, Scalar and GpSimd instructions of :class:`~trnsim.builder.kernel.Kernel` (the core set
and the nki.isa instructions beyond it, DMA transposes and MX matmuls among them), each with its
argument checks (a mixin: ``Kernel`` is these methods and the others)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..isa import (AP, Activation, AffineSelect, CopyPredicated, DmaTranspose, Dropout, MatMulMx, RangeSelect,
                   Reciprocal, Max8, FindIndex8, ScalarTensorTensor, TensorTensorScan, HbmAP, HbmTensor, Iota,
                   KernelError, Memset,
                   TensorCopy, TensorReduce, TensorScalar, TensorTensor, TileAP, activation_fn, alu_op, reduce_op)
from ..memory.dma import plan_transpose
from ..memory.psum import check_matmul_dst
from .geometry import arg_key, geometry
from .rules import (FP32_MIN, MX_DTYPES, arith_op, check_alignment, check_per_partition, check_same_shape, checked_int,
                    checked_number, core_generation, engine_name, reduce_op_checked)

_ACT, _TT, _TS, _TR, _TC, _STT = range(6)  # which op a Kernel._op_ok key is of


class EngineOps:
    """The Vector/Scalar/GpSimd (and nki.isa extension) methods of :class:`Kernel`."""

    # ---- Vector / Scalar / GpSimd ----------------------------------------------------------
    def activation(self, dst: TileAP, op: Any, data: TileAP, *, bias: TileAP | float | None = None,
                   scale: TileAP | float = 1.0, reduce_op: Any = None, reduce_res: TileAP | None = None) -> Activation:
        """ScalarE ``dst = op(data * scale + bias)``; with ``reduce_op`` ('add'/'max') also writes
        the per-partition reduction of the result to ``reduce_res`` [P, 1]."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op (nl.exp too)
        if type(on) is str and type(dst) is TileAP and type(data) is TileAP and \
                (reduce_op is None or type(reduce_op) is str) and (reduce_res is None or type(reduce_res) is TileAP):
            key = (_ACT, on, dst._geo or geometry(dst), data._geo or geometry(data), arg_key(bias),
                   arg_key(scale), reduce_op, None if reduce_res is None else arg_key(reduce_res))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_activation(dst, op, data, bias, scale, reduce_op, reduce_res)
            return self._emit_op(Activation(dst, data, done[0], scale, 0.0 if bias is None else bias, done[1],  # type: ignore[return-value]
                                            reduce_res))
        func, rop = self._check_activation(dst, op, data, bias, scale, reduce_op, reduce_res)
        ins = Activation(dst, data, func, scale, 0.0 if bias is None else bias, rop, reduce_res)
        return self._emit(ins)  # type: ignore[return-value]

    def _check_activation(self, dst: TileAP, op: Any, data: TileAP, bias: Any, scale: Any, reduce_op: Any,
                          reduce_res: Any) -> tuple[str, str | None]:
        """:meth:`activation`'s checks; returns (function name, reduce op or None)."""
        what = f"activation({getattr(op, '__name__', op)})"
        func = activation_fn(op)
        aps = [dst, data] + [x for x in (bias, scale, reduce_res) if isinstance(x, TileAP)]
        self._check_compute(what, "Scalar", aps)
        check_same_shape(what, dst, data)
        for nm, x in (("bias", bias), ("scale", scale)):
            if isinstance(x, TileAP):
                check_per_partition(what, nm, x, data)
            elif x is not None and not isinstance(x, (int, float)):
                raise KernelError(f"{what}: {nm} must be a number or a [P, 1] tile, got {type(x).__name__}")
        rop = None
        if reduce_op is not None or reduce_res is not None:
            if reduce_op is None or reduce_res is None:
                raise KernelError(f"{what}: reduce_op and reduce_res go together")
            rop = reduce_op_checked(reduce_op, ("add", "max", "min"), what)
            check_per_partition(what, "reduce_res", reduce_res, data)
        return func, rop

    def tensor_tensor(self, dst: TileAP, data1: TileAP, data2: TileAP, op: Any, *, engine: str = "vector") -> TensorTensor:
        """Elementwise ``dst = data1 op data2`` (shapes equal; use ``broadcast_to`` to broadcast)."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op
        if type(on) is str and type(engine) is str and type(dst) is TileAP and type(data1) is TileAP and \
                type(data2) is TileAP:
            key = (_TT, engine, on, dst._geo or geometry(dst), data1._geo or geometry(data1),
                   data2._geo or geometry(data2))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_tensor_tensor(dst, data1, data2, op, engine)
            return self._emit_op(TensorTensor(done[0], dst, data1, data2, done[1]))  # type: ignore[return-value]
        done = self._check_tensor_tensor(dst, data1, data2, op, engine)
        return self._emit(TensorTensor(done[0], dst, data1, data2, done[1]))  # type: ignore[return-value]

    def _check_tensor_tensor(self, dst: TileAP, data1: TileAP, data2: TileAP, op: Any, engine: Any) -> tuple[str, str]:
        """:meth:`tensor_tensor`'s checks; returns (engine, op name)."""
        what = f"tensor_tensor({getattr(op, '__name__', op)})"
        eng = engine_name(engine, TensorTensor, what)
        opn = alu_op(op)
        self._check_compute(what, eng, (dst, data1, data2))
        check_same_shape(what, dst, data1)
        check_same_shape(what, dst, data2)
        return eng, opn

    def tensor_scalar(self, dst: TileAP, data: TileAP, op0: Any, operand0: TileAP | float, *, op1: Any = None,
                      operand1: TileAP | float | None = None, reverse0: bool = False, reverse1: bool = False,
                      engine: str = "vector") -> TensorScalar:
        """``dst = (data op0 operand0) op1 operand1`` with immediate or per-partition operands."""
        # what the checks read of the ops: their names (nl.add too)
        o0n = op0 if type(op0) is str else getattr(op0, "__name__", None)
        o1n = op1 if op1 is None or type(op1) is str else getattr(op1, "__name__", None)
        if type(o0n) is str and (op1 is None or type(o1n) is str) and type(engine) is str and \
                type(dst) is TileAP and type(data) is TileAP:
            key = (_TS, engine, o0n, o1n, dst._geo or geometry(dst), data._geo or geometry(data),
                   arg_key(operand0), arg_key(operand1))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_tensor_scalar(dst, data, op0, operand0, op1, operand1, engine)
            ins = TensorScalar(done[0], dst, data, done[1], operand0, done[2], operand1, reverse0, reverse1)
            return self._emit_op(ins)  # type: ignore[return-value]
        done = self._check_tensor_scalar(dst, data, op0, operand0, op1, operand1, engine)
        ins = TensorScalar(done[0], dst, data, done[1], operand0, done[2], operand1, reverse0, reverse1)
        return self._emit(ins)  # type: ignore[return-value]

    def _check_tensor_scalar(self, dst: TileAP, data: TileAP, op0: Any, operand0: Any, op1: Any, operand1: Any,
                             engine: Any) -> tuple[str, str, str | None]:
        """:meth:`tensor_scalar`'s checks; returns (engine, op0 name, op1 name or None)."""
        what = f"tensor_scalar({getattr(op0, '__name__', op0)})"
        eng = engine_name(engine, TensorScalar, what)
        o0 = alu_op(op0)
        o1 = alu_op(op1) if op1 is not None else None
        if (op1 is None) != (operand1 is None):
            raise KernelError(f"{what}: op1 and operand1 go together")
        aps = [dst, data] + [x for x in (operand0, operand1) if isinstance(x, TileAP)]
        self._check_compute(what, eng, aps)
        check_same_shape(what, dst, data)
        for nm, x in (("operand0", operand0), ("operand1", operand1)):
            if isinstance(x, TileAP):
                check_per_partition(what, nm, x, data)
            elif x is not None and not isinstance(x, (int, float)):
                raise KernelError(f"{what}: {nm} must be a number or a [P, 1] tile, got {type(x).__name__}")
        return eng, o0, o1

    def tensor_reduce(self, dst: TileAP, op: Any, data: TileAP, axis: int | Sequence[int], *, negate: bool = False,
                      engine: str = "vector") -> TensorReduce:
        """Reduce free axes ``axis`` (1 = the first free axis, as in NKI) of ``data`` into ``dst``."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op
        if type(on) is str and type(engine) is str and type(dst) is TileAP and type(data) is TileAP and \
                (type(axis) is int or (type(axis) is tuple and all(type(a) is int for a in axis))):
            key = (_TR, engine, on, axis, dst._geo or geometry(dst), data._geo or geometry(data))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_tensor_reduce(dst, op, data, axis, engine)
            return self._emit_op(TensorReduce(done[0], dst, data, done[1], done[2], negate))  # type: ignore[return-value]
        done = self._check_tensor_reduce(dst, op, data, axis, engine)
        return self._emit(TensorReduce(done[0], dst, data, done[1], done[2], negate))  # type: ignore[return-value]

    def _check_tensor_reduce(self, dst: TileAP, op: Any, data: TileAP, axis: Any, engine: Any
                             ) -> tuple[str, str, tuple[int, ...]]:
        """:meth:`tensor_reduce`'s checks; returns (engine, op name, sorted axes)."""
        what = f"tensor_reduce({getattr(op, '__name__', op)})"
        eng = engine_name(engine, TensorReduce, what)
        opn = reduce_op_checked(op, ("add", "max", "min", "multiply"), what)
        axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis) if hasattr(axis, "__iter__") else (axis,)
        axes = tuple(checked_int(a, f"{what}: axis") for a in axes)
        if len(set(axes)) != len(axes):
            raise KernelError(f"{what}: axis {axes} names an axis twice")
        self._check_compute(what, eng, (data,))
        nfree = len(data.dims)
        for a in axes:
            if not 1 <= a <= nfree:
                raise KernelError(f"{what}: axis {a} is not a free axis of '{data.name}' (1..{nfree}); "
                                  f"cross-partition reductions need nc_matmul with a ones vector")
        self._check_compute(what, eng, (dst, data))
        kept = 1
        for i, (_, n) in enumerate(data.dims, start=1):
            if i not in axes:
                kept *= n
        if dst.p_count != data.p_count or dst.free_size != kept:
            raise KernelError(f"{what}: dst '{dst.name}' has shape {dst.shape}; reducing axes {axes} of "
                              f"{data.shape} leaves [{data.p_count}, {kept}]")
        return eng, opn, tuple(sorted(axes))

    def tensor_copy(self, dst: TileAP, src: TileAP, *, engine: str = "vector") -> TensorCopy:
        """``dst = src`` with a cast (RNE). The usual PSUM evacuation."""
        if type(engine) is str and type(dst) is TileAP and type(src) is TileAP:
            key = (_TC, engine, dst._geo or geometry(dst), src._geo or geometry(src))
            eng = self._op_ok.get(key)
            if eng is None:
                eng = self._op_ok[key] = self._check_tensor_copy(dst, src, engine)
            return self._emit_op(TensorCopy(eng, dst, src))  # type: ignore[return-value]
        eng = self._check_tensor_copy(dst, src, engine)
        return self._emit(TensorCopy(eng, dst, src))  # type: ignore[return-value]

    def _check_tensor_copy(self, dst: TileAP, src: TileAP, engine: Any) -> str:
        """:meth:`tensor_copy`'s checks; returns the engine."""
        what = "tensor_copy"
        eng = engine_name(engine, TensorCopy, what)
        self._check_compute(what, eng, (dst, src))
        check_same_shape(what, dst, src)
        return eng

    def memset(self, dst: TileAP, value: float, *, engine: str = "vector") -> Memset:
        what = "memset"
        eng = engine_name(engine, Memset, what)
        self._check_compute(what, eng, (dst,))
        return self._emit(Memset(eng, dst, checked_number(value, "memset: value")))  # type: ignore[return-value]

    def iota(self, dst: TileAP, *, base: int = 0, channel_multiplier: int = 0,
             pattern: Sequence[int] | None = None) -> Iota:
        """GpSimd: ``dst[p, i...] = base + channel_multiplier*p + sum(pattern[k] * i_k)``."""
        what = "iota"
        self._check_compute(what, "GpSimd", (dst,))
        pat = tuple(checked_int(x, f"{what}: pattern") for x in (pattern if pattern is not None else [1] * len(dst.dims)))
        if len(pat) != len(dst.dims):
            raise KernelError(f"{what}: pattern has {len(pat)} strides but dst has {len(dst.dims)} free dims")
        return self._emit(Iota(dst, checked_int(base, f"{what}: base"),
                               checked_int(channel_multiplier, f"{what}: channel_multiplier"), pat))  # type: ignore[return-value]

    def affine_select(self, dst: TileAP, data: TileAP, *, cmp: str = "greater_equal", offset: int = 0,
                      channel_multiplier: int = 0, pattern: Sequence[int] | None = None,
                      on_false: float = 0.0) -> AffineSelect:
        """GpSimd: keep ``data`` where ``offset + channel_multiplier*p + sum(pattern*i) cmp 0``,
        else write ``on_false`` (e.g. -inf above the diagonal for causal attention)."""
        what = "affine_select"
        c = alu_op(cmp)
        if c not in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"):
            raise KernelError(f"{what}: cmp must be a comparison, got {cmp!r}")
        self._check_compute(what, "GpSimd", (dst, data))
        check_same_shape(what, dst, data)
        pat = tuple(checked_int(x, f"{what}: pattern") for x in (pattern if pattern is not None else [1] * len(data.dims)))
        if len(pat) != len(data.dims):
            raise KernelError(f"{what}: pattern has {len(pat)} strides but data has {len(data.dims)} free dims")
        ins = AffineSelect(dst, data, c, checked_int(offset, f"{what}: offset"),
                           checked_int(channel_multiplier, f"{what}: channel_multiplier"), pat,
                           checked_number(on_false, f"{what}: on_false"))
        return self._emit(ins)  # type: ignore[return-value]

    # ---- nki.isa instructions beyond the core set (datasheet §7 costs; VectorE unless noted) ----
    def tensor_tensor_scan(self, dst: TileAP, data0: TileAP, data1: TileAP, initial: TileAP | float, op0: Any,
                           op1: Any, *, reverse0: bool = False, reverse1: bool = False) -> TensorTensorScan:
        """``dst[:, i] = op1(op0(data0[:, i], dst[:, i-1]), data1[:, i])`` along the free axis,
        ``dst[:, -1]`` being ``initial`` (an immediate or a [P, 1] tile)."""
        what = "tensor_tensor_scan"
        o0, o1 = arith_op(op0, what), arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data0, data1] + ([initial] if isinstance(initial, TileAP) else []))
        check_same_shape(what, dst, data0)
        check_same_shape(what, dst, data1)
        if data0.space == data1.space == "psum":
            raise KernelError(f"{what}: data0 and data1 cannot both be in PSUM")
        init = self._scalar_or_column(what, "initial", initial, data0)
        return self._emit(TensorTensorScan(dst, data0, data1, init, o0, o1, bool(reverse0), bool(reverse1)))  # type: ignore[return-value]

    def scalar_tensor_tensor(self, dst: TileAP, data: TileAP, op0: Any, operand0: TileAP | float, op1: Any,
                             operand1: TileAP, *, reverse0: bool = False, reverse1: bool = False) -> ScalarTensorTensor:
        """``dst = (data op0 operand0) op1 operand1``: ``operand0`` an immediate or [P, 1] tile,
        ``operand1`` shaped like ``data``."""
        # what the checks read of the ops: their names (nl.add too); of operand0, a [P, 1] tile's
        # geometry or a number's type (a depthwise convolution emits this op for every tap)
        o0n = op0 if type(op0) is str else getattr(op0, "__name__", None)
        o1n = op1 if type(op1) is str else getattr(op1, "__name__", None)
        t0 = type(operand0)
        if type(o0n) is str and type(o1n) is str and type(dst) is TileAP and type(data) is TileAP and \
                type(operand1) is TileAP and (t0 is TileAP or t0 is float or t0 is int):
            key = (_STT, o0n, o1n, dst._geo or geometry(dst), data._geo or geometry(data), arg_key(operand0),
                   operand1._geo or geometry(operand1))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1)
            ins = ScalarTensorTensor(dst, data, done[0], operand0 if t0 is TileAP else float(operand0), done[1],
                                     operand1, bool(reverse0), bool(reverse1))
            return self._emit_op(ins)  # type: ignore[return-value]
        o0, o1 = self._check_scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1)
        op0v = self._scalar_or_column("scalar_tensor_tensor", "operand0", operand0, data)
        ins = ScalarTensorTensor(dst, data, o0, op0v, o1, operand1, bool(reverse0), bool(reverse1))
        return self._emit(ins)  # type: ignore[return-value]

    def _check_scalar_tensor_tensor(self, dst: TileAP, data: TileAP, op0: Any, operand0: Any, op1: Any,
                                    operand1: Any) -> tuple[str, str]:
        """:meth:`scalar_tensor_tensor`'s checks; returns (op0 name, op1 name)."""
        what = "scalar_tensor_tensor"
        o0, o1 = arith_op(op0, what), arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data, operand1] + ([operand0] if isinstance(operand0, TileAP) else []))
        check_same_shape(what, dst, data)
        check_same_shape(what, dst, operand1)
        if data.space == operand1.space == "psum":
            raise KernelError(f"{what}: data and operand1 cannot both be in PSUM")
        self._scalar_or_column(what, "operand0", operand0, data)
        return o0, o1

    def tensor_copy_predicated(self, dst: TileAP, src: TileAP | float, predicate: TileAP, *,
                               reverse_pred: bool = False) -> CopyPredicated:
        """``dst = src`` where ``predicate`` (an unsigned integer tile) is non-zero; elsewhere
        ``dst`` keeps its values. ``src`` is a tile of dst's dtype or an immediate."""
        what = "tensor_copy_predicated"
        self._check_compute(what, "Vector", [dst, predicate] + ([src] if isinstance(src, TileAP) else []))
        check_same_shape(what, dst, predicate)
        if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
            raise KernelError(f"{what}: predicate '{predicate.name}' is {predicate.dtype.short}; expected uint8, "
                              f"uint16 or uint32")
        if isinstance(src, TileAP):
            check_same_shape(what, dst, src)
            if src.dtype != dst.dtype:
                raise KernelError(f"{what}: src '{src.name}' is {src.dtype.short} but dst '{dst.name}' is "
                                  f"{dst.dtype.short}; they must share a dtype")
            if src.space == predicate.space == "psum":
                raise KernelError(f"{what}: src and predicate cannot both be in PSUM")
        else:
            src = checked_number(src, f"{what}: src")
        return self._emit(CopyPredicated(dst, src, predicate, bool(reverse_pred)))  # type: ignore[return-value]

    def range_select(self, dst: TileAP, data: TileAP, cmp0: Any, cmp1: Any, bound0: TileAP, bound1: TileAP, *,
                     range_start: int = 0, on_false: float = FP32_MIN, reduce_res: TileAP | None = None) -> RangeSelect:
        """Keep ``data[p, i]`` where ``range_start + i`` passes ``cmp0 bound0[p]`` and ``cmp1
        bound1[p]``, else ``on_false`` (FP32_MIN, the only value the hardware takes); with
        ``reduce_res`` [P, 1] also the row max of the result. NC-v3 and newer."""
        what = "range_select"
        if core_generation(self.config) < 3:
            raise KernelError(f"{what}: needs NeuronCore-v3 or newer, {self.config.name} is {self.config.core.version}")
        cmps = []
        for nm, c in (("cmp0", cmp0), ("cmp1", cmp1)):
            op = alu_op(c)
            if op not in ("equal", "less", "less_equal", "greater", "greater_equal"):
                raise KernelError(f"{what}: {nm} must be equal, less, less_equal, greater or greater_equal, got {c!r}")
            cmps.append(op)
        aps = [dst, data, bound0, bound1] + ([reduce_res] if reduce_res is not None else [])
        self._check_compute(what, "Vector", aps)
        check_same_shape(what, dst, data)
        if not data.dtype.is_float:
            raise KernelError(f"{what}: data '{data.name}' must be a float tile, got {data.dtype.short}")
        for nm, b in (("bound0", bound0), ("bound1", bound1)):
            check_per_partition(what, nm, b, data)
            if b.dtype.name != "float32":
                raise KernelError(f"{what}: {nm} '{b.name}' must be fp32, got {b.dtype.short}")
        if reduce_res is not None:
            check_per_partition(what, "reduce_res", reduce_res, data)
        if checked_number(on_false, f"{what}: on_false") != FP32_MIN:
            raise KernelError(f"{what}: on_false must be FP32_MIN (-3.4028235e+38), the only value the hardware "
                              f"takes, got {on_false!r}")
        start = checked_int(range_start, f"{what}: range_start", lo=0)
        ins = RangeSelect(dst, data, cmps[0], cmps[1], bound0, bound1, start, FP32_MIN, reduce_res)
        return self._emit(ins)  # type: ignore[return-value]

    def dropout(self, dst: TileAP, data: TileAP, prob: float, *, seed: int = 0, offset: int = 0,
                row_stride: int | None = None) -> Dropout:
        """``dst = data`` with each element zeroed with probability ``prob`` (VectorE,
        ``nisa.dropout``, ``max(MIN_II, N)`` cycles, datasheet §7); the kept values are not
        rescaled. Element (p, i) draws with counter ``offset + p * row_stride + i`` (default
        ``row_stride``: the tile's free size), see :class:`trnsim.isa.Dropout`."""
        what = "dropout"
        self._check_compute(what, "Vector", (dst, data))
        check_same_shape(what, dst, data)
        if not data.dtype.is_float or not dst.dtype.is_float:
            raise KernelError(f"{what}: data and dst must be float tiles, got {data.dtype.short} -> {dst.dtype.short}")
        p = checked_number(prob, f"{what}: prob")
        if not 0.0 <= p <= 1.0:
            raise KernelError(f"{what}: prob must be a probability in [0, 1], got {prob!r}")
        seed = checked_int(seed, f"{what}: seed", lo=0)
        offset = checked_int(offset, f"{what}: offset", lo=0)
        stride = data.free_size if row_stride is None else checked_int(row_stride, f"{what}: row_stride", lo=0)
        return self._emit(Dropout(dst, data, float(p), seed, offset, stride))  # type: ignore[return-value]

    def reciprocal(self, dst: TileAP, data: TileAP) -> Reciprocal:
        """``dst = 1 / data`` on VectorE (8 cycles an element; ScalarE's activation('reciprocal')
        is one)."""
        what = "reciprocal"
        self._check_compute(what, "Vector", (dst, data))
        check_same_shape(what, dst, data)
        return self._emit(Reciprocal(dst, data))  # type: ignore[return-value]

    def max8(self, dst: TileAP, data: TileAP) -> Max8:
        """``dst[p, 0:8]`` = the eight largest values of each partition of ``data``, largest
        first (VectorE, ``N`` cycles for ``N`` elements a partition, datasheet §7)."""
        what = "max8"
        self._check_compute(what, "Vector", (dst, data))
        if data.free_size < 8:
            raise KernelError(f"{what}: data '{data.name}' has {data.free_size} elements per partition; max8 needs "
                              f"at least 8")
        if dst.p_count != data.p_count or dst.free_size != 8:
            raise KernelError(f"{what}: dst '{dst.name}' must be [{data.p_count}, 8], got {dst.shape}")
        if not data.dtype.is_float or not dst.dtype.is_float:
            raise KernelError(f"{what}: data and dst must be float tiles, got {data.dtype.short} -> {dst.dtype.short}")
        return self._emit(Max8(dst, data))  # type: ignore[return-value]

    def nc_find_index8(self, dst: TileAP, data: TileAP, vals: TileAP) -> FindIndex8:
        """``dst[p, i]`` = the first index in ``data[p, :]`` of the value ``vals[p, i]``, for the
        eight ``vals`` of each partition (a value not there: 2^32 - 1); VectorE, ``N`` cycles
        (datasheet §7). With :meth:`max8`, the indices of a row's top eight."""
        what = "nc_find_index8"
        self._check_compute(what, "Vector", (dst, data, vals))
        for nm, t in (("vals", vals), ("dst", dst)):
            if t.p_count != data.p_count or t.free_size != 8:
                raise KernelError(f"{what}: {nm} '{t.name}' must be [{data.p_count}, 8], got {t.shape}")
        if dst.dtype.name not in ("uint32", "int32"):
            raise KernelError(f"{what}: dst '{dst.name}' must be uint32 or int32, got {dst.dtype.short}")
        if not data.dtype.is_float:
            raise KernelError(f"{what}: data '{data.name}' must be a float tile, got {data.dtype.short}")
        return self._emit(FindIndex8(dst, data, vals))  # type: ignore[return-value]

    def dma_transpose(self, dst: TileAP, src: AP | HbmTensor, *, engine: str = "sync", queue: int = 0) -> DmaTranspose:
        """``dst[P, K] = src[K, P]ᵀ`` by the DMA engines, from HBM or SBUF into SBUF (NC-v3+):
        2- or 4-byte dtypes, bit exact, at ``core.dma.transpose_rate_hbm`` (0.9 on Trn2) or
        ``transpose_rate_sbuf`` (0.5) of a copy's throughput."""
        what = "dma_transpose"
        src = src.full() if isinstance(src, HbmTensor) else src
        if not isinstance(dst, TileAP) or dst.space != "sbuf":
            raise KernelError(f"{what}: dst must be an SBUF tile, got {dst!r}")
        if not isinstance(src, (HbmAP, TileAP)) or src.space == "psum":
            raise KernelError(f"{what}: src must be an HBM view or an SBUF tile, got {src!r}")
        d = self.config.core.dma
        if (d.transpose_rate_hbm if isinstance(src, HbmAP) else d.transpose_rate_sbuf) <= 0:
            raise KernelError(f"{what}: {self.config.name} has no DMA transpose (core.dma.transpose_rate_"
                              f"{'hbm' if isinstance(src, HbmAP) else 'sbuf'} is 0; it needs NeuronCore-v3)")
        shape = tuple(n for n in src.shape if n != 1) if len(src.shape) > 2 else src.shape
        if len(shape) != 2 or dst.shape != (shape[1], shape[0]):
            raise KernelError(f"{what}: dst '{dst.name}' has shape {dst.shape}; transposing {src.shape} needs "
                              f"{tuple(reversed(shape)) if len(shape) == 2 else 'a 2-D source'}")
        if src.dtype != dst.dtype or dst.dtype.itemsize not in (2, 4):
            raise KernelError(f"{what}: src and dst must share a 2- or 4-byte dtype, got {src.dtype.short} -> "
                              f"{dst.dtype.short}")
        check_alignment(dst, what)
        eng = engine_name(engine, DmaTranspose, what)
        lane = self._dma_lane(eng, queue, what)
        ins = DmaTranspose(eng, dst, src, lane)
        ins.plan = plan_transpose(dst, src, self.config)
        return self._emit(ins, key=lane)  # type: ignore[return-value]

    def nc_matmul_mx(self, dst: TileAP, stationary: TileAP, moving: TileAP, stationary_scale: TileAP,
                     moving_scale: TileAP, *, accumulate: bool = False) -> MatMulMx:
        """MX matmul on NC-v4 (``core.tensor.mx_quad``): ``dst[M, N] (+)= st[K, M]ᵀ @ mv[K, N]`` with
        K = 4 x partitions of quad-packed MXFP8/MXFP4 data and uint8 E8M0 scales laid out as
        :class:`trnsim.isa.MatMulMx` says."""
        t = self.config.core.tensor
        what = "nc_matmul_mx"
        if not t.mx_quad:
            raise KernelError(f"{what}: {self.config.name} has no MX matmul (core.tensor.mx_quad is false; "
                              f"it needs NeuronCore-v4)")
        self._check_compute(what, "Tensor", (dst, stationary, moving, stationary_scale, moving_scale))
        for nm, ap in (("stationary", stationary), ("moving", moving)):
            if ap.space != "sbuf" or ap.dtype.name not in MX_DTYPES:
                raise KernelError(f"{what}: {nm} '{ap.name}' must be an SBUF tile of float8_e5m2_x4, "
                                  f"float8_e4m3fn_x4 or float4_e2m1fn_x4, got {ap.space.upper()} {ap.dtype.name}")
        k, m, n = stationary.p_count, stationary.free_size, moving.free_size
        if moving.p_count != k:
            raise KernelError(f"{what}: contraction mismatch: stationary has {k} partitions, moving {moving.p_count}")
        if k % 32 or k > t.max_contraction:
            raise KernelError(f"{what}: {k} partitions; MX operands take a multiple of 32 up to {t.max_contraction} "
                              f"(scales are laid out per 32-partition quadrant)")
        if m > t.stationary_max_free or n > 512:
            raise KernelError(f"{what}: stationary [{k}, {m}] x4 / moving [{k}, {n}] x4 exceed the MX tiles "
                              f"[128, {t.stationary_max_free}] / [128, 512]")
        for nm, sc, data in (("stationary_scale", stationary_scale, stationary), ("moving_scale", moving_scale, moving)):
            if sc.space != "sbuf" or sc.dtype.name != "uint8":
                raise KernelError(f"{what}: {nm} '{sc.name}' must be a uint8 SBUF tile")
            need = 32 * ((k - 1) // 32) + 4
            if sc.free_size != data.free_size or sc.p_count < need:
                raise KernelError(f"{what}: {nm} '{sc.name}' has shape {sc.shape}; expected at least [{need}, "
                                  f"{data.free_size}] (4 partitions of scales per 32-partition quadrant)")
        if dst.space != "psum" or dst.dtype.name not in ("float32", "bfloat16"):
            raise KernelError(f"{what}: dst '{dst.name}' must be an fp32 or bf16 PSUM tile")
        if dst.p_count != m or dst.free_size != n:
            raise KernelError(f"{what}: dst '{dst.name}' has shape {dst.shape}, expected [{m}, {n}]")
        check_matmul_dst(dst, self.config, what)
        ins = MatMulMx(dst, stationary, moving, stationary_scale, moving_scale, bool(accumulate))
        return self._emit(ins)  # type: ignore[return-value]

    def _scalar_or_column(self, what: str, name: str, x: Any, like: TileAP) -> TileAP | float:
        if isinstance(x, TileAP):
            check_per_partition(what, name, x, like)
            return x
        return checked_number(x, f"{what}: {name}")
