"""Running collective calls: a call becomes a schedule, the schedule runs on the network.

:class:`CollectiveRunner` owns a :class:`~trnsim.collectives.network.Network` in a simpy
environment (its own, or one a device model shares with kernel timelines). ``launch`` resolves a
:class:`CollectiveCall` (names, group, sizes, the algorithm and why), builds its schedule and
starts its processes; each rank gets an event that fires when its part is done, so a device
model can continue that rank's stream from there. ``report`` gives the
:class:`~trnsim.collectives.report.CollectiveReport` once the environment has run.

A rank takes part from its start tick and once it holds one of its CC cores
(``collectives.cc_cores_per_core`` per physical core: 4 per logical core at LNC=2, datasheet
§9); a fifth concurrent collective on a rank waits for one to finish. It keeps the CC core until
its last transfer of the call is complete. The runtime's costs (:mod:`~trnsim.collectives.runtime`)
are charged here: the launch before a rank's first transfer, and before each transfer its CC
core's issue (one at a time per core), the handshake and, over EFA, its proxy thread's turn. The
call's transfers on a rank hold the DMA rings of its CC stream (:meth:`Network.ring_set`), so
concurrent calls on different streams do not queue on each other's engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Mapping, Sequence

import simpy

from ..compat import renamed
from ..config import SystemConfig, load_system
from ..native.dtypes import get_dtype
from .algorithms import (ALGORITHMS, BUSBW_FACTORS, CollectiveError, Context, build, canonical_algorithm,
                         canonical_collective)
from ..memory.bandwidth import BandwidthPipe
from ..sim.report import union_length
from .network import ChipResources, Network
from .report import CollectiveReport
from .schedule import Schedule, Transfer

__all__ = ["CollectiveCall", "CollectiveRunner", "CollectiveHandle", "resolve_call", "parse_sizes"]


@dataclass(frozen=True)
class CollectiveCall:
    """One collective on a group of ranks.

    ``nbytes`` is nccl-tests' S (see :mod:`trnsim.collectives.report`). ``group`` lists global
    ranks (logical NeuronCores; default ``range(ranks)``, and ``ranks`` defaults to the whole
    system). ``start`` is when each rank reaches the call, in ticks of the chip config's
    ``tick_hz``: one value for all, or one per rank of ``group``. ``root`` is broadcast's source
    and reduce's destination (default the first rank); ``pairs`` the (source, destination) ranks
    of a permute (default: each rank to the next in ring order, as nccom-test's permute ring;
    a rank paired with itself copies locally). ``counts[i][j]`` is the bytes an uneven
    all-to-all (all-to-all-v) sends from the group's i-th rank to its j-th; ``nbytes`` is then
    the largest rank's send total. ``instances`` spreads ``ranks`` over that many instances, as
    nccom-test's ``-N`` (default: every instance of the system when the ranks divide over
    them); a ``group`` places itself. ``streams`` is how many CC streams the program runs
    collectives on at once (nccom-test ``--streams-json``'s entries; NxD's TP and FSDP streams):
    a system without ``collectives.multistream_mesh`` then runs it as a ring (select.py).
    """

    collective: str
    nbytes: int
    ranks: int | None = None
    group: Sequence[int] | None = None
    dtype: str = "bf16"
    algorithm: str | None = None
    start: int | Sequence[int] = 0
    root: int | None = None
    pairs: Sequence[tuple[int, int]] | None = None
    label: str = ""
    counts: Sequence[Sequence[int]] | None = None
    instances: int | None = None
    streams: int = 1


@dataclass
class _Resolved:
    ctx: Context
    algorithm: str
    reason: str
    starts: tuple[int, ...]
    dtype: str


#: 8-byte words a collective moves and adds as such (int64 indices, fp64 sums); the chip's
#: datapath has no 8-byte dtype, but its DMA moves any bytes: name -> (short name, bytes)
WIDE = {"int64": ("int64", 8), "i64": ("int64", 8), "s64": ("int64", 8), "long": ("int64", 8),
        "uint64": ("uint64", 8), "u64": ("uint64", 8),
        "fp64": ("fp64", 8), "float64": ("fp64", 8), "f64": ("fp64", 8), "double": ("fp64", 8)}


def element(collective: str, dtype: str) -> tuple[str, int]:
    """(short name, bytes) of a collective's element type: a chip dtype or an 8-byte word."""
    wide = WIDE.get(str(dtype).strip().lower())
    if wide is not None:
        return wide
    try:
        dt = get_dtype(dtype)
    except ValueError as e:
        raise CollectiveError(f"{collective}: {e}; or an 8-byte word: int64, uint64, fp64") from None
    return dt.short, dt.itemsize


def resolve_call(system: SystemConfig, call: CollectiveCall, topo: Any = None) -> _Resolved:
    """Check a call and pick its algorithm; every problem is a one-line CollectiveError."""
    from .select import choose
    from .topology import Topology

    topo = topo or Topology(system)
    coll = canonical_collective(call.collective)
    if call.group is not None:
        group = tuple(int(r) for r in call.group)
        if not group:
            raise CollectiveError(f"{coll}: the group is empty; give at least one rank")
        bad = [r for r in group if not 0 <= r < system.ranks]
        if bad:
            raise CollectiveError(f"{coll}: rank {bad[0]} is not in {system.name}, whose ranks are 0..{system.ranks - 1}")
        if len(set(group)) != len(group):
            dup = next(r for r in group if group.count(r) > 1)
            raise CollectiveError(f"{coll}: rank {dup} appears twice in the group")
        if call.ranks is not None and call.ranks != len(group):
            raise CollectiveError(f"{coll}: ranks={call.ranks} but the group has {len(group)} ranks")
        if call.instances is not None:
            raise CollectiveError(f"{coll}: give instances= with ranks=, not with a group (a group places itself)")
    else:
        n = system.ranks if call.ranks is None else call.ranks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or system.ranks % n:
            divs = [d for d in range(1, system.ranks + 1) if system.ranks % d == 0]
            raise CollectiveError(
                f"{coll}: {n!r} ranks does not divide {system.name}'s {system.ranks} ranks ({system.chips} chips x "
                f"{system.ranks_per_chip} logical cores); expected one of {', '.join(map(str, divs))}")
        k = call.instances if call.instances is not None else topo.default_instances(n)
        ok = [d for d in range(1, topo.instances + 1) if n % d == 0 and n // d <= topo.instance_ranks]
        if isinstance(k, bool) or not isinstance(k, int) or k not in ok:
            raise CollectiveError(
                f"{coll}: {n} ranks cannot spread evenly over {k!r} instance(s) of {system.name} ({topo.instances} "
                f"instance(s) of {topo.instance_ranks} ranks); expected one of {', '.join(map(str, ok))}")
        group = topo.place(n, k)
    short, isz = element(coll, call.dtype)
    nbytes = call.nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise CollectiveError(f"{coll}: bytes must be a whole number >= 0, got {nbytes!r}")
    if nbytes % isz:
        raise CollectiveError(f"{coll}: {nbytes} bytes is not a whole number of {short} elements "
                              f"({isz} bytes each)")
    p = len(group)
    if coll in ("all-gather", "reduce-scatter", "all-to-all") and nbytes and call.counts is None:
        # nccl-tests' count is per rank: S is a whole number of count * nranks elements
        nbytes = max(1, nbytes // (isz * p)) * isz * p
    order = tuple(topo.ring_order(group))
    root = group[0] if call.root is None else int(call.root)
    if root not in group:
        raise CollectiveError(f"{coll}: root {root} is not in the group")
    if call.pairs is not None:
        pairs = tuple((int(a), int(b)) for a, b in call.pairs)
        for a, b in pairs:
            if a not in group or b not in group:
                raise CollectiveError(f"{coll}: pair ({a}, {b}) must name ranks of the group")
        if len({a for a, _ in pairs}) != len(pairs):
            a = next(a for a, _ in pairs if sum(1 for x, _ in pairs if x == a) > 1)
            raise CollectiveError(f"{coll}: rank {a} is the source of two pairs; a rank sends once")
    else:
        pairs = tuple((order[i], order[(i + 1) % p]) for i in range(p)) if p > 1 else ()
    counts: tuple[tuple[int, ...], ...] = ()
    if call.counts is not None:
        if coll != "all-to-all":
            raise CollectiveError(f"{coll}: counts are for an uneven all-to-all; this is {coll}")
        try:
            counts = tuple(tuple(int(x) for x in row) for row in call.counts)
        except (TypeError, ValueError):
            raise CollectiveError(f"{coll}: counts must be {p} rows of {p} whole numbers of bytes") from None
        if len(counts) != p or any(len(row) != p for row in counts):
            raise CollectiveError(f"{coll}: counts must be {p} rows of {p} byte counts (one per rank of the group), "
                                  f"got {len(counts)} rows")
        if any(x < 0 or x % isz for row in counts for x in row):
            raise CollectiveError(f"{coll}: counts must be whole numbers of {short} elements ({isz} bytes each) >= 0")
        top = max(sum(row) for row in counts)
        if call.nbytes != top:
            raise CollectiveError(f"{coll}: bytes={call.nbytes} but the largest rank sends {top} bytes by its "
                                  f"counts; give bytes={top}")
        nbytes = top
    streams = call.streams
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise CollectiveError(f"{coll}: streams must be a whole number of CC streams >= 1, got {streams!r}")
    ctx = Context(system, topo, coll, group, nbytes, isz, root, pairs, order, topo.shape(group), counts=counts,
                  streams=streams)
    if call.algorithm is not None:
        algo = canonical_algorithm(call.algorithm, coll)
        reason = "forced"
    else:
        algo, reason = choose(ctx)
    why = ALGORITHMS[algo].check(ctx)
    if why is not None:
        raise CollectiveError(f"algorithm '{algo}' cannot run {coll} on {p} ranks of {system.name}: it needs {why}")
    if algo == "hierarchical":  # say what each tier runs
        from .algorithms.compose import hierarchical_plan

        tiers, algos = hierarchical_plan(ctx)
        names = ["intra-instance" if not any(topo.level_inter_instance(lv) for lv in t) else "inter-instance"
                 for t in tiers]
        reason += "; " + ", ".join(f"{n} {a}" for n, a in zip(names, algos))
    start = call.start
    starts = tuple(int(start) for _ in group) if isinstance(start, int) else tuple(int(s) for s in start)
    if len(starts) != p:
        raise CollectiveError(f"{coll}: {len(starts)} start times for {p} ranks; give one, or one per rank")
    if any(s < 0 for s in starts):
        raise CollectiveError(f"{coll}: start times must be >= 0 ticks")
    return _Resolved(ctx, algo, reason, starts, short)


class CollectiveHandle:
    """A launched call: ``done`` fires when every rank is done, ``rank_done[r]`` when rank r is."""

    def __init__(self, runner: "CollectiveRunner", call: CollectiveCall, res: _Resolved, sched: Schedule):
        self.runner = runner
        self.call = call
        self.res = res
        env = runner.env
        self.rank_done: dict[int, simpy.Event] = {r: env.event() for r in res.ctx.group}
        self.done = simpy.AllOf(env, list(self.rank_done.values())) if self.rank_done else env.event()
        self.set_schedule(sched)

    def set_schedule(self, sched: Schedule) -> None:
        """Take ``sched`` as the call's schedule (a symmetric runner builds it when it runs: in
        full, or on orbit representatives)."""
        res = self.res
        self.sched = sched
        ts = sched.transfers
        self.finish: list[int | None] = [None] * len(ts)
        self.data_start: list[int] = [0] * len(ts)
        self.end: dict[int, int] = {}  # rank -> tick its part completed
        self.begin: dict[int, int] = {}  # rank -> tick it started (holding a CC core)
        self.stream: dict[int, int] = {}  # rank -> which of its CC cores runs this call
        self.requests: dict[int, Any] = {}
        #: per resource (by id): (resource, intervals it held one of this call's chunks back)
        self.limits: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        self.pending = [len(t.deps) for t in ts]
        self.sym: Any = None  # the calls' Symmetry when only representatives run (symmetry.py)
        self.sym_call = 0  # which of the reduced calls this is (its transfers start at sym.offsets[sym_call])
        self.dependents: list[list[int]] = [[] for _ in ts]
        self.left: dict[int, int] = {r: 0 for r in res.ctx.group}  # rank -> transfers not done
        for i, t in enumerate(ts):
            for d in t.deps:
                self.dependents[d].append(i)
            for r in set(t.ranks()):
                self.left[r] += 1


def _last_finish(transfers: Any, finish: list[int | None], rank_rep: dict[int, int] | None) -> dict[int, int]:
    """The tick each rank's last transfer finished, after a run of a symmetric call on fewer
    transfers; with ``rank_rep``, keyed by each rank's representative (the ranks it stands for)."""
    last: dict[int, int] = {}
    for j, t in enumerate(transfers):
        if not t.is_node:
            f = finish[j]
            assert f is not None, "a run on representatives left a transfer unfinished"
            for r in t.ranks():
                if rank_rep is not None:
                    r = rank_rep[r]
                if f > last.get(r, -1):
                    last[r] = f
    return last


class CollectiveRunner:
    """Collectives on one system, in one simpy environment (see the module docstring)."""

    def __init__(self, system: SystemConfig | str, env: simpy.Environment | None = None,
                 chips: Mapping[int, ChipResources] | None = None, trace: bool = False, symmetric: bool = False):
        self.system = load_system(system) if not isinstance(system, SystemConfig) else system
        #: run a lone call's alike ranks once (symmetry.py): only for an engine that owns its
        #: environment and resources and runs that one call, without a trace
        self.symmetric = symmetric and env is None and not chips and not trace
        self._started = False
        self._qplans: dict[tuple[int, int], tuple[list[tuple[Any, ...]], Any, int]] = {}
        self.net = Network(self.system, env, chips, trace)
        self.env = self.net.env
        self.handles: list[CollectiveHandle] = []
        self._plans: dict[tuple[Any, ...], tuple[list[tuple[int, Any, float, float]], tuple[Any, ...], int]] = {}
        self._proxied: dict[tuple[Any, ...], bool] = {}  # plan key -> it crosses a proxy (EFA) tier
        #: (rank, CC stream) -> tick its CC core is free to issue the next transfer
        self._issue_free: dict[tuple[int, int], int] = {}
        #: network proxy thread -> tick it is free
        self._proxy_free: dict[int, int] = {}
        #: transfers whose dependencies completed this tick, started at its end (same-tick share)
        self._starting: list[tuple[CollectiveHandle, int]] = []
        self.net.on_tick_end = self._start_staged

    def launch(self, call: CollectiveCall) -> CollectiveHandle:
        res = resolve_call(self.system, call, self.net.topo)
        if self.symmetric:  # built and started by run(), once every call is known
            if self._started:
                raise RuntimeError("a symmetric runner takes its calls before it runs; launch others on a runner of "
                                   "their own")
            h = CollectiveHandle(self, call, res, Schedule(()))
            self.handles.append(h)
            return h
        sched = Schedule(res.ctx.group)
        build(sched, res.ctx, res.algorithm)
        h = CollectiveHandle(self, call, res, sched)
        self.handles.append(h)
        for r, i in sched.start.items():
            self.env.process(self._rank_start(h, r, i))
        return h

    def _start_symmetric(self) -> None:
        """Find the launched calls' symmetry (symmetry.py) and start the representative ranks
        only, or every rank when there is none."""
        from .symmetry import direct, find

        self._started = True
        if len(self.handles) == 1:  # a lone call: built on its representatives when that is shown
            h = self.handles[0]
            got = direct(self, h.res)
            if got is not None:
                sched, sym = got
                h.set_schedule(sched)
                h.sym = sym
                for r, i in sched.start.items():
                    self.env.process(self._rank_start(h, r, i))
                return
        for h in self.handles:
            sched = Schedule(h.res.ctx.group)
            build(sched, h.res.ctx, h.res.algorithm)
            h.set_schedule(sched)
        sym = find(self, self.handles)
        for k, h in enumerate(self.handles):
            if sym is not None:
                self._reduce(h, sym, k)
            for r, i in h.sched.start.items():
                if sym is None or sym.rank_rep[r] == r:
                    self.env.process(self._rank_start(h, r, i))

    def _reduce(self, h: CollectiveHandle, sym: Any, call: int) -> None:
        """Run only ``sym``'s representative transfers of call ``call`` (none when another call
        stands for it, ``sym.base``): each waits for its dependencies' representatives (the same ticks), and books resources' representatives with the
        multiplicity its orbit brings to each (symmetry.py)."""
        h.sym = sym
        h.sym_call = call
        off = sym.offsets[call]
        ts = h.sched.transfers
        rep = sym.rep
        h.dependents = [[] for _ in ts]
        for k in range(len(ts)):
            if rep[off + k] == off + k:
                for d in ts[k].deps:
                    h.dependents[rep[off + d] - off].append(k)

    def run(self) -> list[CollectiveReport]:
        """Run the environment to the end and report every launched call."""
        if self.symmetric and not self._started:
            self._start_symmetric()
        self.env.run()
        for h in self.handles:
            if h.sym is not None and not h.end:
                if h.sym.direct is not None:
                    self._finish_direct(h)
                else:
                    self._finish_reduced(h)
        return [self.report(h) for h in self.handles]

    # ---- processes -----------------------------------------------------------------------------
    def _rank_start(self, h: CollectiveHandle, rank: int, node: int) -> Generator[simpy.Event, Any, None]:
        env = self.env
        t0 = h.res.starts[h.res.ctx.group.index(rank)]
        if t0 > env.now:
            yield env.timeout(t0 - env.now)
        rr = self.net.rank(rank)
        req = rr.cc.request()
        yield req
        used = set(rr.streams.values())
        h.stream[rank] = next(i for i in range(rr.cc.capacity) if i not in used)
        rr.streams[id(h)] = h.stream[rank]
        h.requests[rank] = req
        h.begin[rank] = int(env.now)
        launch = self.net.runtime.launch
        if launch:  # the trigger reaching the CC core and its program starting
            yield env.timeout(launch)
        self._complete(h, node, int(env.now))
        if h.left[rank] == 0 and h.sym is None:
            self._rank_finished(h, rank, int(env.now))

    def plan_of(self, t: Transfer) -> tuple[list[tuple[int, Any, float, float]], tuple[Any, ...], int]:
        """What transfer ``t`` books per byte (:meth:`Network.plan`: bookings, links, route
        latency), worked out once per booking pattern (sender, receivers, operands) and shared
        by every transfer with that pattern; symmetry.py compares patterns through it."""
        key = (t.src, t.dsts, t.reads, t.dst_reads, t.gather)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = self.net.plan(t)
        return p

    def _runtime_delays(self, todo: list[tuple[CollectiveHandle, int]], now: int) -> list[int]:
        """Ticks from ``now`` until the runtime lets each transfer's DMA start: the sender's CC
        core issues it, the handshake with its peers, and for a transfer that leaves the
        instance over EFA the sender's network proxy thread (runtime.py). A CC core (or a proxy
        thread) serves one transfer at a time; the transfers that reach it at the same tick are
        served as one group that ends together (k issues after it is free), as the network books
        same-tick chunks, so alike ranks stay alike."""
        rt = self.net.runtime
        at = [now] * len(todo)
        # a representative transfer stands for |orbit| / |its sender's orbit| alike transfers of its sender
        src_of, mult = [], []
        for h, i in todo:
            src = h.sched.transfers[i].src
            sym = h.sym
            if sym is None:
                src_of.append(src)
                mult.append(1)
            else:
                r = sym.rank_rep[src]
                src_of.append(r)
                mult.append(sym.size[sym.offsets[h.sym_call] + i] // sym.rank_size[r])
        if rt.issue:
            groups: dict[tuple[int, int], list[int]] = {}
            for n, (h, i) in enumerate(todo):
                src = src_of[n]
                groups.setdefault((src, h.stream.get(src, 0)), []).append(n)
            for key, members in groups.items():
                free = self._issue_free.get(key, 0)
                end = (free if free > now else now) + rt.issue * sum(mult[n] for n in members)
                self._issue_free[key] = end
                for n in members:
                    at[n] = end
        if rt.step_sync:
            at = [a + rt.step_sync for a in at]
        if rt.reduce_sync:  # a transfer that adds what it reads: the runtime's reduce step before it
            for n, (h, i) in enumerate(todo):
                t = h.sched.transfers[i]
                if t.operands > 1 and not t.gather:
                    at[n] += rt.reduce_sync
        if rt.efa_proxy:
            dims = self.system.topology
            waits: dict[int, dict[int, list[int]]] = {}  # proxy thread -> arrival tick -> transfers
            for n, (h, i) in enumerate(todo):
                t = h.sched.transfers[i]
                pkey = (t.src, t.dsts, t.reads, t.dst_reads, t.gather)
                crosses = self._proxied.get(pkey)
                if crosses is None:
                    crosses = self._proxied[pkey] = any(dims[k[0]].proxy for k in self.plan_of(t)[1])
                if crosses:
                    waits.setdefault(src_of[n] // rt.ranks_per_proxy, {}).setdefault(at[n], []).append(n)
            for thread, by_tick in waits.items():
                for tick in sorted(by_tick):
                    members = by_tick[tick]
                    free = self._proxy_free.get(thread, 0)
                    end = (free if free > tick else tick) + rt.efa_proxy * sum(mult[n] for n in members)
                    self._proxy_free[thread] = end
                    for n in members:
                        at[n] = end
        return [a - now for a in at]

    def _transfer(self, h: CollectiveHandle, i: int) -> None:
        """Start transfer ``i`` of ``h`` at this tick's end, with the tick's other starts."""
        if not self._starting:
            self.net.at_tick_end()
        self._starting.append((h, i))

    def _start_staged(self, now: int) -> None:
        todo, self._starting = self._starting, []
        if todo:
            for (h, i), delay in zip(todo, self._runtime_delays(todo, now)):
                self._run_transfer(h, i, delay)

    def _run_transfer(self, h: CollectiveHandle, i: int, delay: int) -> None:
        t = h.sched.transfers[i]
        book, links, lat = self.plan_of(t)
        sym = h.sym
        if sym is not None:  # the representatives of its resources, each with its multiplicity
            book = self._quotient_plan(sym, sym.offsets[h.sym_call] + i, book)

        def data(tick: int) -> None:
            h.data_start[i] = tick

        def done(end: int) -> None:
            self._complete(h, i, end)
            if sym is not None:
                return  # the ranks' ends are the representatives', set when the run is over
            left = h.left
            for r in set(t.ranks()):
                left[r] -= 1
                if left[r] == 0 and r in h.begin:
                    self._rank_finished(h, r, end)

        net = self.net
        k = net.runtime.rings(h.res.ctx.collective)
        rings: dict[int, tuple[int, ...]] = {}
        if k < net.config.core.dma.engines:  # the rings the collective holds on each core
            for r in (t.src, *(t.dsts[:1] if t.dst_reads else ())):
                engines = net.ring_set(h.stream.get(r, 0), k)
                for d in net.rank(r).dma:
                    rings[id(d if sym is None else sym.res_rep.get(id(d), (d,))[0])] = engines
        net.start_transfer(t.nbytes, book, lat, data, done, h.limits, delay, rings, k)

    def _quotient_plan(self, sym: Any, g: int, book: list[tuple[int, Any, float, float]]) -> list[tuple[Any, ...]]:
        """``book`` (transfer number ``g``'s bookings) on its resources' representatives, each
        with the multiplicity ``g``'s orbit brings to it, and the resource it stands for."""
        key = (id(book), sym.size[g])
        got = self._qplans.get(key)
        if got is None or got[1] is not book:
            out = []
            for kind, obj, w, dw in book:
                r, n = sym.res_rep[id(obj)]
                out.append((kind, r, w, dw, sym.size[g] // n, obj))
            got = self._qplans[key] = (out, book, 0)
        return got[0]

    def _finish_reduced(self, h: CollectiveHandle) -> None:
        """After a reduced run: every transfer takes its representative's ticks, every rank its
        representative's start and stream, and ends with its last transfer (or its launch)."""
        sym = h.sym
        rep = sym.rep
        ts = h.sched.transfers
        off = sym.offsets[h.sym_call]
        base = self.handles[sym.base[h.sym_call]]  # where the representatives ran
        boff = sym.offsets[base.sym_call]
        for j in range(len(ts)):
            r = rep[off + j] - boff
            if base is not h or r != j:
                h.finish[j] = base.finish[r]
                h.data_start[j] = base.data_start[r]
        last = _last_finish(ts, h.finish, None)
        launch = self.net.runtime.launch
        for r in h.res.ctx.group:
            rr = sym.rank_rep[r]
            h.begin[r] = base.begin[rr]
            h.stream[r] = base.stream[rr]
            h.end[r] = last.get(r, h.begin[r] + launch)
        for rr in set(sym.rank_rep.values()):
            req = h.requests.pop(rr, None)
            if req is not None:
                self.net.rank(rr).cc.release(req)

    def _finish_direct(self, h: CollectiveHandle) -> None:
        """After a run on representatives (symmetry.direct): every rank takes its
        representative's start and stream, and ends with the last transfer of an orbit that
        touches its orbit (the image of that transfer touching it ends then too)."""
        sym = h.sym
        rank_rep = sym.rank_rep
        last = _last_finish(h.sched.transfers, h.finish, rank_rep)
        launch = self.net.runtime.launch
        for r in h.res.ctx.group:
            rr = rank_rep[r]
            h.begin[r] = h.begin[rr]
            h.stream[r] = h.stream[rr]
            h.end[r] = last.get(rr, h.begin[rr] + launch)
        for rr in set(rank_rep.values()):
            req = h.requests.pop(rr, None)
            if req is not None:
                self.net.rank(rr).cc.release(req)

    def _complete(self, h: CollectiveHandle, i: int, tick: int) -> None:
        pending = h.pending
        deps = h.dependents
        ts = h.sched.transfers
        work = [i]
        h.finish[i] = tick
        while work:
            j = work.pop()
            for k in deps[j]:
                pending[k] -= 1
                if pending[k] == 0:
                    if ts[k].is_node:  # a join: nothing to move
                        h.finish[k] = tick
                        work.append(k)
                    else:
                        self._transfer(h, k)

    def _rank_finished(self, h: CollectiveHandle, rank: int, tick: int) -> None:
        h.end[rank] = tick
        rr = self.net.rank(rank)
        rr.cc.release(h.requests.pop(rank))
        rr.streams.pop(id(h), None)
        h.rank_done[rank].succeed(tick)

    # ---- reports -------------------------------------------------------------------------------
    def report(self, h: CollectiveHandle) -> CollectiveReport:
        from .analytic import estimate_resolved

        res = h.res
        ctx = res.ctx
        group = ctx.group
        missing = [r for r in group if r not in h.end]
        if missing:
            raise RuntimeError(f"{ctx.collective}: rank {missing[0]} has not finished; run the environment first")
        net = self.net
        starts = tuple(res.starts)
        ends = tuple(h.end[r] for r in group)
        t0 = min(starts)
        time = max(ends) - t0
        link_bytes: dict[str, int] = {}
        hbm: dict[str, int] = {}
        dma: dict[int, int] = {}
        max_hops = 0
        hz = self.system.tick_hz
        owner = {id(d): r for r, rr in net._ranks.items() for d in rr.dma}
        timeline: list[tuple[str, str, int, int]] = []
        per_plan: dict[tuple[Any, ...], int] = {}  # bytes per distinct booking pattern
        for i, t in enumerate(h.sched.transfers):
            if t.is_node:
                continue
            key = (t.src, t.dsts, t.reads, t.dst_reads, t.gather)
            per_plan[key] = per_plan.get(key, 0) + t.nbytes
            if net.trace:
                timeline.append((f"rank {t.src} CC{h.stream.get(t.src, 0)}",
                                 f"{t.phase + ' ' if t.phase else ''}step {t.step} -> {','.join(map(str, t.dsts))}",
                                 h.data_start[i], int(h.finish[i] or 0)))
        used: set[Any] = set()
        sym = h.sym
        dsym = None if sym is None else sym.direct
        for key, nbytes in per_plan.items():
            book, links, _ = self._plans[key]
            if dsym is not None:  # a pattern on representatives stands for its orbit's
                max_hops = max(max_hops, len(links))
                self._direct_bytes(dsym, book, nbytes, link_bytes, hbm, dma)
                continue
            max_hops = max(max_hops, len(links))
            used.update(links)
            for k in links:
                name = net.topo.link_name(k)
                link_bytes[name] = link_bytes.get(name, 0) + nbytes
            for kind, obj, w, _ in book:
                b = nbytes * w
                if kind == 3:
                    hbm[obj.name] = hbm.get(obj.name, 0) + round(b)
                elif kind == 1:
                    dma[owner[id(obj)]] = dma.get(owner[id(obj)], 0) + round(b)
        if net.trace:
            for k in sorted(used):
                pipe = net.links[k]
                timeline.extend((f"link {pipe.name}", "chunk", a, b) for a, b in (pipe.log or ()))
        # the bound: the resource that held this call's chunks back longest (union of the
        # intervals from a chunk's booking to when that resource had served it)
        vec_owner = {id(v): r for r, rr in net._ranks.items() for v in rr.vector}
        busy: dict[str, int] = {}
        if dsym is not None:  # each orbit's spans stand for every member's
            spans_of: dict[Any, list[tuple[int, int]]] = {}
            for held, spans in h.limits.values():
                spans_of.setdefault(dsym.canon[dsym.addr[id(held)]], []).extend(spans)
            for root, spans in spans_of.items():
                length = union_length(spans)
                for a in dsym.members[root]:
                    name = self._address_name(a)
                    busy[name] = busy.get(name, 0) + length
            held_back = []
        elif sym is None:
            held_back = [((held,), union_length(spans)) for held, spans in h.limits.values()]
        else:  # a reduced run's chunks stand for their alike chunks on their resources' orbits
            base = self.handles[sym.base[h.sym_call]]
            orbits: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
            for held, spans in base.limits.values():
                orbit = sym.stab[sym.base[h.sym_call]].get(id(held), [held])
                orbits.setdefault(id(orbit[0]), (held, []))[1].extend(spans)
            held_back = [(sym.images(held, h.sym_call), union_length(spans)) for held, spans in orbits.values()]
        for objs, length in held_back:
            for obj in objs:
                k = id(obj)
                if k in owner:
                    name = f"DMA rank {owner[k]}"
                elif k in vec_owner:
                    name = f"VectorE rank {vec_owner[k]}"
                elif isinstance(obj, BandwidthPipe) and "HBM" in obj.name:
                    name = f"HBM {obj.name}"
                else:
                    name = f"link {obj.name}"
                busy[name] = busy.get(name, 0) + length
        estimate = estimate_resolved(self.system, res)
        rt = self.net.runtime
        if rt.reduce_sync and estimate.steps:  # the runtime's own step before each reduce step (runtime.py)
            import dataclasses

            from .report import EstimateStep

            reducing = {(t.phase, t.step) for t in h.sched.transfers
                        if not t.is_node and t.operands > 1 and not t.gather}
            if reducing:
                last = estimate.steps[-1]
                estimate = dataclasses.replace(estimate, steps=estimate.steps + (EstimateStep(
                    f"reduce_sync x {len(reducing)} reduce steps", len(reducing) * rt.reduce_sync_ps * 1e-12,
                    0.0, 0.0, 0.0, last.hbm_bandwidth, 0.0, last.dma_bandwidth),))
        if busy and time > 0:
            top = max(busy.values())
            name = min(k for k, v in busy.items() if v == top)  # ties: the first by name
            pct = 100.0 * top / time
        else:
            name, pct = "latency", 0.0
        if estimate.latency_s >= estimate.time_s / 2 and pct < 50.0:
            name = "latency"  # the alpha terms are most of the time and no resource was busy half of it
        secs = time / hz
        factor = BUSBW_FACTORS(ctx.collective, ctx.p)
        algbw = ctx.nbytes / secs if secs > 0 else 0.0
        count = ctx.nbytes // ctx.itemsize
        if ctx.collective in ("all-gather", "reduce-scatter", "all-to-all"):
            count //= ctx.p
        return CollectiveReport(
            collective=ctx.collective, algorithm=res.algorithm, reason=res.reason, system=self.system.name,
            group=group, nbytes=ctx.nbytes, count=count, dtype=res.dtype, tick_hz=hz, start_ticks=starts,
            end_ticks=ends, time_ticks=time, algbw=algbw, busbw=algbw * factor, busbw_factor=factor,
            steps=h.sched.steps, max_hops=max_hops,
            transfers=sum(1 for t in h.sched.transfers if not t.is_node) * (1 if dsym is None else dsym.order),
            chunks=sum(len(net.chunks_of(t.nbytes)) for t in h.sched.transfers if not t.is_node)
            * (1 if dsym is None else dsym.order),
            link_bytes=dict(sorted(link_bytes.items())), hbm_bytes=dict(sorted(hbm.items())), dma_bytes=dma,
            bound=name, bound_percent=pct, estimate=estimate,
            overrides=self.system.overrides, timeline=tuple(timeline), placement=net.topo.describe_placement(group))


    def _address_name(self, a: tuple[Any, ...]) -> str:
        """A resource's name in a report's bound, from its address (symmetry.Direct)."""
        kind = a[0]
        if kind == "dma":
            return f"DMA rank {a[1]}"
        if kind == "vec":
            return f"VectorE rank {a[1]}"
        if kind == "hbm":
            return f"HBM chip {a[1]} HBM stack {a[2]}"
        return f"link {self.net.topo.link_name(a[1])}"

    def _direct_bytes(self, dsym: Any, book: list[tuple[int, Any, float, float]], nbytes: int,
                      link_bytes: dict[str, int], hbm: dict[str, int], dma: dict[int, int]) -> None:
        """What one booking pattern on representatives (``nbytes`` over its transfers) moves,
        spread over its resources' orbits: the group's elements take it onto each member of an
        orbit of size m order/m times, each image pattern moving the same bytes (rounded per
        pattern, as the full report rounds)."""
        for kind, obj, w, _ in book:
            root = dsym.canon[dsym.addr[id(obj)]]
            members = dsym.members[root]
            times = dsym.order // len(members)
            if kind == 0:
                for a in members:
                    name = self.net.topo.link_name(a[1])
                    link_bytes[name] = link_bytes.get(name, 0) + nbytes * times
            elif kind == 3:
                b = round(nbytes * w) * times
                for a in members:
                    name = f"chip {a[1]} HBM stack {a[2]}"
                    hbm[name] = hbm.get(name, 0) + b
            elif kind == 1:
                b = round(nbytes * w) * times
                for a in members:
                    dma[a[1]] = dma.get(a[1], 0) + b


def parse_sizes(text: str, factor: int, what: str = "--bytes") -> list[int]:
    """Message sizes as ``trnsim collective --bytes`` takes them: one size (``1GiB``), a range
    ``MIN:MAX`` multiplied by ``factor`` each step (nccl-tests' ``-b/-e/-f``), or a comma list;
    bytes. Errors are one-line CollectiveErrors naming ``what``."""
    from ..config import parse_quantity

    shown = f"{what} {text}"
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise CollectiveError(f"--factor {factor}: expected an integer >= 2 (each size is the previous times it)")
    parts = text.split(":")
    if len(parts) > 2 or any(not p.strip() for p in parts):
        raise CollectiveError(f"{shown}: expected SIZE, MIN:MAX or SIZE,SIZE,..., e.g. 8B:4GiB")

    def one(t: str) -> int:
        try:
            return parse_quantity(t.strip(), "bytes")
        except ValueError as e:
            raise CollectiveError(f"{shown}: '{t.strip()}': {e}") from None

    if len(parts) == 2:
        lo, hi = one(parts[0]), one(parts[1])
        if lo == 0:
            raise CollectiveError(f"{shown}: a range starts at 1 byte or more")
        if lo > hi:
            raise CollectiveError(f"{shown}: the first size ({lo} bytes) is larger than the second ({hi} bytes)")
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
    else:
        sizes = [one(t) for t in text.split(",")]
    if len(sizes) > 128:
        raise CollectiveError(f"{shown}: {len(sizes)} sizes; at most 128 (use a larger --factor)")
    return sizes


def __getattr__(name: str) -> object:  # names renamed so one name means one thing (trnsim.compat.RENAMED)
    return renamed(__name__, name)
