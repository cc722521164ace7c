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
(``trnsim.native._sched``, sched.c) when it is built: the same events in the same order, ties
broken as simpy breaks them (tick, priority, event id), so every tick, ready time and trace
segment is identical (tests/test_sim_equivalence.py) at a fraction of the cost. The engine
modules still give each instruction its costs; the loop keeps the state that moves with time.
"""

from __future__ import annotations

from array import array
from typing import Any, Generator, Sequence

import simpy

from . import cores as _cores  # noqa: F401  (registers the engine modules)
from .config import ChipConfig
from .cores.base import ENGINE_TYPES, Engine, Segment
from .cores.tensor import LS_LANE, TensorEngine
from .isa import DmaCopy, Instruction, MatMul, Transpose
from .kernel import Kernel, gc_paused
from .memory.dma import BandwidthPipe, DmaSystem
from .memory.hbm import stack_bandwidth, stack_of_core

try:
    from .native import _sched  # type: ignore[attr-defined]
except ImportError:  # not built: simulate() runs the simpy processes
    _sched = None

__all__ = ["CoreTimeline", "simulate", "native_available"]

SIM_ENGINES = ("auto", "native", "simpy")


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
        return max((r for r in self.ready if r is not None), default=0)

    def check_complete(self) -> None:
        missing = [i for i, r in enumerate(self.ready) if r is None]
        if missing:  # pragma: no cover - would be a scheduler bug: deps always point backwards
            raise RuntimeError(f"simulation stalled: {len(missing)} instructions never ran, first #{missing[0]}")


def native_available() -> bool:
    """True when the C event loop (``trnsim.native._sched``) is built."""
    return _sched is not None


def simulate(config: ChipConfig, kernels: Sequence[Kernel], *, engine: str = "auto") -> list[CoreTimeline]:
    """Run the timing model of ``kernels[c]`` on core ``c`` of one chip; return the timelines.

    ``engine``: ``"native"`` (the C event loop), ``"simpy"`` (the reference processes) or
    ``"auto"`` (native when built). Both give the same ticks and segments."""
    if engine not in SIM_ENGINES:
        raise ValueError(f"simulate: engine must be one of {', '.join(SIM_ENGINES)}, got {engine!r}")
    if len(kernels) > config.chip.cores:
        raise ValueError(f"{len(kernels)} kernels for a chip with {config.chip.cores} cores")
    if engine == "native" and _sched is None:
        raise RuntimeError("simulate(engine='native'): trnsim.native._sched (the C event loop) is not built: "
                           "run `pip install -e .` (needs gcc and cffi)")
    n_stacks = config.chip.hbm.stacks
    pipes = [BandwidthPipe(stack_bandwidth(config), config.tick_hz) for _ in range(n_stacks)]
    with gc_paused():
        if engine == "simpy" or _sched is None or not _native_rules():
            env = simpy.Environment()
            cores = [CoreTimeline(env, config, k, pipes[stack_of_core(config, c)], c) for c, k in enumerate(kernels)]
            env.run()
        else:
            cores = _NativeRun(config, kernels, pipes).run()
    for c in cores:
        c.check_complete()
    return cores


def _native_rules() -> bool:
    """Whether every registered engine places instructions by a rule sched.c implements: the
    in-order rule of :meth:`Engine.plan`, or TensorE's (an engine registered with its own
    ``plan`` runs on the simpy processes)."""
    return all(cls.plan is Engine.plan or cls.plan is TensorEngine.plan for cls in ENGINE_TYPES.values())


_KIND_GENERIC, _KIND_TRIGGER, _KIND_TENSOR = 0, 1, 2  # sched.h SCHED_*
_SEG_MAIN, _SEG_LS, _SEG_DMA = 0, 1, 2  # sched.h SEG_*


class _NativeRun:
    """:func:`simulate` on the C event loop: each instruction's costs from its engine module,
    in flat arrays; the loop (sched.c) runs the processes :class:`CoreTimeline` would start, in
    the same order; the results go back into :class:`CoreTimeline` objects."""

    def __init__(self, config: ChipConfig, kernels: Sequence[Kernel], pipes: list[BandwidthPipe]):
        self.config = config
        self.pipes = pipes
        self.timelines = [CoreTimeline(None, config, k, pipes[stack_of_core(config, c)], c)
                          for c, k in enumerate(kernels)]
        self.stacks = [stack_of_core(config, c) for c in range(len(kernels))]

    def run(self) -> list[CoreTimeline]:
        cfg = self.config
        names = list(ENGINE_TYPES)
        eng_id = {name: j for j, name in enumerate(names)}
        kind: list[int] = []
        busy: list[int] = []
        lat: list[int] = []
        ls: list[int] = []
        owner_id: list[int] = []
        dep_off = [0]
        deps: list[int] = []
        first_off = [0]
        first_flat: list[int] = []
        has_first: list[int] = []
        plan_of: list[int] = []
        plan_index: dict[int, int] = {}
        plans: list[Any] = []
        plan_off = [0]
        plan_engine: list[int] = []
        plan_ticks: list[int] = []
        plan_hbm: list[int] = []
        plan_hbm_ticks: list[int] = []
        plan_hbm_bytes: list[int] = []
        proc_queue: list[int] = []
        proc_core: list[int] = []
        proc_own: list[int] = []
        proc_off = [0]
        proc_instr: list[int] = []
        proc_engine: list[tuple[int, Engine | None]] = []  # (core, engine object or None for a queue)
        core_base: list[int] = []
        lanes: list[str] = []   # per instruction: its main segment's lane and label
        labels: list[str] = []
        owners: list[str] = []
        hbm_bytes = [0] * len(self.timelines)
        hbm_ticks = [0] * len(self.timelines)
        dma_used = [False] * len(self.timelines)
        tensor_used = [False] * len(self.timelines)
        trig_ticks = cfg.core.dma.trigger_cycles
        base = 0
        for c, tl in enumerate(self.timelines):
            core_base.append(base)
            instrs = tl.kernel.instructions
            engines = tl.engines
            queue_id: dict[str, int] = {}
            by_engine: dict[str, list[int]] = {name: [] for name in names}
            by_queue: dict[str, list[int]] = {}
            pipe = tl.dma.hbm
            dma = tl.dma
            trig_label: dict[str, str] = {}
            for g, ins in enumerate(instrs, base):
                en = ins.engine
                eng = engines[en]
                by_engine[en].append(g)
                d = ins.deps
                deps.extend(d)
                dep_off.append(len(deps))
                f = ins.first_deps
                if f is None:
                    has_first.append(0)
                else:
                    has_first.append(1)
                    first_flat.extend(f)
                first_off.append(len(first_flat))
                if isinstance(ins, DmaCopy):
                    q = ins.queue
                    by_queue.setdefault(q, []).append(g)
                    qid = queue_id.get(q)
                    if qid is None:
                        qid = queue_id[q] = eng_id[q] if q in eng_id else len(names) + len(queue_id)
                    owner_id.append(qid)
                    owners.append(q)
                    plan = ins.plan
                    pi = plan_index.get(id(plan))
                    if pi is None or plans[pi] is not plan:
                        pi = plan_index[id(plan)] = len(plans)
                        plans.append(plan)
                        for e, b, ch in plan.engines:
                            plan_engine.append(e)
                            plan_ticks.append(dma.engine_ticks(b, ch, plan))
                        plan_off.append(len(plan_engine))
                        nb = plan.hbm_bus_bytes
                        plan_hbm.append(1 if nb else 0)
                        plan_hbm_bytes.append(nb)
                        plan_hbm_ticks.append(pipe.ticks(nb))
                    plan_of.append(pi)
                    if plan_hbm[pi]:
                        hbm_bytes[c] += plan_hbm_bytes[pi]
                        hbm_ticks[c] += plan_hbm_ticks[pi]
                    dma_used[c] = True
                else:
                    owner_id.append(eng_id[en])
                    owners.append(en)
                    plan_of.append(-1)
                if ins.is_dma:  # Engine.plan: the sequencer writes the descriptor trigger
                    kind.append(_KIND_TRIGGER)
                    busy.append(trig_ticks * eng.tpc)
                    lat.append(0)
                    ls.append(0)
                    lanes.append(en)
                    lab = trig_label.get(ins.queue)  # type: ignore[attr-defined]
                    if lab is None:
                        lab = trig_label[ins.queue] = f"DmaTrigger[{ins.queue}]"  # type: ignore[attr-defined]
                    labels.append(lab)
                elif isinstance(eng, TensorEngine) and isinstance(ins, (MatMul, Transpose)):
                    ls_c, mm_c = eng.cached_cycles(ins)  # type: ignore[attr-defined]
                    tensor_used[c] = True
                    tpc = eng.tpc
                    kind.append(_KIND_TENSOR)
                    busy.append(mm_c * tpc)
                    lat.append(0)
                    ls.append(ls_c * tpc)
                    lanes.append(en)
                    labels.append("Transpose" if isinstance(ins, Transpose) else "MultiplyMoving")
                else:
                    tpc = eng.tpc
                    kind.append(_KIND_GENERIC)
                    busy.append(eng.cycles(ins) * tpc)
                    lat.append(eng.latency_cycles(ins) * tpc)
                    ls.append(0)
                    lanes.append(eng.lane(ins))
                    labels.append(ins.describe())
            for name in names:
                if by_engine[name]:
                    eng = engines[name]
                    proc_queue.append(0)
                    proc_core.append(c)
                    proc_own.append(eng_id[name] if eng.pipelines_own_results else -1)
                    proc_instr.extend(by_engine[name])
                    proc_off.append(len(proc_instr))
                    proc_engine.append((c, eng))
            for q, gs in by_queue.items():
                proc_queue.append(1)
                proc_core.append(c)
                proc_own.append(-1)
                proc_instr.extend(gs)
                proc_off.append(len(proc_instr))
                proc_engine.append((c, None))
            base += len(instrs)
        return self._finish(locals())

    def _finish(self, v: dict[str, Any]) -> list[CoreTimeline]:
        ffi, lib = _sched.ffi, _sched.lib
        cfg = self.config
        n = len(v["kind"])
        nproc = len(v["proc_queue"])
        keep: list[Any] = []  # buffers the C struct points into, alive until the run is over

        def buf(ctype: str, code: str, values: Sequence[int]) -> Any:
            a = array(code, values) if len(values) else array(code, [0])
            keep.append(a)
            return ffi.from_buffer(ctype + "[]", a)

        r = ffi.new("sched_run_t *")
        r.n = n
        r.kind = buf("int8_t", "b", v["kind"])
        r.busy = buf("int64_t", "q", v["busy"])
        r.lat = buf("int64_t", "q", v["lat"])
        r.ls = buf("int64_t", "q", v["ls"])
        r.owner = buf("int32_t", "i", v["owner_id"])
        r.dep_off = buf("int64_t", "q", v["dep_off"])
        r.deps = buf("int32_t", "i", v["deps"])
        r.first_off = buf("int64_t", "q", v["first_off"])
        r.first_deps = buf("int32_t", "i", v["first_flat"])
        r.has_first = buf("int8_t", "b", v["has_first"])
        r.plan = buf("int32_t", "i", v["plan_of"])
        r.nproc = nproc
        r.proc_queue = buf("int8_t", "b", v["proc_queue"])
        r.proc_core = buf("int32_t", "i", v["proc_core"])
        r.proc_own = buf("int32_t", "i", v["proc_own"])
        r.proc_off = buf("int64_t", "q", v["proc_off"])
        r.proc_instr = buf("int32_t", "i", v["proc_instr"])
        r.core_base = buf("int64_t", "q", v["core_base"])
        t = cfg.core.tensor
        tensor_eng = ENGINE_TYPES["Tensor"](cfg)  # the ramp's figures in ticks, as TensorEngine has them
        r.overlap_ls = 1 if t.overlap_load_stationary else 0
        r.drain_ticks = tensor_eng.drain_cycles * tensor_eng.tpc  # type: ignore[attr-defined]
        r.ramp_ticks = tensor_eng.ramp_ticks  # type: ignore[attr-defined]
        r.idle_reset_ticks = tensor_eng.idle_reset_ticks  # type: ignore[attr-defined]
        r.initial_util = float(t.throttle_initial_util)
        ncores = len(self.timelines)
        n_dma = cfg.core.dma.engines
        r.ncores = ncores
        r.dma_engines = n_dma
        d0 = self.timelines[0].dma if self.timelines else None
        r.start_latency = d0.start_latency if d0 else 0
        r.transfer_latency = d0.transfer_latency if d0 else 0
        r.core_stack = buf("int32_t", "i", self.stacks)
        r.plan_off = buf("int64_t", "q", v["plan_off"])
        r.plan_engine = buf("int32_t", "i", v["plan_engine"])
        r.plan_ticks = buf("int64_t", "q", v["plan_ticks"])
        r.plan_hbm = buf("int8_t", "b", v["plan_hbm"])
        r.plan_hbm_ticks = buf("int64_t", "q", v["plan_hbm_ticks"])
        engine_free = array("q", [0]) * max(nproc, 1)
        tensor_state = array("q", [0]) * max(6 * nproc, 1)
        dma_free = array("q", [0]) * max(ncores * n_dma, 1)
        pipe_free = array("q", [p.free for p in self.pipes]) if self.pipes else array("q", [0])
        ready = array("q", [0]) * max(n, 1)
        end = array("q", [0]) * max(n, 1)
        trigger = array("q", [0]) * max(n, 1)
        seg_index = array("i", [0]) * max(2 * n, 1)
        seg_kind = array("b", [0]) * max(2 * n, 1)
        seg_start = array("q", [0]) * max(2 * n, 1)
        seg_end = array("q", [0]) * max(2 * n, 1)
        for a in (engine_free, tensor_state, dma_free, pipe_free, ready, end, trigger, seg_index, seg_kind,
                  seg_start, seg_end):
            keep.append(a)
        r.engine_free = ffi.from_buffer("int64_t[]", engine_free)
        r.tensor_state = ffi.from_buffer("int64_t[]", tensor_state)
        r.dma_free = ffi.from_buffer("int64_t[]", dma_free)
        r.pipe_free = ffi.from_buffer("int64_t[]", pipe_free)
        r.ready = ffi.from_buffer("int64_t[]", ready)
        r.end = ffi.from_buffer("int64_t[]", end)
        r.trigger = ffi.from_buffer("int64_t[]", trigger)
        r.seg_index = ffi.from_buffer("int32_t[]", seg_index)
        r.seg_kind = ffi.from_buffer("int8_t[]", seg_kind)
        r.seg_start = ffi.from_buffer("int64_t[]", seg_start)
        r.seg_end = ffi.from_buffer("int64_t[]", seg_end)
        if lib.sched_run(r) != 0:
            raise MemoryError("simulate: the native event loop ran out of memory")
        nseg = r.nseg
        # ---- results back into the timelines --------------------------------------------------
        lanes, labels, owners = v["lanes"], v["labels"], v["owners"]
        ready_l = ready.tolist()
        end_l = end.tolist()
        trig_l = trigger.tolist()
        segs_all = list(zip(seg_index[:nseg].tolist(), seg_kind[:nseg].tolist(), seg_start[:nseg].tolist(),
                            seg_end[:nseg].tolist()))
        core_base = v["core_base"]
        bounds = core_base[1:] + [n]
        for c, tl in enumerate(self.timelines):
            b0, b1 = core_base[c], bounds[c]
            tl.ready = [None if x < 0 else x for x in ready_l[b0:b1]] if -1 in ready_l[b0:b1] else ready_l[b0:b1]
            tl.end = end_l[b0:b1]
            tl.trigger = [None if x < 0 else x for x in trig_l[b0:b1]]
            tl.owner = owners[b0:b1]
        if ncores == 1:
            tl = self.timelines[0] if self.timelines else None
            if tl is not None:
                tl.segments = [(lanes[g], labels[g], s, e, g) if k == _SEG_MAIN else
                               (LS_LANE, "LoadStationary", s, e, g) if k == _SEG_LS else
                               (owners[g], "DmaCopy", s, e, g) for g, k, s, e in segs_all]
        else:
            core_of: list[int] = []
            for c in range(ncores):
                core_of.extend([c] * (bounds[c] - core_base[c]))
            for g, k, s, e in segs_all:
                c = core_of[g]
                i = g - core_base[c]
                self.timelines[c].segments.append(
                    (lanes[g], labels[g], s, e, i) if k == _SEG_MAIN else
                    (LS_LANE, "LoadStationary", s, e, i) if k == _SEG_LS else (owners[g], "DmaCopy", s, e, i))
        # ---- the engines, DMA systems and HBM pipes left as the simpy run leaves them ------------
        for p, (c, eng) in enumerate(v["proc_engine"]):
            if eng is None:
                continue
            eng.free = engine_free[p]
            if eng.name == "Tensor" and v["tensor_used"][c]:
                ts = tensor_state[6 * p:6 * p + 6]
                eng.ls_free, eng.last_mm_start, eng.last_mm_ready, eng.last_mm_end = ts[0], ts[1], ts[2], ts[3]
                if ts[5]:
                    eng.ramp_start = ts[4]
        for c, tl in enumerate(self.timelines):
            if v["dma_used"][c]:
                tl.dma.engine_free = dma_free[c * n_dma:(c + 1) * n_dma].tolist()
                tl.dma._level = None
            tl.dma.hbm.bytes += v["hbm_bytes"][c]
            tl.dma.hbm.busy_ticks += v["hbm_ticks"][c]
        for s_, p_ in enumerate(self.pipes):
            p_.free = pipe_free[s_]
        return self.timelines


