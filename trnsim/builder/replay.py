"""Replaying what a kernel emitted: :class:`Replay` templates (a run of instructions emitted
again on other HBM views), the instruction copies they are made of, the :class:`ViewCache` of
operand views, and :func:`stream_fingerprint`, what two builds are compared by."""

from __future__ import annotations

import array
import functools

from typing import TYPE_CHECKING, Any

from ..isa import (
    Activation,
    AffineSelect,
    Allocation,
    HbmAP,
    Instruction,
    MatMul,
    Memset,
    TensorCopy,
    TensorReduce,
    TensorScalar,
    TensorTensor,
    TileAP,
    Transpose,
    row_major,
)
from ..native.dtypes import Dtype
from . import deps

if TYPE_CHECKING:
    from .kernel import Kernel



def _fingerprint_operand(x: Any) -> Any:
    if isinstance(x, TileAP):
        a = x.alloc
        return ("tile", a.space, a.uid, a.addr, a.nbytes, x.p_start, x.p_count, x.offset, x.dims, x.dtype.name)
    if isinstance(x, HbmAP):
        return ("hbm", x.tensor.name, x.offset, x.dims, x.box)
    if isinstance(x, tuple):
        return tuple(_fingerprint_operand(y) for y in x)
    return x


@functools.cache
def slot_names(cls: type) -> tuple[str, ...]:
    """Every slot of an instruction class: its classes' ``__slots__``, base class first, the
    weak-reference list left out (what :func:`stream_fingerprint` reads and :func:`_cloner` copies)."""
    return tuple(n for c in reversed(cls.__mro__) for n in getattr(c, "__slots__", ()) if n != "__weakref__")


def stream_fingerprint(kern: "Kernel") -> list[tuple[Any, ...]]:
    """Everything the simulator, the values path and the reports read of each instruction:
    its type, opcode and every slot (index, engine, operands as memory and geometry, deps,
    first_deps, load_stationary, DMA plan, ...). Two builds of a kernel made the same stream
    when their fingerprints are equal (how fast builds are checked against the reference)."""
    out = []
    for ins in kern.instructions:
        cls = type(ins)
        out.append((cls.__name__, ins.opcode, ins.describe())
                   + tuple((n, _fingerprint_operand(getattr(ins, n, None))) for n in slot_names(cls)))
    return out


class ViewCache:
    """Operand views a kernel builder slices again and again, made once per kernel: ``get(key,
    make)`` is ``make()``: slices (or lists of them) of the views in ``key`` that its ints name
    (the caller keeps one meaning per key shape). Views are immutable and a :class:`TilePool`
    hands out the same view for the same request, so a cached slice is the one slicing again
    would make; a new allocation comes as a new view, hence a new key. In a
    :func:`reference_build` every view is made afresh (so the equivalence test checks the cache
    too)."""

    __slots__ = ("_views",)

    def __init__(self, kern: "Kernel"):
        self._views: dict[tuple[Any, ...], Any] | None = None if kern.reference else {}

    def get(self, key: tuple[Any, ...], make: Any) -> Any:
        views = self._views
        if views is None:
            return make()
        v = views.get(key)
        if v is None:
            v = views[key] = make()
        return v

class Replay:
    """A run of instructions a kernel emitted, to emit again with other HBM views on some DMAs'
    HBM side (:meth:`Kernel.replay_template`, :meth:`Kernel.replay`): the instructions, their
    accesses as the tracker's region ids (``[key, dma, first, nr, reads..., nw, writes...]``
    each), the replaced sides ``(position, src?, index in spec)``, every tile allocation they
    touch; what decides their LoadStationary flags (the allocations written before the first
    matmul, its stationary's key and whether it loaded it) and the loaded stationary after them;
    the tile operands a replay replaces, if any (``tile_sides``: a block of another buffer, read
    the same way)."""

    __slots__ = ("ins", "spec", "sides", "allocs", "unloads", "first_key", "first_loads", "loaded_after", "cloners",
                 "firsts", "tile_sides")

    def __init__(self, ins: list[Instruction], spec: "array.array[int]", sides: list[tuple[int, bool, int]],
                 allocs: tuple[Allocation, ...], unloads: frozenset[int], first_key: tuple[Any, ...],
                 first_loads: bool, loaded_after: tuple[Any, ...] | None,
                 tile_sides: list[tuple[int, tuple[str, ...], tuple[int, ...], tuple[int, ...]]]) -> None:
        self.ins, self.spec, self.sides, self.allocs = ins, spec, sides, allocs
        self.unloads, self.first_key, self.first_loads, self.loaded_after = unloads, first_key, first_loads, loaded_after
        # tile operands to replace (replay_template's ``tiles``): (position, slot names holding
        # the view, its indices in reads, its indices in the spec)
        self.tile_sides = tile_sides
        # matmuls and PE transposes have a first operand (stationary / data): their first_deps.
        # The copies are made in C (deps.native_clone.replay) when every class is one it can copy, else by
        # the generated Python cloners
        self.firsts: bytes | None = bytes(type(x) in FIRST_OPERAND_OPS for x in ins) if deps.native_clone is not None else None
        if self.firsts is not None:
            try:
                for cls in {type(x) for x in ins}:
                    deps.native_clone.layout(cls)
            except TypeError:
                self.firsts = None
        self.cloners = None if self.firsts is not None else [_cloner(type(x), type(x) in FIRST_OPERAND_OPS) for x in ins]


def stationary_key(s: TileAP) -> tuple[Any, ...]:
    """What the builder compares to know a matmul's stationary is still loaded (``_loaded_stationary``)."""
    return (s.alloc.uid, s.p_start, s.p_count, s.offset, s.dims, s.dtype.name)


_CLONERS: dict[tuple[type, bool], Any] = {}
FIRST_OPERAND_OPS = (MatMul, Transpose)  # the instructions the tracker records with a first operand (reads[0])
# VectorE / ScalarE / GpSimd instructions a template may hold: every operand a tile (reads and
# writes), recorded under their engine's key without a first operand, no other state read
REPLAYABLE_OPS = frozenset((TensorCopy, Activation, TensorScalar, TensorTensor, TensorReduce, AffineSelect, Memset))


def _cloner(cls: type, first: bool) -> Any:
    """``clone(x, index, deps, first_deps)``: a copy of ``x`` (an instance of ``cls``, every
    slot shallow) with those fields replaced (``first_deps`` None unless ``first``: the tracker
    gave the instruction no first operand); one generated function per class, as copying a
    slotted object attribute by attribute in a loop costs several times more."""
    f = _CLONERS.get((cls, first))
    if f is None:
        names = [n for n in slot_names(cls) if n not in ("index", "deps", "first_deps")]
        body = "".join(f"\n    y.{n} = x.{n}" for n in names)
        ns: dict[str, Any] = {"new": object.__new__, "C": cls}
        exec(f"def clone(x, i, d, f):\n    y = new(C)\n    y.index = i\n    y.deps = d\n    "
             f"y.first_deps = {'f' if first else 'None'}{body}\n    return y", ns)
        f = _CLONERS[(cls, first)] = ns["clone"]
    return f


def free_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def tile_view(alloc: Allocation, shape: tuple[int, ...], dt: Dtype) -> TileAP:
    return TileAP(alloc, alloc.p_start, shape[0], 0, row_major(shape[1:] or (1,)), dt)
