"""Collective algorithms, written against the schedule (and so against no topology).

Every algorithm emits transfers into a :class:`~trnsim.collectives.schedule.Schedule` over
*lanes*: ``(ranks in order, bytes)`` pairs that run in lockstep. A bidirectional ring is two
lanes (the order and its reverse, half the bytes each); one phase of a per-dimension algorithm is
one lane per line of the grid. A new topology needs no new code here: routes, contention and
the chip/link boundary are the network model's.

Sizes follow nccl-tests (notes/collectives.md §2): ``nbytes`` is the all-reduce buffer, the
all-gather output, the reduce-scatter input, one rank's all-to-all send buffer, the
broadcast/reduce buffer and the message of a send/recv or permute.

Algorithms (notes §1.3, §4.2, §5):

``ring``        p-1 steps per phase of n/p; all-reduce = reduce-scatter + all-gather.
``bidir-ring``  two rings in opposite directions on half the bytes each.
``rdh``         recursive halving (reduce-scatter: partner distance 1, 2, 4, ..., intra-chip bits
                first) and doubling (all-gather: the reverse, inter-chip first); Rabenseifner's
                all-reduce; a binomial tree for broadcast and reduce. Power-of-two groups.
``mesh``        direct: every rank writes every other rank at once (routes and over-subscription
                are the network's); all-reduce = mesh reduce-scatter + mesh all-gather.
``kangaring``   Neuron's ring over one primary per pair of ranks on a chip, with DMA duplication
                (one read, two writes: the next primary and its pair) and the pair's second
                input read directly; both directions, as Neuron runs "multiple cycles with
                mutually exclusive wires". Groups that hold pairs on every chip.
``per-dim-ring`` ASTRA-sim's multi-dimensional composition, one ring per level (the chip's cores,
                then each topology dimension): all-reduce = RS(level 0..k-2), AR(level k-1),
                AG(k-2..0); a bidirectional ring on ring dimensions.
``hierarchical`` Neuron's composition across levels: intra-chip, intra-instance, inter-instance;
                each level runs the algorithm the size rule picks for its own share.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..config import SystemConfig
from .schedule import Schedule, pieces
from .topology import GroupShape, Topology

__all__ = ["COLLECTIVES", "ALGORITHMS", "Context", "canonical_collective", "canonical_algorithm", "build",
           "CollectiveError", "BUSBW_FACTORS"]


class CollectiveError(ValueError):
    """A collective call that cannot run as asked (unknown name, bad group, an algorithm the
    topology or group cannot run). The message is one line."""


#: canonical name -> accepted aliases (nccom-test's and nccl-tests' spellings)
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "all-reduce": ("allr", "all_reduce", "allreduce"),
    "all-gather": ("allg", "all_gather", "allgather"),
    "reduce-scatter": ("redsct", "reduce_scatter", "reducescatter"),
    "all-to-all": ("alltoall", "all_to_all", "a2a"),
    "broadcast": ("bcast",),
    "reduce": (),
    "send-recv": ("sendrecv", "send_recv", "p2p"),
    "permute": (),
}


def _busbw_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw factor (notes §2): AR 2(n-1)/n; AG, RS, A2A (n-1)/n; others 1."""
    if p <= 1:
        return 0.0 if collective in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") else 1.0
    if collective == "all-reduce":
        return 2 * (p - 1) / p
    if collective in ("all-gather", "reduce-scatter", "all-to-all"):
        return (p - 1) / p
    return 1.0


BUSBW_FACTORS = _busbw_factor


def canonical_collective(name: str) -> str:
    key = name.strip().lower()
    for canon, aliases in COLLECTIVES.items():
        if key == canon or key in aliases:
            return canon
    raise CollectiveError(f"unknown collective '{name}': expected one of {', '.join(COLLECTIVES)}")


@dataclass
class Context:
    """What an algorithm knows about the call: the group (as given and in ring order), its grid
    shape, the element size, a root and permute pairs."""

    system: SystemConfig
    topo: Topology
    collective: str
    group: tuple[int, ...]
    nbytes: int
    itemsize: int
    root: int
    pairs: tuple[tuple[int, int], ...] = ()
    order: tuple[int, ...] = ()
    shape: GroupShape | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def p(self) -> int:
        return len(self.group)


Lane = tuple[Sequence[int], int]


# ---------------------------------------------------------------------------------------------
# flat building blocks over lanes
# ---------------------------------------------------------------------------------------------


def _halves(nbytes: int, itemsize: int) -> tuple[int, int]:
    a, b = pieces(nbytes, 2, itemsize)
    return a, b


def _bidir(lanes: Sequence[Lane], itemsize: int) -> list[Lane]:
    out: list[Lane] = []
    for order, total in lanes:
        a, b = _halves(total, itemsize)
        out.append((tuple(order), a))
        out.append((tuple(reversed(order)), b))
    return out


def _ring_steps(s: Schedule, lanes: Sequence[Lane], itemsize: int,
                send: Callable[[int, int, int, int, int, list[int]], None]) -> None:
    """Run ring steps in lockstep over ``lanes``: at step k every rank i of a lane of p ranks
    calls ``send(k, p, i, rank, next rank, pieces)``; a lane of p ranks takes p-1 steps."""
    work = [(tuple(o), pieces(total, len(o), itemsize)) for o, total in lanes if len(o) > 1]
    steps = max((len(o) for o, _ in work), default=1) - 1
    for k in range(steps):
        s.begin_step()
        for order, pc in work:
            p = len(order)
            if k < p - 1:
                for i, r in enumerate(order):
                    send(k, p, i, r, order[(i + 1) % p], pc)
        s.end_step()


def ring_reduce_scatter(s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Each lane rank holds ``total``; after p-1 steps rank i holds piece i, reduced. Step k:
    rank i adds its piece (i-k-1) to the partial it received and writes it to the next rank;
    the last receiver adds its own piece as the data lands (fused)."""
    _ring_steps(s, lanes, itemsize, lambda k, p, i, r, nxt, pc: s.send(
        r, nxt, pc[(i - k - 1) % p], (r,) if k == 0 else (r, r), (nxt,) if k == p - 2 else ()))


def ring_all_gather(s: Schedule, lanes: Sequence[Lane], itemsize: int, dup: dict[int, int] | None = None) -> None:
    """Each lane rank holds piece i of ``total``; step k forwards piece (i-k) to the next rank.
    ``dup`` maps a rank to its pair: every write to it is duplicated to the pair (KangaRing)."""
    _ring_steps(s, lanes, itemsize, lambda k, p, i, r, nxt, pc: s.send(
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
    for k in (range(L) if order_k is None else order_k):
        s.begin_step()
        for order, acc, ranges in work:
            if (1 << k) < len(order):
                for i, r in enumerate(order):
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


def _flat(kind: str, algo: str, s: Schedule, lanes: Sequence[Lane], itemsize: int) -> None:
    """Reduce-scatter ('rs'), all-gather ('ag') or all-reduce ('ar') of ``algo`` on lanes."""
    if kind == "ar":
        _flat("rs", algo, s, lanes, itemsize)
        # the all-gather moves the pieces the reduce-scatter left: the same lanes and bytes
        _flat("ag", algo, s, lanes, itemsize)
        return
    if algo == "bidir-ring":
        lanes, algo = _bidir(lanes, itemsize), "ring"
    fn = {("rs", "ring"): ring_reduce_scatter, ("ag", "ring"): ring_all_gather,
          ("rs", "rdh"): rdh_reduce_scatter, ("ag", "rdh"): rdh_all_gather,
          ("rs", "mesh"): mesh_reduce_scatter, ("ag", "mesh"): mesh_all_gather}[(kind, algo)]
    fn(s, lanes, itemsize)


# ---------------------------------------------------------------------------------------------
# algorithms on a whole group
# ---------------------------------------------------------------------------------------------

_KIND = {"all-reduce": "ar", "reduce-scatter": "rs", "all-gather": "ag"}


def _flat_algo(algo: str) -> Callable[[Schedule, Context], None]:
    def run(s: Schedule, ctx: Context) -> None:
        c = ctx.collective
        if c in _KIND:
            order = sorted(ctx.group) if algo == "rdh" else list(ctx.order)
            _flat(_KIND[c], algo, s, [(order, ctx.nbytes)], ctx.itemsize)
        elif c == "all-to-all":
            _all_to_all(algo, s, ctx)
        elif c in ("broadcast", "reduce"):
            _rooted(algo, s, ctx)
        else:
            _point_to_point(s, ctx)
    return run


def _all_to_all(algo: str, s: Schedule, ctx: Context) -> None:
    order = list(ctx.order)
    p = len(order)
    pc = pieces(ctx.nbytes, p, ctx.itemsize)
    if algo == "mesh":
        s.begin_step()
        for i, r in enumerate(order):
            for j, d in enumerate(order):
                if d != r:
                    s.send(r, d, pc[j])
        s.end_step()
        return
    for k in range(1, p):  # pairwise exchange: one peer per step, at ring distance k
        s.begin_step()
        for i, r in enumerate(order):
            j = (i + k) % p
            s.send(r, order[j], pc[j])
        s.end_step()


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
    segs = pieces(n, max(1, min(ctx.system.collectives.pipeline_segments, -(-n // ctx.system.collectives.packet_bytes))),
                  ctx.itemsize)
    chain = list(reversed(order)) if reduce else order  # a reduce flows toward the root
    prev_hop: list[int | None] = [None] * (p - 1)
    last: list[int] = []
    for g, size in enumerate(segs):
        up: int | None = None
        for h in range(p - 1):
            src, dst = chain[h], chain[h + 1]
            deps = [x for x in (up, prev_hop[h]) if x is not None]
            if reduce:
                t = s.send(src, dst, size, (src,) if h == 0 else (src, src), (dst,) if h == p - 2 else (), deps=deps)
            else:
                t = s.send(src, dst, size, deps=deps)
            prev_hop[h] = up = t
        last.append(up)  # type: ignore[arg-type]
    s.sync(order, [x for x in prev_hop if x is not None])


def _point_to_point(s: Schedule, ctx: Context) -> None:
    s.begin_step()
    for a, b in ctx.pairs:
        s.send(a, b, ctx.nbytes)
    s.end_step()


def _kangaring(s: Schedule, ctx: Context) -> None:
    pairs = _pairs(ctx)
    assert pairs is not None
    primaries = ctx.topo.ring_order([a for a, _ in pairs])
    mate = dict(pairs)
    p, q = ctx.p, len(primaries)
    c = ctx.collective
    isz = ctx.itemsize
    # every pair owns a block of 2 ranks' pieces; the ring moves pair blocks
    if c == "all-gather":
        piece = pieces(ctx.nbytes, p, isz)[0]
        s.begin_step()
        for a, b in pairs:  # each pair swaps its two pieces on chip
            s.send(a, b, piece)
            s.send(b, a, piece)
        s.end_step()
        ring_all_gather(s, _bidir([(primaries, 2 * piece * q)], isz), isz, dup=mate)
        return
    # reduce-scatter (and the first half of all-reduce): the ring over primaries adds the
    # primary's and its pair's inputs (two reads), duplicated nothing; the last receiver adds
    # both of its own as the data lands
    _ring_steps(s, _bidir([(primaries, ctx.nbytes)], isz), isz, lambda k, p, i, r, nxt, pc: s.send(
        r, nxt, pc[(i - k - 1) % p], (r, mate[r]) if k == 0 else (r, r, mate[r]),
        (nxt, mate[nxt]) if k == p - 2 else ()))
    block = pieces(ctx.nbytes, q, isz)[0]
    if c == "reduce-scatter":
        s.begin_step()
        for a, b in pairs:  # the pair's half of the reduced block
            s.send(a, b, block // 2)
        s.end_step()
        return
    s.begin_step()
    for a, b in pairs:  # all-reduce: the pair gets the whole reduced block, then the ring gathers
        s.send(a, b, block)
    s.end_step()
    ring_all_gather(s, _bidir([(primaries, ctx.nbytes)], isz), isz, dup=mate)


def _pairs(ctx: Context) -> list[tuple[int, int]] | None:
    """Pairs of group ranks on one chip (the group must hold an even number on every chip)."""
    return ctx.topo.pairs(ctx.group)


def _levels_lanes(ctx: Context, levels: Sequence[int]) -> list[list[int]]:
    """The group's ranks split into lines along ``levels``: ranks that share every other
    level's coordinate, each in ring order."""
    lines: dict[tuple[int, ...], list[int]] = {}
    others = [i for i in range(len(ctx.topo.level_names)) if i not in levels]
    for r in ctx.group:
        c = ctx.topo.rank_coords(r)
        lines.setdefault(tuple(c[i] for i in others), []).append(r)
    return [ctx.topo.ring_order(v) for _, v in sorted(lines.items())]


def _compose(s: Schedule, ctx: Context, groups: Sequence[Sequence[int]], algos: Sequence[str]) -> None:
    """Run the collective as phases over level ``groups`` (ASTRA-sim / Neuron hierarchical):
    reduce-scatter up the groups with shrinking data, all-reduce on the last, all-gather back
    down; all-gather alone goes from the last group down, reduce-scatter from the first up."""
    sizes = [math.prod(len(ctx.shape.values[i]) for i in g) for g in groups]  # type: ignore[union-attr]
    c = ctx.collective
    isz = ctx.itemsize
    lanes = [_levels_lanes(ctx, g) for g in groups]

    def phase(kind: str, k: int, total: int) -> None:
        order_of = sorted if algos[k] == "rdh" else list
        s.phase = f"{kind} {'+'.join(ctx.topo.level_names[i] for i in groups[k])} ({algos[k]})"
        _flat(kind, algos[k], s, [(order_of(v), total) for v in lanes[k]], isz)

    n = ctx.nbytes
    if c == "all-reduce":
        data = n
        for k in range(len(groups) - 1):
            phase("rs", k, data)
            data = data // sizes[k] // isz * isz
        phase("ar", len(groups) - 1, data)
        for k in reversed(range(len(groups) - 1)):
            data *= sizes[k]
            phase("ag", k, data)
    elif c == "reduce-scatter":
        data = n
        for k in range(len(groups)):
            phase("rs", k, data)
            data = data // sizes[k] // isz * isz
    else:
        data = n // math.prod(sizes) // isz * isz
        for k in reversed(range(len(groups))):
            data *= sizes[k]
            phase("ag", k, data)
    s.phase = ""


def _per_dim(s: Schedule, ctx: Context) -> None:
    assert ctx.shape is not None
    spanned = ctx.shape.spanned()
    algos = []
    for lv in spanned:
        dim = ctx.topo.dims[lv - 1] if lv > 0 else None
        bidir = dim is not None and dim.kind == "ring" and len(ctx.shape.values[lv]) > 2
        algos.append("bidir-ring" if bidir else "ring")
    _compose(s, ctx, [[lv] for lv in spanned], algos)


def hierarchy_groups(ctx: Context) -> list[list[int]]:
    """The spanned levels grouped as intra-chip, intra-instance and inter-instance."""
    assert ctx.shape is not None
    return ctx.topo.tiers(ctx.shape)


def _hierarchical(s: Schedule, ctx: Context) -> None:
    from .select import flat_choice

    groups = hierarchy_groups(ctx)
    sizes = [math.prod(len(ctx.shape.values[i]) for i in g) for g in groups]  # type: ignore[union-attr]
    # each level runs what the size rule picks for the share it moves
    algos = []
    data = ctx.nbytes
    for k, g in enumerate(groups):
        algos.append(flat_choice(ctx.system, data, sizes[k], ctx.topo, g)[0])
        if ctx.collective != "all-gather":
            data //= sizes[k]
    _compose(s, ctx, groups, algos)


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------

_ALL = tuple(COLLECTIVES)
_THREE = ("all-reduce", "all-gather", "reduce-scatter")


@dataclass(frozen=True)
class Algorithm:
    name: str
    collectives: tuple[str, ...]
    aliases: tuple[str, ...]
    build: Callable[[Schedule, Context], None]
    check: Callable[[Context], str | None]


def _check_pow2(ctx: Context) -> str | None:
    p = ctx.p
    if p & (p - 1):
        return f"a power-of-two group; {p} ranks is not"
    return None


def _check_kanga(ctx: Context) -> str | None:
    pairs = _pairs(ctx)
    if pairs is None:
        return ("pairs of ranks on every chip it uses (an even number of the group's ranks per chip); "
                f"{ctx.system.name} has {ctx.topo.rpc} rank(s) per chip")
    if len(pairs) < 2:
        return "at least two pairs of ranks (4 ranks, 2 per chip)"
    return None


def _check_grid(levels_needed: int, what: str) -> Callable[[Context], str | None]:
    def check(ctx: Context) -> str | None:
        if ctx.shape is None:
            return "a group that is a grid over the topology (every combination of its chips' coordinates and cores)"
        spanned = ctx.shape.spanned() if what == "levels" else hierarchy_groups(ctx)
        if len(spanned) < levels_needed:
            names = ", ".join(ctx.topo.level_names[i] for i in ctx.shape.spanned()) or "nothing"
            if what == "levels":
                return f"a group spanning at least 2 levels (chip cores, {', '.join(ctx.topo.level_names[1:])}); this one spans {names}"
            return f"a group spanning at least 2 of intra-chip, intra-instance, inter-instance; this one spans {names}"
        return None
    return check


def _ok(ctx: Context) -> str | None:
    return None


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("ring", _ALL[:6], (), _flat_algo("ring"), _ok),
    Algorithm("bidir-ring", _THREE, ("bidirectional-ring", "bring"), _flat_algo("bidir-ring"), _ok),
    Algorithm("rdh", _THREE + ("broadcast", "reduce"), ("halving-doubling", "recursive-doubling", "hd"),
              _flat_algo("rdh"), lambda ctx: _check_pow2(ctx) if ctx.collective in _THREE else None),
    Algorithm("mesh", _ALL, ("direct",), _flat_algo("mesh"), _ok),
    Algorithm("kangaring", _THREE, ("kanga",), _kangaring, _check_kanga),
    Algorithm("per-dim-ring", _THREE, ("ring2d", "ring3d", "2d-ring", "3d-ring", "torus"), _per_dim,
              _check_grid(2, "levels")),
    Algorithm("hierarchical", _THREE, ("hier",), _hierarchical, _check_grid(2, "tiers")),
)}


def canonical_algorithm(name: str, collective: str) -> str:
    key = name.strip().lower()
    for a in ALGORITHMS.values():
        if key == a.name or key in a.aliases:
            if collective not in a.collectives:
                ok = ", ".join(x.name for x in ALGORITHMS.values() if collective in x.collectives)
                raise CollectiveError(f"algorithm '{a.name}' does not run {collective}; expected one of {ok}")
            return a.name
    ok = ", ".join(x.name for x in ALGORITHMS.values() if collective in x.collectives)
    raise CollectiveError(f"unknown algorithm '{name}' for {collective}: expected one of {ok}")


def build(s: Schedule, ctx: Context, algorithm: str) -> None:
    a = ALGORITHMS[algorithm]
    why = a.check(ctx)
    if why is not None:
        raise CollectiveError(f"algorithm '{algorithm}' cannot run {ctx.collective} on {ctx.p} ranks of "
                              f"{ctx.system.name}: it needs {why}")
    if ctx.p > 1:
        a.build(s, ctx)
