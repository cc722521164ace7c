"""The discrete-event scheduler (simpy).

One simpy environment per simulated chip. Per core, one process per engine consumes that
engine's in-order instruction queue, and one process per DMA queue consumes its transfers.
An instruction starts when every instruction it depends on has made its result visible (the
semaphore waits the Neuron compiler inserts) and its engine is free; the engine module
(:mod:`trnsim.cores`) decides where on its own timeline it lands. DMA transfers share their
core's 16 DMA engines and their HBM stack's bandwidth, which is shared by the cores on that
stack.

Global time is an integer number of ticks, ``config.tick_hz`` per second: the least common
multiple of all engine clocks, so every engine cycle is a whole number of ticks and runs are
exactly reproducible. The scheduler never computes data.

Two implementations of the same model. :class:`CoreTimeline`'s simpy processes are the
reference, and the one collectives run beside (:func:`trnsim.collectives.simulate_beside_kernels`
shares their environment). :func:`simulate` runs the same processes in a C event loop
(``trnsim.native.accel._sched``, sched.c) when it is built: the same events in the same order, ties
broken as simpy breaks them (tick, priority, event id), so every tick, ready time and trace
segment is identical (tests/sim/test_sim_equivalence.py) at a fraction of the cost. The engine
modules still give each instruction its costs; the loop keeps the state that moves with time.
"""

from __future__ import annotations

from itertools import accumulate, chain, compress, repeat
from operator import attrgetter, is_not, itemgetter, length_hint
from typing import Any, Callable, Generator, NamedTuple, Sequence

import numpy as np
import simpy

from .. import cores as _cores  # noqa: F401  (registers the engine modules)
from ..compat import renamed
from ..config import ChipConfig
from ..cores.base import ENGINE_TYPES, Engine, Numbering, Segment
from ..cores.tensor import LS_LANE, TensorEngine
from ..isa import DmaCopy, Instruction, MatMul, Transpose
from ..builder.kernel import Kernel, gc_paused
from ..memory.dma import BandwidthPipe, DmaSystem
from ..memory.hbm import stack_bandwidth, stack_of_core

try:
    from ..native.accel import _sched  # type: ignore[attr-defined]
except ImportError:  # not built: simulate() runs the simpy processes
    _sched = None
try:  # the per-instruction reads in one C pass each (scan.c); without it, map() passes
    from ..native.accel import _scan  # type: ignore[attr-defined]
except ImportError:
    _scan = None

__all__ = ["CoreTimeline", "simulate", "native_available"]

#: the timelines simulate() can run (not engines: those are a NeuronCore's, trnsim.cores)
TIMELINES = ("auto", "native", "simpy")


class CoreTimeline:
    """The timing simulation of one kernel on one NeuronCore."""

    def __init__(self, env: simpy.Environment | None, config: ChipConfig, kernel: Kernel, hbm_pipe: BandwidthPipe,
                 core: int = 0):
        """Start ``kernel``'s processes in ``env`` (with ``env=None``, only the engines and DMA
        system: the native loop fills in the results)."""
        self.env = env
        self.config = config
        self.kernel = kernel
        self.core = core
        self.engines: dict[str, Engine] = {name: cls(config) for name, cls in ENGINE_TYPES.items()}
        self.dma = DmaSystem(config, hbm_pipe)
        self.segments: list[Segment] = []
        if env is None:
            return
        n = len(kernel.instructions)
        self.ready: list[int | None] = [None] * n   # results visible to dependents
        self.end: list[int] = [0] * n                # engine done (for pipelined own results)
        self.trigger: list[int | None] = [None] * n  # DMA trigger done
        self.owner: list[str] = [""] * n
        self._waiters: dict[int, simpy.Event] = {}
        self._trigger_waiters: dict[int, simpy.Event] = {}
        by_engine: dict[str, list[Instruction]] = {name: [] for name in self.engines}
        by_queue: dict[str, list[DmaCopy]] = {}
        for ins in kernel.instructions:
            by_engine[ins.engine].append(ins)
            if isinstance(ins, DmaCopy):
                by_queue.setdefault(ins.queue, []).append(ins)
                self.owner[ins.index] = ins.queue
            else:
                self.owner[ins.index] = ins.engine
        for name, instrs in by_engine.items():
            if instrs:
                env.process(self._engine(self.engines[name], instrs))
        for lane, dmas in by_queue.items():
            env.process(self._queue(lane, dmas))

    # ---- events ----------------------------------------------------------------------------
    def _wait(self, waiters: dict[int, simpy.Event], idx: int) -> simpy.Event:
        ev = waiters.get(idx)
        if ev is None:
            ev = waiters[idx] = self.env.event()
        return ev

    @staticmethod
    def _notify(waiters: dict[int, simpy.Event], idx: int) -> None:
        ev = waiters.pop(idx, None)
        if ev is not None:
            ev.succeed()

    def _set_ready(self, idx: int, t: int) -> None:
        self.ready[idx] = t
        self._notify(self._waiters, idx)

    # ---- processes -------------------------------------------------------------------------
    def _engine(self, eng: Engine, instrs: Sequence[Instruction]) -> Generator[simpy.Event, Any, None]:
        env = self.env
        ready, end, owner, trigger = self.ready, self.end, self.owner, self.trigger
        waiters, trigger_waiters = self._waiters, self._trigger_waiters
        add_segments = self.segments.extend
        plan = eng.plan
        own = eng.name if eng.pipelines_own_results else None
        for ins in instrs:
            t = int(env.now)
            for d in ins.deps:
                r = ready[d]
                if r is None:
                    yield self._wait(waiters, d)
                    r = ready[d]
                if owner[d] == own:
                    r = end[d]
                if r > t:  # type: ignore[operator]
                    t = r  # type: ignore[assignment]
            first = ins.first_deps
            if first is None:
                t_first = t
            else:
                t_first = int(env.now)
                for d in first:
                    r = end[d] if owner[d] == own else ready[d]
                    if r > t_first:  # type: ignore[operator]
                        t_first = r  # type: ignore[assignment]
            start, e, rdy, segs = plan(ins, t, t_first)
            now = env.now
            if start > now:
                yield env.timeout(start - now)
            add_segments(segs)
            i = ins.index
            end[i] = e
            if ins.is_dma:  # a DMA trigger: the queue process moves the data
                trigger[i] = e
                ev = trigger_waiters.pop(i, None)
                if ev is not None:
                    ev.succeed()
            else:
                ready[i] = rdy
                ev = waiters.pop(i, None)
                if ev is not None:
                    ev.succeed()

    def _queue(self, lane: str, dmas: Sequence[DmaCopy]) -> Generator[simpy.Event, Any, None]:
        env = self.env
        dma = self.dma
        last = 0
        for ins in dmas:
            i = ins.index
            t = self.trigger[i]
            if t is None:
                yield self._wait(self._trigger_waiters, i)
                t = self.trigger[i]
            t0 = t + dma.start_latency  # type: ignore[operator]
            if t0 > env.now:
                yield env.timeout(t0 - env.now)
            data_start, fin = dma.reserve(ins.plan, int(env.now))
            fin = max(fin, last)
            last = fin
            self.end[i] = fin
            self.segments.append((lane, "DmaCopy", data_start, fin, i))
            self._set_ready(i, fin)

    # ---- results ---------------------------------------------------------------------------
    @property
    def total_ticks(self) -> int:
        if None not in self.ready:
            return max(self.ready, default=0)
        return max((r for r in self.ready if r is not None), default=0)

    def check_complete(self) -> None:
        if None not in self.ready:
            return
        missing = [i for i, r in enumerate(self.ready) if r is None]
        if missing:  # pragma: no cover - would be a scheduler bug: deps always point backwards
            raise RuntimeError(f"simulation stalled: {len(missing)} instructions never ran, first #{missing[0]}")


def native_available() -> bool:
    """True when the C event loop (``trnsim.native.accel._sched``) is built."""
    return _sched is not None


#: "auto" runs the simpy processes when the kernels have this many instructions or fewer in all
#: (over every core): the native loop's set-up - the C scan, numpy columns, cffi buffers - is a
#: fixed cost, which the simpy processes' cost per instruction overtakes at about this many
#: (callgrind, instructions executed per simulate() call on trn2, one core, after e1ff13f cut the
#: set-up by a fifth: softmax of 20 instructions 1.67M native / 1.35M simpy, of 40 1.80M / 2.37M,
#: of 80 1.87M / 4.56M; a 32-instruction matmul 1.82M / 1.83M). Two cores running one kernel
#: share the native set-up, so the crossing comes no later in all. Eager programs simulate
#: thousands of such kernels (a new shape each), and both give the same ticks, segments and end
#: state (tests/sim/test_sim_equivalence.py).
SIMPY_MAX_INSTRUCTIONS = 32


def simulate(config: ChipConfig, kernels: Sequence[Kernel], *, timeline: str = "auto",
             engine: str | None = None) -> list[CoreTimeline]:
    """Run the timing model of ``kernels[c]`` on core ``c`` of one chip; return the timelines.

    ``timeline``: ``"native"`` (the C event loop), ``"simpy"`` (the reference processes) or
    ``"auto"`` (native when built, but the simpy processes for runs of at most
    :data:`SIMPY_MAX_INSTRUCTIONS` instructions, where they are faster). Both give the same
    ticks and segments. (``engine=`` is its old name, still taken.)"""
    if engine is not None:
        timeline = engine
    if timeline not in TIMELINES:
        raise ValueError(f"simulate: timeline must be one of {', '.join(TIMELINES)}, got {timeline!r}")
    if len(kernels) > config.chip.cores:
        raise ValueError(f"{len(kernels)} kernels for a chip with {config.chip.cores} cores")
    if timeline == "native" and _sched is None:
        raise RuntimeError("simulate(timeline='native'): trnsim.native.accel._sched (the C event loop) is not built: "
                           "run `pip install -e .` (needs gcc and cffi)")
    n_stacks = config.chip.hbm.stacks
    pipes = [BandwidthPipe(stack_bandwidth(config), config.tick_hz) for _ in range(n_stacks)]
    fields = _scan_fields()
    if timeline == "auto" and sum(len(k.instructions) for k in kernels) <= SIMPY_MAX_INSTRUCTIONS:
        timeline = "simpy"  # the same results, sooner (above)
    types = None if timeline == "simpy" or _sched is None else _once_per_kernel(kernels, lambda k: _type_column(k, fields))
    why = None if types is None else _native_unsupported(types)
    if timeline == "native" and why is not None:
        raise ValueError(f"simulate(timeline='native'): {why}; use timeline='simpy' or 'auto'")
    with gc_paused():
        if timeline == "simpy" or _sched is None or why is not None:
            env = simpy.Environment()
            cores = [CoreTimeline(env, config, k, pipes[stack_of_core(config, c)], c) for c, k in enumerate(kernels)]
            env.run()
        else:
            cores = _NativeRun(config, kernels, pipes, types).run()  # checks completeness on its arrays
            return cores
    for c in cores:
        c.check_complete()
    return cores


def _once_per_kernel(kernels: Sequence[Kernel], fn: Callable[[Kernel], Any]) -> list[Any]:
    """``[fn(k) for k in kernels]``, calling ``fn`` once per distinct kernel object: the cores of
    a logical core given the same share run one kernel (:meth:`trnsim.device.Device.kernels_of`),
    and what ``fn`` reads of it is the same for each."""
    seen: dict[int, Any] = {}
    out = []
    for k in kernels:
        if id(k) not in seen:
            seen[id(k)] = fn(k)
        out.append(seen[id(k)])
    return out


class _Scan(NamedTuple):
    """One C pass over a kernel's instructions (scan.c, :func:`_type_column`)."""

    key: np.ndarray                 #: each instruction's number: identity of (type, engine, _ScanFields)
    reps: list[Instruction]         #: each number's first instruction
    key_type: np.ndarray            #: each number's type number
    log: tuple[Any, ...] | None     #: the tracker's edge log (dlog, flog, columns), when of this length
    deps_same: int                  #: instructions 0..deps_same-1 carry the logged deps objects
    first_same: int                 #: ... and first_deps


#: a kernel's instruction types: (types numbered in order of first use, each instruction's
#: type number, the C scan or None)
TypeColumn = tuple[Numbering, np.ndarray, "_Scan | None"]


class _ScanFields(dict):  # type: ignore[type-arg]
    """Instruction type -> the attributes the C scan numbers its instructions by, besides type
    and engine: TensorE's operands (:attr:`TensorEngine.OPERANDS_MATMUL`), a DMA's queue and
    plan, the first step of every path a cost key reads (:attr:`Engine.cost_fields`), for every
    registered engine. A superset of what each path below reads, so the scan's numbering is at
    least as fine as each one's key. Kept while the registered engines stay the same
    (:func:`_scan_fields`; engines may be registered at any time)."""

    def __missing__(self, t: type) -> tuple[str, ...]:
        names: dict[str, None] = {}
        if issubclass(t, DmaCopy):
            names.update(dict.fromkeys(("queue", "plan")))
        for cls in ENGINE_TYPES.values():
            if issubclass(cls, TensorEngine) and issubclass(t, (MatMul, Transpose)):
                names.update(dict.fromkeys(cls.OPERANDS_TRANSPOSE if issubclass(t, Transpose) else cls.OPERANDS_MATMUL))
            for path in cls.cost_fields.get(t, ()):
                names[path.split(".", 1)[0]] = None
        v = self[t] = tuple(names)
        return v


_FIELDS_MADE: list[Any] = [None, None]  # (the engines it was made for, the _ScanFields)


def _scan_fields() -> _ScanFields:
    """The :class:`_ScanFields` of the engines registered now: one kept while they stay the same
    (made anew, as each simulate() call made it before, when one is registered or replaced)."""
    engines = tuple(ENGINE_TYPES.items())
    if _FIELDS_MADE[0] != engines:
        _FIELDS_MADE[:] = [engines, _ScanFields()]
    return _FIELDS_MADE[1]


def _edge_log(kernel: Kernel, n: int) -> tuple[Any, ...] | None:
    """The builder's dependency log (:meth:`NativeDependencyTracker.logged_edges`) when it has
    ``n`` records; None otherwise."""
    get = getattr(getattr(kernel, "_deps", None), "logged_edges", None)
    log = get() if get is not None else None
    return log if log is not None and len(log[0]) == n else None


def _type_column(kernel: Kernel, fields: _ScanFields) -> TypeColumn:
    """The instruction types of a kernel (numbered in order of first use) and each one's
    number. With the C scan (scan.c), read in one pass with everything else the columns need
    of each instruction (:class:`_Scan`); without it (or if the scan meets an error), by
    ``map(type)``: the columns then read the rest with map() passes, meeting any error where
    they always did."""
    instrs = kernel.instructions
    type_id = Numbering()
    if _scan is not None and type(instrs) is list:
        log = _edge_log(kernel, len(instrs))
        try:
            raw, first, ds, fs = _scan.instructions(instrs, fields, None if log is None else log[0],
                                                    None if log is None else log[1])
        except Exception:  # noqa: BLE001 - the map() passes meet it (or not) where they always did
            pass
        else:
            key = np.frombuffer(raw, dtype=np.int32)
            reps = [instrs[i] for i in first]
            key_type = np.fromiter(map(type_id.__getitem__, map(type, reps)), dtype=np.int32, count=len(reps))
            return type_id, key_type[key], _Scan(key, reps, key_type, log, ds, fs)
    return type_id, np.fromiter(map(type_id.__getitem__, map(type, instrs)), dtype=np.int32,
                                count=len(instrs)), None


def _renumber(keys: np.ndarray, nkeys: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct numbers among ``keys`` (values in 0..nkeys-1), ascending, and each key's
    position among them: np.unique(return_inverse=True) without the sort."""
    present = np.zeros(nkeys, dtype=bool)
    present[keys] = True
    uniq = _where(present)
    at = np.empty(nkeys, dtype=np.int64)
    at[uniq] = np.arange(len(uniq))
    return uniq, at[keys]


def _where(mask: np.ndarray) -> np.ndarray:
    """The positions of the true (non-zero) entries of a 1-d array: ``np.flatnonzero`` without
    its ravel() wrapper (~2 us a call, a dozen calls per simulated kernel)."""
    return mask.nonzero()[0]


def _distinct(small: np.ndarray) -> np.ndarray:
    """``np.unique`` of small non-negative ints (engine, type and key numbers), by counting:
    plain np.unique looks at ``np.ma`` and so imports numpy.ma on its first call in a process
    (~13 ms, more than simulating a small kernel)."""
    return _where(np.bincount(small)) if len(small) else np.zeros(0, dtype=np.int64)


def _objects(items: list[Any]) -> np.ndarray:
    """A 1-d object array of ``items`` (np.array would make a 2-d one of tuples)."""
    a = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        a[i] = x
    return a


def _native_unsupported(types: Sequence[TypeColumn]) -> str | None:
    """Why the native loop cannot run kernels of these instruction types (:func:`_type_column`)
    exactly as the simpy processes would (None: it can). It implements the in-order rule of
    :meth:`Engine.plan` and TensorE's; an engine registered with a placement rule of its own
    runs on the simpy processes."""
    for name, cls in ENGINE_TYPES.items():
        if cls.plan is Engine.plan:
            continue
        if not (issubclass(cls, TensorEngine) and cls.plan is TensorEngine.plan
                and cls.utilisation_limit is TensorEngine.utilisation_limit):
            return f"engine {name} ({cls.__name__}) places instructions by its own plan(), which sched.c does not model"
    for type_id, _, _ in types:
        for t in type_id:
            if issubclass(t, DmaCopy) != bool(t.is_dma):
                return f"instruction type {t.__name__} is a DMA for the queues but not for its engine"
    return None


# instruction kinds of sched.h
_KIND_GENERIC, _KIND_TRIGGER, _KIND_TENSOR = (_sched.lib.SCHED_GENERIC, _sched.lib.SCHED_TRIGGER,
                                              _sched.lib.SCHED_TENSOR) if _sched is not None else (0, 1, 2)


class _TriggerLabels(dict):  # type: ignore[type-arg]
    """A DMA trigger's segment label per queue lane (as :meth:`Engine.plan` names it)."""

    def __missing__(self, queue: str) -> str:
        lab = self[queue] = Engine.trigger_label(queue)
        return lab


_TRIGGER_LABEL = _TriggerLabels()
_ENGINE_OF = attrgetter("engine")
_DEPS_OF = attrgetter("deps")
_FIRST_OF = attrgetter("first_deps")
_QUEUE_OF = attrgetter("queue")
_PLAN_OF = attrgetter("plan")


def _pick(items: Sequence[Any], idx: np.ndarray) -> list[Any]:
    """``[items[i] for i in idx]`` (``idx`` ascending), at C speed."""
    if len(idx) == 1:
        return [items[int(idx[0])]]
    if len(idx) * 8 > len(items):  # most of them: one pass over a mask copies less
        mask = np.zeros(len(items), dtype=bool)
        mask[idx] = True
        return list(compress(items, mask.tolist()))
    return list(itemgetter(*idx.tolist())(items)) if len(idx) else []


def _logged_edges(kernel: Kernel, instrs: Sequence[Instruction], scan: _Scan | None = None
                  ) -> tuple[np.ndarray, ...] | None:
    """The deps / first_deps columns from the builder's dependency log (the C tracker keeps
    each record's edges as ints: :meth:`NativeDependencyTracker.logged_edges`), when they are
    provably what the instructions carry now; None otherwise (read the instructions).

    Instructions are mutable: the proof is that instruction ``i``'s ``deps`` and ``first_deps``
    are equal to the tuples record ``i`` returned (identical objects - the C scan checks that
    in its pass, ``scan`` - unless something replaced them: then compared by value; anything
    else, e.g. a list, is not equal and falls back). A kernel whose records are not exactly its
    instructions in order (an edited or spliced list, an unpickled kernel, the Python tracker)
    falls back too."""
    if scan is not None:
        log, ds, fs = scan.log, scan.deps_same, scan.first_same
    else:
        log, ds, fs = _edge_log(kernel, len(instrs)), 0, 0
    if log is None:
        return None
    dlog, flog, cols = log
    try:
        if list(map(_DEPS_OF, instrs[ds:])) != dlog[ds:] or list(map(_FIRST_OF, instrs[fs:])) != flog[fs:]:
            return None
    except (TypeError, ValueError):  # a deps value whose == is not a truth value (an array)
        return None
    return cols


class _CoreColumns:
    """One core's instructions as the arrays sched.c reads (local indices), built column by
    column with C-level map/numpy operations rather than a Python loop per instruction (that
    loop would cost more than the whole event loop in C)."""

    def __init__(self, tl: CoreTimeline, plans: "_Plans", types: TypeColumn):
        instrs = tl.kernel.instructions
        n = self.n = len(instrs)
        names = list(ENGINE_TYPES)
        eng_id = {name: j for j, name in enumerate(names)}
        engines = [tl.engines[name] for name in names]
        type_id, tid, scan = types
        if scan is not None:  # engine numbers per scan key, in order of first use: the same KeyError for a bad name
            key_eng = np.fromiter(map(eng_id.__getitem__, map(_ENGINE_OF, scan.reps)), dtype=np.int32,
                                  count=len(scan.reps))
            self.engine = eng = key_eng[scan.key]
        else:
            self.engine = eng = np.fromiter(map(eng_id.__getitem__, map(_ENGINE_OF, instrs)), dtype=np.int32,
                                            count=n)
        logged = _logged_edges(tl.kernel, instrs, scan)
        if logged is not None:
            self.dep_off, self.deps, self.has_first, self.first_off, self.first = logged
        else:
            dl = list(map(_DEPS_OF, instrs))
            self.dep_off = np.fromiter(accumulate(map(len, dl), initial=0), dtype=np.int64, count=n + 1)
            self.deps = np.fromiter(chain.from_iterable(dl), dtype=np.int32, count=int(self.dep_off[-1]))
            fl = list(map(_FIRST_OF, instrs))
            # None (wait for all deps) and () (no first-phase deps) differ; both add no indices
            self.has_first = np.fromiter(map(is_not, fl, repeat(None)), dtype=np.int8, count=n)
            self.first_off = np.fromiter(accumulate(map(length_hint, fl), initial=0), dtype=np.int64, count=n + 1)
            self.first = np.fromiter(chain.from_iterable(filter(None, fl)), dtype=np.int32,
                                     count=int(self.first_off[-1]))
        self.lat = np.zeros(n, dtype=np.int64)
        self.tensor_used = False
        self.hbm_bytes = self.hbm_ticks = 0
        self.queues: list[tuple[str, np.ndarray]] = []
        if scan is not None:
            gidx = self._by_key(scan, key_eng, type_id, names, engines, plans, tl.dma)
        else:
            gidx = self._by_instruction(instrs, tid, type_id, names, engines, plans, tl.dma)
        busy, lat, lanes, labels = self.busy, self.lat, self.lanes, self.labels
        if len(gidx):
            types = list(type_id)
            states = [(e, [getattr(e, a) for a in e.cost_state]) for e in engines]
            try:
                for j in _distinct(eng[gidx]).tolist():
                    idx = gidx[eng[gidx] == j]
                    cost = _generic_costs(instrs, idx, tid[idx], types, engines[j], scan)
                    busy[idx], lat[idx], lanes[idx], labels[idx] = cost
            except Exception:
                # a cost method failed: ask again instruction by instruction in program order
                # from the same engine states, so the error (and the state at it) is the one
                # the simpy reference meets first
                for e, vals in states:
                    for a, v in zip(e.cost_state, vals):
                        setattr(e, a, v)
                bl, ll, lal, lbl = [], [], [], []
                for i in gidx.tolist():
                    b, lt, ln, lb = _cost_row(engines[eng[i]], instrs[i])
                    bl.append(b)
                    ll.append(lt)
                    lal.append(ln)
                    lbl.append(lb)
                busy[gidx], lat[gidx], lanes[gidx], labels[gidx] = bl, ll, lal, lbl
        self.processes: list[tuple[int, np.ndarray]] = []  # (engine id, or -1 for a queue; instructions)
        # each engine's instructions in program order: the stable sort by engine, cut at the counts
        by_engine = np.argsort(eng, kind="stable")
        lo = 0
        for j, c in enumerate(np.bincount(eng, minlength=len(names)).tolist()):
            if c:
                self.processes.append((j, by_engine[lo:lo + c]))
                lo += c
        self.processes.extend((-1, q_idx) for _, q_idx in self.queues)

    def _by_key(self, scan: _Scan, key_eng: np.ndarray, type_id: Numbering, names: list[str], engines: list[Engine],
                plans: "_Plans", dma: DmaSystem) -> np.ndarray:
        """TensorE's and the DMAs' columns worked out once per scan key (same type, engine and
        cost fields: the same costs, lane, label, queue and plan) and gathered per instruction;
        the generic instructions' positions, for :func:`_generic_costs`."""
        nk, reps, key = len(scan.reps), scan.reps, scan.key
        k_kind = np.zeros(nk, dtype=np.int8)
        k_busy = np.zeros(nk, dtype=np.int64)
        k_ls = np.zeros(nk, dtype=np.int64)
        k_plan = np.full(nk, -1, dtype=np.int32)
        k_owner = key_eng.copy()
        k_lane = _names_array(names)[key_eng]  # each instruction's main segment: lane and label
        k_label = np.empty(nk, dtype=object)
        k_owners = k_lane.copy()                       # CoreTimeline.owner: engine, or queue of a DMA
        k_qid = np.full(nk, -1, dtype=np.int32)
        generic = np.ones(nk, dtype=bool)
        dma_parts: list[np.ndarray] = []
        for t, j in type_id.items():
            kt = _where(scan.key_type == j)  # this type's keys, in order of first use
            if issubclass(t, DmaCopy):  # a trigger on its engine, a transfer on its queue
                dma_parts.append(kt)
                generic[kt] = False
                continue
            if issubclass(t, (MatMul, Transpose)):
                ticks = _tensor_ticks(t, key_eng[kt], engines, lambda: [reps[u] for u in kt.tolist()])
                if ticks is not None:
                    k_kind[kt] = _KIND_TENSOR
                    k_ls[kt], k_busy[kt], k_label[kt] = ticks
                    generic[kt] = False
                    self.tensor_used = True
        if dma_parts:
            dk = np.sort(np.concatenate(dma_parts)) if len(dma_parts) > 1 else dma_parts[0]
            dmas = [reps[u] for u in dk.tolist()]
            qs = list(map(_QUEUE_OF, dmas))
            trig = np.array([e.trigger_ticks() for e in engines], dtype=np.int64)
            k_kind[dk] = _KIND_TRIGGER
            k_busy[dk] = trig[key_eng[dk]]
            k_label[dk] = _objects(list(map(_TRIGGER_LABEL.__getitem__, qs)))
            k_owners[dk] = _objects(qs)
            # queues in order of first appearance, as CoreTimeline starts their processes
            qid_of = Numbering()
            k_qid[dk] = qid = np.fromiter(map(qid_of.__getitem__, qs), dtype=np.int32, count=len(qs))
            k_owner[dk] = _queue_owners(qid_of, names)[qid]
            count = np.bincount(key, minlength=nk)[dk]  # transfers per key
            k_plan[dk], self.hbm_bytes, self.hbm_ticks = plans.index(list(map(_PLAN_OF, dmas)), dma, count)
            inst_qid = k_qid[key]
            for q, k in qid_of.items():
                self.queues.append((q, _where(inst_qid == k)))
        k_lat = np.zeros(nk, dtype=np.int64)
        if generic.any():
            _keyed_costs(scan, key_eng, engines, generic, k_busy, k_lat, k_lane, k_label)
        self.kind, self.busy, self.ls, self.plan, self.owner = k_kind[key], k_busy[key], k_ls[key], k_plan[key], \
            k_owner[key]
        self.lanes, self.labels, self.owners = k_lane[key], k_label[key], k_owners[key]
        self.lat = k_lat[key]
        return _where(generic[key])

    def _by_instruction(self, instrs: Sequence[Instruction], tid: np.ndarray, type_id: Numbering, names: list[str],
                        engines: list[Engine], plans: "_Plans", dma: DmaSystem) -> np.ndarray:
        """TensorE's and the DMAs' columns read instruction by instruction (map() passes: no
        C scan); the generic instructions' positions, for :func:`_generic_costs`."""
        n, eng = self.n, self.engine
        kind = self.kind = np.zeros(n, dtype=np.int8)
        busy = self.busy = np.zeros(n, dtype=np.int64)
        ls = self.ls = np.zeros(n, dtype=np.int64)
        self.plan = np.full(n, -1, dtype=np.int32)
        self.owner = eng.copy()
        lanes = np.array(names, dtype=object)[eng]  # each instruction's main segment: lane and label
        labels = np.empty(n, dtype=object)
        owners = lanes.copy()                # CoreTimeline.owner: engine, or queue of a DMA
        self.lanes, self.labels, self.owners = lanes, labels, owners
        generic: list[np.ndarray] = []
        dma_parts: list[np.ndarray] = []
        for t, j in type_id.items():
            idx = _where(tid == j)
            if issubclass(t, DmaCopy):  # a trigger on its engine, a transfer on its queue
                dma_parts.append(idx)
                continue
            if issubclass(t, (MatMul, Transpose)):
                ticks = _tensor_ticks(t, eng[idx], engines, lambda: _pick(instrs, idx))
                if ticks is not None:
                    kind[idx] = _KIND_TENSOR
                    ls[idx], busy[idx], labels[idx] = ticks
                    self.tensor_used = True
                    continue
            generic.append(idx)
        if dma_parts:
            didx = np.sort(np.concatenate(dma_parts)) if len(dma_parts) > 1 else dma_parts[0]
            trig = np.array([e.trigger_ticks() for e in engines], dtype=np.int64)
            kind[didx] = _KIND_TRIGGER
            busy[didx] = trig[eng[didx]]
            qid_of = Numbering()  # queues in order of first appearance, as CoreTimeline starts their processes
            dmas = _pick(instrs, didx)
            qs = list(map(_QUEUE_OF, dmas))
            labels[didx] = list(map(_TRIGGER_LABEL.__getitem__, qs))
            owners[didx] = qs
            qid = np.fromiter(map(qid_of.__getitem__, qs), dtype=np.int32, count=len(qs))
            for q, k in qid_of.items():
                self.queues.append((q, didx[qid == k]))
            self.owner[didx] = _queue_owners(qid_of, names)[qid]
            pl, self.hbm_bytes, self.hbm_ticks = plans.index(list(map(_PLAN_OF, dmas)), dma)
            self.plan[didx] = pl
        if not generic:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(generic)) if len(generic) > 1 else generic[0]


_NAMES_ARRAYS: dict[tuple[str, ...], np.ndarray] = {}


def _names_array(names: list[str]) -> np.ndarray:
    """``np.array(names, dtype=object)``, made once per list of engine names (indexing gives a
    new array: the kept one is never written)."""
    key = tuple(names)
    a = _NAMES_ARRAYS.get(key)
    if a is None:
        a = _NAMES_ARRAYS[key] = np.array(names, dtype=object)
    return a


def _queue_owners(queues: Numbering, names: list[str]) -> np.ndarray:
    """The owner number of each DMA queue (numbered in order of first use): the engine's for a
    queue named after an engine, else ``len(names)`` on, one per queue."""
    eng_id = {name: j for j, name in enumerate(names)}
    return np.array([eng_id.get(q, len(names) + k) for q, k in queues.items()], dtype=np.int32)


def _tensor_ticks(t: type, on: np.ndarray, engines: list[Engine], items: Any
                  ) -> tuple[np.ndarray, np.ndarray, str] | None:
    """LoadStationary and busy ticks and the label of TensorE instructions of type ``t`` (a
    matmul or PE transpose type) on engines ``on``, read from ``items()`` by shape; None when
    they are not all on one TensorEngine (then costed like any other instruction)."""
    e = _distinct(on)
    te = engines[int(e[0])]
    if len(e) != 1 or not isinstance(te, TensorEngine):
        return None
    transpose = issubclass(t, Transpose)
    ids, cycles = te.cycles_by_shape(items(), transpose)
    tab = np.array(cycles, dtype=np.int64).reshape(-1, 2) * te.tpc
    return tab[ids, 0], tab[ids, 1], "Transpose" if transpose else "MultiplyMoving"


def _cost_row(e: Engine, ins: Instruction) -> tuple[int, int, str, str]:
    """``ins``'s busy ticks, latency ticks, lane and label on engine ``e``, from its cost methods."""
    return e.cycles(ins) * e.tpc, e.latency_cycles(ins) * e.tpc, e.lane(ins), ins.describe()


def _keyed_costs(scan: _Scan, key_eng: np.ndarray, engines: list[Engine], generic: np.ndarray, k_busy: np.ndarray,
                 k_lat: np.ndarray, k_lane: np.ndarray, k_label: np.ndarray) -> None:
    """The costs of the generic instructions of engines without a cost state, worked out per
    scan key (:class:`_Scan`: the same type, engine and cost fields, so the same costs) into the
    per-key columns, whose keys are then no longer ``generic``: what :func:`_generic_costs` gives
    them, without its per-instruction passes. The cost methods run once per cost key, in program
    order of first use (scan keys are numbered in that order, and each cost key's first
    instruction is its first scan key's), each key's label that first instruction's. An engine
    with a cost state, a type without a cost key (each instruction its own key), or a cost
    method that raises is left to :func:`_generic_costs` (which meets the error in program order)."""
    reps = scan.reps
    by_engine: dict[int, list[int]] = {}
    for u in _where(generic).tolist():
        by_engine.setdefault(int(key_eng[u]), []).append(u)
    for j, keys in by_engine.items():
        e = engines[j]
        if e.cost_state:
            continue
        fns: dict[type, Any] = {}
        for u in keys:
            t = type(reps[u])
            if t not in fns:
                fns[t] = e.cost_key(t)
        if None in fns.values():
            continue
        memo: dict[tuple[type, Any], tuple[int, int, str, str]] = {}
        got = []
        try:
            for u in keys:
                ins = reps[u]
                t = type(ins)
                ck = (t, fns[t](ins))
                c = memo.get(ck)
                if c is None:
                    c = memo[ck] = _cost_row(e, ins)
                got.append(c)
        except Exception:  # noqa: BLE001 - _generic_costs asks again, in program order
            continue
        for u, (b, lt, ln, lb) in zip(keys, got):
            k_busy[u], k_lat[u], k_lane[u], k_label[u] = b, lt, ln, lb
            generic[u] = False


def _generic_costs(instrs: Sequence[Instruction], idx: np.ndarray, tid: np.ndarray, types: list[type],
                   e: Engine, scan: _Scan | None = None) -> tuple[Any, Any, Any, Any]:
    """Busy ticks, latency ticks, lane and label of instructions ``idx`` (ascending) of engine
    ``e``, from its cost methods: once per distinct cost key (:attr:`Engine.cost_fields`; an
    instruction of a type without one is its own key), in program order of first use. An engine
    with a cost state (ScalarE's table) is walked in program order by (key, state), each state
    change exactly as calling it instruction by instruction makes it."""
    n = len(idx)
    kid = np.empty(n, dtype=np.int64)
    nkeys = 0
    for j in _distinct(tid).tolist():
        pos = _where(tid == j)
        key = e.cost_key(types[j])
        if key is None:
            kid[pos] = np.arange(nkeys, nkeys + len(pos))
            nkeys += len(pos)
            continue
        number = Numbering()
        if scan is not None:  # the key once per scan key (same operand objects), in order of first use
            uk, at = _renumber(scan.key[idx[pos]], len(scan.reps))
            kid[pos] = np.fromiter(map(number.__getitem__, map(key, [scan.reps[u] for u in uk.tolist()])),
                                   dtype=np.int64, count=len(uk))[at] + nkeys
        else:
            kid[pos] = np.fromiter(map(number.__getitem__, map(key, _pick(instrs, idx[pos]))), dtype=np.int64,
                                   count=len(pos)) + nkeys
        nkeys += len(number)

    if not e.cost_state:
        _, first = np.unique(kid, return_index=True)  # first[k]: where key k is first used
        order = np.sort(first)
        # keys numbered in order of first use, so the cost methods run in program order
        renum = np.empty(nkeys, dtype=np.int64)
        renum[kid[order]] = np.arange(len(order))
        table = [_cost_row(e, instrs[i]) for i in idx[order].tolist()]
        at = renum[kid]
    else:
        names = e.cost_state
        memo: dict[tuple[int, Any], tuple[int, Any]] = {}
        table, at_l = [], []
        state = tuple(getattr(e, a) for a in names)
        for p, k in enumerate(kid.tolist()):
            hit = memo.get((k, state))
            if hit is None:
                for a, v in zip(names, state):
                    setattr(e, a, v)
                table.append(_cost_row(e, instrs[int(idx[p])]))
                hit = memo[(k, state)] = (len(table) - 1, tuple(getattr(e, a) for a in names))
            at_l.append(hit[0])
            state = hit[1]
        for a, v in zip(names, state):
            setattr(e, a, v)
        at = np.array(at_l, dtype=np.int64)
    b, lt, ln, lb = zip(*table)
    return (np.array(b, dtype=np.int64)[at], np.array(lt, dtype=np.int64)[at],
            np.array(ln, dtype=object)[at], np.array(lb, dtype=object)[at])


class _Plans:
    """The distinct DMA plans of a run and each one's per-engine and HBM ticks
    (:meth:`DmaSystem.engine_ticks`, :meth:`BandwidthPipe.ticks`)."""

    def __init__(self) -> None:
        self.number = Numbering()  # id(plan) -> plan index (the plans stay alive during the run)
        self.off = [0]
        self.engine: list[int] = []
        self.ticks: list[int] = []
        self.hbm: list[int] = []
        self.hbm_bytes: list[int] = []
        self.hbm_ticks: list[int] = []

    def index(self, plans: list[Any], dma: DmaSystem, weights: np.ndarray | None = None
              ) -> tuple[np.ndarray, int, int]:
        """Plan indices of ``plans`` and the HBM bytes and ticks they book in all (``plans[i]``
        standing for ``weights[i]`` transfers)."""
        id_list = list(map(self.number.__getitem__, map(id, plans)))
        ids = np.array(id_list, dtype=np.int32)
        # the new plans in number order: numbers are given in order of first appearance, so
        # the first appearance of each new number comes in increasing order
        for k, plan in zip(id_list, plans):
            if k < len(self.off) - 1:  # known, or added already in this call
                continue
            for e, t in dma.engine_ticks_of(plan):
                self.engine.append(e)
                self.ticks.append(t)
            self.off.append(len(self.engine))
            hb = plan.hbm_bus_bytes
            self.hbm.append(1 if hb else 0)
            self.hbm_bytes.append(hb)
            self.hbm_ticks.append(dma.hbm.ticks(hb) if hb else 0)
        if weights is None:
            count = np.bincount(ids, minlength=len(self.hbm_bytes))
        else:
            # (counts: whole numbers far below 2**53, so the float sums are exact)
            count = np.bincount(ids, weights=weights, minlength=len(self.hbm_bytes)).astype(np.int64)
        nbytes = sum(c * b for c, b in zip(count.tolist(), self.hbm_bytes) if c)
        nticks = sum(c * t for c, t in zip(count.tolist(), self.hbm_ticks) if c)
        return ids, nbytes, nticks


class _NativeTimeline(CoreTimeline):
    """A :class:`CoreTimeline` the native loop filled in. Its ``segments`` list is made when it
    is first read (a report or trace reads it; a search that wants ``total_ticks`` does not):
    the loop logs them as arrays, and one Python tuple per segment is most of what is left of
    a simulation's cost. The list is the one the simpy processes make, in the same order."""

    _segments: list[Segment] | None
    _segment_columns: tuple[Any, ...] | None = None

    @property  # type: ignore[override]
    def segments(self) -> list[Segment]:
        if self._segments is None:
            with gc_paused():
                self._segments = self._make_segments()
            self._segment_columns = None
        return self._segments

    @segments.setter
    def segments(self, value: list[Segment]) -> None:
        self._segments = value

    def _make_segments(self) -> list[Segment]:
        lanes, labels, owners, li, ki, si, ei = self._segment_columns  # type: ignore[misc]
        m = len(lanes)
        # (lane, label) of a segment: the instruction's own, LoadStationary's, or its transfer's
        lane_tab = np.concatenate([lanes, np.full(m, LS_LANE, dtype=object), owners])
        label_tab = np.concatenate([labels, np.full(m, "LoadStationary", dtype=object),
                                    np.full(m, "DmaCopy", dtype=object)])
        at = ki.astype(np.int64) * m + li
        return list(zip(lane_tab[at].tolist(), label_tab[at].tolist(), si.tolist(), ei.tolist(), li.tolist()))


class _NativeRun:
    """:func:`simulate` on the C event loop: each instruction's costs from its engine module,
    in flat arrays (:class:`_CoreColumns`); the loop (sched.c) runs the processes
    :class:`CoreTimeline` would start, in the same order; the results go back into
    :class:`CoreTimeline` objects, and the engines, DMA systems and HBM pipes are left as the
    simpy run leaves them."""

    def __init__(self, config: ChipConfig, kernels: Sequence[Kernel], pipes: list[BandwidthPipe],
                 types: Sequence[TypeColumn]):
        self.config = config
        self.pipes = pipes
        self.stacks = [stack_of_core(config, c) for c in range(len(kernels))]
        self.timelines = [_NativeTimeline(None, config, k, pipes[self.stacks[c]], c) for c, k in enumerate(kernels)]
        self.types = types

    def run(self) -> list["_NativeTimeline"]:
        ffi, lib = _sched.ffi, _sched.lib
        cfg = self.config
        plans = _Plans()
        cols: list[_CoreColumns] = []
        first: dict[int, tuple[_CoreColumns, CoreTimeline]] = {}
        for tl, t in zip(self.timelines, self.types):
            seen = first.get(id(tl.kernel))
            if seen is None:
                cols.append(_CoreColumns(tl, plans, t))
                first[id(tl.kernel)] = (cols[-1], tl)
                continue
            # the same kernel on another core: its columns are a function of the kernel, fresh
            # engines of one config and the plans already numbered, so they are the first
            # core's; its engines are left in the state working them out leaves (ScalarE's table)
            col, tl0 = seen
            for name, e in tl.engines.items():
                for a in e.cost_state:
                    setattr(e, a, getattr(tl0.engines[name], a))
            cols.append(col)
        ncores = len(cols)
        sizes = [c.n for c in cols]
        base = np.array([0, *accumulate(sizes)], dtype=np.int64)
        n = int(base[-1])

        # (each column is copied, in its C type, into its type's buffer below: no conversion here)
        def cat(name: str) -> Any:
            if ncores == 1:
                return getattr(cols[0], name)
            return np.concatenate([getattr(c, name) for c in cols]) if cols else ()

        def offsets(name: str, flat: str) -> Any:
            parts, shift = [], 0
            for k, c in enumerate(cols):
                o = getattr(c, name)
                parts.append((o[:-1] if k < ncores - 1 else o) + shift)
                shift += len(getattr(c, flat))
            return np.concatenate(parts) if parts else (0,)

        keep: list[Any] = []

        def ptr(ctype: str, a: np.ndarray) -> Any:
            if not len(a):
                a = np.zeros(1, dtype=a.dtype)
            keep.append(a)
            return ffi.from_buffer(ctype + "[]", a)

        names = list(ENGINE_TYPES)
        proc_queue, proc_core, proc_own, proc_parts, proc_engine = [], [], [], [], []
        for c, col in enumerate(cols):
            for j, idx in col.processes:
                proc_queue.append(0 if j >= 0 else 1)
                proc_core.append(c)
                eng = self.timelines[c].engines[names[j]] if j >= 0 else None
                proc_own.append(j if eng is not None and eng.pipelines_own_results else -1)
                proc_parts.append(idx + base[c] if c else idx)
                proc_engine.append((c, eng))
        nproc = len(proc_queue)
        r = ffi.new("sched_run_t *")
        r.n = n
        r.nproc = nproc
        # the loop's inputs, each copied into one buffer per C type (one cffi buffer each, every
        # field a pointer into it: ~25 buffers made ~10% of simulating a small kernel)
        inputs: list[tuple[str, Any, Any]] = [
            ("kind", np.int8, cat("kind")), ("busy", np.int64, cat("busy")), ("lat", np.int64, cat("lat")),
            ("ls", np.int64, cat("ls")), ("owner", np.int32, cat("owner")),
            ("dep_off", np.int64, offsets("dep_off", "deps")), ("deps", np.int32, cat("deps")),
            ("first_off", np.int64, offsets("first_off", "first")), ("first_deps", np.int32, cat("first")),
            ("has_first", np.int8, cat("has_first")), ("plan", np.int32, cat("plan")),
            ("proc_queue", np.int8, proc_queue), ("proc_core", np.int32, proc_core), ("proc_own", np.int32, proc_own),
            ("proc_off", np.int64, [0, *accumulate(map(len, proc_parts))]),
            ("proc_instr", np.int32, np.concatenate(proc_parts) if proc_parts else ()),
            ("core_base", np.int64, base)]
        t = cfg.core.tensor
        # the ramp's figures in ticks, as TensorEngine has them (the timelines' own where it is one)
        tensor_eng = next((e for tl in self.timelines for e in tl.engines.values() if type(e) is TensorEngine), None) \
            or TensorEngine(cfg)
        r.overlap_ls = 1 if t.overlap_load_stationary else 0
        r.drain_ticks = tensor_eng.drain_cycles * tensor_eng.tpc
        r.ramp_ticks = tensor_eng.ramp_ticks
        r.idle_reset_ticks = tensor_eng.idle_reset_ticks
        r.initial_util = float(t.throttle_initial_util)
        n_dma = cfg.core.dma.engines
        r.ncores = ncores
        r.dma_engines = n_dma
        d0 = self.timelines[0].dma if self.timelines else DmaSystem(cfg, self.pipes[0])
        r.start_latency = d0.start_latency
        r.transfer_latency = d0.transfer_latency
        inputs += [("core_stack", np.int32, self.stacks), ("plan_off", np.int64, plans.off),
                   ("plan_engine", np.int32, plans.engine), ("plan_ticks", np.int64, plans.ticks),
                   ("plan_hbm", np.int8, plans.hbm), ("plan_hbm_ticks", np.int64, plans.hbm_ticks)]
        for dtype, ctype in ((np.int64, "int64_t"), (np.int32, "int32_t"), (np.int8, "int8_t")):
            group = [(name, a) for name, dt, a in inputs if dt is dtype]
            at = [0, *accumulate(len(a) for _, a in group)]
            buf = np.empty(at[-1] + 1, dtype=dtype)  # (+1: never an empty buffer)
            for (_, a), lo, hi in zip(group, at, at[1:]):
                buf[lo:hi] = a
            p = ptr(ctype, buf)
            for (name, _), lo in zip(group, at):
                setattr(r, name, p + lo)
        # the loop's int64 state and results: slices of one zeroed buffer (one allocation and one
        # cffi buffer for the eight, each then a pointer into it)
        sizes64 = (max(nproc, 1), max(6 * nproc, 1), max(ncores * n_dma, 1), max(n, 1), max(n, 1), max(n, 1),
                   max(2 * n, 1), max(2 * n, 1))
        work = np.zeros(sum(sizes64), dtype=np.int64)
        at64 = [0, *accumulate(sizes64)]
        engine_free, tensor_state, dma_free, ready, end, trigger, seg_start, seg_end = (
            work[a:b] for a, b in zip(at64, at64[1:]))
        wp = ptr("int64_t", work)
        r.engine_free, r.tensor_state, r.dma_free, r.ready, r.end, r.trigger, r.seg_start, r.seg_end = (
            wp + a for a in at64[:-1])
        pipe_free = np.array([p.free for p in self.pipes] or [0], dtype=np.int64)
        seg_index = np.zeros(max(2 * n, 1), dtype=np.int32)
        seg_kind = np.zeros(max(2 * n, 1), dtype=np.int8)
        r.pipe_free = ptr("int64_t", pipe_free)
        r.seg_index = ptr("int32_t", seg_index)
        r.seg_kind = ptr("int8_t", seg_kind)
        if lib.sched_run(r) != 0:
            raise MemoryError("simulate: the native event loop ran out of memory")
        nseg = r.nseg
        # ---- results back into the timelines --------------------------------------------------
        g = seg_index[:nseg].astype(np.int64)
        k = seg_kind[:nseg]
        starts, ends = seg_start[:nseg], seg_end[:nseg]
        seg_core = np.searchsorted(base, g, side="right") - 1 if ncores > 1 else None
        for c, (tl, col) in enumerate(zip(self.timelines, cols)):
            b0, b1 = int(base[c]), int(base[c + 1])
            rd = ready[b0:b1]
            missing = _where(rd < 0)
            if len(missing):  # pragma: no cover - CoreTimeline.check_complete's error, from the arrays
                raise RuntimeError(f"simulation stalled: {len(missing)} instructions never ran, first #{missing[0]}")
            tl.ready = rd.tolist()
            tl.end = end[b0:b1].tolist()
            tl.trigger = [None if x < 0 else x for x in trigger[b0:b1].tolist()]
            tl.owner = col.owners.tolist()
            if seg_core is None:
                li, ki, si, ei = g, k, starts, ends
            else:
                sel = seg_core == c
                li, ki, si, ei = g[sel] - b0, k[sel], starts[sel], ends[sel]
            tl._segment_columns = (col.lanes, col.labels, col.owners, li, ki, si, ei)
            tl._segments = None
        for p, (c, eng) in enumerate(proc_engine):
            if eng is None:
                continue
            eng.free = int(engine_free[p])
            if isinstance(eng, TensorEngine) and cols[c].tensor_used:
                ts = tensor_state[6 * p:6 * p + 6].tolist()
                eng.ls_free, eng.last_mm_start, eng.last_mm_ready, eng.last_mm_end = ts[0], ts[1], ts[2], ts[3]
                if ts[5]:
                    eng.ramp_start = ts[4]
        for c, (tl, col) in enumerate(zip(self.timelines, cols)):
            if col.queues:
                tl.dma.engine_free = dma_free[c * n_dma:(c + 1) * n_dma].tolist()
                tl.dma._level = None
            tl.dma.hbm.bytes += col.hbm_bytes
            tl.dma.hbm.busy_ticks += col.hbm_ticks
        for s_, p_ in enumerate(self.pipes):
            p_.free = int(pipe_free[s_])
        return self.timelines


def __getattr__(name: str) -> object:  # names renamed so one name means one thing (trnsim.compat.RENAMED)
    return renamed(__name__, name)
