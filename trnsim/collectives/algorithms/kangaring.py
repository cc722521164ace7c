"""``kangaring``: Neuron's ring over one primary per pair of ranks on a chip, with DMA
duplication (one read, two writes: the next primary and its pair) and the pair's second input
read directly; both directions, as Neuron runs "multiple cycles with mutually exclusive wires"
(notes/collectives.md §1.3, S21). Groups that hold pairs on every chip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedule import Schedule, pieces
from .base import Algorithm, Context, bidir, group_pairs
from .flat import ring_all_gather, ring_steps

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS"]


def _build(s: Schedule, ctx: Context) -> None:
    pairs = group_pairs(ctx)
    assert pairs is not None
    primaries = ctx.topo.ring_order([a for a, _ in pairs])
    mate = dict(pairs)
    p, q = ctx.p, len(primaries)
    c = ctx.collective
    isz = ctx.itemsize
    # every pair owns a block of 2 ranks' pieces; the ring moves pair blocks
    if c == "all-gather":
        piece = pieces(ctx.nbytes, p, isz)[0]
        s.begin_step()
        for a, b in pairs:  # each pair swaps its two pieces on chip
            s.send(a, b, piece)
            s.send(b, a, piece)
        s.end_step()
        ring_all_gather(s, bidir([(primaries, 2 * piece * q)], isz), isz, dup=mate)
        return
    # reduce-scatter (and the first half of all-reduce): the ring over primaries adds the
    # primary's and its pair's inputs (two reads), duplicated nothing; the last receiver adds
    # both of its own as the data lands
    ring_steps(s, bidir([(primaries, ctx.nbytes)], isz), isz, lambda k, p, i, r, nxt, pc: s.send(
        r, nxt, pc[(i - k - 1) % p], (r, mate[r]) if k == 0 else (r, r, mate[r]),
        (nxt, mate[nxt]) if k == p - 2 else ()))
    block = pieces(ctx.nbytes, q, isz)[0]
    if c == "reduce-scatter":
        s.begin_step()
        for a, b in pairs:  # the pair's half of the reduced block
            s.send(a, b, block // 2)
        s.end_step()
        return
    s.begin_step()
    for a, b in pairs:  # all-reduce: the pair gets the whole reduced block, then the ring gathers
        s.send(a, b, block)
    s.end_step()
    ring_all_gather(s, bidir([(primaries, ctx.nbytes)], isz), isz, dup=mate)


def _estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    pairs = group_pairs(ctx) or []
    prim = r.topo.ring_order([a for a, _ in pairs])
    q, p = len(prim), ctx.p
    n = float(ctx.nbytes)
    m = n / p
    acc = r.acc
    ring = [(prim[i], prim[(i + 1) % q], m) for i in range(q)] + [(prim[(i + 1) % q], prim[i], m) for i in range(q)]
    swap = [(a, b, m) for a, b in pairs] + [(b, a, m) for a, b in pairs]
    out: list[EstimateStep] = []
    c = ctx.collective
    if c == "all-gather":
        out.append(r.step("pair swap", swap, 2 * m, m))
    if c in ("reduce-scatter", "all-reduce"):
        if q == 2:
            out.append(r.step("ring RS", ring, 6 * m, 4 * m / acc, fused=True))
        else:
            out.append(r.step("ring RS first", ring, 4 * m, 2 * m / acc))
            if q > 3:
                out.append(r.step("ring RS", ring, 6 * m, 2 * m / acc, q - 3))
            out.append(r.step("ring RS last", ring, 8 * m, 4 * m / acc, fused=True))
        share = m if c == "reduce-scatter" else 2 * m
        out.append(r.step("pair copy", [(a, b, share) for a, b in pairs], share, share))
    if c in ("all-gather", "all-reduce"):
        out.append(r.step("ring AG", ring, 4 * m, 2 * m, q - 1))
    return out


def _check(ctx: Context) -> str | None:
    pairs = group_pairs(ctx)
    if pairs is None:
        return ("pairs of ranks on every chip it uses (an even number of the group's ranks per chip); "
                f"{ctx.system.name} has {ctx.topo.rpc} rank(s) per chip")
    if len(pairs) < 2:
        return "at least two pairs of ranks (4 ranks, 2 per chip)"
    return None


ALGORITHMS = (
    Algorithm("kangaring", ("all-reduce", "all-gather", "reduce-scatter"), ("kanga",), _build, _estimate,
              "(p/2-1) ring steps over the primaries per phase, plus one on-chip pair step", _check),
)
