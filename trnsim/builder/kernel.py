"""Kernels: an instruction stream over HBM tensors and SBUF/PSUM tiles, built through an
NKI-like API.

A kernel is written the way an NKI author writes one: allocate tiles, move data with
``dma_copy``, multiply with ``nc_matmul`` into PSUM accumulation groups, evacuate with
``tensor_copy``/``activation``, store back. Python loops unroll into instructions::

    k = Kernel("add", config="trn2")
    a = k.input("a", (128, 512), "bf16")
    b = k.input("b", (128, 512), "bf16")
    out = k.output("out", (128, 512), "bf16")
    ta, tb = k.sbuf((128, 512), "bf16"), k.sbuf((128, 512), "bf16")
    k.dma_copy(ta, a)
    k.dma_copy(tb, b, queue=1)
    k.tensor_tensor(ta, ta, tb, "add")
    k.dma_copy(out, ta)

Hardware rules are checked as each instruction is built — tile limits, partition alignment,
engine/memory reachability, SBUF/PSUM capacity — with errors that name the rule and the limit.
Dependencies between instructions (RAW/WAR/WAW on overlapping memory) are derived here too.
"""

from __future__ import annotations

import array
import contextlib
import functools
import gc
import itertools
import os

import numpy as np
from typing import Any, Iterator, Sequence

from ..config import ChipConfig, env_int, load_config
from ..isa import (
    AP,
    AP_MAX_SIZE,
    AP_MAX_STRIDE,
    BITWISE_OPS,
    Activation,
    AffineSelect,
    Allocation,
    CopyPredicated,
    DmaTranspose,
    MatMulMx,
    RangeSelect,
    Reciprocal,
    Max8,
    FindIndex8,
    ScalarTensorTensor,
    TensorTensorScan,
    DmaCopy,
    DmaGather,
    DmaScatter,
    HbmAP,
    HbmTensor,
    Instruction,
    Iota,
    KernelError,
    MatMul,
    Memset,
    TensorCopy,
    TensorReduce,
    TensorScalar,
    TensorTensor,
    TileAP,
    Transpose,
    activation_fn,
    row_major,
    alu_op,
    reduce_op,
)
from ..memory.dma import plan_dma, plan_indirect, plan_transpose
from ..memory.hbm import check_capacity
from ..memory.psum import PsumAllocator, check_matmul_dst
from ..memory.sbuf import OnChipAllocator
from ..native.dtypes import Dtype, get_dtype

__all__ = ["Kernel", "TilePool", "ViewCache"]

_ENGINE_NAMES = {"tensor": "Tensor", "pe": "Tensor", "vector": "Vector", "dve": "Vector", "scalar": "Scalar",
                 "act": "Scalar", "activation": "Scalar", "gpsimd": "GpSimd", "pool": "GpSimd", "sync": "Sync",
                 "sp": "Sync"}
_MATMUL_DTYPES = frozenset({"bfloat16", "float16", "float32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2"})
FP32_MIN = -3.4028234663852886e38  # the fill value range_select takes (float32 min)
_MX_DTYPES = frozenset({"float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"})
_COMPARE_OPS = frozenset({"equal", "not_equal", "greater", "greater_equal", "less", "less_equal"})
#: Instructions one kernel may hold unless TRNSIM_MAX_INSTRUCTIONS says more. Each costs about a
#: kilobyte of host memory, so a mistyped shape (a 100000^3 matmul) stops with a one-line error
#: instead of filling the host; a 16384^3 bf16 matmul has ~0.7 million.
MAX_INSTRUCTIONS = 2_000_000


def max_instructions() -> int:
    """The per-kernel instruction limit: ``TRNSIM_MAX_INSTRUCTIONS`` or :data:`MAX_INSTRUCTIONS`."""
    return env_int("TRNSIM_MAX_INSTRUCTIONS", MAX_INSTRUCTIONS, 1, 10**12, "a whole number of instructions")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a kernel is built or simulated.

    Building and simulating allocate hundreds of thousands of small, acyclic objects
    (instructions, views, accesses, events); every 700 of them the collector walks the young
    generation and, regularly, all of them - about a fifth of the time on a 42,000-instruction
    matmul. Reference counting still frees everything; cycles made meanwhile are collected when
    the block ends. Nested uses and a collector the caller disabled are left as they were."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def checked_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape given by a user: a non-empty sequence of positive ints."""
    if type(shape) is tuple and shape and all(type(n) is int and n > 0 for n in shape):
        return shape  # already a shape: the common case, checked without copying
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise KernelError(f"{what}: shape must be a tuple of sizes like (128, 512), got {shape!r}")
    out = tuple(shape)
    if not out or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in out):
        raise KernelError(f"{what}: shape {out} must be positive integers")
    return tuple(int(n) for n in out)


def checked_dtype(dtype: Any, what: str) -> Dtype:
    try:
        return get_dtype(dtype)
    except ValueError as e:
        raise KernelError(f"{what}: {e}") from None


def checked_int(x: Any, what: str, lo: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or (lo is not None and x < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise KernelError(f"{what} must be an integer{bound}, got {x!r}")
    return int(x)


def checked_number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise KernelError(f"{what} must be a number, got {x!r}")
    return float(x)


def engine_name(name: str, allowed: Sequence[str], what: str) -> str:
    canon = _ENGINE_NAMES.get(str(name).lower(), str(name))
    if canon not in allowed:
        raise KernelError(f"{what}: engine {name!r} cannot run this instruction; expected one of "
                          f"{', '.join(a.lower() for a in allowed)}")
    return canon


# ---------------------------------------------------------------------------------------------
# Dependency tracking
# ---------------------------------------------------------------------------------------------


# One instruction's access to a region, as a plain tuple (built once per operand, so a tuple
# rather than an object): (box, instruction index, engine/queue key). ``box`` is flat
# (lo0, hi0, lo1, hi1, ...).
_Access = tuple  # (tuple[int, ...], int, str)


def _overlap(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    if len(a) != len(b):  # an exact box vs a flat span of the same tensor: compare flat spans
        return a[-2] < b[-1] and b[-2] < a[-1]
    for i in range(0, len(a), 2):
        if a[i] >= b[i + 1] or b[i] >= a[i + 1]:
            return False
    return True


def _covers(outer: tuple[int, ...], inner: tuple[int, ...]) -> bool:
    if len(outer) != len(inner):
        return False
    for i in range(0, len(outer), 2):
        if inner[i] < outer[i] or inner[i + 1] > outer[i + 1]:
            return False
    return True


class _History:
    """The accesses still pending on one buffer. ``tile``: every box is an on-chip
    (p_lo, p_hi, byte_lo, byte_hi) box, so overlap checks take the 4-comparison fast path."""

    __slots__ = ("writes", "reads", "tile")

    def __init__(self, tile: bool = False) -> None:
        self.writes: list[_Access] = []
        self.reads: list[_Access] = []
        self.tile = tile


class _Grave:
    __slots__ = ("box", "hist", "alive")

    def __init__(self, box: tuple[int, ...], hist: _History):
        self.box = box
        self.hist = hist
        self.alive = True


_GRAVE_CHUNK = 2048  # bytes per graveyard index bucket
_READ_PRUNE_WINDOW = 8  # how many recent reads a new read may replace (pruning is an optimisation)


class DependencyTracker:
    """Derives RAW/WAR/WAW edges from the memory each instruction reads and writes.

    Each live SBUF/PSUM allocation and each HBM tensor has its own access history, so checks
    stay local. On-chip boxes are (absolute partition range, absolute byte range): when a tile
    is freed its history moves to a graveyard, and the next allocation placed over the same
    bytes inherits it, so a new tile's first write still waits for the old tile's readers.
    HBM boxes are the logical index box of a sliced view (exact) or the flat element span
    (e.g. the (0, n) of a raw access pattern, compared by span).

    An access pattern's box is computed once and kept on the view (views are immutable), and
    on-chip boxes are compared inline (four integer comparisons) rather than through
    :func:`_overlap`/:func:`_covers`: the same edges, a fraction of the cost per instruction.
    """

    def __init__(self) -> None:
        self._hbm: dict[int, _History] = {}
        self._live: dict[int, _History] = {}
        # freed regions still holding pending accesses, indexed by address chunk
        self._graveyard: dict[str, dict[int, list[_Grave]]] = {"sbuf": {}, "psum": {}}

    @staticmethod
    def _alloc_box(a: Allocation) -> tuple[int, ...]:
        return (a.p_start, a.p_start + a.p_count, a.addr, a.addr + max(a.nbytes, 1))

    @staticmethod
    def _chunks(box: tuple[int, ...]) -> range:
        return range(box[2] // _GRAVE_CHUNK, (box[3] - 1) // _GRAVE_CHUNK + 1)

    def allocated(self, alloc: Allocation) -> None:
        h = _History(tile=True)
        box = self._alloc_box(alloc)
        buckets = self._graveyard[alloc.space]
        seen: set[int] = set()
        for c in self._chunks(box):
            bucket = buckets.get(c)
            if not bucket:
                continue
            for g in bucket:
                if not g.alive or id(g) in seen:
                    continue
                seen.add(id(g))
                if _overlap(box, g.box):
                    h.writes.extend(g.hist.writes)
                    h.reads.extend(g.hist.reads)
                    if _covers(box, g.box):
                        g.alive = False  # the new tile's history now carries it
            buckets[c] = [g for g in bucket if g.alive]
        if len(seen) > 1:  # graves that overlap each other carry the same accesses: keep each once
            h.writes = list({id(a): a for a in h.writes}.values())
            h.reads = list({id(a): a for a in h.reads}.values())
        self._live[alloc.uid] = h

    def freed(self, alloc: Allocation) -> None:
        h = self._live.pop(alloc.uid)
        if h.writes or h.reads:
            box = self._alloc_box(alloc)
            g = _Grave(box, h)
            buckets = self._graveyard[alloc.space]
            for c in self._chunks(box):
                buckets.setdefault(c, []).append(g)

    def _resolve(self, ap: AP) -> tuple[_History, tuple[int, ...]]:
        box = ap._dep_box
        if isinstance(ap, TileAP):
            if box is None:
                lo, hi = ap.byte_span()
                box = ap._dep_box = (ap.p_start, ap.p_start + ap.p_count, lo, hi)
            return self._live[ap.alloc.uid], box
        h = self._hbm.get(ap.tensor.uid)
        if h is None:
            h = self._hbm[ap.tensor.uid] = _History()
        if box is None:
            lo, hi = ap.span()
            if ap.box is not None:  # the trailing flat span serves mixed comparisons
                box = tuple(x for lohi in ap.box for x in lohi) + (lo, hi)
            else:
                box = (lo, hi)
            ap._dep_box = box
        return h, box

    def raw_deps(self, ap: AP) -> tuple[int, ...]:
        """The writers an access to ``ap`` must wait for (read-after-write only)."""
        h, box = self._resolve(ap)
        return tuple(sorted({w[1] for w in h.writes if _overlap(w[0], box)}))

    def record(self, ins: Instruction, key: str, first: AP | None = None) -> tuple[int, ...]:
        """Record ``ins``'s accesses; return the instructions it must wait for. With ``first``
        (one of its reads), also set ``ins.first_deps`` to what :meth:`raw_deps` of it would be."""
        deps: set[int] = set()
        add = deps.add
        idx = ins.index
        dma = ins.is_dma
        new_reads: list[tuple[_History, tuple[int, ...]]] = []
        resolve = self._resolve
        for ap in ins.reads:
            h, box = resolve(ap)
            if ap is first:
                ins.first_deps = tuple(sorted({w[1] for w in h.writes if _overlap(w[0], box)}))
                first = None
            if h.tile:
                p0, p1, b0, b1 = box
                for w in h.writes:
                    o = w[0]
                    if o[0] < p1 and p0 < o[1] and o[2] < b1 and b0 < o[3]:
                        add(w[1])
            else:
                for w in h.writes:
                    if _overlap(w[0], box):
                        add(w[1])
            new_reads.append((h, box))
        for ap in ins.writes:
            h, box = resolve(ap)
            if h.tile:
                p0, p1, b0, b1 = box
                keep = []
                for w in h.writes:
                    o = w[0]
                    if o[0] < p1 and p0 < o[1] and o[2] < b1 and b0 < o[3]:
                        add(w[1])
                        if not (p0 <= o[0] and o[1] <= p1 and b0 <= o[2] and o[3] <= b1):
                            keep.append(w)
                    else:
                        keep.append(w)
                keep.append((box, idx, key))
                h.writes = keep
                if h.reads:
                    keep = []
                    for r in h.reads:
                        o = r[0]
                        if o[0] < p1 and p0 < o[1] and o[2] < b1 and b0 < o[3]:
                            # a compute engine's own earlier reads are done before it issues this
                            # write (in order); a DMA queue only orders completions, so its reads
                            # still need an edge
                            if r[2] != key or dma:
                                add(r[1])
                            if not (p0 <= o[0] and o[1] <= p1 and b0 <= o[2] and o[3] <= b1):
                                keep.append(r)
                        else:
                            keep.append(r)
                    h.reads = keep
                continue
            for w in h.writes:
                if _overlap(w[0], box):
                    add(w[1])
            for r in h.reads:
                if (r[2] != key or dma) and _overlap(r[0], box):
                    add(r[1])
            h.writes = [w for w in h.writes if not _covers(box, w[0])]
            h.writes.append((box, idx, key))
            if h.reads:
                h.reads = [r for r in h.reads if not _covers(box, r[0])]
        for h, box in new_reads:
            reads = h.reads
            n = len(reads)
            if h.tile:
                p0, p1, b0, b1 = box
                for j in range(n - 1, max(-1, n - 1 - _READ_PRUNE_WINDOW), -1):
                    r = reads[j]
                    o = r[0]
                    if r[2] == key and p0 <= o[0] and o[1] <= p1 and b0 <= o[2] and o[3] <= b1:
                        del reads[j]
            else:
                for j in range(n - 1, max(-1, n - 1 - _READ_PRUNE_WINDOW), -1):
                    r = reads[j]
                    if r[2] == key and _covers(box, r[0]):
                        del reads[j]
            reads.append((box, idx, key))
        if first is not None:  # not among the reads (never for TensorE's operands)
            ins.first_deps = self.raw_deps(first)
        deps.discard(idx)
        return tuple(sorted(deps))


try:  # the same tracker in C (trnsim/native/deptrack.c), built by setup.py beside the datapath
    from ..native import _deptrack  # type: ignore[attr-defined]
except ImportError:  # not built: the Python tracker does the same work, slower
    _deptrack = None
try:  # instruction copies and dependency tuples in C (trnsim/native/clone.c), built by setup.py too
    from ..native import _clone  # type: ignore[attr-defined]
except ImportError:  # not built: the same copies and tuples made in Python, slower
    _clone = None


_UNLOGGED = object()  # a record whose first_deps the C edge log does not have (equal to no tuple)
_LOG_FIRST = getattr(_deptrack.lib, "dt_log_first", None) if _deptrack is not None else None


def _hbm_box(ap: HbmAP) -> tuple[int, ...]:
    """The dependency box of an HBM view, as :meth:`DependencyTracker._resolve` makes it."""
    box = ap._dep_box
    if box is None:
        lo, hi = ap.span()
        if ap.box is not None:
            box = tuple(x for lohi in ap.box for x in lohi) + (lo, hi)
        else:
            box = (lo, hi)
        ap._dep_box = box
    return box


class NativeDependencyTracker:
    """:class:`DependencyTracker` with its histories, boxes and scans in C (``_deptrack``).

    The same algorithm access for access (``tests/test_build_equivalence.py`` compares the two
    on every library kernel), so the same edges in the same order; Python keeps only the maps
    from allocations and tensors to history ids and, on each view, the id of its region (made
    once per view and tracker). About 1 us an instruction instead of 10-15 in a big kernel."""

    __slots__ = ("_t", "_lib", "_unpack", "_live", "_hbm", "_keys", "_out", "_out2", "_gen", "_g", "_dlog", "_flog",
                 "__weakref__")

    def __init__(self) -> None:
        assert _deptrack is not None
        lib, ffi = _deptrack.lib, _deptrack.ffi
        t = lib.dt_new()
        if t == ffi.NULL:
            raise MemoryError("dependency tracker: out of memory")
        self._t = ffi.gc(t, lib.dt_free)
        self._lib = lib
        self._unpack = ffi.unpack
        self._live: dict[int, int] = {}  # allocation uid -> history id
        self._hbm: dict[int, int] = {}  # HBM tensor uid -> history id
        self._keys: dict[str, int] = {}  # engine / queue key -> small int
        self._out = lib.dt_out(self._t)
        self._out2 = self._out + 2  # where a record without `first` puts its edges
        self._gen = lib.dt_outgen(self._t)
        self._g = self._gen[0]
        # the tuples each record returned / set, in record order; the C side logs their ints
        # (dt_log_*): the simulator takes those arrays when the instructions still carry
        # exactly these tuples (trnsim.sim._logged_edges)
        self._dlog: list[Any] = []
        self._flog: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        """A kernel pickles with its tracker: the C state as bytes (views drop their region ids,
        and register again with the unpickled tracker)."""
        assert _deptrack is not None
        ffi = _deptrack.ffi
        n = self._lib.dt_dump(self._t, ffi.NULL, 0)
        buf = ffi.new("int64_t[]", n)
        self._lib.dt_dump(self._t, buf, n)
        return {"c": bytes(ffi.buffer(buf)), "live": self._live, "hbm": self._hbm, "keys": self._keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        assert _deptrack is not None
        raw = state["c"]
        buf = _deptrack.ffi.from_buffer("int64_t[]", raw)
        if self._lib.dt_load(self._t, buf, len(raw) // 8) != 0:
            raise ValueError("dependency tracker: the pickled state is not a tracker's")
        self._live, self._hbm, self._keys = dict(state["live"]), dict(state["hbm"]), dict(state["keys"])

    @staticmethod
    def _alloc_box(a: Allocation) -> tuple[int, int, int, int]:
        return (a.p_start, a.p_start + a.p_count, a.addr, a.addr + max(a.nbytes, 1))

    def allocated(self, alloc: Allocation) -> None:
        hid = self._lib.dt_history(self._t, 1, 0 if alloc.space == "sbuf" else 1, *self._alloc_box(alloc))
        if hid < 0:
            raise MemoryError("dependency tracker: out of memory")
        self._live[alloc.uid] = hid

    def freed(self, alloc: Allocation) -> None:
        hid = self._live.pop(alloc.uid)
        if self._lib.dt_freed(self._t, hid, 0 if alloc.space == "sbuf" else 1, *self._alloc_box(alloc)) < 0:
            raise MemoryError("dependency tracker: out of memory")

    def _region(self, ap: AP) -> int:
        """The C region of ``ap`` (its history and box), made once and kept on the view."""
        if isinstance(ap, TileAP):
            hid = self._live[ap.alloc.uid]
            lo, hi = ap.byte_span()
            r = self._lib.dt_region4(self._t, hid, ap.p_start, ap.p_start + ap.p_count, lo, hi)
        else:
            hid = self._hbm.get(ap.tensor.uid)
            if hid is None:
                hid = self._hbm[ap.tensor.uid] = self._lib.dt_history(self._t, 0, 0, 0, 0, 0, 0)
            box = _hbm_box(ap)
            r = self._lib.dt_region(self._t, hid, box, len(box))
        if r < 0:
            raise MemoryError("dependency tracker: out of memory")
        ap._dep_h = (self, r)
        return r

    def _key(self, key: str) -> int:
        """A new engine / queue key's small int."""
        kid = self._keys[key] = len(self._keys)
        return kid

    def _results(self, n: int) -> list[int]:
        """The ``n`` ints a C call left in its output buffer (which may have moved)."""
        if n < 0:
            raise MemoryError("dependency tracker: out of memory")
        if self._gen[0] != self._g:  # the C output buffer grew (moved)
            self._out = self._lib.dt_out(self._t)
            self._out2 = self._out + 2
            self._g = self._gen[0]
        return self._unpack(self._out, n)

    def _raw(self, n: int) -> Any:
        """The ``n`` ints of :meth:`_results` as a buffer over the C output (int32), valid
        until the next C call: what ``_clone`` reads them from."""
        if n < 0:
            raise MemoryError("dependency tracker: out of memory")
        if self._gen[0] != self._g:
            self._out = self._lib.dt_out(self._t)
            self._out2 = self._out + 2
            self._g = self._gen[0]
        return _deptrack.ffi.buffer(self._out, 4 * n)  # type: ignore[union-attr]

    def _edges(self, n: int) -> tuple[int, ...]:
        """The edges a record without ``first`` left in the output buffer (``n`` ints in all:
        -1, the count, the edges), noted in the log as :meth:`record` notes them."""
        if n <= 2:
            if n < 0:
                raise MemoryError("dependency tracker: out of memory")
            self._dlog.append(())
            self._flog.append(None)
            return ()
        if self._gen[0] != self._g:  # the C output buffer grew (moved)
            self._out = self._lib.dt_out(self._t)
            self._out2 = self._out + 2
            self._g = self._gen[0]
        deps = tuple(self._unpack(self._out2, n - 2))
        self._dlog.append(deps)
        self._flog.append(None)
        return deps

    def logged_edges(self) -> tuple[list[Any], list[Any], tuple[np.ndarray, ...]] | None:
        """Every record so far, when they were instructions 0, 1, 2... in order: the deps and
        first_deps tuples they returned / set, and their ints as the simulator's columns
        (dep_off, deps, has_first, first_off, first); None when not."""
        lib, ffi = self._lib, _deptrack.ffi
        sizes = ffi.new("int64_t[3]")
        if not hasattr(lib, "dt_log_size"):  # a _deptrack built before the log: read the objects
            return None
        if lib.dt_log_size(self._t, sizes) != 0 or sizes[0] != len(self._dlog):
            return None
        n, nd, nf = sizes[0], sizes[1], sizes[2]
        cols = (np.empty(n + 1, np.int64), np.empty(max(nd, 1), np.int32), np.empty(max(n, 1), np.int8),
                np.empty(n + 1, np.int64), np.empty(max(nf, 1), np.int32))
        lib.dt_log_columns(self._t, *(ffi.from_buffer(t + "[]", c) for t, c in
                                      zip(("int64_t", "int32_t", "int8_t", "int64_t", "int32_t"), cols)))
        dep_off, deps, has_first, first_off, first = cols
        return self._dlog, self._flog, (dep_off, deps[:nd], has_first[:n], first_off, first[:nf])

    def raw_deps(self, ap: AP) -> tuple[int, ...]:
        """The writers an access to ``ap`` must wait for (read-after-write only)."""
        d = ap._dep_h
        r = d[1] if d is not None and d[0] is self else self._region(ap)
        return tuple(self._results(self._lib.dt_raw_deps(self._t, r)))

    def record(self, ins: Instruction, key: str, first: AP | None = None) -> tuple[int, ...]:
        """Record ``ins``'s accesses; return the instructions it must wait for. With ``first``
        (one of its reads), also set ``ins.first_deps`` to what :meth:`raw_deps` of it would be."""
        kid = self._keys.get(key)
        if kid is None:
            kid = self._key(key)
        reads, writes = ins.reads, ins.writes
        nr, nw = len(reads), len(writes)
        if first is None and 0 < nr <= 3 and (nw == 1 or (nw == 2 and nr == 2)):
            # the generic engine instructions: a short call per shape (regions made reads first,
            # as below)
            ap = reads[0]
            d = ap._dep_h
            r0 = d[1] if d is not None and d[0] is self else self._region(ap)
            if nr > 1:
                ap = reads[1]
                d = ap._dep_h
                r1 = d[1] if d is not None and d[0] is self else self._region(ap)
                if nr > 2:
                    ap = reads[2]
                    d = ap._dep_h
                    r2 = d[1] if d is not None and d[0] is self else self._region(ap)
            ap = writes[0]
            d = ap._dep_h
            w0 = d[1] if d is not None and d[0] is self else self._region(ap)
            lib = self._lib
            if nw == 2:
                ap = writes[1]
                d = ap._dep_h
                w1 = d[1] if d is not None and d[0] is self else self._region(ap)
                return self._edges(lib.dt_record22(self._t, ins.index, kid, ins.is_dma, r0, r1, w0, w1))
            if nr == 1:
                return self._edges(lib.dt_record11(self._t, ins.index, kid, ins.is_dma, r0, w0))
            if nr == 2:
                return self._edges(lib.dt_record21(self._t, ins.index, kid, ins.is_dma, r0, r1, w0))
            return self._edges(lib.dt_record31(self._t, ins.index, kid, ins.is_dma, r0, r1, r2, w0))
        rs = []
        for ap in ins.reads:
            d = ap._dep_h
            rs.append(d[1] if d is not None and d[0] is self else self._region(ap))
        ws = []
        for ap in ins.writes:
            d = ap._dep_h
            ws.append(d[1] if d is not None and d[0] is self else self._region(ap))
        fpos = -1
        if first is not None:
            for i, ap in enumerate(ins.reads):
                if ap is first:
                    fpos = i
                    break
        nr, nw = len(rs), len(ws)
        if nr == 1 and nw == 1 and fpos < 0:  # a DMA, a copy: the short call
            n = self._lib.dt_record11(self._t, ins.index, kid, ins.is_dma, rs[0], ws[0])
        elif nr > 6 or nw > 2:
            n = self._lib.dt_record(self._t, ins.index, kid, ins.is_dma, rs, nr, ws, nw, fpos)
        else:
            rs.extend((0, 0, 0, 0, 0, 0))
            ws.extend((0, 0))
            n = self._lib.dt_record6(self._t, ins.index, kid, ins.is_dma, nr, rs[0], rs[1], rs[2], rs[3], rs[4],
                                     rs[5], nw, ws[0], ws[1], fpos)
        vals = self._results(n)  # [nfirst, ndeps, first..., deps...]
        if vals[0] >= 0:
            return self._with_first(ins, vals)
        deps = tuple(vals[2:])
        self._dlog.append(deps)
        if first is not None:  # not among the reads (an operand view that is not one of them)
            fd = ins.first_deps = self.raw_deps(first)
            if _LOG_FIRST is not None and _LOG_FIRST(self._t, len(fd)) == 0:  # raw_deps' ints, still in dt_out
                self._flog.append(fd)
            else:
                self._flog.append(_UNLOGGED)  # the C log has no first deps for it: never taken
        else:
            self._flog.append(None)
        return deps

    def _tensor_kid(self) -> int:
        kid = self._keys.get("Tensor")
        return kid if kid is not None else self._key("Tensor")

    def _with_first(self, ins: Instruction, vals: list[int]) -> tuple[int, ...]:
        """A record's results ``[nfirst, ndeps, first..., deps...]`` with first deps: set
        ``ins.first_deps``, note both in the log (:meth:`logged_edges`), return the deps."""
        nf = vals[0]
        fd = ins.first_deps = tuple(vals[2:2 + nf])
        deps = tuple(vals[2 + nf:])
        self._dlog.append(deps)
        self._flog.append(fd)
        return deps

    def record_matmul(self, ins: Instruction, st: AP, mv: AP, dst: AP, acc: bool) -> tuple[int, ...]:
        """:meth:`record` of a matmul (reads ``st, mv`` and, accumulating, ``dst``; writes
        ``dst``; ``first`` = ``st``), without the generic argument handling."""
        d = st._dep_h
        rs = d[1] if d is not None and d[0] is self else self._region(st)
        d = mv._dep_h
        rm = d[1] if d is not None and d[0] is self else self._region(mv)
        d = dst._dep_h
        rd = d[1] if d is not None and d[0] is self else self._region(dst)
        kid = self._tensor_kid()
        n = self._lib.dt_record6(self._t, ins.index, kid, 0, 3 if acc else 2, rs, rm, rd, 0, 0, 0, 1, rd, 0, 0)
        vals = self._results(n)
        return self._with_first(ins, vals)

    def record_transpose(self, ins: Instruction, data: AP, dst: AP) -> tuple[int, ...]:
        """:meth:`record` of a PE transpose (reads ``data``, writes ``dst``; ``first`` = ``data``)."""
        d = data._dep_h
        r = d[1] if d is not None and d[0] is self else self._region(data)
        d = dst._dep_h
        w = d[1] if d is not None and d[0] is self else self._region(dst)
        kid = self._tensor_kid()
        vals = self._results(self._lib.dt_record_first11(self._t, ins.index, kid, r, w))
        return self._with_first(ins, vals)

    def record_transposes(self, ins: Sequence[Transpose]) -> None:
        """:meth:`record_transpose` of consecutive transposes (indices ``ins[0].index`` on) in one
        C call; sets each one's ``deps`` and ``first_deps``."""
        data, dst = [], []
        for m in ins:
            for ap, out in ((m.data, data), (m.dst, dst)):
                d = ap._dep_h
                out.append(d[1] if d is not None and d[0] is self else self._region(ap))
        kid = self._tensor_kid()
        self._spread(ins, self._lib.dt_record_transposes(self._t, ins[0].index, kid, len(ins), data, dst))

    def record_matmuls(self, ins: Sequence[MatMul]) -> None:
        """:meth:`record_matmul` of consecutive matmuls (indices ``ins[0].index`` on) in one C
        call; sets each one's ``deps`` and ``first_deps``."""
        st, mv, dst = [], [], []
        for m in ins:
            for ap, out in ((m.stationary, st), (m.moving, mv), (m.dst, dst)):
                d = ap._dep_h
                out.append(d[1] if d is not None and d[0] is self else self._region(ap))
        kid = self._tensor_kid()
        self._spread(ins, self._lib.dt_record_matmuls(self._t, ins[0].index, kid, len(ins), st, mv, dst,
                                                      [1 if m.accumulate else 0 for m in ins]))

    def _spread(self, ins: Sequence[Instruction], n: int) -> None:
        """Set each instruction's ``first_deps`` and ``deps`` from a batched record's ``n``
        results, laid out one after the other as ``[nfirst, ndeps, first..., deps...]``, and
        note them in the log (:meth:`logged_edges`)."""
        if _clone is not None and type(ins) is list:
            _clone.spread(ins, self._raw(n), self._dlog, self._flog)
            return
        vals = self._results(n)
        p = 0
        dlog, flog = self._dlog.append, self._flog.append
        for m in ins:
            nf, nd = vals[p], vals[p + 1]
            p += 2
            fd = m.first_deps = tuple(vals[p:p + nf])
            p += nf
            deps = m.deps = tuple(vals[p:p + nd])
            p += nd
            dlog(deps)
            flog(fd)

    def region(self, ap: AP) -> int:
        """The C region id of ``ap`` (registered on first use, as :meth:`record` does)."""
        d = ap._dep_h
        return d[1] if d is not None and d[0] is self else self._region(ap)

    def _record_many(self, idx0: int, n: int, spec: Any) -> int:
        buf = _deptrack.ffi.from_buffer("int32_t[]", spec)  # type: ignore[union-attr]
        return self._lib.dt_record_many(self._t, idx0, n, buf, len(spec))

    def record_many_raw(self, idx0: int, n: int, spec: Any) -> Any:
        """:meth:`record_many`'s results as :meth:`_raw` gives them (what ``_clone.replay`` reads)."""
        return self._raw(self._record_many(idx0, n, spec))

    def record_many(self, idx0: int, n: int, spec: Any) -> list[int]:
        """:meth:`record` of ``n`` consecutive instructions (indices ``idx0`` on) in one C call:
        ``spec`` (an int32 buffer) holds, per instruction, ``[key, dma, first, nr, reads..., nw,
        writes...]`` as region ids. Returns ``2n+1`` offsets, then the values: instruction i's
        ``first_deps`` are ``values[off[2i]:off[2i+1]]`` (none without a first operand), its
        ``deps`` ``values[off[2i+1]:off[2i+2]]``."""
        return self._results(self._record_many(idx0, n, spec))

    def log_recorded(self, ins: Sequence[Instruction]) -> None:
        """Note the ``deps``/``first_deps`` tuples that the caller of :meth:`record_many` gave
        ``ins`` (made from its results; the C log already has their ints), so that
        :meth:`logged_edges` still covers every instruction."""
        self._dlog.extend([x.deps for x in ins])
        self._flog.extend([x.first_deps for x in ins])


_REFERENCE_BUILDS = 0  # > 0 inside reference_build()


@contextlib.contextmanager
def reference_build() -> Iterator[None]:
    """Kernels made inside the block are built the reference way: the Python dependency tracker
    and no batched fast paths (the library kernels emit one instruction at a time). The
    instruction stream is the same (``tests/test_build_equivalence.py`` checks it); this is
    what that test and ``benchmarks/bench_kernels.py`` compare the fast build against."""
    global _REFERENCE_BUILDS
    _REFERENCE_BUILDS += 1
    try:
        yield
    finally:
        _REFERENCE_BUILDS -= 1


def new_tracker(reference: bool = False) -> DependencyTracker | NativeDependencyTracker:
    """The C tracker when it is built, unless ``reference`` or ``TRNSIM_NATIVE=0`` asks for the
    Python one (the two give the same edges)."""
    if reference or _deptrack is None or os.environ.get("TRNSIM_NATIVE", "").strip() == "0":
        return DependencyTracker()
    return NativeDependencyTracker()


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


# ---------------------------------------------------------------------------------------------
# Tile pools
# ---------------------------------------------------------------------------------------------


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
        self._checked: dict[tuple[Any, Any], tuple[tuple[int, ...], Dtype, int, tuple[tuple[int, int], ...]]] = {}
        self._reuse = not kernel.reference  # a reference build makes every view afresh
        self._next = 0

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
            c = (shape, dt, _free_elems(shape) * dt.itemsize, row_major(shape[1:] or (1,)))
            if ask is not None:
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
        # The copies are made in C (_clone.replay) when every class is one it can copy, else by
        # the generated Python cloners
        self.firsts: bytes | None = bytes(type(x) in _FIRST_OPERAND for x in ins) if _clone is not None else None
        if self.firsts is not None:
            try:
                for cls in {type(x) for x in ins}:
                    _clone.layout(cls)
            except TypeError:
                self.firsts = None
        self.cloners = None if self.firsts is not None else [_cloner(type(x), type(x) in _FIRST_OPERAND) for x in ins]


def _stationary_key(s: TileAP) -> tuple[Any, ...]:
    """What the builder compares to know a matmul's stationary is still loaded (``_loaded_stationary``)."""
    return (s.alloc.uid, s.p_start, s.p_count, s.offset, s.dims, s.dtype.name)


_CLONERS: dict[tuple[type, bool], Any] = {}
_FIRST_OPERAND = (MatMul, Transpose)  # the instructions the tracker records with a first operand (reads[0])
# VectorE / ScalarE / GpSimd instructions a template may hold: every operand a tile (reads and
# writes), recorded under their engine's key without a first operand, no other state read
_REPLAYABLE_OPS = frozenset((TensorCopy, Activation, TensorScalar, TensorTensor, TensorReduce, AffineSelect))


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


def _free_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def tile_view(alloc: Allocation, shape: tuple[int, ...], dt: Dtype) -> TileAP:
    return TileAP(alloc, alloc.p_start, shape[0], 0, row_major(shape[1:] or (1,)), dt)


# ---------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------


class Kernel:
    """An instruction stream for one NeuronCore, built against a chip config."""

    def __init__(self, name: str = "kernel", config: ChipConfig | str = "trn2"):
        self.name = name
        self.config: ChipConfig = config if isinstance(config, ChipConfig) else load_config(config)
        c = self.config.core
        self.instructions: list[Instruction] = []
        self.tensors: dict[str, HbmTensor] = {}
        self.queues: dict[str, int] = {}  # lane name -> hardware queue id
        uids = itertools.count(1)
        self._sbuf = OnChipAllocator("sbuf", c.sbuf.partitions, c.sbuf.partition_bytes, c.sbuf.allocation_granule,
                                     f"{self.config.name} ({c.sbuf.partition_bytes // 1024} KiB per partition)", uids)
        self._psum = PsumAllocator(self.config, uids)
        self._allocs: dict[int, Allocation] = {}  # uid -> every allocation of this kernel, live or freed
        #: built the reference way (see :func:`reference_build`): no batched fast paths
        self.reference = _REFERENCE_BUILDS > 0
        self._deps = new_tracker(self.reference)
        self._scopes: list[list[TileAP]] = []
        self._loaded_stationary: tuple[Any, ...] | None = None
        self._hbm_bytes = 0
        self._uid = 0
        self._max_instructions = max_instructions()
        self._dma_plans: dict[tuple[Any, ...], Any] = {}  # plan_dma's inputs -> its (frozen) plan
        self._matmul_ok: dict[tuple[Any, ...], bool] = {}  # matmul operand geometries checked -> double_row
        self._transpose_ok: set[tuple[int, ...]] = set()  # nc_transpose operand geometries checked
        self._lanes: dict[tuple[str, int], tuple[str, str]] = {}  # dma_copy (engine, queue) -> (engine, lane) checked
        self._compute_ok: set[tuple[str, int]] = set()  # (engine, view geometry) that passed _check_compute
        #: runs of instructions emitted by :meth:`replay` (a matmul's repeated row blocks)
        self.replays = 0
        # an engine op's arguments as far as its checks read them (op and engine names, operand
        # geometries or number types) -> what the checks made of them (engine, op names), for
        # calls that passed: a repeat skips the checks (a failing call is checked each time)
        self._op_ok: dict[tuple[Any, ...], Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # the check and plan caches are keyed by geometry numbers, which belong to one process
        # (kernel._GEOMETRIES): a kernel pickles without them and fills them again
        state = self.__dict__.copy()
        for k in ("_dma_plans", "_matmul_ok", "_transpose_ok", "_compute_ok", "_op_ok"):
            state[k] = type(state[k])()
        return state

    # ---- HBM tensors -----------------------------------------------------------------------
    def _tensor(self, name: str, shape: Sequence[int], dtype: Any, kind: str) -> HbmTensor:
        if not isinstance(name, str) or not name:
            raise KernelError(f"tensor names must be non-empty strings, got {name!r}")
        if name in self.tensors:
            raise KernelError(f"tensor name '{name}' is already used in kernel '{self.name}'")
        shape = checked_shape(shape, f"tensor '{name}'")
        self._uid += 1
        t = HbmTensor(name, shape, checked_dtype(dtype, f"tensor '{name}'"), kind, self._uid)
        check_capacity(self.config, self._hbm_bytes + t.nbytes, f"kernel '{self.name}' tensor '{name}'")
        self._hbm_bytes += t.nbytes
        self.tensors[name] = t
        return t

    def input(self, name: str, shape: Sequence[int], dtype: Any) -> HbmTensor:
        """A kernel input in HBM; ``Chip.run`` fills it from the ``inputs`` mapping."""
        return self._tensor(name, shape, dtype, "input")

    def output(self, name: str, shape: Sequence[int], dtype: Any) -> HbmTensor:
        """A kernel output in HBM; ``Chip.run`` returns it."""
        return self._tensor(name, shape, dtype, "output")

    def scratch(self, name: str, shape: Sequence[int], dtype: Any) -> HbmTensor:
        """An HBM buffer private to the kernel (spills, intermediate results)."""
        return self._tensor(name, shape, dtype, "scratch")

    @property
    def hbm_bytes(self) -> int:
        return self._hbm_bytes

    # ---- on-chip allocation ----------------------------------------------------------------
    def _allocate(self, space: str, shape: Sequence[int], dt: Dtype, name: str, partition_offset: int,
                  scoped: bool = True) -> TileAP:
        shape = checked_shape(shape, f"{space.upper()} tile '{name}'")
        partition_offset = checked_int(partition_offset, f"{space.upper()} tile '{name}': partition_offset", lo=0)
        if len(shape) > 5:
            raise KernelError(f"{space.upper()} tile '{name}': at most 4 free dimensions, got shape {shape}")
        alloc_ = self._sbuf if space == "sbuf" else self._psum
        nbytes = _free_elems(shape) * dt.itemsize
        alloc = alloc_.allocate(name, partition_offset, shape[0], nbytes)
        self._allocs[alloc.uid] = alloc
        self._deps.allocated(alloc)
        t = tile_view(alloc, shape, dt)
        if scoped and self._scopes:
            self._scopes[-1].append(t)
        return t

    def sbuf(self, shape: Sequence[int], dtype: Any, *, name: str | None = None, partition_offset: int = 0) -> TileAP:
        """Allocate an SBUF tile ``[partitions, free...]`` (first axis: partitions, <= 128)."""
        self._uid += 1
        name = name or f"sbuf{self._uid}"
        return self._allocate("sbuf", shape, checked_dtype(dtype, f"SBUF tile '{name}'"), name, partition_offset)

    def psum(self, shape: Sequence[int], dtype: Any = "fp32", *, name: str | None = None) -> TileAP:
        """Allocate a PSUM tile (whole 2 KiB banks per partition)."""
        self._uid += 1
        name = name or f"psum{self._uid}"
        return self._allocate("psum", shape, checked_dtype(dtype, f"PSUM tile '{name}'"), name, 0)

    def ndarray(self, shape: Sequence[int], dtype: Any, buffer: str = "sbuf", *, name: str | None = None) -> TileAP:
        """NKI spelling of :meth:`sbuf` / :meth:`psum`."""
        if buffer not in ("sbuf", "psum"):
            raise KernelError(f"ndarray buffer must be 'sbuf' or 'psum', got {buffer!r} (HBM tensors: input/output/scratch)")
        return self.sbuf(shape, dtype, name=name) if buffer == "sbuf" else self.psum(shape, dtype, name=name)

    def free(self, tile: TileAP) -> None:
        """Release a tile's memory; later tiles may reuse the address (with WAR dependencies).

        ``tile`` is a tile as this kernel allocated it: a slice of one (``t[:, :32]``) or another
        kernel's tile is refused, as freeing it would release memory the caller did not name."""
        if not isinstance(tile, TileAP):
            raise KernelError(f"free: expected an SBUF/PSUM tile, got {type(tile).__name__} "
                              f"(HBM tensors live as long as the kernel)")
        self._check_owned(tile, "free")
        a = tile.alloc
        whole = (tile.p_start == a.p_start and tile.p_count == a.p_count and tile.offset == 0
                 and tile.nbytes == a.p_count * a.nbytes and tile.dims == row_major(tile.shape[1:] or (1,)))
        if not whole and a.live:
            raise KernelError(f"free: {list(tile.shape)} at partition {tile.p_start} is a slice of tile '{a.name}' "
                              f"({a.p_count} partitions x {a.nbytes} bytes); free the whole tile, as allocated")
        self._release(tile)

    def _release(self, tile: TileAP) -> None:
        """Free ``tile``'s whole allocation (tile pools free their buffers through any view)."""
        (self._sbuf if tile.space == "sbuf" else self._psum).free(tile.alloc)
        self._deps.freed(tile.alloc)

    def _check_owned(self, ap: Any, what: str) -> None:
        """A tile or HBM tensor of another kernel would alias this kernel's memory by id."""
        if isinstance(ap, TileAP):
            if self._allocs.get(ap.alloc.uid) is not ap.alloc:
                raise KernelError(f"{what}: tile '{ap.name}' belongs to another kernel, not '{self.name}'; a kernel "
                                  f"uses only its own tiles")
            return
        t = ap.tensor if isinstance(ap, HbmAP) else ap
        if isinstance(t, HbmTensor) and self.tensors.get(t.name) is not t:
            raise KernelError(f"{what}: HBM tensor '{t.name}' belongs to another kernel, not '{self.name}'; declare "
                              f"it with input/output/scratch on this kernel")

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Tiles allocated inside the block are freed when it ends."""
        self._scopes.append([])
        try:
            yield
        finally:
            for t in self._scopes.pop():
                if t.alloc.live:
                    self.free(t)

    def tile_pool(self, name: str, bufs: int = 2, space: str = "sbuf") -> TilePool:
        """Rotating buffers for double (or deeper) buffering; see :class:`TilePool`."""
        if space not in ("sbuf", "psum"):
            raise KernelError(f"tile pool '{name}': space must be 'sbuf' or 'psum', got {space!r}")
        return TilePool(self, name, bufs, space)

    @property
    def sbuf_peak_bytes(self) -> int:
        return self._sbuf.peak_bytes

    @property
    def psum_peak_bytes(self) -> int:
        return self._psum.peak_bytes

    @property
    def sbuf_high_water(self) -> int:
        """Bytes per partition up to the highest SBUF address any tile reached."""
        return self._sbuf.high_water

    @property
    def psum_high_water(self) -> int:
        return self._psum.high_water

    # ---- emitting --------------------------------------------------------------------------
    def _emit(self, ins: Instruction, key: str | None = None) -> Instruction:
        allocs, tensors = self._allocs, self.tensors
        for aps in (ins.reads, ins.writes):
            for ap in aps:
                if type(ap) is TileAP:
                    a = ap.alloc
                    if allocs.get(a.uid) is not a:
                        self._check_owned(ap, ins.describe())
                    if not a.live:
                        raise KernelError(f"{ins.describe()}: tile '{ap.name}' was freed before this instruction")
                elif tensors.get(ap.tensor.name) is not ap.tensor:
                    self._check_owned(ap, ins.describe())
        instrs = self.instructions
        idx = ins.index = len(instrs)
        if idx >= self._max_instructions:
            raise KernelError(f"kernel '{self.name}' has more than {self._max_instructions:,} instructions; check its "
                              f"shape, or raise the limit with TRNSIM_MAX_INSTRUCTIONS=N (about 1 KB of host "
                              f"memory each)")
        tracker = self._deps
        cls = type(ins)
        # LoadStationary can start as soon as the stationary operand is ready (ins.first_deps)
        if cls is MatMul and key is None and type(tracker) is NativeDependencyTracker:
            ins.deps = tracker.record_matmul(ins, ins.stationary, ins.moving, ins.dst, ins.accumulate)  # type: ignore[attr-defined]
            self._track_stationary(ins)
        elif isinstance(ins, MatMul):
            ins.deps = tracker.record(ins, key or ins.engine, ins.stationary)
            self._track_stationary(ins)
        elif cls is Transpose and key is None and type(tracker) is NativeDependencyTracker:
            ins.deps = tracker.record_transpose(ins, ins.data, ins.dst)  # type: ignore[attr-defined]
            self._loaded_stationary = None
        elif isinstance(ins, Transpose):
            ins.deps = tracker.record(ins, key or ins.engine, ins.data)  # type: ignore[attr-defined]
            self._loaded_stationary = None
        else:
            ins.deps = tracker.record(ins, key or ins.engine)
            loaded = self._loaded_stationary
            if loaded is not None:  # a write to the loaded stationary's tile unloads it
                uid = loaded[0]
                for w in ins.writes:
                    if type(w) is TileAP and w.alloc.uid == uid:
                        self._loaded_stationary = None
                        break
        instrs.append(ins)
        return ins

    def _emit_op(self, ins: Instruction) -> Instruction:
        """:meth:`_emit` of a VectorE/ScalarE/GpSimd instruction from an op method's checked path
        (every operand a tile, the engine's own queue): the same instruction, with the
        ownership and liveness checks inline; anything out of the ordinary (and every error)
        goes through :meth:`_emit`."""
        allocs = self._allocs
        for ap in ins.reads:
            a = ap.alloc
            if allocs.get(a.uid) is not a or not a.live:
                return self._emit(ins)
        for ap in ins.writes:
            a = ap.alloc
            if allocs.get(a.uid) is not a or not a.live:
                return self._emit(ins)
        instrs = self.instructions
        idx = len(instrs)
        if idx >= self._max_instructions:
            return self._emit(ins)
        ins.index = idx
        ins.deps = self._deps.record(ins, ins.engine)
        loaded = self._loaded_stationary
        if loaded is not None:  # a write to the loaded stationary's tile unloads it
            uid = loaded[0]
            for w in ins.writes:
                if w.alloc.uid == uid:
                    self._loaded_stationary = None
                    break
        instrs.append(ins)
        return ins

    def _track_stationary(self, ins: Instruction) -> None:
        """Mark matmuls whose stationary operand is still loaded in the PE array (no LS)."""
        if isinstance(ins, MatMul):
            s = ins.stationary
            key = (s.alloc.uid, s.p_start, s.p_count, s.offset, s.dims, s.dtype.name)
            if key == self._loaded_stationary:
                ins.load_stationary = False
            self._loaded_stationary = key
            return
        if isinstance(ins, Transpose):
            self._loaded_stationary = None
            return
        if self._loaded_stationary is not None:
            uid = self._loaded_stationary[0]
            if any(isinstance(w, TileAP) and w.alloc.uid == uid for w in ins.writes):
                self._loaded_stationary = None

    def _check_compute(self, what: str, engine: str, aps: Sequence[TileAP]) -> None:
        passed = self._compute_ok
        for ap in aps:
            if type(ap) is TileAP:
                # these rules depend on the view's geometry and the engine alone: a geometry
                # that passed them once passes again (a failing one is checked, and named, each time)
                key = (engine, ap._geo or _geometry(ap))
                if key in passed:
                    continue
                self._check_compute_one(what, engine, ap)
                passed.add(key)
                continue
            self._check_compute_one(what, engine, ap)

    def _check_compute_one(self, what: str, engine: str, ap: TileAP) -> None:
        """One operand of :meth:`_check_compute`: the rules, with their messages."""
        if not isinstance(ap, TileAP):
            if isinstance(ap, (HbmAP, HbmTensor)):
                raise KernelError(f"{what}: operands must be SBUF/PSUM tiles, got HBM view {ap!r}; "
                                  f"load it with dma_copy first")
            raise KernelError(f"{what}: operands must be SBUF/PSUM tiles, got {type(ap).__name__}")
        if engine == "GpSimd" and ap.space == "psum":
            raise KernelError(f"{what}: GpSimd cannot access PSUM (tile '{ap.name}'); use the vector or scalar engine")
        _check_alignment(ap, what)
        for stride, size in ap.dims:
            if size > AP_MAX_SIZE or not -AP_MAX_STRIDE - 1 <= stride <= AP_MAX_STRIDE:
                raise KernelError(f"{what}: tile '{ap.name}' access pattern {list(ap.dims)} needs sizes <= "
                                  f"{AP_MAX_SIZE} and strides within {-AP_MAX_STRIDE - 1}..{AP_MAX_STRIDE} elements")
        if engine == "Vector":
            vec = self.config.core.vector
            limit = vec.max_free_psum if ap.space == "psum" else vec.max_free_sbuf
            if ap.free_size > limit:
                raise KernelError(f"{what}: tile '{ap.name}' has {ap.free_size} elements per partition; "
                                  f"a VectorE instruction may touch at most {limit} in {ap.space.upper()}")

    # ---- DMA -------------------------------------------------------------------------------
    def dma_copy(self, dst: AP | HbmTensor, src: AP | HbmTensor, *, engine: str = "sync", queue: int = 0) -> DmaCopy:
        """Copy ``src`` to ``dst`` (HBM<->SBUF, SBUF->SBUF, HBM->HBM), casting if dtypes differ.

        The trigger runs on ``engine``'s sequencer (sync by default, like NKI's DMAs on
        qSyncIO); the transfer runs on DMA queue ``queue`` of that engine. Transfers in one
        queue complete in order; different queues overlap.
        """
        td, ts = type(dst), type(src)
        el = self._lanes.get((engine, queue)) if (td is TileAP or td is HbmAP) and (ts is TileAP or ts is HbmAP) \
            and type(engine) is str and type(queue) is int else None
        if el is None:  # checked once per (engine, queue) of plain views; anything else every time
            for nm, x in (("dst", dst), ("src", src)):
                if not isinstance(x, (HbmTensor, HbmAP, TileAP)):
                    raise KernelError(f"dma_copy: {nm} must be an HBM tensor or view or an SBUF tile, got {type(x).__name__}")
            dst = dst.full() if isinstance(dst, HbmTensor) else dst
            src = src.full() if isinstance(src, HbmTensor) else src
            eng = engine_name(engine, ("Sync", "Scalar", "GpSimd", "Vector", "Tensor"), "dma_copy")
            lane = self._dma_lane(eng, queue, "dma_copy")
            if type(engine) is str and type(queue) is int:
                self._lanes[(engine, queue)] = (eng, lane)
        else:
            eng, lane = el
        ins = DmaCopy(eng, dst, src, lane)
        # a kernel moves the same shapes between the same partitions over and over: plan each once
        key = (dst._geo or _dma_geometry(dst), src._geo or _dma_geometry(src))
        plan = self._dma_plans.get(key)
        if plan is None:
            plan = self._dma_plans[key] = plan_dma(dst, src, self.config)
        ins.plan = plan
        return self._emit(ins, key=lane)  # type: ignore[return-value]

    def _dma_lane(self, eng: str, queue: Any, what: str) -> str:
        """The DMA queue lane ``engine``/``queue`` names, registering it (16 per kernel at most)."""
        queue = checked_int(queue, f"{what}: queue", lo=0)
        n = self.config.core.dma.queues
        if queue >= n:
            raise KernelError(f"{what}: queue {queue} does not exist; {self.config.name} has DMA queues 0..{n - 1} "
                              f"per engine (core.dma.queues)")
        lane = f"q{eng}IO{queue}"
        if lane not in self.queues:
            if len(self.queues) >= self.config.core.dma.queues:
                raise KernelError(f"{what}: kernel uses more than {self.config.core.dma.queues} DMA queues "
                                  f"(core.dma.queues on {self.config.name}); reuse one of {', '.join(self.queues)}")
            self.queues[lane] = len(self.queues)
        return lane

    def dma_gather(self, dst: TileAP, src: HbmAP | HbmTensor, indices: TileAP, *, engine: str = "gpsimd",
                   queue: int = 0, oob_mode: str = "error") -> DmaGather:
        """Indirect DMA: ``dst[p, :] = src[indices[p], :]`` for each partition ``p`` of ``dst``.

        ``src`` is a 2-D ``[rows, D]`` HBM view, ``dst`` an SBUF tile with D elements per
        partition, ``indices`` an int32 ``[P, 1]`` SBUF tile whose values are read when the
        transfer runs (NKI's ``dma_copy`` with a dynamic index). Only software descriptor
        generation on GpSimd supports indirect access (datasheet §6), so ``engine`` must be
        gpsimd. Each row costs one descriptor. An index outside ``0..rows-1`` stops the run
        with an error (``oob_mode="error"``, NKI's default) or leaves that partition
        unwritten (``oob_mode="skip"``).
        """
        what = "dma_gather"
        rows, lane, eng, oob = self._indirect_operands(what, dst, src, indices, engine, queue, oob_mode, "dst", "src")
        ins = DmaGather(eng, dst, rows, indices, lane, oob)
        ins.plan = plan_indirect(dst, rows, True, self.config)
        return self._emit(ins, key=lane)  # type: ignore[return-value]

    def dma_scatter(self, dst: HbmAP | HbmTensor, src: TileAP, indices: TileAP, *, engine: str = "gpsimd",
                    queue: int = 0, oob_mode: str = "error") -> DmaScatter:
        """Indirect DMA, the reverse of :meth:`dma_gather`: ``dst[indices[p], :] = src[p, :]``.
        Two partitions naming the same row are a run-time error (hardware leaves their order
        undefined)."""
        what = "dma_scatter"
        rows, lane, eng, oob = self._indirect_operands(what, src, dst, indices, engine, queue, oob_mode, "src", "dst")
        ins = DmaScatter(eng, rows, src, indices, lane, oob)
        ins.plan = plan_indirect(src, rows, False, self.config)
        return self._emit(ins, key=lane)  # type: ignore[return-value]

    def _indirect_operands(self, what: str, tile: Any, rows: Any, indices: Any, engine: str, queue: Any,
                           oob_mode: Any, tile_nm: str, rows_nm: str) -> tuple[HbmAP, str, str, str]:
        """Check a gather/scatter's operands; return (rows view, lane, engine, oob_mode)."""
        if not isinstance(tile, TileAP) or tile.space != "sbuf":
            raise KernelError(f"{what}: {tile_nm} must be an SBUF tile, got {tile!r}")
        if not isinstance(rows, (HbmTensor, HbmAP)):
            raise KernelError(f"{what}: {rows_nm} must be an HBM tensor or view, got {type(rows).__name__}")
        rows = rows.full() if isinstance(rows, HbmTensor) else rows
        if len(rows.shape) != 2:
            raise KernelError(f"{what}: {rows_nm} '{rows.tensor.name}' must be a 2-D [rows, D] view, got shape {rows.shape}")
        if tile.free_size != rows.shape[1]:
            raise KernelError(f"{what}: {tile_nm} '{tile.name}' has {tile.free_size} elements per partition but "
                              f"{rows_nm} rows of '{rows.tensor.name}' have {rows.shape[1]}")
        if not isinstance(indices, TileAP) or indices.space != "sbuf" or indices.dtype.name != "int32":
            raise KernelError(f"{what}: indices must be an int32 SBUF tile, got {indices!r}")
        if indices.p_count != tile.p_count or indices.free_size != 1:
            raise KernelError(f"{what}: indices '{indices.name}' must be [{tile.p_count}, 1] (one row index per "
                              f"partition of '{tile.name}'), got {indices.shape}")
        eng = _ENGINE_NAMES.get(str(engine).lower(), str(engine))
        if eng != "GpSimd":
            raise KernelError(f"{what}: engine {engine!r} cannot generate indirect descriptors; only gpsimd "
                              f"(software DGE) can (datasheet §6)")
        if oob_mode not in ("error", "skip"):
            raise KernelError(f"{what}: oob_mode must be 'error' or 'skip', got {oob_mode!r}")
        return rows, self._dma_lane(eng, queue, what), eng, oob_mode

    # ---- TensorE ---------------------------------------------------------------------------
    def nc_matmul(self, dst: TileAP, stationary: TileAP, moving: TileAP, *, accumulate: bool = False) -> MatMul:
        """``dst[M,N] (+)= stationary[K,M]ᵀ @ moving[K,N]`` on the PE array.

        K is the partition axis of both operands (<= 128; fp8 "double-row" operands are shaped
        [K, 2, M] and [K, 2, N] and contract over 2K). ``accumulate=True`` adds into the PSUM
        accumulation group instead of starting it.
        """
        if type(dst) is TileAP and type(stationary) is TileAP and type(moving) is TileAP:
            # the rules below depend on the operands' geometry alone: check each geometry once
            # (a matmul kernel repeats a handful of them thousands of times)
            key = (dst._geo or _geometry(dst), dst.alloc.addr, dst.offset, stationary._geo or _geometry(stationary),
                   moving._geo or _geometry(moving))  # interned geometries: a key of five ints
            double_row = self._matmul_ok.get(key)
            if double_row is None:
                double_row = self._matmul_ok[key] = self._check_matmul(dst, stationary, moving)
        else:
            double_row = self._check_matmul(dst, stationary, moving)
        return self._emit(MatMul(dst, stationary, moving, accumulate, double_row))  # type: ignore[return-value]

    def nc_matmul_row(self, stationary: TileAP, pairs: Sequence[tuple[TileAP, TileAP]], *,
                      accumulate: bool = False) -> None:
        """``nc_matmul(dst, stationary, moving, accumulate=accumulate)`` for each ``(dst, moving)``
        of ``pairs`` in order: one stationary serving a row of PSUM banks, as a blocked matmul
        issues it. The same instructions, checks and errors as those calls; a matmul whose
        operands are new geometries, not live or not this kernel's, and every matmul of a
        :func:`reference_build`, goes through :meth:`nc_matmul` itself."""
        if self.reference or type(stationary) is not TileAP:
            for dst, mv in pairs:
                self.nc_matmul(dst, stationary, mv, accumulate=accumulate)
            return
        allocs, ok, instrs = self._allocs, self._matmul_ok, self.instructions
        sa = stationary.alloc
        s_ok = allocs.get(sa.uid) is sa and sa.live  # nothing frees a tile between the pairs
        gs = stationary._geo or _geometry(stationary)
        s_key = (sa.uid, stationary.p_start, stationary.p_count, stationary.offset, stationary.dims,
                 stationary.dtype.name)
        tracker = self._deps
        record = tracker.record_matmul if type(tracker) is NativeDependencyTracker else None
        acc = accumulate  # stored as given, as nc_matmul does
        limit = self._max_instructions
        for dst, mv in pairs:
            double_row = None
            if s_ok and type(dst) is TileAP and type(mv) is TileAP:
                da, ma = dst.alloc, mv.alloc
                key = (dst._geo or _geometry(dst), da.addr, dst.offset, gs, mv._geo or _geometry(mv))
                double_row = ok.get(key)
                if double_row is not None and (allocs.get(da.uid) is not da or not da.live
                                               or allocs.get(ma.uid) is not ma or not ma.live
                                               or len(instrs) >= limit):
                    double_row = None
            if double_row is None:  # new geometry (nc_matmul checks it and fills the cache), or an error
                self.nc_matmul(dst, stationary, mv, accumulate=accumulate)
                continue
            ins = MatMul(dst, stationary, mv, acc, double_row)
            ins.index = len(instrs)
            ins.deps = record(ins, stationary, mv, dst, acc) if record is not None else \
                tracker.record(ins, "Tensor", stationary)
            if s_key == self._loaded_stationary:
                ins.load_stationary = False
            self._loaded_stationary = s_key
            instrs.append(ins)

    def nc_matmul_many(self, ops: Sequence[tuple[TileAP, TileAP, TileAP, bool]]) -> None:
        """``nc_matmul(dst, stationary, moving, accumulate=acc)`` for each ``(dst, stationary,
        moving, acc)`` of ``ops`` in order (a blocked matmul's k-tiles between two loads): the
        same instructions, checks and errors as those calls. When every operand geometry has
        been checked before, all are live and the instruction limit is not reached, the C
        tracker records them in one call; otherwise (and in a :func:`reference_build`) each goes
        through :meth:`nc_matmul_row`."""
        tracker = self._deps
        instrs = self.instructions
        if not ops or self.reference or type(tracker) is not NativeDependencyTracker or \
                len(instrs) + len(ops) > self._max_instructions:
            for dst, st, mv, acc in ops:
                self.nc_matmul_row(st, ((dst, mv),), accumulate=acc)
            return
        allocs, ok = self._allocs, self._matmul_ok
        made: list[MatMul] = []
        for dst, st, mv, acc in ops:
            if type(dst) is not TileAP or type(st) is not TileAP or type(mv) is not TileAP:
                break
            da, sa, ma = dst.alloc, st.alloc, mv.alloc
            double_row = ok.get((dst._geo or _geometry(dst), da.addr, dst.offset, st._geo or _geometry(st),
                                 mv._geo or _geometry(mv)))
            if double_row is None or allocs.get(da.uid) is not da or not da.live or allocs.get(sa.uid) is not sa \
                    or not sa.live or allocs.get(ma.uid) is not ma or not ma.live:
                break
            made.append(MatMul(dst, st, mv, acc, double_row))
        if len(made) < len(ops):  # something to check: one at a time, with nc_matmul's errors
            for dst, st, mv, acc in ops:
                self.nc_matmul_row(st, ((dst, mv),), accumulate=acc)
            return
        i0 = len(instrs)
        for i, m in enumerate(made):
            m.index = i0 + i
        tracker.record_matmuls(made)
        loaded = self._loaded_stationary
        prev = None
        for m in made:
            s = m.stationary
            if s is not prev:
                key = (s.alloc.uid, s.p_start, s.p_count, s.offset, s.dims, s.dtype.name)
                prev = s
            if key == loaded:
                m.load_stationary = False
            loaded = key
        self._loaded_stationary = loaded
        instrs.extend(made)

    def replay_template(self, i0: int, hbm: Sequence[int], tiles: Sequence[tuple[int, TileAP]] = (),
                        end: tuple[int, Any] | None = None) -> "Replay | None":
        """The instructions from ``i0`` to the end, as a :class:`Replay` (None when they are not
        replayable: a reference build, the Python tracker, no matmul, an instruction other than
        a DMA copy, a matmul, a PE transpose or one of the tile-only engine ops of
        ``_REPLAYABLE_OPS``, an HBM operand other than the HBM side of the DMAs at positions
        ``hbm``). ``tiles``: (position, view) of tile operands that :meth:`replay` replaces
        (``tiles=`` there, in this order): each must be read, not as a matmul's stationary or a
        transpose's data, and not written by its instruction. ``end``: (index, loaded stationary
        then) when the run ended before the last instruction (a template made later, when first
        wanted)."""
        tracker = self._deps
        if self.reference or type(tracker) is not NativeDependencyTracker or \
                not hasattr(tracker._lib, "dt_record_many"):  # a module built before it had it
            return None
        ins = self.instructions[i0:] if end is None else self.instructions[i0:end[0]]
        want = set(hbm)
        spec: list[int] = []
        read_at: list[int] = []
        sides: list[tuple[int, bool, int]] = []
        allocs: dict[int, Allocation] = {}
        keys = tracker._keys
        for j, x in enumerate(ins):
            cls = type(x)
            if cls is DmaCopy:
                key, first = x.queue, -1
            elif cls is MatMul:
                key, first = x.engine, 0
                if x.reads[0] is not x.stationary or x.first_deps is None:
                    return None
            elif cls is Transpose:  # recorded as record_transpose does: first = data
                key, first = x.engine, 0
                if x.reads[0] is not x.data or x.first_deps is None:
                    return None
            elif cls in _REPLAYABLE_OPS:
                key, first = x.engine, -1
            else:
                return None
            if cls not in _FIRST_OPERAND and x.first_deps is not None:
                return None
            kid = keys.get(key)
            if kid is None:
                return None
            spec.extend((kid, 1 if x.is_dma else 0, first, len(x.reads)))
            read_at.append(len(spec))  # where its reads start in the spec
            for group in (x.reads, x.writes):
                if group is x.writes:
                    spec.append(len(x.writes))
                for ap in group:
                    d = ap._dep_h
                    if d is None or d[0] is not tracker:
                        return None
                    if type(ap) is TileAP:
                        allocs[ap.alloc.uid] = ap.alloc
                    elif j in want and cls is DmaCopy and (ap is x.src) != (ap is x.dst):
                        sides.append((j, ap is x.src, len(spec)))
                    else:
                        return None
                    spec.append(d[1])
        if [j for j, _, _ in sides] != sorted(want):  # one HBM side at each position, in order
            return None
        tile_sides = []
        if tiles:
            base = set(slot_names(Instruction))  # index, engine, reads, writes, deps...: no operand slot
            for j, t in tiles:
                x = ins[j]
                reads = x.reads
                ri = (reads.index(t),) if reads.count(t) == 1 else tuple(i for i, ap in enumerate(reads) if ap is t)
                if type(t) is not TileAP or not ri or t in x.writes or (type(x) in _FIRST_OPERAND and 0 in ri):
                    return None
                names = tuple(n for n in slot_names(type(x)) if n not in base and getattr(x, n, None) is t)
                tile_sides.append((j, names, ri, tuple(read_at[j] + i for i in ri)))
        # the loaded stationary matters up to the first matmul: the tiles written before it
        # (a write unloads the stationary of its tile), its stationary and whether it loaded it
        first = next((x for x in ins if type(x) is MatMul), None)
        if first is None:
            return None
        unloads = frozenset(w.alloc.uid for x in ins[:ins.index(first)] for w in x.writes if type(w) is TileAP)
        return Replay(ins, array.array("i", spec), sides, tuple(allocs.values()), unloads,
                      _stationary_key(first.stationary), first.load_stationary,
                      self._loaded_stationary if end is None else end[1], tile_sides)

    def replay(self, tpl: "Replay", views: Sequence[HbmAP], tiles: Sequence[TileAP] = ()) -> bool:
        """Emit ``tpl``'s instructions again at the end of the stream, the i-th replaced HBM side
        being ``views[i]`` (in the template's order): the instructions the calls that made the
        template would emit now, when they would emit the same ones with those views (the
        caller's claim: the same operands from the same builder state); their ``deps`` and
        ``first_deps`` come from the tracker, fed every access in order. Returns False, having
        changed nothing, when the kernel's part of that state differs: the loaded stationary,
        a tile not live or not this kernel's, an HBM tensor not this kernel's, the instruction
        limit reached. ``tiles``: the views that replace the template's tile operands named by
        replay_template's ``tiles`` (the caller's claim: the same geometry on another buffer)."""
        instrs, n = self.instructions, len(tpl.ins)
        i0 = len(instrs)
        loaded = self._loaded_stationary
        if loaded is not None and loaded[0] in tpl.unloads:
            loaded = None
        # the first matmul loads its stationary as the template's did: the rest follows
        if (tpl.first_key != loaded) != tpl.first_loads or i0 + n > self._max_instructions \
                or len(views) != len(tpl.sides):
            return False
        allocs, tensors = self._allocs, self.tensors
        for a in tpl.allocs:
            if allocs.get(a.uid) is not a or not a.live:
                return False
        if len(tiles) != len(tpl.tile_sides):
            return False
        for t in tiles:
            if type(t) is not TileAP or allocs.get(t.alloc.uid) is not t.alloc or not t.alloc.live:
                return False
        plans, ins = self._dma_plans, tpl.ins
        new_plans = []
        for (j, is_src, _), v in zip(tpl.sides, views):
            if type(v) is not HbmAP or tensors.get(v.tensor.name) is not v.tensor:
                return False
            x = ins[j]
            g = v._geo or _dma_geometry(v)  # as dma_copy keys its plan cache
            if g == (x.src if is_src else x.dst)._geo:
                plan = x.plan  # the template's key, so the plan dma_copy gave it
            else:
                plan = plans.get((x.dst._geo, g) if is_src else (g, x.src._geo))
                if plan is None:  # a geometry not planned yet: dma_copy plans it
                    return False
            new_plans.append(plan)
        tracker = self._deps
        spec = array.array("i", tpl.spec)
        for (_, _, at), v in zip(tpl.sides, views):
            spec[at] = tracker.region(v)
        for (_, _, _, ats), t in zip(tpl.tile_sides, tiles):
            r = tracker.region(t)
            for at in ats:
                spec[at] = r
        if tpl.firsts is not None:  # the copies, their tuples and the log's entries in C
            out = _clone.replay(tpl.ins, tpl.firsts, i0, tracker.record_many_raw(i0, n, spec), tracker._dlog,
                                tracker._flog)
        else:
            raw = tracker.record_many(i0, n, spec)
            offs, vals = raw[:2 * n + 1], tuple(raw[2 * n + 1:])  # slices of a tuple are tuples: one allocation each
            out = [clone(x, i, vals[b:c], vals[a:b]) for x, clone, i, a, b, c in
                   zip(tpl.ins, tpl.cloners, range(i0, i0 + n), offs[0:2 * n:2], offs[1:2 * n:2], offs[2::2])]
            tracker.log_recorded(out)
        for (j, is_src, _), v, plan in zip(tpl.sides, views, new_plans):
            x = out[j]
            if is_src:
                x.src, x.reads = v, (v,)
            else:
                x.dst, x.writes = v, (v,)
            x.plan = plan
        for (j, names, ri, _), t in zip(tpl.tile_sides, tiles):
            x = out[j]
            for name in names:
                setattr(x, name, t)
            reads = x.reads
            if len(ri) == 1:
                i = ri[0]
                x.reads = reads[:i] + (t,) + reads[i + 1:]
            else:
                x.reads = tuple(t if i in ri else ap for i, ap in enumerate(reads))
        self._loaded_stationary = tpl.loaded_after
        instrs.extend(out)
        self.replays += 1
        return True

    def _check_matmul(self, dst: TileAP, stationary: TileAP, moving: TileAP) -> bool:
        """Check an ``nc_matmul``'s operands against TensorE's rules; return whether it is an
        fp8 double-row matmul."""
        t = self.config.core.tensor
        what = "nc_matmul"
        self._check_compute(what, "Tensor", (dst, stationary, moving))
        for name, ap in (("stationary", stationary), ("moving", moving)):
            if ap.space != "sbuf":
                raise KernelError(f"{what}: {name} '{ap.name}' is in {ap.space.upper()}; TensorE reads operands from SBUF only")
            if ap.dtype.name not in _MATMUL_DTYPES:
                raise KernelError(f"{what}: {name} dtype {ap.dtype.name} is not a TensorE input type; expected "
                                  f"bf16, fp16, fp32, fp8_e4m3, fp8_e4m3fn or fp8_e5m2")
        if dst.space != "psum":
            raise KernelError(f"{what}: dst '{dst.name}' is in {dst.space.upper()}; TensorE writes to PSUM only")
        if (stationary.dtype.name == "float32") != (moving.dtype.name == "float32"):
            raise KernelError(f"{what}: if one operand is fp32 the other must be too "
                              f"(got {stationary.dtype.name} x {moving.dtype.name})")
        fp8 = stationary.dtype.name.startswith("float8") and moving.dtype.name.startswith("float8")
        double_row = fp8 and len(stationary.dims) == 2 and stationary.dims[0][1] == 2
        if double_row:
            if not t.fp8_double_row:
                raise KernelError(f"{what}: a [K, 2, M] double-row stationary needs fp8 operands on a core with "
                                  f"FP8 double-row (core.tensor.fp8_double_row on {self.config.name})")
            if len(moving.dims) != 2 or moving.dims[0][1] != 2:
                raise KernelError(f"{what}: double-row moving must be shaped [K, 2, N], got {moving.shape}")
            m_size, n_size = stationary.dims[1][1], moving.dims[1][1]
        else:
            m_size, n_size = stationary.free_size, moving.free_size
        k = stationary.p_count
        if moving.p_count != k:
            raise KernelError(f"{what}: contraction mismatch: stationary has {k} partitions, moving has {moving.p_count}")
        if k > t.max_contraction:
            raise KernelError(f"{what}: contraction {k} partitions exceeds {t.max_contraction} (core.tensor.max_contraction)")
        if m_size > t.stationary_max_free:
            raise KernelError(f"{what}: stationary free size {m_size} exceeds {t.stationary_max_free} "
                              f"(core.tensor.stationary_max_free on {self.config.name})")
        if dst.dtype.name == "float32":
            n_max, key = t.moving_max_free, "core.tensor.moving_max_free"
        elif dst.dtype.name == "bfloat16" and t.moving_max_free_bf16_dst > 0:
            n_max, key = t.moving_max_free_bf16_dst, "core.tensor.moving_max_free_bf16_dst"
        else:
            raise KernelError(f"{what}: PSUM dst dtype {dst.dtype.name} unsupported on {self.config.name}; expected fp32"
                              + (" or bf16" if t.moving_max_free_bf16_dst else ""))
        if n_size > n_max:
            raise KernelError(f"{what}: moving free size {n_size} exceeds {n_max} ({key} on {self.config.name})")
        if dst.p_count != m_size or dst.free_size != n_size:
            raise KernelError(f"{what}: dst '{dst.name}' has shape {dst.shape}, expected [{m_size}, {n_size}] "
                              f"(stationary free x moving free)")
        check_matmul_dst(dst, self.config, what)
        return double_row

    def nc_transpose(self, dst: TileAP, data: TileAP) -> Transpose:
        """``dst[F, P] = data[P, F]ᵀ`` through the PE array (bit exact; 2-byte types stay 2-byte)."""
        if type(dst) is TileAP and type(data) is TileAP:
            # like nc_matmul's: the rules depend on the operands' geometry alone, checked once
            key = (dst._geo or _geometry(dst), dst.alloc.addr, dst.offset, data._geo or _geometry(data))
            if key not in self._transpose_ok:
                self._check_transpose(dst, data)
                self._transpose_ok.add(key)
        else:
            self._check_transpose(dst, data)
        return self._emit(Transpose(dst, data))  # type: ignore[return-value]

    def nc_transpose_many(self, pairs: Sequence[tuple[TileAP, TileAP]]) -> None:
        """``nc_transpose(dst, data)`` for each ``(dst, data)`` of ``pairs`` in order: the same
        instructions, checks and errors as those calls. When every pair's geometry was checked
        before, all tiles are live and this kernel's and the instruction limit is not reached,
        the C tracker records them in one call; otherwise (and in a :func:`reference_build`)
        each goes through :meth:`nc_transpose`."""
        tracker, instrs = self._deps, self.instructions
        if not pairs or self.reference or type(tracker) is not NativeDependencyTracker or \
                len(instrs) + len(pairs) > self._max_instructions:
            for dst, data in pairs:
                self.nc_transpose(dst, data)
            return
        allocs, ok = self._allocs, self._transpose_ok
        made: list[Transpose] = []
        for dst, data in pairs:
            if type(dst) is not TileAP or type(data) is not TileAP:
                break
            da, sa = dst.alloc, data.alloc
            if (dst._geo or _geometry(dst), da.addr, dst.offset, data._geo or _geometry(data)) not in ok or \
                    allocs.get(sa.uid) is not sa or not sa.live or allocs.get(da.uid) is not da or not da.live:
                break
            made.append(Transpose(dst, data))
        if len(made) < len(pairs):  # something to check: one at a time, with nc_transpose's errors
            for dst, data in pairs:
                self.nc_transpose(dst, data)
            return
        i0 = len(instrs)
        for i, m in enumerate(made):
            m.index = i0 + i
        tracker.record_transposes(made)
        self._loaded_stationary = None
        instrs.extend(made)

    def _check_transpose(self, dst: TileAP, data: TileAP) -> None:
        t = self.config.core.tensor
        what = "nc_transpose"
        self._check_compute(what, "Tensor", (dst, data))
        if data.space != "sbuf" or dst.space != "psum":
            raise KernelError(f"{what}: data must be in SBUF and dst in PSUM (got {data.space.upper()} -> {dst.space.upper()})")
        p, f = data.p_count, data.free_size
        if p > t.pe_rows or f > t.stationary_max_free:
            raise KernelError(f"{what}: data [{p}, {f}] exceeds the {t.pe_rows}x{t.stationary_max_free} PE array")
        if dst.p_count != f or dst.free_size != p:
            raise KernelError(f"{what}: dst '{dst.name}' has shape {dst.shape}, expected [{f}, {p}]")
        if dst.dtype != data.dtype and dst.dtype.name != "float32":
            raise KernelError(f"{what}: dst dtype {dst.dtype.name} must be fp32 or the input dtype {data.dtype.name}")
        check_matmul_dst(dst, self.config, what)

    # ---- Vector / Scalar / GpSimd ----------------------------------------------------------
    def activation(self, dst: TileAP, op: Any, data: TileAP, *, bias: TileAP | float | None = None,
                   scale: TileAP | float = 1.0, reduce_op: Any = None, reduce_res: TileAP | None = None) -> Activation:
        """ScalarE ``dst = op(data * scale + bias)``; with ``reduce_op`` ('add'/'max') also writes
        the per-partition reduction of the result to ``reduce_res`` [P, 1]."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op (nl.exp too)
        if type(on) is str and type(dst) is TileAP and type(data) is TileAP and \
                (reduce_op is None or type(reduce_op) is str) and (reduce_res is None or type(reduce_res) is TileAP):
            key = (_ACT, on, dst._geo or _geometry(dst), data._geo or _geometry(data), _arg_key(bias),
                   _arg_key(scale), reduce_op, None if reduce_res is None else _arg_key(reduce_res))
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
        _check_same_shape(what, dst, data)
        for nm, x in (("bias", bias), ("scale", scale)):
            if isinstance(x, TileAP):
                _check_per_partition(what, nm, x, data)
            elif x is not None and not isinstance(x, (int, float)):
                raise KernelError(f"{what}: {nm} must be a number or a [P, 1] tile, got {type(x).__name__}")
        rop = None
        if reduce_op is not None or reduce_res is not None:
            if reduce_op is None or reduce_res is None:
                raise KernelError(f"{what}: reduce_op and reduce_res go together")
            rop = reduce_op_checked(reduce_op, ("add", "max", "min"), what)
            _check_per_partition(what, "reduce_res", reduce_res, data)
        return func, rop

    def tensor_tensor(self, dst: TileAP, data1: TileAP, data2: TileAP, op: Any, *, engine: str = "vector") -> TensorTensor:
        """Elementwise ``dst = data1 op data2`` (shapes equal; use ``broadcast_to`` to broadcast)."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op
        if type(on) is str and type(engine) is str and type(dst) is TileAP and type(data1) is TileAP and \
                type(data2) is TileAP:
            key = (_TT, engine, on, dst._geo or _geometry(dst), data1._geo or _geometry(data1),
                   data2._geo or _geometry(data2))
            done = self._op_ok.get(key)
            if done is None:
                done = self._op_ok[key] = self._check_tensor_tensor(dst, data1, data2, op, engine)
            return self._emit_op(TensorTensor(done[0], dst, data1, data2, done[1]))  # type: ignore[return-value]
        done = self._check_tensor_tensor(dst, data1, data2, op, engine)
        return self._emit(TensorTensor(done[0], dst, data1, data2, done[1]))  # type: ignore[return-value]

    def _check_tensor_tensor(self, dst: TileAP, data1: TileAP, data2: TileAP, op: Any, engine: Any) -> tuple[str, str]:
        """:meth:`tensor_tensor`'s checks; returns (engine, op name)."""
        what = f"tensor_tensor({getattr(op, '__name__', op)})"
        eng = engine_name(engine, ("Vector", "GpSimd"), what)
        opn = alu_op(op)
        self._check_compute(what, eng, (dst, data1, data2))
        _check_same_shape(what, dst, data1)
        _check_same_shape(what, dst, data2)
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
            key = (_TS, engine, o0n, o1n, dst._geo or _geometry(dst), data._geo or _geometry(data),
                   _arg_key(operand0), _arg_key(operand1))
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
        allowed = ("Vector", "GpSimd", "Scalar")
        eng = engine_name(engine, allowed, what)
        o0 = alu_op(op0)
        o1 = alu_op(op1) if op1 is not None else None
        if (op1 is None) != (operand1 is None):
            raise KernelError(f"{what}: op1 and operand1 go together")
        aps = [dst, data] + [x for x in (operand0, operand1) if isinstance(x, TileAP)]
        self._check_compute(what, eng, aps)
        _check_same_shape(what, dst, data)
        for nm, x in (("operand0", operand0), ("operand1", operand1)):
            if isinstance(x, TileAP):
                _check_per_partition(what, nm, x, data)
            elif x is not None and not isinstance(x, (int, float)):
                raise KernelError(f"{what}: {nm} must be a number or a [P, 1] tile, got {type(x).__name__}")
        return eng, o0, o1

    def tensor_reduce(self, dst: TileAP, op: Any, data: TileAP, axis: int | Sequence[int], *, negate: bool = False,
                      engine: str = "vector") -> TensorReduce:
        """Reduce free axes ``axis`` (1 = the first free axis, as in NKI) of ``data`` into ``dst``."""
        on = op if type(op) is str else getattr(op, "__name__", None)  # what the checks read of op
        if type(on) is str and type(engine) is str and type(dst) is TileAP and type(data) is TileAP and \
                (type(axis) is int or (type(axis) is tuple and all(type(a) is int for a in axis))):
            key = (_TR, engine, on, axis, dst._geo or _geometry(dst), data._geo or _geometry(data))
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
        eng = engine_name(engine, ("Vector", "GpSimd"), what)
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
            key = (_TC, engine, dst._geo or _geometry(dst), src._geo or _geometry(src))
            eng = self._op_ok.get(key)
            if eng is None:
                eng = self._op_ok[key] = self._check_tensor_copy(dst, src, engine)
            return self._emit_op(TensorCopy(eng, dst, src))  # type: ignore[return-value]
        eng = self._check_tensor_copy(dst, src, engine)
        return self._emit(TensorCopy(eng, dst, src))  # type: ignore[return-value]

    def _check_tensor_copy(self, dst: TileAP, src: TileAP, engine: Any) -> str:
        """:meth:`tensor_copy`'s checks; returns the engine."""
        what = "tensor_copy"
        eng = engine_name(engine, ("Vector", "Scalar", "GpSimd"), what)
        self._check_compute(what, eng, (dst, src))
        _check_same_shape(what, dst, src)
        return eng

    def memset(self, dst: TileAP, value: float, *, engine: str = "vector") -> Memset:
        what = "memset"
        eng = engine_name(engine, ("Vector", "GpSimd", "Scalar"), what)
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
        _check_same_shape(what, dst, data)
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
        o0, o1 = _arith_op(op0, what), _arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data0, data1] + ([initial] if isinstance(initial, TileAP) else []))
        _check_same_shape(what, dst, data0)
        _check_same_shape(what, dst, data1)
        if data0.space == data1.space == "psum":
            raise KernelError(f"{what}: data0 and data1 cannot both be in PSUM")
        init = self._scalar_or_column(what, "initial", initial, data0)
        return self._emit(TensorTensorScan(dst, data0, data1, init, o0, o1, bool(reverse0), bool(reverse1)))  # type: ignore[return-value]

    def scalar_tensor_tensor(self, dst: TileAP, data: TileAP, op0: Any, operand0: TileAP | float, op1: Any,
                             operand1: TileAP, *, reverse0: bool = False, reverse1: bool = False) -> ScalarTensorTensor:
        """``dst = (data op0 operand0) op1 operand1``: ``operand0`` an immediate or [P, 1] tile,
        ``operand1`` shaped like ``data``."""
        what = "scalar_tensor_tensor"
        o0, o1 = _arith_op(op0, what), _arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data, operand1] + ([operand0] if isinstance(operand0, TileAP) else []))
        _check_same_shape(what, dst, data)
        _check_same_shape(what, dst, operand1)
        if data.space == operand1.space == "psum":
            raise KernelError(f"{what}: data and operand1 cannot both be in PSUM")
        op0v = self._scalar_or_column(what, "operand0", operand0, data)
        ins = ScalarTensorTensor(dst, data, o0, op0v, o1, operand1, bool(reverse0), bool(reverse1))
        return self._emit(ins)  # type: ignore[return-value]

    def tensor_copy_predicated(self, dst: TileAP, src: TileAP | float, predicate: TileAP, *,
                               reverse_pred: bool = False) -> CopyPredicated:
        """``dst = src`` where ``predicate`` (an unsigned integer tile) is non-zero; elsewhere
        ``dst`` keeps its values. ``src`` is a tile of dst's dtype or an immediate."""
        what = "tensor_copy_predicated"
        self._check_compute(what, "Vector", [dst, predicate] + ([src] if isinstance(src, TileAP) else []))
        _check_same_shape(what, dst, predicate)
        if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
            raise KernelError(f"{what}: predicate '{predicate.name}' is {predicate.dtype.short}; expected uint8, "
                              f"uint16 or uint32")
        if isinstance(src, TileAP):
            _check_same_shape(what, dst, src)
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
        _check_same_shape(what, dst, data)
        if not data.dtype.is_float:
            raise KernelError(f"{what}: data '{data.name}' must be a float tile, got {data.dtype.short}")
        for nm, b in (("bound0", bound0), ("bound1", bound1)):
            _check_per_partition(what, nm, b, data)
            if b.dtype.name != "float32":
                raise KernelError(f"{what}: {nm} '{b.name}' must be fp32, got {b.dtype.short}")
        if reduce_res is not None:
            _check_per_partition(what, "reduce_res", reduce_res, data)
        if checked_number(on_false, f"{what}: on_false") != FP32_MIN:
            raise KernelError(f"{what}: on_false must be FP32_MIN (-3.4028235e+38), the only value the hardware "
                              f"takes, got {on_false!r}")
        start = checked_int(range_start, f"{what}: range_start", lo=0)
        ins = RangeSelect(dst, data, cmps[0], cmps[1], bound0, bound1, start, FP32_MIN, reduce_res)
        return self._emit(ins)  # type: ignore[return-value]

    def reciprocal(self, dst: TileAP, data: TileAP) -> Reciprocal:
        """``dst = 1 / data`` on VectorE (8 cycles an element; ScalarE's activation('reciprocal')
        is one)."""
        what = "reciprocal"
        self._check_compute(what, "Vector", (dst, data))
        _check_same_shape(what, dst, data)
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
        _check_alignment(dst, what)
        eng = engine_name(engine, ("Sync", "Scalar", "GpSimd"), what)
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
            if ap.space != "sbuf" or ap.dtype.name not in _MX_DTYPES:
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
            _check_per_partition(what, name, x, like)
            return x
        return checked_number(x, f"{what}: {name}")

    # ---- introspection ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.instructions)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, {len(self.instructions)} instructions, config={self.config.name})"




_GEOMETRIES: dict[tuple[Any, ...], int] = {}  # a tile view's geometry -> a small int (process-wide)
_ACT, _TT, _TS, _TR, _TC = range(5)  # which op a Kernel._op_ok key is of


def _arg_key(x: Any) -> Any:
    """What an op's checks read of an operand that is a [P, 1] tile or a number: the tile's
    geometry number (an int), or the number's type (the checks take int and float)."""
    if type(x) is TileAP:
        return x._geo or _geometry(x)
    return type(x)


def _geometry(ap: TileAP) -> int:
    """The number of ``ap``'s geometry as the matmul checks see it (memory, partitions, free
    dims, dtype; not the address), interned once per view: a key part that hashes as one int."""
    g = (ap.alloc.space, ap.p_start, ap.p_count, ap.dims, ap.dtype.name)
    n = _GEOMETRIES.get(g)
    if n is None:
        n = _GEOMETRIES[g] = len(_GEOMETRIES) + 1
    ap._geo = n
    return n


def _dma_geometry(ap: AP) -> int:
    """The interned number of everything :func:`plan_dma` reads of one side of a copy: a tile's
    full geometry (:func:`_geometry`, finer than the plan needs), an HBM view's :func:`_dma_side`."""
    if isinstance(ap, TileAP):
        return _geometry(ap)
    g = _dma_side(ap)
    n = _GEOMETRIES.get(g)
    if n is None:
        n = _GEOMETRIES[g] = len(_GEOMETRIES) + 1
    ap._geo = n
    return n


def _dma_side(ap: AP) -> tuple[Any, ...]:
    """Everything :func:`plan_dma` reads of one side of a copy: the kind of memory, the
    partitions of a tile, the access pattern's dims and the element size (offsets and which
    tensor or tile do not change a plan)."""
    if isinstance(ap, TileAP):
        return (ap.alloc.space, ap.p_start, ap.p_count, ap.dims, ap.dtype.itemsize)
    return ("hbm", ap.dims, ap.dtype.itemsize)


def _arith_op(op: Any, what: str) -> str:
    n = alu_op(op)
    if n in BITWISE_OPS or n in _COMPARE_OPS:
        raise KernelError(f"{what}: {op!r} is not an arithmetic op")
    return n


def core_generation(config: ChipConfig) -> int:
    """2, 3, 4 for NeuronCore-v2, -v3, -v4 (from ``core.version``)."""
    digits = "".join(ch for ch in config.core.version.rsplit("v", 1)[-1] if ch.isdigit())
    return int(digits) if digits else 0


def reduce_op_checked(op: Any, allowed: Sequence[str], what: str) -> str:
    n = reduce_op(op)
    if n not in allowed:
        raise KernelError(f"{what}: reduce op {op!r} not supported here; expected one of {', '.join(allowed)}")
    return n


def _check_alignment(ap: TileAP, what: str) -> None:
    """Partition start rules of datasheet §4.6: 65-128 partitions start at 0, 33-64 at 0/64,
    1-32 at a multiple of 32."""
    n, s = ap.p_count, ap.p_start
    if n > 64:
        ok, need = s == 0, "0"
    elif n > 32:
        ok, need = s in (0, 64), "0 or 64"
    else:
        ok, need = s % 32 == 0, "0, 32, 64 or 96"
    if not ok:
        raise KernelError(f"{what}: tile '{ap.name}' covers {n} partitions starting at {s}; "
                          f"an access of {n} partitions must start at partition {need}")


def _check_same_shape(what: str, dst: TileAP, src: TileAP) -> None:
    if dst.p_count != src.p_count or dst.free_size != src.free_size:
        raise KernelError(f"{what}: shape mismatch: '{dst.name}' {dst.shape} vs '{src.name}' {src.shape}")
    if dst.p_start != src.p_start:
        n = dst.p_count
        if n > 64 or (n > 32 and {dst.p_start, src.p_start} != {0, 64}):
            raise KernelError(f"{what}: moving {n} partitions from partition {src.p_start} to {dst.p_start}; "
                              f"engines shift partitions only across halves (<=64) or quadrants (<=32)")


def _check_per_partition(what: str, name: str, x: TileAP, data: TileAP) -> None:
    if x.p_count != data.p_count or x.free_size != 1:
        raise KernelError(f"{what}: {name} '{x.name}' must be a per-partition [{data.p_count}, 1] tile, got {x.shape}")
