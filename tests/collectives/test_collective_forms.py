"""The network model against its own alpha-beta closed form (``trnsim.collectives`` estimate),
where the form's assumptions hold, and the one case where a textbook form's do not.

The network alone (``trnsim.collectives.runtime.network_only``: the runtime's launch, issue,
handshake and proxy costs zero, a transfer on all of a core's DMA engines), so that the figure
compared is the links', HBM stacks' and DMA engines'. The published nccom-test figures, which
include the runtime's costs, are rows of the validation ledger (``trnsim validate collectives``).

Where the form holds - every step has one flow per link direction and switch port, every rank
its own HBM stack - the simulation (chunk by chunk on FIFO links, HBM stacks and DMA engines)
agrees with the form (a sum over the algorithm's steps of ``alpha + max(link, HBM, DMA)``)
within 2%: ring on all 64 ranks of a trn2.48xlarge (the snake ring crosses one link per chip),
2D ring on one rank per chip of its 4x4 torus, halving-doubling on one rank per chip of a Trn3
Gen1 server (every partner one switch port away).
"""

import pytest

from trnsim.collectives import simulate_collective
from trnsim.collectives.runtime import network_only
from trnsim.config import load_system

CASES = [  # (system, algorithm, group)
    ("trn2.48xlarge", "ring", list(range(64))),
    ("trn2.48xlarge", "per-dim-ring", list(range(0, 64, 4))),
    ("trn3-ultraserver-gen1", "rdh", list(range(0, 64, 4))),
]


def _network(system: str):
    return load_system(system, network_only(system))


@pytest.mark.parametrize("system, algo, group", CASES, ids=[f"{a}-{s}" for s, a, _ in CASES])
@pytest.mark.parametrize("collective", ["all-reduce", "all-gather", "reduce-scatter"])
def test_simulation_within_2_percent_of_the_form_where_it_holds(system, algo, group, collective):
    net = _network(system)
    for n in (8, 64 << 10, 16 << 20):
        r = simulate_collective(net, collective, n, group=group, algorithm=algo)
        assert abs(r.time_s / r.estimate.time_s - 1) <= 0.02, (n, r.time_us, r.estimate.time_us)


def test_textbook_form_misses_shared_links_our_form_counts():
    """rdh on one rank per chip of the 4x4 torus: partners two chips apart on a ring of four route
    through the chip between, so two flows share its link. The form counts the flows a step's
    routes put on each link and agrees; a textbook form (one flow per link) is >15% optimistic."""
    r = simulate_collective(_network("trn2.48xlarge"), "all-reduce", 16 << 20, group=list(range(0, 64, 4)),
                            algorithm="rdh")
    assert r.time_s == pytest.approx(r.estimate.time_s, rel=0.02)
    assert r.estimate.textbook_s < 0.85 * r.time_s


def _astra_sim(collective: str, p: int, nbytes: int, hops: int, latency_s: float, endpoint_s: float,
               bandwidth_gib_s: float) -> float:
    """ASTRA-sim's analytical network backend for one dimension, congestion-unaware
    (astra-network-analytical 599a0473, congestion_unaware/basic-topology/BasicTopology.cpp:
    ``send = hops x latency + size / bandwidth``, bandwidth in GiB/s as its ``bw_GBps_to_Bpns``
    takes "1 GB is 2^30 B"; Ring.cpp one hop to the ring neighbour, Switch.cpp two), driven by
    ASTRA-sim's ring algorithm (astra-sim 518bd513, native_collectives/collective_algorithm/Ring.cc:
    all-reduce 2(p-1) sends of S/p, all-gather and reduce-scatter p-1), each step one send plus
    the system's endpoint delay (notes/collectives.md §4)."""
    steps = 2 * (p - 1) if collective == "all-reduce" else p - 1
    return steps * (hops * latency_s + endpoint_s + (nbytes / p) / (bandwidth_gib_s * 2**30))


@pytest.mark.parametrize("system, sets, group, hops", [
    ("trn2.48xlarge", ["topology.y.size=1"], [0, 4, 8, 12], 1),       # a 1-D ring of 4 chips, a rank each
    ("trn3-ultraserver-gen1", [], list(range(0, 64, 4)), 2),          # a server's 16 chips on its switch
], ids=["ring", "switch"])
@pytest.mark.parametrize("collective", ["all-reduce", "all-gather", "reduce-scatter"])
def test_the_network_alone_agrees_with_astra_sims_analytical_backend(system, sets, group, hops, collective):
    """With ASTRA-sim's link parameters (the system's hop latency and per-direction bandwidth, the
    DMA start and completion as its endpoint delay) and the runtime's costs zero, trnsim's ring on
    a 1-D ring and on a switch takes ASTRA-sim's time within 0.2% from 16 MiB to 1 GiB. HBM is
    made ample and a DMA add as fast as a copy: ASTRA-sim's network backend has no memory and no
    reduction cost (a ring reduce-scatter step's two reads and a write, and Trn2's DMA adding at
    half its copy rate on the engines that also send, make trnsim 6-13% slower there)."""
    base = load_system(system, sets)
    net = load_system(system, sets + network_only(base) + ["chip.hbm.bandwidth=1000TB/s",
                                                           "collectives.dma_accumulate_rate=1"])
    dim = net.topology[0]
    dma = net.chip.core.dma
    for n in (16 << 20, 256 << 20, 1 << 30):
        r = simulate_collective(net, collective, n, group=group, algorithm="ring")
        astra = _astra_sim(collective, len(group), r.nbytes, hops, dim.latency * 1e-12,
                           (dma.start_latency + dma.transfer_latency) * 1e-12, dim.bandwidth / 2**30)
        assert r.time_s == pytest.approx(astra, rel=0.002), (n, r.time_us, astra * 1e6, r.bound)


@pytest.mark.parametrize("system", ["trn2.48xlarge", "trn1.32xlarge"])
def test_a_one_rank_call_is_its_launch_in_the_simulation_and_the_form_alike(system):
    """The event model charged the launch of a one-rank call (no steps) and the form did not, so
    `trnsim collective --ranks 1` printed time 4.99 us beside a-b 0.00."""
    for collective in ("all-reduce", "all-gather", "permute"):
        rep = simulate_collective(system, collective, 1 << 20, ranks=1)
        assert rep.time_us > 0 and rep.estimate.time_us == pytest.approx(rep.time_us, rel=1e-3)
