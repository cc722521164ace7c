"""Neuron's mesh algorithms for groups of several ranks per chip, and its single-step mesh
all-reduce (SDK ``neuron-runtime/explore/intranode-collective-comm.rst`` and
``internode-collective-comm.rst``; notes/collectives.md §1.3).

``two-step-mesh``   the intra-node Mesh. All-gather: step 0, each chip's chunks go to every other
                    chip, the destination chips split among the chip's ranks, each writing the
                    chip's chunks (read "locally or over intra-chip connectivity") to one rank
                    of each of its destination chips; step 1, an intra-chip broadcast of what
                    each rank received (one read, duplicated writes). Reduce-scatter: step 0,
                    for each off-chip rank one of the chip's ranks reads the chip's chunks for
                    it, adds them and writes the partial there; step 1, each rank adds the
                    partials it received and its chip's chunks into its output. All-reduce is
                    the two in turn: 4 steps, O(1) in the group size.
``single-step-mesh`` all-reduce in one step: every rank writes its whole buffer to every peer
                    (a copy per peer on the links), then adds the p buffers into its output;
                    (p-1)·n on every rank's links instead of 2(p-1)·n/p, one hop instead of
                    two. Neuron uses it across instances for small groups and sizes, where the
                    extra data costs less than a hop (select.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedule import Schedule, pieces
from .base import Algorithm, Context

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS", "chip_blocks"]


def chip_blocks(ctx: Context) -> list[list[int]]:
    """The group's ranks by chip (chips in ring order, each chip's ranks sorted)."""
    by: dict[int, list[int]] = {}
    for r in ctx.topo.ring_order(ctx.group):
        by.setdefault(ctx.topo.chip_of(r), []).append(r)
    return [sorted(v) for v in by.values()]


def _assignments(blocks: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Per chip, (writer, receiver) for each other chip: destination chips in turn among the
    chip's ranks, each written to the rank of the same local index (so receptions spread too)."""
    out = []
    n = len(blocks)
    for a, mine in enumerate(blocks):
        pairs = []
        for j in range(1, n):
            other = blocks[(a + j) % n]
            k = (j - 1) % len(mine)
            pairs.append((mine[k], other[k % len(other)]))
        out.append(pairs)
    return out


def _ag(s: Schedule, ctx: Context, blocks: list[list[int]], piece: int) -> None:
    c = len(blocks[0])
    got: dict[int, int] = {r: 1 for b in blocks for r in b}  # pieces each rank holds
    s.begin_step()
    for mine, pairs in zip(blocks, _assignments(blocks)):
        for w, d in pairs:
            s.send(w, d, c * piece, tuple(mine), gather=True)
            got[d] += c
    s.end_step()
    if c > 1:
        s.begin_step()
        for mine in blocks:
            for r in mine:  # what it received and its own piece, to its chip's other ranks
                s.send(r, tuple(x for x in mine if x != r), got[r] * piece)
        s.end_step()


def _rs(s: Schedule, ctx: Context, blocks: list[list[int]], piece: int) -> None:
    c = len(blocks[0])
    n = len(blocks)
    received: dict[int, int] = {r: 0 for b in blocks for r in b}
    s.begin_step()
    for a, mine in enumerate(blocks):
        k = 0
        for j in range(1, n):
            for d in blocks[(a + j) % n]:  # every off-chip rank, by one of this chip's ranks in turn
                s.send(mine[k % c], d, piece, tuple(mine))
                received[d] += 1
                k += 1
    s.end_step()
    s.begin_step()
    for mine in blocks:
        for r in mine:  # the partials received and the chip's own chunks, added into the output
            s.send(r, r, piece, (r,) * (received[r] + c))
    s.end_step()


def _two_step(s: Schedule, ctx: Context) -> None:
    blocks = chip_blocks(ctx)
    p = ctx.p
    isz = ctx.itemsize
    c = ctx.collective
    if c == "all-gather":
        _ag(s, ctx, blocks, pieces(ctx.nbytes, p, isz)[0])
        return
    piece = pieces(ctx.nbytes, p, isz)[0]
    s.phase = "rs"
    _rs(s, ctx, blocks, piece)
    if c == "all-reduce":
        s.phase = "ag"
        _ag(s, ctx, blocks, piece)
    s.phase = ""


def _two_step_estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    blocks = chip_blocks(ctx)
    p, cc, nc = ctx.p, len(blocks[0]), len(blocks)
    m = ctx.nbytes / p
    acc = r.acc
    out: list[EstimateStep] = []
    coll = ctx.collective
    if coll in ("reduce-scatter", "all-reduce"):
        flows = []
        per_rank: dict[int, int] = {}
        for a, mine in enumerate(blocks):
            k = 0
            for j in range(1, nc):
                for d in blocks[(a + j) % nc]:
                    flows.append((mine[k % cc], d, m))
                    per_rank[mine[k % cc]] = per_rank.get(mine[k % cc], 0) + 1
                    k += 1
        most = max(per_rank.values(), default=0)
        # each write reads the chip's cc chunks and adds them: cc reads + 1 write, an add each
        out.append(r.step("mesh RS off-chip", flows, most * (cc + 1) * m, most * m / acc if cc > 1 else most * m))
        got = (nc - 1)  # partials each rank received
        local = [(x, x, m) for b in blocks for x in b]
        out.append(r.step("mesh RS on-chip add", local, (got + cc + 1) * m, m / acc))
    if coll in ("all-gather", "all-reduce"):
        flows = []
        sends: dict[int, int] = {}
        got: dict[int, int] = {x: 1 for b in blocks for x in b}
        for mine, pairs in zip(blocks, _assignments(blocks)):
            for w, d in pairs:
                flows.append((w, d, cc * m))
                sends[w] = sends.get(w, 0) + 1
                got[d] += cc
        most = max(sends.values(), default=0)
        out.append(r.step("mesh AG off-chip", flows, 2 * most * cc * m, most * cc * m))
        if cc > 1:
            top = max(got.values())
            bflows = [(x, y, got[x] * m) for b in blocks for x in b for y in b if y != x]
            out.append(r.step("mesh AG on-chip", bflows, cc * top * m, top * m))
    return out


def _check_two_step(ctx: Context) -> str | None:
    blocks = chip_blocks(ctx)
    if len({len(b) for b in blocks}) != 1:
        return "the same number of the group's ranks on every chip it uses"
    return None


def _single_step(s: Schedule, ctx: Context) -> None:
    order = list(ctx.order)
    n = ctx.nbytes
    s.begin_step()
    for r in order:  # its whole buffer to every peer: a copy crosses the links per peer
        for x in order:
            if x != r:
                s.send(r, x, n)
    s.end_step()
    s.begin_step()
    for r in order:  # the p buffers added into the output
        s.send(r, r, n, (r,) * len(order))
    s.end_step()


def _single_step_estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    order = list(ctx.order)
    p = len(order)
    n = float(ctx.nbytes)
    flows = [(a, b, n) for a in order for b in order if a != b]
    local = [(a, a, n) for a in order]
    return [r.step("broadcast", flows, 2 * (p - 1) * n, (p - 1) * n), r.step("local add", local, (p + 1) * n, n / r.acc)]


ALGORITHMS = (
    Algorithm("two-step-mesh", ("all-reduce", "all-gather", "reduce-scatter"), ("mesh2", "neuron-mesh"),
              _two_step, _two_step_estimate,
              "AG: chip chunks to every other chip (destinations split among the chip's ranks), then an on-chip "
              "broadcast; RS: the chip's chunks added and written to each off-chip rank, then an on-chip add; "
              "AR = RS + AG (4 steps)", _check_two_step),
    Algorithm("single-step-mesh", ("all-reduce",), ("mesh1", "ssm"), _single_step, _single_step_estimate,
              "every rank's whole buffer to every peer in one step ((p-1)·n per rank), then a local add of p buffers",
              lambda ctx: None),
)
