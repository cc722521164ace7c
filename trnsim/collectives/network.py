"""The network model: links, DMA engines and HBM stacks as discrete-event resources.

Every resource is a :class:`~trnsim.bandwidth.BandwidthPipe` or a core's
:class:`~trnsim.memory.dma.DmaSystem`, the same primitives a kernel's DMA uses, so a collective
and a kernel in one simpy environment contend for the same HBM stacks and DMA engines (pass the
kernels' :class:`~trnsim.sim.CoreTimeline`\\ s in ``chips``).

A transfer (:mod:`trnsim.collectives.schedule`) runs as one simpy process:

1. It starts when its dependencies are complete and its ranks have started; the runtime's
   delay passes (the sender's CC core issuing it, the handshake, an EFA proxy thread's turn:
   :mod:`trnsim.collectives.runtime`, worked out by the engine), then the DMA start latency
   (``core.dma.start_latency``: semaphore to data movement).
2. Its bytes move in chunks (``collectives.max_chunks`` at most, at least one CC DMA packet each),
   one event per chunk. A chunk is booked, at the tick it is issued, on every resource on its
   path at once: the DMA rings the call holds on each of the sender's cores (``dma_rings``
   engines, ``p2p_rings`` for a send/recv or permute; an even share each; an add costs
   ``1/dma_accumulate_rate`` copies), the HBM stacks it reads and writes, and every link of its
   route. Each resource serves it first-come first-served; the chunk is through when the slowest
   has served it (cut-through: links on a route work in parallel, not store-and-forward). At
   most ``collectives.window`` chunks of a transfer are in flight, so flows that share a link
   interleave chunk by chunk.
3. It completes when its last chunk has crossed the route (hop latencies) plus
   ``core.dma.transfer_latency`` (completion and the semaphore write).

So an uncontended transfer of ``n`` bytes takes ``start + completion + route latency + n / B``,
``B`` the slowest resource's share: the α-β model the analytical estimate uses, with contention
on top. With ``collectives.reduce_engine: vector`` the adds are charged on the adding rank's
VectorE instead (``tensor_tensor`` add cycles, datasheet §7), and the DMA moves at copy rate.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import simpy

from ..memory.bandwidth import BandwidthPipe
from ..config import SystemConfig
from ..memory.dma import DmaSystem
from ..memory.hbm import stack_bandwidth, stack_of_core
from .runtime import RuntimeCosts
from .schedule import Transfer
from .topology import LinkKey, Topology

__all__ = ["Network", "ChipResources", "RankResources"]


@dataclass
class ChipResources:
    """One chip's HBM stacks, and the DMA engines and VectorE of each physical core. Give the
    kernels' ones (``CoreTimeline.dma``, ``CoreTimeline.engines['Vector']``) to make a collective
    share them; missing ones are created."""

    hbm: Sequence[BandwidthPipe]
    dma: Sequence[DmaSystem]
    vector: Sequence[Any] | None = None

    @classmethod
    def from_timelines(cls, timelines: Sequence[Any], hbm: Sequence[BandwidthPipe]) -> "ChipResources":
        """The resources of a chip whose cores run ``timelines`` (:class:`trnsim.sim.CoreTimeline`)."""
        return cls(hbm=list(hbm), dma=[t.dma for t in timelines], vector=[t.engines["Vector"] for t in timelines])


@dataclass
class RankResources:
    """What a rank (a logical core) brings: its physical cores' DMA engines and VectorEs, the HBM
    stacks they are attached to, and its CC cores."""

    rank: int
    dma: list[DmaSystem]
    vector: list[Any]
    stacks: list[BandwidthPipe]
    cc: simpy.Resource
    streams: dict[int, int] = field(default_factory=dict)  # CC stream lane per collective id


class Network:
    """The links and endpoints of a system in one simpy environment."""

    def __init__(self, system: SystemConfig, env: simpy.Environment | None = None,
                 chips: Mapping[int, ChipResources] | None = None, trace: bool = False):
        self.system = system
        self.config = system.chip
        self.env = env or simpy.Environment()
        self.topo = Topology(system)
        self.tick_hz = system.tick_hz
        self.trace = trace
        self._given = dict(chips or {})
        self._chips: dict[int, ChipResources] = {}
        self._ranks: dict[int, RankResources] = {}
        self.links: dict[LinkKey, BandwidthPipe] = {}
        cfg = self.config
        dma = cfg.core.dma
        coll = system.collectives
        self.start_ticks = cfg.ps_to_ticks(dma.start_latency)
        self.done_ticks = cfg.ps_to_ticks(dma.transfer_latency)
        self.packet = coll.packet_bytes
        self.max_chunks = coll.max_chunks
        self.window = coll.window
        self.acc = coll.dma_accumulate_rate
        self.vector_reduce = coll.reduce_engine == "vector"
        self.cc_per_rank = coll.cc_cores_per_core * cfg.chip.lnc
        self.runtime = RuntimeCosts.of(system)
        self.rings = self.runtime.dma_rings
        self._vec_cost: dict[tuple[str, int], int] = {}
        #: chunk bookings made (for the benchmark's events per second)
        self.chunks = 0
        #: what waits for this tick's end (see :meth:`at_tick_end`): transfers' chunks to book, and
        #: the engine's transfer starts (``on_tick_end``: it books the runtime's costs the same way)
        self._staged: list[tuple["_TransferRun", list[list[tuple[int, Any, int, Any, int, Any]]]]] = []
        self.on_tick_end: Callable[[int], None] | None = None
        self._flush_due = False

    # ---- resources -----------------------------------------------------------------------------
    def chip(self, chip: int) -> ChipResources:
        res = self._chips.get(chip)
        if res is None:
            cfg = self.config
            given = self._given.get(chip)
            hbm = list(given.hbm) if given else [
                BandwidthPipe(stack_bandwidth(cfg), self.tick_hz, f"chip {chip} HBM stack {s}")
                for s in range(cfg.chip.hbm.stacks)]
            dma = list(given.dma) if given else []
            for c in range(len(dma), cfg.chip.cores):
                dma.append(DmaSystem(cfg, hbm[stack_of_core(cfg, c)]))
            vec = list(given.vector or []) if given else []
            if len(vec) < cfg.chip.cores:
                from ..cores.vector import VectorEngine

                vec.extend(VectorEngine(cfg) for _ in range(len(vec), cfg.chip.cores))
            for s, p in enumerate(hbm):
                p.name = p.name or f"chip {chip} HBM stack {s}"
            res = self._chips[chip] = ChipResources(hbm, dma, vec)
            if self.trace:
                for p in hbm:
                    p.log = p.log if p.log is not None else []
        return res

    def rank(self, rank: int) -> RankResources:
        res = self._ranks.get(rank)
        if res is None:
            cfg = self.config
            chip = self.chip(rank // self.topo.rpc)
            lnc = cfg.chip.lnc
            cores = range((rank % self.topo.rpc) * lnc, (rank % self.topo.rpc + 1) * lnc)
            stacks: list[BandwidthPipe] = []
            for c in cores:
                p = chip.hbm[stack_of_core(cfg, c)]
                if p not in stacks:
                    stacks.append(p)
            vec = chip.vector or []
            res = self._ranks[rank] = RankResources(rank, [chip.dma[c] for c in cores], [vec[c] for c in cores],
                                                    stacks, simpy.Resource(self.env, capacity=self.cc_per_rank))
        return res

    def link(self, key: LinkKey) -> BandwidthPipe:
        pipe = self.links.get(key)
        if pipe is None:
            pipe = self.links[key] = BandwidthPipe(self.topo.link_bandwidth(key), self.tick_hz, self.topo.link_name(key))
            if self.trace:
                pipe.log = []
        return pipe

    # ---- what a transfer books -------------------------------------------------------------------
    def plan(self, t: Transfer) -> tuple[list[tuple[int, Any, float, float]], tuple[LinkKey, ...], int]:
        """The bookings of one byte of ``t`` as ``(kind, resource, cost per byte, data per
        byte)`` (kind 0 a link, 1 a DMA system, 2 a VectorE, 3 an HBM stack; the cost of a DMA
        system counts an add at its rate, the data what it moves), its links, and its route
        latency in ticks."""
        book: dict[int, list[Any]] = {}

        def add(kind: int, obj: Any, w: float, data: float | None = None) -> None:
            e = book.get(id(obj))
            if e is None:
                book[id(obj)] = [kind, obj, w, w if data is None else data]
            else:
                e[2] += w
                e[3] += w if data is None else data

        src = self.rank(t.src)
        share = 1 / len(t.reads) if t.gather else 1.0  # a gathered message reads each part once
        for r in t.reads:
            st = self.rank(r).stacks
            for p in st:
                add(3, p, share / len(st))
        adds_here = len(t.reads) > 1 and not t.gather
        adds_there = bool(t.dst_reads)
        if self.vector_reduce:
            for v in (src.vector if adds_here else ()):
                add(2, v, (len(t.reads) - 1) / len(src.vector))
            if adds_there:
                rv = self.rank(t.dsts[0]).vector
                for v in rv:
                    add(2, v, len(t.dst_reads) / len(rv))
            rate_src = rate_dst = 1.0
        else:
            rate_src = 1 / self.acc if adds_here else 1.0
            rate_dst = 1 / self.acc
        for d in src.dma:
            add(1, d, rate_src / len(src.dma), 1 / len(src.dma))
        if adds_there:
            rdma = self.rank(t.dsts[0]).dma
            for d in rdma:
                add(1, d, rate_dst / len(rdma), 1 / len(rdma))
        for r in t.dst_reads:
            st = self.rank(r).stacks
            for p in st:
                add(3, p, 1 / len(st))
        links: list[LinkKey] = []
        lat = 0
        src_chip = t.src // self.topo.rpc
        for r in dict.fromkeys(t.dsts):
            st = self.rank(r).stacks
            for p in st:
                add(3, p, 1 / len(st))
            route = self.topo.route(src_chip, r // self.topo.rpc)
            lat = max(lat, self.topo.route_latency(route))
            for k in route:
                if k not in links:  # a duplicated write crosses a shared link once
                    links.append(k)
        for k in links:
            add(0, self.link(k), 1.0)
        return [(k, o, w, dw) for k, o, w, dw in book.values()], tuple(links), self.config.ps_to_ticks(lat)

    def ring_set(self, stream: int, k: int | None = None) -> tuple[int, ...]:
        """The engines a collective on CC stream ``stream`` holds on each core: ``k`` of them
        (default ``dma_rings``), the streams' sets side by side round the core's engines."""
        n = self.config.core.dma.engines
        k = self.rings if k is None else k
        return tuple((stream * k + i) % n for i in range(k))

    def chunks_of(self, nbytes: int) -> list[int]:
        """A transfer's chunk sizes, bytes: at most ``max_chunks``, each at least a packet."""
        if nbytes <= 0:
            return []
        k = min(self.max_chunks, -(-nbytes // self.packet))
        q, r = divmod(nbytes, k)
        return [q + 1] * r + [q] * (k - r)

    def vector_ticks(self, vec: Any, nbytes: float) -> int:
        """Ticks of VectorE adding ``nbytes`` of bf16 spread over its 128 lanes (one
        ``tensor_tensor`` add per SBUF-sized tile, datasheet §7)."""
        elems = max(1, int(nbytes) // 2)
        per_part = -(-elems // self.config.core.sbuf.partitions)
        key = ("bf16", per_part)
        ticks = self._vec_cost.get(key)
        if ticks is None:
            from ..builder.kernel import Kernel

            tile = min(per_part, 8192)
            k = Kernel("cc_reduce", self.config)
            a = k.sbuf((self.config.core.sbuf.partitions, tile), "bf16")
            b = k.sbuf((self.config.core.sbuf.partitions, tile), "bf16")
            k.tensor_tensor(a, a, b, "add")
            cycles = vec.cycles(k.instructions[-1])
            ticks = self._vec_cost[key] = -(-cycles * per_part // tile) * vec.tpc
        return ticks

    def _chunk_plan(self, bookings: Sequence[tuple[Any, ...]], nbytes: int, rings: int | None = None
                    ) -> list[tuple[int, list[tuple[int, Any, int, Any, int, Any]]]]:
        """The chunks of a transfer as (how many, bookings of one): each booking is (kind,
        resource, bytes, extra, multiplicity, the resource it stands for). A DMA system's extra is (engines, ticks on each):
        a transfer spreads its data evenly over the collective's ``dma_rings`` rings of the core
        (kind 4 when that is all of its engines), one descriptor per CC packet; a VectorE's extra
        is its ticks. The multiplicity (a booking's fifth field, default 1) is how many alike
        bookings of the same tick the resource stands for, and the sixth field the resource
        whose orbit it represents (default itself; symmetry.py)."""
        sizes = self.chunks_of(nbytes)
        k = len(sizes)
        out = []
        for size in sorted(set(sizes), reverse=True):
            todo = []
            for b in bookings:
                kind, obj, w, dw = b[:4]
                mult = b[4] if len(b) > 4 else 1
                orig = b[5] if len(b) > 5 else obj
                nb = math.ceil(size * w)
                extra: Any = 0
                if kind == 1:
                    n_eng = len(obj.engine_free)
                    packets = -(-math.ceil(nbytes * dw) // self.packet)
                    used = self.rings if rings is None else rings  # the call's rings here, whatever the size
                    per = -(-nb // used)
                    desc = -(-packets * obj.desc_ticks // (used * k))  # this chunk's share of descriptors
                    extra = (used, -(-per * obj.tick_hz // obj.bw) + desc)
                    if used == n_eng:
                        kind = 4
                elif kind == 2:
                    extra = self.vector_ticks(obj, size * w)
                else:  # a pipe: its service ticks, worked out once per chunk size
                    extra = obj.ticks(nb)
                todo.append((kind, obj, nb, extra, mult, orig))
            out.append((sizes.count(size), todo))
        return out

    # ---- running a transfer --------------------------------------------------------------------
    def start_transfer(self, nbytes: int, bookings: Sequence[tuple[Any, ...]], route_ticks: int,
                       on_data: Callable[[int], None], on_done: Callable[[int], None],
                       limits: dict[int, tuple[Any, list[tuple[int, int]]]] | None = None, delay: int = 0,
                       rings: Mapping[int, tuple[int, ...]] | None = None, nrings: int | None = None) -> None:
        """Run one transfer from now (see the module docstring): ``on_data(tick)`` when its data
        starts to move, ``on_done(tick)`` when it is complete. ``limits`` collects, per resource
        (by id), the intervals during which it was the one holding a chunk back; ``delay`` ticks
        (the runtime's issue, handshake and proxy time) pass before the DMA start latency;
        ``rings`` maps a DMA system (by id) to the engines the collective holds on it (default
        the first ``dma_rings``); ``nrings`` is how many the call holds per core (default
        ``dma_rings``).

        It is driven by timeout callbacks rather than a simpy process: a transfer is one event
        per chunk, and a process would double what each event costs."""
        _TransferRun(self, self._chunk_plan(bookings, nbytes, nrings), route_ticks, on_data, on_done, limits, delay,
                     rings or {})

    # ---- same-tick arrivals share ------------------------------------------------------------------
    def at_tick_end(self) -> None:
        """Make sure this tick's staged work is booked once everything else of the tick has run:
        chunks (and, through ``on_tick_end``, the engine's transfer starts) that reach a resource
        at the same tick are booked together, as one group that ends together (see
        :meth:`_book_staged`), so which of them simpy happened to run first never matters. A
        flush that stages more work at the same tick books it in a second group, after the first."""
        if not self._flush_due:
            self._flush_due = True
            ev = simpy.Event(self.env)
            ev._ok = True
            ev._value = None
            ev.callbacks.append(self._flush)
            self.env.schedule(ev, 2, 0)  # priority 2: after the tick's normal and urgent events

    def _flush(self, _: Any) -> None:
        self._flush_due = False
        now = int(self.env.now)
        if self.on_tick_end is not None:
            self.on_tick_end(now)
        if self._staged:
            staged, self._staged = self._staged, []
            self._book_staged(staged, now)

    def _book_staged(self, staged: list[tuple["_TransferRun", list[list[tuple[int, Any, int, Any, int, Any]]]]], now: int
                     ) -> None:
        """Book the chunks staged at tick ``now``. Every resource serves the group that reached
        it at this tick together: the group starts when the resource is free (or now) and all of
        it is through at start + the sum of its members' service times (each rounded up as a
        booking of its own would be), the end a FIFO gives its last member. Alike flows (a
        ring's ranks, a mesh's peers) thus end alike, whatever order simpy ran them in."""
        pipes: dict[int, list[Any]] = {}  # id -> [resource, ticks, bytes] (links, HBM; VectorE: bytes -1)
        dmas: dict[int, list[Any]] = {}  # id -> [DmaSystem, {engine: ticks}, ticks on every engine]
        default = self.ring_set(0)
        for run, chunks in staged:
            rings = run.rings
            for todo in chunks:
                for kind, obj, nb, extra, mult, _ in todo:
                    key = id(obj)
                    if kind == 1 or kind == 4:
                        d = dmas.get(key)
                        if d is None:
                            d = dmas[key] = [obj, {}, 0]
                        if kind == 4:
                            d[2] += extra[1] * mult
                        else:
                            per = d[1]
                            eng = rings.get(key) or default
                            per[eng] = per.get(eng, 0) + extra[1] * mult
                    else:
                        p = pipes.get(key)
                        if p is None:
                            p = pipes[key] = [obj, 0, 0 if kind != 2 else -1]
                        p[1] += extra * mult
                        if kind != 2:
                            p[2] += nb * mult
        ends: dict[Any, int] = {}
        for key, (obj, ticks, nbytes) in pipes.items():
            begin = obj.free if obj.free > now else now
            obj.free = end = begin + ticks
            if nbytes >= 0:  # a pipe keeps its counters and trace log
                obj.bytes += nbytes
                obj.busy_ticks += ticks
                if obj.log is not None:
                    obj.log.append((begin, end))
            ends[key] = end
        for key, (obj, per, spread) in dmas.items():
            if not per:
                ends[key] = obj.reserve_spread(spread, now)
                continue
            if obj._level is not None:
                obj.engine_free = [obj._level] * len(obj.engine_free)
                obj._level = None
            free = obj.engine_free
            if len(per) == 1 and not spread:  # one engine set (one CC stream): book just those
                (engines, t), = per.items()
                top = now
                for e in engines:
                    f = free[e] = (free[e] if free[e] > now else now) + t
                    if f > top:
                        top = f
                ends[(key, engines)] = top
                continue
            add = [spread] * len(free)
            for engines, t in per.items():
                for e in engines:
                    add[e] += t
            for e, t in enumerate(add):
                if t:
                    free[e] = (free[e] if free[e] > now else now) + t
            for engines in per:
                ends[(key, engines)] = max(free[e] for e in engines)
            ends[key] = max(free)  # what a booking on every engine (kind 4) waits for
        for run, chunks in staged:
            rings = run.rings
            fins = []
            for todo in chunks:
                fin = now
                held = None
                for kind, obj, _, _, _, orig in todo:
                    key = id(obj)
                    if kind == 1:  # the end of its own engines' group
                        e = ends[(key, rings.get(key) or default)]
                    else:
                        e = ends[key]
                    if e >= fin:  # ties: the last on the path (its links), as a FIFO's later booking
                        fin = e
                        held = orig  # the resource itself, not the representative booked for it
                fins.append((fin, held))
            run.booked(fins, now)


class _TransferRun:
    """The state of one running transfer: chunks left to book, those in flight, the last
    tick any of them is through."""

    __slots__ = ("net", "env", "chunks", "inflight", "last", "route", "on_data", "on_done", "limits", "rings",
                 "staged")

    def __init__(self, net: Network, plan: list[tuple[int, list[tuple[int, Any, int, Any, int, Any]]]], route_ticks: int,
                 on_data: Callable[[int], None], on_done: Callable[[int], None],
                 limits: dict[int, tuple[Any, list[tuple[int, int]]]] | None, delay: int = 0,
                 rings: Mapping[int, tuple[int, ...]] | None = None):
        self.net = net
        self.rings = rings or {}
        self.env = net.env
        self.chunks = [todo for count, todo in plan for _ in range(count)]
        self.chunks.reverse()  # popped from the end, so in order
        net.chunks += len(self.chunks)
        self.inflight: deque[int] = deque()
        self.route = route_ticks
        self.on_data = on_data
        self.on_done = on_done
        self.limits = limits
        self.staged = 0
        # always through an event, so a chain of instant transfers never recurses
        self.env.timeout(net.start_ticks + delay).callbacks.append(self._begin)

    def _begin(self, _: Any) -> None:
        self.last = self.env.now
        self.on_data(self.env.now)
        self._step(None)

    def _step(self, _: Any) -> None:
        """Stage the chunks the window lets out now; they are booked at the tick's end."""
        now = self.env.now
        inflight = self.inflight
        while inflight and inflight[0] <= now:
            inflight.popleft()
        chunks = self.chunks
        room = self.net.window - len(inflight)
        if chunks and room > 0:
            out = [chunks.pop() for _ in range(min(room, len(chunks)))]
            self.net._staged.append((self, out))
            self.net.at_tick_end()
            return
        self._next(now)

    def booked(self, fins: list[tuple[int, Any]], now: int) -> None:
        """The chunks staged at ``now`` are booked: each is through at its ``fin``, held back by
        its ``held`` resource (None: a zero-cost chunk, which leaves its window slot free)."""
        limits = self.limits
        inflight = self.inflight
        for fin, held in fins:
            if fin <= now:
                continue  # nothing to move (a zero-cost chunk)
            if limits is not None:
                slot = limits.get(id(held))
                if slot is None:
                    slot = limits[id(held)] = (held, [])
                slot[1].append((now, fin))
            inflight.append(fin)
            if fin > self.last:
                self.last = fin
        if self.chunks and len(inflight) < self.net.window:
            self._step(None)  # zero-cost chunks left room: stage the next now
            return
        self._next(now)

    def _next(self, now: int) -> None:
        if self.chunks:
            self.env.timeout(self.inflight[0] - now).callbacks.append(self._step)
            return
        end = self.last + self.route + self.net.done_ticks
        if end > now:
            self.env.timeout(end - now).callbacks.append(self._done)
        else:
            self.on_done(now)

    def _done(self, _: Any) -> None:
        self.on_done(self.env.now)
