"""The network model: routes, links as FIFO bandwidth pipes, exact timelines of small transfers
(every tick derived here from the config figures), contention, DMA engines and CC cores; then
the runtime's costs on top (launch, issue, DMA rings, the EFA proxy), each tick derived too.

The exact timelines run the network alone (``network_only``: the runtime's costs zero, a
transfer on all of a core's DMA engines), so every tick is a link, DMA or HBM figure."""

from fractions import Fraction

import pytest

from trnsim.bandwidth import BandwidthPipe
from trnsim.collectives import CollectiveCall, simulate_collective, simulate_collectives
from trnsim.collectives.runtime import network_only
from trnsim.collectives.topology import Topology
from trnsim.config import load_system

TRN2 = load_system("trn2.48xlarge", network_only("trn2.48xlarge"))


def ceil_div(a, b):
    return -(-a // b)


def test_bandwidth_pipe_is_fifo_and_exact():
    log = []
    p = BandwidthPipe(Fraction(256 * 10**9), 4_800_000_000)
    p.log = log
    assert p.reserve(65536, 100) == 100 + 1229  # ceil(65536 B * 4.8 GHz / 256 GB/s)
    assert p.reserve(65536, 0) == 100 + 2 * 1229  # queued behind the first
    assert p.reserve(10, 10_000) == 10_000 + 1
    assert log == [(100, 1329), (1329, 2558), (10_000, 10_001)]
    assert p.bytes == 131082 and p.busy_ticks == 2459


def test_routes_are_dimension_ordered_and_shortest():
    t = Topology(TRN2)
    assert t.coords(7) == (3, 1, 0) and t.chip_at((3, 1, 0)) == 7
    assert [t.link_name(k) for k in t.route(0, 5)] == ["chip 0 -> chip 4 (y+)", "chip 4 -> chip 5 (x+)"]
    assert [t.link_name(k) for k in t.route(0, 3)] == ["chip 0 -> chip 3 (x-)"]  # the wrap is shorter
    assert [t.link_name(k) for k in t.route(0, 2)] == ["chip 0 -> chip 1 (x+)", "chip 1 -> chip 2 (x+)"]  # tie: +
    assert t.route(5, 5) == ()
    g1 = Topology(load_system("trn3-ultraserver-gen1"))
    assert [g1.link_name(k) for k in g1.route(0, 17)] == ["chip 0 -> rack switch", "rack switch -> chip 17"]
    assert [g1.link_name(k) for k in g1.route(3, 5)] == ["chip 3 -> server switch", "server switch -> chip 5"]
    two = Topology(load_system("trn2.48xlarge", ["topology.efa.size=2"]))
    assert [two.link_name(k) for k in two.route(1, 21)] == ["chip 1 -> efa switch", "efa switch -> chip 21"]


def test_ring_order_snakes_so_every_step_is_one_hop():
    t = Topology(TRN2)
    order = t.ring_order(range(64))
    assert order[:9] == [0, 1, 2, 3, 7, 6, 5, 4, 8]
    chips = [t.chip_of(r) for r in order]
    hops = [len(t.route(a, b)) for a, b in zip(chips, chips[1:] + chips[:1]) if a != b]
    assert len(hops) == 16 and set(hops) == {1}
    us = Topology(load_system("trn2-ultraserver"))
    chips = [us.chip_of(r) for r in us.ring_order(range(256))]
    assert {len(us.route(a, b)) for a, b in zip(chips, chips[1:] + chips[:1]) if a != b} == {1}


def _ticks():
    cfg = TRN2.chip
    hz = cfg.tick_hz
    return {"start": cfg.ps_to_ticks(cfg.core.dma.start_latency), "done": cfg.ps_to_ticks(cfg.core.dma.transfer_latency),
            "hop": cfg.ps_to_ticks(TRN2.dim("x").latency), "link": lambda n: ceil_div(n * hz, TRN2.dim("x").bandwidth)}


def test_one_transfer_exact_timeline():
    """8 MiB from rank 0 (chip 0) to rank 4 (chip 1): 8 chunks of 1 MiB, link-bound (the DMA
    engines and HBM stacks are faster), booked back to back on the x+ link."""
    k = _ticks()
    assert (k["start"], k["done"], k["hop"], k["link"](1 << 20)) == (6240, 96, 960, 19661)
    r = simulate_collective(TRN2, "permute", 8 << 20, group=[0, 4], pairs=[(0, 4)], trace=True)
    chunk = k["link"](1 << 20)
    link = [(a, b) for lane, _, a, b in r.timeline if lane == "link chip 0 -> chip 1 (x+)"]
    assert link == [(6240 + i * chunk, 6240 + (i + 1) * chunk) for i in range(8)]
    end = 6240 + 8 * chunk + k["hop"] + k["done"]
    assert end == 164584
    assert r.end_ticks == (end, end) and r.time_ticks == end
    assert r.link_bytes == {"chip 0 -> chip 1 (x+)": 8 << 20}
    assert r.hbm_bytes == {"chip 0 HBM stack 0": 8 << 20, "chip 1 HBM stack 0": 8 << 20}
    assert r.bound == "link chip 0 -> chip 1 (x+)" and r.chunks == 8 and r.steps == 1 and r.max_hops == 1


def test_two_flows_over_one_link_take_turns():
    """Ranks 0 (chip 0) and 4 (chip 1) both send 1 MiB to chip 2: the chip 1 -> chip 2 link
    carries both, their 128 KiB chunks reaching it at the same ticks: each pair of chunks is
    served as one group that ends together (same-tick arrivals share, never the order simpy
    ran them in), so both flows end on the link's last tick and the pair takes twice as long
    as one flow alone."""
    k = _ticks()
    c = k["link"](128 << 10)
    both = simulate_collective(TRN2, "permute", 1 << 20, group=[0, 4, 8, 9], pairs=[(0, 8), (4, 9)], trace=True)
    alone = simulate_collective(TRN2, "permute", 1 << 20, group=[0, 4, 8, 9], pairs=[(0, 8)])
    shared = [(a, b) for lane, _, a, b in both.timeline if lane == "link chip 1 -> chip 2 (x+)"]
    assert shared == [(6240 + 2 * i * c, 6240 + 2 * (i + 1) * c) for i in range(8)]
    assert alone.end_of(0) == 6240 + 8 * c + 2 * k["hop"] + k["done"] == 27920  # two hops, links in parallel
    assert both.end_of(0) == 6240 + 16 * c + 2 * k["hop"] + k["done"]
    assert both.end_of(4) == 6240 + 16 * c + k["hop"] + k["done"]
    assert both.time_ticks > 1.6 * alone.time_ticks
    assert both.link_bytes["chip 1 -> chip 2 (x+)"] == 2 << 20


def test_a_transfer_spreads_over_the_collectives_rings_at_every_size():
    """With 2 rings a transfer moves on 2 engines of each of the rank's 2 physical cores, whether
    it is one CC packet or many: 64 KiB and 256 KiB both over 4 engines at 23 GB/s (the DMA, not
    the 256 GB/s link, binds), one descriptor per 64 KiB packet. (A permute is point to point:
    p2p_rings; a collective's transfers hold dma_rings.)"""
    cfg = TRN2.chip
    two = load_system(TRN2, ["collectives.p2p_rings=2"])
    desc = cfg.ps_to_ticks(cfg.core.dma.descriptor_overhead)
    for n, packets in ((64 << 10, 1), (256 << 10, 4)):
        r = simulate_collective(two, "permute", n, group=[0, 4], pairs=[(0, 4)])
        chunks = min(8, packets)  # at most 8 chunks, each at least a packet
        per_core = -(-n // 2 // (64 << 10))  # the packets each core's engines describe
        per_chunk = (ceil_div(n // chunks // 4 * cfg.tick_hz, cfg.core.dma.engine_bandwidth)  # over 2 x 2 engines
                     + ceil_div(per_core * desc, 2 * chunks))
        assert r.time_ticks == 6240 + chunks * per_chunk + 960 + 96, n
        assert r.bound == ("DMA rank 0" if packets > 1 else "latency")
    # the packet rule is gone: 4x the bytes is 4x the DMA time, not the same time on 4x the engines
    small = simulate_collective(two, "permute", 1 << 20, group=[0, 4], pairs=[(0, 4)])
    big = simulate_collective(two, "permute", 4 << 20, group=[0, 4], pairs=[(0, 4)])
    assert (big.time_ticks - 7296) == pytest.approx(4 * (small.time_ticks - 7296), rel=0.01)


def test_a_rank_runs_at_most_its_cc_cores_collectives_at_once():
    """LNC=2: 2 CC cores per physical core, 4 per rank (datasheet §9). A fifth concurrent call
    waits until one of the first four is done."""
    rings = load_system(TRN2, ["collectives.dma_rings=2"])  # each CC stream on rings of its own
    one = simulate_collective(rings, "all-gather", 64, group=[0, 4], algorithm="ring")
    reps = simulate_collectives(rings, [CollectiveCall("all-gather", 64, group=[0, 4], algorithm="ring")
                                        for _ in range(5)])
    t = one.time_ticks
    assert [r.end_ticks for r in reps] == [(t, t)] * 4 + [(2 * t, 2 * t)]
    more = simulate_collectives(load_system(rings, ["collectives.cc_cores_per_core=3"]),
                                [CollectiveCall("all-gather", 64, group=[0, 4], algorithm="ring") for _ in range(5)])
    assert [r.end_ticks for r in more] == [(t, t)] * 5


def test_start_times_and_late_ranks():
    """A rank that reaches the call late holds everyone whose data it sends or receives."""
    base = simulate_collective(TRN2, "all-reduce", 1 << 20, group=[0, 1, 2, 3], algorithm="ring")
    late = simulate_collective(TRN2, "all-reduce", 1 << 20, group=[0, 1, 2, 3], algorithm="ring",
                               start=[0, 0, 0, 48_000])
    assert late.start_ticks == (0, 0, 0, 48_000)
    assert min(late.end_ticks) > 48_000 and late.time_ticks >= base.time_ticks + 48_000 - 10
    shifted = simulate_collective(TRN2, "all-reduce", 1 << 20, group=[0, 1, 2, 3], algorithm="ring", start=4800)
    assert shifted.end_ticks == tuple(e + 4800 for e in base.end_ticks) and shifted.time_ticks == base.time_ticks


def test_same_call_same_ticks():
    a = simulate_collective(TRN2, "all-reduce", 3 << 20, ranks=16)
    b = simulate_collective(TRN2, "all-reduce", 3 << 20, ranks=16)
    assert a == b and a.end_ticks == b.end_ticks


def test_vector_reduce_engine_charges_vector_time():
    """With collectives.reduce_engine=vector the adds run on the adding rank's VectorE (its
    tensor_tensor cost) and the DMA copies at full rate; a slow VectorE becomes the bound."""
    dma = simulate_collective(TRN2, "reduce-scatter", 32 << 20, group=[0, 1], algorithm="ring")
    vec = simulate_collective(TRN2, "reduce-scatter", 32 << 20, group=[0, 1], algorithm="ring",
                              overrides=["collectives.reduce_engine=vector"])
    assert sum(vec.dma_bytes.values()) < sum(dma.dma_bytes.values())  # adds no longer cost DMA time
    slow = simulate_collective(TRN2, "reduce-scatter", 32 << 20, group=[0, 1], algorithm="ring",
                               overrides=["collectives.reduce_engine=vector", "core.vector.clock=20MHz"])
    assert slow.bound.startswith("VectorE rank") and slow.time_ticks > 2 * dma.time_ticks


def _with(**costs):
    return load_system(TRN2, [f"collectives.{k}={v}" for k, v in costs.items()])


def test_the_runtime_costs_each_add_their_ticks():
    """launch once per call; step_sync per transfer (a ring all-gather's p-1 steps in turn);
    issue per transfer a rank's CC core starts, one after another (a mesh step of k peers costs
    k issues); each is the tick count of its config figure."""
    hz = TRN2.chip.tick_hz
    us = hz // 10**6  # ticks per microsecond
    base = simulate_collective(_with(step_sync="0ns"), "all-gather", 64, ranks=4, algorithm="ring")
    launched = simulate_collective(_with(launch="10us", step_sync="0ns"), "all-gather", 64, ranks=4, algorithm="ring")
    assert launched.time_ticks == base.time_ticks + 10 * us
    synced = simulate_collective(_with(step_sync="1us"), "all-gather", 64, ranks=4, algorithm="ring")
    assert synced.time_ticks == base.time_ticks + 3 * us  # 3 steps, each waits for its handshake
    mesh = simulate_collective(TRN2, "all-gather", 64, group=[0, 4, 8, 12], algorithm="mesh")
    issued = simulate_collective(_with(issue="1us"), "all-gather", 64, group=[0, 4, 8, 12], algorithm="mesh")
    # each rank starts its 3 writes 1 us apart; at once, they queued a few ticks on its DMA engines
    assert 0 <= mesh.time_ticks + 3 * us - issued.time_ticks <= 16


def test_reduce_sync_delays_each_reduce_step_and_nothing_else():
    """reduce_sync is paid by the transfers that add what they read: a 4-rank ring all-reduce's
    two reduce steps (its first step sends a rank's own chunk), RDH's four halving steps and
    KangaRing's seven on 16 ranks; an all-gather has none."""
    us = TRN2.chip.tick_hz // 10**6
    for coll, algo, ranks, steps in [("all-reduce", "ring", 4, 2), ("reduce-scatter", "ring", 4, 2),
                                     ("all-gather", "ring", 4, 0), ("all-reduce", "two-step-mesh", 16, 2),
                                     ("all-reduce", "rdh", 16, 4), ("all-reduce", "kangaring", 16, 7)]:
        base = simulate_collective(TRN2, coll, 4096, ranks=ranks, algorithm=algo)
        synced = simulate_collective(_with(reduce_sync="1us"), coll, 4096, ranks=ranks, algorithm=algo)
        assert synced.time_ticks == base.time_ticks + steps * us, (coll, algo)
        # the simulated call's alpha-beta estimate charges the same reduce steps
        assert synced.estimate.time_s == pytest.approx(base.estimate.time_s + steps * 1e-6, abs=1e-9), (coll, algo)


def test_the_efa_proxy_thread_serves_its_ranks_one_transfer_at_a_time():
    """A transfer that leaves the instance over EFA waits for its sender's proxy thread; ranks
    sharing one thread (ranks_per_proxy) take turns."""
    us = TRN2.chip.tick_hz // 10**6
    two = load_system(TRN2, ["topology.efa.size=2"])
    pairs = [(0, 64), (1, 65)]
    base = simulate_collective(two, "permute", 64, group=[0, 1, 64, 65], pairs=pairs)
    own = simulate_collective(load_system(two, ["collectives.efa_proxy=20us"]), "permute", 64,
                              group=[0, 1, 64, 65], pairs=pairs)
    shared = simulate_collective(load_system(two, ["collectives.efa_proxy=20us", "collectives.ranks_per_proxy=2"]),
                                 "permute", 64, group=[0, 1, 64, 65], pairs=pairs)
    assert own.time_ticks == base.time_ticks + 20 * us
    # ranks 0 and 1 share one thread: the second transfer starts 20 us after the first (which
    # then no longer queue a few ticks on the link together)
    assert 0 <= base.time_ticks + 40 * us - shared.time_ticks <= 16
    on_chip = simulate_collective(load_system(two, ["collectives.efa_proxy=20us"]), "permute", 64, group=[0, 4],
                                  pairs=[(0, 4)])
    assert on_chip.time_ticks == simulate_collective(two, "permute", 64, group=[0, 4], pairs=[(0, 4)]).time_ticks


def test_the_estimate_carries_the_runtime_costs():
    """The α-β form charges the same costs: launch once, per step the handshake and the busiest
    CC core's issues; with them the simulation still agrees where the form's assumptions hold."""
    sysc = load_system("trn2.48xlarge")
    for n in (8 << 10, 64 << 20):
        r = simulate_collective(sysc, "all-reduce", n, ranks=64, algorithm="ring")
        assert r.time_s == pytest.approx(r.estimate.time_s, rel=0.02), (n, r.time_us, r.estimate.time_us)
    est = r.estimate
    assert est.steps[0].label == "launch" and est.steps[0].alpha_s == pytest.approx(sysc.collectives.launch * 1e-12)


def test_a_point_to_point_transfer_holds_its_own_ring_count():
    """send-recv and permute run one channel (p2p_rings); collectives hold dma_rings: the same
    bytes between the same two ranks take twice as long on 1 ring as on 2."""
    sysc = load_system(TRN2, ["collectives.p2p_rings=1", "collectives.dma_rings=2"])
    p2p = simulate_collective(sysc, "permute", 8 << 20, group=[0, 1], pairs=[(0, 1)])
    both = load_system(TRN2, ["collectives.p2p_rings=2", "collectives.dma_rings=2"])
    faster = simulate_collective(both, "permute", 8 << 20, group=[0, 1], pairs=[(0, 1)])
    fixed = 6240 + 96  # DMA start and completion
    assert p2p.time_ticks - fixed == pytest.approx(2 * (faster.time_ticks - fixed), rel=0.01)
    assert p2p.estimate.time_s == pytest.approx(p2p.time_s, rel=0.02)
