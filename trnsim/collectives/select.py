"""Which algorithm a collective runs when none is forced: Neuron's size rule, as NCCL's tuner
picks by size and topology.

For all-reduce, all-gather and reduce-scatter (notes/collectives.md §1.3, S21):

* a group spanning instances runs **hierarchical** (intra-chip, intra-instance, inter-instance),
  each level by the rule below on its own share, as Neuron composes across nodes;
* otherwise **mesh** below ``collectives.mesh_below`` (1 MB), **rdh** below
  ``collectives.rdh_below`` (56 MB) for power-of-two groups, and above that **kangaring** when
  the group holds pairs of ranks on its chips (Neuron: TP groups holding a chip's ranks), else a
  ring: **bidir-ring** over torus links (Neuron runs cycles on mutually exclusive wires),
  **ring** elsewhere.

All-to-all runs **mesh** on switched topologies or below ``mesh_below``, else the pairwise
**ring**; broadcast and reduce a binomial tree (**rdh**) below ``rdh_below``, else a pipelined
**ring** chain; send/recv and permute are **mesh** (direct writes). The thresholds are the
system config's, so a sweep can move them.
"""

from __future__ import annotations

from typing import Sequence

from ..config import SystemConfig
from .topology import Topology

__all__ = ["choose", "flat_choice"]


def _mb(n: int) -> str:
    """A size as written in configs: the largest exact binary or decimal unit (56MB, 2MiB, 8B)."""
    for unit, scale in (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("KB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _ring_dims(topo: Topology, levels: Sequence[int]) -> bool:
    return any(lv > 0 and topo.dims[lv - 1].kind == "ring" for lv in levels)


def flat_choice(system: SystemConfig, nbytes: int, p: int, topo: Topology, levels: Sequence[int],
                pairs: bool = False) -> tuple[str, str]:
    """The size rule on ``p`` ranks spanning ``levels``: (algorithm, why)."""
    c = system.collectives
    if nbytes < c.mesh_below:
        return "mesh", f"{_mb(nbytes)} < mesh_below {_mb(c.mesh_below)}"
    pow2 = p & (p - 1) == 0
    if nbytes < c.rdh_below and pow2:
        return "rdh", f"{_mb(nbytes)} < rdh_below {_mb(c.rdh_below)}, {p} ranks a power of two"
    big = f"{_mb(nbytes)} >= rdh_below {_mb(c.rdh_below)}" if nbytes >= c.rdh_below else \
        f"{p} ranks not a power of two"
    if pairs:
        return "kangaring", f"{big}, pairs of ranks on every chip"
    if _ring_dims(topo, levels):
        return "bidir-ring", f"{big}, torus links run both ways"
    return "ring", big


def choose(ctx: "object") -> tuple[str, str]:
    """(algorithm, why) for a call's :class:`~trnsim.collectives.algorithms.Context`."""
    system: SystemConfig = ctx.system  # type: ignore[attr-defined]
    topo: Topology = ctx.topo  # type: ignore[attr-defined]
    c = ctx.collective  # type: ignore[attr-defined]
    n: int = ctx.nbytes  # type: ignore[attr-defined]
    p: int = ctx.p  # type: ignore[attr-defined]
    shape = ctx.shape  # type: ignore[attr-defined]
    spanned = shape.spanned() if shape is not None else list(range(len(topo.level_names)))
    coll = system.collectives
    if c in ("send-recv", "permute"):
        return "mesh", "point to point: direct writes"
    if c == "all-to-all":
        switched = all(lv == 0 or topo.dims[lv - 1].kind != "ring" for lv in spanned)
        if switched:
            return "mesh", "no torus dimension in the group: direct writes through the switches"
        if n < coll.mesh_below:
            return "mesh", f"{_mb(n)} < mesh_below {_mb(coll.mesh_below)}"
        return "ring", f"{_mb(n)} >= mesh_below {_mb(coll.mesh_below)} on a torus: pairwise exchange"
    if c in ("broadcast", "reduce"):
        if n < coll.rdh_below:
            return "rdh", f"{_mb(n)} < rdh_below {_mb(coll.rdh_below)}: binomial tree"
        return "ring", f"{_mb(n)} >= rdh_below {_mb(coll.rdh_below)}: pipelined chain"
    if shape is not None:
        inter = [lv for lv in spanned if topo.level_inter_instance(lv)]
        if inter and len(topo.tiers(shape)) >= 2:
            names = "+".join(topo.level_names[lv] for lv in inter)
            return "hierarchical", f"the group spans instances ({names}): intra-chip, intra-instance, inter-instance"
    pairs = topo.pairs(ctx.group)  # type: ignore[attr-defined]
    return flat_choice(system, n, p, topo, spanned, pairs=pairs is not None and len(pairs) >= 2)
