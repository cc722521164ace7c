"""The device model: a chip's logical NeuronCores over time.

Every front end charges its work here - the ``neuron`` PyTorch device's eager ops, compiled
regions, timing-only runs, collectives - as *launches* of kernels whose cost the scheduler
(:mod:`trnsim.sim`) simulated once and this module caches. Only this module knows time across
kernels; only the scheduler knows time inside one. It needs no torch: a kernel is named by a
:class:`KernelSpec` (a library kernel, its shape, dtype and parameters: metadata, never values).

The model, in integer ticks of the chip config (``config.tick_hz``):

* **Host.** One host thread issues every launch. A launch costs the host ``host.dispatch`` (a
  config figure) and the host runs ahead of the device: it waits for the device only when the
  program synchronises (:meth:`Device.synchronize`: reading a value, copying to the host, an
  event's synchronize) or when ``host.max_inflight`` launches of a core are still unfinished (the
  runtime's queue is full). Metadata-only ops (views) launch nothing: :meth:`Device.host_op`
  counts them and they cost neither host nor device time.
* **Streams.** Each logical core has streams (0 is the default). A kernel starts when its
  stream's previous kernel has finished and the host has issued it, so the device idles,
  *waiting on the host*, when its kernels are shorter than the host's dispatch time.
* **LNC.** A logical core of LNC=2 runs each kernel on both of its physical cores: the op's work
  is split the way the library's SPMD kernels split it (the registry's ``split`` rule) and the
  halves are simulated together, sharing their HBM stack. A kernel that cannot be split runs on
  one physical core.
* **Concurrent streams share the core's engines** (an approximation). A kernel's demand on each
  resource (TensorE, VectorE, ScalarE, GpSimd, DMA: busy ticks from its simulation) is taken as
  spread evenly over its duration. A kernel that starts while kernels of other streams of its
  core are running is stretched until, for every resource, its own demand plus theirs within its
  window fits in the window (``lnc`` physical engines of each kind). Kernels already placed keep
  their times: the later launch absorbs the contention. So two TensorE-bound kernels on two
  streams take about as long as one after the other, while a TensorE-bound and a DMA-bound one
  overlap. Logical cores do not contend with each other (at LNC=2 each has its own HBM stack).
* **Graph launches.** A compiled graph (or a replayed sequence of eager ops) is one executable:
  :meth:`Device.launch_graph` costs the host one ``host.dispatch`` for all its kernels, which run
  back to back on one stream. :meth:`Device.graph` collects the launches a thread makes inside a
  ``with`` block and issues them so; :meth:`Device.muted` discards them (a value computed for a
  kernel charged another way).
* **Adaptive eager** (opt-in, :meth:`Device.set_adaptive`). Launches are queued instead of issued
  until the program synchronises (or the queue holds ``ADAPTIVE_QUEUE`` launches). A queued
  sequence issued before (the same ops with the same kernels, in order) is replayed as one graph
  launch; a new one is issued launch by launch, as the capture run of a CUDA graph is, and
  remembered. Values and the order of kernels are unchanged; only the host's dispatches are.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

from ..sim.chip import Chip
from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..sim.report import CollectiveStats, CoreStats, OpRow, RunReport, TraceEvent, busiest
# what a launch is and costs, the recorder and the core timeline are their own modules (re-exported)
from .ops import COLLECTIVE_STREAM, CollectiveLaunch, collective_stream, FusedRegion, KernelSpec, LaunchLog, OpCost, no_work
from .recorder import NO_CONTEXT, CoreTally, Recorder
from .timeline import Capture, CoreTimeline, LaunchItem, on_fresh_thread, shared_duration, stream_runs

__all__ = ["KernelSpec", "OpCost", "FusedRegion", "CollectiveLaunch", "Device", "LaunchLog", "Recorder", "no_work", "ADAPTIVE_QUEUE",
           "COLLECTIVE_STREAM"]

#: launches adaptive eager queues at most before it issues them (a program that never syncs)
ADAPTIVE_QUEUE = 4096

#: logged launches from which :meth:`Device._drain` lets a log that can place them (``place``) do so
PLACE_MIN = 16
#: logged entries from which :meth:`Device._drain` lets a log take a prefix of captured launches and
#: host ops in bulk (``take_captured``)
CAPTURED_MIN = 8


class Device:
    """A chip's logical NeuronCores, their streams and the host that feeds them, with a cache of
    simulated kernel costs. Thread-safe: launches from several threads are serialised."""

    def __init__(self, config: ChipConfig):
        self.config = config
        self.chip = Chip(config)
        self.lnc = config.chip.lnc
        self.dispatch = config.ps_to_ticks(config.host.dispatch)
        self._host = 0  # the host's clock: when it will issue its next launch
        self.cores = [CoreTimeline(i, config.host.max_inflight) for i in range(config.logical_cores)]
        self.recorders: list[Recorder] = [Recorder(0)]  # [0]: since start (or the last reset)
        self._costs: dict[KernelSpec, OpCost] = {}
        self._rejected: set[KernelSpec] = set()
        self._streams: dict[tuple[Any, ...], OpCost] = {}  # stream kernels' costs by geometry
        self.simulated = 0  # kernels actually simulated (cost-cache misses)
        self._lock = threading.RLock()
        self._local = threading.local()  # .capture: the launches this thread is collecting
        self.adaptive = False
        self._pending: list[LaunchItem] = []
        self._replays: dict[tuple[Any, ...], list[OpCost]] = {}
        self._context = threading.local()  # per host thread: (source line, call) of its launches
        # simulate cost-cache misses on a fresh thread: a Python profiler of the host (torch.profiler
        # with_stack) follows only the threads that existed when it started, so it does not record
        # the simulator's own calls, which a real host would not make
        self.simulate_off_thread = False
        # the source line of a launch its front end gave no context for (None: left blank); set
        # by a front end only while something records lines, as it walks the host's stack
        self._source_of: Callable[[], str] | None = None
        self._log: LaunchLog | None = None  # launches made elsewhere, to issue first (attach_log)
        self._tokens: dict[int, Capture] = {}  # the open ones by token (LaunchLog.capture), and the closed
        self._closed: collections.deque[int] = collections.deque()  # ... ones whose close the log holds, in its order
        self._next_token = 0
        self._ctx_threads: set[int] = set()  # threads whose launches carry a context

    @property
    def source_of(self) -> Callable[[], str] | None:
        return self._source_of

    @source_of.setter
    def source_of(self, fn: Callable[[], str] | None) -> None:
        with self._lock:
            self._drain()
            self._source_of = fn
            self._update_gate()

    # ---- launches made elsewhere -------------------------------------------------------------
    def attach_log(self, log: LaunchLog | None) -> None:
        """Issue ``log``'s launches (a front end's native fast path) before anything else."""
        with self._lock:
            self._drain()
            self._log = log
            self._update_gate()

    def _drain(self) -> None:
        """Issue what the launch log holds, in order, exactly as :meth:`launch` and
        :meth:`host_op` would have when the launches were made."""
        log = self._log
        if log is None or not log.pending():
            return
        with self._lock:
            recs = self.recorders
            while True:  # prefixes the log handles in bulk, each the same as the loop below
                if log.pending() >= PLACE_MIN and hasattr(log, "place") and all(r.events is None for r in recs):
                    self._place(log)
                    if not log.pending():
                        return
                if not (log.pending() >= CAPTURED_MIN and hasattr(log, "take_captured") and self._take_captured(log)):
                    break
                if not log.pending():
                    return
            for rec in recs:
                rec.fold()  # (rows a placement deferred come first)
            cores = self.cores
            dispatch = self.dispatch
            host = self._host  # kept here while entries are issued inline, in self._host otherwise
            for core, op, cost, key, token in log.take():
                if cost is None:
                    if op is None and core < 0:  # capture `token` ended here: what it collected, issued
                        self._closed.popleft()
                        self._host = host
                        self._settle_capture(self._tokens.pop(token))
                        host = self._host
                        continue
                    if op is None:  # the host waits for the core's work, as synchronize(core) does
                        for ready in cores[core].ready.values():
                            if ready > host:
                                host = ready
                        continue
                    cap = self._tokens.get(token) if token else None
                    if cap is not None and cap.hosts is not None:  # inside Device.recorded: learned, not counted
                        cap.hosts[op] = cap.hosts.get(op, 0) + 1
                        continue
                    for rec in recs:
                        rec.host_ops[op] = rec.host_ops.get(op, 0) + 1
                    continue
                if token:  # made inside a graph capture: collected there, as launch() does
                    self._tokens[token].append((core, op, cost, 0, NO_CONTEXT))
                    continue
                c = cores[core]
                streams = c.streams
                if c.pending or (streams and (len(streams) > 1 or 0 not in streams)):
                    self._host = host
                    self._issue(core, 0, [(op, cost, NO_CONTEXT)])  # engines shared, a collective to place
                    host = self._host
                    continue
                # what self._issue(core, 0, [(op, cost, NO_CONTEXT)]) does when stream 0 has the core
                # to itself and no collective awaits its group, inline (this runs once per fast op)
                prev = host
                inflight = c.inflight
                if len(inflight) >= c.max_inflight:
                    oldest = inflight.popleft()
                    if oldest > host:
                        host = oldest
                host += dispatch
                ready = c.ready.get(0, 0)
                start = ready if ready > host else host
                busy = c.busy_until
                wait = host - (ready if ready > busy else busy)
                if wait < 0:
                    wait = 0
                ticks = cost.ticks
                if not streams:
                    streams.add(0)
                end = start + ticks
                if ticks:
                    c.bookings.append((0, start, end, cost.demand))
                for rec in recs:
                    rec.host_ticks += host - prev
                    row = rec.rows.get(key)
                    if row is None:
                        rec.rows[key] = [cost, 1, ticks, wait, 0]
                    else:
                        row[1] += 1
                        row[2] += ticks
                        row[3] += wait
                    tally = rec.cores.get(core)
                    if tally is None:
                        tally = rec.cores[core] = CoreTally()
                    tally.launches += 1
                    tally.wait += wait
                    live = tally.open
                    if end > start and live and start < live[-1][1]:
                        tally.add(start, end, host)  # overlaps an open interval: the general merge
                    else:  # what CoreTally.add does for a kernel after every open interval
                        if end > tally.last_end:
                            tally.last_end = end
                        if end > start:
                            tally.ticks += end - start
                            while live and live[0][1] <= host:
                                lo, hi = live.pop(0)
                                tally.busy += hi - lo
                            live.append([start, end])
                    if rec.events is not None:
                        rec.events.append(TraceEvent(core, 0, op, cost.kernel, host, start, end, "", -1, cost.reports))
                    rec.dispatches += 1
                c.ready[0] = end
                if end > busy:
                    c.busy_until = end
                if end > start:
                    inflight.append(end)
            self._host = host

    def _take_captured(self, log: Any) -> bool:
        """Take the log's first entries while they are launches made inside a graph capture or
        host ops (``log.take_captured``): the launches collected into their captures in order,
        the host ops counted, as :meth:`_drain`'s loop does one entry at a time (a host op has no
        time and a captured launch waits for its capture's end, so neither depends on where the
        other falls). False when the first entry is neither."""
        got = log.take_captured()
        if got is None:
            return False
        launches, hops = got
        tokens = self._tokens
        for token, core, op, cost in launches:
            tokens[token].append((core, op, cost, 0, NO_CONTEXT))
        for rec in self.recorders:
            rec.count_host_ops(hops)
        return True

    def _place(self, log: Any) -> None:
        """The log's first launches placed by the log itself (``log.place``: the native fast path's
        arithmetic of the loop in :meth:`_drain`, for the entries up to the first one it does not
        take), their figures applied here in aggregate: the same state and the same recorder
        figures as that loop leaves, without a Python loop per launch."""
        recs = self.recorders
        states = []
        for i, c in enumerate(self.cores):
            last = 0
            for rec in recs:
                tally = rec.cores.get(i)
                if tally is not None and tally.open and tally.open[-1][1] > last:
                    last = tally.open[-1][1]
            # another stream's kernels: a launch of stream 0 may be placed natively from where the last
            # of them ends (nothing of theirs to share the engines with: _book stretches nothing) and
            # the host's wait for the core (item()) waits for every stream's
            others = ready = 0
            if c.streams and (len(c.streams) > 1 or 0 not in c.streams):
                others = max((b[2] for b in c.bookings if b[0] != 0), default=0)
                ready = max((t for s, t in c.ready.items() if s != 0), default=0)
            states.append((not c.pending, c.max_inflight, c.ready.get(0, 0), c.busy_until, c.inflight, last, others,
                           ready))
        got = log.place(self._host, self.dispatch, states)
        if got is None:
            return
        taken, host, used, (rows, table), hops, waited, closes = got
        for _ in range(closes):  # (captures the log ended and placed)
            del self._tokens[self._closed.popleft()]
        dispatches = sum(u[12] for u in used)
        graphs = sum(u[13] for u in used)
        for core, ready, busy, inflight, *_, bookings, _d, _g in used:
            c = self.cores[core]
            c.ready[0] = ready
            c.busy_until = busy
            c.inflight.clear()
            c.inflight.extend(inflight)
            c.bookings.extend(bookings)
            c.streams.add(0)
        delta = host - self._host - waited  # (waits for a core's work are no dispatch time, as in synchronize)
        self._host = host
        for rec in recs:
            rec.host_ticks += delta
            rec.dispatches += dispatches
            rec.graph_launches += graphs
            rec.defer_rows(rows, table)
            rec.count_host_ops(hops)
            for core, _r, _b, _i, n, wait, ticks, last_end, last_host, folded, keep, *_ in used:
                tally = rec.cores.get(core)
                if tally is None:
                    tally = rec.cores[core] = CoreTally()
                tally.launches += n
                tally.wait += wait
                if last_end > tally.last_end:
                    tally.last_end = last_end
                if last_host >= 0:  # an interval was added: the ones the host has passed are folded
                    tally.ticks += ticks
                    live = tally.open
                    while live and live[0][1] <= last_host:
                        lo, hi = live.pop(0)
                        tally.busy += hi - lo
                    tally.busy += folded
                    live.extend([lo, hi] for lo, hi in keep)

    def _update_gate(self) -> None:
        """Tell the log whether launches may be made without :meth:`launch` now."""
        if self._log is not None:
            self._log.gate(not self.adaptive and not self._ctx_threads
                           and self._source_of is None and all(c.current_stream == 0 for c in self.cores))

    def set_current_stream(self, core: int, stream: int) -> None:
        """Make ``stream`` the one ``core``'s launches go to when they name none."""
        with self._lock:
            self._drain()
            self.cores[core].current_stream = stream
            self._update_gate()

    @property
    def core_count(self) -> int:
        return len(self.cores)

    # ---- costs -----------------------------------------------------------------------------
    def cost(self, spec: KernelSpec) -> OpCost:
        """The cost of one launch of ``spec``, simulated once per spec (timing only) and cached.
        A kernel that refuses the shape (``KernelError``) falls back to ``spec.fallback``."""
        hit = self._costs.get(spec)
        if hit is not None:
            return hit
        with self._lock:
            try:
                if spec in self._rejected:
                    raise KernelError(f"kernel '{spec.kernel}' refused {spec.shape}")
                cost = self._simulate(spec)
            except KernelError:
                if spec.fallback is None:
                    raise
                self._rejected.add(spec)
                cost = self.cost(spec.fallback)
            self._costs[spec] = cost
            return cost

    def refused(self) -> list[KernelSpec]:
        """The specs whose kernel refused the shape and were costed as their fallback instead."""
        return sorted(self._rejected, key=lambda sp: (sp.kernel, sp.shape, sp.dtype))

    def kernels_of(self, spec: KernelSpec) -> list[Kernel]:
        """The kernels ``spec`` runs as on one logical core: one per physical core it uses."""
        from ..kernels.registry import build_spec, split_parts

        params = dict(spec.params)
        parts = split_parts(spec.kernel, spec.shape, params, self.lnc)
        # cores given the same share run the same kernel: a build is a function of its
        # arguments, so it is made once and run on each of them (the simulator reads a kernel,
        # never changes it)
        built: list[tuple[tuple[Any, ...], Kernel]] = []
        out = []
        for s, own in parts:
            for key, k in built:
                if key == (s, own):
                    break
            else:
                k = build_spec(spec.kernel, s, spec.dtype, self.config, {**params, **own})
                built.append(((s, own), k))
            out.append(k)
        return out

    def _simulate(self, spec: KernelSpec) -> OpCost:
        if self.simulate_off_thread:
            return on_fresh_thread(self._simulate_here, spec)
        return self._simulate_here(spec)

    def _simulate_here(self, spec: KernelSpec) -> OpCost:
        geometry = self._stream_geometry(spec)
        if geometry is not None:
            same = self._streams.get(geometry)
            if same is not None:  # the same kernels, instruction for instruction: the same cost
                return replace(same, busy=dict(same.busy), demand=dict(same.demand))
        kernels = self.kernels_of(spec)
        results = self.chip.run_spmd(kernels, timing_only=True)
        self.simulated += len(kernels)
        cost = OpCost.of_reports(spec.name, spec.generic, [r.report for r in results],
                                 self.config.hbm_bandwidth_reachable)
        if geometry is not None:
            self._streams[geometry] = cost
        return cost

    def _stream_geometry(self, spec: KernelSpec) -> tuple[Any, ...] | None:
        """For the generic stream kernel, everything its cost is a function of: the columns of
        each core's share (:func:`trnsim.kernels.generic.stream_geometry`, what the builder
        reads of the element counts), its dtype and parameters, and the report's name. A small
        op's element count varies (an MoE expert's routed tokens) where its kernels do not."""
        if spec.kernel != "stream" or spec.fallback is not None:  # (kernels.generic.STREAM)
            return None
        from ..kernels.generic import stream_geometry
        from ..kernels.registry import split_parts

        p = self.config.core.sbuf.partitions
        parts = tuple((stream_geometry(s, p), tuple(sorted(own.items())))
                      for s, own in split_parts(spec.kernel, spec.shape, dict(spec.params), self.lnc))
        return (spec.name, spec.generic, spec.dtype, spec.params, parts)

    def collective_cost(self, report: Any, rank: int, alone: Any = None) -> OpCost:
        """A simulated collective (:class:`trnsim.collectives.CollectiveReport`) as a launch on
        ``rank``'s logical core: from the rank's start to its completion, with the bytes its DMA
        engines moved as its DMA demand (so kernels on other streams of the core share DMA with
        it, and it with them). ``alone``: the same call simulated without the calls beside it
        (its sibling groups'), kept for the report's slowdown."""
        i = report.group.index(rank)
        ticks = report.end_ticks[i] - report.start_ticks[i]
        alone_ticks = -1 if alone is None else alone.end_ticks[i] - alone.start_ticks[i]
        dma = report.dma_bytes.get(rank, 0)
        demand = {"DMA": -(-dma * self.config.tick_hz // int(self.config.hbm_bandwidth_reachable))}
        busy = {"DMA": min(ticks * self.lnc, demand["DMA"])}
        info = CollectiveLaunch(report.collective, report.algorithm, len(report.group), report.nbytes, ticks,
                                report.busbw_factor, report.bound.split(" ")[0], alone_ticks)
        return OpCost(f"{report.collective}:{report.algorithm}", False, ticks, busy, self.lnc,
                      sum(report.hbm_bytes.values()) // max(1, len(report.group)), 0, demand, collective=info)

    # ---- time ------------------------------------------------------------------------------
    def set_context(self, source: str = "", call: int = -1) -> tuple[str, int]:
        """Attribute the launches this thread issues from now on to Python line ``source`` and
        host call ``call`` (a front end's op record; -1: none), for traces and per-line reports;
        returns the previous context, to restore when the call ends."""
        prev = getattr(self._context, "value", NO_CONTEXT)
        self._put_context((source, call) if source or call >= 0 else NO_CONTEXT)
        return prev

    def restore_context(self, prev: tuple[str, int]) -> None:
        """Put back a context :meth:`set_context` returned."""
        self._put_context(prev)

    def _put_context(self, ctx: tuple[str, int]) -> None:
        with self._lock:
            self._drain()
            self._context.value = ctx
            if ctx == NO_CONTEXT:
                self._ctx_threads.discard(threading.get_ident())
            else:
                self._ctx_threads.add(threading.get_ident())
            self._update_gate()

    def _launch_context(self) -> tuple[str, int]:
        """This thread's context for a launch it makes now (taken when the launch is made, not
        when a queued or collected launch is issued)."""
        source, call = getattr(self._context, "value", NO_CONTEXT)
        if not source and self.source_of is not None:
            source = self.source_of()
        return source, call

    @property
    def host(self) -> int:
        """The host's clock: when it will issue its next launch (queued launches issued first)."""
        self._settle()
        return self._host

    def launch_collective(self, core: int, op: str, cost: OpCost, after: int | None = None) -> tuple[int, int]:
        """Issue a collective's launch on ``core``'s :data:`COLLECTIVE_STREAM`: it starts once the
        work already issued on compute stream ``after`` (default: the core's current stream)
        has finished, as a collective waits for the data it sends, and overlaps what is issued
        after it."""
        with self._lock:
            arrival = self.issue_collective(core, after)
            return self.place_collective(core, op, cost, arrival, arrival)

    def issue_collective(self, core: int, after: int | None = None, lane: int = 0) -> int:
        """The host issues a collective on ``core`` whose start is not known yet (it waits for
        the other ranks of its group): queued and collected launches are issued first, the host
        pays the dispatch now, and the tick returned is the collective's *arrival* on this core:
        issued, the work already issued on compute stream ``after`` (default: the current
        stream) finished, and the core's earlier collectives on its CC stream ``lane`` done
        (:func:`collective_stream`: one CC stream by default, as the runtime runs; NxD's
        multistream mode puts FSDP/DP collectives on a second). :meth:`place_collective` puts
        it on the timeline once its start is known; until then reports keep this core's
        intervals from the arrival on open."""
        with self._lock:
            self._settle()
            c = self.cores[core]
            host = self._dispatch(c)
            for rec in self.recorders:
                rec.dispatches += 1
            ready = max(c.ready.get(collective_stream(lane), 0),
                        c.ready.get(c.current_stream if after is None else after, 0))
            arrival = ready if ready > host else host
            c.pending.append([arrival, max(0, host - max(ready, c.busy_until))])
            return arrival

    def cancel_collective(self, core: int, arrival: int) -> None:
        """Forget a collective issued by :meth:`issue_collective` that will not run (its group
        disagreed): the host keeps the dispatch it paid; nothing is placed."""
        with self._lock:
            c = self.cores[core]
            entry = next((p for p in c.pending if p[0] == arrival), None)
            if entry is not None:
                c.pending.remove(entry)

    def place_collective(self, core: int, op: str, cost: OpCost, start: int, arrival: int,
                         lane: int = 0) -> tuple[int, int]:
        """Put a collective issued by :meth:`issue_collective` (``arrival``: what it returned) on
        ``core``'s :data:`COLLECTIVE_STREAM` from ``start`` (ticks; no earlier than the arrival:
        when the last rank of the group arrived). The time between is the rank's wait for its
        peers. Kernels already placed keep their times; this launch absorbs the sharing of the
        core's DMA with them. Returns its (start, end) ticks."""
        with self._lock:
            self._settle()
            c = self.cores[core]
            entry = next((p for p in c.pending if p[0] == arrival), None)
            if entry is None:
                raise ValueError(f"no collective issued on core {core} arrives at tick {arrival}")
            c.pending.remove(entry)
            s = collective_stream(lane)
            start = max(start, arrival)
            end = self._book(c, core, s, op, cost, start, entry[1], arrival, self._launch_context(), start - arrival)
            if end > c.ready.get(s, 0):
                c.ready[s] = end
            if end > c.busy_until:
                c.busy_until = end
            if end > start:
                c.inflight.append(end)
            return start, end

    def launch(self, core: int, op: str, cost: OpCost, stream: int | None = None) -> tuple[int, int] | None:
        """Issue one launch of ``cost`` for ``op`` on ``core``'s ``stream`` (default: the core's
        current stream); returns its (start, end) ticks, or None when the launch was collected
        (inside :meth:`graph`/:meth:`muted`) or queued (adaptive eager) to be issued later."""
        with self._lock:
            self._drain()
            s = self.cores[core].current_stream if stream is None else stream
            ctx = self._launch_context()
            cap = getattr(self._local, "capture", None)
            if cap is not None:
                cap.append((core, op, cost, s, ctx))
                return None
            if self.adaptive:
                self._pending.append((core, op, cost, s, ctx))
                if len(self._pending) >= ADAPTIVE_QUEUE:
                    self._flush_pending()
                return None
            return self._issue(core, s, [(op, cost, ctx)])[0]

    def launch_graph(self, core: int, items: Sequence[tuple[str, OpCost]], stream: int | None = None
                     ) -> list[tuple[int, int]]:
        """Issue ``items`` ((op, cost) pairs) as one graph on ``core``'s ``stream``: the host pays
        one dispatch for all of them and the kernels run back to back, each starting when the one
        before it ends. Returns each kernel's (start, end) ticks."""
        with self._lock:
            self._settle()
            s = self.cores[core].current_stream if stream is None else stream
            ctx = self._launch_context()
            return self._issue(core, s, [(op, cost, ctx) for op, cost in items])

    def _dispatch(self, c: CoreTimeline) -> int:
        """The host dispatches one launch to core ``c``: it waits for room in the runtime's queue
        if it is full (for the oldest unfinished launch) and pays ``host.dispatch``; returns its
        new tick (the host ticks are counted in the reports)."""
        host = self._host
        if len(c.inflight) >= c.max_inflight:  # the runtime's queue is full: wait for the oldest
            oldest = c.inflight.popleft()
            if oldest > host:
                host = oldest
        host += self.dispatch
        for rec in self.recorders:
            rec.host_ticks += host - self._host
        self._host = host
        return host

    def _book(self, c: CoreTimeline, core: int, s: int, op: str, cost: OpCost, start: int, wait: int, host: int,
              ctx: tuple[str, int] = NO_CONTEXT, peer_wait: int = 0) -> int:
        """Place one kernel on stream ``s`` of ``c`` from ``start`` (stretched by sharing the core's
        engines with other streams' kernels) and record it; returns its end tick."""
        ticks = cost.ticks
        if s not in c.streams:
            c.streams.add(s)
        if len(c.streams) > 1:
            # collectives on two CC streams share the core's DMA inside the NeuronLink model
            # (simulated together): not stretched again here
            others = [b for b in c.bookings if b[0] != s and b[2] > start
                      and not (s <= COLLECTIVE_STREAM and b[0] <= COLLECTIVE_STREAM)]
            if others:
                ticks = shared_duration(ticks, cost.demand, others, start, self.lnc)
                if ticks > cost.ticks:
                    for rec in self.recorders:
                        rec.contention_ticks += ticks - cost.ticks
        end = start + ticks
        if ticks:
            c.bookings.append((s, start, end, cost.demand))
        self._record(core, s, op, cost, ticks, wait, host, start, end, ctx, peer_wait, c.fold_until(host))
        return end

    def _issue(self, core: int, s: int, items: list[tuple[str, OpCost, tuple[str, int]]]) -> list[tuple[int, int]]:
        """One host dispatch for ``items`` ((op, cost, context)) on stream ``s`` of ``core`` (one
        item: a plain launch)."""
        c = self.cores[core]
        host = self._dispatch(c)
        ready = c.ready.get(s, 0)
        t = ready if ready > host else host
        wait = host - max(ready, c.busy_until)
        if wait < 0:
            wait = 0
        if len(items) > 1 and (not c.streams or (len(c.streams) == 1 and s in c.streams)) \
                and all(r.events is None and r.sources is None for r in self.recorders):
            return self._issue_run(c, core, s, items, host, t, wait)
        return self._issue_each(c, core, s, items, host, t, wait)

    def _issue_each(self, c: CoreTimeline, core: int, s: int, items: list[tuple[str, OpCost, tuple[str, int]]],
                    host: int, t: int, wait: int) -> list[tuple[int, int]]:
        """:meth:`_issue`'s kernels booked and recorded one by one."""
        times = []
        for op, cost, ctx in items:
            start = t
            end = self._book(c, core, s, op, cost, start, wait, host, ctx)
            wait = 0  # kernels of one graph follow each other without the host
            times.append((start, end))
            t = end
        self._close_dispatch(c, s, times)
        return times

    def _close_dispatch(self, c: CoreTimeline, s: int, times: list[tuple[int, int]]) -> None:
        """After one dispatch's kernels (``times``: their (start, end)) are booked: stream ``s``
        of ``c`` is ready at the last end, the dispatch is in flight if it took time, and each
        recorder counts it (a graph launch when it held several kernels)."""
        t = times[-1][1]
        c.ready[s] = t
        if t > c.busy_until:
            c.busy_until = t
        if t > times[0][0]:
            c.inflight.append(t)
        graph = len(times) > 1
        for rec in self.recorders:
            rec.dispatches += 1
            rec.graph_launches += graph

    def _issue_run(self, c: CoreTimeline, core: int, s: int, items: list[tuple[str, OpCost, tuple[str, int]]],
                   host: int, t: int, wait: int) -> list[tuple[int, int]]:
        """:meth:`_issue`'s loop for a graph on a stream that has its core to itself, with no
        recorder keeping a trace or source lines: the kernels run back to back, none stretched,
        so their figures are summed per row and applied once per recorder, leaving the state and
        figures the per-kernel :meth:`_book` and :meth:`_record` leave."""
        c.streams.add(s)
        bookings = c.bookings
        times = []
        rows: dict[tuple[str, int], list[Any]] = {}
        wait0 = wait
        busy = 0
        for op, cost, _ctx in items:
            ticks = cost.ticks
            end = t + ticks
            if ticks:
                bookings.append((s, t, end, cost.demand))
                busy += ticks
            times.append((t, end))
            key = (op, id(cost))
            row = rows.get(key)
            if row is None:
                rows[key] = [cost, 1, ticks, wait]
            else:
                row[1] += 1
                row[2] += ticks
                row[3] += wait
            wait = 0  # kernels of one graph follow each other without the host
            t = end
        fold = c.fold_until(host)
        n = len(items)
        spans = [[lo, hi] for lo, hi in times if hi > lo]
        for rec in self.recorders:
            rec.add_rows((key, *row) for key, row in rows.items())
            tally = rec.cores.get(core)
            if tally is None:
                tally = rec.cores[core] = CoreTally()
            tally.launches += n
            tally.wait += wait0
            live = tally.open
            if spans and live and spans[0][0] < live[-1][1]:  # (an open interval overlaps: the general merge)
                for lo, hi in times:
                    tally.add(lo, hi, fold)
                continue
            if t > tally.last_end:
                tally.last_end = t
            if spans:  # CoreTally.add of each kernel after every open interval: one fold, then the intervals
                tally.ticks += busy
                while live and live[0][1] <= fold:
                    lo, hi = live.pop(0)
                    tally.busy += hi - lo
                live.extend([lo, hi] for lo, hi in spans)
        self._close_dispatch(c, s, times)
        return times

    def _record(self, core: int, s: int, op: str, cost: OpCost, ticks: int, wait: int, host: int, start: int,
                end: int, ctx: tuple[str, int] = NO_CONTEXT, peer_wait: int = 0, fold: int | None = None) -> None:
        key = (op, id(cost))
        source, call = ctx
        for rec in self.recorders:
            rec.fold()
            row = rec.rows.get(key)
            if row is None:
                rec.rows[key] = [cost, 1, ticks, wait, peer_wait]
            else:
                row[1] += 1
                row[2] += ticks
                row[3] += wait
                row[4] += peer_wait
            tally = rec.cores.get(core)
            if tally is None:
                tally = rec.cores[core] = CoreTally()
            tally.launches += 1
            tally.wait += wait
            tally.add(start, end, host if fold is None else fold)
            if rec.sources is not None and source:
                lines = rec.sources.get(key)
                if lines is None:
                    lines = rec.sources[key] = {}
                lines[source] = lines.get(source, 0) + ticks
            if rec.events is not None:
                rec.events.append(TraceEvent(core, s, op, cost.kernel, host, start, end, source, call, cost.reports))

    # ---- collecting launches: compiled graphs, values charged another way, adaptive eager --
    @contextlib.contextmanager
    def graph(self) -> Iterator[list[LaunchItem]]:
        """Collect the launches this thread makes inside the block and issue them, when it ends,
        as graph launches: one per run of consecutive launches on one (core, stream). A
        synchronisation inside the block issues what was collected so far first."""
        with self._collect(keep=True) as cap:
            yield cap

    @contextlib.contextmanager
    def muted(self) -> Iterator[list[LaunchItem]]:
        """Discard the launches this thread makes inside the block (their cost is charged some
        other way, e.g. as one fused kernel)."""
        with self._collect(keep=False) as cap:
            yield cap

    @contextlib.contextmanager
    def recorded(self) -> Iterator[tuple[list[LaunchItem], dict[str, int]]]:
        """Learn what a computation launches without issuing or counting any of it: yields
        (launches, host-op counts) that this thread's launches and host ops inside the block fill,
        in order, when it ends. What the launch log holds from before the block is issued first
        (queued and collected launches stay where they are: a graph capture around the block, or
        adaptive eager's queue, is not cut short). A caller replays the list where the computation
        would have run (a fused op whose values are computed another way, charged exactly as its
        ops would have been). Other threads' launches and host ops are issued and counted as
        usual: the block's are told apart by its capture's token, in the launch log too."""
        with self._lock:
            self._drain()
        launches: list[LaunchItem] = []
        hosts: dict[str, int] = {}
        with self._collect(keep=False, hosts=hosts) as cap:
            try:
                yield launches, hosts
            finally:
                with self._lock:
                    self._drain()  # (the log's share of the block: into cap and hosts)
                    launches.extend(cap)

    @contextlib.contextmanager
    def _collect(self, keep: bool, hosts: dict[str, int] | None = None) -> Iterator[list[LaunchItem]]:
        cap = Capture(keep, hosts)
        prev = getattr(self._local, "capture", None)
        with self._lock:  # (what the log holds from before the block stays ahead of the block's launches in it)
            self._next_token += 1
            cap.token = self._next_token
            self._tokens[cap.token] = cap
        self._local.capture = cap
        log = self._log
        learning = getattr(log, "learning", None) if hosts is not None else None
        if learning is not None:
            learning(cap.token, True)  # (the log's native prefixes leave this block's host ops to the loop)
        if log is not None:
            log.capture(cap.token)  # this thread's logged launches are collected in cap
        try:
            yield cap
        finally:
            if self._log is not None:
                self._log.capture(0 if prev is None else prev.token)
            self._local.capture = prev
            with self._lock:
                # every launch of the block still in the log (none collected here): the log ends the
                # capture in its place, where the launches are issued (or, muted, dropped) when it is drained
                close = getattr(self._log, "close", None) if not cap else None
                if close is not None and close(cap.token, cap.keep):
                    self._closed.append(cap.token)
                else:
                    self._drain()  # (what the log holds of this block, into cap)
                    self._settle_capture(cap)
                    del self._tokens[cap.token]
                if learning is not None:
                    learning(cap.token, False)

    def _settle_capture(self, cap: "Capture") -> None:
        """Issue (or drop) what ``cap`` collected so far, as graph launches."""
        items, cap[:] = list(cap), []
        if cap.keep:
            for core, s, run in stream_runs(items):
                self._issue(core, s, run)

    def set_adaptive(self, enabled: bool) -> None:
        """Turn adaptive eager on or off (off issues what is queued first)."""
        with self._lock:
            self._drain()
            self._flush_pending()
            self.adaptive = bool(enabled)
            self._update_gate()

    def _flush_pending(self) -> None:
        """Issue adaptive eager's queue: a run seen before as one graph launch (a replay), a new
        one launch by launch (its capture), remembered for next time."""
        items, self._pending = self._pending, []
        for core, s, run in stream_runs(items):
            key = (core, s, tuple((op, id(cost)) for op, cost, _ in run))
            if len(run) > 1 and key in self._replays:
                self._issue(core, s, run)
                continue
            for item in run:
                self._issue(core, s, [item])
            if len(run) > 1:
                self._replays[key] = [cost for _, cost, _ in run]  # keeps the costs (and their ids) alive

    def _settle(self) -> None:
        """Before anything that reads or waits on time: issue logged, queued and collected launches."""
        self._drain()
        if self._pending:
            with self._lock:
                self._flush_pending()
        cap = getattr(self._local, "capture", None)
        if cap:
            with self._lock:
                self._settle_capture(cap)

    def host_op(self, op: str) -> None:
        """Count a metadata-only op: it runs on the host alone (no launch, no device time)."""
        self.host_ops({op: 1})

    def host_ops(self, counts: dict[str, int]) -> None:
        """:meth:`host_op` for ``counts[op]`` ops of each name, counted at once (one drain: a host
        op has no time, so the counts a recorder ends with do not depend on where they fall among
        the launches made around them)."""
        cap = getattr(self._local, "capture", None)
        if cap is not None and cap.hosts is not None:  # inside Device.recorded: learned, not counted
            for name, n in counts.items():
                cap.hosts[name] = cap.hosts.get(name, 0) + n
            return
        with self._lock:
            self._drain()
            for rec in self.recorders:
                rec.count_host_ops(counts.items())

    def note_compile(self, seconds: float) -> None:
        """Record one graph compiled in ``seconds`` of wall time (reported, never charged)."""
        with self._lock:
            for rec in self.recorders:
                rec.compiled_graphs += 1
                rec.compile_seconds += seconds

    def synchronize(self, core: int | None = None, stream: int | None = None) -> None:
        """The host waits until ``stream`` of ``core`` (every stream; every core) has finished."""
        with self._lock:
            self._settle()
            cores = self.cores if core is None else [self.cores[core]]
            for c in cores:
                ready = c.ready.values() if stream is None else [c.ready.get(stream, 0)]
                self._host = max(self._host, *ready)

    def wait_host_until(self, tick: int) -> None:
        """The host waits until simulated time ``tick`` (an event's synchronize)."""
        with self._lock:
            self._settle()
            if tick > self._host:
                self._host = tick

    def stream_ready(self, core: int, stream: int) -> int:
        """When the last work issued on ``stream`` of ``core`` finishes."""
        self._settle()
        return self.cores[core].ready.get(stream, 0)

    def stream_wait(self, core: int, stream: int, tick: int) -> None:
        """Work issued later on ``stream`` of ``core`` starts no earlier than ``tick``."""
        with self._lock:
            self._settle()
            c = self.cores[core]
            c.ready[stream] = max(c.ready.get(stream, 0), tick)

    def now(self, core: int | None = None) -> int:
        """The latest simulated time the host or any work on ``core`` (every core) reaches."""
        self._settle()
        cores = self.cores if core is None else [self.cores[core]]
        return max([self._host, *(t for c in cores for t in c.ready.values())])

    # ---- reports ---------------------------------------------------------------------------
    def open_scope(self, trace: bool = False, sources: bool = False) -> Recorder:
        """Start recording launches from now (a report scope); close it with :meth:`close_scope`."""
        with self._lock:
            self._settle()
            rec = Recorder(self._host, trace, sources)
            self.recorders.append(rec)
            return rec

    def close_scope(self, rec: Recorder) -> RunReport:
        with self._lock:
            self._settle()
            self.recorders.remove(rec)
            return self.report(rec)

    def reset(self, trace: bool = False, sources: bool | None = None) -> None:
        """Start the whole-run recorder afresh (``trace``: keep every launch for a timeline;
        ``sources``: each row's device time per source line; None keeps the current choice, so a
        program's own reset does not undo what its runner asked for)."""
        with self._lock:
            self._settle()
            if sources is None:
                sources = self.recorders[0].sources is not None
            self.recorders[0] = Recorder(self._host, trace, sources)

    def report(self, rec: Recorder | None = None) -> RunReport:
        """The :class:`RunReport` of ``rec`` (default: the whole run since start or reset)."""
        with self._lock:
            self._settle()
            return self._build_report(rec or self.recorders[0])

    def _build_report(self, rec: Recorder) -> RunReport:
        cfg = self.config
        hz = cfg.tick_hz
        peak = cfg.peak_flops_per_core("bf16") * self.lnc  # a logical core: its physical cores' peak
        acc: dict[tuple[str, str], dict[str, Any]] = {}
        rec.fold()
        for (op, cid), (cost, calls, ticks, wait, peer_wait) in rec.rows.items():
            a = acc.get((op, cost.kernel))
            if a is None:
                a = acc[(op, cost.kernel)] = {"generic": cost.generic, "calls": 0, "ticks": 0, "wait": 0,
                                              "lane_ticks": 0, "busy": {}, "hbm": 0, "flops": 0, "eflops": 0, "fused": (),
                                              "eager_launches": 0, "eager_hbm": 0, "eager_ticks": 0,
                                              "hbm_read": 0, "hbm_write": 0, "dma": 0, "sources": {}, "coll": None}
            for line, t in (rec.sources or {}).get((op, cid), {}).items():
                a["sources"][line] = a["sources"].get(line, 0) + t
            a["hbm_read"] += calls * cost.hbm_read_bytes
            a["hbm_write"] += calls * cost.hbm_write_bytes
            a["dma"] += calls * cost.dma_bytes
            a["calls"] += calls
            a["ticks"] += ticks
            a["wait"] += wait
            if cost.collective is not None:
                info = cost.collective
                co = a["coll"]
                if co is None:
                    co = a["coll"] = {"collective": info.collective, "algorithm": info.algorithm, "ranks": info.ranks,
                                      "bytes": 0, "net": 0, "alone": 0, "peer": 0, "bus_bytes": 0.0, "bound": {}}
                co["bytes"] += calls * info.nbytes
                co["net"] += calls * info.network_ticks
                co["alone"] += calls * (info.network_ticks if info.alone_ticks < 0 else info.alone_ticks)
                co["peer"] += peer_wait
                co["bus_bytes"] += calls * info.nbytes * info.busbw_factor
                co["bound"][info.bound] = co["bound"].get(info.bound, 0) + calls * info.network_ticks
            a["lane_ticks"] += ticks * cost.cores
            for name, t in cost.busy.items():
                a["busy"][name] = a["busy"].get(name, 0) + calls * t
            a["hbm"] += calls * cost.hbm_bytes
            a["flops"] += calls * cost.matmul_flops
            a["eflops"] += calls * cost.engine_flops
            if cost.region is not None:
                a["fused"] = cost.region.ops
                a["eager_launches"] += calls * cost.region.eager_launches
                a["eager_hbm"] += calls * cost.region.eager_hbm_bytes
                a["eager_ticks"] += calls * cost.region.eager_ticks
        device_ticks = sum(a["ticks"] for a in acc.values())
        rows = []
        for (op, kernel), a in acc.items():
            lane = a["lane_ticks"]
            engines = {n: 100.0 * b / lane for n, b in a["busy"].items()} if lane else {}
            seconds = a["ticks"] / hz
            bound = "launch" if a["wait"] >= a["ticks"] else busiest(engines)
            co = a["coll"]
            coll = None
            if co is not None:
                net_s = co["net"] / hz
                coll = CollectiveStats(collective=co["collective"], algorithm=co["algorithm"], ranks=co["ranks"],
                                       bytes=co["bytes"], network_us=net_s * 1e6, peer_wait_us=co["peer"] / hz * 1e6,
                                       busbw=co["bus_bytes"] / net_s if net_s else 0.0,
                                       alone_us=co["alone"] / hz * 1e6)
                top = max(co["bound"].values())
                bound = min(k for k, v in co["bound"].items() if v == top)  # where most of its model time went
            rows.append(OpRow(
                op=op, kernel=kernel, generic=a["generic"], calls=a["calls"], time_us=seconds * 1e6,
                share_percent=100.0 * a["ticks"] / device_ticks if device_ticks else 0.0,
                host_wait_us=a["wait"] / hz * 1e6, engine_percent=engines, hbm_bytes=a["hbm"],
                matmul_flops=a["flops"], mfu_percent=100.0 * a["flops"] / (peak * seconds) if seconds else 0.0,
                bound=bound, fused_ops=a["fused"], eager_launches=a["eager_launches"],
                eager_hbm_bytes=a["eager_hbm"], eager_time_us=a["eager_ticks"] / hz * 1e6,
                engine_flops=a["eflops"], hbm_read_bytes=a["hbm_read"], hbm_write_bytes=a["hbm_write"],
                dma_bytes=a["dma"],
                source_line=min(a["sources"].items(), key=lambda kv: (-kv[1], kv[0]))[0] if a["sources"] else "",
                collective=coll))
        rows.sort(key=lambda r: (-r.time_us, r.op, r.kernel))
        end = max([self._host, *(t.last_end for t in rec.cores.values())])
        elapsed = end - rec.start
        cores = {i: CoreStats(elapsed_us=(t.last_end - rec.start) / hz * 1e6, busy_us=t.busy_ticks() / hz * 1e6,
                              host_wait_us=t.wait / hz * 1e6, launches=t.launches, device_us=t.ticks / hz * 1e6)
                 for i, t in sorted(rec.cores.items())}
        flops = sum(r.matmul_flops for r in rows)
        span = elapsed / hz * max(1, len(cores))
        return RunReport(
            config=cfg.name, rows=tuple(rows), host_ops=dict(sorted(rec.host_ops.items())), cores=cores,
            elapsed_us=elapsed / hz * 1e6, device_us=device_ticks / hz * 1e6, host_us=rec.host_ticks / hz * 1e6,
            host_wait_us=sum(t.wait for t in rec.cores.values()) / hz * 1e6,
            launches=sum(r.calls for r in rows), hbm_bytes=sum(r.hbm_bytes for r in rows), matmul_flops=flops,
            mfu_percent=100.0 * flops / (peak * span) if span else 0.0,
            events=tuple(rec.events or ()), tick_hz=hz, dispatches=rec.dispatches,
            graph_launches=rec.graph_launches, compiled_graphs=rec.compiled_graphs,
            compile_seconds=rec.compile_seconds, engine_flops=sum(r.engine_flops for r in rows),
            contention_us=rec.contention_ticks / hz * 1e6)
