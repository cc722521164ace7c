"""Geometry numbers: a tile or HBM view's geometry (memory, partitions, free dims, dtype; not its
address) interned once per view as a small int, so the builder's check and plan caches key on a
few ints instead of hashing views."""

from __future__ import annotations

import itertools
from typing import Any

from ..isa import AP, TileAP

_GEOMETRIES: dict[tuple[Any, ...], int] = {}  # a tile view's geometry -> a small int (process-wide)
# the numbers: next() and dict.setdefault on a tuple of ints and strings are each one step under
# the GIL, so two threads interning two geometries at once never get one number (the check and
# plan caches shared by a process's kernels key on them)
_NUMBERS = itertools.count(1)


def _number(g: tuple[Any, ...]) -> int:
    """``g``'s number, given it now if it has none."""
    return _GEOMETRIES.setdefault(g, next(_NUMBERS))


def arg_key(x: Any) -> Any:
    """What an op's checks read of an operand that is a [P, 1] tile or a number: the tile's
    geometry number (an int), or the number's type (the checks take int and float)."""
    if type(x) is TileAP:
        return x._geo or geometry(x)
    return type(x)


def geometry(ap: TileAP) -> int:
    """The number of ``ap``'s geometry as the matmul checks see it (memory, partitions, free
    dims, dtype; not the address), interned once per view: a key part that hashes as one int."""
    g = (ap.alloc.space, ap.p_start, ap.p_count, ap.dims, ap.dtype.name)
    n = _GEOMETRIES.get(g) or _number(g)
    ap._geo = n
    return n


def dma_geometry(ap: AP) -> int:
    """The interned number of everything :func:`plan_dma` reads of one side of a copy: a tile's
    full geometry (:func:`geometry`, finer than the plan needs), an HBM view's :func:`dma_side`."""
    if isinstance(ap, TileAP):
        return geometry(ap)
    g = dma_side(ap)
    n = _GEOMETRIES.get(g) or _number(g)
    ap._geo = n
    return n


def dma_side(ap: AP) -> tuple[Any, ...]:
    """Everything :func:`plan_dma` reads of one side of a copy: the kind of memory, the
    partitions of a tile, the access pattern's dims and the element size (offsets and which
    tensor or tile do not change a plan)."""
    if isinstance(ap, TileAP):
        return (ap.alloc.space, ap.p_start, ap.p_count, ap.dims, ap.dtype.itemsize)
    return ("hbm", ap.dims, ap.dtype.itemsize)
