"""The composed algorithms: a collective as phases over the levels of a group (the chip's
cores, then each topology dimension), each phase a flat algorithm on the lines of the grid.

``per-dim-ring``  ASTRA-sim's multi-dimensional composition, one ring per level: all-reduce =
                  RS(level 0..k-2), AR(level k-1), AG(k-2..0); a bidirectional ring on ring
                  dimensions (notes/collectives.md §4.3).
``hierarchical``  Neuron's composition across tiers: intra-instance (the chip's cores and the
                  torus together), then inter-instance; each tier runs the algorithm the size
                  rule picks for its own share (§1.3), any registered one (two-step mesh,
                  kangaring, single-step mesh across instances...).

A phase of a flat algorithm runs every line of the grid as lanes of one schedule; any other
algorithm runs each line as a call of its own on that line's ranks (the lines share no rank, so
they still run side by side).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from ..schedule import Schedule, pieces
from .base import Algorithm, Context, hierarchy_groups, levels_lanes
from .flat import phase, phase_estimate

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS"]


def _sizes(ctx: Context, groups: Sequence[Sequence[int]]) -> list[int]:
    assert ctx.shape is not None
    return [math.prod(len(ctx.shape.values[i]) for i in g) for g in groups]


def _compose(s: Schedule, ctx: Context, groups: Sequence[Sequence[int]], algos: Sequence[str]) -> None:
    """Run the collective as phases over level ``groups`` (ASTRA-sim / Neuron hierarchical):
    reduce-scatter up the groups with shrinking data, all-reduce on the last, all-gather back
    down; all-gather alone goes from the last group down, reduce-scatter from the first up."""
    sizes = _sizes(ctx, groups)
    c = ctx.collective
    isz = ctx.itemsize
    lanes = [levels_lanes(ctx, g) for g in groups]

    def ph(kind: str, k: int, total: int) -> None:
        algo = algos[k]
        s.phase = f"{kind} {'+'.join(ctx.topo.level_names[i] for i in groups[k])} ({algo})"
        if algo in FLAT:
            order_of = sorted if algo == "rdh" else list
            phase(kind, algo, s, channel_lanes(ctx, groups, k, algo, [(order_of(v), total) for v in lanes[k]]), isz)
            return
        from . import ALGORITHMS

        first = s.steps
        for v in lanes[k]:  # lines share no rank: each as a call of its own, side by side
            s.steps = first
            ALGORITHMS[algo].build(s, _line(ctx, kind, v, total))

    n = ctx.nbytes
    if c == "all-reduce":
        data = n
        for k in range(len(groups) - 1):
            ph("rs", k, data)
            data = data // sizes[k] // isz * isz
        ph("ar", len(groups) - 1, data)
        for k in reversed(range(len(groups) - 1)):
            data *= sizes[k]
            ph("ag", k, data)
    elif c == "reduce-scatter":
        data = n
        for k in range(len(groups)):
            ph("rs", k, data)
            data = data // sizes[k] // isz * isz
    else:
        data = n // math.prod(sizes) // isz * isz
        for k in reversed(range(len(groups))):
            data *= sizes[k]
            ph("ag", k, data)
    s.phase = ""


def channels_of(ctx: Context, groups: Sequence[Sequence[int]], k: int, algo: str, lane_ranks: int,
                total: int) -> int:
    """The channels a hierarchical call's tier ``k`` runs (``collectives.flat_ring_channels``):
    a communicator spanning instances has one channel per EFA device (Trn1's runtime: 8-channel
    support, network devices associated with channels, "global comm has less channels than this
    replica group ... not enough EFA devices" [SDK release-notes/runtime/aws-neuronx-runtime-lib
    2.9.64, 2.10.15, 2.16.8]), and its intra-instance rings run one cycle per channel, each on
    its share; a ring channel moves a whole element per rank and step at least, so a call uses
    as many channels as it has elements per rank of the ring (at most the system's). One channel
    where the call stays in an instance, on the inter-instance tier, and for non-ring phases."""
    ch = ctx.system.collectives.flat_ring_channels
    topo = ctx.topo
    if ch <= 1 or algo not in ("ring", "bidir-ring") or len(groups) < 2:
        return 1
    if any(topo.level_inter_instance(lv) for lv in groups[k]) or \
            not any(topo.level_inter_instance(lv) for g in groups for lv in g):
        return 1
    return max(1, min(ch, total // (lane_ranks * ctx.itemsize)))


def channel_lanes(ctx: Context, groups: Sequence[Sequence[int]], k: int, algo: str,
                  lanes: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """Each lane of tier ``k`` as :func:`channels_of` cycles: channel c rotated by c/C of the
    lane (its chain starts at a different rank), on its share of whole elements per rank."""
    out = []
    for order, total in lanes:
        c = channels_of(ctx, groups, k, algo, len(order), total)
        if c == 1:
            out.append((order, total))
            continue
        for i, nb in enumerate(pieces(total, c, ctx.itemsize * len(order))):
            shift = i * len(order) // c
            out.append((order[shift:] + order[:shift], nb))
    return out


def _compose_estimate(r: "Rates", ctx: Context, groups: Sequence[Sequence[int]],
                      algos: Sequence[str]) -> "list[EstimateStep]":
    sizes = _sizes(ctx, groups)
    lanes = [levels_lanes(ctx, g) for g in groups]
    names = ["+".join(ctx.topo.level_names[i] for i in g) for g in groups]
    out: list[EstimateStep] = []
    n = float(ctx.nbytes)
    c = ctx.collective

    def ph(kind: str, k: int, data: float) -> "list[EstimateStep]":
        if algos[k] in FLAT:
            split = channel_lanes(ctx, groups, k, algos[k], [(v, int(data)) for v in lanes[k]])
            return phase_estimate(r, kind, algos[k], [(v, float(nb)) for v, nb in split], names[k])
        from . import ALGORITHMS

        # the lines run side by side on links of their own: the first stands for all
        return ALGORITHMS[algos[k]].estimate(r, _line(ctx, kind, lanes[k][0], int(data)))

    if c == "all-reduce":
        data = n
        for k in range(len(groups) - 1):
            out += ph("rs", k, data)
            data /= sizes[k]
        out += ph("ar", len(groups) - 1, data)
        for k in reversed(range(len(groups) - 1)):
            data *= sizes[k]
            out += ph("ag", k, data)
    elif c == "reduce-scatter":
        data = n
        for k in range(len(groups)):
            out += ph("rs", k, data)
            data /= sizes[k]
    else:
        data = n / math.prod(sizes)
        for k in reversed(range(len(groups))):
            data *= sizes[k]
            out += ph("ag", k, data)
    return out


#: the algorithms :func:`~.flat.phase` runs on lanes
FLAT = ("ring", "bidir-ring", "rdh", "mesh")
_COLLECTIVE = {"rs": "reduce-scatter", "ag": "all-gather", "ar": "all-reduce"}


def _line(ctx: Context, kind: str, ranks: Sequence[int], total: int) -> Context:
    """One line of a phase as a call of its own: ``kind`` of ``total`` bytes on ``ranks``."""
    group = tuple(sorted(ranks))
    return Context(ctx.system, ctx.topo, _COLLECTIVE[kind], group, total, ctx.itemsize, group[0], (),
                   tuple(ctx.topo.ring_order(group)), ctx.topo.shape(group))


def _per_dim_plan(ctx: Context) -> tuple[list[list[int]], list[str]]:
    """One group per spanned level; a bidirectional ring on ring dimensions of more than 2."""
    assert ctx.shape is not None
    spanned = ctx.shape.spanned()
    algos = []
    for lv in spanned:
        dim = ctx.topo.dims[lv - 1] if lv > 0 else None
        both_ways = dim is not None and dim.kind == "ring" and len(ctx.shape.values[lv]) > 2
        algos.append("bidir-ring" if both_ways else "ring")
    return [[lv] for lv in spanned], algos


def hierarchical_plan(ctx: Context) -> tuple[list[list[int]], list[str]]:
    """The tiers, each with the algorithm the size rule picks for the share it moves."""
    from ..select import flat_choice

    groups = hierarchy_groups(ctx)
    algos = []
    c = ctx.collective
    data = ctx.nbytes
    sizes = _sizes(ctx, groups)
    if c == "all-gather":
        data = data // sizes[-1]  # the inter-instance gather moves the smaller share, first
    for k, g in enumerate(groups):
        line = levels_lanes(ctx, g)[0]
        kind = c if c != "all-reduce" or k == len(groups) - 1 else "reduce-scatter"
        algo = flat_choice(ctx.system, kind, data, line, ctx.topo, ctx.streams)[0]
        if algo == "single-step-mesh" and kind != "all-reduce":
            algo = "mesh"
        algos.append(algo)
        if c != "all-gather":
            data //= sizes[k]
    return groups, algos


def _built(plan: Callable[[Context], tuple[list[list[int]], list[str]]]) -> Callable[[Schedule, Context], None]:
    return lambda s, ctx: _compose(s, ctx, *plan(ctx))


def _estimated(plan: Callable[[Context], tuple[list[list[int]], list[str]]]
               ) -> "Callable[[Rates, Context], list[EstimateStep]]":
    return lambda r, ctx: _compose_estimate(r, ctx, *plan(ctx))


def _check_grid(what: str) -> Callable[[Context], str | None]:
    def check(ctx: Context) -> str | None:
        if ctx.shape is None:
            return "a group that is a grid over the topology (every combination of its chips' coordinates and cores)"
        spanned = ctx.shape.spanned() if what == "levels" else hierarchy_groups(ctx)
        if len(spanned) < 2:
            names = ", ".join(ctx.topo.level_names[i] for i in ctx.shape.spanned()) or "nothing"
            if what == "levels":
                return f"a group spanning at least 2 levels (chip cores, {', '.join(ctx.topo.level_names[1:])}); this one spans {names}"
            return f"a group spanning instances and ranks inside them; this one spans {names}"
        return None
    return check


_THREE = ("all-reduce", "all-gather", "reduce-scatter")

ALGORITHMS = (
    Algorithm("per-dim-ring", _THREE, ("ring2d", "ring3d", "2d-ring", "3d-ring", "torus"), _built(_per_dim_plan),
              _estimated(_per_dim_plan), "a ring per level: RS up the levels on n, n/p0, ..., AR on the last, AG back down",
              _check_grid("levels")),
    Algorithm("hierarchical", _THREE, ("hier",), _built(hierarchical_plan), _estimated(hierarchical_plan),
              "an intra-instance phase, then the inter-instance one, each by the size rule", _check_grid("tiers")),
)
