"""The machinery under ``trnsim.nki``: tensors and their index expressions, the trace of one
kernel, and deferred results.

An NKI kernel is Python that runs once, at trace time, to produce a flat list of ``nki.isa``
instructions (NKI Language Guide, "Compilation Model"). Here every ISA call emits one
instruction into a :class:`trnsim.kernel.Kernel`, built with unbounded SBUF/PSUM
(:func:`trnsim.schedule.unbounded_kernel`): as on Neuron, the compiler, here the scheduling pass,
decides where tiles live and in which order independent instructions issue.

Tensors (:class:`NkiTensor`) are views: storage (an HBM tensor or an on-chip tile) plus, for each
storage dimension, an affine expression over *iterators*, one iterator per axis of the view.
Slices, integers, ``nl.arange``/``nl.mgrid`` index arrays and ``nl.ds`` all become such
expressions, so indexing composes, and a mask (``i_p < 64``) is a range restriction on an
iterator that applies to every operand of the masked instruction at once. A view turns into a
builder access pattern (:class:`trnsim.isa.HbmAP` / :class:`trnsim.isa.TileAP`) only when an
instruction is emitted.

The legacy API returns results (``t = nisa.activation(op=nl.exp, data=x)``) where the current
one takes ``dst``. A returned result is *deferred*: it becomes an instruction writing wherever
it goes next. Assigned into a view (``out[...] = nl.load(x)``) or accumulated into PSUM
(``acc += nisa.nc_matmul(a, b)``) it writes there, as the Neuron compiler folds it; used any
other way, or once anything else is emitted, it gets a tile of its own first.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..isa import HbmAP, HbmTensor, KernelError, MatMul, TileAP, span
from ..isa import norm_index as _isa_norm_index
from ..builder.kernel import Kernel
from ..builder.rules import max_instructions
from ..native.dtypes import Dtype, get_dtype


class _Api:
    """The ``nl.*`` and ``nisa.*`` modules that NkiTensor's operators and assignments call.
    Both sit above this module (they import it), so each hands itself down when it is imported
    (:mod:`trnsim.nki` imports both before anything can trace): the core never imports upward."""

    nl: Any = None
    nisa: Any = None


_api = _Api()


def provide(*, nl: Any = None, nisa: Any = None) -> None:
    """Called by :mod:`trnsim.nki.language` and :mod:`trnsim.nki.isa` at import."""
    if nl is not None:
        _api.nl = nl
    if nisa is not None:
        _api.nisa = nisa

__all__ = ["NkiError", "NkiTensor", "Trace", "current", "unsupported"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the trnsim package


class NkiError(KernelError):
    """An NKI kernel uses something trnsim does not support, or breaks a hardware rule. One line,
    prefixed with the kernel file and line it comes from."""


def call_site(skip_internal: bool = True) -> str:
    """``file.py:LINE`` of the innermost frame outside trnsim: the user's NKI call."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not (skip_internal and fn.startswith(PACKAGE_DIR + os.sep)):
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return ""


def unsupported(name: str, why: str = "") -> Callable[..., Any]:
    """A stand-in for an NKI API trnsim does not model: calling it fails with one line."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NkiError(f"{name} is not supported by trnsim.nki" + (f": {why}" if why else ""))

    stub.__name__ = name.rsplit(".", 1)[-1]
    stub.__qualname__ = name
    stub.__doc__ = f"Not supported by trnsim.nki{': ' + why if why else ''}."
    return stub


# ---------------------------------------------------------------------------------------------
# Index expressions
# ---------------------------------------------------------------------------------------------


class Iter:
    """One axis of an index space: ``0 .. size-1``. ``pos`` is its place in an ``nl.arange`` /
    ``nl.mgrid`` grid (None for the axis a slice makes), which orders the axes of a view."""

    __slots__ = ("size", "pos", "__weakref__")
    _ids = itertools.count()

    def __init__(self, size: int, pos: int | None = None):
        self.size = int(size)
        self.pos = pos

    def __repr__(self) -> str:
        return f"iter[{self.size}]" + (f"@{self.pos}" if self.pos is not None else "")


class Affine:
    """``const + sum(coef * iterator)``: an index expression (``nl.arange(128)[:, None] + 64``).
    Comparisons give a :class:`Predicate` (a mask)."""

    __slots__ = ("const", "terms")

    def __init__(self, const: int = 0, terms: Iterable[tuple[Iter, int]] = ()):
        self.const = int(const)
        merged: dict[Iter, int] = {}
        for it, c in terms:
            merged[it] = merged.get(it, 0) + int(c)
        # a zero coefficient stays: the iterator is still an axis (``nl.arange(128)[:, None] * 0``
        # broadcasts along it with stride 0)
        self.terms = tuple(merged.items())

    @staticmethod
    def of(x: Any) -> "Affine":
        if isinstance(x, Affine):
            return x
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise NkiError(f"index expressions combine integers and nl.arange/nl.mgrid indices, got {type(x).__name__}")
        return Affine(int(x))

    def iters(self) -> tuple[Iter, ...]:
        return tuple(it for it, _ in self.terms)

    def coef(self, it: Iter) -> int:
        for i, c in self.terms:
            if i is it:
                return c
        return 0

    def subst(self, sub: dict[Iter, "Affine"]) -> "Affine":
        const, terms = self.const, []
        for it, c in self.terms:
            if it in sub:
                e = sub[it]
                const += c * e.const
                terms.extend((j, c * k) for j, k in e.terms)
            else:
                terms.append((it, c))
        return Affine(const, terms)

    def bounds(self, box: dict[Iter, tuple[int, int]] | None = None) -> tuple[int, int]:
        """(min, max) over the iterators' ranges (inclusive)."""
        lo = hi = self.const
        for it, c in self.terms:
            a, b = (box or {}).get(it, (0, it.size))
            lo += min(c * a, c * (b - 1))
            hi += max(c * a, c * (b - 1))
        return lo, hi

    # arithmetic
    def __add__(self, o: Any) -> "Affine":
        o = Affine.of(o)
        return Affine(self.const + o.const, self.terms + o.terms)

    __radd__ = __add__

    def __neg__(self) -> "Affine":
        return Affine(-self.const, [(it, -c) for it, c in self.terms])

    def __sub__(self, o: Any) -> "Affine":
        return self + (-Affine.of(o))

    def __rsub__(self, o: Any) -> "Affine":
        return Affine.of(o) + (-self)

    def __mul__(self, o: Any) -> "Affine":
        if isinstance(o, Affine):
            if o.terms and self.terms:
                raise NkiError("an index expression cannot multiply two nl.arange/nl.mgrid indices")
            return self * o.const if not o.terms else o * self.const
        k = Affine.of(o).const
        return Affine(self.const * k, [(it, c * k) for it, c in self.terms])

    __rmul__ = __mul__

    def __getitem__(self, key: Any) -> "Affine":
        """``nl.arange(n)[:, None]``: place a one-axis expression in a grid of len(key) axes."""
        if not isinstance(key, tuple):
            key = (key,)
        if len(self.terms) != 1 or self.terms[0][1] != 1 or self.const != 0:
            raise NkiError("only nl.arange(n) can be placed in a grid with [:, None] / [None, :]")
        slots = [i for i, k in enumerate(key) if isinstance(k, slice)]
        if len(slots) != 1 or any(k is not None for i, k in enumerate(key) if i != slots[0]):
            raise NkiError(f"nl.arange(n)[{key}]: expected one ':' and None elsewhere, e.g. [:, None]")
        return Affine(0, [(Iter(self.terms[0][0].size, slots[0]), 1)])

    def _cmp(self, op: str, o: Any) -> "Predicate":
        return Predicate([(self - Affine.of(o), op)])

    def __lt__(self, o: Any) -> "Predicate":
        return self._cmp("<", o)

    def __le__(self, o: Any) -> "Predicate":
        return self._cmp("<=", o)

    def __gt__(self, o: Any) -> "Predicate":
        return self._cmp(">", o)

    def __ge__(self, o: Any) -> "Predicate":
        return self._cmp(">=", o)

    def __eq__(self, o: Any) -> "Predicate":  # type: ignore[override]
        return self._cmp("==", o)

    def __ne__(self, o: Any) -> "Predicate":  # type: ignore[override]
        return self._cmp("!=", o)

    __hash__ = None  # type: ignore[assignment]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(it.size for it in self.iters())

    def __repr__(self) -> str:
        return " + ".join([str(self.const)] + [f"{c}*{it!r}" for it, c in self.terms])


class Predicate:
    """A conjunction of ``expr OP 0`` conditions on index expressions: an NKI mask."""

    __slots__ = ("conds",)

    def __init__(self, conds: list[tuple[Affine, str]]):
        self.conds = conds

    def __and__(self, o: Any) -> "Predicate":
        if not isinstance(o, Predicate):
            raise NkiError("a mask combines conditions on nl.arange/nl.mgrid indices with '&'")
        return Predicate(self.conds + o.conds)

    def __or__(self, o: Any) -> "Predicate":
        raise NkiError("masks combined with '|' are not supported by trnsim.nki (only '&' of per-axis bounds)")

    def __bool__(self) -> bool:
        raise NkiError("a mask (a comparison of nl.arange/nl.mgrid indices) has no truth value at trace time; "
                       "pass it as mask=")

    def box(self) -> dict[Iter, tuple[int, int]] | None:
        """The iterator ranges the mask keeps, or None when it keeps nothing. Each condition must
        bound one iterator: masks are boxes (per-axis ranges) in trnsim."""
        box: dict[Iter, tuple[int, int]] = {}
        for e, op in self.conds:
            if not e.terms:
                v = e.const
                if not {"<": v < 0, "<=": v <= 0, ">": v > 0, ">=": v >= 0, "==": v == 0, "!=": v != 0}[op]:
                    return None
                continue
            if len(e.terms) != 1:
                raise NkiError("a mask that relates two indices (e.g. i_p < i_f) is not supported by trnsim.nki; "
                               "use nisa.affine_select for triangular masks")
            if op == "!=":
                raise NkiError("a mask with '!=' is not supported by trnsim.nki (only per-axis bounds)")
            it, c = e.terms[0]
            lo, hi = box.get(it, (0, it.size))
            # c*i + k OP 0  ->  bound on i
            k = e.const
            if op == "==":
                if k % c:
                    return None
                v = -k // c
                lo, hi = max(lo, v), min(hi, v + 1)
            else:
                strict = op in ("<", ">")
                upper = (op in ("<", "<=")) == (c > 0)  # i < bound (after dividing by c)
                q = -k / c
                if upper:
                    b = math.ceil(q) if strict else math.floor(q) + 1
                    hi = min(hi, b)
                else:
                    b = math.floor(q) + 1 if strict else math.ceil(q)
                    lo = max(lo, b)
            if lo >= hi:
                return None
            box[it] = (lo, hi)
        return box


class MGrid:
    """``nl.mgrid[0:128, 0:512]``: index expressions on a grid; unpacks into one per axis and
    names them ``.p``, ``.x``, ``.y``, ``.z``."""

    def __getitem__(self, key: Any) -> "MGridResult":
        if not isinstance(key, tuple):
            key = (key,)
        exprs = []
        for pos, k in enumerate(key):
            if not isinstance(k, slice) or k.step not in (None, 1):
                raise NkiError(f"nl.mgrid[{key}]: expected unit-step slices like 0:128")
            start = 0 if k.start is None else int(k.start)
            if k.stop is None or int(k.stop) <= start:
                raise NkiError(f"nl.mgrid[{key}]: each slice needs an end above its start")
            exprs.append(Affine(start, [(Iter(int(k.stop) - start, pos), 1)]))
        return MGridResult(exprs)


class MGridResult(tuple):
    @property
    def p(self) -> Affine:
        return self[0]

    @property
    def x(self) -> Affine:
        return self[1]

    @property
    def y(self) -> Affine:
        return self[2]

    @property
    def z(self) -> Affine:
        return self[3]


def arange(start: int, stop: int | None = None) -> Affine:
    """``nl.arange(n)``: an index expression over 0..n-1 (place it with ``[:, None]``)."""
    if stop is None:
        start, stop = 0, start
    start, stop = int(start), int(stop)
    if stop <= start:
        raise NkiError(f"nl.arange({start}, {stop}) is empty")
    return Affine(start, [(Iter(stop - start), 1)])


# ---------------------------------------------------------------------------------------------
# Storage and tensors
# ---------------------------------------------------------------------------------------------

_BUFFERS = {"sbuf": "sbuf", "psum": "psum", "hbm": "hbm", "private_hbm": "hbm", "shared_hbm": "hbm"}


def buffer_name(buffer: Any) -> str:
    b = getattr(buffer, "value", buffer)
    b = getattr(b, "name", b) if not isinstance(b, str) else b
    if b not in _BUFFERS:
        raise NkiError(f"unknown buffer {buffer!r}: expected nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")
    return _BUFFERS[b]


def nki_dtype(dtype: Any, what: str = "dtype") -> Dtype:
    name = getattr(dtype, "name", None) if not isinstance(dtype, (str, np.dtype, type)) else None
    d = name if isinstance(name, str) else dtype
    if isinstance(d, str) and d in ("tfloat32",):
        raise NkiError(f"{what}: tfloat32 is not supported by trnsim (use float32)")
    if isinstance(d, str) and d in ("bool", "bool_"):
        d = "uint8"
    try:
        return get_dtype(d)
    except ValueError as e:
        raise NkiError(f"{what}: {e}") from None


class Store:
    """The memory behind tensors: an HBM tensor (``hbm``) or a tile in SBUF/PSUM."""

    __slots__ = ("kind", "shape", "dtype", "strides", "tensor", "offset", "tile", "pdim", "zero_pending",
                 "mm_written", "other_written", "name", "__weakref__")

    def __init__(self, kind: str, shape: tuple[int, ...], dtype: Dtype, name: str):
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.name = name
        self.tensor: HbmTensor | None = None
        self.offset = 0
        self.tile: TileAP | None = None
        self.pdim = 0
        self.zero_pending = False  # nl.zeros in PSUM: the memset is deferred (a first matmul makes it moot)
        self.mm_written: list[tuple[int, int, int, int]] = []  # PSUM boxes matmuls have written
        self.other_written: list[tuple[int, int, int, int]] = []  # ... and other instructions (Trace.emit)
        # element strides of each dim within a partition (on-chip) or in the tensor (HBM)
        dims = [n for i, n in enumerate(shape) if kind == "hbm" or i != self.pdim]
        acc, st = 1, []
        for n in reversed(dims):
            st.append(acc)
            acc *= n
        st.reverse()
        self.strides = st


class NkiTensor:
    """A view of HBM or on-chip memory (``shape``, ``dtype``, ``buffer``), indexable like NKI
    tensors; or a deferred result that gets its memory when used."""

    __slots__ = ("_st", "_exprs", "_axes", "_pending", "_updated", "__weakref__")

    def __init__(self, st: Store | None, exprs: tuple[Affine, ...], axes: tuple[Iter, ...],
                 pending: "Pending | None" = None):
        self._st = st
        self._exprs = exprs
        self._axes = axes
        self._pending = pending
        self._updated = False  # set on what ``x[i] += y`` returns: already written in place

    @staticmethod
    def full(st: Store) -> "NkiTensor":
        its = tuple(Iter(n) for n in st.shape)
        return NkiTensor(st, tuple(Affine(0, [(it, 1)]) for it in its), its)

    # ---- metadata (never materializes) -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        if self._pending is not None:
            return self._pending.shape
        return tuple(it.size for it in self._axes)

    @property
    def dtype(self) -> str:
        return (self._pending.dtype if self._pending is not None else self._st.dtype).name  # type: ignore[union-attr]

    @property
    def buffer(self) -> str:
        kind = self._pending.buffer if self._pending is not None else self._st.kind  # type: ignore[union-attr]
        return "shared_hbm" if kind == "hbm" else kind

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        if self._pending is not None:
            return f"the {self._pending.name} result" if self._pending.name else "a result"
        return self._st.name if self._st is not None else "a result"

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"NkiTensor({self.name}, shape={self.shape}, dtype={self.dtype}, buffer={self.buffer})"

    # ---- views ---------------------------------------------------------------------------------
    def _store(self) -> Store:
        if self._pending is not None:
            self._pending.materialize(self)
        return self._st  # type: ignore[return-value]

    def __getitem__(self, idx: Any) -> "NkiTensor":
        st = self._store()
        items = norm_index(idx, len(self._axes))
        sub: dict[Iter, Affine] = {}
        new: list[tuple[float, int, Iter]] = []  # (sort key, appearance, iterator)
        onchip = st.kind != "hbm"
        pidx = partition_axis(self) if onchip else -1
        kept: list[int] = []
        for k, (it, e) in enumerate(zip(self._axes, items)):
            what = f"dim {k} of {self.name} (size {it.size})"
            if isinstance(e, slice):
                start, stop, step = e.indices(it.size)
                if step <= 0:
                    raise NkiError(f"slice step must be positive, got {step} for {what}")
                # Python clamps a slice to the sequence; NKI refuses an access past the tensor, as it
                # refuses the same range written as an index expression (resolve)
                first = 0 if e.start is None else e.start + (it.size if e.start < 0 else 0)
                end = it.size if e.stop is None else e.stop + (it.size if e.stop < 0 else 0)
                last = first + (-(-(end - first) // step) - 1) * step
                if first < 0 or last >= it.size:
                    raise NkiError(f"slice {e.start}:{e.stop} reaches index {first if first < 0 else last}, out of "
                                   f"range for {what}")
                n = max(0, -(-(stop - start) // step))
                if n == 0:
                    raise NkiError(f"empty slice {e.start}:{e.stop} for {what}")
                j = Iter(n)
                sub[it] = Affine(start, [(j, step)])
                new.append((k, len(new), j))
                kept.append(k)
            elif isinstance(e, Affine):
                sub[it] = e  # bounds are checked when an instruction uses it, under its mask
                for j in e.iters():
                    if all(j is not x for _, _, x in new):
                        new.append((j.pos if j.pos is not None else k, len(new), j))
                kept.append(k)
            elif isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_)):
                v = int(e) + (it.size if e < 0 else 0)
                if not 0 <= v < it.size:
                    raise NkiError(f"index {int(e)} out of range for {what}")
                if k == pidx:  # the partition dim of an on-chip tile stays, at size 1
                    j = Iter(1)
                    sub[it] = Affine(v, [(j, 1)])
                    new.append((k, len(new), j))
                    kept.append(k)
                else:
                    sub[it] = Affine(v)
            elif isinstance(e, NkiTensor):
                raise NkiError("indexing a tensor with another tensor (dynamic or indirect access) is not supported "
                               "by trnsim.nki; for row gathers use nisa.dma_copy with a gather")
            else:
                raise NkiError(f"unsupported index {e!r}: use integers, slices, nl.ds or nl.arange/nl.mgrid")
        new.sort(key=lambda t: (t[0], t[1]))
        axes = [j for _, _, j in new]
        if onchip and len(axes) < 2:
            # on-chip tensors stay at least 2-D: the last integer-indexed free dim comes back at size 1
            last = max((k for k in range(len(self._axes)) if k not in kept and k != pidx), default=None)
            if last is not None:
                j = Iter(1)
                sub[self._axes[last]] = sub[self._axes[last]] + Affine(0, [(j, 1)])
                axes.append(j)
        exprs = tuple(e.subst(sub) for e in self._exprs)
        return NkiTensor(st, exprs, tuple(axes))

    def __setitem__(self, idx: Any, value: Any) -> None:
        dst = self[idx]
        current().assign(dst, value)

    def reshape(self, *shape: Any) -> "NkiTensor":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(n) for n in shape)
        st = self._store()
        if math.prod(shape) != self.size:
            raise NkiError(f"cannot reshape {self.shape} of {self.name} to {shape}")
        if not is_whole(self):
            raise NkiError(f"reshape of a view of {self.name} is not supported by trnsim.nki; reshape the whole tensor")
        if st.kind != "hbm" and (shape[0] != st.shape[st.pdim] or st.pdim != 0):
            raise NkiError(f"reshape of {self.name} must keep its partition dim {st.shape[st.pdim]} first, got {shape}")
        ns = Store(st.kind, shape, st.dtype, st.name)
        ns.tensor, ns.offset, ns.tile = st.tensor, st.offset, st.tile
        ns.zero_pending, ns.mm_written, ns.other_written = st.zero_pending, st.mm_written, st.other_written
        return NkiTensor.full(ns)

    def view(self, dtype: Any) -> "NkiTensor":
        """The same bytes as another dtype (the last dim rescaled by the element sizes): for HBM
        kernel inputs, e.g. packed MX data passed as uint8/uint32 and viewed as an x4 type."""
        st = self._store()
        dt = nki_dtype(dtype, f"{self.name}.view")
        tr = current()
        if st.kind != "hbm" or st.tensor is None or st.tensor.kind != "input" or not is_whole(self) \
                or st.tensor.name not in tr.inputs:
            raise NkiError(f"{self.name}.view({dt.name}) is supported by trnsim.nki for whole HBM kernel inputs only")
        old = st.dtype
        last = st.shape[-1] * old.itemsize
        if last % dt.itemsize:
            raise NkiError(f"{self.name}.view({dt.name}): the last dim ({st.shape[-1]} x {old.itemsize} bytes) is not a "
                           f"whole number of {dt.itemsize}-byte elements")
        shape = st.shape[:-1] + (last // dt.itemsize,)
        name = f"{st.tensor.name}_as_{dt.name}"
        if name not in tr.kernel.tensors:
            tr.kernel.input(name, shape, dt)
            arr = tr.inputs[st.tensor.name]
            tr.inputs[name] = np.ascontiguousarray(arr).view(dt.np_dtype).reshape(shape) if isinstance(arr, np.ndarray) \
                else arr
        ns = Store("hbm", shape, dt, name)
        ns.tensor = tr.kernel.tensors[name]
        return NkiTensor.full(ns)

    def broadcast_to(self, shape: Sequence[int]) -> "NkiTensor":
        shape = tuple(int(n) for n in shape)
        self._store()
        if len(shape) != len(self._axes):
            raise NkiError(f"broadcast_to: {self.name} has {len(self._axes)} dims, target {shape} has {len(shape)}")
        axes = []
        sub: dict[Iter, Affine] = {}
        for k, (it, n) in enumerate(zip(self._axes, shape)):
            if it.size == n:
                axes.append(it)
            elif it.size == 1:
                if k == 0 and self._st.kind != "hbm":  # type: ignore[union-attr]
                    raise NkiError(f"broadcast_to: cannot broadcast the partition dim of {self.name} (1 -> {n}); "
                                   f"broadcast across partitions with nl.matmul of a ones vector")
                j = Iter(n)
                sub[it] = Affine(0)
                axes.append(j)
            else:
                raise NkiError(f"broadcast_to: cannot broadcast {self.shape} of {self.name} to {shape}")
        return NkiTensor(self._st, tuple(e.subst(sub) for e in self._exprs), tuple(axes))

    def ap(self, pattern: Sequence[Sequence[int]], offset: int | None = None, **kwargs: Any) -> "NkiTensor":
        """A raw hardware access pattern ``[[stride, count], ...]`` over the storage (outer first;
        for SBUF/PSUM the first pair is the partition dim)."""
        if kwargs:
            raise NkiError(f".ap({', '.join(kwargs)}=...): dynamic access patterns are not supported by trnsim.nki")
        st = self._store()
        pat = [(int(s), int(n)) for s, n in pattern]
        axes = tuple(Iter(n) for _, n in pat)
        base = int(offset) if offset is not None else _flat_offset(self)
        if st.kind == "hbm":
            flat = Affine(base, [(it, s) for it, (s, _) in zip(axes, pat)])
            exprs = _unflatten(flat, st)
            return NkiTensor(st, exprs, axes)
        free = math.prod(n for i, n in enumerate(st.shape) if i != st.pdim)
        if pat[0][0] != free:
            raise NkiError(f".ap: the partition stride of {self.name} must be its free size {free}, got {pat[0][0]}")
        p0, f0 = divmod(base, free)
        flat = Affine(f0, [(it, s) for it, (s, _) in zip(axes[1:], pat[1:])])
        exprs = _unflatten(flat, st, partition=Affine(p0, [(axes[0], 1)]))
        return NkiTensor(st, exprs, axes)

    # ---- arithmetic: the nl.* ops --------------------------------------------------------------
    def _binop(self, name: str, other: Any, reverse: bool = False) -> "NkiTensor":
        fn = getattr(_api.nl, name)
        return fn(other, self) if reverse else fn(self, other)

    def __add__(self, o: Any) -> "NkiTensor":
        return self._binop("add", o)

    def __radd__(self, o: Any) -> "NkiTensor":
        return self._binop("add", o, True)

    def __sub__(self, o: Any) -> "NkiTensor":
        return self._binop("subtract", o)

    def __rsub__(self, o: Any) -> "NkiTensor":
        return self._binop("subtract", o, True)

    def __mul__(self, o: Any) -> "NkiTensor":
        return self._binop("multiply", o)

    def __rmul__(self, o: Any) -> "NkiTensor":
        return self._binop("multiply", o, True)

    def __truediv__(self, o: Any) -> "NkiTensor":
        return self._binop("divide", o)

    def __rtruediv__(self, o: Any) -> "NkiTensor":
        return self._binop("divide", o, True)

    def __pow__(self, o: Any) -> "NkiTensor":
        return self._binop("power", o)

    def __neg__(self) -> "NkiTensor":
        return _api.nl.negative(self)

    def __lt__(self, o: Any) -> "NkiTensor":
        return self._binop("less", o)

    def __le__(self, o: Any) -> "NkiTensor":
        return self._binop("less_equal", o)

    def __gt__(self, o: Any) -> "NkiTensor":
        return self._binop("greater", o)

    def __ge__(self, o: Any) -> "NkiTensor":
        return self._binop("greater_equal", o)

    def __and__(self, o: Any) -> "NkiTensor":
        return self._binop("bitwise_and", o)

    def __or__(self, o: Any) -> "NkiTensor":
        return self._binop("bitwise_or", o)

    def __xor__(self, o: Any) -> "NkiTensor":
        return self._binop("bitwise_xor", o)

    def __iadd__(self, o: Any) -> "NkiTensor":
        current().accumulate(self, o, "add")
        return _Updated(self)

    def __isub__(self, o: Any) -> "NkiTensor":
        current().accumulate(self, o, "subtract")
        return _Updated(self)

    def __imul__(self, o: Any) -> "NkiTensor":
        current().accumulate(self, o, "multiply")
        return _Updated(self)

    def __itruediv__(self, o: Any) -> "NkiTensor":
        current().accumulate(self, o, "divide")
        return _Updated(self)

    def __bool__(self) -> bool:
        raise NkiError(f"the values of {self.name} are not known at trace time: a tensor has no truth value "
                       f"(control flow on values needs dynamic loops, not supported by trnsim.nki)")

    __hash__ = object.__hash__


def _Updated(t: NkiTensor) -> NkiTensor:
    """``x[i] += y`` ends in ``x.__setitem__(i, x[i])``: the view comes back marked as already
    written, so the assignment adds no copy."""
    u = NkiTensor(t._st, t._exprs, t._axes)
    u._updated = True
    return u


def norm_index(idx: Any, ndim: int) -> list[Any]:
    if any(i is None for i in (idx if isinstance(idx, tuple) else (idx,))):
        raise NkiError("None (new axis) in an index is not supported by trnsim.nki; use nl.expand_dims")
    return _isa_norm_index(idx, ndim, NkiError)


def partition_axis(t: NkiTensor) -> int:
    """Which axis of the view carries the storage's partition dim (on-chip), or -1."""
    st = t._st
    if st is None or st.kind == "hbm":
        return -1
    pe = t._exprs[st.pdim]
    for k, it in enumerate(t._axes):
        if any(i is it and c for i, c in pe.terms):
            return k
    return -1


def is_whole(t: NkiTensor) -> bool:
    st = t._st
    return st is not None and tuple(it.size for it in t._axes) == st.shape and all(
        e.const == 0 and len(e.terms) == 1 and e.terms[0][0] is it and e.terms[0][1] == 1
        for e, it in zip(t._exprs, t._axes))


def _flat_offset(t: NkiTensor) -> int:
    st = t._st
    assert st is not None
    dims = [d for d in range(len(st.shape)) if st.kind == "hbm" or d != st.pdim]
    return sum(t._exprs[d].const * s for d, s in zip(dims, st.strides))


def _unflatten(flat: Affine, st: Store, partition: Affine | None = None) -> tuple[Affine, ...]:
    """Storage-dim expressions for a flat element expression: all of it on the innermost dim
    (exact for addressing; the storage strides then multiply by 1)."""
    exprs: list[Affine] = []
    dims = [d for d in range(len(st.shape)) if st.kind == "hbm" or d != st.pdim]
    for d in range(len(st.shape)):
        if st.kind != "hbm" and d == st.pdim:
            exprs.append(partition if partition is not None else Affine(0))
        elif d == dims[-1]:
            exprs.append(flat)
        else:
            exprs.append(Affine(0))
    return tuple(exprs)


# ---------------------------------------------------------------------------------------------
# Views -> builder access patterns
# ---------------------------------------------------------------------------------------------


def resolve(t: NkiTensor, box: dict[Iter, tuple[int, int]] | None, what: str) -> HbmAP | TileAP:
    """The builder access pattern of view ``t`` with iterator ranges restricted by ``box``."""
    st = t._store()
    if st.zero_pending:  # a deferred nl.zeros in PSUM read or written by something else than a matmul
        zero_fill(current(), st)
    box = box or {}
    rng = {it: box.get(it, (0, it.size)) for it in t._axes}
    for d, (e, n) in enumerate(zip(t._exprs, st.shape)):
        lo, hi = e.bounds(rng)
        if lo < 0 or hi >= n:
            raise NkiError(f"{what}: index {lo}..{hi} out of range for dim {d} of {st.name} (size {n}); "
                           f"a mask can keep an index expression in range")
    if st.kind == "hbm":
        tensor = st.tensor
        assert tensor is not None
        offset, dims = st.offset, []
        for e, s in zip(t._exprs, st.strides):
            lo_e = e.const + sum(c * rng.get(it, (0, 0))[0] for it, c in e.terms)
            offset += lo_e * s
        for it in t._axes:
            stride = sum(e.coef(it) * s for e, s in zip(t._exprs, st.strides))
            dims.append((stride, rng[it][1] - rng[it][0]))
        lo, hi = span(offset, dims)
        if lo < 0 or hi > tensor.size:
            raise NkiError(f"{what}: the view of {st.name} reaches elements {lo}..{hi - 1}, outside its {tensor.size}")
        return HbmAP(tensor, offset, tuple(dims) or ((1, 1),), _exact_box(t, st, rng))
    base = st.tile
    assert base is not None
    k = partition_axis(t)
    pe = t._exprs[st.pdim]
    if k != 0:
        if k < 0 and len(pe.terms) == 0 and t._axes and t._axes[0].size == 1:
            k = 0  # a constant partition index on a size-1 first axis
        else:
            raise NkiError(f"{what}: the partition dim of {st.name} must be the first dim of the view "
                           f"(got view shape {t.shape}); index its block dims with integers")
    pit = t._axes[0]
    if pe.terms and (len(pe.terms) != 1 or pe.terms[0][1] != 1):
        raise NkiError(f"{what}: partitions of {st.name} must be indexed with step 1, got {pe!r}")
    p_lo = pe.const + (rng[pit][0] if pe.terms else 0)
    p_count = rng[pit][1] - rng[pit][0]
    fdims = [d for d in range(len(st.shape)) if d != st.pdim]
    offset = base.offset
    for d, s in zip(fdims, st.strides):
        e = t._exprs[d]
        offset += (e.const + sum(c * rng.get(it, (0, 0))[0] for it, c in e.terms)) * s
    dims = []
    for it in t._axes[1:]:
        if pe.coef(it):
            raise NkiError(f"{what}: a view of {st.name} uses its partition index on a free dim")
        stride = sum(t._exprs[d].coef(it) * s for d, s in zip(fdims, st.strides))
        dims.append((stride, rng[it][1] - rng[it][0]))
    if not dims:
        dims = [(1, 1)]
    return TileAP(base.alloc, base.p_start + p_lo, p_count, offset, tuple(dims), st.dtype)


def _exact_box(t: NkiTensor, st: Store, rng: dict[Iter, tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """The index box of an HBM view when it is exactly a box of the tensor (each dim indexed by a
    constant or by one unit-step iterator used nowhere else), for exact dependencies."""
    if st.tensor is None or st.shape != st.tensor.shape or st.offset:
        return None
    used: set[int] = set()
    box = []
    for e in t._exprs:
        if not e.terms:
            box.append((e.const, e.const + 1))
            continue
        if len(e.terms) != 1 or abs(e.terms[0][1]) != 1 or id(e.terms[0][0]) in used:
            return None
        it, c = e.terms[0]
        used.add(id(it))
        a, b = rng.get(it, (0, it.size))
        lo = e.const + (c * a if c > 0 else c * (b - 1))
        box.append((lo, lo + (b - a)))
    return tuple(box)


def view_box_bytes(ap: TileAP) -> tuple[int, int, int, int]:
    lo, hi = ap.byte_span()
    return (ap.p_start, ap.p_start + ap.p_count, lo, hi)


# ---------------------------------------------------------------------------------------------
# Deferred results
# ---------------------------------------------------------------------------------------------


class Pending:
    """A result not written anywhere yet: ``emit(dst_view, accumulate)`` writes it."""

    __slots__ = ("shape", "dtype", "buffer", "emit", "matmul", "name", "site")

    def __init__(self, shape: tuple[int, ...], dtype: Dtype, buffer: str, emit: Callable[..., None],
                 matmul: bool = False, name: str = ""):
        self.shape = shape
        self.dtype = dtype
        self.buffer = buffer
        self.emit = emit
        self.matmul = matmul
        self.name = name
        self.site = call_site()  # where the kernel asked for it: errors of its emission name this line

    def run(self, *args: Any) -> None:
        """``emit(*args)``, an error prefixed with the line that asked for the result."""
        try:
            self.emit(*args)
        except KernelError as e:
            msg = str(e)
            if self.site and not msg.startswith(self.site):
                raise NkiError(f"{self.site}: {msg}") from None
            raise

    def materialize(self, t: NkiTensor) -> None:
        """Give ``t`` a tile of its own and write the result there."""
        tr = current()
        if tr.pending is t:
            tr.pending = None
        t._pending = None
        st = tr.new_tile(self.shape, self.dtype, self.buffer, f"{self.name} result" if self.name else "result")
        full = NkiTensor.full(st)
        t._st, t._exprs, t._axes = full._st, full._exprs, full._axes
        self.run(full, False) if self.matmul else self.run(full)


# ---------------------------------------------------------------------------------------------
# The trace of one kernel
# ---------------------------------------------------------------------------------------------

STACK: list["Trace"] = []


def current() -> "Trace":
    if not STACK:
        raise NkiError("an NKI API was called outside a kernel: call it inside a function decorated with "
                       "@nki.jit, run through trnsim.nki")
    return STACK[-1]


class Trace:
    """One kernel being traced: the builder, the deferred result, the SPMD position."""

    def __init__(self, kernel: Kernel, program_id: tuple[int, ...] = (), grid: tuple[int, ...] = ()):
        self.kernel = kernel
        self.config = kernel.config
        self.pending: NkiTensor | None = None
        self.program_id = program_id
        self.grid = grid
        self.extra_deps: dict[int, set[int]] = {}
        self.no_reorder: list[int | None] = []  # stack: last instruction emitted in each no_reorder block
        self.source_lines: list[str] = []
        # a PSUM tile's allocation -> the boxes instructions other than matmuls wrote in it (its
        # Store's other_written): a first `+=` of a matmul there adds to them
        self.psum_boxes: dict[int, list[tuple[int, int, int, int]]] = {}
        self.constants: dict[str, np.ndarray] = {}  # HBM inputs nl.shared_constant made: name -> values
        self.shared_hbm: list[Store] = []  # HBM tensors allocated so far, shared by the programs of a grid
        self.inputs: dict[str, Any] = {}  # the kernel's input arrays by tensor name (for view(dtype))
        self._hbm_seq = 0
        self._names = itertools.count()

    def __enter__(self) -> "Trace":
        STACK.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        STACK.remove(self)

    # ---- memory ------------------------------------------------------------------------------
    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self._names)}"

    def new_tile(self, shape: Sequence[int], dtype: Dtype, buffer: str, name: str = "", *, one_bank: bool = False
                 ) -> Store:
        """Storage for an ``nl.ndarray``: an on-chip tile or an HBM tensor. ``one_bank``: a PSUM
        tile the kernel declares, which NKI limits to one accumulation bank per partition."""
        shape, pdim = _tile_shape(shape)
        name = name or self.name("t")
        if buffer == "hbm":
            if pdim:
                raise NkiError(f"nl.par_dim is for SBUF/PSUM tiles, not HBM tensors ({name})")
            shared = self.shared_hbm
            k = self._hbm_seq
            self._hbm_seq += 1
            if k < len(shared):  # an SPMD program: the k-th HBM tensor is the one program 0 made
                if shared[k].shape != shape or shared[k].dtype != dtype:
                    raise NkiError(f"HBM tensor {name} {shape} differs between SPMD programs ({shared[k].shape})")
                return shared[k]
            st = Store("hbm", shape, dtype, name)
            tname = name
            while tname in self.kernel.tensors:
                tname = self.name(name + "_")
            st.tensor = self.kernel.scratch(tname, shape, dtype)
            shared.append(st)
            return st
        st = Store(buffer, shape, dtype, name)
        st.pdim = pdim
        p = shape[pdim]
        cfg = self.config.core
        limit = cfg.sbuf.partitions if buffer == "sbuf" else cfg.psum.partitions
        if p > limit:
            raise NkiError(f"{buffer.upper()} tile {name} has {p} partitions in dim {pdim} of {shape}; at most "
                           f"{limit} (nl.tile_size.pmax): tile the partition dim")
        free = math.prod(n for i, n in enumerate(shape) if i != pdim)
        if one_bank and buffer == "psum" and free * dtype.itemsize > cfg.psum.bank_bytes:
            # an NKI PSUM tile is one accumulation bank (nl.tile_size.psum_fmax); the builder's
            # own tiles may span banks, an NKI kernel's may not
            raise NkiError(f"PSUM tile {name} of {shape} {dtype.short} takes {free * dtype.itemsize:,} bytes per "
                           f"partition; a PSUM tile is one bank, at most {cfg.psum.bank_bytes:,} bytes per partition "
                           f"(nl.tile_size.psum_fmax fp32 elements): tile the free dim")
        st.tile = self.kernel._allocate(buffer, (p, free), dtype, name, 0, scoped=False)
        if buffer == "psum":
            self.psum_boxes[id(st.tile.alloc)] = st.other_written
        return st

    # ---- emission ----------------------------------------------------------------------------
    def flush(self, keep: NkiTensor | None = None) -> None:
        """Give the deferred result (if any, and not ``keep``) its own tile now."""
        p = self.pending
        if p is not None and p is not keep and p._pending is not None:
            p._pending.materialize(p)
        if p is not keep:
            self.pending = None

    def defer(self, t: NkiTensor) -> NkiTensor:
        self.flush()
        self.pending = t
        return t

    def emit(self, build: Callable[[], Any]) -> Any:
        """Run one builder call, recording where it came from and no_reorder chains."""
        k = self.kernel
        n0 = len(k.instructions)
        ins = build()
        site = call_site()
        for i in range(n0, len(k.instructions)):
            self.source_lines.append(site)
            made = k.instructions[i]
            if self.psum_boxes and not isinstance(made, MatMul):  # a PSUM box a later `+=` of a matmul adds to
                for w in made.writes:
                    if isinstance(w, TileAP) and w.alloc.space == "psum":
                        boxes = self.psum_boxes.get(id(w.alloc))
                        if boxes is not None:
                            boxes.append(view_box_bytes(w))
            if self.no_reorder:
                prev = self.no_reorder[-1]
                if prev is not None:
                    self.extra_deps.setdefault(i, set()).add(prev)
                self.no_reorder[-1] = i
        return ins

    def assign(self, dst: NkiTensor, value: Any) -> None:
        """``dst[...] = value``: a deferred result writes into dst; a tensor is copied; a number
        fills dst."""
        nisa = _api.nisa
        if isinstance(value, NkiTensor) and value._updated and value._st is dst._st:
            return  # x[i] += y already wrote x[i]
        if isinstance(value, NkiTensor) and value._pending is not None and value is self.pending:
            p = value._pending
            _check_assign_shape(dst, p.shape, p.name)
            self.pending = None
            value._pending = None
            value._st, value._exprs, value._axes = dst._st, dst._exprs, dst._axes
            if p.matmul:  # `dst[...] = matmul`: it writes dst (only `+=` adds to what is there)
                matmul_accumulates(self, dst)
                p.run(dst, False)
            else:
                p.run(dst)
            return
        self.flush()
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            nisa.memset(dst, float(value))
            return
        if not isinstance(value, NkiTensor):
            raise NkiError(f"cannot assign {type(value).__name__} to {dst.name}; assign a tile, a result or a number")
        _check_assign_shape(dst, value.shape, value.name)
        if dst.buffer.endswith("hbm") or value.buffer.endswith("hbm"):
            nisa.dma_copy(dst, value)
        else:
            nisa.tensor_copy(dst, value)

    def accumulate(self, dst: NkiTensor, value: Any, op: str) -> None:
        """``dst += value``: a deferred matmul accumulates into PSUM dst; otherwise an in-place
        elementwise op."""
        nisa, nl = _api.nisa, _api.nl
        if (op == "add" and isinstance(value, NkiTensor) and value._pending is not None and value._pending.matmul
                and value is self.pending and dst.buffer == "psum"):
            p = value._pending
            _check_assign_shape(dst, p.shape, p.name)
            self.pending = None
            value._pending = None
            value._st, value._exprs, value._axes = dst._st, dst._exprs, dst._axes
            p.run(dst, matmul_accumulates(self, dst))
            return
        self.flush()
        operand = value
        if isinstance(value, NkiTensor):
            operand = value
            if value.shape != dst.shape and not (len(value.shape) == 2 and value.shape[1] == 1):
                operand = value.broadcast_to(dst.shape)
        if isinstance(operand, NkiTensor) and operand.shape == dst.shape:
            nisa.tensor_tensor(dst, dst, operand, getattr(nl, op))
        else:
            nisa.tensor_scalar(dst, dst, getattr(nl, op), operand)


def _check_assign_shape(dst: NkiTensor, shape: tuple[int, ...], what: str) -> None:
    a = tuple(n for n in dst.shape if n != 1)
    b = tuple(n for n in shape if n != 1)
    if a != b:
        raise NkiError(f"cannot assign a {what or 'value'} of shape {shape} to {dst.name}{list(dst.shape)}: shapes "
                       f"must match (size-1 dims aside)")


def matmul_accumulates(tr: Trace, dst: NkiTensor) -> bool:
    """``accumulate=None``: the first matmul into a PSUM location starts its accumulation group,
    later ones add to it (nc_matmul docs). A deferred nl.zeros memset is then moot."""
    st = dst._store()
    if st.kind != "psum":
        raise NkiError(f"nc_matmul: dst {st.name} is in {st.kind.upper()}; matmuls write PSUM")
    pending_zero, st.zero_pending = st.zero_pending, False
    ap = resolve(dst, None, "nc_matmul")
    assert isinstance(ap, TileAP)
    box = view_box_bytes(ap)
    written = any(b[0] < box[1] and box[0] < b[1] and b[2] < box[3] and box[2] < b[3]
                  for b in (*st.mm_written, *st.other_written))
    if pending_zero:
        base = st.tile
        assert base is not None
        lo, hi = base.byte_span()
        covers = box[0] <= base.p_start and box[1] >= base.p_start + base.p_count and box[2] <= lo and box[3] >= hi
        if not covers:  # the rest of the tile must read as zeros: the memset cannot be skipped
            st.zero_pending = True
            zero_fill(tr, st)
            written = True
    st.mm_written.append(box)
    return written


def zero_fill(tr: Trace, st: Store) -> None:
    """Emit the memset a deferred ``nl.zeros`` in PSUM owes."""
    st.zero_pending = False
    _api.nisa.memset(NkiTensor.full(st), 0.0)


def _tile_shape(shape: Any) -> tuple[tuple[int, ...], int]:
    """(shape, partition dim) of an ``nl.ndarray`` shape that may hold one ``nl.par_dim``."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out, pdim = [], 0
    for i, n in enumerate(shape):
        if isinstance(n, ParDim):
            pdim = i
            n = n.size
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise NkiError(f"tensor shape {tuple(shape)} must be positive integers")
        out.append(int(n))
    if not out:
        raise NkiError("a tensor needs at least one dimension")
    return tuple(out), pdim


class ParDim:
    """``nl.par_dim(n)``: marks the partition dim in a shape with block dims before it."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = int(size)

    def __index__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"par_dim({self.size})"


def as_tensor(x: Any, what: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise NkiError(f"{what}: expected a tensor, got {type(x).__name__}")
    return x


def iter_range(*args: Any) -> Iterator[int]:
    """The iterators of nl.affine_range / sequential_range / static_range: Python ranges (the
    loop unrolls at trace time; the scheduling pass finds what can overlap)."""
    for a in args:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise NkiError(f"loop bounds must be integers at trace time, got {type(a).__name__} (dynamic loops are "
                           f"not supported by trnsim.nki)")
    r = range(*(int(a) for a in args))
    if not STACK or len(r) < _LONG_LOOP:
        return iter(r)
    return _bounded(r, STACK[-1].kernel)


#: iterations from which a loop is checked against the instruction limit after its first one
_LONG_LOOP = 4096


def _bounded(r: range, kernel: Kernel) -> Iterator[int]:
    """``r``'s iterations, refused after the first when it emitted instructions and the loop's
    length would take the kernel past its instruction limit: a runaway bound
    (``nl.sequential_range(10**9)``) was traced at ~50 us an instruction for ~100 s before the
    builder's own limit stopped it."""
    start = len(kernel)
    for n, i in enumerate(r):
        yield i
        if n == 0:
            per = len(kernel) - start
            limit = max_instructions()
            if per and len(kernel) + per * (len(r) - 1) > limit:
                raise NkiError(f"a loop of {len(r):,} iterations emitted {per:,} instruction(s) in its first: the "
                               f"kernel would pass its {limit:,}-instruction limit; check the loop's bounds, or raise "
                               f"the limit with TRNSIM_MAX_INSTRUCTIONS=N")
