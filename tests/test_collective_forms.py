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
