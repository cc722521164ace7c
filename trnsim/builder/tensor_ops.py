"""TensorE instructions of :class:`~trnsim.builder.kernel.Kernel`: matmuls (one, a row of
them sharing a stationary, many at once), PE transposes and the replay of a matmul's repeated
row blocks, each with its checks (a mixin: ``Kernel`` is these methods and the others)."""

from __future__ import annotations

import array
from typing import Any, Sequence

from ..isa import Allocation, DmaCopy, HbmAP, Instruction, KernelError, MatMul, TileAP, Transpose
from ..memory.psum import check_matmul_dst
from . import deps
from .deps import NativeDependencyTracker
from .geometry import dma_geometry, geometry
from .replay import FIRST_OPERAND_OPS, REPLAYABLE_OPS, Replay, slot_names, stationary_key
from .rules import TENSORE_DTYPES


class TensorEngineOps:
    """The TensorE methods of :class:`Kernel` (state and emitting live in ``Kernel``)."""

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
            key = (dst._geo or geometry(dst), dst.alloc.addr, dst.offset, stationary._geo or geometry(stationary),
                   moving._geo or geometry(moving))  # interned geometries: a key of five ints
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
        gs = stationary._geo or geometry(stationary)
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
                key = (dst._geo or geometry(dst), da.addr, dst.offset, gs, mv._geo or geometry(mv))
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
            double_row = ok.get((dst._geo or geometry(dst), da.addr, dst.offset, st._geo or geometry(st),
                                 mv._geo or geometry(mv)))
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
        ``REPLAYABLE_OPS``, an HBM operand other than the HBM side of the DMAs at positions
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
            elif cls in REPLAYABLE_OPS:
                key, first = x.engine, -1
            else:
                return None
            if cls not in FIRST_OPERAND_OPS and x.first_deps is not None:
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
                if type(t) is not TileAP or not ri or t in x.writes or (type(x) in FIRST_OPERAND_OPS and 0 in ri):
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
                      stationary_key(first.stationary), first.load_stationary,
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
            g = v._geo or dma_geometry(v)  # as dma_copy keys its plan cache
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
            out = deps.native_clone.replay(tpl.ins, tpl.firsts, i0, tracker.record_many_raw(i0, n, spec), tracker._dlog,
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
            if ap.dtype.name not in TENSORE_DTYPES:
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
            key = (dst._geo or geometry(dst), dst.alloc.addr, dst.offset, data._geo or geometry(data))
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
            if (dst._geo or geometry(dst), da.addr, dst.offset, data._geo or geometry(data)) not in ok or \
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
