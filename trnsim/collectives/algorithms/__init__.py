"""Collective algorithms, written against the schedule (and so against no topology).

Each algorithm is one :class:`~.base.Algorithm` record in one module: how it builds a call's
message schedule, its α-β estimate of the same call, its closed form in words and what a group
must be for it to run. :data:`ALGORITHMS` gathers the records; nothing else lists them.

* :mod:`.flat` — ``ring``, ``bidir-ring``, ``rdh``, ``mesh``;
* :mod:`.mesh` — ``two-step-mesh``, ``single-step-mesh``;
* :mod:`.kangaring` — ``kangaring``;
* :mod:`.compose` — ``per-dim-ring``, ``hierarchical``;
* :mod:`.flat_ring` — ``flat-ring`` (across instances, several channels).

Sizes follow nccl-tests (notes/collectives.md §2): ``nbytes`` is the all-reduce buffer, the
all-gather output, the reduce-scatter input, one rank's all-to-all send buffer, the
broadcast/reduce buffer and the message of a send/recv or permute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedule import Schedule
from . import compose, flat, flat_ring, kangaring, mesh
from .base import (COLLECTIVES, KINDS, Algorithm, CollectiveError, Context, busbw_factor, canonical_collective,
                   hierarchy_groups, levels_lanes)

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["COLLECTIVES", "ALGORITHMS", "KINDS", "Algorithm", "Context", "CollectiveError", "BUSBW_FACTORS",
           "busbw_factor", "canonical_collective", "canonical_algorithm", "build", "estimate_steps",
           "hierarchy_groups", "levels_lanes"]

#: every algorithm by name, in the order the CLI lists them
ALGORITHMS: dict[str, Algorithm] = {a.name: a for mod in (flat, mesh, kangaring, compose, flat_ring) for a in mod.ALGORITHMS}

BUSBW_FACTORS = busbw_factor


def canonical_algorithm(name: str, collective: str) -> str:
    key = name.strip().lower()
    for a in ALGORITHMS.values():
        if key == a.name or key in a.aliases:
            if collective not in a.collectives:
                ok = ", ".join(x.name for x in ALGORITHMS.values() if collective in x.collectives)
                raise CollectiveError(f"algorithm '{a.name}' does not run {collective}; expected one of {ok}")
            return a.name
    ok = ", ".join(x.name for x in ALGORITHMS.values() if collective in x.collectives)
    raise CollectiveError(f"unknown algorithm '{name}' for {collective}: expected one of {ok}")


def _checked(ctx: Context, algorithm: str) -> Algorithm:
    a = ALGORITHMS[algorithm]
    why = a.check(ctx)
    if why is not None:
        raise CollectiveError(f"algorithm '{algorithm}' cannot run {ctx.collective} on {ctx.p} ranks of "
                              f"{ctx.system.name}: it needs {why}")
    return a


def build(s: Schedule, ctx: Context, algorithm: str) -> None:
    """Emit the call's transfers into ``s``."""
    a = _checked(ctx, algorithm)
    if ctx.p > 1:
        a.build(s, ctx)


def estimate_steps(r: "Rates", ctx: Context, algorithm: str) -> "list[EstimateStep]":
    """The α-β steps of the call (none on one rank)."""
    a = _checked(ctx, algorithm)
    return a.estimate(r, ctx) if ctx.p > 1 else []
