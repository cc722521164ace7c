"""The scheduling pass: reorder a kernel's instruction stream as the Neuron compiler does, and
lay its tiles out again.

trnsim's engines run their queues in order (datasheet §3): a kernel written as a plain loop,
one iteration after another, leaves every engine waiting on the others unless its author
software-pipelines it by hand. The Neuron compiler does not leave it so: it may interleave
independent iterations of an ``affine_range`` loop and hoist work that depends on nothing, and
it allocates SBUF/PSUM itself, so a tile declared inside a loop body gets as many buffers as the
schedule needs. This pass does the same to any :class:`~trnsim.kernel.Kernel`:

1. **Renaming.** A write that covers a whole tile (and does not read it) starts a new *version*
   of that tile: later readers read the version, and earlier readers of the old one no longer
   block the writer. Each version is laid out again below, so reuse of one buffer by successive
   iterations (a ``tile_pool(bufs=1)`` or a tile allocated inside a loop) stops serialising
   them. Partial writes, accumulating matmuls and in-place instructions keep the version.
2. **The dependency graph** over versions and HBM tensors: every RAW, WAR and WAW edge between
   instructions, including those between instructions of the same engine (which the builder
   leaves out because an in-order engine implies them).
3. **List scheduling.** Instructions are placed one at a time, each time the ready one (all its
   predecessors placed) that can start earliest on its engine; ties go to a priority, either
   the longer critical path to the end of the kernel or the earlier program position (both are
   tried). Start times come from the engines' own cost models (:mod:`trnsim.cores`) and the DMA
   system, the same code the simulator runs, so the pass's estimate of the total is the
   simulated one as long as the simulator's tie-breaks agree.
4. **Memory.** Each version takes SBUF/PSUM from its first placed access; once its last access
   is placed, its bytes are free from when every instruction that touched it is done. A new
   version goes at the lowest address free when its writer wants to start (time-aware first
   fit), or its writer waits for the address that frees first, so reusing an address does not
   stall the writer on the old tile's readers. Instructions placed ahead of program order may
   keep only ``speculative_share`` of the capacity live; the first unplaced instruction in
   program order (always ready) may use all of it, so the program order can always go on.
   A schedule that still gets stuck is retried with half the share.
5. **Choice.** The candidates are emitted into new kernels in their order, through the builder
   (which places each version at the chosen address and derives the semaphores of the new
   order), and simulated; the fastest wins unless the kernel as built is faster still, in which
   case the kernel is kept as it is: the compiler does not undo a hand-pipelined kernel.

The pass never changes what an instruction computes, only when it issues and where its tiles
live: every instruction reads the values it read in program order, so outputs are bit-identical.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .. import cores as _cores  # noqa: F401  (registers the engine modules)
from ..cores.base import ENGINE_TYPES
from ..config import ChipConfig, format_quantity
from ..isa import Allocation, DmaCopy, Instruction, KernelError, MatMul, TileAP, Transpose, is_dense
from ..builder.kernel import DependencyTracker, Kernel
from ..memory.dma import BandwidthPipe, DmaSystem
from ..memory.hbm import stack_bandwidth
from ..memory.sbuf import OnChipAllocator
from . import simulate

__all__ = ["ScheduleStats", "schedule", "unbounded_kernel", "SPECULATIVE_SHARE"]

#: share of SBUF/PSUM that instructions placed ahead of program order may keep live; an estimate:
#: the rest is left to the program order, so that it can always go on
SPECULATIVE_SHARE = 0.75


@dataclass(frozen=True)
class ScheduleStats:
    """What the pass did to one kernel.

    ``moved``: instructions whose position changed; ``versions``: tile versions the renaming
    made (one per whole-tile write that starts new contents); ``speculative_bytes``: the SBUF
    budget per partition that work ahead of program order could fill; ``estimated_ticks``: the
    pass's own estimate of the winner's total; ``policy``: which candidate won ("critical path",
    "program order first", "program order" or "as built", see :func:`schedule`); ``ticks`` and
    ``as_built_ticks``: the simulated totals of the winner and of the kernel as built (of the
    program order for an :func:`unbounded_kernel`, which cannot run as built);
    ``fallback``: why no list schedule could be made, or None.
    """

    instructions: int
    moved: int
    versions: int
    speculative_bytes: int
    estimated_ticks: int
    policy: str
    ticks: int
    as_built_ticks: int
    fallback: str | None = None


class _Version:
    __slots__ = ("alloc", "size", "accesses", "built_addr")

    def __init__(self, alloc: Allocation, size: int, built_addr: int):
        self.alloc = alloc  # a virtual allocation (address 0, own uid) standing for these contents
        self.size = size    # bytes per partition it occupies once laid out
        self.accesses = 0   # instructions that touch it
        self.built_addr = built_addr  # where the kernel as built keeps it


_SLOTS: dict[type, tuple[str, ...]] = {}


def _tile_fields(ins: Instruction) -> list[str]:
    """The names of ``ins``'s attributes that hold tile operands."""
    slots = _SLOTS.get(type(ins))
    if slots is None:
        slots = _SLOTS[type(ins)] = tuple(name for cls in type(ins).__mro__ for name in cls.__dict__.get("__slots__", ())
                                          if name not in ("reads", "writes", "deps", "first_deps", "index", "engine"))
    return [name for name in slots if isinstance(getattr(ins, name, None), TileAP)]


def _remap(ins: Instruction, amap: Mapping[int, TileAP], default: "callable") -> Instruction:  # type: ignore[valid-type]
    """A copy of ``ins`` whose tile operands are replaced: ``amap`` by operand identity, else
    ``default(ap)``."""
    out = copy.copy(ins)

    def m(ap: object) -> object:
        if not isinstance(ap, TileAP):
            return ap
        return amap.get(id(ap)) or default(ap)

    out.reads = tuple(m(ap) for ap in ins.reads)  # type: ignore[misc]
    out.writes = tuple(m(ap) for ap in ins.writes)  # type: ignore[misc]
    for name in _tile_fields(ins):
        setattr(out, name, m(getattr(ins, name)))
    out.index = -1
    out.deps = ()
    out.first_deps = None
    if isinstance(out, (MatMul, Transpose)):
        out.load_stationary = True
    return out


def _with_alloc(ap: TileAP, alloc: Allocation) -> TileAP:
    return TileAP(alloc, ap.p_start, ap.p_count, ap.offset, ap.dims, ap.dtype)


def _covers_tile(ap: TileAP) -> bool:
    a = ap.alloc
    return (ap.p_start == a.p_start and ap.p_count == a.p_count and ap.offset == 0 and is_dense(ap.dims)
            and ap.free_size * ap.dtype.itemsize == a.nbytes)


class _Program:
    """The kernel over tile versions: renamed instructions, their versions, and the full graph."""

    def __init__(self, kernel: Kernel, extra_deps: Mapping[int, Iterable[int]] | None):
        cfg = kernel.config
        self.kernel = kernel
        #: where each instruction came from, for messages (a front end's source lines), if known
        self.where: Sequence[str] | None = getattr(kernel, "source_lines", None)
        granule = {"sbuf": cfg.core.sbuf.allocation_granule, "psum": cfg.core.psum.bank_bytes}
        uids = itertools.count(1)
        current: dict[int, _Version] = {}
        self.versions: list[_Version] = []
        self.instrs: list[Instruction] = []
        self.touch: list[tuple[_Version, ...]] = []

        def version_of(a: Allocation) -> _Version:
            v = _Version(Allocation(a.space, a.name, a.p_start, a.p_count, 0, a.nbytes, next(uids)),
                         -(-max(a.nbytes, 1) // granule[a.space]) * granule[a.space], a.addr)
            self.versions.append(v)
            return v

        for ins in kernel.instructions:
            amap: dict[int, TileAP] = {}
            touched: dict[int, _Version] = {}
            read_allocs = {ap.alloc.uid for ap in ins.reads if isinstance(ap, TileAP)}
            for ap in ins.reads:
                if isinstance(ap, TileAP):
                    v = current.get(ap.alloc.uid) or current.setdefault(ap.alloc.uid, version_of(ap.alloc))
                    amap[id(ap)] = _with_alloc(ap, v.alloc)
                    touched[id(v)] = v
            for ap in ins.writes:
                if isinstance(ap, TileAP) and id(ap) not in amap:
                    uid = ap.alloc.uid
                    if uid not in current or (uid not in read_allocs and _covers_tile(ap)):
                        current[uid] = version_of(ap.alloc)
                    v = current[uid]
                    amap[id(ap)] = _with_alloc(ap, v.alloc)
                    touched[id(v)] = v
            self.instrs.append(_remap(ins, amap, lambda ap: _with_alloc(ap, current[ap.alloc.uid].alloc)))
            for v in touched.values():
                v.accesses += 1
            self.touch.append(tuple(touched.values()))

        tracker = DependencyTracker()
        for v in self.versions:
            tracker.allocated(v.alloc)
        n = len(self.instrs)
        self.deps: list[tuple[int, ...]] = []
        self.first_deps: list[tuple[int, ...] | None] = []
        for i, ins in enumerate(self.instrs):
            ins.index = i
            first = None
            if isinstance(ins, (MatMul, Transpose)):
                first = tracker.raw_deps(ins.stationary if isinstance(ins, MatMul) else ins.data)
            deps = set(tracker.record(ins, f"#{i}"))  # a key per instruction: same-engine edges too
            for d in (extra_deps or {}).get(i, ()):
                if not 0 <= d < i:
                    raise KernelError(f"schedule: instruction #{i} cannot depend on #{d} (only on earlier ones)")
                deps.add(d)
            self.deps.append(tuple(sorted(deps)))
            self.first_deps.append(first)
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                self.succs[d].append(i)


class _Placer:
    """The engines and the DMA system of one core, as the simulator models them, placing
    instructions one at a time in non-decreasing start order.

    A DMA transfer books the DMA engines when it reaches them, ``start_latency`` after its
    trigger, and transfers from different queues book them in that order, as the simulator's
    queue processes do. So a placed trigger's transfer waits in ``pending`` until no trigger
    placed later can reach the engines before it (:meth:`flush`); until then its dependents see
    a lower bound of its completion."""

    def __init__(self, prog: _Program):
        cfg = prog.kernel.config
        self.prog = prog
        self.engines = {name: cls(cfg) for name, cls in ENGINE_TYPES.items()}
        self.dma = DmaSystem(cfg, BandwidthPipe(stack_bandwidth(cfg), cfg.tick_hz))
        n = len(prog.instrs)
        self.ready = [0] * n
        self.end = [0] * n
        self.final = [True] * n  # False while a transfer waits in pending (ready is a lower bound)
        self.owner = [ins.queue if isinstance(ins, DmaCopy) else ins.engine for ins in prog.instrs]
        self.queue_t0: dict[str, int] = {}    # lane -> when its last transfer reaches the engines
        self.queue_fin: dict[str, int] = {}   # lane -> when its last booked transfer completes
        self.pending: list[tuple[int, int, int, int]] = []  # (reaches the engines, engine rank, sequence, index)
        self.rank = {name: r for r, name in enumerate(ENGINE_TYPES)}
        self._seq = 0
        self.releases: dict[int, list[list[int | None]]] = {}  # pending transfer -> blocks it releases
        self._dep_cache: dict[int, int] = {}  # when all predecessors are done, once they are final
        #: the soonest a trigger placed at tick t reaches the DMA engines: t + this
        self.lead = self.dma.start_latency + cfg.core.dma.trigger_cycles * min(e.tpc for e in self.engines.values())

    def _dep_time(self, i: int, deps: Sequence[int] | None) -> int:
        eng = self.engines[self.prog.instrs[i].engine]
        own = eng.name if eng.pipelines_own_results else None
        t = 0
        for d in deps or ():
            r = self.end[d] if self.owner[d] == own else self.ready[d]
            if r > t:
                t = r
        return t

    def earliest(self, i: int) -> int:
        """A lower bound of when ``i`` can start (exact once its DMA predecessors are flushed)."""
        t = self._dep_cache.get(i)
        if t is None:
            t = self._dep_time(i, self.prog.deps[i])
            if self.exact(i):
                self._dep_cache[i] = t
        return max(t, self.engines[self.prog.instrs[i].engine].free)

    def exact(self, i: int) -> bool:
        return all(self.final[d] for d in self.prog.deps[i])

    def place(self, i: int, not_before: int = 0) -> None:
        """Place ``i`` once its predecessors are done, and not before ``not_before`` (the tick
        its new tiles' memory is free: the builder turns that reuse into semaphore waits)."""
        prog = self.prog
        ins = prog.instrs[i]
        eng = self.engines[ins.engine]
        t = max(self._dep_time(i, prog.deps[i]), not_before)
        first = prog.first_deps[i]
        t_first = self._dep_time(i, first) if first is not None else t
        _, e, rdy, _ = eng.plan(ins, t, t_first)
        if isinstance(ins, DmaCopy):
            t0 = max(e + self.dma.start_latency, self.queue_t0.get(ins.queue, 0))
            self.queue_t0[ins.queue] = t0
            move = max((self.dma.engine_ticks(b, c, ins.plan) for _, b, c in ins.plan.engines), default=0)
            e = rdy = t0 + move + self.dma.transfer_latency
            self.final[i] = False
            # ties go as in the simulator, whose engine processes run in registration order
            heapq.heappush(self.pending, (t0, self.rank[ins.engine], self._seq, i))
            self._seq += 1
        self.end[i] = e
        self.ready[i] = rdy

    def flush(self, limit: int | None = None) -> None:
        """Book the pending transfers that reach the engines by ``limit`` (all when None)."""
        while self.pending and (limit is None or self.pending[0][0] <= limit):
            t0, _, _, i = heapq.heappop(self.pending)
            ins = self.prog.instrs[i]
            _, fin = self.dma.reserve(ins.plan, t0)  # type: ignore[attr-defined]
            fin = max(fin, self.queue_fin.get(ins.queue, 0))  # type: ignore[attr-defined]
            self.queue_fin[ins.queue] = fin  # type: ignore[attr-defined]
            self.end[i] = self.ready[i] = fin
            self.final[i] = True
            for block in self.releases.pop(i, ()):
                block[4] = max(block[4], fin)  # type: ignore[call-overload]


def _durations(prog: _Program) -> list[int]:
    """Each instruction's issue interval plus result latency, in ticks, on an idle engine: the
    weights of the critical path. DMA: trigger, start latency and the transfer alone."""
    cfg = prog.kernel.config
    engines = {name: cls(cfg) for name, cls in ENGINE_TYPES.items()}
    dma = DmaSystem(cfg, BandwidthPipe(stack_bandwidth(cfg), cfg.tick_hz))
    out = []
    for ins in prog.instrs:
        eng = engines[ins.engine]
        if isinstance(ins, DmaCopy):
            move = max((dma.engine_ticks(b, c, ins.plan) for _, b, c in ins.plan.engines), default=0)
            out.append(cfg.core.dma.trigger_cycles * eng.tpc + dma.start_latency + move + dma.transfer_latency)
        elif isinstance(ins, (MatMul, Transpose)):
            ls, mm = eng.shape_cycles(ins)  # type: ignore[attr-defined]
            out.append((mm + eng.drain_cycles) * eng.tpc)  # type: ignore[attr-defined]
        else:
            out.append((eng.cycles(ins) + eng.latency_cycles(ins)) * eng.tpc)
    return out


class _Memory:
    """Where versions live in one on-chip memory over (estimated) time: time-aware first fit.

    A block is taken from its version's first placed access; once its last access is placed it
    is *released* at that access's completion tick, and a later version may take its bytes from
    then on. Placing a version at the lowest address that is free when its first access wants to
    start keeps the reuse of an address from stalling the new tile's writer on the old tile's
    readers (the WAR semaphore the builder will derive)."""

    def __init__(self, partitions: int, partition_bytes: int):
        self.partitions = partitions
        self.cap = partition_bytes
        # partition range -> its blocks sorted by address: [addr, end, p0, p1, release tick or
        # None while the version is live] (kernels use few ranges: whole tiles, quadrants)
        self.groups: dict[tuple[int, int], list[list[int | None]]] = {}
        self.held = np.zeros(partitions, dtype=np.int64)  # bytes of live versions per partition

    def _blocks(self, p0: int, p1: int) -> list[list[int | None]]:
        lists = [g for (q0, q1), g in self.groups.items() if q0 < p1 and p0 < q1 and g]
        if len(lists) == 1:
            return lists[0]
        return list(heapq.merge(*lists, key=lambda b: b[0]))  # type: ignore[arg-type, return-value]

    def find(self, p0: int, p1: int, size: int, t: int) -> tuple[int, int] | None:
        """(address, tick from which it is free) for ``size`` bytes on partitions [p0, p1): the
        lowest address free by ``t``, else the one that frees first; None if live versions
        leave no room at any time."""
        blocks = self._blocks(p0, p1)
        # first fit among the blocks still busy at t (the common case, one sweep by address)
        a = 0
        for lo, hi, _, _, rel in blocks:
            if rel is not None and rel <= t:  # type: ignore[operator]
                continue
            if a + size <= lo:  # type: ignore[operator]
                break
            if hi > a:  # type: ignore[operator]
                a = hi  # type: ignore[assignment]
        if a + size <= self.cap:
            return a, 0
        # nothing is free by t: the address whose blocks are released first
        los = [b[0] for b in blocks]
        widest = max((b[1] - b[0] for b in blocks), default=0)  # type: ignore[operator]
        best: tuple[int, int] | None = None
        for a in sorted({0, *(b[1] for b in blocks)}):  # type: ignore[arg-type]
            if a + size > self.cap:  # type: ignore[operator]
                break
            when = 0
            for lo, hi, _, _, rel in blocks[bisect.bisect_left(los, a - widest + 1):]:
                if lo >= a + size:  # type: ignore[operator]
                    break
                if hi > a:  # type: ignore[operator]
                    if rel is None:
                        when = -1
                        break
                    when = max(when, rel)  # type: ignore[call-overload]
            if when >= 0 and (best is None or when < best[1]):
                best = (a, when)
        return best

    def take(self, addr: int, p0: int, p1: int, size: int) -> list[int | None]:
        b: list[int | None] = [addr, addr + size, p0, p1, None]
        bisect.insort(self.groups.setdefault((p0, p1), []), b, key=lambda x: x[0])  # type: ignore[arg-type, return-value]
        self.held[p0:p1] += size
        return b

    def untake(self, b: list[int | None]) -> None:
        self.groups[(b[2], b[3])].remove(b)  # type: ignore[index]
        self.held[b[2]:b[3]] -= b[1] - b[0]  # type: ignore[misc, operator]

    def release(self, block: list[int | None], tick: int, size: int) -> None:
        block[4] = tick
        self.held[block[2]:block[3]] -= size  # type: ignore[misc]

    def prune(self, t: int, pending: Sequence[list[int | None]]) -> None:
        """Forget blocks released by ``t``: later placements start at ``t`` or after. Blocks of
        transfers not booked yet (``pending``) stay: their release tick is a lower bound."""
        keep = {id(b) for b in pending}
        for key, g in self.groups.items():
            self.groups[key] = [b for b in g if b[4] is None or b[4] > t or id(b) in keep]  # type: ignore[operator]


class _NoRoom(Exception):
    """A forced placement found no room at all: try again with less lookahead."""


def _no_room(prog: "_Program", i: int, v: "_Version", m: _Memory) -> str:
    a = v.alloc
    held = int(m.held[a.p_start:a.p_start + a.p_count].max())
    where = prog.where[i] if prog.where else ""
    return (f"{a.space.upper()} is full: tile '{a.name}' needs {format_quantity(v.size, 'bytes')} per partition on "
            f"partitions {a.p_start}..{a.p_start + a.p_count - 1} for instruction #{i} "
            f"({prog.instrs[i].describe()}{', ' + where if where else ''}), but tiles still to be used hold "
            f"{format_quantity(held, 'bytes')} of {format_quantity(m.cap, 'bytes')}")


def _critical_paths(prog: _Program) -> list[int]:
    """Ticks from each instruction's start to the end of the kernel along its longest chain of
    dependents, on idle engines."""
    dur = _durations(prog)
    prio = [0] * len(dur)
    for i in range(len(dur) - 1, -1, -1):
        prio[i] = dur[i] + max((prio[s] for s in prog.succs[i]), default=0)
    return prio


def _list_schedule(prog: _Program, speculative: Mapping[str, int], prio: Sequence[int],
                   fixed: bool = False) -> tuple[list[int], dict[int, int], int]:
    """The scheduled order (original indices), the address of every version (by its uid) and the
    estimated total ticks. ``speculative[space]`` is how many bytes per partition instructions
    ahead of program order may keep live; ``prio`` ranks ready instructions that can start at
    the same tick (higher first; program order breaks its ties). With ``fixed`` the order is the
    program order and only the layout is made (the estimate is then rough: transfers are booked
    in program order, not in the order they reach the DMA engines)."""
    n = len(prog.instrs)
    cfg = prog.kernel.config
    placer = _Placer(prog)
    mem = {"sbuf": _Memory(cfg.core.sbuf.partitions, cfg.core.sbuf.partition_bytes),
           "psum": _Memory(cfg.core.psum.partitions, cfg.core.psum.partition_bytes)}
    blocks: dict[int, list[int | None]] = {}  # version uid -> its block
    left: dict[int, int] = {}                 # version uid -> accesses still to place
    seen: dict[int, list[int]] = {}           # version uid -> instructions placed that touch it
    addrs: dict[int, int] = {}
    placed = [False] * n
    frontier = 0  # the first instruction in program order not placed yet: always ready
    indeg = [len(d) for d in prog.deps]
    heap: list[tuple[int, int, int]] = []
    for i in range(n):
        if indeg[i] == 0:
            heapq.heappush(heap, (placer.earliest(i), -prio[i], i))
    blocked: list[tuple[int, int]] = []  # (-prio, index): waiting for memory to be released
    waiting: set[int] = set()             # the indices in blocked
    order: list[int] = []

    def new_versions(i: int) -> list[_Version]:
        return [v for v in prog.touch[i] if v.alloc.uid not in blocks]

    def over_budget(i: int, new: list[_Version], extra: Mapping[str, int] | None = None) -> bool:
        """Would the new versions of ``i`` take live bytes past its budget? The first unplaced
        instruction in program order may use the whole capacity, every other one only the
        speculative share: so work ahead of program order can never take the room the program
        order needs to go on (a version's bytes stay held until its last access is placed)."""
        need: dict[str, int] = dict(extra or {})
        worst: dict[str, int] = {}
        for v in new:
            a = v.alloc
            need[a.space] = need.get(a.space, 0) + v.size
            held = int(mem[a.space].held[a.p_start:a.p_start + a.p_count].max())
            worst[a.space] = max(worst.get(a.space, 0), held)
        limit = {sp: m.cap for sp, m in mem.items()} if i == frontier else speculative
        return any(worst[sp] + need[sp] > limit[sp] for sp in worst)

    def room(i: int, t: int, force: bool) -> tuple[int, list[tuple[_Version, int]]] | None:
        """(tick from which the new versions of ``i`` have room, their addresses), or None while
        they must wait for a release (or, for loads, for the speculative budget)."""
        new = new_versions(i)
        if not new:
            return 0, []
        if not force and over_budget(i, new):
            return None
        when, out, taken = 0, [], []
        try:
            for v in new:
                a = v.alloc
                m = mem[a.space]
                got = m.find(a.p_start, a.p_start + a.p_count, v.size, t)
                if got is None:
                    if force:
                        raise _NoRoom(_no_room(prog, i, v, m))
                    return None
                taken.append((m, m.take(got[0], a.p_start, a.p_start + a.p_count, v.size)))  # tentatively
                out.append((v, got[0]))
                when = max(when, got[1])
        finally:
            for m, b in taken:  # undo: commit() takes them for real
                m.untake(b)
        return when, out

    def commit(i: int, where: list[tuple[_Version, int]], not_before: int) -> bool:
        """Place ``i`` (not before ``not_before``, when its new tiles' memory frees up); True when
        a version was released by it."""
        for v, addr in where:
            a = v.alloc
            blocks[a.uid] = mem[a.space].take(addr, a.p_start, a.p_start + a.p_count, v.size)
            left[a.uid] = v.accesses
            addrs[a.uid] = addr
        nonlocal frontier
        placer.place(i, not_before)
        order.append(i)
        placed[i] = True
        while frontier < n and placed[frontier]:
            frontier += 1
        released = False
        for v in prog.touch[i]:
            uid = v.alloc.uid
            left[uid] -= 1
            users = seen.setdefault(uid, [])
            users.append(i)
            if left[uid] == 0:
                # free once every instruction that touched it is done; transfers not booked yet
                # raise the release tick when they are
                block = blocks[uid]
                mem[v.alloc.space].release(block, max(placer.ready[u] for u in users), v.size)
                for u in users:
                    if not placer.final[u]:
                        placer.releases.setdefault(u, []).append(block)
                del seen[uid]
                released = True
        for s in prog.succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (placer.earliest(s), -prio[s], s))
        return released

    def unblock() -> None:
        """Back to the ready heap go the waiting instructions whose new tiles the live bytes now
        leave room for, best first, as far as that room goes; the first in program order always."""
        nonlocal blocked
        if frontier in waiting:
            waiting.discard(frontier)
            blocked = [b for b in blocked if b[1] != frontier]
            heapq.heapify(blocked)
            heapq.heappush(heap, (placer.earliest(frontier), -prio[frontier], frontier))
        extra: dict[str, int] = {}
        while blocked:
            negp, b = blocked[0]
            new = new_versions(b)
            if over_budget(b, new, extra):
                return
            heapq.heappop(blocked)
            waiting.discard(b)
            for v in new:
                extra[v.alloc.space] = extra.get(v.alloc.space, 0) + v.size
            heapq.heappush(heap, (placer.earliest(b), negp, b))

    if fixed:
        for i in range(n):
            placer.flush()
            got = room(i, placer.earliest(i), force=True)
            assert got is not None
            commit(i, got[1], got[0])
        placer.flush()
        return order, addrs, max(placer.ready, default=0)
    while heap or blocked:
        if not heap:
            # every ready instruction waits for memory: the one first in program order goes anyway
            i = min(waiting)
            waiting.discard(i)
            blocked = [b for b in blocked if b[1] != i]
            heapq.heapify(blocked)
            placer.flush()
            got = room(i, placer.earliest(i), force=True)
            assert got is not None
            released = commit(i, got[1], got[0])
        else:
            est, negp, i = heapq.heappop(heap)
            # what is placed from now on starts at est or later (bar instructions waiting for
            # memory), so no trigger placed later reaches the DMA engines before est + lead:
            # transfers that reach them by then can be booked in the simulator's order
            placer.flush(est + placer.lead)
            t = placer.earliest(i)
            if t > est or not placer.exact(i):  # not exact: a predecessor's transfer ends after est
                heapq.heappush(heap, (max(t, est + 1), negp, i))
                continue
            got = room(i, t, force=False)
            if got is None:
                heapq.heappush(blocked, (negp, i))
                waiting.add(i)
                continue
            if got[0] > est:
                heapq.heappush(heap, (got[0], negp, i))
                continue
            released = commit(i, got[1], got[0])
            if len(order) % 16 == 0:
                pend = [b for bs in placer.releases.values() for b in bs]
                for m in mem.values():
                    m.prune(est, pend)
        if released or frontier in waiting:
            unblock()
    placer.flush()
    return order, addrs, max(placer.ready, default=0)


def _emit(prog: _Program, order: Sequence[int], addrs: Mapping[int, int] | None) -> Kernel:
    """The scheduled kernel: ``prog``'s instructions in ``order``, each version at ``addrs[uid]``
    (first fit when None)."""
    old = prog.kernel
    new = Kernel(old.name, old.config)
    new.tensors = dict(old.tensors)
    new.queues = dict(old.queues)
    new._hbm_bytes = old._hbm_bytes  # the HBM tensors are the same objects
    new._uid = old._uid
    phys: dict[int, Allocation] = {}
    left: dict[int, int] = {}
    by_alloc = {v.alloc.uid: v for v in prog.versions}

    def physical(ap: TileAP) -> TileAP:
        a = ap.alloc
        p = phys.get(a.uid)
        if p is None:
            allocator = new._sbuf if a.space == "sbuf" else new._psum
            addr = None if addrs is None else addrs[a.uid]
            p = phys[a.uid] = allocator.allocate(a.name, a.p_start, a.p_count, a.nbytes, addr=addr)
            new._allocs[p.uid] = p  # the new kernel's own tile, as Kernel._allocate records one
            new._deps.allocated(p)
            left[a.uid] = by_alloc[a.uid].accesses
        return _with_alloc(ap, p)

    for i in order:
        ins = _remap(prog.instrs[i], {}, physical)
        new._emit(ins, key=ins.queue if isinstance(ins, DmaCopy) else None)
        for v in prog.touch[i]:
            uid = v.alloc.uid
            left[uid] -= 1
            if left[uid] == 0:
                p = phys.pop(uid)
                (new._sbuf if p.space == "sbuf" else new._psum).free(p)
                new._deps.freed(p)
    return new


class _Bump(OnChipAllocator):
    """An allocator that never runs out and never reuses: each tile gets fresh bytes."""

    def allocate(self, name: str, p_start: int, p_count: int, nbytes: int, addr: int | None = None) -> Allocation:
        size = self._round(max(nbytes, 1))
        alloc = Allocation(self.space, name, p_start, p_count, self._top, nbytes, next(self._uids))
        self._top += size
        return alloc

    def free(self, alloc: Allocation) -> None:
        alloc.live = False


def unbounded_kernel(name: str, config: ChipConfig | str) -> Kernel:
    """A kernel builder whose SBUF and PSUM never run out: every tile gets bytes of its own,
    never freed. For front ends that leave the layout to :func:`schedule`, as the NKI compiler
    allocates memory itself (:mod:`trnsim.nki`); only a scheduled copy can run."""
    k = Kernel(name, config)
    cfg = k.config
    uids = itertools.count(1)
    k._sbuf = _Bump("sbuf", cfg.core.sbuf.partitions, 2**62, cfg.core.sbuf.allocation_granule, "unbounded", uids)
    k._sbuf._top = 0  # type: ignore[attr-defined]
    k._psum = _Bump("psum", cfg.core.psum.partitions, 2**62, cfg.core.psum.bank_bytes, "unbounded", uids)
    k._psum._top = 0  # type: ignore[attr-defined]
    k.unbounded = True  # type: ignore[attr-defined]
    return k


def schedule(kernel: Kernel, *, extra_deps: Mapping[int, Iterable[int]] | None = None,
             speculative_share: float = SPECULATIVE_SHARE, reorder: bool = True) -> Kernel:
    """``kernel``'s instructions list-scheduled over its dependency graph, tiles renamed and laid
    out again within SBUF/PSUM capacity (see the module docstring). Returns a new kernel with the
    same HBM tensors; ``kernel`` is not changed. The new kernel's ``schedule_stats`` says what
    happened and ``schedule_origin[i]`` is the original index of its instruction ``i``.

    ``extra_deps`` maps an instruction index to earlier indices it must also follow (NKI's
    ``depends_on`` and ``no_reorder``). With ``reorder=False`` the program order is kept and
    only the tiles are laid out (what an :func:`unbounded_kernel` needs to run at all).

    Raises KernelError when the kernel cannot fit SBUF/PSUM in any order tried (only an
    unbounded kernel can: one built with the builder fits as built).
    """
    if not isinstance(kernel, Kernel):
        raise KernelError(f"schedule expects a trnsim.Kernel, got {type(kernel).__name__}")
    if not 0 < speculative_share <= 1:
        raise KernelError(f"schedule: speculative_share must be in (0, 1], got {speculative_share!r}")
    cfg = kernel.config
    prog = _Program(kernel, extra_deps)
    n = len(prog.instrs)
    caps = {"sbuf": cfg.core.sbuf.partition_bytes, "psum": cfg.core.psum.partition_bytes}
    unbounded = getattr(kernel, "unbounded", False)
    # candidate schedules, each with the pass's estimate of its time: the list schedule ranked by
    # critical path and the list schedule ranked by program order; for a kernel with no layout
    # of its own, the program order too
    candidates: list[tuple[int, int, str, list[int], dict[int, int], int]] = []
    reasons: list[str] = []
    if unbounded or not reorder:
        try:
            order, addrs, est = _list_schedule(prog, caps, [0] * n, fixed=True)
            candidates.append((est, 2, "program order", order, addrs, caps["sbuf"]))
        except _NoRoom as e:
            reasons.append(str(e))
    for rank, (policy, prio) in enumerate((("critical path", _critical_paths(prog)),
                                           ("program order first", [-i for i in range(n)]))):
        if not reorder:
            break
        share = speculative_share
        for _ in range(4):
            spec = {sp: int(c * share) for sp, c in caps.items()}
            try:
                order, addrs, est = _list_schedule(prog, spec, prio)
            except _NoRoom as e:
                reasons.append(str(e))
                share /= 2
                continue
            candidates.append((est, rank, policy, order, addrs, spec["sbuf"]))
            break
    if unbounded or not reorder:
        # no layout to fall back on: the candidate that simulates fastest; the program order's
        # time stands for "as built"
        best, program_ticks = None, 0
        for est, _, policy, order, addrs, spec_bytes in sorted(candidates, key=lambda c: (c[0], c[1])):
            cand = _emit(prog, order, addrs)
            ticks = simulate(cfg, [cand])[0].total_ticks
            if policy == "program order":
                program_ticks = ticks
            if best is None or ticks < best[0]:
                moved = sum(1 for pos, i in enumerate(order) if pos != i)
                best = (ticks, cand, (n, moved, len(prog.versions), spec_bytes, est, policy, ticks), order)
        if best is None:
            raise KernelError(reasons[0] if reasons else "schedule: no schedule fits")
        _, new, fields, order = best
        stats = ScheduleStats(*fields, program_ticks or fields[-1])
        new.schedule_stats = stats  # type: ignore[attr-defined]
        new.schedule_origin = list(order)  # type: ignore[attr-defined]
        return new
    # the kernel as built (its own order and layout) is the last candidate: the compiler does not
    # undo a hand-pipelined kernel. The winner is decided by simulating both.
    built = _emit(prog, range(n), {v.alloc.uid: v.built_addr for v in prog.versions})
    built_ticks = simulate(cfg, [built])[0].total_ticks
    new, stats = built, ScheduleStats(n, 0, len(prog.versions), 0, built_ticks, "as built", built_ticks, built_ticks,
                                      "; ".join(reasons) or None)
    for est, _, policy, order, addrs, spec_bytes in sorted(candidates, key=lambda c: (c[0], c[1])):
        try:
            cand = _emit(prog, order, addrs)
        except KernelError as e:  # pragma: no cover - the layout was checked while scheduling
            reasons.append(str(e))
            continue
        ticks = simulate(cfg, [cand])[0].total_ticks
        if ticks < built_ticks:
            moved = sum(1 for pos, i in enumerate(order) if pos != i)
            new, stats = cand, ScheduleStats(n, moved, len(prog.versions), spec_bytes, est, policy, ticks, built_ticks)
            new.schedule_origin = list(order)  # type: ignore[attr-defined]
        break
    if new is built:
        new.schedule_origin = list(range(n))  # type: ignore[attr-defined]
    new.schedule_stats = stats  # type: ignore[attr-defined]
    return new
