"""A collective's message schedule: the transfers an algorithm emits and what each waits for.

Algorithms never touch time. They describe data movement as a DAG of :class:`Transfer`\\ s
(ASTRA-sim's collective phases against its network API) and the network model
(:mod:`trnsim.collectives.network`) runs the DAG over links, DMA engines and HBM stacks.

A transfer is one DMA-ring entry: the sender's DMA engines read ``reads`` (one full read of
``nbytes`` from each listed rank's HBM: its own input, the partial it received), combine them
if there are several (a reduce-on-send, NCCL's ``recvReduceSend``), and write the result to every
rank in ``dsts`` (several for KangaRing's DMA duplication: one read, two writes). ``dst_reads``
fuses a reduction at the receiver (``recvReduceCopy``): the receiving rank's DMA reads those
operands and adds them to the arriving data before it lands.

Dependencies follow ranks: each rank has a *frontier*, the transfers of the last step it took
part in, and a transfer waits for the frontiers of its sender and receivers (data received and
buffers free, as the CC cores' semaphores enforce). Every rank's first frontier is its *start*:
the rank has reached the collective and holds a CC core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = ["Transfer", "Schedule", "Quotient", "NotQuotient", "pieces"]

#: a frontier longer than this is replaced by a join node, so a mesh step (a rank touching 2(p-1)
#: transfers) does not give the next step's p-1 transfers 2(p-1) dependencies each
_JOIN_AT = 4


@dataclass(slots=True)
class Transfer:
    """One DMA-ring entry (see the module docstring); ``src == -1`` is a join or a start node
    that moves no data."""

    src: int
    dsts: tuple[int, ...]
    nbytes: int
    reads: tuple[int, ...]
    dst_reads: tuple[int, ...] = ()
    deps: list[int] = field(default_factory=list)
    step: int = 0
    phase: str = ""
    gather: bool = False  # ``reads`` are concatenated (each holds nbytes / len(reads)), not added

    @property
    def operands(self) -> int:
        return len(self.reads) + len(self.dst_reads)

    @property
    def is_node(self) -> bool:
        return self.src < 0

    def ranks(self) -> Iterable[int]:
        if self.src >= 0:
            yield self.src
            yield from self.dsts


def pieces(nbytes: int, parts: int, itemsize: int) -> list[int]:
    """``nbytes`` cut into ``parts`` pieces of whole elements, as even as possible (the first
    pieces one element larger), bytes."""
    elems, rem = divmod(nbytes // itemsize, parts)
    return [(elems + (1 if i < rem else 0)) * itemsize for i in range(parts)]


class NotQuotient(Exception):
    """A schedule built on orbit representatives met what its orbits cannot stand for (a
    pipelined chain's explicit dependencies): the call is built in full instead."""


@dataclass
class Quotient:
    """What a schedule built on orbit representatives needs (symmetry.py): each rank's
    representative (``rep``; the representatives map to themselves), and the ranks whose sends
    are written down as descriptors (``keep``: the representatives and their images under the
    generators, for the equivariance check). ``desc[rank]`` collects ``(step, dsts, nbytes,
    reads, dst_reads, gather)`` of every send of a kept rank, in order."""

    rep: dict[int, int]
    keep: frozenset[int]
    desc: dict[int, list[tuple[object, ...]]] = field(default_factory=dict)


class Schedule:
    """The DAG under construction for one collective over ``group``.

    With a :class:`Quotient` it is built on orbit representatives: only the representatives'
    sends become transfers (one per orbit of transfers), and frontiers are kept per
    representative rank as orbits of transfers: a transfer waits for its sender's frontier and
    for its receivers' representatives' (the transfer into a receiver of an orbit is the image
    of one into its representative). Sends of ranks outside ``keep`` are dropped at once
    (algorithms that loop over ranks skip them first: :attr:`keep`)."""

    def __init__(self, group: Sequence[int], quotient: Quotient | None = None):
        self.group = tuple(group)
        self.transfers: list[Transfer] = []
        #: rank -> the node every transfer of that rank waits for first
        self.start: dict[int, int] = {}
        self.frontier: dict[int, list[int]] = {}
        self.steps = 0
        self.phase = ""
        self._step_touch: dict[int, list[int]] | None = None
        self.quotient = quotient
        #: the ranks whose sends matter (None: every rank); loops over ranks may skip the others
        self.keep: frozenset[int] | None = None if quotient is None else quotient.keep
        for r in self.group:
            if quotient is not None and quotient.rep[r] != r:
                continue
            i = self._node([], "start")
            self.start[r] = i
            self.frontier[r] = [i]

    def _node(self, deps: list[int], phase: str) -> int:
        self.transfers.append(Transfer(-1, (), 0, (), (), deps, self.steps, phase))
        return len(self.transfers) - 1

    def _deps_of(self, rank: int) -> list[int]:
        f = self.frontier[rank]
        if len(f) > _JOIN_AT:
            f = self.frontier[rank] = [self._node(list(f), "join")]
        return f

    def begin_step(self) -> None:
        """Transfers added until :meth:`end_step` run concurrently: they wait for the frontiers
        as they were when the step began, and the step's transfers become the new frontiers."""
        assert self._step_touch is None, "steps do not nest"
        self._step_touch = {}
        self.steps += 1

    def end_step(self) -> None:
        touch = self._step_touch
        assert touch is not None, "end_step without begin_step"
        for r, ids in touch.items():
            self.frontier[r] = ids
        self._step_touch = None

    def send(self, src: int, dsts: int | Sequence[int], nbytes: int, reads: Sequence[int] | None = None,
             dst_reads: Sequence[int] = (), deps: Sequence[int] | None = None, gather: bool = False) -> int:
        """Add a transfer (inside a step, or with explicit ``deps``); return its index.

        ``reads`` defaults to the sender's own buffer; with ``gather`` the listed ranks' buffers
        are read one after another into one message (an equal share each), not added. A
        transfer whose only destination is its sender is a local step (a rank reducing what it
        received into its output). With explicit ``deps`` the transfer waits
        for those and for the start nodes of its ranks only, and the frontiers are updated to it
        (pipelined chains set their own edges)."""
        q = self.quotient
        if q is not None:
            if deps is not None:
                raise NotQuotient("a pipelined chain's explicit dependencies")
            if src not in q.keep:
                return -1
            d = (dsts,) if isinstance(dsts, int) else tuple(dsts)
            rd = (src,) if reads is None else tuple(reads)
            q.desc.setdefault(src, []).append((self.steps, d, nbytes, rd, tuple(dst_reads), gather))
            if q.rep[src] != src:
                return -1
            return self._send_rep(src, d, nbytes, rd, tuple(dst_reads), gather)
        d = (dsts,) if isinstance(dsts, int) else tuple(dsts)
        rd = (src,) if reads is None else tuple(reads)
        if deps is None:
            touch = self._step_touch
            assert touch is not None, "send outside a step needs explicit deps"
            dep: list[int] = list(self._deps_of(src))
            for r in d:
                if r != src:
                    dep.extend(x for x in self._deps_of(r) if x not in dep)
            idx = len(self.transfers)  # after any join node _deps_of added
            self.transfers.append(Transfer(src, d, nbytes, rd, tuple(dst_reads), dep, self.steps, self.phase, gather))
            for r in (src, *d):
                lst = touch.setdefault(r, [])
                if not lst or lst[-1] != idx:
                    lst.append(idx)
        else:
            idx = len(self.transfers)
            dep = list(deps) + [self.start[src]] + [self.start[r] for r in d if r != src]
            self.transfers.append(Transfer(src, d, nbytes, rd, tuple(dst_reads), dep, self.steps, self.phase, gather))
            for r in (src, *d):
                self.frontier[r] = [idx]
        return idx

    def _send_rep(self, src: int, d: tuple[int, ...], nbytes: int, rd: tuple[int, ...], dr: tuple[int, ...],
                  gather: bool) -> int:
        """A representative's send on orbits: it waits for its sender's frontier and its
        receivers' representatives' (orbits of transfers), and becomes part of theirs."""
        touch = self._step_touch
        if touch is None:
            raise NotQuotient("a send outside a step")
        rep = self.quotient.rep  # type: ignore[union-attr]
        dep: list[int] = list(self._deps_of(src))
        for r in d:
            rr = rep[r]
            if rr != src:
                dep.extend(x for x in self._deps_of(rr) if x not in dep)
        idx = len(self.transfers)  # after any join node _deps_of added
        self.transfers.append(Transfer(src, d, nbytes, rd, dr, dep, self.steps, self.phase, gather))
        for r in (src, *(rep[x] for x in d)):
            lst = touch.setdefault(r, [])
            if idx not in lst:
                lst.append(idx)
        return idx

    def sync(self, ranks: Iterable[int], ids: Iterable[int]) -> None:
        """Make ``ids`` the frontier of every rank in ``ranks`` (after a pipelined chain)."""
        if self.quotient is not None:
            raise NotQuotient("a pipelined chain's explicit dependencies")
        ids = list(ids)
        for r in ranks:
            self.frontier[r] = list(ids)
