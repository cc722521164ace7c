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
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import simpy

from . import cores as _cores  # noqa: F401  (registers the engine modules)
from .config import ChipConfig
from .cores.base import ENGINE_TYPES, Engine, Segment
from .isa import DmaCopy, Instruction
from .kernel import Kernel, gc_paused
from .memory.dma import BandwidthPipe, DmaSystem
from .memory.hbm import stack_bandwidth, stack_of_core

__all__ = ["CoreTimeline", "simulate"]


class CoreTimeline:
    """The timing simulation of one kernel on one NeuronCore."""

    def __init__(self, env: simpy.Environment, config: ChipConfig, kernel: Kernel, hbm_pipe: BandwidthPipe,
                 core: int = 0):
        self.env = env
        self.config = config
        self.kernel = kernel
        self.core = core
        n = len(kernel.instructions)
        self.ready: list[int | None] = [None] * n   # results visible to dependents
        self.end: list[int] = [0] * n                # engine done (for pipelined own results)
        self.trigger: list[int | None] = [None] * n  # DMA trigger done
        self.owner: list[str] = [""] * n
        self._waiters: dict[int, simpy.Event] = {}
        self._trigger_waiters: dict[int, simpy.Event] = {}
        self.segments: list[Segment] = []
        self.engines: dict[str, Engine] = {name: cls(config) for name, cls in ENGINE_TYPES.items()}
        self.dma = DmaSystem(config, hbm_pipe)
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


def simulate(config: ChipConfig, kernels: Sequence[Kernel]) -> list[CoreTimeline]:
    """Run the timing model of ``kernels[c]`` on core ``c`` of one chip; return the timelines."""
    if len(kernels) > config.chip.cores:
        raise ValueError(f"{len(kernels)} kernels for a chip with {config.chip.cores} cores")
    env = simpy.Environment()
    n_stacks = config.chip.hbm.stacks
    pipes = [BandwidthPipe(stack_bandwidth(config), config.tick_hz) for _ in range(n_stacks)]
    with gc_paused():
        cores = [CoreTimeline(env, config, k, pipes[stack_of_core(config, c)], c) for c, k in enumerate(kernels)]
        env.run()
    for c in cores:
        c.check_complete()
    return cores
