"""Alike ranks simulated once (trnsim/collectives/symmetry.py): same-tick arrivals share, so
alike ranks end alike, and a call run on its orbits' representatives reports exactly what the
full simulation reports."""

import pytest

from trnsim.collectives import CollectiveCall, simulate_collective
from trnsim.collectives.runner import CollectiveRunner
from trnsim.config import load_system

TRN2 = load_system("trn2.48xlarge")


def run(system, call, symmetric):
    e = CollectiveRunner(system, symmetric=symmetric)
    h = e.launch(call)
    return e.run()[0], h.sym


def same(a, b):
    assert a.end_ticks == b.end_ticks and a.start_ticks == b.start_ticks and a.time_ticks == b.time_ticks
    assert a.link_bytes == b.link_bytes and a.hbm_bytes == b.hbm_bytes and a.dma_bytes == b.dma_bytes
    assert a.bound == b.bound and a.bound_percent == pytest.approx(b.bound_percent, abs=1e-9)
    assert a.chunks == b.chunks and a.transfers == b.transfers and a.algorithm == b.algorithm


def test_alike_ranks_end_on_the_same_tick():
    """A 64-rank KangaRing all-reduce: every rank does the same work along the snake, so every
    rank ends on the same tick (before same-tick arrivals shared, 8 of 64 ended a tick group
    earlier, by the order simpy ran same-tick bookings in)."""
    r = simulate_collective(TRN2, "all-reduce", 64 << 20, ranks=64)
    assert r.algorithm == "kangaring" and len(set(r.end_ticks)) == 1


@pytest.mark.parametrize("system,call,order", [
    # KangaRing: two chips along the snake, and the mirror (its partners' cycle is its primaries' reversed)
    (TRN2, CollectiveCall("all-reduce", 64 << 20, ranks=64), 16),
    (TRN2, CollectiveCall("all-reduce", 1 << 20, ranks=64), 2),  # RDH
    (TRN2, CollectiveCall("all-gather", 4 << 20, ranks=16, dtype="fp32"), 2),
    (TRN2, CollectiveCall("all-reduce", 1 << 20, ranks=16, algorithm="ring"), 4),  # one chip along the ring
    # hierarchical: rings in each instance (Trn1's runtime has no mesh reduce-scatter or all-gather), 2-rank AR across
    (load_system("trn1.32xlarge", ["topology.efa.size=2"]), CollectiveCall("all-reduce", 1 << 20, ranks=64), 32),
    (load_system("trn2-ultraserver"), CollectiveCall("all-reduce", 4 << 20, ranks=256), 8),
])
def test_a_symmetric_run_reports_exactly_what_the_full_run_does(system, call, order):
    full, none = run(system, call, False)
    reduced, sym = run(system, call, True)
    assert none is None and sym is not None and sym.order == order
    same(full, reduced)


def test_calls_that_are_not_alike_run_in_full():
    """Ranks starting at different ticks, or a permute whose pairs break the ring, have no
    symmetry to use: the runner runs every transfer."""
    staggered = CollectiveCall("all-reduce", 1 << 20, ranks=8, start=[0, 10, 0, 0, 0, 0, 0, 0])
    full, _ = run(TRN2, staggered, False)
    reduced, sym = run(TRN2, staggered, True)
    assert sym is None
    same(full, reduced)
    pairs = CollectiveCall("permute", 1 << 20, group=[0, 1, 4, 5], pairs=[(0, 4), (1, 0)])
    reduced, sym = run(TRN2, pairs, True)
    assert sym is None


def test_a_symmetric_runner_takes_its_calls_before_it_runs():
    e = CollectiveRunner(TRN2, symmetric=True)
    e.launch(CollectiveCall("all-reduce", 1 << 20, ranks=8))
    e.run()
    with pytest.raises(RuntimeError, match="^a symmetric runner takes its calls before it runs"):
        e.launch(CollectiveCall("all-reduce", 1 << 20, ranks=8))


def run_all(system, calls, symmetric):
    e = CollectiveRunner(system, symmetric=symmetric)
    hs = [e.launch(c) for c in calls]
    return e.run(), hs[0].sym


@pytest.mark.parametrize("system,groups,nbytes,order", [
    # 8 DP groups of a TP8 x DP8 mesh: one rank of every chip pair, all sharing links
    (TRN2, [list(range(k, 64, 8)) for k in range(8)], 64 << 20, 8),
    # 2 DP groups of 16 on a trn1.32xlarge (2 cores a chip): the cores turned, each ring turned
    (load_system("trn1.32xlarge"), [list(range(k, 32, 2)) for k in range(2)], 16 << 20, 2),
    # 4 TP groups of 16 ranks (4 chips each): the chips moved, each ring turned by a chip
    (TRN2, [list(range(16 * k, 16 * k + 16)) for k in range(4)], 8 << 20, 4),
])
def test_sibling_calls_run_once_and_report_exactly_what_the_full_run_does(system, groups, nbytes, order):
    """Sibling calls (an SPMD step's other groups making the same call, as the distributed
    backend and the estimate simulate them) map onto each other (a chip's cores turned, chips
    moved along a dimension): only the first call of each orbit of calls runs, its
    representatives only, and every call's report is the full run's."""
    calls = [CollectiveCall("all-reduce", nbytes, group=g) for g in groups]
    full, none = run_all(system, calls, False)
    reduced, sym = run_all(system, calls, True)
    assert none is None and sym is not None and sym.order >= order and sym.base[-1] < len(groups) - 1
    assert full[0].time_ticks > simulate_collective(system, "all-reduce", nbytes, group=groups[0]).time_ticks \
        or system is not TRN2 or len(groups[0]) == 16  # siblings sharing links slow each other
    for a, b in zip(full, reduced):
        same(a, b)


def test_calls_that_overlap_or_differ_run_in_full():
    """A TP call and a DP call through the same ranks, or siblings of different sizes, are not
    alike: the runner runs every transfer."""
    tp = CollectiveCall("all-reduce", 8 << 20, group=list(range(8)))
    dp = CollectiveCall("all-reduce", 8 << 20, group=list(range(0, 64, 8)))
    (a, b), sym = run_all(TRN2, [tp, dp], True)
    (c, d), _ = run_all(TRN2, [tp, dp], False)
    assert sym is None
    same(a, c)
    same(b, d)
    other = CollectiveCall("all-reduce", 4 << 20, group=list(range(8, 16)))
    _, sym = run_all(TRN2, [tp, other], True)
    assert sym is None


# ---- a lone call built on its representatives directly (symmetry.direct) ----------------------


def full_schedule(system, call):
    from trnsim.collectives.algorithms import build
    from trnsim.collectives.schedule import Schedule

    e = CollectiveRunner(system)
    h = e.launch(call)
    s = Schedule(h.res.ctx.group)
    build(s, h.res.ctx, h.res.algorithm)
    return s


def descriptors(transfers, g=None):
    from collections import Counter

    m = (lambda x: x) if g is None else g.__getitem__
    return Counter((t.step, m(t.src), tuple(map(m, t.dsts)), t.nbytes, tuple(map(m, t.reads)),
                    tuple(map(m, t.dst_reads)), t.gather) for t in transfers if not t.is_node)


@pytest.mark.parametrize("system,call", [
    (TRN2, CollectiveCall("all-reduce", 64 << 20, ranks=64)),  # KangaRing
    (TRN2, CollectiveCall("all-reduce", 1 << 20, ranks=64)),  # RDH
    (TRN2, CollectiveCall("all-gather", 4 << 20, ranks=16, dtype="fp32")),
    (TRN2, CollectiveCall("all-reduce", 1 << 20, ranks=16, algorithm="ring")),
    (load_system("trn1.32xlarge", ["topology.efa.size=2"]), CollectiveCall("all-reduce", 1 << 20, ranks=64)),
    (load_system("trn2-ultraserver"), CollectiveCall("all-reduce", 4 << 20, ranks=256)),  # RDH, then mesh over z
])
def test_representatives_built_directly_are_exactly_the_orbits_of_the_full_schedule(system, call):
    """The orbit reasoning, checked against the schedule built in full: the representatives'
    transfers taken by every element of the group the generators make are the full schedule's
    transfers, each exactly once (so each representative stands for exactly its orbit, of the
    group's size), and the run on them reports what the full run reports, tick for tick."""
    from trnsim.collectives.symmetry import _closure, direct

    e = CollectiveRunner(system, symmetric=True)
    h = e.launch(call)
    got = direct(e, h.res)
    assert got is not None
    sched, sym = got
    group = h.res.ctx.group
    elems = _closure(sym.generators, group)
    assert len(elems) == sym.direct.order == sym.order
    images = sum((descriptors(sched.transfers, {r: group[e[i]] for i, r in enumerate(group)}) for e in elems),
                 start=descriptors([]))
    assert images == descriptors(full_schedule(system, call).transfers)
    full, _ = run(system, call, False)
    reduced, s = run(system, call, True)
    assert s.direct is not None
    same(full, reduced)


def test_a_call_whose_symmetry_cannot_be_shown_directly_is_checked_in_full():
    """Pieces that are not all alike (an uneven split: a ring turned by a rank would carry
    other sizes), a pipelined chain (explicit dependencies): not built on representatives; the
    runner builds the call in full and finds what symmetry it has there, or runs it all."""
    from trnsim.collectives.symmetry import direct

    for call in (CollectiveCall("all-reduce", 2 * 1001, ranks=16, algorithm="ring"),
                 CollectiveCall("broadcast", 1 << 20, ranks=8, algorithm="ring")):
        e = CollectiveRunner(TRN2, symmetric=True)
        h = e.launch(call)
        assert direct(e, h.res) is None
        full, _ = run(TRN2, call, False)
        reduced, sym = run(TRN2, call, True)
        assert sym is None or sym.direct is None
        same(full, reduced)


def test_a_join_node_does_not_stand_in_a_frontier_for_the_transfer_that_made_it():
    """A send whose sender's frontier is long (after a mesh step) first joins it; the step's
    frontier then holds the send, not the join, so the next step waits for the send (it once
    held the join: a 256-rank all-reduce's all-gather started before its mesh's local add)."""
    from trnsim.collectives.schedule import Schedule

    s = Schedule(range(6))
    s.begin_step()
    for r in range(6):
        for x in range(6):
            if x != r:
                s.send(r, x, 64)
    s.end_step()
    s.begin_step()
    local = s.send(0, 0, 64, (0,) * 6)
    s.end_step()
    assert not s.transfers[local].is_node and s.transfers[s.transfers[local].deps[0]].phase == "join"
    s.begin_step()
    nxt = s.send(0, 1, 64)
    s.end_step()
    assert local in s.transfers[nxt].deps
