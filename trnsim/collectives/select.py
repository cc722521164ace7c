"""Which algorithm a collective runs when none is forced: Neuron's size rule, as NCCL's tuner
picks by size and topology.

For all-reduce, all-gather and reduce-scatter (notes/collectives.md §1.3, S21):

* a group spanning instances runs **hierarchical**: the intra-instance part (every rank of an
  instance in the group, chip cores and torus together), then the inter-instance part on its
  share, each by the rule below, as Neuron composes across nodes;
* the thresholds are stated for ``collectives.rule_ranks`` ranks (64: Neuron's ranges are for a
  whole trn2.48xlarge); a group of p ranks switches at the same bytes per rank, so p/64 of them
  (the 16-rank nccom-test example picks rdh at 2 MiB and kangaring at 32 MiB);
* otherwise below ``collectives.mesh_below`` (1 MB) a mesh, for the collectives
  ``collectives.mesh_collectives`` names: with ``all`` (Trn2's runtime) Neuron's
  **two-step-mesh** when the group holds several ranks on each of several chips (chip chunks
  across, then an on-chip broadcast), the direct **mesh** otherwise; with ``all-reduce`` (Trn1's
  runtime, whose only mesh is its all-to-all all-reduce) the direct **mesh** for all-reduce, and
  all-gather and reduce-scatter go on to the rules below; **rdh** below ``collectives.rdh_below`` (56 MB) for
  power-of-two groups; above that **kangaring** when the group holds pairs of ranks on its
  chips (Neuron: TP groups holding a chip's ranks) and the DMA can duplicate writes, else a ring: **bidir-ring** over torus links
  (Neuron runs cycles on mutually exclusive wires), **ring** elsewhere;
* with collectives on several CC streams at once (nccom-test ``--streams-json``, NxD's TP and
  FSDP streams) and ``collectives.multistream_mesh`` false, the ring fallback only: the runtime
  enabled Mesh "in multi-stream mode" on Trn3 Gen2 UltraServers only in SDK 2.32 ("so
  multi-stream workloads can now use Mesh alongside Ring", runtime release notes, S21), so
  multi-stream collectives elsewhere run rings;
* between instances, an all-reduce runs **single-step-mesh** where the data it adds costs less
  than the hop it saves ("where the extra data transfer time is shorter than 15 us", S21): the
  extra (p-1)(p-2)/p·n over the tier's per-rank bandwidth against one step of its α.

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


def _per_chip(topo: Topology, ranks: Sequence[int]) -> dict[int, int]:
    by: dict[int, int] = {}
    for r in ranks:
        c = topo.chip_of(r)
        by[c] = by.get(c, 0) + 1
    return by


def _ring_dims(topo: Topology, ranks: Sequence[int]) -> bool:
    """Whether the ranks' chips differ along a ring (torus) dimension."""
    coords = {topo.coords(topo.chip_of(r)) for r in ranks}
    return any(d.kind == "ring" and len({c[i] for c in coords}) > 1 for i, d in enumerate(topo.dims))


def _single_step_pays(system: SystemConfig, topo: Topology, nbytes: int, ranks: Sequence[int]) -> tuple[bool, str]:
    """Single-step mesh against two-step (RS + AG) mesh across instances: the extra bytes each
    rank sends, (p-1)(p-2)/p·n, over its share of the slowest inter-instance port, against the
    hop it saves (the tier's hop latency both ways, the DMA start and completion, the runtime's
    handshake and proxy turn)."""
    p = len(ranks)
    chips = _per_chip(topo, ranks)
    coords = {topo.coords(c) for c in chips}
    dims = [d for i, d in enumerate(topo.dims) if d.inter_instance and len({c[i] for c in coords}) > 1]
    if not dims:
        return False, ""
    per_rank = min(d.bandwidth for d in dims) / max(chips.values())
    extra = (p - 1) * (p - 2) / p * nbytes / per_rank
    dma = system.chip.core.dma
    coll = system.collectives
    hop = (max(2 * d.latency if d.kind == "switch" else d.latency for d in dims) + dma.start_latency
           + dma.transfer_latency + coll.step_sync + coll.issue + coll.efa_proxy) * 1e-12
    return extra < hop, f"{extra * 1e6:.2f} us of extra data < a {hop * 1e6:.2f} us hop"


def _ring(topo: Topology, ranks: Sequence[int]) -> str:
    """The ring fallback: cycles both ways over torus links, else one cycle."""
    return "bidir-ring" if _ring_dims(topo, ranks) else "ring"


def flat_choice(system: SystemConfig, collective: str, nbytes: int, ranks: Sequence[int],
                topo: Topology, streams: int = 1) -> tuple[str, str]:
    """The size rule on the group (or one tier's lane) ``ranks``: (algorithm, why). ``streams``
    CC streams at once: without ``collectives.multistream_mesh`` the runtime runs rings only."""
    c = system.collectives
    p = len(ranks)
    if streams > 1 and not c.multistream_mesh:
        return _ring(topo, ranks), f"{streams} CC streams at once: rings only (collectives.multistream_mesh false)"
    chips = _per_chip(topo, ranks)
    # the ranges were measured on rule_ranks ranks: a group compares the same bytes per rank
    mesh_below = c.mesh_below * p // c.rule_ranks
    rdh_below = c.rdh_below * p // c.rule_ranks
    scaled = "" if p == c.rule_ranks else f" x {p}/{c.rule_ranks} ranks"
    coords = {topo.coords(ch) for ch in chips}
    inter = any(d.inter_instance and len({cc[i] for cc in coords}) > 1 for i, d in enumerate(topo.dims))
    if collective == "all-reduce" and inter and p > 2:
        pays, why = _single_step_pays(system, topo, nbytes, ranks)
        if pays:
            return "single-step-mesh", f"across instances: {why}"
    meshes = c.mesh_collectives == "all" or collective == c.mesh_collectives
    if nbytes < mesh_below and meshes:
        why = f"{_mb(nbytes)} < mesh_below {_mb(c.mesh_below)}{scaled}"
        if c.mesh_collectives != "all":  # Trn1's all-to-all all-reduce: every rank writes every peer
            return "mesh", f"{why}, the runtime's all-to-all {collective}"
        counts = set(chips.values())
        if len(chips) > 1 and len(counts) == 1 and counts.pop() > 1:
            return "two-step-mesh", f"{why}, {p // len(chips)} ranks on each of {len(chips)} chips"
        return "mesh", why
    pow2 = p & (p - 1) == 0
    if mesh_below <= nbytes < rdh_below and pow2:
        return "rdh", f"{_mb(nbytes)} < rdh_below {_mb(c.rdh_below)}{scaled}, {p} ranks a power of two"
    if nbytes >= rdh_below:
        big = f"{_mb(nbytes)} >= rdh_below {_mb(c.rdh_below)}{scaled}"
    elif not pow2:
        big = f"{p} ranks not a power of two"
    else:
        big = f"{_mb(nbytes)} < mesh_below, no mesh {collective} on this runtime"
    pairs = topo.pairs(ranks)
    if pairs is not None and len(pairs) >= 2 and c.dma_duplication:
        return "kangaring", f"{big}, pairs of ranks on every chip"
    if _ring(topo, ranks) == "bidir-ring":
        return "bidir-ring", f"{big}, torus links run both ways"
    return "ring", big


def choose(ctx: "object") -> tuple[str, str]:
    """(algorithm, why) for a call's :class:`~trnsim.collectives.algorithms.Context`."""
    system: SystemConfig = ctx.system  # type: ignore[attr-defined]
    topo: Topology = ctx.topo  # type: ignore[attr-defined]
    c = ctx.collective  # type: ignore[attr-defined]
    n: int = ctx.nbytes  # type: ignore[attr-defined]
    shape = ctx.shape  # type: ignore[attr-defined]
    group = ctx.group  # type: ignore[attr-defined]
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
            return "hierarchical", f"the group spans instances ({names}): intra-instance, then inter-instance"
    return flat_choice(system, c, n, group, topo, ctx.streams)  # type: ignore[attr-defined]
