"""Collective algorithms over the network model: what each one moves, the size rule that picks
one, the errors for what a group or topology cannot run, and the simulation next to its α-β
estimate where the estimate's assumptions hold."""

import pytest

from trnsim.collectives import ALGORITHMS, COLLECTIVES, CollectiveError, estimate_collective, simulate_collective
from trnsim.collectives.runtime import network_only
from trnsim.config import load_system

TRN2 = load_system("trn2.48xlarge")
TWO = load_system("trn2.48xlarge", ["topology.efa.size=2"])  # two instances: hierarchical runs
GEN1 = load_system("trn3-ultraserver-gen1")

RUNS = {c: [a for a, spec in ALGORITHMS.items() if c in spec.collectives] for c in COLLECTIVES}


@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_every_algorithm_of_every_collective_runs(collective):
    for algo in RUNS[collective]:
        for n in (64, 3 << 20):
            r = simulate_collective(TWO, collective, n, ranks=16, algorithm=algo)  # 8 ranks on each instance
            assert r.algorithm == algo and r.reason.split(";")[0] == "forced"
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
    ("all-reduce", 8, 64, "two-step-mesh", "8B < mesh_below 1MB, 4 ranks on each of 16 chips"),
    ("all-reduce", 8, 4, "mesh", "8B < mesh_below 1MB x 4/64 ranks"),
    ("all-reduce", 4 << 20, 64, "rdh", "4MiB < rdh_below 56MB, 64 ranks a power of two"),
    ("all-reduce", 1 << 30, 64, "kangaring", "1GiB >= rdh_below 56MB, pairs of ranks on every chip"),
    ("all-reduce", 4 << 20, 48, "kangaring", "48 ranks not a power of two, pairs of ranks on every chip"),
    ("all-gather", 1 << 30, 16, "kangaring", "1GiB >= rdh_below 56MB x 16/64 ranks, pairs of ranks on every chip"),
    ("all-reduce", 2 << 20, 16, "rdh", "2MiB < rdh_below 56MB x 16/64 ranks, 16 ranks a power of two"),
    ("all-reduce", 32 << 20, 16, "kangaring", "32MiB >= rdh_below 56MB x 16/64 ranks, pairs of ranks on every chip"),
    ("all-to-all", 1 << 30, 64, "ring", "1GiB >= mesh_below 1MB on a torus: pairwise exchange"),
    ("all-to-all", 1 << 10, 64, "mesh", "1KiB < mesh_below 1MB"),
    ("broadcast", 1 << 30, 64, "ring", "1GiB >= rdh_below 56MB: pipelined chain"),
    ("reduce", 1 << 20, 64, "rdh", "1MiB < rdh_below 56MB: binomial tree"),
    ("send-recv", 1 << 20, 2, "mesh", "point to point: direct writes"),
])
def test_the_size_rule(collective, nbytes, ranks, algo, why):
    system = load_system("trn2.48xlarge", ["topology.efa.size=3"]) if ranks == 48 else TRN2
    inst = 1 if ranks == 48 else None  # 48 ranks on one of the three instances
    est = estimate_collective(system, collective, nbytes, ranks=ranks, instances=inst)
    r = simulate_collective(system, collective, nbytes, ranks=ranks, instances=inst) if nbytes <= 1 << 20 else None
    assert est.algorithm == algo
    if r is not None:
        assert (r.algorithm, r.reason) == (algo, why)
    if ranks == 48:
        return
    from trnsim.collectives.runner import CollectiveCall, resolve_call

    res = resolve_call(system, CollectiveCall(collective, nbytes, ranks))
    assert (res.algorithm, res.reason) == (algo, why)


@pytest.mark.parametrize("collective,nbytes,ranks,algo,why", [
    ("all-reduce", 16 << 10, 32, "mesh", "16KiB < mesh_below 8MB, the runtime's all-to-all all-reduce"),
    ("all-gather", 1 << 10, 32, "bidir-ring",
     "1KiB < mesh_below, no mesh all-gather on this runtime, torus links run both ways"),
    ("reduce-scatter", 1 << 20, 32, "bidir-ring",
     "1MiB < mesh_below, no mesh reduce-scatter on this runtime, torus links run both ways"),
    ("all-reduce", 32 << 20, 32, "bidir-ring", "32MiB >= rdh_below 8MB, torus links run both ways"),
])
def test_trn1s_runtime_meshes_only_its_all_reduce(collective, nbytes, ranks, algo, why):
    """Trn1's runtime (2.14-2.15) has an all-to-all all-reduce and no mesh all-gather or
    reduce-scatter, and no RDH (collectives.mesh_collectives: all-reduce, rdh_below = mesh_below)."""
    from trnsim.collectives.runner import CollectiveCall, resolve_call

    res = resolve_call(load_system("trn1.32xlarge"), CollectiveCall(collective, nbytes, ranks))
    assert (res.algorithm, res.reason) == (algo, why)


def test_a_compiled_graphs_collective_pays_graph_launch_not_launch():
    from trnsim.collectives.runtime import in_graph

    trn1 = load_system("trn1.32xlarge")
    g = in_graph(trn1)
    assert g.collectives.launch == trn1.collectives.graph_launch < trn1.collectives.launch
    alone = simulate_collective(trn1, "all-reduce", 16 << 10, ranks=32)
    inside = simulate_collective(g, "all-reduce", 16 << 10, ranks=32)
    assert alone.time_ticks - inside.time_ticks == trn1.chip.ps_to_ticks(trn1.collectives.launch - g.collectives.launch)
    trn2 = in_graph(TRN2)  # one rule on every system: the in-graph trigger has no runtime launch
    assert trn2.collectives.launch == TRN2.collectives.graph_launch == trn1.collectives.graph_launch
    assert in_graph(trn2) is trn2  # a system already in a graph stays as it is


def test_a_call_across_trn1_instances_runs_its_intra_instance_rings_on_channels():
    """A communicator spanning instances has one channel per EFA device (flat_ring_channels, 8 on
    trn1.32xlarge); a hierarchical call's intra-instance rings run a cycle per channel, as many
    as it has whole elements per ring rank: 128 B of fp32 over 32 ranks is one channel, 256 B two,
    1 KiB and up eight. The CC core issues every channel's transfers, so the floor rises with them."""
    from trnsim.collectives.algorithms.base import hierarchy_groups
    from trnsim.collectives.algorithms.compose import channels_of, hierarchical_plan
    from trnsim.collectives.runner import CollectiveCall, resolve_call

    two = load_system("trn1.32xlarge", ["topology.efa.size=2"])
    got = {}
    for n in (128, 256, 512, 1024, 1 << 20):
        ctx = resolve_call(two, CollectiveCall("all-reduce", n, 64, dtype="fp32")).ctx
        groups, algos = hierarchical_plan(ctx)
        got[n] = [channels_of(ctx, groups, k, algos[k], 32, n) for k in range(len(groups))]
    assert got == {128: [1, 1], 256: [2, 1], 512: [4, 1], 1024: [8, 1], 1 << 20: [8, 1]}
    ctx = resolve_call(load_system("trn1.32xlarge"), CollectiveCall("all-reduce", 1 << 20, 32)).ctx
    assert ctx.shape is not None and len(hierarchy_groups(ctx)) < 2  # one instance: no tiers, one channel


def test_more_channels_cost_the_cc_core_more_issues():
    two = load_system("trn1.32xlarge", ["topology.efa.size=2"])
    t = {n: simulate_collective(two, "all-reduce", n, ranks=64, dtype="fp32").time_us for n in (128, 256, 1024)}
    assert t[128] < t[256] < t[1024]


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
     "unknown algorithm 'tree' for all-reduce: expected one of ring, bidir-ring, rdh, mesh, two-step-mesh, "
     "single-step-mesh, kangaring, per-dim-ring, hierarchical"),
    (dict(collective="all-to-all", nbytes=8, ranks=2, algorithm="rdh"),
     "algorithm 'rdh' does not run all-to-all; expected one of ring, mesh"),
    (dict(collective="all-reduce", nbytes=8, group=[0, 64]),
     "all-reduce: rank 64 is not in trn2.48xlarge, whose ranks are 0..63"),
    (dict(collective="all-reduce", nbytes=8, group=[3, 3]), "all-reduce: rank 3 appears twice in the group"),
    (dict(collective="all-reduce", nbytes=8, ranks=2, dtype="fp7"),
     "all-reduce: unknown dtype 'fp7'"),
    (dict(collective="broadcast", nbytes=8, ranks=2, root=5), "broadcast: root 5 is not in the group"),
    (dict(collective="permute", nbytes=8, ranks=2, pairs=[(0, 5)]),
     "permute: pair (0, 5) must name ranks of the group"),
    (dict(collective="permute", nbytes=8, ranks=2, pairs=[(0, 1), (0, 0)]),
     "permute: rank 0 is the source of two pairs; a rank sends once"),
    (dict(collective="all-reduce", nbytes=8, ranks=2, dtype="int65"),
     "all-reduce: unknown dtype 'int65'"),
    (dict(collective="all-reduce", nbytes=8, ranks=16, instances=3),
     "all-reduce: 16 ranks cannot spread evenly over 3 instance(s) of trn2.48xlarge (1 instance(s) of 64 ranks); "
     "expected one of 1"),
    (dict(collective="all-reduce", nbytes=8, group=[0, 1], instances=1),
     "all-reduce: give instances= with ranks=, not with a group (a group places itself)"),
    (dict(collective="all-gather", nbytes=8, ranks=2, counts=[[0, 4], [4, 0]]),
     "all-gather: counts are for an uneven all-to-all; this is all-gather"),
    (dict(collective="all-to-all", nbytes=8, ranks=2, counts=[[0, 4]]),
     "all-to-all: counts must be 2 rows of 2 byte counts (one per rank of the group), got 1 rows"),
    (dict(collective="all-to-all", nbytes=8, ranks=2, counts=[[0, 4], [3, 0]]),
     "all-to-all: counts must be whole numbers of bf16 elements (2 bytes each) >= 0"),
    (dict(collective="all-to-all", nbytes=8, ranks=2, counts=[[0, 4], [2, 0]]),
     "all-to-all: bytes=8 but the largest rank sends 4 bytes by its counts; give bytes=4"),
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
    ("trn2.48xlarge", "all-gather", "kangaring", range(64)),
    ("trn2.48xlarge", "all-reduce", "mesh", range(16)),
    ("trn3-ultraserver-gen1", "all-reduce", "rdh", range(0, 64, 4)),  # one rank per chip of a server
    ("trn3-ultraserver-gen1", "all-gather", "ring", range(64)),
    ("trn3-ultraserver-gen1", "reduce-scatter", "per-dim-ring", range(0, 256, 4)),
    ("trn1.32xlarge", "all-reduce", "ring", range(32)),
])
def test_simulation_matches_the_alpha_beta_form_where_it_holds(system, collective, algo, group):
    """The network alone (the runtime's costs zero, a transfer on all of a core's DMA engines):
    one flow per link direction and switch port in every step, every rank its own HBM stack:
    within 2%. (Where a chip's ranks share a port, a flow's start latency hides behind the
    others' data and the simulation is faster than the step-by-step form; see
    tests/collectives/test_collective_forms.py.)"""
    net = load_system(system, network_only(system))
    for n in (8 << 10, 64 << 20):
        r = simulate_collective(net, collective, n, group=list(group), algorithm=algo)
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


def test_two_step_mesh_moves_chip_chunks_then_broadcasts_on_chip():
    """Neuron's intra-node mesh: all-gather in 2 steps whatever the group (chip chunks to every
    other chip, destinations split among the chip's ranks; then one duplicated on-chip write per
    rank); reduce-scatter in 2 (an add of the chip's chunks per off-chip rank; a local add)."""
    ag = simulate_collective(TRN2, "all-gather", 1 << 20, ranks=64, algorithm="two-step-mesh")
    assert ag.steps == 2 and ag.transfers == 16 * 15 + 64  # one write per (chip, other chip), one broadcast per rank
    rs = simulate_collective(TRN2, "reduce-scatter", 1 << 20, ranks=64, algorithm="two-step-mesh")
    assert rs.steps == 2 and rs.transfers == 16 * 60 + 64  # every off-chip rank once per chip; a local add each
    ar = simulate_collective(TRN2, "all-reduce", 1 << 20, ranks=64, algorithm="two-step-mesh")
    assert ar.steps == 4
    with pytest.raises(CollectiveError, match=r"it needs the same number of the group's ranks on every chip"):
        simulate_collective(TRN2, "all-gather", 1 << 20, group=[0, 1, 4], algorithm="two-step-mesh")


def test_single_step_mesh_trades_bytes_for_a_hop():
    """Single-step mesh all-reduce: one network step of (p-1)·n per rank, then a local add,
    against mesh's two of 2(p-1)/p·n (S21's table); the size rule takes it across instances
    only where the extra bytes cost less than a hop."""
    two = load_system("trn2.48xlarge", ["topology.efa.size=4"])
    s = simulate_collective(two, "all-reduce", 4096, group=[0, 64, 128, 192], algorithm="single-step-mesh")
    m = simulate_collective(two, "all-reduce", 4096, group=[0, 64, 128, 192], algorithm="mesh")
    assert s.steps == 2 and m.steps == 2
    assert sum(s.link_bytes.values()) == 4 * 3 * 4096 * 2  # every rank's buffer to 3 peers, up and down a port
    assert sum(m.link_bytes.values()) == 4 * 3 * 1024 * 2 * 2
    small = estimate_collective(two, "all-reduce", 4096, group=[0, 64, 128, 192])
    big = estimate_collective(two, "all-reduce", 64 << 20, group=[0, 64, 128, 192])
    assert small.algorithm == "single-step-mesh" and big.algorithm != "single-step-mesh"


def test_uneven_all_to_all_moves_each_ranks_own_bytes():
    """counts[i][j] bytes from the i-th rank to the j-th: only what is asked moves, so an
    all-to-all where one rank sends much is faster than the even one of the largest rank's bytes."""
    p = 16
    counts = [[(64 << 10) if i == 0 and j else (4 << 10) if j != i else 0 for j in range(p)] for i in range(p)]
    top = sum(counts[0])
    uneven = simulate_collective(TRN2, "all-to-all", top, ranks=p, algorithm="mesh", counts=counts)
    even = simulate_collective(TRN2, "all-to-all", top, ranks=p, algorithm="mesh")
    assert sum(uneven.link_bytes.values()) < sum(even.link_bytes.values())
    assert uneven.time_ticks < even.time_ticks and uneven.nbytes == top
    assert uneven.estimate.time_s < even.estimate.time_s


def test_eight_byte_words_move_as_eight_byte_elements():
    r = simulate_collective(TRN2, "all-reduce", 1 << 20, ranks=8, dtype="int64")
    assert r.dtype == "int64" and r.count == (1 << 20) // 8
    assert simulate_collective(TRN2, "all-gather", 8 * 8 * 3, ranks=8, dtype="fp64").count == 3
    with pytest.raises(CollectiveError, match=r"^all-reduce: 12 bytes is not a whole number of int64 elements"):
        simulate_collective(TRN2, "all-reduce", 12, ranks=8, dtype="int64")


def test_ranks_spread_over_instances_as_neuron_numbers_them():
    """64 ranks on a Trn2 UltraServer run 16 on each of its 4 instances (nccom-test -r 64 -N 4), so
    the Z links carry the hierarchical all-reduce's inter-instance part; -N 1 keeps them on one."""
    us = load_system("trn2-ultraserver")
    r = simulate_collective(us, "all-reduce", 64 << 20, ranks=64)
    assert r.group == tuple(i * 64 + k for i in range(4) for k in range(16))
    assert r.placement == "64 ranks on 4 of 4 instances (16 ranks each, on chips 0-3 of each: 16 chips)"
    assert r.algorithm == "hierarchical" and any("(z" in name for name in r.link_bytes)
    one = simulate_collective(us, "all-reduce", 64 << 20, ranks=64, instances=1)
    assert one.group == tuple(range(64)) and not any("(z" in name for name in one.link_bytes)
