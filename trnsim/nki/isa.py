"""``nki.isa`` on trnsim: one builder instruction per call (:mod:`trnsim.kernel`).

Both spellings work: the current one, with the destination first (``nisa.tensor_copy(dst, src)``,
``nisa.nc_matmul(dst=acc, stationary=a, moving=b)``), and the legacy one (``neuronxcc.nki.isa``),
which returns the result (``t = nisa.tensor_copy(src)``); see :mod:`trnsim.nki._core` for how a
returned result finds its memory. ``engine=`` picks the engine where the instruction allows a
choice; otherwise each runs where the hardware runs it (TensorE matmuls and transposes, ScalarE
activations, VectorE for the rest, GpSimd iota/affine_select). ``mask=`` restricts an
instruction to a box of its index space.

What trnsim does not model fails with one line naming it (``nisa.local_gather is not supported
by trnsim.nki``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..isa import alu_op
from ._core import Affine, NkiError, NkiTensor, Predicate, current, nki_dtype
from ._core import provide
from ._core import unsupported as _unsupported
from .isa_base import (Instruction, dge_mode, engine, get_nc_version, gpsimd_engine,  # noqa: F401 - the API's names
                       matmul_perf_mode, nc_version, oob_mode, reduce_cmd, scalar_engine, tensor_engine,
                       unknown_engine, vector_engine)
from .isa_base import bind as _bind
from .isa_base import dtype_of as _dtype_of
from .isa_base import emit as _emit
from .isa_base import engine_of as _engine
from .isa_base import mask_box as _mask
from .isa_base import op_name as _op_name
from .isa_base import run as _run
from .isa_base import split_dst as _split
from .isa_base import spread as _spread
from .isa_base import tensor_arg as _tensor
from .isa_base import value_arg as _value
from .isa_base import view_ap as _ap

__all__ = [
    "engine", "dge_mode", "oob_mode", "reduce_cmd", "matmul_perf_mode", "nc_version", "get_nc_version",
    "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine",
    "nc_matmul", "nc_matmul_mx", "nc_transpose", "activation", "activation_reduce", "tensor_tensor",
    "tensor_scalar", "tensor_reduce", "tensor_copy", "memset", "iota", "affine_select", "dma_copy",
    "dma_transpose", "reciprocal", "tensor_tensor_scan", "scalar_tensor_tensor", "tensor_copy_predicated",
    "range_select", "max8", "nc_find_index8",
]


# ---------------------------------------------------------------------------------------------
# TensorE
# ---------------------------------------------------------------------------------------------


def nc_matmul(*args: Any, **kwargs: Any) -> Any:
    """``dst (+)= stationary.T @ moving`` on TensorE into PSUM (fp32, or bf16 on NC-v4).
    ``accumulate=None`` starts an accumulation group on a PSUM location's first matmul and
    adds to it afterwards; ``is_transpose=True`` is the PE transpose of ``stationary``."""
    what = "nisa.nc_matmul"
    dst, args = _split(args, kwargs, 2)
    p = _bind(what, args, kwargs, ["stationary", "moving"],
              {"is_stationary_onezero": False, "is_moving_onezero": False, "is_transpose": False,
               "accumulate": None, "tile_position": (), "tile_size": (), "perf_mode": None, "mask": None,
               "name": None, "dtype": None})
    if p["tile_position"] or p["tile_size"]:
        raise NkiError(f"{what}: tile_position/tile_size (PE array tiling) is not supported by trnsim.nki")
    st, mv = _tensor(p["stationary"], what, "stationary"), _tensor(p["moving"], what, "moving")
    box = _spread(_mask(p["mask"], what), [dst, st, mv])
    if p["is_transpose"]:
        return nc_transpose(*(() if dst is None else (dst,)), st, mask=p["mask"])
    double = len(st.shape) == 3 and st.shape[1] == 2
    m = st.shape[2] if double else int(np.prod(st.shape[1:]))
    n = mv.shape[2] if double else int(np.prod(mv.shape[1:]))

    def emit(d: NkiTensor, acc: bool) -> None:
        tr = current()
        _emit(lambda: tr.kernel.nc_matmul(_ap(d, box, what), _ap(st, box, what), _ap(mv, box, what), accumulate=acc))

    emit.accumulate = None if p["accumulate"] is None else bool(p["accumulate"])  # type: ignore[attr-defined]
    return _run(what, dst, (m, n), p["dtype"] or "float32", "psum", emit, box, matmul=True)


def nc_matmul_mx(*args: Any, **kwargs: Any) -> Any:
    """MX matmul (NC-v4): quad-packed MXFP8/MXFP4 ``stationary``/``moving`` with their uint8
    scales (:meth:`trnsim.kernel.Kernel.nc_matmul_mx`)."""
    what = "nisa.nc_matmul_mx"
    dst, args = _split(args, kwargs, 4)
    p = _bind(what, args, kwargs, ["stationary", "moving", "stationary_scale", "moving_scale"],
              {"tile_position": None, "tile_size": None, "accumulate": None, "name": None})
    if p["tile_position"] or p["tile_size"]:
        raise NkiError(f"{what}: tile_position/tile_size (PE array tiling) is not supported by trnsim.nki")
    ops = [_tensor(p[k], what, k) for k in ("stationary", "moving", "stationary_scale", "moving_scale")]

    def emit(d: NkiTensor, acc: bool) -> None:
        tr = current()
        _emit(lambda: tr.kernel.nc_matmul_mx(_ap(d, {}, what), *(_ap(o, {}, what) for o in ops), accumulate=acc))

    emit.accumulate = None if p["accumulate"] is None else bool(p["accumulate"])  # type: ignore[attr-defined]
    return _run(what, dst, (int(np.prod(ops[0].shape[1:])), int(np.prod(ops[1].shape[1:]))), "float32", "psum",
                emit, {}, matmul=True)


def nc_transpose(*args: Any, **kwargs: Any) -> Any:
    """``dst[F, P] = data[P, F]ᵀ`` on TensorE into PSUM (2-byte types stay 2-byte)."""
    what = "nisa.nc_transpose"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["data"], {"engine": None, "mask": None, "dtype": None, "name": None})
    eng = _engine(p["engine"], "tensor", what)
    if eng != "tensor":
        raise NkiError(f"{what}: engine={eng} (the VectorE 32x32 transpose) is not supported by trnsim.nki; "
                       f"use the tensor engine")
    x = _tensor(p["data"], what, "data")
    box = _spread(_mask(p["mask"], what), [dst, x])
    if len(x.shape) != 2:
        raise NkiError(f"{what}: data must be 2-D [P, F], got {x.shape}")
    dt = p["dtype"] or (x.dtype if nki_dtype(x.dtype).itemsize == 2 else "float32")

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.nc_transpose(_ap(d, dbox, what), _ap(x, box, what)))

    return _run(what, dst, (x.shape[1], x.shape[0]), dt, "psum", emit, box)


# ---------------------------------------------------------------------------------------------
# ScalarE / VectorE / GpSimd
# ---------------------------------------------------------------------------------------------


def activation(*args: Any, **kwargs: Any) -> Any:
    """ScalarE ``dst = op(data * scale + bias)``, optionally reducing along the free axis into
    ``reduce_res``."""
    what = "nisa.activation"
    dst, args = _split(args, kwargs, 0)
    p = _bind(what, args, kwargs, ["op", "data"],
              {"bias": None, "scale": 1.0, "reduce_op": None, "reduce_res": None, "reduce_cmd": None,
               "dtype": None, "mask": None, "name": None})
    return _activation(what, dst, p)


def activation_reduce(*args: Any, **kwargs: Any) -> Any:
    """:func:`activation` with its free-axis reduction (``reduce_op`` into ``reduce_res``)."""
    what = "nisa.activation_reduce"
    dst, args = _split(args, kwargs, 0)
    p = _bind(what, args, kwargs, ["op", "data", "reduce_op", "reduce_res"],
              {"bias": None, "scale": 1.0, "dtype": None, "mask": None, "name": None})
    p["reduce_cmd"] = None
    return _activation(what, dst, p)


def refuse_integer_result(op: str, x: NkiTensor, dtype: Any, what: str) -> None:
    """An activation whose values are fractions (exp, log, sigmoid, ...) of an integer tile, with
    no dtype given: NKI's default result dtype is the input's, so the fp32 values ScalarE
    computes would come back rounded and saturated to integers without a word; refused, naming
    the dtype to ask for. Whether ``op`` keeps integers integral is read from its own definition
    (the ISA's activation table), not listed again here."""
    import numpy as np

    from ..isa import ACTIVATIONS

    dt = nki_dtype(x.dtype, what)
    if dtype is not None or dt.is_float or op not in ACTIVATIONS:
        return
    probe = np.array([-3.0, -1.0, 0.0, 1.0, 2.0, 3.0, 7.0])
    with np.errstate(all="ignore"):
        values = ACTIVATIONS[op][0](probe)
    if np.all(np.isfinite(values)) and np.array_equal(values, np.round(values)):
        return  # relu, abs, square, sign, identity: integers stay integers
    raise NkiError(f"{what}: {op} of an {dt.short} tile would give {dt.short} results (NKI's default dtype is the "
                   f"input's), the fp32 values rounded and saturated to integers; pass dtype=nl.float32 for the "
                   f"values, or dtype=nl.{dt.np_dtype.name} to keep integers")


def _activation(what: str, dst: NkiTensor | None, p: dict[str, Any]) -> Any:
    if p["reduce_cmd"] not in (None, reduce_cmd.idle, reduce_cmd.reset_reduce):
        raise NkiError(f"{what}: reduce_cmd={p['reduce_cmd']} (accumulating across instructions) is not supported "
                       f"by trnsim.nki")
    x = _tensor(p["data"], what, "data")
    bias = None if p["bias"] is None else _value(p["bias"], what, "bias")
    scale = _value(p["scale"], what, "scale")
    red = None if p["reduce_res"] is None else _tensor(p["reduce_res"], what, "reduce_res")
    rop = None if p["reduce_op"] is None else _op_name(p["reduce_op"])
    if (rop is None) != (red is None):
        raise NkiError(f"{what}: reduce_op and reduce_res go together")
    box = _spread(_mask(p["mask"], what), [dst, x, bias, scale, red])
    op = _op_name(p["op"])
    if dst is None:
        refuse_integer_result(op, x, p["dtype"], what)

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.activation(_ap(d, dbox, what), op, _ap(x, box, what), bias=_ap(bias, box, what),
                                           scale=_ap(scale, box, what), reduce_op=rop,
                                           reduce_res=_ap(red, box, what)))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def tensor_tensor(*args: Any, **kwargs: Any) -> Any:
    """Elementwise ``dst = data1 op data2`` (VectorE, or GpSimd)."""
    what = "nisa.tensor_tensor"
    dst, args = _split(args, kwargs, 2)
    p = _bind(what, args, kwargs, ["data1", "data2", "op"], {"engine": None, "dtype": None, "mask": None, "name": None})
    a, b = _tensor(p["data1"], what, "data1"), _tensor(p["data2"], what, "data2")
    eng = _engine(p["engine"], "vector", what)
    box = _spread(_mask(p["mask"], what), [dst, a, b])
    op = _op_name(p["op"])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_tensor(_ap(d, dbox, what), _ap(a, box, what), _ap(b, box, what), op, engine=eng))

    return _run(what, dst, a.shape, _dtype_of(a, p["dtype"], what), "sbuf", emit, box, ref=a)


def tensor_scalar(*args: Any, **kwargs: Any) -> Any:
    """``dst = (data op0 operand0) op1 operand1`` with immediate or [P, 1] operands (VectorE,
    ScalarE or GpSimd)."""
    what = "nisa.tensor_scalar"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["data", "op0", "operand0"],
              {"reverse0": False, "op1": None, "operand1": None, "reverse1": False, "engine": None, "dtype": None,
               "mask": None, "name": None})
    x = _tensor(p["data"], what, "data")
    o0 = _value(p["operand0"], what, "operand0")
    o1 = None if p["operand1"] is None else _value(p["operand1"], what, "operand1")
    eng = _engine(p["engine"], "vector", what)
    box = _spread(_mask(p["mask"], what), [dst, x, o0, o1])
    op0 = _op_name(p["op0"])
    op1 = None if p["op1"] is None else _op_name(p["op1"])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_scalar(_ap(d, dbox, what), _ap(x, box, what), op0, _ap(o0, box, what), op1=op1,
                                              operand1=_ap(o1, box, what), reverse0=bool(p["reverse0"]),
                                              reverse1=bool(p["reverse1"]), engine=eng))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def tensor_reduce(*args: Any, **kwargs: Any) -> Any:
    """Reduce free ``axis`` (1 = the first free dim) of ``data`` with ``op`` (VectorE)."""
    what = "nisa.tensor_reduce"
    dst, args = _split(args, kwargs, 0)
    p = _bind(what, args, kwargs, ["op", "data", "axis"],
              {"negate": False, "keepdims": False, "dtype": None, "mask": None, "name": None, "engine": None})
    x = _tensor(p["data"], what, "data")
    axes = p["axis"] if isinstance(p["axis"], (tuple, list)) else (p["axis"],)
    nd = len(x.shape)
    axes = tuple(int(a) % nd if isinstance(a, (int, np.integer)) and a < 0 else a for a in axes)
    for a in axes:
        if not isinstance(a, (int, np.integer)) or not 1 <= a < nd:
            raise NkiError(f"{what}: axis {a!r} is not a free dim of a {nd}-D tile (1..{nd - 1}); reducing "
                           f"across partitions needs nc_matmul with a ones vector")
    shape = [n if i not in axes else 1 for i, n in enumerate(x.shape)]
    if not p["keepdims"]:
        shape = [n for i, n in enumerate(shape) if i not in axes]
        if len(shape) < 2:
            shape.append(1)
    box = _spread(_mask(p["mask"], what), [dst, x])
    op = _op_name(p["op"])
    eng = _engine(p["engine"], "vector", what)

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_reduce(_ap(d, dbox, what), op, _ap(x, box, what), tuple(int(a) for a in axes),
                                              negate=bool(p["negate"]), engine=eng))

    return _run(what, dst, tuple(shape), _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def tensor_copy(*args: Any, **kwargs: Any) -> Any:
    """``dst = src`` with a cast (VectorE by default; ScalarE or GpSimd with ``engine=``)."""
    what = "nisa.tensor_copy"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["src"], {"engine": None, "dtype": None, "mask": None, "name": None})
    x = _tensor(p["src"], what, "src")
    eng = _engine(p["engine"], "vector", what)
    box = _spread(_mask(p["mask"], what), [dst, x])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_copy(_ap(d, dbox, what), _ap(x, box, what), engine=eng))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def memset(*args: Any, **kwargs: Any) -> Any:
    """Fill ``dst`` with ``value``; legacy form ``memset(shape, value, dtype)`` returns a tile."""
    what = "nisa.memset"
    if "dst" in kwargs or (args and isinstance(args[0], NkiTensor)):
        dst, args = _split(args, kwargs, 0)
        p = _bind(what, args, kwargs, ["value"], {"engine": None, "mask": None, "name": None})
        shape, dtype = dst.shape, dst.dtype  # type: ignore[union-attr]
    else:
        dst = None
        p = _bind(what, args, kwargs, ["shape", "value", "dtype"], {"engine": None, "mask": None, "name": None,
                                                                    "buffer": None})
        shape, dtype = tuple(p["shape"]), p["dtype"]
    value = float(_value(p["value"], what, "value"))  # type: ignore[arg-type]
    eng = _engine(p["engine"], "vector", what)
    box = _spread(_mask(p["mask"], what), [dst])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.memset(_ap(d, dbox, what), value, engine=eng))

    return _run(what, dst, shape, dtype, "sbuf", emit, box)


def iota(*args: Any, **kwargs: Any) -> Any:
    """GpSimd: an integer ramp. Current form ``iota(dst, pattern=[[step, num], ...], offset,
    channel_multiplier)``; legacy form ``iota(expr, dtype)`` with an index expression such as
    ``nl.arange(128)[:, None] * 512 + nl.arange(512)[None, :]``."""
    what = "nisa.iota"
    if "dst" in kwargs or (args and isinstance(args[0], NkiTensor)):
        dst, args = _split(args, kwargs, 0)
        p = _bind(what, args, kwargs, ["pattern"], {"offset": 0, "channel_multiplier": 0, "name": None, "mask": None})
        pattern = [int(s) for s, _ in p["pattern"]]
        base, cm = int(p["offset"]), int(p["channel_multiplier"])
        shape, dtype = dst.shape, dst.dtype  # type: ignore[union-attr]
    else:
        dst = None
        p = _bind(what, args, kwargs, ["expr", "dtype"], {"mask": None, "name": None})
        e = p["expr"]
        if not isinstance(e, Affine):
            raise NkiError(f"{what}: expr must be an index expression of nl.arange/nl.mgrid, got {type(e).__name__}")
        its = sorted(e.iters(), key=lambda it: it.pos if it.pos is not None else 0)
        if not its or its[0].pos not in (0, None):
            raise NkiError(f"{what}: expr must vary along the partition axis first ([:, None])")
        cm, pattern, base = e.coef(its[0]), [e.coef(it) for it in its[1:]] or [0], e.const
        shape, dtype = tuple(it.size for it in its) + (() if len(its) > 1 else (1,)), p["dtype"]
    box = _spread(_mask(p["mask"], what), [dst])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.iota(_ap(d, dbox, what), base=base, channel_multiplier=cm, pattern=pattern))

    return _run(what, dst, shape, dtype, "sbuf", emit, box)


def affine_select(*args: Any, **kwargs: Any) -> Any:
    """GpSimd: ``on_true_tile`` where an affine condition on (partition, free indices) holds, else
    ``on_false_value``. Current form ``affine_select(dst, pattern, channel_multiplier,
    on_true_tile, on_false_value, cmp_op, offset)``; legacy form ``affine_select(pred,
    on_true_tile, on_false_value)`` with ``pred`` like ``(i_q - i_k >= 0)``."""
    what = "nisa.affine_select"
    if "dst" in kwargs or (args and isinstance(args[0], NkiTensor)):
        dst, args = _split(args, kwargs, 0)
        p = _bind(what, args, kwargs, ["pattern", "channel_multiplier", "on_true_tile", "on_false_value"],
                  {"cmp_op": "equal", "offset": 0, "name": None, "mask": None})
        data = _tensor(p["on_true_tile"], what, "on_true_tile")
        pattern = [int(s) for s, _ in p["pattern"]]
        cm, offset, cmp = int(p["channel_multiplier"]), int(p["offset"]), alu_op(_op_name(p["cmp_op"]))
    else:
        dst = None
        p = _bind(what, args, kwargs, ["pred", "on_true_tile", "on_false_value"],
                  {"dtype": None, "mask": None, "name": None})
        data = _tensor(p["on_true_tile"], what, "on_true_tile")
        pred = p["pred"]
        if not isinstance(pred, Predicate) or len(pred.conds) != 1:
            raise NkiError(f"{what}: pred must be one affine comparison of the tile's indices, e.g. (i_p - i_f >= 0)")
        expr, sym = pred.conds[0]
        axes = data._axes
        if any(all(it is not a for a in axes) for it in expr.iters()):
            raise NkiError(f"{what}: pred uses an index that does not index on_true_tile")
        cmp = {"<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal", "==": "equal",
               "!=": "not_equal"}[sym]
        cm, pattern, offset = expr.coef(axes[0]), [expr.coef(a) for a in axes[1:]], expr.const
    on_false = float(p["on_false_value"])
    box = _spread(_mask(p["mask"], what), [dst, data])
    dtype = p.get("dtype") or data.dtype

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.affine_select(_ap(d, dbox, what), _ap(data, box, what), cmp=cmp, offset=offset,
                                              channel_multiplier=cm, pattern=pattern, on_false=on_false))

    return _run(what, dst, data.shape, dtype, "sbuf", emit, box, ref=data)


def reciprocal(*args: Any, **kwargs: Any) -> Any:
    """``dst = 1 / data`` on VectorE."""
    what = "nisa.reciprocal"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["data"], {"dtype": None, "mask": None, "name": None, "engine": None})
    x = _tensor(p["data"], what, "data")
    box = _spread(_mask(p["mask"], what), [dst, x])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.reciprocal(_ap(d, dbox, what), _ap(x, box, what)))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def tensor_tensor_scan(*args: Any, **kwargs: Any) -> Any:
    """VectorE scan: ``dst[:, i] = op1(op0(data0[:, i], dst[:, i-1]), data1[:, i])``."""
    what = "nisa.tensor_tensor_scan"
    dst, args = _split(args, kwargs, 2)
    p = _bind(what, args, kwargs, ["data0", "data1", "initial", "op0", "op1"],
              {"reverse0": False, "reverse1": False, "dtype": None, "mask": None, "name": None})
    a, b = _tensor(p["data0"], what, "data0"), _tensor(p["data1"], what, "data1")
    init = _value(p["initial"], what, "initial")
    box = _spread(_mask(p["mask"], what), [dst, a, b, init])
    op0, op1 = _op_name(p["op0"]), _op_name(p["op1"])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_tensor_scan(_ap(d, dbox, what), _ap(a, box, what), _ap(b, box, what),
                                                   _ap(init, box, what), op0, op1, reverse0=bool(p["reverse0"]),
                                                   reverse1=bool(p["reverse1"])))

    return _run(what, dst, a.shape, _dtype_of(a, p["dtype"], what), "sbuf", emit, box, ref=a)


def scalar_tensor_tensor(*args: Any, **kwargs: Any) -> Any:
    """VectorE ``dst = (data op0 operand0) op1 operand1``."""
    what = "nisa.scalar_tensor_tensor"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["data", "op0", "operand0", "op1", "operand1"],
              {"reverse0": False, "reverse1": False, "dtype": None, "mask": None, "name": None})
    x = _tensor(p["data"], what, "data")
    o0, o1 = _value(p["operand0"], what, "operand0"), _tensor(p["operand1"], what, "operand1")
    box = _spread(_mask(p["mask"], what), [dst, x, o0, o1])
    op0, op1 = _op_name(p["op0"]), _op_name(p["op1"])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.scalar_tensor_tensor(_ap(d, dbox, what), _ap(x, box, what), op0, _ap(o0, box, what), op1,
                                                     _ap(o1, box, what), reverse0=bool(p["reverse0"]),
                                                     reverse1=bool(p["reverse1"])))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


def tensor_copy_predicated(*args: Any, **kwargs: Any) -> Any:
    """VectorE: ``dst = src`` where ``predicate`` is non-zero, ``dst`` unchanged elsewhere."""
    what = "nisa.tensor_copy_predicated"
    dst, args = _split(args, kwargs, 2)
    p = _bind(what, args, kwargs, ["src", "predicate"], {"reverse_pred": False, "mask": None, "name": None,
                                                         "dtype": None})
    if dst is None:
        raise NkiError(f"{what}: dst is required (it keeps its values where the predicate is false)")
    src = _value(p["src"], what, "src")
    pred = _tensor(p["predicate"], what, "predicate")
    box = _spread(_mask(p["mask"], what), [dst, src, pred])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.tensor_copy_predicated(_ap(d, dbox, what), _ap(src, box, what), _ap(pred, box, what),
                                                       reverse_pred=bool(p["reverse_pred"])))

    return _run(what, dst, dst.shape, dst.dtype, "sbuf", emit, box, ref=pred)


def range_select(*args: Any, **kwargs: Any) -> Any:
    """VectorE: keep elements whose free index + ``range_start`` passes ``comp_op0 bound0`` and
    ``comp_op1 bound1``, else FP32_MIN; the row max into ``reduce_res``."""
    from ..builder.kernel import FP32_MIN

    what = "nisa.range_select"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["on_true_tile", "comp_op0", "comp_op1", "bound0", "bound1"],
              {"reduce_cmd": None, "reduce_res": None, "reduce_op": None, "range_start": 0, "on_false_value": FP32_MIN,
               "dtype": None, "mask": None, "name": None})
    if p["reduce_cmd"] not in (None, reduce_cmd.reset_reduce, reduce_cmd.idle):
        raise NkiError(f"{what}: reduce_cmd={p['reduce_cmd']} (accumulating across instructions) is not supported "
                       f"by trnsim.nki")
    if p["reduce_op"] is not None and _op_name(p["reduce_op"]) not in ("max", "maximum"):
        raise NkiError(f"{what}: reduce_op must be maximum")
    x = _tensor(p["on_true_tile"], what, "on_true_tile")
    b0, b1 = _tensor(p["bound0"], what, "bound0"), _tensor(p["bound1"], what, "bound1")
    red = None if p["reduce_res"] is None else _tensor(p["reduce_res"], what, "reduce_res")
    box = _spread(_mask(p["mask"], what), [dst, x, b0, b1, red])
    c0, c1 = _op_name(p["comp_op0"]), _op_name(p["comp_op1"])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.range_select(_ap(d, dbox, what), _ap(x, box, what), c0, c1, _ap(b0, box, what),
                                             _ap(b1, box, what), range_start=int(p["range_start"]),
                                             on_false=float(p["on_false_value"]), reduce_res=_ap(red, box, what)))

    return _run(what, dst, x.shape, _dtype_of(x, p["dtype"], what), "sbuf", emit, box, ref=x)


# ---------------------------------------------------------------------------------------------
# DMA
# ---------------------------------------------------------------------------------------------


def dma_queue(dst: Any, src: Any) -> tuple[str, int]:
    """(trigger engine, queue) a DMA goes to when the kernel does not say: loads, stores and
    on-chip or HBM-to-HBM copies each on a queue of their own, so a store that waits for its
    data never holds up the loads queued behind it (a queue completes in order)."""
    d_hbm, s_hbm = dst.space == "hbm", src.space == "hbm"
    return "sync", (0 if s_hbm and not d_hbm else 1 if d_hbm and not s_hbm else 2)


def dma_copy(*args: Any, **kwargs: Any) -> Any:
    """Copy ``src`` to ``dst`` (HBM <-> SBUF, SBUF -> SBUF, HBM -> HBM) on the DMA engines."""
    what = "nisa.dma_copy"
    p = _bind(what, args, kwargs, ["dst", "src"],
              {"mask": None, "dst_rmw_op": None, "oob_mode": None, "dge_mode": None, "engine": None,
               "priority": None, "name": None})
    if p["dst_rmw_op"] is not None:
        raise NkiError(f"{what}: dst_rmw_op (DMA read-modify-write) is not supported by trnsim.nki")
    dst, src = _tensor(p["dst"], what, "dst"), _tensor(p["src"], what, "src")
    box = _spread(_mask(p["mask"], what), [dst, src])
    if box is False:
        return None
    eng = _engine(p["engine"], "", what) or ("gpsimd" if p["dge_mode"] is dge_mode.swdge else "")
    tr = current()
    tr.flush()
    d, s = _ap(dst, box, what), _ap(src, box, what)
    if s.space == "psum":
        raise NkiError(f"{what}: the DMA engines cannot read PSUM ({src.name}); copy it to SBUF first")
    default_eng, queue = dma_queue(d, s)
    tr.emit(lambda: tr.kernel.dma_copy(d, s, engine=eng or default_eng, queue=queue))
    return Instruction(len(tr.kernel.instructions) - 1)


def dma_transpose(*args: Any, **kwargs: Any) -> Any:
    """``dst[P, K] = src[K, P]ᵀ`` by the DMA engines into SBUF (NC-v3+; 2-D, axes (1, 0))."""
    what = "nisa.dma_transpose"
    dst, args = _split(args, kwargs, 1)
    p = _bind(what, args, kwargs, ["src"], {"axes": None, "priority": None, "dge_mode": None, "oob_mode": None,
                                            "dtype": None, "mask": None, "name": None})
    if p["axes"] not in (None, (1, 0), [1, 0]):
        raise NkiError(f"{what}: axes {p['axes']} are not supported by trnsim.nki (2-D transposes, axes (1, 0))")
    src = _tensor(p["src"], what, "src")
    if len(src.shape) != 2:
        raise NkiError(f"{what}: src must be 2-D, got shape {src.shape}")
    box = _spread(_mask(p["mask"], what), [dst, src])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        dap, sap = _ap(d, dbox, what), _ap(src, box, what)
        _emit(lambda: tr.kernel.dma_transpose(dap, sap, queue=dma_queue(dap, sap)[1]))

    return _run(what, dst, (src.shape[1], src.shape[0]), src.dtype, "sbuf", emit, box)


def max8(*args: Any, **kwargs: Any) -> Any:
    """The eight largest values of each partition of ``src``, largest first (VectorE)."""
    what = "nisa.max8"
    dst, args = _split(args, kwargs, 1)
    if "data" in kwargs and "src" not in kwargs:
        kwargs["src"] = kwargs.pop("data")
    p = _bind(what, args, kwargs, ["src"], {"dtype": None, "mask": None, "name": None})
    x = _tensor(p["src"], what, "src")
    box = _spread(_mask(p["mask"], what), [dst, x])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.max8(_ap(d, dbox, what), _ap(x, box, what)))

    return _run(what, dst, (x.shape[0], 8), _dtype_of(x, p["dtype"], what), "sbuf", emit, box)


def nc_find_index8(*args: Any, **kwargs: Any) -> Any:
    """The first index in each partition of ``data`` of each of the eight ``vals`` (VectorE;
    uint32, 2^32 - 1 for a value not found)."""
    what = "nisa.nc_find_index8"
    dst, args = _split(args, kwargs, 2)
    p = _bind(what, args, kwargs, ["data", "vals"], {"dtype": None, "mask": None, "name": None})
    x = _tensor(p["data"], what, "data")
    vals = _tensor(p["vals"], what, "vals")
    box = _spread(_mask(p["mask"], what), [dst, x])

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        _emit(lambda: tr.kernel.nc_find_index8(_ap(d, dbox, what), _ap(x, box, what), _ap(vals, box, what)))

    return _run(what, dst, (x.shape[0], 8), p["dtype"] or "uint32", "sbuf", emit, box)


# ---------------------------------------------------------------------------------------------
# what trnsim does not model
# ---------------------------------------------------------------------------------------------

_UNSUPPORTED = {
    "local_gather": "GpSimd gathers are not modelled", "nc_n_gather": "", "bn_stats": "", "bn_aggr": "",
    "nc_match_replace8": "", "nc_stream_shuffle": "",
    "tensor_partition_reduce": "", "tensor_scalar_reduce": "", "tensor_scalar_cumulative": "",
    "tensor_copy_dynamic_src": "dynamic access patterns are not modelled",
    "tensor_copy_dynamic_dst": "dynamic access patterns are not modelled",
    "exponential": "", "quantize_mx": "", "dropout": "random numbers are not modelled",
    "rng": "random numbers are not modelled", "rand2": "random numbers are not modelled",
    "rand_set_state": "random numbers are not modelled", "rand_get_state": "random numbers are not modelled",
    "set_rng_seed": "random numbers are not modelled", "select_reduce": "", "sequence_bounds": "",
    "register_alloc": "registers and dynamic control flow are not modelled", "register_load": "",
    "register_move": "", "register_store": "", "core_barrier": "multi-core (LNC=2) kernels are not modelled",
    "sendrecv": "multi-core (LNC=2) kernels are not modelled", "dma_compute": "", "activate2": "",
    "nonzero_with_count": "", "topk": "", "sparse_matmul": "",
}
for _name, _why in _UNSUPPORTED.items():
    globals()[_name] = _unsupported(f"nisa.{_name}", _why)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'trnsim.nki.isa' has no attribute '{name}' (not an nki.isa API trnsim knows)")


provide(nisa=sys.modules[__name__])  # the core's operators call this module (see _core._Api)
