"""``flat-ring``: Neuron's Flat Ring across instances, as the Trn1 runtime runs it for large
messages (SDK ``neuron-runtime/explore/internode-collective-comm.rst``, "Flat Ring Algorithm"):
all the group's ranks in one directed cycle, each instance's ranks an open chain joined to the
next instance's over EFA, and several such cycles ("channels") side by side, since "each EFA
interface is connected to a different Trainium Chip": channel c rotates every instance's chain
so that it leaves the instance from a different chip. Each channel carries n/C; every channel is
a ring all-reduce (reduce-scatter then all-gather, 2(p-1) steps), all-gather or reduce-scatter
over the whole group. ``collectives.flat_ring_channels`` sets C (at most the group's chips per
instance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedule import Schedule, pieces
from .base import Algorithm, Context
from .flat import ring_estimate, phase

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS", "channel_orders"]


def channel_orders(ctx: Context) -> list[list[int]]:
    """The cycle of each channel: the group's ring order cut into its instances' chains, each
    chain rotated by c/C of its length for channel c (its last rank, the one that writes across
    EFA, on a different chip per channel)."""
    topo = ctx.topo
    order = list(ctx.order or topo.ring_order(ctx.group))
    chains: list[list[int]] = []
    for r in order:
        if chains and topo.instance_of(chains[-1][-1]) == topo.instance_of(r):
            chains[-1].append(r)
        else:
            chains.append([r])
    per_inst = min(len({topo.chip_of(r) for r in ch}) for ch in chains)
    c = max(1, min(ctx.system.collectives.flat_ring_channels, per_inst))
    out = []
    for k in range(c):
        cyc: list[int] = []
        for ch in chains:
            shift = k * len(ch) // c
            cyc.extend(ch[shift:] + ch[:shift])
        out.append(cyc)
    return out


def _lanes(ctx: Context) -> list[tuple[list[int], int]]:
    orders = channel_orders(ctx)
    # channel pieces of whole elements, each a whole number of pieces per rank where the
    # collective needs it (all-gather and reduce-scatter move n/p per rank and step)
    grain = ctx.itemsize * (ctx.p if ctx.collective != "all-reduce" else 1)
    return [(o, nb) for o, nb in zip(orders, pieces(ctx.nbytes, len(orders), grain)) if nb]


_KIND = {"all-reduce": "ar", "all-gather": "ag", "reduce-scatter": "rs"}


def _build(s: Schedule, ctx: Context) -> None:
    phase(_KIND[ctx.collective], "ring", s, _lanes(ctx), ctx.itemsize)


def _estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    return ring_estimate(r, _KIND[ctx.collective], _lanes(ctx), False, "flat ring")


def _check(ctx: Context) -> str | None:
    topo = ctx.topo
    if len({topo.instance_of(r) for r in ctx.group}) < 2:
        return "a group spanning instances (one cycle through every instance, joined over EFA)"
    return None


ALGORITHMS = (
    Algorithm("flat-ring", ("all-reduce", "all-gather", "reduce-scatter"), ("flatring",), _build, _estimate,
              "C channels, each a ring over all p ranks on n/C (instances' chains joined over EFA): "
              "2(p-1) steps of n/(pC) for all-reduce", _check),
)
