"""``nki.language`` on trnsim: tensors, loops, memory, and the high-level ops, each lowered to
the ``nki.isa`` instructions the compiler would emit (:mod:`trnsim.nki.isa`).

The legacy (``neuronxcc.nki.language``) and current spellings both work: ``nl.load`` /
``nl.store``, ``nl.ndarray(..., buffer=nl.sbuf)``, ``nl.zeros``, index arrays (``nl.arange``,
``nl.mgrid``) and masks, ``nl.affine_range`` and friends (Python loops, unrolled at trace time),
``nl.matmul`` with ``+=`` into PSUM, ``nl.transpose``, the elementwise math (ScalarE for
transcendental functions, VectorE for arithmetic), reductions, ``nl.softmax``,
``nl.rms_norm`` and ``nl.where``. What trnsim does not model fails with one line naming it.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import sys
from typing import Any, Iterator, Sequence

import numpy as np

from . import isa as nisa
from ._core import (Affine, MGrid, NkiError, NkiTensor, ParDim, Trace, Iter, arange, buffer_name, current,
                    iter_range, nki_dtype)
from ._core import provide
from ._core import unsupported as _unsupported

__all__ = [
    "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size", "par_dim", "ds", "arange", "mgrid",
    "ndarray", "zeros", "ones", "full", "zeros_like", "ones_like", "empty_like", "shared_constant",
    "shared_identity_matrix", "load", "store", "load_transpose2d", "copy", "broadcast_to", "expand_dims",
    "affine_range", "sequential_range", "static_range", "dynamic_range", "no_reorder", "program_id",
    "num_programs", "program_ndim", "matmul", "transpose", "softmax", "rms_norm", "where",
]

# ---- data types (names, as NKI's stubs define them) --------------------------------------------
bool_ = "bool"
int8, int16, int32 = "int8", "int16", "int32"
uint8, uint16, uint32 = "uint8", "uint16", "uint32"
float16, float32, bfloat16, tfloat32 = "float16", "float32", "bfloat16", "tfloat32"
float8_e4m3, float8_e5m2, float8_e4m3fn = "float8_e4m3", "float8_e5m2", "float8_e4m3fn"
float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4 = "float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"


# ---- memory ---------------------------------------------------------------------------------
class _Buffer(str):
    """A memory region: ``nl.sbuf``, ``nl.psum``, ``nl.hbm`` / ``nl.private_hbm`` / ``nl.shared_hbm``."""

    @property
    def name(self) -> str:
        return str(self)


sbuf, psum = _Buffer("sbuf"), _Buffer("psum")
hbm, private_hbm, shared_hbm = _Buffer("hbm"), _Buffer("private_hbm"), _Buffer("shared_hbm")


def is_hbm(buffer: Any) -> bool:
    return buffer_name(buffer) == "hbm"


def is_sbuf(buffer: Any) -> bool:
    return buffer_name(buffer) == "sbuf"


def is_psum(buffer: Any) -> bool:
    return buffer_name(buffer) == "psum"


def is_on_chip(buffer: Any) -> bool:
    return buffer_name(buffer) in ("sbuf", "psum")


class _TileSize:
    """Hardware tile limits of the chip the kernel is traced for (``nl.tile_size``)."""

    def _cfg(self) -> Any:
        from .. import load_config
        from ._core import STACK

        return STACK[-1].config if STACK else load_config("trn2")

    @property
    def pmax(self) -> int:
        return self._cfg().core.sbuf.partitions

    @property
    def psum_bank_fmax(self) -> int:
        return self._cfg().core.psum.bank_bytes // 4

    psum_fmax = psum_bank_fmax

    @property
    def psum_bank_fmax_bytes(self) -> int:
        return self._cfg().core.psum.bank_bytes

    @property
    def psum_num_banks(self) -> int:
        return self._cfg().core.psum.banks

    @property
    def gemm_stationary_fmax(self) -> int:
        return self._cfg().core.tensor.stationary_max_free

    @property
    def gemm_moving_fmax(self) -> int:
        return builtins.min(self._cfg().core.tensor.moving_max_free, self.psum_bank_fmax)

    @property
    def bn_stats_fmax(self) -> int:
        return 512

    @property
    def psum_min_align(self) -> int:
        return self._cfg().core.psum.bank_bytes

    @property
    def sbuf_min_align(self) -> int:
        return self._cfg().core.sbuf.allocation_granule

    @property
    def total_available_sbuf_size(self) -> int:
        return self._cfg().core.sbuf.partition_bytes

    sbuf_fmax_bytes = total_available_sbuf_size

    @property
    def sbuf_fmax(self) -> int:
        return self.total_available_sbuf_size // 4

    @property
    def sbuf_size_bytes(self) -> int:
        return self._cfg().core.sbuf.bytes


tile_size = _TileSize()


def par_dim(size: int) -> ParDim:
    """Marks the partition dim of a tile shape with block dims before it (legacy NKI)."""
    return ParDim(size)


def ds(start: int, size: int) -> slice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""
    return slice(int(start), int(start) + int(size))


mgrid = MGrid()


def ndarray(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "", address: Any = None) -> NkiTensor:
    """A new tensor, not initialized: an SBUF/PSUM tile or an HBM tensor."""
    if address is not None:
        raise NkiError("nl.ndarray(address=...) (manual allocation) is not supported by trnsim.nki: the scheduling "
                       "pass lays tiles out, as the compiler does")
    tr = current()
    return NkiTensor.full(tr.new_tile(shape, nki_dtype(dtype, "nl.ndarray"), buffer_name(buffer), name, one_bank=True))


def zeros(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    """A new tensor filled with zeros. In PSUM the memset waits: a first matmul that overwrites
    the whole tile makes it unnecessary, as the compiler folds it."""
    t = ndarray(shape, dtype, buffer, name)
    if t._st.kind == "psum":  # type: ignore[union-attr]
        t._st.zero_pending = True  # type: ignore[union-attr]
    elif t._st.kind == "hbm":  # type: ignore[union-attr]
        raise NkiError("nl.zeros in HBM is not supported by trnsim.nki; fill an SBUF tile and store it")
    else:
        nisa.memset(t, 0.0)
    return t


def full(shape: Any, fill_value: float, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    nisa.memset(t, float(fill_value))
    return t


def ones(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    return full(shape, 1.0, dtype, buffer, name)


def zeros_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ones_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ones(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_constant(constant: Any, dtype: Any = None) -> NkiTensor:
    """An HBM tensor holding ``constant`` (a numpy array or a .npy path), as the compiler embeds it."""
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    tr = current()
    return tr_constant(tr, arr, dtype)


def tr_constant(tr: Trace, arr: np.ndarray, dtype: Any) -> NkiTensor:
    dt = nki_dtype(dtype if dtype is not None else arr.dtype, "nl.shared_constant")
    from ._core import Store

    name = tr.name("const")
    st = Store("hbm", tuple(arr.shape) or (1,), dt, name)
    st.tensor = tr.kernel.input(name, st.shape, dt)
    tr.constants[name] = arr.reshape(st.shape)  # type: ignore[attr-defined]
    return NkiTensor.full(st)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An [n, n] identity in SBUF: ones (VectorE memset) kept on the diagonal by affine_select
    (GpSimd)."""
    t = dst if dst is not None else ndarray((int(n), int(n)), dtype, sbuf)
    nisa.memset(t, 1.0)
    nisa.affine_select(t, pattern=[[-1, int(n)]], channel_multiplier=1, on_true_tile=t, on_false_value=0.0,
                       cmp_op="equal", offset=0)
    return t


# ---- data movement ------------------------------------------------------------------------------
def load(src: NkiTensor, *, mask: Any = None, dtype: Any = None, **kwargs: Any) -> NkiTensor:
    """A new SBUF tile with ``src``'s values (a DMA; the first dim of ``src`` becomes the
    partition dim)."""
    what = "nl.load"
    if kwargs:
        raise NkiError(f"{what}: unexpected argument '{next(iter(kwargs))}'")
    src = nisa._tensor(src, what, "src")
    if not src.buffer.endswith("hbm"):
        raise NkiError(f"{what}: src must be in HBM, got {src.name} in {src.buffer.upper()} (copy on-chip tiles with "
                       f"nl.copy or nisa.tensor_copy)")
    box = nisa._mask(mask, what)
    shape = src.shape if len(src.shape) > 1 else (1,) + src.shape
    dt = dtype or src.dtype

    def emit(d: NkiTensor, dbox: dict) -> None:
        tr = current()
        dap, sap = nisa._ap(d, dbox, what), nisa._ap(src, box, what)
        eng, q = nisa.dma_queue(dap, sap)
        tr.emit(lambda: tr.kernel.dma_copy(dap, sap, engine=eng, queue=q))

    return nisa._run(what, None, shape, dt, "sbuf", emit, box, ref=src if len(src.shape) > 1 else None)


def store(dst: NkiTensor, value: Any, *, mask: Any = None, **kwargs: Any) -> None:
    """Write ``value`` (an SBUF tile; a PSUM tile is copied to SBUF first) to HBM ``dst``."""
    what = "nl.store"
    if kwargs:
        raise NkiError(f"{what}: unexpected argument '{next(iter(kwargs))}'")
    dst = nisa._tensor(dst, what, "dst")
    value = nisa._tensor(value, what, "value")
    if value.buffer == "psum":
        value = nisa.tensor_copy(value, mask=mask)
        value._store()
    nisa.dma_copy(dst, value, mask=mask)


def load_transpose2d(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile [F, P] = ``src[P, F]ᵀ`` by a DMA transpose (NC-v3+, ~90% of a load's rate)."""
    if dtype is not None and nki_dtype(dtype) != nki_dtype(src.dtype):
        raise NkiError("nl.load_transpose2d: a cast (dtype=) is not supported by the DMA transpose")
    return nisa.dma_transpose(src)


def copy(x: NkiTensor, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
    """A copy of ``x`` (VectorE), cast to ``dtype`` if given."""
    return nisa.tensor_copy(x, dtype=dtype, mask=mask)


def broadcast_to(x: NkiTensor, shape: Sequence[int], dtype: Any = None) -> NkiTensor:
    """``x`` broadcast along free dims of size 1 (a stride-0 view; the partition dim cannot)."""
    v = x.broadcast_to(shape)
    return v if dtype is None or nki_dtype(dtype) == nki_dtype(x.dtype) else copy(v, dtype)


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    """A view of ``x`` with a new size-1 axis at ``axis``."""
    x._store()
    nd = len(x._axes) + 1
    a = int(axis) % nd
    if a == 0 and x._st.kind != "hbm":  # type: ignore[union-attr]
        raise NkiError("nl.expand_dims: the partition dim of an on-chip tile stays first")
    axes = list(x._axes)
    axes.insert(a, Iter(1))
    return NkiTensor(x._st, x._exprs, tuple(axes))


# ---- loops and SPMD -----------------------------------------------------------------------------
def affine_range(start: int, stop: int | None = None, step: int = 1) -> Iterator[int]:
    """Iterations with no loop-carried dependency; unrolled at trace time (the scheduling pass
    interleaves them as the compiler may)."""
    return iter_range(start, stop, step) if stop is not None else iter_range(start)


def sequential_range(start: int, stop: int | None = None, step: int = 1) -> Iterator[int]:
    """Iterations that may depend on each other; unrolled, dependencies come from the data."""
    return affine_range(start, stop, step)


def static_range(start: int, stop: int | None = None, step: int = 1) -> Iterator[int]:
    """A fully unrolled loop."""
    return affine_range(start, stop, step)


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> Iterator[int]:
    """A device loop; with integer bounds trnsim unrolls it (registers are not modelled)."""
    return affine_range(start, stop, step)


@contextlib.contextmanager
def no_reorder() -> Iterator[None]:
    """Instructions emitted inside the block keep their program order (the scheduling pass
    chains them)."""
    tr = current()
    tr.flush()
    tr.no_reorder.append(None)
    try:
        yield
    finally:
        tr.flush()
        tr.no_reorder.pop()


def program_id(axis: int = 0) -> int:
    """This program's index along ``axis`` of the SPMD grid (``kernel[g0, g1](...)``)."""
    tr = current()
    if not 0 <= int(axis) < builtins.max(1, len(tr.grid)):
        raise NkiError(f"nl.program_id({axis}): the launch grid has {len(tr.grid)} axes")
    return tr.program_id[int(axis)] if tr.program_id else 0


def num_programs(axes: int | Sequence[int] | None = None) -> int:
    tr = current()
    grid = tr.grid or (1,)
    if axes is None:
        return math.prod(grid)
    if isinstance(axes, (list, tuple)):
        return math.prod(grid[int(a)] for a in axes)
    return grid[int(axes)]


def program_ndim() -> int:
    return len(current().grid)


# ---- math -----------------------------------------------------------------------------------------
def _is_column(c: NkiTensor, like: NkiTensor) -> bool:
    return len(c.shape) >= 2 and c.shape[0] == like.shape[0] and math.prod(c.shape[1:]) == 1 and like.shape != c.shape


# NKI's type promotion of two tiles (the programming model's "NKI Type Promotion"): a float and
# an integer give the float; two floats the wider, float16 with bfloat16 float32, an fp8 with a
# 16-bit float that float, e4m3 with e5m2 bfloat16; two integers the wider, or a widened type
# that holds both ranges (int32 with uint32: float32, the hardware has no int64)
_FLOAT_RANK = {"float8_e4m3": 0, "float8_e4m3fn": 0, "float8_e5m2": 0, "bfloat16": 1, "float16": 1, "float32": 2}


def promote(a: Any, b: Any) -> Any:
    """The dtype NKI gives an arithmetic op on tiles of dtypes ``a`` and ``b`` (trnsim Dtypes)."""
    if a.name == b.name:
        return a
    if a.is_float != b.is_float:
        return a if a.is_float else b
    if a.is_float:
        ra, rb = _FLOAT_RANK.get(a.name, 2), _FLOAT_RANK.get(b.name, 2)
        if ra != rb:
            return a if ra > rb else b
        return nki_dtype("float32") if ra == 1 else nki_dtype("bfloat16")  # (f16, bf16); (e4m3, e5m2)
    sa, sb = not a.name.startswith("uint"), not b.name.startswith("uint")
    if sa == sb:
        return a if a.itemsize >= b.itemsize else b
    signed, unsigned = (a, b) if sa else (b, a)
    if signed.itemsize > unsigned.itemsize:
        return signed
    widened = {1: "int16", 2: "int32"}.get(unsigned.itemsize)
    return nki_dtype(widened) if widened is not None else nki_dtype("float32")


def _dtype_of(v: Any) -> Any:
    """A tile's dtype, a numpy scalar's, or a weakly typed Python scalar's as NKI infers it: the
    widest the hardware has of its kind (bool uint8, int int32, float float32)."""
    if isinstance(v, NkiTensor):
        return nki_dtype(v.dtype)
    if isinstance(v, (bool, np.bool_)):
        return nki_dtype("uint8")
    if isinstance(v, np.generic) and v.dtype not in (np.float64, np.int64):  # (numpy's defaults count as weak)
        return nki_dtype(v.dtype)
    return nki_dtype("int32" if isinstance(v, (int, np.integer)) else "float32")


def _binary(op: Any, x: Any, y: Any, dtype: Any, mask: Any, what: str) -> NkiTensor:
    tx, ty = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
    if not tx and not ty:
        raise NkiError(f"{what}: at least one operand must be a tensor")
    if dtype is None:
        dtype = promote(_dtype_of(x), _dtype_of(y))
    if tx and ty:
        if x.shape == y.shape:
            return nisa.tensor_tensor(x, y, op, dtype=dtype, mask=mask)
        if _is_column(y, x):
            return nisa.tensor_scalar(x, op, y, dtype=dtype, mask=mask)
        if _is_column(x, y):
            return nisa.tensor_scalar(y, op, x, reverse0=True, dtype=dtype, mask=mask)
        if x.shape[0] != y.shape[0]:
            raise NkiError(f"{what}: shapes {x.shape} and {y.shape} differ in the partition dim; broadcasting across "
                           f"partitions is not supported (use nl.matmul with a ones vector)")
        if len(x.shape) == len(y.shape) and builtins.all(a == b or b == 1 for a, b in zip(x.shape, y.shape)):
            return nisa.tensor_tensor(x, y.broadcast_to(x.shape), op, dtype=dtype, mask=mask)
        if len(x.shape) == len(y.shape) and builtins.all(a == b or a == 1 for a, b in zip(x.shape, y.shape)):
            return nisa.tensor_tensor(x.broadcast_to(y.shape), y, op, dtype=dtype, mask=mask)
        raise NkiError(f"{what}: cannot broadcast shapes {x.shape} and {y.shape}")
    if tx:
        return nisa.tensor_scalar(x, op, y, dtype=dtype, mask=mask)
    return nisa.tensor_scalar(y, op, x, reverse0=True, dtype=dtype, mask=mask)


def _make_binary(opname: str) -> Any:
    def fn(x: Any, y: Any, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
        return _binary(opname, x, y, dtype, mask, f"nl.{opname}")

    fn.__name__ = fn.__qualname__ = opname
    fn.__doc__ = f"Elementwise ``{opname}`` of two tiles, or a tile and a number or [P, 1] tile (VectorE)."
    return fn


add = _make_binary("add")
subtract = _make_binary("subtract")
multiply = _make_binary("multiply")
divide = _make_binary("divide")
maximum = _make_binary("maximum")
minimum = _make_binary("minimum")
power = _make_binary("power")
abs_max = _make_binary("abs_max")
equal = _make_binary("equal")
not_equal = _make_binary("not_equal")
less = _make_binary("less")
less_equal = _make_binary("less_equal")
greater = _make_binary("greater")
greater_equal = _make_binary("greater_equal")
bitwise_and = _make_binary("bitwise_and")
bitwise_or = _make_binary("bitwise_or")
bitwise_xor = _make_binary("bitwise_xor")
left_shift = _make_binary("left_shift")
right_shift = _make_binary("right_shift")


def _make_unary(func: str) -> Any:
    def fn(x: NkiTensor, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
        if isinstance(x, NkiTensor):
            nisa.refuse_integer_result(func, x, dtype, f"nl.{func}")
        return nisa.activation(op=func, data=x, dtype=dtype, mask=mask)

    fn.__name__ = fn.__qualname__ = func
    fn.__doc__ = f"Elementwise ``{func}`` on ScalarE (one ``activation``)."
    return fn


exp = _make_unary("exp")
log = _make_unary("log")
sqrt = _make_unary("sqrt")
rsqrt = _make_unary("rsqrt")
tanh = _make_unary("tanh")
sigmoid = _make_unary("sigmoid")
relu = _make_unary("relu")
gelu = _make_unary("gelu")
gelu_apprx_tanh = _make_unary("gelu_apprx_tanh")
silu = _make_unary("silu")
softplus = _make_unary("softplus")
mish = _make_unary("mish")
erf = _make_unary("erf")
sin = _make_unary("sin")
arctan = _make_unary("arctan")
square = _make_unary("square")
abs = _make_unary("abs")  # noqa: A001 - NKI's name
sign = _make_unary("sign")
reciprocal = _make_unary("reciprocal")
identity = _make_unary("identity")
bypass = identity


def negative(x: NkiTensor, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
    """``-x`` (VectorE)."""
    return nisa.tensor_scalar(x, "multiply", -1.0, dtype=dtype, mask=mask)


def _reduction(opname: str) -> Any:
    def fn(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, *, mask: Any = None) -> NkiTensor:
        return nisa.tensor_reduce(opname, x, axis, keepdims=keepdims, dtype=dtype, mask=mask)

    fn.__name__ = fn.__qualname__ = opname
    fn.__doc__ = f"``{opname}`` along free ``axis`` (VectorE ``tensor_reduce``)."
    return fn


sum = _reduction("add")  # noqa: A001
sum.__name__ = "sum"
max = _reduction("max")  # noqa: A001
min = _reduction("min")  # noqa: A001
prod = _reduction("multiply")
prod.__name__ = "prod"


def mean(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, *, mask: Any = None) -> NkiTensor:
    """The mean along free ``axis``: a sum (VectorE) then a multiply by 1/n."""
    axes = axis if isinstance(axis, (list, tuple)) else (axis,)
    n = math.prod(x.shape[int(a)] for a in axes)
    s = nisa.tensor_reduce("add", x, axis, keepdims=keepdims, dtype="float32", mask=mask)
    return nisa.tensor_scalar(s, "multiply", 1.0 / n, dtype=dtype or x.dtype)


def var(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, *, mask: Any = None) -> NkiTensor:
    """The variance along free ``axis``: mean of squares minus the square of the mean."""
    m = mean(x, axis, "float32", keepdims=True, mask=mask)
    sq = nisa.activation(op="square", data=x, dtype="float32", mask=mask)
    m2 = mean(sq, axis, "float32", keepdims=True)
    mm = nisa.activation(op="square", data=m, dtype="float32")
    out = nisa.tensor_tensor(m2, mm, "subtract", dtype=dtype or x.dtype)
    return out if keepdims else out


def softmax(x: NkiTensor, axis: int = -1, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
    """Softmax along the last free axis: VectorE row max, ScalarE ``exp(x - max)`` with its row
    sum fused, VectorE reciprocal and scale."""
    nd = len(x.shape)
    if int(axis) % nd != nd - 1 or nd < 2:
        raise NkiError(f"nl.softmax: only the last free axis of a tile is supported, got axis={axis} of {x.shape}")
    negmax = nisa.tensor_reduce("max", x, nd - 1, negate=True, keepdims=True, dtype="float32", mask=mask)
    rowsum = ndarray((x.shape[0], 1), float32, sbuf)
    e = nisa.activation(op="exp", data=x, bias=negmax, reduce_op="add", reduce_res=rowsum, dtype=dtype or x.dtype,
                        mask=mask)
    e._store()
    inv = nisa.reciprocal(rowsum)
    return nisa.tensor_scalar(e, "multiply", inv, dtype=dtype or x.dtype, mask=mask)


def rms_norm(x: NkiTensor, w: NkiTensor, axis: int, n: int, epsilon: float = 1e-6, dtype: Any = None,
             compute_dtype: Any = None) -> NkiTensor:
    """``x / sqrt(mean(x^2) + eps) * w`` along the free axis: ScalarE square with its row sum,
    VectorE mean and eps, ScalarE rsqrt, VectorE scale, VectorE multiply by ``w``."""
    ss = ndarray((x.shape[0], 1), float32, sbuf)
    sq = nisa.activation(op="square", data=x, reduce_op="add", reduce_res=ss, dtype=float32)
    sq._store()
    ms = nisa.tensor_scalar(ss, "multiply", 1.0 / int(n), op1="add", operand1=float(epsilon))
    inv = nisa.activation(op="rsqrt", data=ms)
    y = nisa.tensor_scalar(x, "multiply", inv, dtype=compute_dtype or float32)
    return _binary("multiply", y, w, dtype or x.dtype, None, "nl.rms_norm")


def where(condition: NkiTensor, x: Any, y: Any, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
    """``x`` where ``condition`` is true (non-zero, as numpy.where), else ``y``: ``y`` copied
    (or filled), the condition compared with 0 into a uint8 predicate, then VectorE
    ``tensor_copy_predicated`` of ``x``. (A cast to uint8 rounded 0.3 and -2.0 to a false
    predicate.)"""
    cond = nisa._tensor(condition, "nl.where", "condition")
    like = x if isinstance(x, NkiTensor) else y if isinstance(y, NkiTensor) else cond
    dt = dtype or like.dtype
    out = ndarray(cond.shape, dt, sbuf)
    if isinstance(y, NkiTensor):
        nisa.tensor_copy(out, y, mask=mask)
    else:
        nisa.memset(out, float(y), mask=mask)
    pred = nisa.tensor_scalar(cond, not_equal, 0, dtype=uint8, mask=mask)
    pred._store()
    if isinstance(x, NkiTensor):
        src = nisa.tensor_copy(x, dtype=dt) if nki_dtype(x.dtype) != nki_dtype(dt) else x
    else:  # a number: a tile of it (the predicated copy takes a tile)
        src = ndarray(cond.shape, dt, sbuf)
        nisa.memset(src, float(x), mask=mask)
    nisa.tensor_copy_predicated(out, src, pred, mask=mask)
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False, *, mask: Any = None) -> NkiTensor:
    """``x @ y`` into PSUM (fp32). With ``transpose_x=False`` x is first transposed on the PE
    array (and copied back to SBUF), as the compiler inserts it."""
    if not transpose_x:
        xt = nisa.nc_transpose(x)
        x = nisa.tensor_copy(xt, dtype=x.dtype)
        x._store()
    return nisa.nc_matmul(x, y, mask=mask)


def transpose(x: NkiTensor, dtype: Any = None, *, mask: Any = None) -> NkiTensor:
    """``x[P, F]`` transposed to [F, P] on the PE array (the result is in PSUM)."""
    return nisa.nc_transpose(x, dtype=dtype, mask=mask)


# ---- what trnsim does not model -------------------------------------------------------------------
_UNSUPPORTED = {
    "device_print": "values are computed after the kernel is traced; print the outputs instead",
    "rand": "random numbers are not modelled", "random_seed": "random numbers are not modelled",
    "dropout": "random numbers are not modelled", "gather_flattened": "", "invert": "", "logical_and": "",
    "logical_or": "", "logical_xor": "", "logical_not": "", "floor": "", "ceil": "", "trunc": "", "fmod": "",
    "mod": "", "cos": "", "tan": "", "gelu_dx": "", "silu_dx": "", "erf_dx": "", "gelu_apprx_sigmoid": "",
    "gelu_apprx_sigmoid_dx": "", "all": "", "fori_loop": "dynamic loops are not modelled",
    "while_loop": "dynamic loops are not modelled", "static_cast": "", "loop_reduce": "",
    "spmd_dim": "multi-core (LNC=2) launches are not modelled", "nc": "multi-core (LNC=2) launches are not modelled",
    "atomic_rmw": "",
}
for _name, _why in _UNSUPPORTED.items():
    globals()[_name] = _unsupported(f"nl.{_name}", _why)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'trnsim.nki.language' has no attribute '{name}' (not an nki.language API trnsim knows)")


provide(nl=sys.modules[__name__])  # the core's operators call this module (see _core._Api)
