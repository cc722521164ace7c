"""Where ranks and chips sit, and which links a message between two chips crosses.

A system's chips have mixed-radix coordinates over its topology dimensions, the first fastest
(ASTRA-sim's ``MultiDimTopology``, notes/collectives.md §4.1). Ranks are logical NeuronCores:
rank ``r`` is logical core ``r % ranks_per_chip`` of chip ``r // ranks_per_chip``, as on Neuron.
A rank's coordinates are ``(local core, chip coordinates...)``: the first *level* of every group
is the chip itself, whose ranks talk through HBM, not links.

Routing is dimension-ordered, highest dimension first:

* ``ring`` — hop by hop along the shorter way round (ties go the positive way), one link per
  direction between neighbours (a torus is a ring in every dimension);
* ``full`` — one direct link to the chip with the destination's coordinate;
* ``switch`` — up the sender's port into the switch, down the receiver's port. A switch tier
  reaches every chip that shares its coordinates above the tier, so it is crossed once and fixes
  every lower coordinate (EFA reaches every chip; Trn3's rack tier every chip of the UltraServer).

A link is a key ``(dim, chip, way)``: ``way`` 0/1 is +/- on a ring and up/down at a switch port;
``2 + c`` on a ``full`` dimension is the link to coordinate ``c``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from ..config import SystemConfig

__all__ = ["Topology", "LinkKey", "GroupShape"]

LinkKey = tuple[int, int, int]


@dataclass(frozen=True)
class GroupShape:
    """A group of ranks that is a grid: per level (the chip's cores, then each topology
    dimension) the sorted coordinates it spans. ``levels[0]`` is the chip level ("chip")."""

    names: tuple[str, ...]
    values: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(v) for v in self.values)

    def spanned(self) -> list[int]:
        """Indices of the levels with more than one coordinate."""
        return [i for i, v in enumerate(self.values) if len(v) > 1]


class Topology:
    """Coordinates and routes of one system (routes are cached: algorithms ask for the same
    pairs again and again)."""

    def __init__(self, system: SystemConfig):
        self.system = system
        self.dims = system.topology
        self.sizes = tuple(d.size for d in self.dims)
        self.chips = system.chips
        self.rpc = system.ranks_per_chip
        self.ranks = system.ranks
        self._strides = tuple(math.prod(self.sizes[:i]) for i in range(len(self.sizes)))
        self.route = lru_cache(maxsize=1 << 16)(self._route)  # type: ignore[method-assign]
        # pure functions asked again and again by the algorithms' lanes and their estimates
        self.coords = lru_cache(maxsize=1 << 16)(self._coords)  # type: ignore[method-assign]
        self._orders: dict[tuple[int, ...], list[int]] = {}
        #: (group, levels) -> the group's lines along those levels (algorithms.base.levels_lanes)
        self.lanes_memo: dict[tuple[Any, ...], list[list[int]]] = {}
        self._link_names: dict[LinkKey, str] = {}

    # ---- coordinates ---------------------------------------------------------------------------
    def _coords(self, chip: int) -> tuple[int, ...]:
        return tuple((chip // s) % n for s, n in zip(self._strides, self.sizes))

    def chip_at(self, coords: Sequence[int]) -> int:
        return sum(c * s for c, s in zip(coords, self._strides))

    def chip_of(self, rank: int) -> int:
        return rank // self.rpc

    def rank_coords(self, rank: int) -> tuple[int, ...]:
        return (rank % self.rpc, *self.coords(rank // self.rpc))

    @property
    def level_names(self) -> tuple[str, ...]:
        return ("chip", *(d.name for d in self.dims))

    def level_inter_instance(self, level: int) -> bool:
        return level > 0 and self.dims[level - 1].inter_instance

    # ---- instances and placement -----------------------------------------------------------------
    @property
    def instances(self) -> int:
        """Instances of the system (the product of its inter-instance dimensions)."""
        return self.chips // self.system.instance_chips

    @property
    def instance_ranks(self) -> int:
        return self.system.instance_chips * self.rpc

    def instance_of(self, rank: int) -> int:
        """The instance holding ``rank``: ranks are numbered instance by instance (the
        inter-instance dimensions come last, so they are a chip id's slowest digits)."""
        return rank // self.instance_ranks

    def place(self, ranks: int, instances: int) -> tuple[int, ...]:
        """A job of ``ranks`` on ``instances`` instances, numbered as Neuron numbers them: the
        ranks divided equally over the instances (nccom-test's ``-r`` over ``-N`` nodes), each
        instance's share its first logical cores, instance by instance."""
        per = ranks // instances
        return tuple(i * self.instance_ranks + r for i in range(instances) for r in range(per))

    def default_instances(self, ranks: int) -> int:
        """Every instance of the system when the ranks divide over them, else the fewest that
        hold them (the system is the job, as nccom-test runs on every host it is given)."""
        k = self.instances
        if ranks >= k and ranks % k == 0:
            return k
        need = -(-ranks // self.instance_ranks)
        while need < k and ranks % need:
            need += 1
        return need

    def describe_placement(self, group: Sequence[int]) -> str:
        """Where a group sits: its instances, the ranks on each, and the chips they use."""
        inst: dict[int, list[int]] = {}
        for r in group:
            inst.setdefault(self.instance_of(r), []).append(r)
        chips = sorted({self.chip_of(r) for r in group})
        per = {len(v) for v in inst.values()}
        each = f"{per.pop()} ranks each" if len(per) == 1 else "uneven"
        ic = self.system.instance_chips
        local = sorted({c % ic for c in chips})
        span = f"chips {local[0]}-{local[-1]}" if local == list(range(local[0], local[-1] + 1)) and len(local) > 1 \
            else f"chip {local[0]}" if len(local) == 1 else f"{len(local)} chips"
        if self.instances == 1:
            return f"{len(group)} ranks on {len(chips)} chip{'s' if len(chips) > 1 else ''}"
        return (f"{len(group)} ranks on {len(inst)} of {self.instances} instances ({each}, on {span} of each: "
                f"{len(chips)} chips)")

    # ---- routes --------------------------------------------------------------------------------
    def _route(self, src: int, dst: int) -> tuple[LinkKey, ...]:
        """The links from chip ``src`` to chip ``dst``, in order (empty on the same chip)."""
        if src == dst:
            return ()
        cur = list(self.coords(src))
        want = self.coords(dst)
        links: list[LinkKey] = []
        for d in reversed(range(len(self.dims))):
            if cur[d] == want[d]:
                continue
            dim = self.dims[d]
            if dim.kind == "switch":
                links.append((d, self.chip_at(cur), 0))
                cur[: d + 1] = want[: d + 1]
                links.append((d, self.chip_at(cur), 1))
            elif dim.kind == "full":
                links.append((d, self.chip_at(cur), 2 + want[d]))
                cur[d] = want[d]
            else:
                n = dim.size
                fwd = (want[d] - cur[d]) % n
                step, way = (1, 0) if fwd <= n - fwd else (-1, 1)
                while cur[d] != want[d]:
                    links.append((d, self.chip_at(cur), way))
                    cur[d] = (cur[d] + step) % n
        return tuple(links)

    def route_latency(self, links: Sequence[LinkKey]) -> int:
        """Sum of the hop latencies along ``links``, ps."""
        return sum(self.dims[d].latency for d, _, _ in links)

    def link_bandwidth(self, key: LinkKey) -> int:
        return self.dims[key[0]].bandwidth

    def link_name(self, key: LinkKey) -> str:
        name = self._link_names.get(key)
        if name is None:
            name = self._link_names[key] = self._link_name(key)
        return name

    def _link_name(self, key: LinkKey) -> str:
        d, chip, way = key
        dim = self.dims[d]
        if dim.kind == "switch":
            return f"chip {chip} -> {dim.name} switch" if way == 0 else f"{dim.name} switch -> chip {chip}"
        c = list(self.coords(chip))
        if dim.kind == "full":
            c[d] = way - 2
            return f"chip {chip} -> chip {self.chip_at(c)} ({dim.name})"
        c[d] = (c[d] + (1 if way == 0 else -1)) % dim.size
        return f"chip {chip} -> chip {self.chip_at(c)} ({dim.name}{'+' if way == 0 else '-'})"

    # ---- groups --------------------------------------------------------------------------------
    def shape(self, group: Sequence[int]) -> GroupShape | None:
        """The group as a grid over the levels, or None when it is not a full cartesian product
        of per-level coordinates (then only flat algorithms can run on it)."""
        coords = [self.rank_coords(r) for r in group]
        values = tuple(tuple(sorted({c[i] for c in coords})) for i in range(len(self.dims) + 1))
        if math.prod(len(v) for v in values) != len(group):
            return None
        return GroupShape(self.level_names, values)

    def ring_order(self, group: Sequence[int]) -> list[int]:
        """The group in snake (boustrophedon) order over its coordinates, slowest level first,
        so consecutive ranks are neighbours and the last one is next to the first on a torus:
        a ring over it crosses one link per step where it leaves a chip."""
        key = tuple(group)
        got = self._orders.get(key)
        if got is None:
            if len(self._orders) > 4096:
                self._orders.clear()
            got = self._orders[key] = self._ring_order(key)
        return list(got)

    def _ring_order(self, group: Sequence[int]) -> list[int]:
        coords = {r: self.rank_coords(r) for r in group}
        levels = len(self.dims) + 1
        values = [sorted({c[i] for c in coords.values()}) for i in range(levels)]
        index = [{v: k for k, v in enumerate(vs)} for vs in values]

        def key(r: int) -> tuple[int, ...]:
            c = coords[r]
            higher = 0  # the position so far in the snake over the slower levels
            for i in reversed(range(levels)):
                k = index[i][c[i]]
                n = len(values[i])
                # a level runs backwards when the slower levels are at an odd position
                higher = higher * n + (n - 1 - k if higher % 2 else k)
            return (higher,)

        return sorted(group, key=key)

    def pairs(self, group: Sequence[int]) -> list[tuple[int, int]] | None:
        """The group's ranks as pairs on one chip, or None unless every chip it uses holds an
        even number of them (KangaRing's primaries and their partners)."""
        by_chip: dict[int, list[int]] = {}
        for r in group:
            by_chip.setdefault(self.chip_of(r), []).append(r)
        out = []
        for ranks in by_chip.values():
            ranks.sort()
            if len(ranks) % 2:
                return None
            out.extend((ranks[i], ranks[i + 1]) for i in range(0, len(ranks), 2))
        return out

    def tiers(self, shape: GroupShape) -> list[list[int]]:
        """The levels a group spans, grouped as intra-instance (the chip's cores and the
        dimensions inside an instance) and inter-instance: the phases of Neuron's hierarchical
        algorithms (an intra-node part, then the inter-node part); empty tiers left out."""
        groups: list[list[int]] = [[], []]
        for lv in shape.spanned():
            groups[1 if self.level_inter_instance(lv) else 0].append(lv)
        return [g for g in groups if g]
