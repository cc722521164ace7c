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
  the engines a transfer spreads its CC packets on (as many as it has packets, up to all).

These are computed from the system config with closed-form step counts and sizes and static
routes; the simulator is not consulted. Where the assumptions hold (every flow of a step keeps
its share from start to end, each rank's HBM its own) the simulation must agree; where flows of
unequal load share a link, or a step's flows finish at different times, the simulation differs
and says how (the fidelity benchmark prints both).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..config import SystemConfig
from .algorithms import Context, _levels_lanes, _pairs, hierarchy_groups
from .report import AlphaBetaEstimate, EstimateStep
from .topology import Topology

__all__ = ["estimate_resolved", "Rates"]


class Rates:
    """The figures the estimate uses, from the system config."""

    def __init__(self, system: SystemConfig, topo: Topology):
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

    def flows(self, flows: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, int]:
        """For concurrent flows ``(src rank, dst rank, bytes)``: the worst α (seconds), the bytes
        and bandwidth of the busiest link direction (0, 0 when every flow stays on its chip) and
        the most flows on one link. Flows between the same two chips count once per flow: the
        ranks of a chip that talk to another chip at once share its links."""
        alpha_ps = 0
        load: dict[Any, float] = {}
        count: dict[Any, int] = {}
        topo = self.topo
        for a, b, nb in flows:
            route = topo.route(topo.chip_of(a), topo.chip_of(b))
            alpha_ps = max(alpha_ps, topo.route_latency(route))
            for k in route:
                load[k] = load.get(k, 0.0) + nb
                count[k] = count.get(k, 0) + 1
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
        # a transfer spreads over as many of a core's engines as it has packets; a rank's
        # concurrent transfers take further engines
        lnc = self.system.chip.chip.lnc
        per_core = self.engines // lnc
        biggest = max((nb for _, _, nb in flows), default=0.0)
        each = min(per_core, max(1, math.ceil(biggest / lnc / self.packet)))
        out: dict[int, int] = {}
        for a, b, _ in flows:
            out[a] = out.get(a, 0) + 1
            if fused:
                out[b] = out.get(b, 0) + 1
        used = min(per_core, each * max(out.values(), default=1)) * lnc
        return EstimateStep(label, alpha, link, bw, hbm, self.hbm, dma, used * self.engine_bw, repeat, max(1, nflows))


Lanes = Sequence[tuple[Sequence[int], float]]


def _ring(r: Rates, kind: str, lanes: Lanes, bidir: bool, label: str) -> list[EstimateStep]:
    lanes = [(list(o), t) for o, t in lanes if len(o) > 1]
    if not lanes:
        return []
    p = len(lanes[0][0])
    m = lanes[0][1] / p
    share = 0.5 if bidir else 1.0
    flows = [(o[i], o[(i + 1) % len(o)], share * t / len(o)) for o, t in lanes for i in range(len(o))]
    if bidir:
        flows += [(o[(i + 1) % len(o)], o[i], share * t / len(o)) for o, t in lanes for i in range(len(o))]
    acc = r.acc
    out: list[EstimateStep] = []
    if kind in ("rs", "ar"):
        if p == 2:
            out.append(r.step(f"{label} RS", flows, 3 * m, m + m / acc, fused=True))
        else:
            out.append(r.step(f"{label} RS first", flows, 2 * m, m))
            if p > 3:
                out.append(r.step(f"{label} RS", flows, 3 * m, m / acc, p - 3))
            out.append(r.step(f"{label} RS last", flows, 4 * m, 2 * m / acc, fused=True))
    if kind in ("ag", "ar"):
        out.append(r.step(f"{label} AG", flows, 2 * m, m, p - 1))
    return out


def _rdh(r: Rates, kind: str, lanes: Lanes, label: str) -> list[EstimateStep]:
    lanes = [(sorted(o), t) for o, t in lanes if len(o) > 1]
    if not lanes:
        return []
    p = len(lanes[0][0])
    total = lanes[0][1]
    L = int(math.log2(p))
    rs, ag = [], []
    for k in range(L):
        m = total / 2 ** (k + 1)
        flows = [(o[i], o[i ^ (1 << k)], t / 2 ** (k + 1)) for o, t in lanes for i in range(len(o))]
        rs.append(r.step(f"{label} RS d={1 << k}", flows, 3 * m, m + m / r.acc, fused=True))
        ag.append(r.step(f"{label} AG d={1 << k}", flows, 2 * m, m))
    return (rs if kind in ("rs", "ar") else []) + (list(reversed(ag)) if kind in ("ag", "ar") else [])


def _mesh(r: Rates, kind: str, lanes: Lanes, label: str) -> list[EstimateStep]:
    lanes = [(list(o), t) for o, t in lanes if len(o) > 1]
    if not lanes:
        return []
    p = len(lanes[0][0])
    m = lanes[0][1] / p
    flows = [(a, b, t / len(o)) for o, t in lanes for a in o for b in o if a != b]
    out = []
    if kind in ("rs", "ar"):
        out.append(r.step(f"{label} RS", flows, 3 * (p - 1) * m, (p - 1) * m * (1 + 1 / r.acc), fused=True))
    if kind in ("ag", "ar"):
        out.append(r.step(f"{label} AG", flows, 2 * (p - 1) * m, (p - 1) * m))
    return out


def _flat(r: Rates, kind: str, algo: str, lanes: Lanes, label: str) -> list[EstimateStep]:
    if algo in ("ring", "bidir-ring"):
        return _ring(r, kind, lanes, algo == "bidir-ring", label)
    if algo == "rdh":
        return _rdh(r, kind, lanes, label)
    return _mesh(r, kind, lanes, label)


def _kanga(r: Rates, ctx: Context) -> list[EstimateStep]:
    pairs = _pairs(ctx) or []
    prim = r.topo.ring_order([a for a, _ in pairs])
    q, p = len(prim), ctx.p
    n = float(ctx.nbytes)
    m = n / p
    acc = r.acc
    ring = [(prim[i], prim[(i + 1) % q], m) for i in range(q)] + [(prim[(i + 1) % q], prim[i], m) for i in range(q)]
    swap = [(a, b, m) for a, b in pairs] + [(b, a, m) for a, b in pairs]
    out: list[EstimateStep] = []
    c = ctx.collective
    if c == "all-gather":
        out.append(r.step("pair swap", swap, 2 * m, m))
    if c in ("reduce-scatter", "all-reduce"):
        if q == 2:
            out.append(r.step("ring RS", ring, 6 * m, 4 * m / acc, fused=True))
        else:
            out.append(r.step("ring RS first", ring, 4 * m, 2 * m / acc))
            if q > 3:
                out.append(r.step("ring RS", ring, 6 * m, 2 * m / acc, q - 3))
            out.append(r.step("ring RS last", ring, 8 * m, 4 * m / acc, fused=True))
        share = m if c == "reduce-scatter" else 2 * m
        out.append(r.step("pair copy", [(a, b, share) for a, b in pairs], share, share))
    if c in ("all-gather", "all-reduce"):
        out.append(r.step("ring AG", ring, 4 * m, 2 * m, q - 1))
    return out


def _compose(r: Rates, ctx: Context, groups: Sequence[Sequence[int]], algos: Sequence[str]) -> list[EstimateStep]:
    assert ctx.shape is not None
    sizes = [math.prod(len(ctx.shape.values[i]) for i in g) for g in groups]
    lanes = [_levels_lanes(ctx, g) for g in groups]
    names = ["+".join(ctx.topo.level_names[i] for i in g) for g in groups]
    out: list[EstimateStep] = []
    n = float(ctx.nbytes)
    c = ctx.collective

    def ph(kind: str, k: int, data: float) -> list[EstimateStep]:
        return _flat(r, kind, algos[k], [(v, data) for v in lanes[k]], names[k])

    if c == "all-reduce":
        data = n
        for k in range(len(groups) - 1):
            out += ph("rs", k, data)
            data /= sizes[k]
        out += ph("ar", len(groups) - 1, data)
        for k in reversed(range(len(groups) - 1)):
            data *= sizes[k]
            out += ph("ag", k, data)
    elif c == "reduce-scatter":
        data = n
        for k in range(len(groups)):
            out += ph("rs", k, data)
            data /= sizes[k]
    else:
        data = n / math.prod(sizes)
        for k in reversed(range(len(groups))):
            data *= sizes[k]
            out += ph("ag", k, data)
    return out


def _rooted(r: Rates, ctx: Context, algo: str) -> list[EstimateStep]:
    order = list(ctx.order)
    i0 = order.index(ctx.root)
    order = order[i0:] + order[:i0]
    p = len(order)
    n = float(ctx.nbytes)
    red = ctx.collective == "reduce"
    acc = r.acc
    if p < 2:
        return []
    if algo == "mesh":
        flows = [(b, order[0], n) if red else (order[0], b, n) for b in order[1:]]
        return [r.step("direct", flows, (p - 1) * n * (2 if red else 1), (p - 1) * n * (1 / acc if red else 1),
                       fused=red)]
    if algo == "rdh":
        out = []
        for k in range((p - 1).bit_length()):
            flows = [(order[i], order[i + (1 << k)], n) for i in range(1 << k) if i + (1 << k) < p]
            out.append(r.step(f"tree d={1 << k}", flows, 2 * n if red else n, n / acc if red else n, fused=red))
        return out
    coll = ctx.system.collectives
    segs = max(1, min(coll.pipeline_segments, -(-ctx.nbytes // coll.packet_bytes)))
    seg = n / segs
    # a pipeline: every hop once to fill it (each at its own speed), then segs-1 more at the
    # slowest hop's pace: T = sum_h t_h + (segs - 1) max_h t_h
    # (filling, a hop's ends touch their own HBM once - a reduce's sender twice, the root's fused
    # add twice; in the steady state a middle rank receives one segment while it sends the last)
    chain = list(reversed(order)) if red else order
    hops = []
    for h in range(p - 1):
        last = h == p - 2
        if red:
            hbm, dma = max(2 if h else 1, 2 if last else 1) * seg, (seg / acc if h else seg) + (seg / acc if last else 0)
        else:
            hbm, dma = seg, seg
        hops.append(r.step(f"chain hop {h}", [(chain[h], chain[h + 1], seg)], hbm, dma, fused=red and last))
    if segs > 1:
        flows = [(chain[h], chain[h + 1], seg) for h in range(p - 1)]
        hops.append(r.step("chain, steady", flows, (3 if red else 2) * seg if p > 2 else hops[0].hbm_bytes,
                           seg / acc if red else seg, segs - 1))
    return hops


def _a2a(r: Rates, ctx: Context, algo: str) -> list[EstimateStep]:
    order = list(ctx.order)
    p = len(order)
    m = ctx.nbytes / p
    if p < 2:
        return []
    if algo == "mesh":
        flows = [(a, b, m) for a in order for b in order if a != b]
        return [r.step("direct", flows, 2 * (p - 1) * m, (p - 1) * m)]
    return [r.step(f"shift {k}", [(order[i], order[(i + k) % p], m) for i in range(p)], 2 * m, m)
            for k in range(1, p)]


_FORMS = {
    "ring": "RS: (p-1) steps of n/p, AG: (p-1) steps of n/p; a step = α + max(link, HBM, DMA)",
    "bidir-ring": "as ring, with n/2 on each of two opposite rings: the link term halves",
    "rdh": "log2(p) steps, n/2 .. n/p (RS) and back (AG); binomial tree of log2(p) steps of n (broadcast/reduce)",
    "mesh": "one step per phase: (p-1) pieces of n/p in and out of every rank, spread over the chip's links",
    "kangaring": "(p/2-1) ring steps over the primaries per phase, plus one on-chip pair step",
    "per-dim-ring": "a ring per level: RS up the levels on n, n/p0, ..., AR on the last, AG back down",
    "hierarchical": "intra-chip, intra-instance, inter-instance phases, each by the size rule",
}


def estimate_resolved(system: SystemConfig, res: Any) -> AlphaBetaEstimate:
    """The α-β estimate of a resolved call (see :func:`trnsim.collectives.estimate_collective`)."""
    from .algorithms import _KIND
    from .select import flat_choice

    ctx: Context = res.ctx
    algo: str = res.algorithm
    r = Rates(system, ctx.topo)
    c = ctx.collective
    steps: list[EstimateStep] = []
    if ctx.p > 1:
        if c in _KIND:
            kind = _KIND[c]
            if algo == "kangaring":
                steps = _kanga(r, ctx)
            elif algo == "per-dim-ring":
                assert ctx.shape is not None
                spanned = ctx.shape.spanned()
                algos = ["bidir-ring" if lv > 0 and ctx.topo.dims[lv - 1].kind == "ring" and len(ctx.shape.values[lv]) > 2
                         else "ring" for lv in spanned]
                steps = _compose(r, ctx, [[lv] for lv in spanned], algos)
            elif algo == "hierarchical":
                assert ctx.shape is not None
                groups = hierarchy_groups(ctx)
                algos, data = [], ctx.nbytes
                for g in groups:
                    size = math.prod(len(ctx.shape.values[i]) for i in g)
                    algos.append(flat_choice(system, data, size, ctx.topo, g)[0])
                    if c != "all-gather":
                        data //= size
                steps = _compose(r, ctx, groups, algos)
            else:
                steps = _flat(r, kind, algo, [(ctx.order, float(ctx.nbytes))], algo)
        elif c == "all-to-all":
            steps = _a2a(r, ctx, algo)
        elif c in ("broadcast", "reduce"):
            steps = _rooted(r, ctx, algo)
        else:
            srcs = [a for a, _ in ctx.pairs]
            dsts = [b for _, b in ctx.pairs]
            both = max(srcs.count(x) + dsts.count(x) for x in set(srcs + dsts))
            steps = [r.step("direct", [(a, b, ctx.nbytes) for a, b in ctx.pairs], both * ctx.nbytes,
                            max(srcs.count(x) for x in srcs) * ctx.nbytes)]
    assumptions = ("every flow of a step moves at once at its share of the links it crosses; each rank's HBM "
                   "share and DMA engines its own; flows do not wait for one another within a step; no other traffic")
    return AlphaBetaEstimate(c, algo, ctx.p, ctx.nbytes, tuple(steps), _FORMS.get(algo, ""), assumptions)
