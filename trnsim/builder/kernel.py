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

import numpy as np
from typing import Any, Iterator, Sequence

from ..config import ChipConfig, load_config
from ..isa import (
    AP,
    AP_MAX_SIZE,
    AP_MAX_STRIDE,
    Activation,
    AffineSelect,
    Allocation,
    CopyPredicated,
    DmaTranspose,
    MatMulMx,
    RangeSelect,
    Dropout,
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
from ..native.dtypes import Dtype
from . import deps
from .deps import DependencyTracker, NativeDependencyTracker, in_reference_build, new_tracker, reference_build
from .pool import TilePool
from .replay import (FIRST_OPERAND_OPS, REPLAYABLE_OPS, Replay, ViewCache, free_elems, slot_names, stationary_key,
                     stream_fingerprint, tile_view)
from .rules import (ENGINE_NAMES, FP32_MIN, MX_DTYPES, TENSORE_DTYPES, arith_op, check_alignment, check_per_partition,
                    check_same_shape, checked_dtype, checked_int, checked_number, checked_shape, core_generation,
                    engine_name, gc_paused, max_instructions, reduce_op_checked)

# the builder's face: kernels, the NKI front end and tools import these from here; each is
# defined in its own module of trnsim.builder (rules, deps, replay, pool)
__all__ = ["Kernel", "TilePool", "ViewCache", "DependencyTracker", "NativeDependencyTracker", "reference_build",
           "stream_fingerprint", "Replay", "gc_paused", "checked_shape", "checked_dtype", "checked_int", "checked_number",
           "max_instructions", "core_generation", "tile_view", "FP32_MIN"]


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
        self.reference = in_reference_build()
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
        check_alignment(ap, what)
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
        eng = ENGINE_NAMES.get(str(engine).lower(), str(engine))
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
        check_same_shape(what, dst, data)
        for nm, x in (("bias", bias), ("scale", scale)):
            if isinstance(x, TileAP):
                check_per_partition(what, nm, x, data)
            elif x is not None and not isinstance(x, (int, float)):
                raise KernelError(f"{what}: {nm} must be a number or a [P, 1] tile, got {type(x).__name__}")
        rop = None
        if reduce_op is not None or reduce_res is not None:
            if reduce_op is None or reduce_res is None:
                raise KernelError(f"{what}: reduce_op and reduce_res go together")
            rop = reduce_op_checked(reduce_op, ("add", "max", "min"), what)
            check_per_partition(what, "reduce_res", reduce_res, data)
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
        check_same_shape(what, dst, data1)
        check_same_shape(what, dst, data2)
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
        check_same_shape(what, dst, data)
        for nm, x in (("operand0", operand0), ("operand1", operand1)):
            if isinstance(x, TileAP):
                check_per_partition(what, nm, x, data)
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
        check_same_shape(what, dst, src)
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
        check_same_shape(what, dst, data)
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
        o0, o1 = arith_op(op0, what), arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data0, data1] + ([initial] if isinstance(initial, TileAP) else []))
        check_same_shape(what, dst, data0)
        check_same_shape(what, dst, data1)
        if data0.space == data1.space == "psum":
            raise KernelError(f"{what}: data0 and data1 cannot both be in PSUM")
        init = self._scalar_or_column(what, "initial", initial, data0)
        return self._emit(TensorTensorScan(dst, data0, data1, init, o0, o1, bool(reverse0), bool(reverse1)))  # type: ignore[return-value]

    def scalar_tensor_tensor(self, dst: TileAP, data: TileAP, op0: Any, operand0: TileAP | float, op1: Any,
                             operand1: TileAP, *, reverse0: bool = False, reverse1: bool = False) -> ScalarTensorTensor:
        """``dst = (data op0 operand0) op1 operand1``: ``operand0`` an immediate or [P, 1] tile,
        ``operand1`` shaped like ``data``."""
        what = "scalar_tensor_tensor"
        o0, o1 = arith_op(op0, what), arith_op(op1, what)
        self._check_compute(what, "Vector", [dst, data, operand1] + ([operand0] if isinstance(operand0, TileAP) else []))
        check_same_shape(what, dst, data)
        check_same_shape(what, dst, operand1)
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
        check_same_shape(what, dst, predicate)
        if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
            raise KernelError(f"{what}: predicate '{predicate.name}' is {predicate.dtype.short}; expected uint8, "
                              f"uint16 or uint32")
        if isinstance(src, TileAP):
            check_same_shape(what, dst, src)
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
        check_same_shape(what, dst, data)
        if not data.dtype.is_float:
            raise KernelError(f"{what}: data '{data.name}' must be a float tile, got {data.dtype.short}")
        for nm, b in (("bound0", bound0), ("bound1", bound1)):
            check_per_partition(what, nm, b, data)
            if b.dtype.name != "float32":
                raise KernelError(f"{what}: {nm} '{b.name}' must be fp32, got {b.dtype.short}")
        if reduce_res is not None:
            check_per_partition(what, "reduce_res", reduce_res, data)
        if checked_number(on_false, f"{what}: on_false") != FP32_MIN:
            raise KernelError(f"{what}: on_false must be FP32_MIN (-3.4028235e+38), the only value the hardware "
                              f"takes, got {on_false!r}")
        start = checked_int(range_start, f"{what}: range_start", lo=0)
        ins = RangeSelect(dst, data, cmps[0], cmps[1], bound0, bound1, start, FP32_MIN, reduce_res)
        return self._emit(ins)  # type: ignore[return-value]

    def dropout(self, dst: TileAP, data: TileAP, prob: float, *, seed: int = 0, offset: int = 0,
                row_stride: int | None = None) -> Dropout:
        """``dst = data`` with each element zeroed with probability ``prob`` (VectorE,
        ``nisa.dropout``, ``max(MIN_II, N)`` cycles, datasheet §7); the kept values are not
        rescaled. Element (p, i) draws with counter ``offset + p * row_stride + i`` (default
        ``row_stride``: the tile's free size), see :class:`trnsim.isa.Dropout`."""
        what = "dropout"
        self._check_compute(what, "Vector", (dst, data))
        check_same_shape(what, dst, data)
        if not data.dtype.is_float or not dst.dtype.is_float:
            raise KernelError(f"{what}: data and dst must be float tiles, got {data.dtype.short} -> {dst.dtype.short}")
        p = checked_number(prob, f"{what}: prob")
        if not 0.0 <= p <= 1.0:
            raise KernelError(f"{what}: prob must be a probability in [0, 1], got {prob!r}")
        seed = checked_int(seed, f"{what}: seed", lo=0)
        offset = checked_int(offset, f"{what}: offset", lo=0)
        stride = data.free_size if row_stride is None else checked_int(row_stride, f"{what}: row_stride", lo=0)
        return self._emit(Dropout(dst, data, float(p), seed, offset, stride))  # type: ignore[return-value]

    def reciprocal(self, dst: TileAP, data: TileAP) -> Reciprocal:
        """``dst = 1 / data`` on VectorE (8 cycles an element; ScalarE's activation('reciprocal')
        is one)."""
        what = "reciprocal"
        self._check_compute(what, "Vector", (dst, data))
        check_same_shape(what, dst, data)
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
        check_alignment(dst, what)
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
            if ap.space != "sbuf" or ap.dtype.name not in MX_DTYPES:
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
            check_per_partition(what, name, x, like)
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
