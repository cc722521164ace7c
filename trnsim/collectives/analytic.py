"""The α-β estimate of a collective call: the closed forms, to check the simulation against.

Each algorithm's time is a sum over its steps of ``α + max(link, HBM, DMA)`` (Thakur,
Rabenseifner & Gropp 2005; notes/collectives.md §5), where for one step

* ``α`` = DMA start latency + completion latency + one descriptor + the hop latencies of the
  step's longest route;
* *link* = bytes the step's flows put on the busiest link direction (from their dimension-order
  routes) / its bandwidth. A textbook form has one flow per link; here the flows of a chip's
  ranks that leave it at once, or routes that overlap, add up;
* *HBM* = bytes a rank's HBM share moves in the step (every read and write: a ring
  reduce-scatter step reads two operands and writes one) / that share;
* *DMA* = bytes a rank's DMA engines move, an add costing ``1/dma_accumulate_rate`` copies, over
  the ``dma_rings`` engines per core each of its concurrent transfers spreads over;
* the runtime (:mod:`trnsim.collectives.runtime`): ``launch`` once, and per step the handshake
  (``step_sync``), the busiest CC core's issues (``issue`` per transfer it sends) and the
  busiest proxy thread's turns (``efa_proxy`` per transfer over EFA), all in ``α``.

Each algorithm's steps come from its own record (:mod:`trnsim.collectives.algorithms`); this
module holds the rates they are priced at. These are computed from the system config with closed-form step counts and sizes and static
routes; the simulator is not consulted. Where the assumptions hold (every flow of a step keeps
its share from start to end, each rank's HBM its own) the simulation must agree; where flows of
unequal load share a link, or a step's flows finish at different times, the simulation differs
and says how (tests/collectives/test_collective_forms.py checks both).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..config import SystemConfig
from .algorithms import ALGORITHMS, Context, estimate_steps
from .report import AlphaBetaEstimate, EstimateStep
from .runtime import RuntimeCosts
from .topology import Topology

__all__ = ["estimate_resolved", "Rates"]


class Rates:
    """The figures the estimate uses, from the system config."""

    def __init__(self, system: SystemConfig, topo: Topology, collective: str = "all-reduce"):
        cfg = system.chip
        self.topo = topo
        self.system = system
        dma = cfg.core.dma
        # a transfer's fixed cost: start, completion, and its first descriptor on an engine
        self.fixed_ps = dma.start_latency + dma.transfer_latency + dma.descriptor_overhead
        self.hbm = cfg.chip.hbm.bandwidth / system.ranks_per_chip  # one rank's HBM share, bytes/s
        self.engines = dma.engines * cfg.chip.lnc  # one rank's DMA engines
        self.engine_bw = dma.engine_bandwidth
        self.dma = self.engines * self.engine_bw  # bytes/s
        self.packet = system.collectives.packet_bytes
        vector = system.collectives.reduce_engine == "vector"
        self.acc = 1.0 if vector else system.collectives.dma_accumulate_rate
        self.runtime = RuntimeCosts.of(system)
        self.rings = self.runtime.rings(collective)  # DMA rings per core the call holds

    def flows(self, flows: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, int]:
        """For concurrent flows ``(src rank, dst rank, bytes)``: the worst α (seconds), the bytes
        and bandwidth of the busiest link direction (0, 0 when every flow stays on its chip) and
        the most flows on one link. Flows between the same two chips count once per flow: the
        ranks of a chip that talk to another chip at once share its links."""
        alpha_ps = 0
        load: dict[Any, float] = {}
        count: dict[Any, int] = {}
        topo = self.topo
        rt = self.runtime
        sent: dict[int, int] = {}  # transfers each rank's CC core issues in the step
        proxied: dict[int, int] = {}  # transfers each proxy thread drives in the step
        dims = self.system.topology
        for a, b, nb in flows:
            route = topo.route(topo.chip_of(a), topo.chip_of(b))
            alpha_ps = max(alpha_ps, topo.route_latency(route))
            sent[a] = sent.get(a, 0) + 1
            if any(dims[k[0]].proxy for k in route):
                thread = a // rt.ranks_per_proxy
                proxied[thread] = proxied.get(thread, 0) + 1
            for k in route:
                load[k] = load.get(k, 0.0) + nb
                count[k] = count.get(k, 0) + 1
        # the runtime: issues one after another, the handshake, the proxy thread's turns
        alpha_ps += (rt.issue_ps * max(sent.values(), default=0) + rt.step_sync_ps
                     + rt.efa_proxy_ps * max(proxied.values(), default=0))
        alpha = (self.fixed_ps + alpha_ps) * 1e-12
        if not load:
            return alpha, 0.0, 0.0, 0
        k = max(load, key=lambda x: load[x] / topo.link_bandwidth(x))
        return alpha, load[k], float(topo.link_bandwidth(k)), max(count.values())

    def step(self, label: str, flows: Sequence[tuple[int, int, float]], hbm: float, dma: float,
             repeat: int = 1, fused: bool = False) -> EstimateStep:
        """A step of concurrent ``flows``; ``hbm`` and ``dma`` are the busiest rank's bytes.
        ``fused``: each flow's receiver adds it as it lands, on its own DMA engines."""
        alpha, link, bw, nflows = self.flows(flows)
        # a collective's transfers on a rank share the dma_rings engines it holds on each core
        used = self.rings * self.system.chip.chip.lnc
        return EstimateStep(label, alpha, link, bw, hbm, self.hbm, dma, used * self.engine_bw, repeat, max(1, nflows))


def estimate_resolved(system: SystemConfig, res: Any) -> AlphaBetaEstimate:
    """The α-β estimate of a resolved call (see :func:`trnsim.collectives.estimate_collective`)."""
    ctx: Context = res.ctx
    algo: str = res.algorithm
    rates = Rates(system, ctx.topo, ctx.collective)
    steps = estimate_steps(rates, ctx, algo)
    if rates.runtime.launch_ps:  # the event model launches a call with no steps too (one rank)
        steps.insert(0, EstimateStep("launch", rates.runtime.launch_ps * 1e-12, 0.0, 0.0, 0.0, rates.hbm, 0.0,
                                     rates.dma))
    assumptions = ("every flow of a step moves at once at its share of the links it crosses; each rank's HBM "
                   "share and DMA engines its own; flows do not wait for one another within a step; no other traffic")
    return AlphaBetaEstimate(ctx.collective, algo, ctx.p, ctx.nbytes, tuple(steps), ALGORITHMS[algo].formula,
                             assumptions)
