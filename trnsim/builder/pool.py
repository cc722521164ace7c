"""Tile pools: ``bufs`` rotating SBUF/PSUM buffers a kernel allocates from, as NKI's
``tile_pool`` gives them."""

from __future__ import annotations


from typing import TYPE_CHECKING, Any, Sequence

from ..isa import TileAP, row_major
from ..native.dtypes import Dtype
from .replay import free_elems
from .rules import checked_dtype, checked_int, checked_shape

if TYPE_CHECKING:
    from .kernel import Kernel



# ---------------------------------------------------------------------------------------------
# Tile pools
# ---------------------------------------------------------------------------------------------


#: the tile() requests every pool of the process has checked (TilePool._checked): (shape, dtype)
#: as asked -> what the checks made of it
_CHECKED: dict[tuple[Any, Any], tuple[tuple[int, ...], Dtype, int, tuple[tuple[int, int], ...]]] = {}


class TilePool:
    """``bufs`` rotating buffers: ``pool.tile(shape, dtype)`` returns the next one.

    ``bufs=1`` makes every iteration wait for the previous one to finish with the buffer
    (single buffering); ``bufs=2`` lets a DMA fill one buffer while compute reads the other.
    """

    def __init__(self, kernel: "Kernel", name: str, bufs: int, space: str):
        bufs = checked_int(bufs, f"tile pool '{name}': bufs", lo=1)
        self.kernel = kernel
        self.name = name
        self.bufs = bufs
        self.space = space
        self._slots: list[TileAP | None] = [None] * bufs
        # the (shape, dtype) each slot's view was asked for: asked again (the same dtype object,
        # an equal shape of ints), the same view serves (views are immutable, so its geometry
        # number and dependency region stay valid); None in a reference build
        self._asked: list[tuple[Any, Any] | None] = [None] * bufs
        # (shape, dtype) as asked -> (shape, Dtype, bytes per partition, free dims), checked once
        # per process (a function of the two alone; a reference build checks in each pool)
        self._checked: dict[tuple[Any, Any], tuple[tuple[int, ...], Dtype, int, tuple[tuple[int, int], ...]]] = \
            _CHECKED if not kernel.reference else {}
        self._reuse = not kernel.reference  # a reference build makes every view afresh
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        # the checked requests are the process's (keyed by id() of dtypes too): not pickled
        state = self.__dict__.copy()
        state["_checked"] = {}
        return state

    def tile(self, shape: Sequence[int], dtype: Any, *, name: str | None = None) -> TileAP:
        i = self._next
        self._next = i + 1 if i + 1 < self.bufs else 0
        old = self._slots[i]
        if old is not None and type(shape) is tuple:
            asked = self._asked[i]
            if asked is not None and asked[1] is dtype:
                for n in shape:  # plain ints only: 128.0 or True would compare equal to 128 or 1
                    if type(n) is not int:
                        break
                else:
                    if asked[0] == shape:
                        # what the general path would make: a view of the whole old allocation
                        # with the same partitions, dims and dtype, i.e. ``old`` itself
                        return old
        ask = c = None
        if type(shape) is tuple:
            for n in shape:
                if type(n) is not int:
                    break
            else:
                # a Dtype by identity (hashing the frozen dataclass hashes all its fields; the
                # cached entry holds it, so its id stays its own), names and the rest as they are
                ask = (shape, Dtype, id(dtype)) if type(dtype) is Dtype else (shape, dtype)
                try:
                    c = self._checked.get(ask)
                except TypeError:  # an unhashable dtype: checked (and refused) below
                    ask = None
        if c is None:
            what = f"tile pool '{self.name}'"
            dt = checked_dtype(dtype, what)
            shape = checked_shape(shape, what)
            c = (shape, dt, free_elems(shape) * dt.itemsize, row_major(shape[1:] or (1,)))
            if ask is not None:
                if len(self._checked) >= 16384:
                    self._checked.clear()
                self._checked[ask] = c
        asked_now = (shape, dtype) if ask is not None and self._reuse else None  # (shape as asked: all ints)
        shape, dt, nbytes, dims = c
        if old is not None and old.alloc.nbytes >= nbytes and old.p_count == shape[0]:
            a = old.alloc
            t = TileAP(a, a.p_start, shape[0], 0, dims, dt)
        else:
            if old is not None:
                self.kernel._release(old)
            t = self.kernel._allocate(self.space, shape, dt, name or f"{self.name}[{i}]", 0, scoped=False)
        self._slots[i] = t
        self._asked[i] = asked_now
        return t

    def release(self) -> None:
        for t in self._slots:
            if t is not None and t.alloc.live:
                self.kernel._release(t)
        self._slots = [None] * self.bufs
        self._asked = [None] * self.bufs
