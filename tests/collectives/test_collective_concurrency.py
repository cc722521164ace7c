"""Concurrent collectives of different groups share links, HBM, DMA engines and CC cores: the
TP and DP collectives of one training step, simulated together, slow each other where their
routes meet (simulate_collectives takes the whole set)."""

from trnsim.collectives import CollectiveCall, simulate_collectives
from trnsim.config import load_system

TRN2 = load_system("trn2.48xlarge")


def step_calls():
    """A 2D mesh on a trn2.48xlarge: 8 TP groups of 8 ranks (two chips each) all-reduce 32 MiB
    while 8 DP groups (one rank of every TP group's position) reduce-scatter 64 MiB."""
    tp = [CollectiveCall("all-reduce", 32 << 20, group=list(range(8 * k, 8 * k + 8)), label=f"tp{k}")
          for k in range(8)]
    dp = [CollectiveCall("reduce-scatter", 64 << 20, group=list(range(k, 64, 8)), label=f"dp{k}") for k in range(8)]
    return tp, dp


def test_tp_and_dp_collectives_of_one_step_slow_each_other_on_shared_links():
    tp, dp = step_calls()
    tp_alone = simulate_collectives(TRN2, tp)
    dp_alone = simulate_collectives(TRN2, dp)
    both = simulate_collectives(TRN2, tp + dp)
    shared = set(tp_alone[0].link_bytes) & set(dp_alone[0].link_bytes)
    assert "chip 0 -> chip 1 (x+)" in shared  # TP's ring between its two chips; DP's route from chip 0 to chip 2
    for alone, together in zip(tp_alone + dp_alone, both):
        assert together.time_ticks > alone.time_ticks  # every call of both kinds is slower together
    assert both[0].time_ticks > 1.3 * tp_alone[0].time_ticks
    # together, what holds the TP call back longest is a resource the DP calls use too
    bound = both[0].bound
    dp_use = {f"link {k}" for d in dp_alone for k in d.link_bytes} | {f"DMA rank {r}" for d in dp_alone for r in d.dma_bytes}
    assert tp_alone[0].bound.startswith("DMA") and bound in dp_use and bound != tp_alone[0].bound, bound


def test_disjoint_groups_do_not_slow_each_other():
    """Two TP all-reduces on different chips share nothing: each takes what it takes alone."""
    a = CollectiveCall("all-reduce", 8 << 20, group=[0, 1, 2, 3])
    b = CollectiveCall("all-reduce", 8 << 20, group=[60, 61, 62, 63])
    alone = simulate_collectives(TRN2, [a])[0]
    x, y = simulate_collectives(TRN2, [a, b])
    assert x.time_ticks == y.time_ticks == alone.time_ticks


def test_sibling_groups_are_the_meshs_other_groups():
    from trnsim.collectives import sibling_groups

    tp = sibling_groups(range(8), 64)
    assert len(tp) == 8 and tp[1] == tuple(range(8, 16)) and tp[-1] == tuple(range(56, 64))
    dp = sibling_groups(range(0, 64, 8), 64)
    assert len(dp) == 8 and dp[1] == tuple(range(1, 64, 8))
    assert sibling_groups([0, 1, 2], 4) == [(0, 1, 2)]  # no translate fits: alone
    assert sibling_groups([0, 1, 4, 5], 16) == [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)]


def test_sibling_groups_are_the_same_set_from_any_group():
    from trnsim.collectives import sibling_groups

    dp1 = sibling_groups(range(1, 64, 8), 64)
    assert dp1[0] == tuple(range(1, 64, 8)) and tuple(range(0, 64, 8)) in dp1 and len(dp1) == 8
    assert set(sibling_groups([1, 3], 4)) == set(sibling_groups([0, 2], 4)) == {(0, 2), (1, 3)}


def test_a_call_beside_its_siblings_is_slower_where_they_share_links():
    """A 2x4 mesh on a trn1.32xlarge (two cores a chip): DP group [0, 4] (chips 0 and 2) and its
    sibling [1, 5] (the same chips) cross the same links at once; the TP groups [0..3] and
    [4..7] (chips 0-1 and 2-3) share nothing."""
    from trnsim.collectives import simulate_with_siblings

    trn1 = load_system("trn1.32xlarge")
    together, alone = simulate_with_siblings(trn1, "all-reduce", 16 << 20, [0, 4], 8)
    assert together.time_ticks > 1.5 * alone.time_ticks and together.bound.startswith("link")
    assert alone.time_ticks == simulate_collectives(trn1, [CollectiveCall("all-reduce", 16 << 20, group=[0, 4])])[0].time_ticks
    together, alone = simulate_with_siblings(trn1, "all-reduce", 16 << 20, [0, 1, 2, 3], 8)
    assert together.time_ticks == alone.time_ticks


def test_siblings_in_other_instances_are_left_out_with_identical_reports():
    """Groups in instances the call's group does not reach (directly or through groups that share
    one with it) share no link, stack or engine with it: simulate_with_siblings leaves them out,
    and the group's report is the one the whole set simulated together gives, tick for tick."""
    from trnsim.collectives import simulate_with_siblings
    from trnsim.collectives.api import _sharing

    trn1 = load_system("trn1.32xlarge", ["topology.efa.size=4"])  # 4 instances of 32 ranks
    # a TP group inside instance 0: its 15 siblings in instances 1-3 are left out, 3 kept
    tp = [tuple(range(8 * k, 8 * k + 8)) for k in range(16)]
    assert _sharing(tp, 32) == tp[:4]
    # a DP pair across instances 0 and 1: the pairs on instances 2 and 3 are left out
    dp = [(k, k + 32) for k in range(32)] + [(64 + k, 96 + k) for k in range(32)]
    assert _sharing(dp, 32) == dp[:32]
    # linked through a third group: [0, 32] shares instance 1 with [33, 64], which reaches 2
    assert _sharing([(0, 32), (33, 64), (96, 97)], 32) == [(0, 32), (33, 64)]
    for group, world, calls in ((list(range(8)), 128, tp), ([0, 32], 128, dp)):
        together, _ = simulate_with_siblings(trn1, "all-reduce", 1 << 20, group, world)
        full = simulate_collectives(trn1, [CollectiveCall("all-reduce", 1 << 20, group=list(g)) for g in calls])[0]
        assert together.time_ticks == full.time_ticks and together.link_bytes == full.link_bytes
        assert together.bound == full.bound


def test_collectives_on_several_cc_streams_run_rings_where_the_runtime_has_no_multistream_mesh():
    """Neuron enabled Mesh in multi-stream mode on Trn3 Gen2 UltraServers only (SDK 2.32): a
    call of a program with collectives on two CC streams runs the ring fallback on a
    trn2.48xlarge (collectives.multistream_mesh false), the size rule's pick with one stream or
    where the system keeps Mesh; a ring pays its p-1 steps, so it is slower at small sizes."""
    import pytest

    from trnsim.collectives import CollectiveError, simulate_collective

    group = list(range(16))
    one = simulate_collective(TRN2, "all-reduce", 1024, group=group)
    two = simulate_collective(TRN2, "all-reduce", 1024, group=group, streams=2)
    assert one.algorithm == "two-step-mesh" and two.algorithm == "bidir-ring"
    assert "multistream_mesh" in two.reason and two.time_ticks > 3 * one.time_ticks
    kept = simulate_collective(TRN2, "all-reduce", 1024, group=group, streams=2,
                               overrides=["collectives.multistream_mesh=true"])
    assert kept.algorithm == one.algorithm and kept.time_ticks == one.time_ticks
    gen2 = load_system("trn3-ultraserver-gen2")
    assert simulate_collective(gen2, "all-gather", 4096, ranks=8, streams=2).algorithm == \
        simulate_collective(gen2, "all-gather", 4096, ranks=8).algorithm
    with pytest.raises(CollectiveError, match="streams must be a whole number of CC streams >= 1"):
        simulate_collective(TRN2, "all-reduce", 1024, group=group, streams=0)


def test_a_call_beside_another_familys_running_call_and_siblings_is_slower_both_ways():
    """What the distributed backend asks for a TP all-reduce that starts while the step's DP
    reduce-scatter runs on another CC stream (NxD's multistream FSDP: stream 0 TP, stream 1
    FSDP): simulate_with_siblings(beside=...) runs both families with their siblings, the
    running one started earlier; each is slower than beside its own siblings only, and the
    later call's report counts from its own start."""
    from trnsim.collectives import simulate_with_siblings

    tp, dp = list(range(8)), list(range(0, 64, 8))
    tp_sibs, tp_alone = simulate_with_siblings(TRN2, "all-reduce", 4 << 20, tp, 64)
    dp_sibs, _ = simulate_with_siblings(TRN2, "reduce-scatter", 8 << 20, dp, 64)
    tp_beside, alone = simulate_with_siblings(TRN2, "all-reduce", 4 << 20, tp, 64,
                                              beside=[("reduce-scatter", 8 << 20, dp, "bf16", None, 1000)])
    assert alone.time_ticks == tp_alone.time_ticks
    assert tp_beside.start_ticks[0] == 1000 and tp_beside.time_ticks > tp_sibs.time_ticks
    dp_beside, _ = simulate_with_siblings(TRN2, "reduce-scatter", 8 << 20, dp, 64,
                                          beside=[("all-reduce", 4 << 20, tp, "bf16", None, 0)])
    assert dp_beside.time_ticks > dp_sibs.time_ticks
    # started long after the other family's calls ended: nothing shared in time, the same ticks
    late, _ = simulate_with_siblings(TRN2, "all-reduce", 4 << 20, tp, 64,
                                     beside=[("reduce-scatter", 8 << 20, dp, "bf16", None, 10 * dp_sibs.time_ticks)])
    assert late.time_ticks == tp_sibs.time_ticks
