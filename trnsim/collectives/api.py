"""The Python API of the collectives model (what the device model, torch.distributed and
timing-only runs call). Torch-free; times are integer ticks of the chip config's ``tick_hz``.

* :func:`simulate_collective` — one call on a group, from given start ticks: a
  :class:`~trnsim.collectives.report.CollectiveReport` with each rank's completion tick, the
  algorithm and why, steps and hops, bytes per link, the bounding resource, algbw/busbw, and the
  α-β estimate of the same call.
* :func:`simulate_collectives` — several calls at once on shared links, HBM and DMA engines
  (and CC cores: a rank runs at most ``cc_cores_per_core * lnc`` of them at a time).
* :func:`simulate_with_siblings` — a call beside the same call of its sibling groups (an SPMD
  program's other TP or DP groups, :func:`sibling_groups`), and the same call alone: what the
  distributed backend and the estimate charge, and the slowdown they report.
* :func:`estimate_collective` — the α-β estimate alone, without simulating.
* :func:`simulate_beside_kernels` — calls and kernels in one simpy environment, sharing the
  kernels' HBM stacks and DMA engines (a collective beside a DMA-bound kernel slows both).
* For a device model that owns its simpy environment: :class:`CollectiveRunner` with
  ``env=`` and ``chips=`` (:class:`ChipResources` of its kernel timelines); ``launch`` returns a
  handle whose ``rank_done[r]`` event fires when rank r is done.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import simpy

from ..memory.bandwidth import BandwidthPipe
from ..config import SystemConfig, load_system
from ..builder.kernel import Kernel
from ..memory.hbm import stack_bandwidth, stack_of_core
from .analytic import estimate_resolved
from .runner import CollectiveCall, CollectiveRunner, resolve_call
from .network import ChipResources
from .report import AlphaBetaEstimate, CollectiveReport

__all__ = ["simulate_collective", "simulate_collectives", "estimate_collective", "simulate_beside_kernels",
           "sibling_groups", "simulate_with_siblings"]


def sibling_groups(group: Sequence[int], world: int) -> list[tuple[int, ...]]:
    """The groups that make the same call as ``group`` at the same time in an SPMD program: its
    translates by whole rank offsets that stay inside ``world`` ranks and overlap neither it nor
    each other, ``group`` first (a device mesh's other tensor-parallel groups for a TP group
    ``[0..7]`` of 64 ranks: ``[8..15]``, ...; for a data-parallel group ``[0, 8, ..., 56]``:
    ``[1, 9, ..., 57]``, ...). The set is the same from any of its groups (``[1, 9, ..., 57]``
    finds ``[0, 8, ..., 56]`` too): the translates of the group moved to rank 0, taken in order.
    A group no translate of which fits is alone."""
    g = tuple(int(r) for r in group)
    if not g:
        return []

    def tile(first: tuple[int, ...]) -> list[tuple[int, ...]]:
        taken = set(first)
        out = [first]
        for shift in range(1, world):
            cand = tuple(r + shift for r in first)
            if max(cand) >= world:
                break
            if taken.isdisjoint(cand):
                out.append(cand)
                taken.update(cand)
        return out

    base = min(g)
    tiles = tile(tuple(r - base for r in g))
    if g not in tiles:  # an irregular group: its own forward translates
        tiles = tile(g)
        return tiles
    return [g] + [t for t in tiles if t != g and set(t).isdisjoint(g)]


#: a call already running when another starts (simulate_with_siblings' ``beside``): collective,
#: bytes, group, dtype, root, and how many ticks before the other it started
Beside = tuple[str, int, Sequence[int], str, "int | None", int]


def simulate_with_siblings(system: SystemConfig | str, collective: str, nbytes: int, group: Sequence[int],
                           world: int, *, dtype: str = "bf16", root: int | None = None, overrides: Any = None,
                           trace: bool = False, beside: Sequence[Beside] = ()
                           ) -> tuple[CollectiveReport, CollectiveReport]:
    """``collective`` on ``group`` beside the same call on each of its :func:`sibling_groups` in
    ``world`` ranks, all from tick 0 (an SPMD step: every TP group all-reduces at once, every DP
    group reduce-scatters at once), sharing links, HBM stacks and DMA engines; and the same call
    alone. Returns (together, alone): the group's report in each (the same report when it has no
    siblings). A ``root`` moves with its group.

    ``beside``: calls of another family already running on other CC streams of the ranks (a DP
    reduce-scatter a TP all-reduce starts beside, NxD's multistream FSDP), each with its own
    sibling groups, each started the given ticks before this call; all are simulated together
    (the CC streams of a rank hold rings of their own; they share links, HBM and the CC cores'
    count), and ``together`` is this call's report from its own start."""
    sysc = _system(system, overrides)
    g = tuple(int(r) for r in group)
    alone = simulate_collectives(sysc, [CollectiveCall(collective, nbytes, group=g, dtype=dtype, root=root)],
                                 trace=trace)[0]
    if beside:
        return _together(sysc, collective, nbytes, g, world, dtype, root, trace, beside), alone
    sibs = sibling_groups(g, world)
    if len(sibs) < 2:
        return alone, alone
    rpc = sysc.ranks_per_chip
    chips = [{r // rpc for r in s} for s in sibs]
    if all(len(c) == 1 for c in chips) and len(set().union(*chips)) == len(sibs):
        return alone, alone  # each group on a chip of its own: nothing shared (no link, stack or engine)
    sibs = _sharing(sibs, sysc.instance_chips * rpc)
    if len(sibs) < 2:
        return alone, alone
    calls = []
    for s in sibs:
        r = None if root is None else s[g.index(root)]
        calls.append(CollectiveCall(collective, nbytes, group=s, dtype=dtype, root=r))
    together = simulate_collectives(sysc, calls, trace=trace)[0]
    return together, alone


def _sharing(groups: list[tuple[int, ...]], instance_ranks: int) -> list[tuple[int, ...]]:
    """The groups of ``groups`` that can change the first one's timing: those linked to it
    through groups sharing an instance. Every resource a call books belongs to a chip its
    transfers start, end or pass on, and routes stay in the instances of their two ends (inside
    an instance on its links; between two, through the switch ports of those two), so a group
    whose instances no linked group touches shares nothing with them: its simulation runs beside
    theirs without one tick of either changing."""
    insts = [{r // instance_ranks for r in g} for g in groups]
    linked, seen, grew = [0], set(insts[0]), True
    while grew:
        grew = False
        for i, ins in enumerate(insts):
            if i not in linked and not seen.isdisjoint(ins):
                linked.append(i)
                seen |= ins
                grew = True
    return [groups[i] for i in sorted(linked)]


def _together(sysc: SystemConfig, collective: str, nbytes: int, g: tuple[int, ...], world: int, dtype: str,
              root: int | None, trace: bool, beside: Sequence[Beside]) -> CollectiveReport:
    """``collective`` on ``g`` and its siblings beside the ``beside`` calls and theirs (see
    :func:`simulate_with_siblings`): the report of ``g``'s call."""
    first = max(int(b[5]) for b in beside)
    if any(int(b[5]) < 0 for b in beside):
        raise ValueError("a call beside this one started a whole number of ticks >= 0 before it")

    def family(coll: str, nb: int, grp: Sequence[int], dt: str, rt: int | None, start: int) -> list[CollectiveCall]:
        base = tuple(int(r) for r in grp)
        out = []
        for s in sibling_groups(base, world):
            r = None if rt is None else s[base.index(rt)]
            out.append(CollectiveCall(coll, nb, group=s, dtype=dt, root=r, start=start))
        return out

    calls = family(collective, nbytes, g, dtype, root, first)
    for coll, nb, grp, dt, rt, since in beside:
        calls += family(coll, nb, grp, dt, rt, first - int(since))
    return simulate_collectives(sysc, calls, trace=trace)[0]


def _system(system: SystemConfig | str, overrides: Any = None) -> SystemConfig:
    return load_system(system, overrides)


def simulate_collective(system: SystemConfig | str, collective: str, nbytes: int, *, ranks: int | None = None,
                        group: Sequence[int] | None = None, dtype: str = "bf16", algorithm: str | None = None,
                        start: int | Sequence[int] = 0, root: int | None = None,
                        pairs: Sequence[tuple[int, int]] | None = None, overrides: Any = None,
                        trace: bool = False, counts: Sequence[Sequence[int]] | None = None,
                        instances: int | None = None, symmetry: bool = True, streams: int = 1) -> CollectiveReport:
    """Simulate one collective (see :class:`CollectiveCall` for the arguments; ``nbytes`` is
    nccl-tests' S, ``start`` in ticks) and return its report (``symmetry``: see
    :func:`simulate_collectives`)."""
    call = CollectiveCall(collective, nbytes, ranks, group, dtype, algorithm, start, root, pairs, "", counts, instances,
                          streams)
    return simulate_collectives(_system(system, overrides), [call], trace=trace, symmetry=symmetry)[0]


def simulate_collectives(system: SystemConfig | str, calls: Sequence[CollectiveCall], *,
                         trace: bool = False, symmetry: bool = True) -> list[CollectiveReport]:
    """Simulate ``calls`` together in one environment; one report per call, in order. Without a
    trace, alike ranks run once (``symmetry``, symmetry.py: a lone call's, or sibling calls' on
    disjoint groups; the same reports, tick for tick, as the full run ``symmetry=False`` makes)."""
    runner = CollectiveRunner(_system(system), trace=trace, symmetric=symmetry)
    for c in calls:
        runner.launch(c)
    return runner.run()


def estimate_collective(system: SystemConfig | str, collective: str, nbytes: int, *, ranks: int | None = None,
                        group: Sequence[int] | None = None, dtype: str = "bf16", algorithm: str | None = None,
                        root: int | None = None, pairs: Sequence[tuple[int, int]] | None = None,
                        overrides: Any = None, counts: Sequence[Sequence[int]] | None = None,
                        instances: int | None = None) -> AlphaBetaEstimate:
    """The α-β estimate of the call :func:`simulate_collective` would simulate (same checks,
    same algorithm choice)."""
    sysc = _system(system, overrides)
    res = resolve_call(sysc, CollectiveCall(collective, nbytes, ranks, group, dtype, algorithm, 0, root, pairs, "",
                                            counts, instances))
    return estimate_resolved(sysc, res)


def simulate_beside_kernels(system: SystemConfig | str, calls: Sequence[CollectiveCall],
                            kernels: Mapping[int, Sequence[Kernel | None]], *, trace: bool = False
                            ) -> tuple[list[CollectiveReport], dict[int, list[Any]]]:
    """Run ``calls`` and kernels in one simpy environment: ``kernels[chip][core]`` runs on that
    physical core of that chip (None: idle) from tick 0, sharing the core's DMA engines and its
    HBM stack with the collectives' traffic. Returns the reports and, per chip, the cores'
    :class:`~trnsim.sim.CoreTimeline`\\ s (``trnsim.report.build_report`` makes their reports)."""
    from ..sim import CoreTimeline

    sysc = _system(system)
    cfg = sysc.chip
    env = simpy.Environment()
    chips: dict[int, ChipResources] = {}
    timelines: dict[int, list[Any]] = {}
    for chip, ks in kernels.items():
        if not 0 <= chip < sysc.chips:
            raise ValueError(f"chip {chip} is not in {sysc.name} (chips 0..{sysc.chips - 1})")
        if len(ks) > cfg.chip.cores:
            raise ValueError(f"{len(ks)} kernels for a chip with {cfg.chip.cores} cores")
        pipes = [BandwidthPipe(stack_bandwidth(cfg), cfg.tick_hz, f"chip {chip} HBM stack {s}")
                 for s in range(cfg.chip.hbm.stacks)]
        full = list(ks) + [None] * (cfg.chip.cores - len(ks))
        tls = [CoreTimeline(env, cfg, k if k is not None else Kernel("idle", cfg), pipes[stack_of_core(cfg, c)], c)
               for c, k in enumerate(full)]
        timelines[chip] = tls
        chips[chip] = ChipResources.from_timelines(tls, pipes)
    runner = CollectiveRunner(sysc, env, chips, trace)
    for c in calls:
        runner.launch(c)
    reports = runner.run()
    for tls in timelines.values():
        for t in tls:
            t.check_complete()
    return reports, timelines
