"""Dependency tracking: the RAW/WAR/WAW edges between a kernel's instructions on overlapping
memory, derived as each instruction is built. :class:`DependencyTracker` is the definition (Python);
:class:`NativeDependencyTracker` runs the same algorithm in C (trnsim/native/accel/deptrack.c);
:func:`reference_build` makes every kernel built inside it use the Python one."""

from __future__ import annotations

import contextlib
import os
from itertools import chain

import numpy as np
from typing import Any, Iterator, Sequence

from ..isa import AP, Allocation, HbmAP, Instruction, MatMul, TileAP, Transpose



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


try:  # the same tracker in C (trnsim/native/accel/deptrack.c), built by setup.py beside the datapath
    from ..native.accel import _deptrack  # type: ignore[attr-defined]
except ImportError:  # not built: the Python tracker does the same work, slower
    _deptrack = None
try:  # instruction copies and dependency tuples in C (trnsim/native/accel/clone.c), built by setup.py too
    from ..native.accel import _clone as native_clone  # type: ignore[attr-defined]
except ImportError:  # not built: the same copies and tuples made in Python, slower
    native_clone = None


_UNLOGGED = object()  # a record whose first_deps the C edge log does not have (equal to no tuple)
_LOG_FIRST = getattr(_deptrack.lib, "dt_log_first", None) if _deptrack is not None else None


def _hbm_box(ap: HbmAP) -> tuple[int, ...]:
    """The dependency box of an HBM view, as :meth:`DependencyTracker._resolve` makes it."""
    box = ap._dep_box
    if box is None:
        lo, hi = ap.span()
        if ap.box is not None:
            box = tuple(chain.from_iterable(ap.box)) + (lo, hi)
        else:
            box = (lo, hi)
        ap._dep_box = box
    return box


class NativeDependencyTracker:
    """:class:`DependencyTracker` with its histories, boxes and scans in C (``_deptrack``).

    The same algorithm access for access (``tests/builder/test_build_equivalence.py`` compares the two
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
        until the next C call: what ``native_clone`` reads them from."""
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
        if native_clone is not None and type(ins) is list:
            native_clone.spread(ins, self._raw(n), self._dlog, self._flog)
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
        """:meth:`record_many`'s results as :meth:`_raw` gives them (what ``native_clone.replay`` reads)."""
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
    instruction stream is the same (``tests/builder/test_build_equivalence.py`` checks it); this is
    what that test and ``benchmarks/bench_kernels.py`` compare the fast build against."""
    global _REFERENCE_BUILDS
    _REFERENCE_BUILDS += 1
    try:
        yield
    finally:
        _REFERENCE_BUILDS -= 1


def in_reference_build() -> bool:
    """Whether a :func:`reference_build` is active (a kernel made now uses the Python tracker)."""
    return _REFERENCE_BUILDS > 0


def new_tracker(reference: bool = False) -> DependencyTracker | NativeDependencyTracker:
    """The C tracker when it is built, unless ``reference`` or ``TRNSIM_NATIVE=0`` asks for the
    Python one (the two give the same edges)."""
    if reference or _deptrack is None or os.environ.get("TRNSIM_NATIVE", "").strip() == "0":
        return DependencyTracker()
    return NativeDependencyTracker()
