"""NeuronLink collectives: systems of chips, links as discrete-event resources, and the
collective algorithms that run over them (ASTRA-sim's split: algorithms against one network
interface, topologies as data).

The Python API::

    from trnsim.collectives import simulate_collective, estimate_collective
    rep = simulate_collective("trn2.48xlarge", "all-reduce", 1 << 30, ranks=64)
    rep.time_us, rep.algorithm, rep.reason, rep.busbw, rep.bound, rep.estimate.time_us

See :mod:`trnsim.collectives.api` for concurrent calls, start times and running beside kernels.
"""

from ..compat import renamed
from .algorithms import ALGORITHMS, COLLECTIVES, CollectiveError
from .api import (estimate_collective, sibling_groups, simulate_beside_kernels, simulate_collective, simulate_collectives,
                  simulate_with_siblings)
from .runner import CollectiveCall, CollectiveHandle, CollectiveRunner
from .network import ChipResources, Network
from .report import AlphaBetaEstimate, CollectiveReport, EstimateStep

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "AlphaBetaEstimate",
    "ChipResources",
    "CollectiveCall",
    "CollectiveRunner",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveReport",
    "EstimateStep",
    "Network",
    "estimate_collective",
    "sibling_groups",
    "simulate_with_siblings",
    "simulate_beside_kernels",
    "simulate_collective",
    "simulate_collectives",
]


def __getattr__(name: str) -> object:  # names renamed so one name means one thing (trnsim.compat.RENAMED)
    return renamed(__name__, name)
