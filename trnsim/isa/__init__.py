"""The instruction set: access patterns (what memory an instruction touches) and instructions.

Granularity follows NKI's ISA (``nki.isa``): one object per engine instruction. Operands are
access patterns:

* :class:`HbmAP` — a view of a device-memory (HBM) tensor: element offset plus (stride, size)
  dimensions, row-major, like ``tensor[a:b, c:d]``.
* :class:`TileAP` — a view of an on-chip allocation in SBUF or PSUM: an absolute partition range
  (the parallel axis) and a free-axis pattern of up to 4 (stride, size) dimensions, in elements.

An instruction lists the access patterns it reads and writes; the kernel builder derives
RAW/WAR/WAW dependencies from them (the semaphores the Neuron compiler would insert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import numpy as np

from ..native.dtypes import Dtype, get_dtype

__all__ = [
    "HbmTensor",
    "HbmAP",
    "Allocation",
    "TileAP",
    "Instruction",
    "DmaCopy",
    "DmaGather",
    "DmaScatter",
    "MatMul",
    "Transpose",
    "Activation",
    "TensorTensor",
    "TensorScalar",
    "TensorReduce",
    "TensorCopy",
    "Memset",
    "Iota",
    "AffineSelect",
    "TensorTensorScan",
    "ScalarTensorTensor",
    "CopyPredicated",
    "RangeSelect",
    "Dropout",
    "dropout_keep",
    "Reciprocal",
    "Max8",
    "FindIndex8",
    "DmaTranspose",
    "MatMulMx",
    "ALU_OPS",
    "ACTIVATIONS",
    "KernelError",
]

# The access-pattern encoding every engine instruction carries (datasheet §4.6, S8): up to 4 free
# dimensions, uint16 sizes and int16 strides, counted in elements.
MAX_FREE_DIMS = 4
AP_MAX_SIZE = 65535
AP_MAX_STRIDE = 32767


class KernelError(ValueError):
    """A kernel breaks a hardware rule (tile limits, alignment, capacity, shapes). One line."""


def row_major(shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(stride, size) dims of a contiguous row-major array of ``shape``."""
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(zip(reversed(strides), shape))


def is_dense(dims: Sequence[tuple[int, int]]) -> bool:
    """True when (stride, size) dims describe one contiguous row-major block."""
    acc = 1
    for s, n in reversed(dims):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


def span(offset: int, dims: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Element range [lo, hi) an access pattern touches."""
    lo = hi = offset
    for s, n in dims:
        if s >= 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + 1


# ---------------------------------------------------------------------------------------------
# Device memory (HBM)
# ---------------------------------------------------------------------------------------------


class HbmTensor:
    """A tensor in device memory: a kernel input, output or scratch buffer."""

    __slots__ = ("name", "shape", "dtype", "kind", "uid", "strides", "size", "_dims", "_box")

    def __init__(self, name: str, shape: Sequence[int], dtype: Dtype, kind: str, uid: int):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.kind = kind  # "input" | "output" | "inout" (an input the kernel writes, returned too) | "scratch"
        self.uid = uid
        self._dims = row_major(self.shape)  # the whole-tensor view's dims and index box, made once
        self._box = tuple((0, s) for s in self.shape)
        self.strides = tuple(s for s, _ in self._dims)
        self.size = math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def full(self) -> "HbmAP":
        return HbmAP(self, 0, self._dims, self._box)

    def __getitem__(self, idx: Any) -> "HbmAP":
        # ``full()[idx]`` without the whole-tensor view in between, for the everyday index (ints
        # and step-1 slices within bounds): on the tensor's own dims the logical box of each
        # dimension is its index range (HbmAP.__getitem__ with step 1 from box (0, n))
        ranges = _fast_ranges(idx, self._dims)
        if ranges is None:
            return self.full()[idx]
        offset = 0
        dims: list[tuple[int, int]] = []
        box: list[tuple[int, int]] = []
        for r, sn in zip(ranges, self._dims):
            if type(r) is int:
                offset += r * sn[0]
                box.append((r, r + 1))
            else:
                start, _, length = r  # type: ignore[misc]
                offset += start * sn[0]
                dims.append((sn[0], length))
                box.append((start, start + length))
        return HbmAP(self, offset, tuple(dims) if dims else ((1, 1),), tuple(box))

    def ap(self, offset: int, dims: Sequence[Sequence[int]]) -> "HbmAP":
        """A raw access pattern: element ``offset`` and ``[[stride, size], ...]`` (outer first)."""
        try:
            d = tuple((int(s), int(n)) for s, n in dims)
        except (TypeError, ValueError):
            raise KernelError(f"access pattern on '{self.name}': dims must be [[stride, size], ...], got {dims!r}") from None
        if not d or any(n < 1 for _, n in d):
            raise KernelError(f"access pattern on '{self.name}': sizes must be >= 1, got {[list(x) for x in d]}")
        ap = HbmAP(self, int(offset), d, None)
        lo, hi = ap.span()
        if lo < 0 or hi > self.size:
            raise KernelError(
                f"access pattern on '{self.name}' reaches elements {lo}..{hi - 1}, outside its {self.size} elements"
            )
        return ap

    def reshape(self, *shape: int) -> "HbmAP":
        return self.full().reshape(*shape)

    def __repr__(self) -> str:
        return f"HbmTensor({self.name!r}, {self.shape}, {self.dtype.name}, {self.kind})"


def norm_index(idx: Any, ndim: int, error: type[KernelError] = KernelError) -> list[Any]:
    """``idx`` as one item per dimension: ``...`` expanded, missing trailing ones as ``:``;
    too many items raise ``error`` (the NKI front end's own subclass there)."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = ndim - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    if len(idx) > ndim:
        raise error(f"too many indices: {len(idx)} for {ndim} dimensions")
    return list(idx) + [slice(None)] * (ndim - len(idx))


def _slice_dim(i: Any, size: int, what: str) -> tuple[int, int, int] | int:
    """Return an int index, or (start, step, length) for a slice; check bounds."""
    if isinstance(i, (int, np.integer)):
        j = int(i)
        if j < 0:
            j += size
        if not 0 <= j < size:
            raise KernelError(f"index {int(i)} out of range for {what} of size {size}")
        return j
    if isinstance(i, slice):
        start, stop, step = i.indices(size)
        if step <= 0:
            raise KernelError(f"slice step must be positive, got {step} for {what}")
        if i.stop is not None and (i.stop > size or i.stop < -size):
            raise KernelError(f"slice end {i.stop} out of range for {what} of size {size}")
        if i.start is not None and (i.start > size or i.start < -size):
            raise KernelError(f"slice start {i.start} out of range for {what} of size {size}")
        length = max(0, -(-(stop - start) // step))
        if length == 0:
            raise KernelError(f"empty slice {i.start}:{i.stop} for {what} of size {size}")
        return (start, step, length)
    raise KernelError(f"unsupported index {i!r}: use integers and slices")


class HbmAP:
    """A view of an HBM tensor. ``box`` is the logical index box per tensor dim when the view
    came from slicing (used for exact dependency checks), else None (flat span is used)."""

    __slots__ = ("tensor", "offset", "dims", "box", "size", "_dep_box", "_dep_h", "_geo")
    space = "hbm"

    def __init__(self, tensor: HbmTensor, offset: int, dims: tuple[tuple[int, int], ...],
                 box: tuple[tuple[int, int], ...] | None):
        self.tensor = tensor
        self.offset = offset
        self.dims = dims
        self.box = box
        size = 1
        for _, n in dims:
            size *= n
        self.size = size
        self._dep_box: tuple[int, ...] | None = None  # the dependency tracker's box, computed once
        self._dep_h: tuple[Any, int] | None = None  # (native tracker, its region handle), made once
        self._geo = 0  # the builder's number for this view's DMA geometry (kernel._dma_geometry), 0 until asked

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        # the builder's caches stay behind: a region id belongs to one tracker and a geometry
        # number to one process
        state = {k: getattr(self, k) for k in self.__slots__}
        state["_dep_h"], state["_geo"] = None, 0
        return None, state

    @property
    def dtype(self) -> Dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.dims)

    @property
    def nbytes(self) -> int:
        return self.size * self.tensor.dtype.itemsize

    def span(self) -> tuple[int, int]:
        return span(self.offset, self.dims)

    def __getitem__(self, idx: Any) -> "HbmAP":
        v = _hbm_slice_fast(self, idx)
        if v is not None:
            return v
        ranges = _fast_ranges(idx, self.dims)
        if ranges is None:  # anything beyond ints and step-1 slices in bounds: check item by item
            items = norm_index(idx, len(self.dims))
            ranges = [_slice_dim(i, n, f"dim {k} of '{self.tensor.name}'")
                      for k, (i, (_, n)) in enumerate(zip(items, self.dims))]
        offset = self.offset
        dims: list[tuple[int, int]] = []
        # the logical box is only tracked for views whose dims are still the tensor's own dims
        tstrides = self.tensor.strides
        box = list(self.box) if self.box is not None and len(self.dims) == len(tstrides) else None
        for k, (r, (s, n)) in enumerate(zip(ranges, self.dims)):
            # the parent view's step along this tensor dim, in logical indices (a view with more
            # dims than its tensor, from ap(), has no box: no tensor dim k to read)
            ts = tstrides[k] if box is not None else 0
            step0 = s // ts if box is not None and ts and s % ts == 0 else None
            if box is not None and step0 is None:
                box = None
            if isinstance(r, int):
                offset += r * s
                if box is not None:
                    lo = box[k][0] + r * step0  # type: ignore[operator]
                    box[k] = (lo, lo + 1)
            else:
                start, step, length = r
                offset += start * s
                dims.append((s * step, length))
                if box is not None:
                    lo = box[k][0] + start * step0  # type: ignore[operator]
                    box[k] = (lo, lo + (length - 1) * step * step0 + 1)  # type: ignore[operator]
        if not dims:
            dims = [(1, 1)]
        return HbmAP(self.tensor, offset, tuple(dims), tuple(box) if box is not None else None)

    def reshape(self, *shape: int) -> "HbmAP":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in shape):
            raise KernelError(f"reshape: shape {tuple(shape)} must be positive integers")
        if math.prod(shape) != self.size:
            raise KernelError(f"cannot reshape {self.shape} of '{self.tensor.name}' to {tuple(shape)}")
        if not is_dense(self.dims):
            raise KernelError(f"cannot reshape a non-contiguous view of '{self.tensor.name}'")
        return HbmAP(self.tensor, self.offset, row_major(shape), None)

    def is_contiguous(self) -> bool:
        return is_dense(self.dims)

    def __repr__(self) -> str:
        return f"{self.tensor.name}@{self.offset}{list(self.dims)}"


# ---------------------------------------------------------------------------------------------
# On-chip memory (SBUF / PSUM)
# ---------------------------------------------------------------------------------------------


class Allocation:
    """A block of SBUF or PSUM: the same byte range [addr, addr+nbytes) on partitions
    [p_start, p_start+p_count)."""

    __slots__ = ("space", "name", "p_start", "p_count", "addr", "nbytes", "uid", "live")

    def __init__(self, space: str, name: str, p_start: int, p_count: int, addr: int, nbytes: int, uid: int):
        self.space = space
        self.name = name
        self.p_start = p_start
        self.p_count = p_count
        self.addr = addr
        self.nbytes = nbytes
        self.uid = uid
        self.live = True

    def __repr__(self) -> str:
        return (f"Allocation({self.space}:{self.name}, partitions {self.p_start}..{self.p_start + self.p_count - 1},"
                f" bytes {self.addr}..{self.addr + self.nbytes - 1})")


class TileAP:
    """A view of an SBUF/PSUM allocation: ``[partitions, free...]``.

    ``offset`` and the ``dims`` strides are in elements of ``dtype`` from the allocation's byte
    address within each partition; ``p_start`` is absolute (0..127).
    """

    __slots__ = ("alloc", "p_start", "p_count", "offset", "dims", "dtype", "free_size", "_dep_box", "_dep_h", "_geo")

    def __init__(self, alloc: Allocation, p_start: int, p_count: int, offset: int,
                 dims: tuple[tuple[int, int], ...], dtype: Dtype):
        self.alloc = alloc
        self.p_start = p_start
        self.p_count = p_count
        self.offset = offset
        self.dims = dims
        self.dtype = dtype
        #: elements per partition (the N of the cost formulas)
        fs = 1
        for _, n in dims:
            fs *= n
        self.free_size = fs
        self._dep_box: tuple[int, ...] | None = None  # the dependency tracker's box, computed once
        self._dep_h: tuple[Any, int] | None = None  # (native tracker, its region handle), made once
        self._geo = 0  # the builder's number for this view's geometry (kernel._geometry), 0 until asked

    def __getstate__(self) -> tuple[None, dict[str, Any]]:
        # the builder's caches stay behind: a region id belongs to one tracker and a geometry
        # number to one process
        state = {k: getattr(self, k) for k in self.__slots__}
        state["_dep_h"], state["_geo"] = None, 0
        return None, state

    @property
    def space(self) -> str:
        return self.alloc.space

    @property
    def name(self) -> str:
        return self.alloc.name

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.p_count,) + tuple(n for _, n in self.dims)

    @property
    def size(self) -> int:
        return self.p_count * self.free_size

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def byte_span(self) -> tuple[int, int]:
        """Absolute byte range [lo, hi) touched within each partition."""
        isz = self.dtype.itemsize
        lo, hi = span(self.offset, self.dims)
        return self.alloc.addr + lo * isz, self.alloc.addr + hi * isz

    def is_contiguous(self) -> bool:
        """True when the innermost free dimension has unit stride (the perf-mode condition)."""
        return not self.dims or self.dims[-1][0] == 1 or self.dims[-1][1] == 1

    def __getitem__(self, idx: Any) -> "TileAP":
        fast = _tile_slice_fast(self, idx)
        if fast is not None:
            return fast
        items = norm_index(idx, 1 + len(self.dims))
        r = _slice_dim(items[0], self.p_count, f"the partition dim of '{self.name}'")
        if isinstance(r, int):
            p_start, p_count = self.p_start + r, 1
        else:
            start, step, length = r
            if step != 1:
                raise KernelError(f"partition slices must be contiguous (step 1), got step {step} on '{self.name}'")
            p_start, p_count = self.p_start + start, length
        offset = self.offset
        dims: list[tuple[int, int]] = []
        for k, (i, (s, n)) in enumerate(zip(items[1:], self.dims)):
            r = _slice_dim(i, n, f"free dim {k + 1} of '{self.name}'")
            if isinstance(r, int):
                offset += r * s
            else:
                start, step, length = r
                offset += start * s
                dims.append((s * step, length))
        if not dims:
            dims = [(1, 1)]
        return TileAP(self.alloc, p_start, p_count, offset, tuple(dims), self.dtype)

    def reshape(self, *shape: int) -> "TileAP":
        """Reshape the free dims of a contiguous view; the partition count must stay."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in shape):
            raise KernelError(f"reshape: shape {tuple(shape)} must be positive integers")
        if shape[0] != self.p_count:
            raise KernelError(f"reshape of '{self.name}' must keep {self.p_count} partitions, got {shape[0]}")
        free = shape[1:] or (1,)
        if math.prod(free) != self.free_size:
            raise KernelError(f"cannot reshape {self.shape} of '{self.name}' to {tuple(shape)}")
        if not is_dense(self.dims):
            raise KernelError(f"cannot reshape a non-contiguous view of '{self.name}'")
        if len(free) > MAX_FREE_DIMS:
            raise KernelError(f"at most {MAX_FREE_DIMS} free dimensions, got {len(free)}")
        return TileAP(self.alloc, self.p_start, self.p_count, self.offset, row_major(free), self.dtype)

    def bitcast(self, dtype: Any) -> "TileAP":
        """The same bytes read as ``dtype`` (NKI's ``tile.view(dtype)``): an fp32 tile's bits as
        int32, four fp8 bytes as one quad-packed ``float8_e4m3fn_x4`` word. Between sizes the
        innermost free dim must have unit stride and whole elements of both dtypes."""
        dt = get_dtype(dtype)
        a, b = self.dtype.itemsize, dt.itemsize
        if a == b:
            return TileAP(self.alloc, self.p_start, self.p_count, self.offset, self.dims, dt)
        s, n = self.dims[-1]
        if s != 1 and n != 1:
            raise KernelError(f"bitcast of '{self.name}' {self.dtype.short} -> {dt.short}: the innermost free dim "
                              f"must have unit stride")
        strides = [st * a for st, _ in self.dims[:-1]]
        if (self.offset * a) % b or (n * a) % b or any(st % b for st in strides):
            raise KernelError(f"bitcast of '{self.name}' {self.shape} {self.dtype.short} -> {dt.short}: the view is "
                              f"not whole {dt.itemsize}-byte elements")
        dims = tuple((st // b, m) for st, (_, m) in zip(strides, self.dims[:-1])) + ((1, n * a // b),)
        return TileAP(self.alloc, self.p_start, self.p_count, self.offset * a // b, dims, dt)

    def broadcast_to(self, *shape: int) -> "TileAP":
        """Broadcast size-1 free dims to ``shape`` with stride 0 (e.g. a [P,1] bias to [P,N])."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in shape):
            raise KernelError(f"broadcast_to: shape {tuple(shape)} must be positive integers")
        if shape[0] != self.p_count:
            raise KernelError(f"cannot broadcast the partition dim of '{self.name}' ({self.p_count} -> {shape[0]})")
        free = list(shape[1:])
        if len(free) > MAX_FREE_DIMS:
            raise KernelError(f"at most {MAX_FREE_DIMS} free dimensions, got {len(free)}")
        dims = list(self.dims)
        while len(dims) < len(free):
            dims.insert(0, (0, 1))
        if len(dims) != len(free):
            raise KernelError(f"cannot broadcast {self.shape} of '{self.name}' to {tuple(shape)}")
        out = []
        for (s, n), m in zip(dims, free):
            if n == m:
                out.append((s, n))
            elif n == 1:
                out.append((0, m))
            else:
                raise KernelError(f"cannot broadcast {self.shape} of '{self.name}' to {tuple(shape)}")
        return TileAP(self.alloc, self.p_start, self.p_count, self.offset, tuple(out), self.dtype)

    def __repr__(self) -> str:
        return f"{self.space}:{self.name}[{self.p_start}:{self.p_start + self.p_count}]@{self.offset}{list(self.dims)}"


def _fast_range(i: Any, size: int) -> tuple[int, int] | int | None:
    """``i`` as (start, length) for a step-1 slice with in-range non-negative bounds, as the
    position for an in-range non-negative int, else None (the general path decides: negative
    indices, steps, errors)."""
    t = type(i)
    if t is slice:
        if i.step is not None and i.step != 1:
            return None
        a, b = i.start, i.stop
        if a is None:
            a = 0
        elif type(a) is not int or a < 0:
            return None
        if b is None:
            b = size
        elif type(b) is not int or b > size:
            return None
        if a >= b:
            return None
        return (a, b - a)
    if t is int and 0 <= i < size:
        return i
    return None


def _fast_ranges(idx: Any, dims: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int] | int] | None:
    """What :func:`_slice_dim` gives for each dimension of ``dims`` - a position, or (start,
    step, length) - when ``idx`` holds only in-range ints and step-1 slices, else None."""
    if type(idx) is not tuple:
        idx = (idx,)
    if len(idx) > len(dims):
        return None
    out: list[tuple[int, int, int] | int] = []
    for k, (_, n) in enumerate(dims):
        if k >= len(idx):
            out.append((0, 1, n))
            continue
        r = _fast_range(idx[k], n)
        if r is None:
            return None
        out.append(r if type(r) is int else (r[0], 1, r[1]))  # type: ignore[index]
    return out


def _hbm_slice_fast(ap: HbmAP, idx: Any) -> HbmAP | None:
    """``ap[idx]`` for the everyday index - ints and step-1 slices within bounds, at most one per
    dimension - in one pass (what HbmAP.__getitem__ works out from :func:`_fast_ranges`, without
    the list between); None sends anything else there."""
    if type(idx) is not tuple:
        idx = (idx,)
    dims = ap.dims
    nd, ni = len(dims), len(idx)
    if ni > nd:
        return None
    tstrides = ap.tensor.strides
    box0 = ap.box if ap.box is not None and nd == len(tstrides) else None
    box: list[tuple[int, int]] | None = [] if box0 is not None else None
    offset = ap.offset
    out: list[tuple[int, int]] = []
    for k in range(nd):
        s, n = dims[k]
        if k < ni:
            i = idx[k]
            if type(i) is slice:
                if i.step is not None and i.step != 1:
                    return None
                a, b = i.start, i.stop
                if a is None:
                    a = 0
                elif type(a) is not int or a < 0:
                    return None
                if b is None:
                    b = n
                elif type(b) is not int or b > n:
                    return None
                if a >= b:
                    return None
                pos, length = a, b - a
            elif type(i) is int and 0 <= i < n:
                pos, length = i, 0  # an int: the dim goes
            else:
                return None
        else:
            pos, length = 0, n
        offset += pos * s
        if length:
            out.append((s, length))
        if box is not None:
            # the parent view's step along this tensor dim, in logical indices
            ts = tstrides[k]
            if ts and s % ts == 0:
                step0 = s // ts
                lo = box0[k][0] + pos * step0  # type: ignore[index]
                box.append((lo, lo + (length - 1) * step0 + 1) if length else (lo, lo + 1))
            else:
                box = None
    return HbmAP(ap.tensor, offset, tuple(out) if out else ((1, 1),), tuple(box) if box is not None else None)


def _tile_slice_fast(ap: TileAP, idx: Any) -> TileAP | None:
    """``ap[idx]`` for the everyday index - ints and step-1 slices within bounds, at most one per
    dimension - without normalising it item by item (kernels slice tiles once per instruction);
    None sends anything else through :meth:`TileAP.__getitem__`'s checks and messages."""
    if type(idx) is slice and idx.start is None and idx.step is None and \
            (idx.stop is None or (type(idx.stop) is int and idx.stop == ap.p_count)):
        return ap  # ``ap[:]``, ``ap[:p_count]``: the same view (views are immutable)
    if type(idx) is not tuple:
        idx = (idx,)
    dims = ap.dims
    ni = len(idx)
    if ni > 1 + len(dims):
        return None
    p_start, p_count = ap.p_start, ap.p_count
    offset = ap.offset
    out: list[tuple[int, int]] = []
    k = 0
    for s, n in ((0, p_count),) + dims:  # the partition dim (k = 0), then the free dims
        if k < ni:
            r = _fast_range(idx[k], n)
            if r is None:
                return None
            if type(r) is int:
                if k:
                    offset += r * s
                else:
                    p_start, p_count = p_start + r, 1
            elif k:
                offset += r[0] * s  # type: ignore[index]
                out.append((s, r[1]))  # type: ignore[index]
            else:
                p_start, p_count = p_start + r[0], r[1]  # type: ignore[index]
        elif k:
            out.append((s, n))
        k += 1
    return TileAP(ap.alloc, p_start, p_count, offset, tuple(out) if out else ((1, 1),), ap.dtype)


AP = Union[HbmAP, TileAP]


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------

ALU_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "max": np.maximum,
    "min": np.minimum,
    "power": np.power,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "equal": lambda a, b: (a == b),
    "not_equal": lambda a, b: (a != b),
    "greater": lambda a, b: (a > b),
    "greater_equal": lambda a, b: (a >= b),
    "less": lambda a, b: (a < b),
    "less_equal": lambda a, b: (a <= b),
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}
ALU_ALIASES = {"sub": "subtract", "mul": "multiply", "div": "divide", "pow": "power", "eq": "equal",
               "ne": "not_equal", "gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}
BITWISE_OPS = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"})
REDUCE_OPS: dict[str, Callable[..., Any]] = {"add": np.sum, "max": np.max, "min": np.min, "multiply": np.prod,
                                              "maximum": np.max, "minimum": np.min}


def alu_op(name: Any) -> str:
    n = getattr(name, "__name__", name)
    n = ALU_ALIASES.get(n, n)
    if n not in ALU_OPS:
        raise KernelError(f"unknown ALU op {name!r}: expected one of {', '.join(sorted(ALU_OPS))}")
    return n


def reduce_op(name: Any) -> str:
    n = getattr(name, "__name__", name)
    n = {"sum": "add", "mul": "multiply"}.get(n, n)
    if n not in REDUCE_OPS:
        raise KernelError(f"unknown reduce op {name!r}: expected one of add, max, min, multiply")
    return n


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz-Stegun 7.1.26 is too coarse; use the exact identity through math.erf
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _gelu(x: np.ndarray) -> np.ndarray:
    xd = x.astype(np.float64)
    return 0.5 * xd * (1.0 + _erf(xd / math.sqrt(2.0)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    xd = x.astype(np.float64)
    return 0.5 * xd * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (xd + 0.044715 * xd**3)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    xd = x.astype(np.float64)
    return 1.0 / (1.0 + np.exp(-xd))


# name -> (function computing in float64 then rounded to fp32 by the engine, PWP table set)
# A table set of None means the function needs no activation table (no switch cost).
ACTIVATIONS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str | None]] = {
    "identity": (lambda x: x, None),
    "copy": (lambda x: x, None),
    "relu": (lambda x: np.maximum(x, 0), None),
    "square": (lambda x: x * x, None),
    "abs": (np.abs, None),
    "sign": (np.sign, None),
    "reciprocal": (lambda x: 1.0 / x, None),
    "exp": (np.exp, "exp_and_others"),
    "log": (np.log, "exp_and_others"),
    "softplus": (lambda x: np.logaddexp(0.0, x), "exp_and_others"),
    "sqrt": (np.sqrt, "exp_and_others"),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), "exp_and_others"),
    "sigmoid": (_sigmoid, "gelu_and_others"),
    "tanh": (np.tanh, "gelu_and_others"),
    "gelu": (_gelu, "gelu_and_others"),
    "gelu_apprx_tanh": (_gelu_tanh, "gelu_and_others"),
    "silu": (lambda x: x * _sigmoid(x), "gelu_and_others"),
    "erf": (_erf, "gelu_and_others"),
    "mish": (lambda x: x * np.tanh(np.logaddexp(0.0, x)), "gelu_and_others"),
    "sin": (np.sin, "trig"),
    "arctan": (np.arctan, "trig"),
}


def activation_fn(name: Any) -> str:
    n = getattr(name, "__name__", name)
    if n not in ACTIVATIONS:
        raise KernelError(f"unknown activation {name!r}: expected one of {', '.join(sorted(ACTIVATIONS))}")
    return n


# ---------------------------------------------------------------------------------------------
# Instructions
# ---------------------------------------------------------------------------------------------


class Instruction:
    """One engine instruction. ``reads``/``writes`` drive dependencies; ``deps`` holds the
    indices of earlier instructions this one waits for (filled in by the builder)."""

    __slots__ = ("index", "engine", "reads", "writes", "deps", "first_deps", "label")
    opcode = "Instruction"
    is_dma = False  # True for the DMA family (a trigger on an engine, a transfer on a queue)

    def __init__(self, engine: str, reads: tuple[AP, ...], writes: tuple[AP, ...], label: str = ""):
        self.index = -1
        self.engine = engine
        self.reads = reads
        self.writes = writes
        self.deps: tuple[int, ...] = ()
        #: the subset of ``deps`` the instruction's first phase needs (TensorE's LoadStationary
        #: needs only the stationary operand); None when the whole instruction waits for all
        self.first_deps: tuple[int, ...] | None = None
        self.label = label

    def describe(self) -> str:
        return self.opcode

    def __repr__(self) -> str:
        return f"#{self.index} {self.engine}.{self.describe()} deps={list(self.deps)}"


class DmaCopy(Instruction):
    """Move data between HBM and SBUF (or SBUF↔SBUF, HBM↔HBM), casting through fp32 when the
    dtypes differ. Triggered by ``engine``'s sequencer onto DMA queue ``queue``."""

    __slots__ = ("dst", "src", "queue", "plan")
    opcode = "DmaCopy"
    is_dma = True

    def __init__(self, engine: str, dst: AP, src: AP, queue: str):
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = engine
        self.reads: tuple[AP, ...] = (src,)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.src = src
        self.queue = queue  # lane name, e.g. "qSyncIO0"
        self.plan: Any = None  # memory.dma.DmaPlan, filled by the builder

    def describe(self) -> str:
        return f"DmaCopy[{self.queue}]"


class DmaGather(DmaCopy):
    """Indirect DMA (NKI ``dma_copy`` with a dynamic index, software DGE): partition ``p`` of
    ``dst`` receives row ``indices[p]`` of ``src`` [rows, D]. The index values are read at run
    time, so the instruction reads all of ``src``; ``oob_mode`` says what an index outside
    0..rows-1 does ("error" stops the run, "skip" leaves that partition unwritten)."""

    __slots__ = ("indices", "oob_mode")
    opcode = "DmaGather"

    def __init__(self, engine: str, dst: TileAP, src: HbmAP, indices: TileAP, queue: str, oob_mode: str):
        super().__init__(engine, dst, src, queue)
        self.reads = (src, indices)
        self.indices = indices
        self.oob_mode = oob_mode

    def describe(self) -> str:
        return f"DmaGather[{self.queue}]"


class DmaScatter(DmaCopy):
    """The reverse of :class:`DmaGather`: partition ``p`` of ``src`` is written to row
    ``indices[p]`` of ``dst`` [rows, D]. Any row of ``dst`` may be written, so the instruction
    writes all of it; two partitions naming one row are an error (the order of their writes is
    not defined on hardware)."""

    __slots__ = ("indices", "oob_mode")
    opcode = "DmaScatter"

    def __init__(self, engine: str, dst: HbmAP, src: TileAP, indices: TileAP, queue: str, oob_mode: str):
        super().__init__(engine, dst, src, queue)
        self.reads = (src, indices)
        self.indices = indices
        self.oob_mode = oob_mode

    def describe(self) -> str:
        return f"DmaScatter[{self.queue}]"


class MatMul(Instruction):
    """LoadStationary + MultiplyMoving: ``dst[M,N] (+)= stationary[K,M]ᵀ @ moving[K,N]``."""

    __slots__ = ("dst", "stationary", "moving", "accumulate", "double_row", "load_stationary")
    opcode = "MatMul"

    def __init__(self, dst: TileAP, stationary: TileAP, moving: TileAP, accumulate: bool, double_row: bool):
        # Instruction.__init__ spelled out: a matmul kernel makes tens of thousands of these
        self.index = -1
        self.engine = "Tensor"
        self.reads: tuple[AP, ...] = (stationary, moving, dst) if accumulate else (stationary, moving)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.stationary = stationary
        self.moving = moving
        self.accumulate = accumulate
        self.double_row = double_row
        self.load_stationary = True  # False when the same stationary is still in the array

    @property
    def macs(self) -> int:
        return self.stationary.p_count * self.stationary.free_size * self.moving.free_size


class Transpose(Instruction):
    """PE-array transpose (``nc_transpose`` on TensorE): ``dst[F,P] = data[P,F]ᵀ``, bit exact."""

    __slots__ = ("dst", "data", "load_stationary")
    opcode = "Transpose"

    def __init__(self, dst: TileAP, data: TileAP):
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = "Tensor"
        self.reads: tuple[AP, ...] = (data,)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data = data
        self.load_stationary = True


class Activation(Instruction):
    """ScalarE ``dst = f(data * scale + bias)`` with an optional reduction along the free axis."""

    __slots__ = ("dst", "data", "func", "scale", "bias", "reduce_op", "reduce_res")
    opcode = "Activation"

    def __init__(self, dst: TileAP, data: TileAP, func: str, scale: float | TileAP, bias: float | TileAP,
                 reduce_op: str | None, reduce_res: TileAP | None):
        # the reads: data, then scale and bias when they are tiles
        if isinstance(scale, TileAP):
            reads: tuple[AP, ...] = (data, scale, bias) if isinstance(bias, TileAP) else (data, scale)
        else:
            reads = (data, bias) if isinstance(bias, TileAP) else (data,)
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = "Scalar"
        self.reads = reads
        self.writes: tuple[AP, ...] = (dst,) if reduce_res is None else (dst, reduce_res)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data = data
        self.func = func
        self.scale = scale
        self.bias = bias
        self.reduce_op = reduce_op
        self.reduce_res = reduce_res

    def describe(self) -> str:
        return f"Activation[{self.func}]"


class TensorTensor(Instruction):
    """Elementwise ``dst = data1 op data2``."""

    __slots__ = ("dst", "data1", "data2", "op")
    opcode = "TensorTensor"

    def __init__(self, engine: str, dst: TileAP, data1: TileAP, data2: TileAP, op: str):
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = engine
        self.reads: tuple[AP, ...] = (data1, data2)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data1 = data1
        self.data2 = data2
        self.op = op

    def describe(self) -> str:
        return f"TensorTensor[{self.op}]"


class TensorScalar(Instruction):
    """``dst = (data op0 operand0) op1 operand1``; operands are immediates or per-partition
    [P,1] tiles. ``reverse0/1`` swap the operand order of each op."""

    __slots__ = ("dst", "data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1")
    opcode = "TensorScalar"

    def __init__(self, engine: str, dst: TileAP, data: TileAP, op0: str, operand0: float | TileAP,
                 op1: str | None, operand1: float | TileAP | None, reverse0: bool, reverse1: bool):
        # the reads: data, then operand0 and operand1 when they are tiles
        if isinstance(operand0, TileAP):
            reads: tuple[AP, ...] = (data, operand0, operand1) if isinstance(operand1, TileAP) else (data, operand0)
        else:
            reads = (data, operand1) if isinstance(operand1, TileAP) else (data,)
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = engine
        self.reads = reads
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data = data
        self.op0 = op0
        self.operand0 = operand0
        self.op1 = op1
        self.operand1 = operand1
        self.reverse0 = reverse0
        self.reverse1 = reverse1

    def describe(self) -> str:
        return f"TensorScalar[{self.op0}{',' + self.op1 if self.op1 else ''}]"


class TensorReduce(Instruction):
    """Reduce ``data`` along free axes ``axes`` (1-based, as in NKI) with ``op``."""

    __slots__ = ("dst", "data", "op", "axes", "negate")
    opcode = "TensorReduce"

    def __init__(self, engine: str, dst: TileAP, data: TileAP, op: str, axes: tuple[int, ...], negate: bool):
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = engine
        self.reads: tuple[AP, ...] = (data,)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data = data
        self.op = op
        self.axes = axes
        self.negate = negate

    def describe(self) -> str:
        return f"TensorReduce[{self.op}]"


class TensorCopy(Instruction):
    """``dst = data`` with a dtype cast (round-to-nearest-even); PSUM evacuation uses this."""

    __slots__ = ("dst", "data")
    opcode = "TensorCopy"

    def __init__(self, engine: str, dst: TileAP, data: TileAP):
        # Instruction.__init__ spelled out: a kernel makes thousands of these
        self.index = -1
        self.engine = engine
        self.reads: tuple[AP, ...] = (data,)
        self.writes: tuple[AP, ...] = (dst,)
        self.deps: tuple[int, ...] = ()
        self.first_deps: tuple[int, ...] | None = None
        self.label = ""
        self.dst = dst
        self.data = data


class Memset(Instruction):
    __slots__ = ("dst", "value")
    opcode = "Memset"

    def __init__(self, engine: str, dst: TileAP, value: float):
        super().__init__(engine, (), (dst,))
        self.dst = dst
        self.value = value


class Iota(Instruction):
    """GpSimd ``dst[p, i...] = base + channel_multiplier*p + sum(pattern_stride_k * i_k)``."""

    __slots__ = ("dst", "base", "channel_multiplier", "pattern")
    opcode = "Iota"

    def __init__(self, dst: TileAP, base: int, channel_multiplier: int, pattern: tuple[int, ...]):
        super().__init__("GpSimd", (), (dst,))
        self.dst = dst
        self.base = base
        self.channel_multiplier = channel_multiplier
        self.pattern = pattern


class AffineSelect(Instruction):
    """GpSimd ``dst = data where (offset + channel_multiplier*p + sum(pattern_k*i_k)) cmp 0
    else on_false``: masks such as causal attention's lower triangle."""

    __slots__ = ("dst", "data", "cmp", "offset", "channel_multiplier", "pattern", "on_false")
    opcode = "AffineSelect"

    def __init__(self, dst: TileAP, data: TileAP, cmp: str, offset: int, channel_multiplier: int,
                 pattern: tuple[int, ...], on_false: float):
        super().__init__("GpSimd", (data,), (dst,))
        self.dst = dst
        self.data = data
        self.cmp = cmp
        self.offset = offset
        self.channel_multiplier = channel_multiplier
        self.pattern = pattern
        self.on_false = on_false


# ---------------------------------------------------------------------------------------------
# Instructions NKI kernels use beyond the core set (nki.isa, datasheet §7)
# ---------------------------------------------------------------------------------------------


class TensorTensorScan(Instruction):
    """VectorE scan along the free axis: ``dst[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0])``,
    then ``dst[:, i] = op1(op0(data0[:, i], dst[:, i-1]), data1[:, i])`` (``nisa.tensor_tensor_scan``),
    ``reverse0/1`` swapping each op's operands. ``initial`` is an immediate or a [P, 1] tile."""

    __slots__ = ("dst", "data0", "data1", "initial", "op0", "op1", "reverse0", "reverse1")
    opcode = "TensorTensorScan"

    def __init__(self, dst: TileAP, data0: TileAP, data1: TileAP, initial: float | TileAP, op0: str, op1: str,
                 reverse0: bool, reverse1: bool):
        reads: list[AP] = [data0, data1] + ([initial] if isinstance(initial, TileAP) else [])
        super().__init__("Vector", tuple(reads), (dst,))
        self.dst, self.data0, self.data1, self.initial = dst, data0, data1, initial
        self.op0, self.op1, self.reverse0, self.reverse1 = op0, op1, reverse0, reverse1

    def describe(self) -> str:
        return f"TensorTensorScan[{self.op0},{self.op1}]"


class ScalarTensorTensor(Instruction):
    """VectorE ``dst = (data op0 operand0) op1 operand1``: ``operand0`` an immediate or [P, 1]
    tile, ``operand1`` a tile shaped like ``data`` (``nisa.scalar_tensor_tensor``)."""

    __slots__ = ("dst", "data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1")
    opcode = "ScalarTensorTensor"

    def __init__(self, dst: TileAP, data: TileAP, op0: str, operand0: float | TileAP, op1: str, operand1: TileAP,
                 reverse0: bool, reverse1: bool):
        reads: list[AP] = [data, operand1] + ([operand0] if isinstance(operand0, TileAP) else [])
        super().__init__("Vector", tuple(reads), (dst,))
        self.dst, self.data, self.op0, self.operand0 = dst, data, op0, operand0
        self.op1, self.operand1, self.reverse0, self.reverse1 = op1, operand1, reverse0, reverse1

    def describe(self) -> str:
        return f"ScalarTensorTensor[{self.op0},{self.op1}]"


class CopyPredicated(Instruction):
    """VectorE ``dst = src where predicate (!= 0) else dst`` (``nisa.tensor_copy_predicated``):
    the elements the predicate rejects keep their values, so ``dst`` is read too. ``src`` is a
    tile or an immediate; ``reverse`` inverts the predicate."""

    __slots__ = ("dst", "src", "predicate", "reverse")
    opcode = "CopyPredicated"

    def __init__(self, dst: TileAP, src: TileAP | float, predicate: TileAP, reverse: bool):
        reads: list[AP] = [predicate, dst] + ([src] if isinstance(src, TileAP) else [])
        super().__init__("Vector", tuple(reads), (dst,))
        self.dst, self.src, self.predicate, self.reverse = dst, src, predicate, reverse


class RangeSelect(Instruction):
    """VectorE: keep ``data[p, i]`` where ``(range_start + i) cmp0 bound0[p]`` and
    ``(range_start + i) cmp1 bound1[p]``, else ``on_false``; optionally the per-partition max
    of the result into ``reduce_res`` (``nisa.range_select``)."""

    __slots__ = ("dst", "data", "cmp0", "cmp1", "bound0", "bound1", "range_start", "on_false", "reduce_res")
    opcode = "RangeSelect"

    def __init__(self, dst: TileAP, data: TileAP, cmp0: str, cmp1: str, bound0: TileAP, bound1: TileAP,
                 range_start: int, on_false: float, reduce_res: TileAP | None):
        writes: tuple[AP, ...] = (dst,) if reduce_res is None else (dst, reduce_res)
        super().__init__("Vector", (data, bound0, bound1), writes)
        self.dst, self.data, self.cmp0, self.cmp1 = dst, data, cmp0, cmp1
        self.bound0, self.bound1, self.range_start, self.on_false, self.reduce_res = (bound0, bound1, range_start,
                                                                                     on_false, reduce_res)

    def describe(self) -> str:
        return f"RangeSelect[{self.cmp0},{self.cmp1}]"


def dropout_keep(seed: int, counters: np.ndarray, prob: float) -> np.ndarray:
    """Which elements :class:`Dropout` keeps: a counter-based generator (as flash attention's
    Philox dropout is), so an element's draw depends only on ``seed`` and its counter, never on
    how a kernel tiles the tensor. The draw is a 32-bit integer hash (splitmix32's finaliser) of
    ``seed`` and the counter; an element is dropped when ``draw < prob * 2**32``."""
    x = (np.asarray(counters, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B9)) \
        & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    return x >= np.uint64(min(1 << 32, int(round(prob * 2.0 ** 32))))


class Dropout(Instruction):
    """VectorE ``dst = data`` with each element replaced by zero with probability ``prob``
    (``nisa.dropout``: no rescaling; the kernel scales the kept values). Which elements drop is
    :func:`dropout_keep` of ``seed`` and the element's counter ``offset + p * row_stride + i``
    (partition ``p``, flat free index ``i``); the hardware draws from its engine's generator
    instead, so only the drop rate, not the pattern, is the hardware's."""

    __slots__ = ("dst", "data", "prob", "seed", "offset", "row_stride")
    opcode = "Dropout"

    def __init__(self, dst: TileAP, data: TileAP, prob: float, seed: int, offset: int, row_stride: int):
        super().__init__("Vector", (data,), (dst,))
        self.dst, self.data, self.prob = dst, data, prob
        self.seed, self.offset, self.row_stride = seed, offset, row_stride


class Reciprocal(Instruction):
    """VectorE ``dst = 1 / data`` (``nisa.reciprocal``)."""

    __slots__ = ("dst", "data")
    opcode = "Reciprocal"

    def __init__(self, dst: TileAP, data: TileAP):
        super().__init__("Vector", (data,), (dst,))
        self.dst, self.data = dst, data


class Max8(Instruction):
    """VectorE ``dst[p, 0:8]`` = the eight largest values of ``data[p, :]``, largest first
    (``nisa.max8``: the first step of a top-k, as the NKI library's router does it)."""

    __slots__ = ("dst", "data")
    opcode = "Max8"

    def __init__(self, dst: TileAP, data: TileAP):
        super().__init__("Vector", (data,), (dst,))
        self.dst, self.data = dst, data


class FindIndex8(Instruction):
    """VectorE ``dst[p, i]`` = the first position in ``data[p, :]`` that holds ``vals[p, i]``, for
    the eight values of ``vals`` (``nisa.nc_find_index8``; a value not found gives 2^32 - 1)."""

    __slots__ = ("dst", "data", "vals")
    opcode = "FindIndex8"

    def __init__(self, dst: TileAP, data: TileAP, vals: TileAP):
        super().__init__("Vector", (data, vals), (dst,))
        self.dst, self.data, self.vals = dst, data, vals


class DmaTranspose(DmaCopy):
    """A DMA that transposes on the way (``nisa.dma_transpose``, NC-v3+): ``dst[P, K] = src[K, P]ᵀ``
    from HBM or SBUF into SBUF, bit exact, at a fraction of the copy rate (datasheet §6)."""

    __slots__ = ()
    opcode = "DmaTranspose"

    def describe(self) -> str:
        return f"DmaTranspose[{self.queue}]"


class MatMulMx(MatMul):
    """TensorE MX matmul (``nisa.nc_matmul_mx``, NC-v4): stationary [128, M] and moving [128, N]
    in quad-packed MXFP8/MXFP4 (four values of K = p, p+128, p+256, p+384 per element), each
    32-value group along K (8 partitions x 4) dequantized by its uint8 E8M0 scale, which sits at
    partition ``32*(p//32) + (p%32)//8`` of the scale tile; contracts K = 512 in the cycles of a
    bf16 matmul of K = 128 (datasheet §4.2, S10/S22)."""

    __slots__ = ("stationary_scale", "moving_scale")
    opcode = "MatMulMx"

    def __init__(self, dst: TileAP, stationary: TileAP, moving: TileAP, stationary_scale: TileAP,
                 moving_scale: TileAP, accumulate: bool):
        super().__init__(dst, stationary, moving, accumulate, False)
        self.reads = self.reads + (stationary_scale, moving_scale)
        self.stationary_scale, self.moving_scale = stationary_scale, moving_scale

    @property
    def macs(self) -> int:
        return 4 * self.stationary.p_count * self.stationary.free_size * self.moving.free_size
