"""Collective algorithms over the network model: what each one moves, the size rule that picks
one, the errors for what a group or topology cannot run, and the simulation next to its α-β
estimate where the estimate's assumptions hold."""

import pytest

from trnsim.collectives import ALGORITHMS, COLLECTIVES, CollectiveError, estimate_collective, simulate_collective
from trnsim.config import load_system

TRN2 = load_system("trn2.48xlarge")
GEN1 = load_system("trn3-ultraserver-gen1")

RUNS = {c: [a for a, spec in ALGORITHMS.items() if c in spec.collectives] for c in COLLECTIVES}


@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_every_algorithm_of_every_collective_runs(collective):
    for algo in RUNS[collective]:
        for n in (64, 3 << 20):
            r = simulate_collective(TRN2, collective, n, ranks=16, algorithm=algo)
            assert r.algorithm == algo and r.reason == "forced"
            assert r.time_ticks > 0 and len(r.end_ticks) == 16 and r.transfers > 0
            assert r.estimate.time_s > 0


def test_ring_moves_what_the_textbook_says():
    """Ring all-gather of S over p ranks: every rank sends (p-1) pieces of S/p, and the one link
    a chip's ring leaves by carries (p-1) of them; all-reduce moves twice that."""
    n, p = 64 << 20, 16
    ag = simulate_collective(TRN2, "all-gather", n, ranks=p, algorithm="ring")
    assert ag.steps == p - 1 and ag.transfers == p * (p - 1)
    assert set(ag.link_bytes.values()) == {(p - 1) * n // p} and len(ag.link_bytes) == 4
    ar = simulate_collective(TRN2, "all-reduce", n, ranks=p, algorithm="ring")
    assert ar.steps == 2 * (p - 1) and set(ar.link_bytes.values()) == {2 * (p - 1) * n // p}
    assert ar.busbw_factor == pytest.approx(2 * (p - 1) / p) and ag.busbw_factor == pytest.approx((p - 1) / p)
    # reduce-scatter reads two operands and writes one per step: 3 HBM touches per byte
    rs = simulate_collective(TRN2, "reduce-scatter", n, group=[0, 1], algorithm="ring")
    assert sum(rs.hbm_bytes.values()) == 3 * n // 2 * 2


def test_bidirectional_ring_halves_the_link_bytes():
    one = simulate_collective(TRN2, "all-gather", 64 << 20, ranks=64, algorithm="ring")
    two = simulate_collective(TRN2, "all-gather", 64 << 20, ranks=64, algorithm="bidir-ring")
    assert 2 * max(two.link_bytes.values()) == max(one.link_bytes.values())
    assert len(two.link_bytes) == 2 * len(one.link_bytes)


def test_rdh_steps_and_partner_distance():
    r = simulate_collective(TRN2, "all-reduce", 16 << 20, ranks=64, algorithm="rdh")
    assert r.steps == 12 and r.max_hops == 2  # log2(64) each way; chip-distance-2 partners cross 2 links
    with pytest.raises(CollectiveError, match=r"^algorithm 'rdh' cannot run all-reduce on 12 ranks of "
                                              r"trn2.48xlarge: it needs a power-of-two group; 12 ranks is not$"):
        simulate_collective(TRN2, "all-reduce", 1 << 20, group=list(range(12)), algorithm="rdh")


def test_kangaring_rings_over_primaries_with_duplicated_writes():
    """64 ranks = 32 pairs: 31 ring steps per phase (N/2 hops) plus one on-chip pair step; the
    primary's DMA writes its next primary and that primary's pair with one read."""
    k = simulate_collective(TRN2, "all-gather", 64 << 20, ranks=64, algorithm="kangaring")
    r = simulate_collective(TRN2, "all-gather", 64 << 20, ranks=64, algorithm="bidir-ring")
    assert k.steps == 1 + 31 and r.steps == 63
    assert sum(k.hbm_bytes.values()) < sum(r.hbm_bytes.values())  # 3 HBM touches per byte instead of 4
    assert sum(k.hbm_bytes.values()) / sum(r.hbm_bytes.values()) == pytest.approx(0.75, abs=0.02)
    with pytest.raises(CollectiveError, match=r"it needs pairs of ranks on every chip it uses"):
        simulate_collective(TRN2, "all-reduce", 1 << 20, group=[0, 4, 8, 12], algorithm="kangaring")


def test_per_dimension_and_hierarchical_compositions():
    pd = simulate_collective(TRN2, "all-reduce", 64 << 20, ranks=64, algorithm="per-dim-ring")
    assert pd.steps == 2 * 3 + 2 * 3 + 2 * 3  # RS chip, RS x, AR y (both halves), AG x, AG chip: 3 steps each
    with pytest.raises(CollectiveError, match=r"^algorithm 'per-dim-ring' cannot run all-reduce on 4 ranks of "
                                              r"trn2.48xlarge: it needs a group spanning at least 2 levels \(chip "
                                              r"cores, x, y, efa\); this one spans chip$"):
        simulate_collective(TRN2, "all-reduce", 1 << 20, ranks=4, algorithm="per-dim-ring")
    two = load_system("trn2.48xlarge", ["topology.efa.size=2"])
    h = simulate_collective(two, "all-reduce", 64 << 20, ranks=128)
    assert h.algorithm == "hierarchical" and "the group spans instances (efa)" in h.reason
    assert any("efa switch" in name for name in h.link_bytes)
    with pytest.raises(CollectiveError, match=r"needs a group that is a grid over the topology"):
        simulate_collective(TRN2, "all-reduce", 1 << 20, group=[0, 1, 5], algorithm="hierarchical")


@pytest.mark.parametrize("collective,nbytes,ranks,algo,why", [
    ("all-reduce", 8, 64, "mesh", "8B < mesh_below 1MB"),
    ("all-reduce", 4 << 20, 64, "rdh", "4MiB < rdh_below 56MB, 64 ranks a power of two"),
    ("all-reduce", 1 << 30, 64, "kangaring", "1GiB >= rdh_below 56MB, pairs of ranks on every chip"),
    ("all-reduce", 4 << 20, 48, "kangaring", "48 ranks not a power of two, pairs of ranks on every chip"),
    ("all-gather", 1 << 30, 16, "kangaring", "1GiB >= rdh_below 56MB, pairs of ranks on every chip"),
    ("all-to-all", 1 << 30, 64, "ring", "1GiB >= mesh_below 1MB on a torus: pairwise exchange"),
    ("all-to-all", 1 << 10, 64, "mesh", "1KiB < mesh_below 1MB"),
    ("broadcast", 1 << 30, 64, "ring", "1GiB >= rdh_below 56MB: pipelined chain"),
    ("reduce", 1 << 20, 64, "rdh", "1MiB < rdh_below 56MB: binomial tree"),
    ("send-recv", 1 << 20, 2, "mesh", "point to point: direct writes"),
])
def test_the_size_rule(collective, nbytes, ranks, algo, why):
    system = load_system("trn2.48xlarge", ["topology.efa.size=3"]) if ranks == 48 else TRN2
    est = estimate_collective(system, collective, nbytes, ranks=ranks)
    r = simulate_collective(system, collective, nbytes, ranks=ranks) if nbytes <= 1 << 20 else None
    assert est.algorithm == algo
    if r is not None:
        assert (r.algorithm, r.reason) == (algo, why)
    if ranks == 48:
        return
    from trnsim.collectives.engine import CollectiveCall, resolve_call

    res = resolve_call(system, CollectiveCall(collective, nbytes, ranks))
    assert (res.algorithm, res.reason) == (algo, why)


def test_one_rank_per_chip_groups_ring_not_kangaring():
    r = estimate_collective(TRN2, "all-reduce", 1 << 30, group=[0, 4, 8, 12])
    assert r.algorithm == "bidir-ring"
    sw = estimate_collective(GEN1, "all-reduce", 1 << 30, group=list(range(0, 256, 4)))
    assert sw.algorithm == "hierarchical"  # spans the 4 servers


@pytest.mark.parametrize("call,message", [
    (dict(collective="allreduce3", nbytes=8, ranks=2),
     "unknown collective 'allreduce3': expected one of all-reduce, all-gather, reduce-scatter, all-to-all, "
     "broadcast, reduce, send-recv, permute"),
    (dict(collective="all-reduce", nbytes=8, ranks=48),
     "all-reduce: 48 ranks does not divide trn2.48xlarge's 64 ranks (16 chips x 4 logical cores); expected one of "
     "1, 2, 4, 8, 16, 32, 64"),
    (dict(collective="all-reduce", nbytes=9, ranks=2),
     "all-reduce: 9 bytes is not a whole number of bf16 elements (2 bytes each)"),
    (dict(collective="all-reduce", nbytes=8, ranks=2, algorithm="tree"),
     "unknown algorithm 'tree' for all-reduce: expected one of ring, bidir-ring, rdh, mesh, kangaring, "
     "per-dim-ring, hierarchical"),
    (dict(collective="all-to-all", nbytes=8, ranks=2, algorithm="rdh"),
     "algorithm 'rdh' does not run all-to-all; expected one of ring, mesh"),
    (dict(collective="all-reduce", nbytes=8, group=[0, 64]),
     "all-reduce: rank 64 is not in trn2.48xlarge, whose ranks are 0..63"),
    (dict(collective="all-reduce", nbytes=8, group=[3, 3]), "all-reduce: rank 3 appears twice in the group"),
    (dict(collective="all-reduce", nbytes=8, ranks=2, dtype="fp7"),
     "all-reduce: unknown dtype 'fp7'"),
    (dict(collective="broadcast", nbytes=8, ranks=2, root=5), "broadcast: root 5 is not in the group"),
    (dict(collective="permute", nbytes=8, ranks=2, pairs=[(0, 0)]),
     "permute: pair (0, 0) must be two different ranks of the group"),
    (dict(collective="all-reduce", nbytes=8, ranks=2, start=[0]),
     "all-reduce: 1 start times for 2 ranks; give one, or one per rank"),
])
def test_bad_calls_are_one_line_errors(call, message):
    with pytest.raises(CollectiveError) as e:
        simulate_collective(TRN2, **call)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("system,collective,algo,group", [
    ("trn2.48xlarge", "all-reduce", "ring", range(64)),
    ("trn2.48xlarge", "all-gather", "bidir-ring", range(64)),
    ("trn2.48xlarge", "reduce-scatter", "kangaring", range(64)),
    ("trn2.48xlarge", "all-reduce", "mesh", range(16)),
    ("trn3-ultraserver-gen1", "all-reduce", "rdh", range(0, 64, 4)),  # one rank per chip of a server
    ("trn3-ultraserver-gen1", "all-gather", "ring", range(64)),
    ("trn3-ultraserver-gen1", "reduce-scatter", "per-dim-ring", range(0, 256, 4)),
    ("trn1.32xlarge", "all-reduce", "ring", range(32)),
])
def test_simulation_matches_the_alpha_beta_form_where_it_holds(system, collective, algo, group):
    """One flow per link direction and switch port in every step, every rank its own HBM
    stack: within 2%. (Where a chip's ranks share a port, a flow's start latency hides behind
    the others' data and the simulation is faster than the step-by-step form; see
    benchmarks/fidelity_collectives.py.)"""
    for n in (8 << 10, 64 << 20):
        r = simulate_collective(system, collective, n, group=list(group), algorithm=algo)
        assert r.time_s == pytest.approx(r.estimate.time_s, rel=0.02), (n, r.time_us, r.estimate.time_us)


def test_nbytes_follow_nccl_tests_counts():
    ag = simulate_collective(TRN2, "all-gather", 1000, ranks=4)  # count per rank: 1000 // (2 * 4) = 125
    assert ag.nbytes == 1000 and ag.count == 125
    odd = simulate_collective(TRN2, "all-gather", 1002, ranks=4)
    assert odd.nbytes == 1000  # rounded down to whole elements per rank, as nccl-tests does
    ar = simulate_collective(TRN2, "all-reduce", 1002, ranks=4)
    assert ar.nbytes == 1002 and ar.count == 501


def test_an_algorithm_carries_its_own_estimate():
    """One name, one place: an algorithm's record holds its schedule, its α-β steps and its closed
    form; the estimate of a call is that record's, for every collective it runs."""
    for name, spec in ALGORITHMS.items():
        assert callable(spec.build) and callable(spec.estimate) and spec.formula
        for c in spec.collectives:
            group = list(range(0, 64, 4)) if name == "per-dim-ring" else list(range(16))
            try:
                est = estimate_collective(TRN2, c, 1 << 20, group=group, algorithm=name)
            except CollectiveError:
                continue  # the group cannot run it (e.g. hierarchical on one instance)
            assert est.algorithm == name and est.formula == spec.formula and est.steps
