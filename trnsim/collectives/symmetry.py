"""Ranks that behave alike, simulated once: the symmetry of one collective call.

A ring all-reduce's ranks all do the same thing on different links; KangaRing's do it chip pair
by chip pair along its snake; a hierarchical call does the same in every instance. When a
permutation of the group's ranks maps the call's schedule onto itself (every transfer onto a
transfer with the same bytes, operands and dependencies) and its resources onto resources of
the same kind and rate (each transfer's bookings, position by position, onto the image's, one
to one), the simulation is invariant under it: the network books the chunks that reach a
resource at the same tick as one group that ends together, and the runtime serves same-tick
issues and proxy turns the same way (network.py, runner.py), so which alike flow simpy ran
first never matters, and alike transfers start and end on the same ticks.

:func:`find` tries the permutations a collective's structure suggests (each instance's ring
order turned by ``d`` ranks, the instances shifted one over, KangaRing's pairs mirrored, the
whole group's ring order turned), keeps those that verify against the schedule built in full,
and returns the orbits of the group they generate. :func:`direct` does it for a lone call
without building it in full: the schedule is built on the representatives only, and what makes
the orbit reasoning exact is shown on them (see there); the call falls back to :func:`find`
when it cannot be. The runner
then runs one transfer per orbit (its *representative*), books each resource's representative
with the multiplicity the orbit brings to it (a transfer of orbit size ``|T|`` booking a
resource of orbit size ``|R|`` stands for ``|T| / |R|`` bookings of every resource in that
orbit, all at the same tick), and copies the representatives' ticks to the rest. The result is
identical to the full simulation's, tick for tick (tests/collectives/test_collective_symmetry.py; the
benchmark checks it on the calls it times). A call with nothing to exploit runs in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from .runner import CollectiveRunner, CollectiveHandle

__all__ = ["Symmetry", "find"]


@dataclass
class Symmetry:
    """The orbits of one set of calls under the permutations that verified (``generators``,
    rank maps). Transfers are numbered over the calls in launch order (``offsets[h]`` is the
    first of call ``h``); every orbit's representative (its smallest number) is in the first
    call when there are several (the permutations take it onto every other)."""

    generators: list[dict[int, int]]
    #: transfer number -> its orbit's representative; orbit sizes by representative
    rep: list[int]
    size: dict[int, int]
    #: rank -> representative rank, and rank orbit sizes by representative
    rank_rep: dict[int, int]
    rank_size: dict[int, int]
    #: id(resource) -> (representative resource, its orbit size)
    res_rep: dict[int, tuple[Any, int]]
    #: per base call (below): id(resource) -> the resources of its orbit under the permutations
    #: that keep that call in place (what the call's own chunks, alike, touch)
    stab: dict[int, dict[int, list[Any]]]
    offsets: list[int]
    #: per call, the call whose representatives stand for it (the first of its orbit of calls),
    #: and a resource map of a permutation taking that call onto it (None: the identity)
    base: list[int]
    trans: list[dict[int, Any] | None]
    #: a lone call built on its representatives directly (:func:`direct`): its resource orbits
    direct: "Direct | None" = None

    @property
    def order(self) -> int:
        """The largest orbit of transfers: how many times fewer transfers run."""
        return max(self.size.values(), default=1)

    def representatives(self) -> list[int]:
        return [i for i, r in enumerate(self.rep) if r == i]

    def images(self, held: Any, call: int) -> list[Any]:
        """The resources of call ``call`` that a representative chunk held back by ``held``
        stands for: ``held``'s orbit under the first call's stabiliser, taken onto call ``call``."""
        out = self.stab[self.base[call]].get(id(held), [held])
        t = self.trans[call]
        return out if t is None else [t[id(o)] for o in out]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        p = self.parent
        root = x
        while p.get(root, root) != root:
            root = p[root]
        while p.get(x, x) != root:
            p[x], x = root, p[x]
        return root

    def union(self, a: Any, b: Any, less: Callable[[Any, Any], bool]) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            if less(rb, ra):
                ra, rb = rb, ra
            self.parent[rb] = ra


def _classes(n: int, pairs: Iterable[tuple[int, int]]) -> list[int]:
    """Union-find over the numbers ``0..n-1`` joining each pair: every number's class, named by
    its smallest member (so the result does not depend on the order of the pairs)."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs:
        a, b = root(i), root(j)
        if a != b:
            if a < b:
                parent[b] = a
            else:
                parent[a] = b
    return [root(i) for i in range(n)]


def _rotations(orders: Sequence[Sequence[int]], d: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for o in orders:
        n = len(o)
        for i, r in enumerate(o):
            out[r] = o[(i + d) % n]
    return out


def _candidates(engine: "CollectiveRunner", groups: Sequence[Sequence[int]]) -> list[list[dict[int, int]]]:
    """Families of rank permutations to try, each in increasing order of the subgroup they
    generate (the first that verifies in a family is kept). Several calls (siblings): their
    ring orders turned together, the chips' cores turned, the chips moved along a dimension."""
    topo = engine.net.topo
    fams: list[list[dict[int, int]]] = []
    all_parts = []
    for group in groups:
        by_inst: dict[int, list[int]] = {}
        for r in group:
            by_inst.setdefault(topo.instance_of(r), []).append(r)
        all_parts.append(([topo.ring_order(v) for _, v in sorted(by_inst.items())], by_inst))
    sizes = {len(p) for parts, _ in all_parts for p in parts}
    if len(sizes) == 1 and next(iter(sizes)) > 1:
        n = next(iter(sizes))
        flat = [p for parts, _ in all_parts for p in parts]
        fams.append([_rotations(flat, d) for d in range(1, n) if n % d == 0])
    if len(groups) > 1:  # the chips' cores turned, the chips moved along each dimension
        ranks = {r for g in groups for r in g}
        rpc = topo.rpc

        def onto(f: Callable[[int], int]) -> dict[int, int] | None:
            m = {r: f(r) for r in ranks}
            return m if set(m.values()) == ranks else None

        fams.append([m for d in range(1, rpc) if rpc % d == 0
                     for m in [onto(lambda r, d=d: r - r % rpc + (r % rpc + d) % rpc)] if m])
        for dim, size in enumerate(topo.sizes):
            def move(r: int, dim: int = dim, size: int = size, t: int = 1) -> int:
                c = list(topo.coords(r // rpc))
                c[dim] = (c[dim] + t) % size
                return topo.chip_at(c) * rpc + r % rpc
            fams.append([m for t in range(1, size) if size % t == 0
                         for m in [onto(lambda r, t=t: move(r, t=t))] if m])
        return fams
    group = groups[0]
    parts, by_inst = all_parts[0]
    mirror = _mirror(topo, by_inst)
    if len(parts) == 1 and mirror:
        fams.append([mirror])
    if len(parts) > 1 and len({len(p) for p in parts}) == 1:
        ir = topo.instance_ranks
        insts = sorted(by_inst)
        shift = {}
        ok = True
        for k, i in enumerate(insts):
            j = insts[(k + 1) % len(insts)]
            for r in by_inst[i]:
                img = r - i * ir + j * ir
                if img not in by_inst[j]:
                    ok = False
                shift[r] = img
        if ok:
            fams.append([shift])
        if mirror:
            fams.append([mirror])
        fams.append([])  # the whole ring's turns: only when the instances gave nothing (see find)
        whole = topo.ring_order(group)
        n = len(whole)
        fams.append([_rotations([whole], d) for d in range(1, n) if n % d == 0])
    return fams


def _mirror(topo: Any, by_inst: dict[int, list[int]]) -> dict[int, int] | None:
    """Each instance's pairs of ranks on a chip (KangaRing's primaries and partners) mirrored:
    the i-th primary in ring order onto the partner of the i-th from the end, and back (the
    cycle over the partners runs the primaries' order reversed, so a KangaRing maps onto
    itself). None when the group does not hold pairs on every chip."""
    out: dict[int, int] = {}
    for ranks in by_inst.values():
        pairs = topo.pairs(ranks)
        if not pairs or len(pairs) < 2:
            return None
        first = topo.ring_order([a for a, _ in pairs])
        mate = {a: b for a, b in pairs}
        q = len(first)
        for i, a in enumerate(first):
            b = mate[first[q - 1 - i]]
            out[a] = b
            out[b] = a
    return out


class _Checker:
    """Verifies rank permutations against one handle's schedule and bookings."""

    def __init__(self, engine: "CollectiveRunner", handles: Sequence["CollectiveHandle"]):
        from .schedule import Transfer

        self.engine = engine
        # the calls' transfers as one list, dependencies renumbered (their groups are disjoint,
        # so a transfer's ranks say which call it is in)
        ts: list[Any] = []
        self.offsets: list[int] = []
        self.start: dict[int, int] = {}
        for h in handles:
            off = len(ts)
            self.offsets.append(off)
            for t in h.sched.transfers:
                if off:
                    t = Transfer(t.src, t.dsts, t.nbytes, t.reads, t.dst_reads, [d + off for d in t.deps], t.step,
                                 t.phase, t.gather)
                ts.append(t)
            for r, i in h.sched.start.items():
                self.start[r] = i + off
        self.ts = ts
        for t in ts:  # every booking pattern (and so every link) exists before any is compared
            if not t.is_node:
                engine.plan_of(t)
        # a transfer's key: its ranks as ids of interned rank tuples, and the rest interned too,
        # so a candidate maps each distinct tuple once rather than each transfer's
        self.tuples: dict[tuple[int, ...], int] = {}
        rests: dict[tuple[Any, ...], int] = {}
        tup = self.tuples
        self.parts: list[tuple[int, int, int, int, int] | None] = []
        for t in ts:
            if t.is_node:
                self.parts.append(None)
                continue
            ids = [tup.setdefault(x, len(tup)) for x in (t.dsts, t.reads, t.dst_reads)]
            rest = rests.setdefault((t.nbytes, t.gather, t.step, t.phase), len(rests))
            self.parts.append((t.src, ids[0], ids[1], ids[2], rest))
        self.tuple_list = list(tup)
        self.index: dict[tuple[Any, ...], list[int]] = {}
        for i, t in enumerate(ts):
            pt = self.parts[i]
            key = (-1, t.step, t.phase) if pt is None else pt
            self.index.setdefault(key, []).append(i)
        self.deps = [t.deps if len(t.deps) < 2 else sorted(t.deps) for t in ts]
        #: per transfer, its plan's key (transfers with one key book the same resources) and plan
        self.pkey = [None if t.is_node else (t.src, t.dsts, t.reads, t.dst_reads, t.gather) for t in ts]
        plans = engine._plans
        self.plan = [None if k is None else plans[k] for k in self.pkey]
        self.start_of = {i: r for r, i in self.start.items()}
        dims = engine.system.topology
        self.link_kind: dict[int, tuple[Any, ...]] = {}
        for k, pipe in engine.net.links.items():
            d = dims[k[0]]
            self.link_kind[id(pipe)] = (d.bandwidth, d.latency, d.proxy)

    def transfer_map(self, s: dict[int, int]) -> list[int] | None:
        """Transfer i -> the transfer ``s`` makes of it (same bytes, operands, step and
        dependencies' images), or None when some transfer has no image."""
        ts = self.ts
        tau = [-1] * len(ts)
        used = [False] * len(ts)
        start = self.start
        deps = self.deps
        index = self.index
        start_of = self.start_of
        tup = self.tuples
        img = [tup.get(tuple([s[x] for x in t])) for t in self.tuple_list]
        parts = self.parts
        for i, t in enumerate(ts):
            if i in start_of:
                j = start[s[start_of[i]]]
            else:
                pt = parts[i]
                key = (-1, t.step, t.phase) if pt is None else (s[pt[0]], img[pt[1]], img[pt[2]], img[pt[3]], pt[4])
                d = t.deps
                want = [tau[d[0]]] if len(d) == 1 else sorted([tau[x] for x in d])
                j = -1
                for c in index.get(key, ()):
                    if not used[c] and deps[c] == want and c not in start_of:
                        j = c
                        break
                if j < 0:
                    return None
            if used[j]:
                return None
            used[j] = True
            tau[i] = j
        return tau

    def resource_map(self, tau: list[int]) -> dict[int, Any] | None:
        """id(resource) -> its image, from every transfer's bookings and theirs, or None when
        they do not correspond one to one, kind for kind and rate for rate."""
        plan = self.plan
        phi: dict[int, Any] = {}
        back: dict[int, int] = {}
        seen: set[tuple[int, int]] = set()
        for i, p1 in enumerate(plan):
            if p1 is None:
                continue
            p2 = plan[tau[i]]
            pair = (id(p1), id(p2))
            if pair in seen:  # the same bookings, mapped the same way
                continue
            seen.add(pair)
            b1, _, lat1 = p1
            b2, _, lat2 = p2
            if lat1 != lat2 or len(b1) != len(b2):
                return None
            for (k1, o1, w1, d1), (k2, o2, w2, d2) in zip(b1, b2):
                if k1 != k2 or w1 != w2 or d1 != d2:
                    return None
                got = phi.get(id(o1))
                if got is None:
                    if back.get(id(o2), id(o1)) != id(o1):
                        return None
                    if k1 == 0 and self.link_kind.get(id(o1)) != self.link_kind.get(id(o2)):
                        return None
                    if k1 == 3 and (o1.num, o1.den) != (o2.num, o2.den):
                        return None
                    phi[id(o1)] = o2
                    back[id(o2)] = id(o1)
                elif got is not o2:
                    return None
        return phi


def find(engine: "CollectiveRunner", handles: Sequence["CollectiveHandle"]) -> Symmetry | None:
    """The symmetry of ``handles`` (all the calls launched on ``engine``), or None when no
    candidate permutation verifies or the calls cannot be reduced (different start ticks,
    groups that overlap, several calls the permutations do not take onto each other, a proxy thread
    shared by several ranks)."""
    groups = [h.res.ctx.group for h in handles]
    starts = {s for h in handles for s in h.res.starts}
    ranks = [r for g in groups for r in g]
    if len(starts) != 1 or len(ranks) < 2 or len(set(ranks)) != len(ranks):
        return None
    rt = engine.net.runtime
    if rt.efa_proxy and rt.ranks_per_proxy != 1:
        return None
    several = len(handles) > 1
    if several:
        first = handles[0]
        alike = (first.res.ctx.collective, first.res.ctx.nbytes, first.res.algorithm, first.res.dtype, len(groups[0]))
        if any((h.res.ctx.collective, h.res.ctx.nbytes, h.res.algorithm, h.res.dtype, len(g)) != alike
               for h, g in zip(handles, groups)):
            return None
    chk = _Checker(engine, handles)
    gens: list[tuple[dict[int, int], list[int], dict[int, Any]]] = []
    rpc = engine.net.topo.rpc

    def chips_to_chips(s: dict[int, int]) -> bool:
        """Ranks of one chip share its HBM stacks, so their images must share a chip too."""
        img: dict[int, int] = {}
        return all(img.setdefault(r // rpc, s[r] // rpc) == s[r] // rpc for r in s)

    for fam in _candidates(engine, groups):
        if not fam:  # the whole-ring turns follow: a flat call across instances needs them
            if gens:
                break
            continue
        for s in fam:
            if not chips_to_chips(s):
                continue
            tau = chk.transfer_map(s)
            if tau is None:
                continue
            phi = chk.resource_map(tau)
            if phi is None:
                continue
            gens.append((s, tau, phi))
            break
    if not gens:
        return None
    # how each permutation moves the calls (by their groups), and one permutation taking the
    # first call onto each other call (a breadth-first walk over the calls)
    where = {r: k for k, g in enumerate(groups) for r in g}
    moves = []
    for s, _, _ in gens:
        mv = [where[s[g[0]]] for g in groups]
        if any({s[r] for r in g} != set(groups[j]) for g, j in zip(groups, mv)):
            return None
        moves.append(mv)
    n = len(chk.ts)
    rep = _classes(n, ((i, tau[i]) for _, tau, _ in gens for i in range(n)))  # the orbits of transfer numbers
    size: dict[int, int] = {}
    for r in rep:
        size[r] = size.get(r, 0) + 1
    # a rank's representative is the rank whose start node represents its start node's orbit
    rank_rep = {r: chk.start_of[rep[chk.start[r]]] for r in ranks}
    rank_size: dict[int, int] = {}
    for r in rank_rep.values():
        rank_size[r] = rank_size.get(r, 0) + 1
    objs: dict[int, Any] = {}
    order: dict[int, int] = {}  # id -> first seen (a deterministic representative)
    for x in chk.plan:
        if x is None:
            continue
        for _, o, _, _ in x[0]:
            if id(o) not in objs:
                objs[id(o)] = o
                order[id(o)] = len(order)
    by_order = lambda a, b: order[a] < order[b]  # noqa: E731

    def orbits(maps: list[dict[int, Any]]) -> dict[int, list[Any]]:
        uf = _UnionFind()
        for phi in maps:
            for a, o in phi.items():
                uf.union(a, id(o), by_order)
        members: dict[int, list[Any]] = {}
        for k in objs:
            members.setdefault(uf.find(k), []).append(objs[k])
        return {k: members[uf.find(k)] for k in objs}

    full = orbits([phi for _, _, phi in gens])
    res_rep = {k: (full[k][0], len(full[k])) for k in objs}
    # the calls' orbits: each walked breadth first from its first call (its base), keeping a
    # permutation that takes the base onto each call; the base's stabiliser is generated by
    # Schreier's t_j^-1 g t_k for each call k of the orbit and permutation g taking k to j
    ident = {k: objs[k] for k in objs}
    base = [-1] * len(handles)
    tr: list[dict[int, Any]] = [ident] * len(handles)
    stab: dict[int, dict[int, list[Any]]] = {}
    for b in range(len(handles)):
        if base[b] >= 0:
            continue
        base[b] = b
        tr[b] = ident
        walk, todo = [b], [b]
        while todo:
            k = todo.pop(0)
            for (_, _, phi), mv in zip(gens, moves):
                j = mv[k]
                if base[j] < 0:
                    base[j] = b
                    tr[j] = {a: phi[id(o)] for a, o in tr[k].items()}
                    walk.append(j)
                    todo.append(j)
        inv = {j: {id(o): objs[a] for a, o in tr[j].items()} for j in walk}
        stab_gens = []
        for (_, _, phi), mv in zip(gens, moves):
            for k in walk:
                m = {a: inv[mv[k]][id(phi[id(o)])] for a, o in tr[k].items()}
                if any(id(o) != a for a, o in m.items()):
                    stab_gens.append(m)
        stab[b] = orbits(stab_gens)
    sym = Symmetry([s for s, _, _ in gens], rep, size, rank_rep, rank_size, res_rep, stab, chk.offsets, base,
                   [None if base[k] == k else t for k, t in enumerate(tr)])
    return sym if sym.order > 1 else None


# ---------------------------------------------------------------------------------------------
# a lone call built on its representatives directly
# ---------------------------------------------------------------------------------------------


@dataclass
class Direct:
    """The resource orbits of a call built on its representatives (:func:`direct`), by address:
    ``("dma", rank, i)``, ``("vec", rank, i)``, ``("hbm", chip, stack)``, ``("link", key)``.
    ``addr`` maps the representatives' booked resources (by id) to their addresses, ``canon``
    an address to its orbit's first, ``members`` that to the orbit."""

    order: int
    addr: dict[int, Any]
    canon: dict[Any, Any]
    members: dict[Any, list[Any]]


def _closure(gens: list[dict[int, int]], group: Sequence[int], cap: int = 4096) -> list[tuple[int, ...]] | None:
    """The group the rank maps ``gens`` generate, as tuples of images of ``group`` (None past
    ``cap`` elements)."""
    pos = {r: i for i, r in enumerate(group)}
    gs = [tuple(pos[g[r]] for r in group) for g in gens]
    ident = tuple(range(len(group)))
    seen = {ident}
    todo = [ident]
    while todo:
        e = todo.pop()
        for g in gs:
            x = tuple(map(g.__getitem__, e))  # g after e
            if x not in seen:
                seen.add(x)
                if len(seen) > cap:
                    return None
                todo.append(x)
    return sorted(seen)


def _apply(g: dict[int, int], d: tuple[Any, ...]) -> tuple[Any, ...]:
    step, dsts, nbytes, reads, dst_reads, gather = d
    return (step, tuple(g[x] for x in dsts), nbytes, tuple(g[x] for x in reads), tuple(g[x] for x in dst_reads),
            gather)


def _equivariant(q: Any, gens: Sequence[dict[int, int]], ranks: Sequence[int]) -> bool:
    """Whether every rank of ``ranks`` sends, under each of ``gens``, what its image sends
    (steps, receivers, bytes and operands, as multisets)."""
    from collections import Counter

    for g in gens:
        for r in ranks:
            mine = q.desc.get(r, [])
            theirs = q.desc.get(g[r], [])
            if len(mine) != len(theirs) or Counter(_apply(g, d) for d in mine) != Counter(theirs):
                return False
    return True


def direct(runner: "CollectiveRunner", res: Any) -> tuple[Any, Symmetry] | None:
    """A lone call's schedule built on orbit representatives only, and its :class:`Symmetry`;
    None when its symmetry cannot be shown (the caller then builds and checks it in full).

    The rank maps are the candidates :func:`find` tries. What is shown, before anything runs:

    * the schedule: every representative rank sends, under each generator, exactly what its
      image sends, step by step (its receivers, bytes and operands mapped); the schedule's
      dependencies follow from its steps alone (a transfer waits for the frontiers of its
      ranks), so they map too. A pipelined chain (explicit dependencies) is not shown: full.
    * the resources: the group acts freely on the ranks (every orbit as large as the group), so
      every transfer's orbit is the group's size; each generator maps every rank's DMA engines,
      VectorEs and HBM stacks onto its image's, consistently (ranks sharing a stack map onto
      ranks sharing one), and the route between every pair of chips in the orbits of the
      representatives' pairs onto the route between their images, link for link, of the same
      bandwidth, latency and proxy, consistently across pairs. A transfer's bookings are made
      of those (Network.plan), so every transfer's image books the images of its resources.

    Then the representatives run with the multiplicities their orbits bring (as :func:`find`'s
    reduced runs do) and their ticks stand for their orbits'."""
    from .algorithms import build
    from .schedule import NotQuotient, Quotient, Schedule

    ctx = res.ctx
    group = tuple(ctx.group)
    if len(group) < 2 or len(set(res.starts)) != 1:
        return None
    rt = runner.net.runtime
    if rt.efa_proxy and rt.ranks_per_proxy != 1:
        return None
    topo = runner.net.topo
    rpc = topo.rpc
    fams = _candidates(runner, [group])
    cands = [s for fam in fams for s in fam]
    if not cands:
        return None

    def chips_to_chips(s: dict[int, int]) -> bool:
        img: dict[int, int] = {}
        return all(img.setdefault(r // rpc, s[r] // rpc) == s[r] // rpc for r in s)

    def built(q: Quotient) -> Schedule | None:
        sched = Schedule(group, q)
        try:
            build(sched, ctx, res.algorithm)
        except NotQuotient:
            return None
        return sched

    # first: which candidate of each family maps a seed rank's sends onto its image's
    seed = group[0]
    q1 = Quotient({r: -1 for r in group}, frozenset({seed, *(s[seed] for s in cands)}))
    if built(q1) is None:
        return None
    gens: list[dict[int, int]] = []
    for fam in fams:
        if not fam:
            if gens:
                break
            continue
        for s in fam:
            if chips_to_chips(s) and _equivariant(q1, [s], [seed]):
                gens.append(s)
                break
    # the generators as a whole: when they do not show (a seed rank alone can pass a map the
    # rest of the group does not), the last one is dropped and the rest tried again
    while gens:
        got = _attempt(runner, res, gens, built)
        if got is not None:
            return got
        gens.pop()
    return None


def _attempt(runner: "CollectiveRunner", res: Any, gens: list[dict[int, int]], built: Callable[[Any], Any]
             ) -> tuple[Any, Symmetry] | None:
    """:func:`direct` with the group ``gens`` generate, or None when it does not show."""
    from .schedule import Quotient

    group = tuple(res.ctx.group)
    elems = _closure(gens, group)
    if elems is None:
        return None
    order = len(elems)
    # the ranks' orbits: a free action (each orbit has the group's size), representatives the
    # first of each orbit in the group's order
    rank_rep: dict[int, int] = {}
    for i, r in enumerate(group):
        if r in rank_rep:
            continue
        orbit = {group[e[i]] for e in elems}
        if len(orbit) != order:
            return None
        for x in orbit:
            rank_rep[x] = r
    reps = sorted(set(rank_rep.values()), key=group.index)
    keep = frozenset({*reps, *(g[r] for g in gens for r in reps)})
    q = Quotient(rank_rep, keep)
    sched = built(q)
    if sched is None or not _equivariant(q, gens, reps):
        return None
    found = _resources(runner, sched, gens, elems, group, order)
    if found is None:
        return None
    res_rep, dinfo = found
    n = len(sched.transfers)
    sym = Symmetry(gens, list(range(n)), {i: order for i in range(n)}, rank_rep, {r: order for r in reps}, res_rep,
                   {}, [0], [0], [None], dinfo)
    return sched, sym


def _resources(runner: "CollectiveRunner", sched: Any, gens: list[dict[int, int]], elems: list[tuple[int, ...]],
               group: Sequence[int], order: int) -> tuple[dict[int, tuple[Any, int]], Direct] | None:
    """The resource orbits of a schedule on representatives (see :func:`direct`), or None when
    a generator does not map the resources the call uses onto resources alike."""
    from ..memory.hbm import stack_of_core

    net = runner.net
    topo = net.topo
    cfg = net.config
    rpc = topo.rpc
    lnc = cfg.chip.lnc
    dims = runner.system.topology

    slot_stacks: list[list[int]] = []  # the HBM stacks of a chip's k-th rank
    for k in range(rpc):
        out: list[int] = []
        for c in range(k * lnc, (k + 1) * lnc):
            st = stack_of_core(cfg, c)
            if st not in out:
                out.append(st)
        slot_stacks.append(out)

    def stacks(r: int) -> list[int]:
        return slot_stacks[r % rpc]

    kinds = ("dma", "vec") if net.vector_reduce else ("dma",)
    # each generator on the ranks' resources: DMA engines and VectorEs by rank, HBM stacks
    # through the ranks that use them (consistently)
    maps: list[dict[Any, Any]] = []
    for g in gens:
        m: dict[Any, Any] = {}
        for r in group:
            gr = g[r]
            for kind in kinds:
                for i in range(lnc):
                    m[(kind, r, i)] = (kind, gr, i)
            a, b = slot_stacks[r % rpc], slot_stacks[gr % rpc]
            if len(a) != len(b):
                return None
            for i, st in enumerate(a):
                key, img = ("hbm", r // rpc, st), ("hbm", gr // rpc, b[i])
                if m.setdefault(key, img) != img:
                    return None
        maps.append(m)
    # the routes between the chips of every transfer's ends: the representatives' pairs and
    # their images under the whole group, each route mapped link for link by each generator
    pos = {r: i for i, r in enumerate(group)}
    pairs: set[tuple[int, int]] = set()
    for t in sched.transfers:
        if t.is_node:
            continue
        for d in dict.fromkeys(t.dsts):
            if t.src // rpc != d // rpc:
                pairs.add((t.src, d))
    chip_pairs: set[tuple[int, int]] = set()
    for a, b in pairs:
        ia, ib = pos[a], pos[b]
        for e in elems:
            chip_pairs.add((group[e[ia]] // rpc, group[e[ib]] // rpc))
    chip_of: list[dict[int, int]] = []
    for g in gens:
        cm: dict[int, int] = {}
        for r in group:
            cm[r // rpc] = g[r] // rpc
        chip_of.append(cm)
    for m, cm in zip(maps, chip_of):
        for a, b in chip_pairs:
            ra, rb = topo.route(a, b), topo.route(cm[a], cm[b])
            if len(ra) != len(rb):
                return None
            for k1, k2 in zip(ra, rb):
                d1, d2 = dims[k1[0]], dims[k2[0]]
                if (d1.bandwidth, d1.latency, d1.proxy) != (d2.bandwidth, d2.latency, d2.proxy):
                    return None
                if m.setdefault(("link", k1), ("link", k2)) != ("link", k2):
                    return None
    for m in maps:  # one to one
        if len(set(m.values())) != len(m):
            return None
    # the orbits of addresses (over their numbers)
    rank_of = {a: i for i, a in enumerate(maps[0])}  # built in the group's order: deterministic
    addrs = list(rank_of)
    if any(b not in rank_of for m in maps for b in m.values()):
        return None
    roots = [addrs[k] for k in _classes(len(addrs), ((rank_of[a], rank_of[b]) for m in maps for a, b in m.items()))]
    members: dict[Any, list[Any]] = {}
    for a, rt in zip(addrs, roots):
        members.setdefault(rt, []).append(a)
    canon = dict(zip(addrs, roots))
    # the representatives' booked resources, by address, and each orbit's booked representative
    addr: dict[int, Any] = {}
    for t in sched.transfers:
        if t.is_node:
            continue
        for r in {t.src, *t.dsts, *t.reads, *t.dst_reads}:
            rr = net.rank(r)
            for i, d in enumerate(rr.dma):
                addr[id(d)] = ("dma", r, i)
            for i, v in enumerate(rr.vector):
                addr[id(v)] = ("vec", r, i)
            chip = net.chip(r // rpc)
            for s in stacks(r):
                addr[id(chip.hbm[s])] = ("hbm", r // rpc, s)
        for k in runner.plan_of(t)[1]:
            addr[id(net.links[k])] = ("link", k)
    res_rep: dict[int, tuple[Any, int]] = {}
    booked: dict[Any, Any] = {}  # orbit -> its first booked resource
    for t in sched.transfers:
        if t.is_node:
            continue
        for _, obj, _, _ in runner.plan_of(t)[0]:
            a = addr.get(id(obj))
            if a is None or a not in rank_of:
                return None
            top = canon[a]
            first = booked.setdefault(top, obj)
            size = len(members[top])
            if order % size:
                return None
            res_rep[id(obj)] = (first, size)
    return res_rep, Direct(order, addr, canon, members)
