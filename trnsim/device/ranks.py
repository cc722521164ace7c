"""A run across ranks: the per-rank :class:`~trnsim.report.RunReport`\\ s of one program merged
into one report, and their Perfetto trace. Data only (the CLI renders); torch-free.

Each rank is logical NeuronCore ``rank`` of a system. Its report comes from its own process's
device model, where collectives ran on the core's collective stream
(:data:`trnsim.device.COLLECTIVE_STREAM`), so per rank:

* ``compute_us`` is the union of its compute streams' kernels, ``collective_us`` the union of
  its collectives (from the group's start to this rank's completion, DMA sharing included);
* ``exposed_us`` is the collective time during which the rank's compute was *stalled*: no
  kernel running, and one already issued but held back (by a ``Work.wait()``, an event, the
  end of the backward pass): what the collectives added to the run; ``overlapped_us`` the rest,
  hidden behind compute or behind the host still issuing; ``beside_compute_us`` the part with
  a compute kernel running at the same time;
* ``peer_wait_us`` is the time its collectives waited for the last rank of their group;
* ``step_ticks`` are the ticks its optimizer steps ended at (all work issued so far finished).

The merged report's rows sum every rank's rows (calls, time, bytes); its ``cores`` are the
ranks. The step time is the one the slowest rank saw: per step, the longest interval from the
previous step's end on any rank, averaged over the steps after the first (the first includes
setup).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..config.files import AtomicOutput
from ..sim.report import CollectiveStats, CoreStats, OpRow, RunReport, TraceEvent, busiest, union_length

__all__ = ["RankSummary", "MultiRankReport", "merge_ranks", "summarize", "link_segments", "rank_trace_events",
           "write_rank_trace"]

COLLECTIVE_STREAM = -1  # trnsim.device.COLLECTIVE_STREAM (imported lazily there: the device pulls in the chip)


@dataclass(frozen=True)
class RankSummary:
    """One rank's figures over its report (microseconds of simulated time)."""

    rank: int
    chip: int
    elapsed_us: float
    compute_us: float
    collective_us: float
    exposed_us: float
    overlapped_us: float
    beside_compute_us: float
    peer_wait_us: float
    collectives: int  # calls
    launches: int
    step_ends_us: tuple[float, ...]


@dataclass(frozen=True)
class MultiRankReport:
    """A program's run on ``world`` ranks of ``system``: ``total`` merges the ranks' reports,
    ``ranks`` keeps each, ``summaries`` the per-rank figures; ``step_times_us`` per step as the
    slowest rank saw it and ``step_us`` their mean after the first step (0 without steps)."""

    system: str
    config: str
    world: int
    total: RunReport
    ranks: dict[int, RunReport]
    summaries: dict[int, RankSummary]
    step_times_us: tuple[float, ...] = ()
    step_us: float = 0.0

    @property
    def collective_us(self) -> float:
        return sum(s.collective_us for s in self.summaries.values())

    @property
    def overlapped_us(self) -> float:
        return sum(s.overlapped_us for s in self.summaries.values())

    def to_dict(self) -> dict[str, Any]:
        return {"system": self.system, "config": self.config, "world": self.world, "step_us": self.step_us,
                "step_times_us": list(self.step_times_us), "total": self.total.to_dict(),
                "ranks": {str(r): {**rep.to_dict(), "summary": asdict(self.summaries[r])}
                          for r, rep in sorted(self.ranks.items())}}


def _intervals(events: Iterable[TraceEvent], collective: bool) -> list[tuple[int, int]]:
    return [(e.start, e.end) for e in events if (e.stream <= COLLECTIVE_STREAM) == collective and e.end > e.start]


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of (union of a) ∩ (union of b), ticks."""
    return union_length(a) + union_length(b) - union_length(a + b)


def _merged(iv: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(iv):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(union of a) minus (union of b), as sorted disjoint intervals."""
    out: list[tuple[int, int]] = []
    b = _merged(b)
    j = 0
    for lo, hi in _merged(a):
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def _stalled(events: Sequence[TraceEvent]) -> list[tuple[int, int]]:
    """When compute was stalled: a kernel issued and not yet started, none running (a kernel
    held back by its own stream's previous one has that one running)."""
    waiting = [(e.issued, e.start) for e in events if e.stream > COLLECTIVE_STREAM and e.start > e.issued]
    return _minus(waiting, _intervals(events, False))


def summarize(rank: int, rep: RunReport, chip: int, step_ticks: Sequence[int]) -> RankSummary:
    """A rank's :class:`RankSummary` from its report (which must keep its events: the
    overlap is measured on them)."""
    hz = rep.tick_hz
    comp, coll = _intervals(rep.events, False), _intervals(rep.events, True)
    peer = sum(r.collective.peer_wait_us for r in rep.rows if r.collective is not None)
    calls = sum(r.calls for r in rep.rows if r.collective is not None)
    coll_us = union_length(coll) / hz * 1e6
    exposed = _intersection(coll, _stalled(rep.events)) / hz * 1e6
    return RankSummary(rank=rank, chip=chip, elapsed_us=rep.elapsed_us, compute_us=union_length(comp) / hz * 1e6,
                       collective_us=coll_us, exposed_us=exposed, overlapped_us=coll_us - exposed,
                       beside_compute_us=_intersection(comp, coll) / hz * 1e6,
                       peer_wait_us=peer, collectives=calls, launches=rep.launches,
                       step_ends_us=tuple(t / hz * 1e6 for t in step_ticks))


def _merge_rows(reports: Sequence[RunReport]) -> tuple[OpRow, ...]:
    acc: dict[tuple[str, str], list[OpRow]] = {}
    for rep in reports:
        for r in rep.rows:
            acc.setdefault((r.op, r.kernel), []).append(r)
    total = sum(r.time_us for rows in acc.values() for r in rows)
    out = []
    for (op, kernel), rows in acc.items():
        t = sum(r.time_us for r in rows)
        wait = sum(r.host_wait_us for r in rows)

        def weighted(get: Any) -> float:
            return sum(get(r) * r.time_us for r in rows) / t if t else 0.0
        engines = {n: weighted(lambda r, n=n: r.engine_percent.get(n, 0.0))
                   for n in sorted({n for r in rows for n in r.engine_percent})}
        coll = None
        cs = [r.collective for r in rows if r.collective is not None]
        if cs:
            net = sum(c.network_us for c in cs)
            coll = CollectiveStats(collective=cs[0].collective, algorithm=cs[0].algorithm, ranks=cs[0].ranks,
                                   bytes=sum(c.bytes for c in cs), network_us=net,
                                   peer_wait_us=sum(c.peer_wait_us for c in cs),
                                   busbw=sum(c.busbw * c.network_us for c in cs) / net if net else 0.0,
                                   alone_us=sum(c.alone_us or c.network_us for c in cs))
            bound = max(rows, key=lambda r: r.time_us).bound
        else:
            bound = "launch" if wait >= t else busiest(engines)
        out.append(OpRow(op=op, kernel=kernel, generic=rows[0].generic, calls=sum(r.calls for r in rows), time_us=t,
                         share_percent=100.0 * t / total if total else 0.0, host_wait_us=wait, engine_percent=engines,
                         hbm_bytes=sum(r.hbm_bytes for r in rows), matmul_flops=sum(r.matmul_flops for r in rows),
                         mfu_percent=weighted(lambda r: r.mfu_percent), bound=bound, fused_ops=rows[0].fused_ops,
                         eager_launches=sum(r.eager_launches for r in rows),
                         eager_hbm_bytes=sum(r.eager_hbm_bytes for r in rows),
                         eager_time_us=sum(r.eager_time_us for r in rows), collective=coll))
    out.sort(key=lambda r: (-r.time_us, r.op, r.kernel))
    return tuple(out)


def merge_ranks(system: str, reports: Mapping[int, RunReport], chips: Mapping[int, int],
                steps: Mapping[int, Sequence[int]]) -> MultiRankReport:
    """Merge each rank's report (``reports[rank]``, with its events) into one: ``chips[rank]``
    is the rank's chip, ``steps[rank]`` its optimizer steps' end ticks."""
    ranks = dict(sorted(reports.items()))
    reps = list(ranks.values())
    if not reps:
        raise ValueError("merge_ranks: no rank reports")
    hz = reps[0].tick_hz
    summaries = {r: summarize(r, rep, chips.get(r, 0), steps.get(r, ())) for r, rep in ranks.items()}
    cores = {}
    for r, rep in ranks.items():
        cs = list(rep.cores.values())
        cores[r] = CoreStats(elapsed_us=max((c.elapsed_us for c in cs), default=0.0),
                             busy_us=sum(c.busy_us for c in cs), host_wait_us=sum(c.host_wait_us for c in cs),
                             launches=sum(c.launches for c in cs), device_us=sum(c.device_us for c in cs))
    elapsed = max(rep.elapsed_us for rep in reps)
    flops = sum(rep.matmul_flops for rep in reps)
    mfu = sum(rep.mfu_percent * rep.elapsed_us * max(1, len(rep.cores)) for rep in reps) / \
        (elapsed * sum(max(1, len(rep.cores)) for rep in reps)) if elapsed else 0.0
    events = tuple(replace(e, core=r) for r, rep in ranks.items() for e in rep.events)
    total = RunReport(config=reps[0].config, rows=_merge_rows(reps),
                      host_ops={op: sum(rep.host_ops.get(op, 0) for rep in reps)
                                for op in sorted({op for rep in reps for op in rep.host_ops})},
                      cores=cores, elapsed_us=elapsed, device_us=sum(rep.device_us for rep in reps),
                      host_us=sum(rep.host_us for rep in reps), host_wait_us=sum(rep.host_wait_us for rep in reps),
                      launches=sum(rep.launches for rep in reps), hbm_bytes=sum(rep.hbm_bytes for rep in reps),
                      matmul_flops=flops, mfu_percent=mfu, events=events, tick_hz=hz,
                      dispatches=sum(rep.dispatches for rep in reps),
                      graph_launches=sum(rep.graph_launches for rep in reps),
                      compiled_graphs=sum(rep.compiled_graphs for rep in reps),
                      compile_seconds=sum(rep.compile_seconds for rep in reps),
                      contention_us=sum(rep.contention_us for rep in reps))
    counts = {len(s) for s in steps.values()} if steps else set()
    step_times: tuple[float, ...] = ()
    step_us = 0.0
    if counts and min(counts) > 0:
        n = min(counts)
        per = []
        for k in range(n):
            per.append(max((steps[r][k] - (steps[r][k - 1] if k else 0)) / hz * 1e6 for r in steps))
        step_times = tuple(per)
        later = per[1:] or per
        step_us = sum(later) / len(later)
    return MultiRankReport(system=system, config=reps[0].config, world=len(ranks), total=total, ranks=ranks,
                           summaries=summaries, step_times_us=step_times, step_us=step_us)


def link_segments(rank: int, placed: Iterable[tuple[str, int, Any]], ranks_per_chip: int
                  ) -> list[tuple[str, str, int, int]]:
    """The NeuronLink lanes a rank shows in its trace, from the collectives it placed
    (``(op, start tick, CollectiveReport simulated from tick 0 with its timeline)``): its own CC
    DMA transfers, and the links leaving its chip when it is the group's lowest rank there (so
    each link of a call shows once). Ticks are absolute (shifted by each call's start)."""
    from ..collectives.trace import chip_of_lane

    chip = rank // ranks_per_chip
    out = []
    for op, start, crep in placed:
        shows_links = min(g for g in crep.group if g // ranks_per_chip == chip) == rank
        for lane, label, a, b in crep.timeline:
            if lane.startswith(f"rank {rank} ") or (shows_links and lane.startswith("link ")
                                                     and chip_of_lane(lane, ranks_per_chip) == chip):
                out.append((lane, f"{op}: {label}", start + a, start + b))
    return out


# ---------------------------------------------------------------------------------------------
# the trace: one Perfetto process per rank
# ---------------------------------------------------------------------------------------------


def _lane_name(stream: int) -> str:
    if stream == COLLECTIVE_STREAM:
        return "collectives (CC cores)"
    if stream < COLLECTIVE_STREAM:
        return f"collectives (CC stream {COLLECTIVE_STREAM - stream})"
    return "default stream" if stream == 0 else f"stream {stream}"


def rank_trace_events(rep: MultiRankReport, links: Mapping[int, Sequence[tuple[str, str, int, int]]] = {}
                      ) -> list[dict[str, Any]]:
    """Chrome trace events: pid = rank (named with its chip), one thread per stream (the
    collective stream as "collectives (CC cores)"), a host lane of each launch's dispatch, and
    ``links[rank]``: NeuronLink lanes as (lane, label, start, end) ticks (the rank's CC DMA
    transfers and the links leaving its chip that its collectives drove)."""
    hz = rep.total.tick_hz
    to_us = 1e6 / hz
    meta: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for r, s in sorted(rep.summaries.items()):
        meta.append({"ph": "M", "name": "process_name", "pid": r,
                     "args": {"name": f"rank {r} (NeuronCore {r}, chip {s.chip}, {rep.config}, simulated)"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
    host_tid = -1000
    tids: dict[tuple[int, str], int] = {}

    def tid(r: int, name: str, order: int) -> int:
        key = (r, name)
        if key not in tids:
            tids[key] = order
            meta.append({"ph": "M", "name": "thread_name", "pid": r, "tid": order, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": order,
                         "args": {"sort_index": order if order >= 0 else 10_000 - order}})
        return tids[key]

    by_rank: dict[int, list[TraceEvent]] = {}
    for e in rep.total.events:
        by_rank.setdefault(e.core, []).append(e)
    for r, evs in sorted(by_rank.items()):
        prev = None
        for e in evs:
            t = tid(r, _lane_name(e.stream), 10_000 - e.stream - 1 if e.stream <= COLLECTIVE_STREAM else e.stream)
            if prev is not None and e.issued > prev:
                out.append({"ph": "X", "name": e.op, "cat": "dispatch", "pid": r, "tid": tid(r, "host", host_tid),
                            "ts": prev * to_us, "dur": (e.issued - prev) * to_us})
            prev = e.issued
            out.append({"ph": "X", "name": e.op, "cat": "collective" if e.stream <= COLLECTIVE_STREAM else e.kernel,
                        "pid": r, "tid": t, "ts": e.start * to_us, "dur": (e.end - e.start) * to_us,
                        "args": {"kernel": e.kernel, "issued_us": e.issued * to_us}})
    for r, segs in sorted(links.items()):
        names = sorted({lane for lane, _, _, _ in segs})
        for k, lane in enumerate(names):
            # "rank 4 CC0": the rank's CC DMA queue; "link chip 0 -> chip 1 (x+)": a link direction
            shown = f"{lane.split(' ', 2)[2]} DMA" if lane.startswith("rank ") else lane.removeprefix("link ")
            t = tid(r, f"NeuronLink {shown}", 20_000 + k)
            for ln, label, a, b in segs:
                if ln == lane:
                    out.append({"ph": "X", "name": label, "cat": "link" if lane.startswith("link") else "cc",
                                "pid": r, "tid": t, "ts": a * to_us, "dur": (b - a) * to_us})
    return meta + out


def write_rank_trace(path: str | os.PathLike[str] | AtomicOutput, rep: MultiRankReport,
                     links: Mapping[int, Sequence[tuple[str, str, int, int]]] = {}) -> Path:
    """Write :func:`rank_trace_events` to ``path`` atomically (never half a trace, never over a
    FIFO or device); ``path`` may be an output reserved before the run."""
    doc = {"traceEvents": rank_trace_events(rep, links), "displayTimeUnit": "ns",
           "otherData": {"generator": "trnsim", "system": rep.system, "world": rep.world}}
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "--trace")
    return out.commit(lambda f: json.dump(doc, f, separators=(",", ":")))
