"""``kangaring``: Neuron's ring over one primary per pair of ranks on a chip, with DMA
duplication (one read, two writes: the next primary and its pair) and the pair's second input
read directly (notes/collectives.md §1.3, S21). It runs two cycles on mutually exclusive wires,
in opposite directions, each on half the data, and the primaries alternate between them ("so
that each rank is active in half of them"): the first rank of every pair leads one cycle, the
second the other. A reduce-scatter then ends with each rank holding one reduced block of its
cycle's half; all-gather and all-reduce add one on-chip swap with the mate. Groups that hold
pairs on every chip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedule import Schedule, pieces
from .base import Algorithm, Context, Lane, group_pairs, halves
from .flat import ring_all_gather, ring_steps

if TYPE_CHECKING:
    from ..analytic import Rates
    from ..report import EstimateStep

__all__ = ["ALGORITHMS"]


def _cycles(ctx: Context, isz: int, total: int) -> tuple[list[Lane], dict[int, int], list[tuple[int, int]]]:
    """The two cycles: one over the pairs' first ranks, the other the opposite way over their
    second ranks, each carrying half of ``total``; and the mate of every rank."""
    pairs = group_pairs(ctx)
    assert pairs is not None
    first = ctx.topo.ring_order([a for a, _ in pairs])
    mate = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    second = [mate[a] for a in reversed(first)]
    ha, hb = halves(total, isz)
    return [(first, ha), (second, hb)], mate, pairs


def _build(s: Schedule, ctx: Context) -> None:
    isz = ctx.itemsize
    p = ctx.p
    c = ctx.collective
    piece = pieces(ctx.nbytes, p, isz)[0]
    lanes, mate, pairs = _cycles(ctx, isz, ctx.nbytes)

    def swap(nbytes: int) -> None:  # each rank gives its mate what the mate's cycle did not bring
        s.begin_step()
        for a, b in pairs:
            s.send(a, b, nbytes)
            s.send(b, a, nbytes)
        s.end_step()

    if c == "all-gather":
        swap(piece)
        ring_all_gather(s, lanes, isz, dup=mate)
        return
    # reduce-scatter: in its cycle a primary adds its own and its mate's chunk to the partial it
    # received (three reads, one write) and writes on; the last receiver adds both of its own as
    # the data lands. Each rank ends with one reduced block of its cycle's half: its piece.
    ring_steps(s, lanes, isz, lambda k, q, i, r, nxt, pc: s.send(
        r, nxt, pc[(i - k - 1) % q], (r, mate[r]) if k == 0 else (r, r, mate[r]),
        (nxt, mate[nxt]) if k == q - 2 else ()))
    if c == "all-reduce":
        swap(piece)
        ring_all_gather(s, lanes, isz, dup=mate)


def _estimate(r: "Rates", ctx: Context) -> "list[EstimateStep]":
    lanes, mate, pairs = _cycles(ctx, ctx.itemsize, ctx.nbytes)
    q, p = len(lanes[0][0]), ctx.p
    m = float(ctx.nbytes) / p
    acc = r.acc
    ring = [(o[i], o[(i + 1) % q], m) for o, _ in lanes for i in range(q)]
    swap = [(a, b, m) for a, b in pairs] + [(b, a, m) for a, b in pairs]
    out: list[EstimateStep] = []
    c = ctx.collective
    # per rank (a primary in one cycle, its mate's partner in the other): its own reads, the
    # reads its mate's transfer makes of its chunk, and the writes it receives
    if c in ("reduce-scatter", "all-reduce"):
        if q == 2:
            out.append(r.step("ring RS", ring, 5 * m, 2 * m / acc, fused=True))
        else:
            out.append(r.step("ring RS first", ring, 3 * m, m / acc))
            if q > 3:
                out.append(r.step("ring RS", ring, 4 * m, m / acc, q - 3))
            out.append(r.step("ring RS last", ring, 6 * m, 2 * m / acc, fused=True))
    if c in ("all-gather", "all-reduce"):
        out.append(r.step("pair swap", swap, 2 * m, m))
        out.append(r.step("ring AG", ring, 3 * m, m, q - 1))
    return out


def _check(ctx: Context) -> str | None:
    if not ctx.system.collectives.dma_duplication:
        return f"DMA duplication (one read, two writes), which {ctx.system.name} does not have (collectives.dma_duplication)"
    pairs = group_pairs(ctx)
    if pairs is None:
        return ("pairs of ranks on every chip it uses (an even number of the group's ranks per chip); "
                f"{ctx.system.name} has {ctx.topo.rpc} rank(s) per chip")
    if len(pairs) < 2:
        return "at least two pairs of ranks (4 ranks, 2 per chip)"
    return None


ALGORITHMS = (
    Algorithm("kangaring", ("all-reduce", "all-gather", "reduce-scatter"), ("kanga",), _build, _estimate,
              "(p/2-1) ring steps per phase over the primaries of two opposite cycles (each rank leads one), "
              "plus one on-chip swap with the mate (AG, AR)", _check),
)
