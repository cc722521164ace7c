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
import itertools
from typing import Any, Iterator, Sequence

from ..config import ChipConfig, load_config, sections_generation
from ..isa import (AP, AP_MAX_SIZE, AP_MAX_STRIDE, Allocation, DmaCopy, DmaGather, DmaScatter, HbmAP, HbmTensor,
                   Instruction, KernelError, MatMul, TileAP, Transpose, row_major)
from ..cores.base import ENGINE_TYPES, canonical_engine, engines_running
from ..memory.dma import plan_dma, plan_indirect
from ..memory.hbm import check_capacity
from ..memory.psum import PsumAllocator
from ..memory.sbuf import OnChipAllocator
from ..native.dtypes import Dtype
from .deps import DependencyTracker, NativeDependencyTracker, in_reference_build, new_tracker, reference_build
from .engine_ops import EngineOps
from .geometry import dma_geometry, geometry
from .pool import TilePool
from .replay import Replay, ViewCache, free_elems, slot_names, stream_fingerprint, tile_view
from .rules import (FP32_MIN, check_alignment, checked_dtype, checked_int, checked_number, checked_shape,
                    core_generation, engine_name, gc_paused, max_instructions)
from .tensor_ops import TensorEngineOps

# the builder's face: kernels, the NKI front end and tools import these from here; each is
# defined in its own module of trnsim.builder (rules, deps, replay, pool); the instruction methods
# are Kernel's mixins TensorEngineOps (tensor_ops) and EngineOps (engine_ops)
__all__ = ["Kernel", "TilePool", "ViewCache", "DependencyTracker", "NativeDependencyTracker", "reference_build",
           "stream_fingerprint", "Replay", "gc_paused", "checked_shape", "checked_dtype", "checked_int", "checked_number",
           "max_instructions", "core_generation", "tile_view", "FP32_MIN"]


# ---------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------


#: id(core config) -> (that core config, what its tables were made with, the tables: the DMA
#: plans by (dst geometry, src geometry), and the checks that passed: matmul geometries,
#: transpose geometries, (engine, geometry) of compute operands, engine op arguments): what
#: :meth:`Kernel.__init__` shares between the kernels of one core config (:func:`_shared_tables`)
_SHARED: dict[int, tuple[Any, Any, tuple[Any, ...]]] = {}


def _shared_tables(config: ChipConfig) -> tuple[Any, ...]:
    """The plan and check tables of ``config``'s core: functions of the operand geometries,
    the core config, the engine table (its sections' generation and its engine classes) and
    ``plan_dma`` (one replaced at run time starts new tables). An eager program's first step
    builds hundreds of small kernels moving and checking the same shapes."""
    core, made_with = config.core, (sections_generation(), tuple(ENGINE_TYPES.values()), plan_dma)
    got = _SHARED.get(id(core))
    if got is None or got[0] is not core or got[1] != made_with or len(got[2][0]) > 8192 \
            or sum(len(c) for c in got[2][1:]) > 50_000:  # (~2 KB a plan)
        if len(_SHARED) >= 4:
            _SHARED.clear()
        got = _SHARED[id(core)] = (core, made_with, ({}, {}, set(), set(), {}))  # (holding the config keeps its id its own)
    return got[2]


class Kernel(TensorEngineOps, EngineOps):
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
        self.reference = in_reference_build()
        self._deps = new_tracker(self.reference)
        self._scopes: list[list[TileAP]] = []
        self._loaded_stationary: tuple[Any, ...] | None = None
        self._hbm_bytes = 0
        self._uid = 0
        self._max_instructions = max_instructions()
        # DMA plans and checks that passed, by operand geometry: shared by the kernels of a
        # process built for one core config (:func:`_shared_tables`; a reference build plans and
        # checks on its own)
        tables = _shared_tables(self.config) if not self.reference else ({}, {}, set(), set(), {})
        self._dma_plans: dict[tuple[Any, ...], Any] = tables[0]  # plan_dma's inputs -> its (frozen) plan
        self._matmul_ok: dict[tuple[Any, ...], bool] = tables[1]  # matmul operand geometries checked -> double_row
        self._transpose_ok: set[tuple[int, ...]] = tables[2]  # nc_transpose operand geometries checked
        self._lanes: dict[tuple[str, int], tuple[str, str]] = {}  # dma_copy (engine, queue) -> (engine, lane) checked
        self._compute_ok: set[tuple[str, int]] = tables[3]  # (engine, view geometry) that passed _check_compute
        #: runs of instructions emitted by :meth:`replay` (a matmul's repeated row blocks)
        self.replays = 0
        # an engine op's arguments as far as its checks read them (op and engine names, operand
        # geometries or number types) -> what the checks made of them (engine, op names), for
        # calls that passed: a repeat skips the checks (a failing call is checked each time)
        self._op_ok: dict[tuple[Any, ...], Any] = tables[4]

    def __getstate__(self) -> dict[str, Any]:
        # the check and plan caches are keyed by geometry numbers, which belong to one process
        # (geometry._GEOMETRIES): a kernel pickles without them and fills them again
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
        nbytes = free_elems(shape) * dt.itemsize
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
                key = (engine, ap._geo or geometry(ap))
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
        eng = ENGINE_TYPES[engine]  # the engine table's facts about what its instructions may touch
        if ap.space == "psum" and not eng.reaches_psum:
            raise KernelError(f"{what}: {engine} cannot access PSUM (tile '{ap.name}'); use the vector or scalar engine")
        check_alignment(ap, what)
        for stride, size in ap.dims:
            if size > AP_MAX_SIZE or not -AP_MAX_STRIDE - 1 <= stride <= AP_MAX_STRIDE:
                raise KernelError(f"{what}: tile '{ap.name}' access pattern {list(ap.dims)} needs sizes <= "
                                  f"{AP_MAX_SIZE} and strides within {-AP_MAX_STRIDE - 1}..{AP_MAX_STRIDE} elements")
        limit = eng.max_free(self.config, ap.space)
        if limit is not None and ap.free_size > limit:
            raise KernelError(f"{what}: tile '{ap.name}' has {ap.free_size} elements per partition; "
                              f"a {eng.title or engine} instruction may touch at most {limit} in {ap.space.upper()}")

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
            eng = engine_name(engine, DmaCopy, "dma_copy")
            lane = self._dma_lane(eng, queue, "dma_copy")
            if type(engine) is str and type(queue) is int:
                self._lanes[(engine, queue)] = (eng, lane)
        else:
            eng, lane = el
        ins = DmaCopy(eng, dst, src, lane)
        # kernels move the same shapes between the same partitions over and over: plan each once
        # (the table is shared by the kernels of one core config, :func:`_shared_tables`)
        key = (dst._geo or dma_geometry(dst), src._geo or dma_geometry(src))
        plan = self._dma_plans.get(key)
        if plan is None:
            plan = self._dma_plans[key] = plan_dma(dst, src, self.config)
        ins.plan = plan
        if el is None:
            return self._emit(ins, key=lane)  # type: ignore[return-value]
        # plain views (el: checked above): _emit with the ownership and liveness checks inline;
        # anything out of the ordinary (and every error) goes through _emit
        for ap in (src, dst):
            if type(ap) is TileAP:
                a = ap.alloc
                if self._allocs.get(a.uid) is not a or not a.live:
                    return self._emit(ins, key=lane)  # type: ignore[return-value]
            elif self.tensors.get(ap.tensor.name) is not ap.tensor:
                return self._emit(ins, key=lane)  # type: ignore[return-value]
        instrs = self.instructions
        idx = len(instrs)
        if idx >= self._max_instructions:
            return self._emit(ins, key=lane)  # type: ignore[return-value]
        ins.index = idx
        ins.deps = self._deps.record(ins, lane)
        loaded = self._loaded_stationary
        if loaded is not None and td is TileAP and dst.alloc.uid == loaded[0]:  # a write to the loaded stationary's tile unloads it
            self._loaded_stationary = None
        instrs.append(ins)
        return ins

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
        eng = canonical_engine(engine)
        if eng not in engines_running(DmaGather):
            raise KernelError(f"{what}: engine {engine!r} cannot generate indirect descriptors; only "
                              f"{', '.join(e.lower() for e in engines_running(DmaGather))} (software DGE) can "
                              f"(datasheet §6)")
        if oob_mode not in ("error", "skip"):
            raise KernelError(f"{what}: oob_mode must be 'error' or 'skip', got {oob_mode!r}")
        return rows, self._dma_lane(eng, queue, what), eng, oob_mode

    # ---- introspection ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.instructions)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, {len(self.instructions)} instructions, config={self.config.name})"
