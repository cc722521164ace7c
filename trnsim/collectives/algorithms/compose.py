"""The composed algorithms: a collective as phases over the levels of a group (the chip's
cores, then each topology dimension), each phase a flat algorithm on the lines of the grid.

``per-dim-ring``  ASTRA-sim's multi-dimensional composition, one ring per level: all-reduce =
                  RS(level 0..k-2), AR(level k-1), AG(k-2..0); a bidirectional ring on ring
                  dimensions (notes/collectives.md §4.3).
``hierarchical``  Neuron's composition across tiers: intra-chip, intra-instance, inter-instance;
                  each tier runs the algorithm the size rule picks for its own share (§1.3).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from ..schedule import Schedule
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
        order_of = sorted if algos[k] == "rdh" else list
        s.phase = f"{kind} {'+'.join(ctx.topo.level_names[i] for i in groups[k])} ({algos[k]})"
        phase(kind, algos[k], s, [(order_of(v), total) for v in lanes[k]], isz)

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


def _compose_estimate(r: "Rates", ctx: Context, groups: Sequence[Sequence[int]],
                      algos: Sequence[str]) -> "list[EstimateStep]":
    sizes = _sizes(ctx, groups)
    lanes = [levels_lanes(ctx, g) for g in groups]
    names = ["+".join(ctx.topo.level_names[i] for i in g) for g in groups]
    out: list[EstimateStep] = []
    n = float(ctx.nbytes)
    c = ctx.collective

    def ph(kind: str, k: int, data: float) -> "list[EstimateStep]":
        return phase_estimate(r, kind, algos[k], [(v, data) for v in lanes[k]], names[k])

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


def _hierarchical_plan(ctx: Context) -> tuple[list[list[int]], list[str]]:
    """The tiers, each with the algorithm the size rule picks for the share it moves."""
    from ..select import flat_choice

    groups = hierarchy_groups(ctx)
    algos = []
    data = ctx.nbytes
    for g, size in zip(groups, _sizes(ctx, groups)):
        algos.append(flat_choice(ctx.system, data, size, ctx.topo, g)[0])
        if ctx.collective != "all-gather":
            data //= size
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
            return f"a group spanning at least 2 of intra-chip, intra-instance, inter-instance; this one spans {names}"
        return None
    return check


_THREE = ("all-reduce", "all-gather", "reduce-scatter")

ALGORITHMS = (
    Algorithm("per-dim-ring", _THREE, ("ring2d", "ring3d", "2d-ring", "3d-ring", "torus"), _built(_per_dim_plan),
              _estimated(_per_dim_plan), "a ring per level: RS up the levels on n, n/p0, ..., AR on the last, AG back down",
              _check_grid("levels")),
    Algorithm("hierarchical", _THREE, ("hier",), _built(_hierarchical_plan), _estimated(_hierarchical_plan),
              "intra-chip, intra-instance, inter-instance phases, each by the size rule", _check_grid("tiers")),
)
