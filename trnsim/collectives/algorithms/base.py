"""What every collective algorithm shares: the collectives' names, a call's :class:`Context`,
the :class:`Algorithm` record the registry holds, and the lane helpers.

An algorithm is one record: the collectives it runs, its aliases, how it builds a call's message
schedule, its α-β estimate of the same call and the closed form in words, and what a group must
be for it to run. Nothing else lists algorithms by name (STYLE 15).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ...config import SystemConfig
from ..schedule import Schedule, pieces
from ..topology import GroupShape, Topology

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["COLLECTIVES", "KINDS", "CollectiveError", "Context", "Algorithm", "Lane", "busbw_factor",
           "canonical_collective", "bidir", "halves", "levels_lanes", "group_pairs", "hierarchy_groups",
           "check_pow2", "no_check"]


class CollectiveError(ValueError):
    """A collective call that cannot run as asked (unknown name, bad group, an algorithm the
    topology or group cannot run). The message is one line."""


#: canonical name -> accepted aliases (nccom-test's and nccl-tests' spellings)
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "all-reduce": ("allr", "all_reduce", "allreduce"),
    "all-gather": ("allg", "all_gather", "allgather"),
    "reduce-scatter": ("redsct", "reduce_scatter", "reducescatter"),
    "all-to-all": ("alltoall", "all_to_all", "a2a"),
    "broadcast": ("bcast",),
    "reduce": (),
    "send-recv": ("sendrecv", "send_recv", "p2p"),
    "permute": (),
}

#: the collectives built from reduce-scatter ("rs") and all-gather ("ag") phases
KINDS = {"all-reduce": "ar", "reduce-scatter": "rs", "all-gather": "ag"}


def busbw_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw factor (notes/collectives.md §2): AR 2(n-1)/n; AG, RS, A2A (n-1)/n;
    others 1."""
    if p <= 1:
        return 0.0 if collective in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") else 1.0
    if collective == "all-reduce":
        return 2 * (p - 1) / p
    if collective in ("all-gather", "reduce-scatter", "all-to-all"):
        return (p - 1) / p
    return 1.0


def canonical_collective(name: str) -> str:
    key = name.strip().lower()
    for canon, aliases in COLLECTIVES.items():
        if key == canon or key in aliases:
            return canon
    raise CollectiveError(f"unknown collective '{name}': expected one of {', '.join(COLLECTIVES)}")


@dataclass
class Context:
    """What an algorithm knows about the call: the group (as given and in ring order), its grid
    shape, the element size, a root and permute pairs."""

    system: SystemConfig
    topo: Topology
    collective: str
    group: tuple[int, ...]
    nbytes: int
    itemsize: int
    root: int
    pairs: tuple[tuple[int, int], ...] = ()
    order: tuple[int, ...] = ()
    shape: GroupShape | None = None
    notes: list[str] = field(default_factory=list)
    #: an uneven all-to-all: bytes from the group's i-th rank (in ``group`` order) to its j-th
    counts: tuple[tuple[int, ...], ...] = ()
    #: CC streams the program runs collectives on at once (nccom-test --streams-json's entries)
    streams: int = 1

    def sends(self, src: int, dst: int, even: int) -> int:
        """Bytes ``src`` sends ``dst`` in an all-to-all: its count, or the even piece."""
        if not self.counts:
            return even
        return self.counts[self.group.index(src)][self.group.index(dst)]

    @property
    def p(self) -> int:
        return len(self.group)


Lane = tuple[Sequence[int], int]


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm: ``build`` emits a call's transfers into a schedule,
    ``estimate`` gives the α-β steps of the same call (from :class:`~trnsim.collectives.analytic.Rates`),
    ``formula`` says the closed form in words, ``check`` returns what the call lacks (None: it
    can run)."""

    name: str
    collectives: tuple[str, ...]
    aliases: tuple[str, ...]
    build: Callable[[Schedule, Context], None]
    estimate: Callable[["Rates", Context], "list[EstimateStep]"]
    formula: str
    check: Callable[[Context], str | None]


def no_check(ctx: Context) -> str | None:
    return None


def check_pow2(ctx: Context) -> str | None:
    p = ctx.p
    if p & (p - 1):
        return f"a power-of-two group; {p} ranks is not"
    return None


def halves(nbytes: int, itemsize: int) -> tuple[int, int]:
    a, b = pieces(nbytes, 2, itemsize)
    return a, b


def bidir(lanes: Sequence[Lane], itemsize: int) -> list[Lane]:
    """Each lane as two: the order and its reverse, half the bytes each (a bidirectional ring)."""
    out: list[Lane] = []
    for order, total in lanes:
        a, b = halves(total, itemsize)
        out.append((tuple(order), a))
        out.append((tuple(reversed(order)), b))
    return out


def group_pairs(ctx: Context) -> list[tuple[int, int]] | None:
    """Pairs of group ranks on one chip (None unless the group holds an even number on every
    chip it uses): KangaRing's primaries and their partners."""
    return ctx.topo.pairs(ctx.group)


def levels_lanes(ctx: Context, levels: Sequence[int]) -> list[list[int]]:
    """The group's ranks split into lines along ``levels``: ranks that share every other
    level's coordinate, each in ring order."""
    key = (tuple(ctx.group), tuple(levels))
    memo = ctx.topo.lanes_memo  # the same lines are asked for by each phase and the estimate
    got = memo.get(key)
    if got is None:
        if len(memo) > 1024:
            memo.clear()
        got = memo[key] = _levels_lanes(ctx, levels)
    return [list(v) for v in got]


def _levels_lanes(ctx: Context, levels: Sequence[int]) -> list[list[int]]:
    lines: dict[tuple[int, ...], list[int]] = {}
    others = [i for i in range(len(ctx.topo.level_names)) if i not in levels]
    for r in ctx.group:
        c = ctx.topo.rank_coords(r)
        lines.setdefault(tuple(c[i] for i in others), []).append(r)
    return [ctx.topo.ring_order(v) for _, v in sorted(lines.items())]


def hierarchy_groups(ctx: Context) -> list[list[int]]:
    """The spanned levels grouped as intra-instance and inter-instance (Topology.tiers)."""
    assert ctx.shape is not None
    return ctx.topo.tiers(ctx.shape)
