"""The flat algorithms: ``ring``, ``bidir-ring``, ``rdh`` and ``mesh``, each as a message
schedule and as its α-β estimate, side by side.

Every builder emits transfers into a :class:`~trnsim.collectives.schedule.Schedule` over
*lanes*: ``(ranks in order, bytes)`` pairs that run in lockstep. A bidirectional ring is two
lanes (the order and its reverse, half the bytes each); one phase of a per-dimension algorithm is
one lane per line of the grid. The estimate blocks take the same lanes, so the composed
algorithms (:mod:`.compose`) reuse both halves.

``ring``        p-1 steps per phase of n/p; all-reduce = reduce-scatter + all-gather.
``bidir-ring``  two rings in opposite directions on half the bytes each.
``rdh``         recursive halving (reduce-scatter: partner distance 1, 2, 4, ..., intra-chip bits
                first) and doubling (all-gather: the reverse, inter-chip first); Rabenseifner's
                all-reduce; a binomial tree for broadcast and reduce. Power-of-two groups.
``mesh``        direct: every rank writes every other rank at once (routes and over-subscription
                are the network's); all-reduce = mesh reduce-scatter + mesh all-gather.

All four also run all-to-all (``mesh``: direct writes; the others: pairwise exchange, one peer
per step), broadcast and reduce (``rdh``: a binomial tree; ``mesh``: the root's direct writes;
``ring``: a pipelined chain), send/recv and permute (direct writes).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Callable, Sequence

from ..schedule import Schedule, pieces
from .base import KINDS, Algorithm, Context, Lane, bidir, check_pow2, no_check

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS", "phase", "phase_estimate", "ring_reduce_scatter", "ring_all_gather", "ring_steps"]

ELanes = Sequence[tuple[Sequence[int], float]]


# ---------------------------------------------------------------------------------------------
# schedules over lanes
# ---------------------------------------------------------------------------------------------


def ring_steps(s: Schedule, lanes: Sequence[Lane], itemsize: int,
               send: Callable[[int, int, int, int, int, list[int]], None]) -> None:
    """Run ring steps in lockstep over ``lanes``: at step k every rank i of a lane of p ranks
    calls ``send(k, p, i, rank, next rank, pieces)``; a lane of p ranks takes p-1 steps."""
    work = [(tuple(o), pieces(total, len(o), itemsize)) for o, total in lanes if len(o) > 1]
    steps = max((len(o) for o, _ in work), default=1) - 1
    keep = s.keep  # a schedule on orbit representatives: the other ranks' sends are not written
    at = [range(len(o)) if keep is None else [i for i, r in enumerate(o) if r in keep] for o, _ in work]
    for k in range(steps):
        s.begin_step()
        for (order, pc), idx in zip(work, at):
            p = len(order)
            if k < p - 1:
                for i in idx:
                    send(k, p, i, order[i], order[(i + 1) % p], pc)
        s.end_step()


def ring_reduce_scatter(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Each lane rank holds ``total``; after p-1 steps rank i holds piece i, reduced. Step k:
    rank i adds its piece (i-k-1) to the partial it received and writes it to the next rank;
    the last receiver adds its own piece as the data lands (fused)."""
    ring_steps(s, lanes, itemsize, lambda k, p, i, r, nxt, pc: s.send(
        r, nxt, pc[(i - k - 1) % p], (r,) if k == 0 else (r, r), (nxt,) if k == p - 2 else ()))


def ring_all_gather(s: Schedule, lanes: Sequence[Lane], itemsize: int, dup: dict[int, int] | None = None) -> None:
    """Each lane rank holds piece i of ``total``; step k forwards piece (i-k) to the next rank.
    ``dup`` maps a rank to its pair: every write to it is duplicated to the pair (KangaRing)."""
    ring_steps(s, lanes, itemsize, lambda k, p, i, r, nxt, pc: s.send(
        r, (nxt, dup[nxt]) if dup else (nxt,), pc[(i - k) % p]))


def _rdh_ranges(p: int) -> list[list[tuple[int, int]]]:
    """Per halving step k (partner distance 2^k), each position's piece range [lo, hi) before the
    step; the list has log2(p)+1 entries (the last: the final ranges)."""
    cur = [(0, p)] * p
    out = [list(cur)]
    k = 0
    while (1 << k) < p:
        nxt = []
        for i, (lo, hi) in enumerate(cur):
            mid = (lo + hi) // 2
            nxt.append((lo, mid) if not i & (1 << k) else (mid, hi))
        cur = nxt
        out.append(list(cur))
        k += 1
    return out


def _rdh_steps(s: Schedule, lanes: Sequence[Lane], itemsize: int, order_k: Sequence[int] | None,
               send: Callable[[int, int, int, int, list[int], list[list[tuple[int, int]]]], None]) -> None:
    """Run halving/doubling steps over ``lanes`` with partner distance 2^k for k in ``order_k``
    (default 0, 1, ...): ``send(k, i, rank, partner, byte offsets of the pieces, ranges)``."""
    work = [(tuple(o), [0, *itertools.accumulate(pieces(t, len(o), itemsize))], _rdh_ranges(len(o)))
            for o, t in lanes if len(o) > 1]
    L = max((int(math.log2(len(o))) for o, _, _ in work), default=0)
    keep = s.keep
    for k in (range(L) if order_k is None else order_k):
        s.begin_step()
        for order, acc, ranges in work:
            if (1 << k) < len(order):
                for i, r in enumerate(order):
                    if keep is None or r in keep:
                        send(k, i, r, order[i ^ (1 << k)], acc, ranges)
        s.end_step()


def rdh_reduce_scatter(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Recursive halving: step k exchanges half the current range with the partner at distance
    2^k (intra-chip ranks first, so the biggest messages stay on HBM); the receiver adds."""

    def send(k: int, i: int, r: int, peer: int, acc: list[int], ranges: list[list[tuple[int, int]]]) -> None:
        lo, hi = ranges[k][i]
        klo, khi = ranges[k + 1][i]
        slo, shi = (khi, hi) if klo == lo else (lo, klo)  # the half this rank gives away
        s.send(r, peer, acc[shi] - acc[slo], (r,), (peer,))

    _rdh_steps(s, lanes, itemsize, None, send)


def rdh_all_gather(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Recursive doubling, the halving in reverse: the partner at distance p/2 first (inter-chip,
    the smallest messages), each step sending everything gathered so far."""
    L = max((int(math.log2(len(o))) for o, _ in lanes if len(o) > 1), default=0)
    _rdh_steps(s, lanes, itemsize, list(reversed(range(L))), lambda k, i, r, peer, acc, ranges: s.send(
        r, peer, acc[ranges[k + 1][i][1]] - acc[ranges[k + 1][i][0]]))


def mesh_reduce_scatter(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """One step: every rank writes piece j to rank j, which adds it as it lands."""
    s.begin_step()
    for order, total in lanes:
        pc = pieces(total, len(order), itemsize)
        for r in order:
            if s.keep is not None and r not in s.keep:
                continue
            for j, d in enumerate(order):
                if d != r:
                    s.send(r, d, pc[j], (r,), (d,))
    s.end_step()


def mesh_all_gather(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """One step: every rank writes its piece to every other rank."""
    s.begin_step()
    for order, total in lanes:
        pc = pieces(total, len(order), itemsize)
        for i, r in enumerate(order):
            for d in order:
                if d != r:
                    s.send(r, d, pc[i])
    s.end_step()


_PHASES = {("rs", "ring"): ring_reduce_scatter, ("ag", "ring"): ring_all_gather,
           ("rs", "rdh"): rdh_reduce_scatter, ("ag", "rdh"): rdh_all_gather,
           ("rs", "mesh"): mesh_reduce_scatter, ("ag", "mesh"): mesh_all_gather}


def phase(kind: str, algo: str, s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Reduce-scatter ('rs'), all-gather ('ag') or all-reduce ('ar') of a flat ``algo`` on lanes."""
    if kind == "ar":
        phase("rs", algo, s, lanes, itemsize)
        # the all-gather moves the pieces the reduce-scatter left: the same lanes and bytes
        phase("ag", algo, s, lanes, itemsize)
        return
    if algo == "bidir-ring":
        lanes, algo = bidir(lanes, itemsize), "ring"
    _PHASES[(kind, algo)](s, lanes, itemsize)


# ---------------------------------------------------------------------------------------------
# the same phases as α-β steps
# ---------------------------------------------------------------------------------------------


def ring_estimate(r: "Rates", kind: str, lanes: ELanes, bidir_: bool, label: str) -> "list[EstimateStep]":
    lanes = [(list(o), t) for o, t in lanes if len(o) > 1]
    if not lanes:
        return []
    p = len(lanes[0][0])
    m = lanes[0][1] / p
    share = 0.5 if bidir_ else 1.0
    flows = [(o[i], o[(i + 1) % len(o)], share * t / len(o)) for o, t in lanes for i in range(len(o))]
    if bidir_:
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


def _rdh_estimate(r: "Rates", kind: str, lanes: ELanes, label: str) -> "list[EstimateStep]":
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


def _mesh_estimate(r: "Rates", kind: str, lanes: ELanes, label: str) -> "list[EstimateStep]":
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


def phase_estimate(r: "Rates", kind: str, algo: str, lanes: ELanes, label: str) -> "list[EstimateStep]":
    """The α-β steps of :func:`phase` (``lanes`` as ``(ranks, bytes)``)."""
    if algo in ("ring", "bidir-ring"):
        return ring_estimate(r, kind, lanes, algo == "bidir-ring", label)
    if algo == "rdh":
        return _rdh_estimate(r, kind, lanes, label)
    return _mesh_estimate(r, kind, lanes, label)


# ---------------------------------------------------------------------------------------------
# all-to-all, broadcast/reduce and point to point, as the flat algorithms run them
# ---------------------------------------------------------------------------------------------


def _all_to_all(algo: str, s: Schedule, ctx: Context) -> None:
    """Each rank's block j to rank j: all at once (mesh), or one peer per step at ring distance
    k (pairwise exchange). An uneven all-to-all moves each rank's own counts; a zero count moves
    nothing."""
    order = list(ctx.order)
    p = len(order)
    pc = pieces(ctx.nbytes, p, ctx.itemsize)
    if algo == "mesh":
        s.begin_step()
        for i, r in enumerate(order):
            for j, d in enumerate(order):
                nb = ctx.sends(r, d, pc[j])
                if d != r and nb:
                    s.send(r, d, nb)
        s.end_step()
        return
    for k in range(1, p):
        s.begin_step()
        for i, r in enumerate(order):
            j = (i + k) % p
            nb = ctx.sends(r, order[j], pc[j])
            if nb:
                s.send(r, order[j], nb)
        s.end_step()


def _all_to_all_estimate(r: "Rates", ctx: Context, algo: str) -> "list[EstimateStep]":
    order = list(ctx.order)
    p = len(order)
    m = ctx.nbytes // p
    if p < 2:
        return []

    def busiest(flows: list[tuple[int, int, float]]) -> tuple[float, float]:
        """The most a rank's HBM moves (what it sends and receives) and its DMA engines send."""
        out: dict[int, float] = {}
        inn: dict[int, float] = {}
        for a, b, nb in flows:
            out[a] = out.get(a, 0.0) + nb
            inn[b] = inn.get(b, 0.0) + nb
        return (max(out.get(x, 0.0) + inn.get(x, 0.0) for x in order), max(out.values(), default=0.0))

    if algo == "mesh":
        flows = [(a, b, float(ctx.sends(a, b, m))) for a in order for b in order if a != b and ctx.sends(a, b, m)]
        hbm, dma = busiest(flows)
        return [r.step("direct", flows, hbm, dma)] if flows else []
    out = []
    for k in range(1, p):
        flows = [(order[i], order[(i + k) % p], float(ctx.sends(order[i], order[(i + k) % p], m))) for i in range(p)]
        flows = [f for f in flows if f[2]]
        if flows:
            hbm, dma = busiest(flows)
            out.append(r.step(f"shift {k}", flows, hbm, dma))
    return out


def _rooted(algo: str, s: Schedule, ctx: Context) -> None:
    """Broadcast from, or reduce to, ``ctx.root``."""
    order = list(ctx.order)
    i0 = order.index(ctx.root)
    order = order[i0:] + order[:i0]  # the root first
    p = len(order)
    n = ctx.nbytes
    reduce = ctx.collective == "reduce"
    if p == 1:
        return
    if algo == "mesh":
        s.begin_step()
        for r in order[1:]:
            if reduce:
                s.send(r, ctx.root, n, (r,), (ctx.root,))
            else:
                s.send(ctx.root, r, n)
        s.end_step()
        return
    if algo == "rdh":  # binomial tree over positions
        L = (p - 1).bit_length()
        ks = range(L) if not reduce else reversed(range(L))
        for k in ks:
            s.begin_step()
            for i in range(1 << k):
                j = i + (1 << k)
                if j < p:
                    if reduce:
                        s.send(order[j], order[i], n, (order[j],), (order[i],))
                    else:
                        s.send(order[i], order[j], n)
            s.end_step()
        return
    # a pipelined chain: segment g crosses hop h after it crossed hop h-1 and after segment g-1
    # crossed hop h (one DMA ring per hop, in order)
    coll = ctx.system.collectives
    segs = pieces(n, max(1, min(coll.pipeline_segments, -(-n // coll.packet_bytes))), ctx.itemsize)
    chain = list(reversed(order)) if reduce else order  # a reduce flows toward the root
    prev_hop: list[int | None] = [None] * (p - 1)
    for size in segs:
        up: int | None = None
        for h in range(p - 1):
            src, dst = chain[h], chain[h + 1]
            deps = [x for x in (up, prev_hop[h]) if x is not None]
            if reduce:
                t = s.send(src, dst, size, (src,) if h == 0 else (src, src), (dst,) if h == p - 2 else (), deps=deps)
            else:
                t = s.send(src, dst, size, deps=deps)
            prev_hop[h] = up = t
    s.sync(order, [x for x in prev_hop if x is not None])


def _rooted_estimate(r: "Rates", ctx: Context, algo: str) -> "list[EstimateStep]":
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


def _point_to_point(s: Schedule, ctx: Context) -> None:
    s.begin_step()
    for a, b in ctx.pairs:
        s.send(a, b, ctx.nbytes)
    s.end_step()


def _point_to_point_estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    srcs = [a for a, _ in ctx.pairs]
    dsts = [b for _, b in ctx.pairs]
    both = max(srcs.count(x) + dsts.count(x) for x in set(srcs + dsts))
    return [r.step("direct", [(a, b, ctx.nbytes) for a, b in ctx.pairs], both * ctx.nbytes,
                   max(srcs.count(x) for x in srcs) * ctx.nbytes)]


# ---------------------------------------------------------------------------------------------
# the records
# ---------------------------------------------------------------------------------------------


def _builder(algo: str) -> Callable[[Schedule, Context], None]:
    def run(s: Schedule, ctx: Context) -> None:
        c = ctx.collective
        if c in KINDS:
            order = sorted(ctx.group) if algo == "rdh" else list(ctx.order)
            phase(KINDS[c], algo, s, [(order, ctx.nbytes)], ctx.itemsize)
        elif c == "all-to-all":
            _all_to_all(algo, s, ctx)
        elif c in ("broadcast", "reduce"):
            _rooted(algo, s, ctx)
        else:
            _point_to_point(s, ctx)
    return run


def _estimator(algo: str) -> "Callable[[Rates, Context], list[EstimateStep]]":
    def est(r: "Rates", ctx: Context) -> "list[EstimateStep]":
        c = ctx.collective
        if c in KINDS:
            return phase_estimate(r, KINDS[c], algo, [(ctx.order, float(ctx.nbytes))], algo)
        if c == "all-to-all":
            return _all_to_all_estimate(r, ctx, algo)
        if c in ("broadcast", "reduce"):
            return _rooted_estimate(r, ctx, algo)
        return _point_to_point_estimate(r, ctx)
    return est


_ALL = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "reduce", "send-recv", "permute")
_THREE = ("all-reduce", "all-gather", "reduce-scatter")

ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("ring", _ALL[:6], (), _builder("ring"), _estimator("ring"),
              "RS: (p-1) steps of n/p, AG: (p-1) steps of n/p; a step = α + max(link, HBM, DMA)", no_check),
    Algorithm("bidir-ring", _THREE, ("bidirectional-ring", "bring"), _builder("bidir-ring"), _estimator("bidir-ring"),
              "as ring, with n/2 on each of two opposite rings: the link term halves", no_check),
    Algorithm("rdh", _THREE + ("broadcast", "reduce"), ("halving-doubling", "recursive-doubling", "hd"),
              _builder("rdh"), _estimator("rdh"),
              "log2(p) steps, n/2 .. n/p (RS) and back (AG); binomial tree of log2(p) steps of n (broadcast/reduce)",
              lambda ctx: check_pow2(ctx) if ctx.collective in _THREE else None),
    Algorithm("mesh", _ALL, ("direct",), _builder("mesh"), _estimator("mesh"),
              "one step per phase: (p-1) pieces of n/p in and out of every rank, spread over the chip's links",
              no_check),
)
