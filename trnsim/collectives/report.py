"""What a collective cost, as data (rendering lives in the CLI).

Conventions (nccl-tests' and nccom-test's, notes/collectives.md §2-3):

* ``nbytes`` is nccl-tests' S: the all-reduce buffer, the all-gather output, the reduce-scatter
  input, one rank's all-to-all send buffer, the broadcast/reduce buffer, the send/recv message.
* ``time`` runs from the earliest rank's start to the last rank's completion.
* ``algbw = S / time`` and ``busbw = algbw * factor`` (all-reduce 2(n-1)/n; all-gather,
  reduce-scatter, all-to-all (n-1)/n; the others 1), in bytes/s. nccom-test prints both in
  GiB/s (2^30 bytes/s), nccl-tests in GB/s (10^9); the CLI says which.
* ``bound`` is the resource that held this call's chunks back longest (the union of the
  intervals from a chunk's booking to when that resource had served it): a link direction, an
  HBM stack, a rank's DMA engines or VectorE; ``latency`` when the α terms are most of the
  estimate and no resource held chunks back for half the time. ``bound_percent`` is that
  resource's share of the call's time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CollectiveReport", "AlphaBetaEstimate", "EstimateStep"]


@dataclass(frozen=True)
class EstimateStep:
    """One step of the α-β estimate: its latency and the bytes its busiest link, HBM stack and
    DMA engines carry (per rank, assuming nothing else shares them)."""

    label: str
    alpha_s: float
    link_bytes: float
    link_bandwidth: float
    hbm_bytes: float
    hbm_bandwidth: float
    dma_bytes: float
    dma_bandwidth: float
    repeat: int = 1
    flows: int = 1  # flows on the busiest link direction (a textbook form assumes 1)

    @property
    def beta_s(self) -> float:
        return max(self.link_bytes / self.link_bandwidth if self.link_bandwidth else 0.0,
                   self.hbm_bytes / self.hbm_bandwidth, self.dma_bytes / self.dma_bandwidth)

    @property
    def bound(self) -> str:
        t = {"link": self.link_bytes / self.link_bandwidth if self.link_bandwidth else 0.0,
             "HBM": self.hbm_bytes / self.hbm_bandwidth, "DMA": self.dma_bytes / self.dma_bandwidth}
        return max(t, key=lambda k: t[k])

    @property
    def time_s(self) -> float:
        return self.repeat * (self.alpha_s + self.beta_s)

    @property
    def textbook_s(self) -> float:
        """The step as a textbook form counts it: one flow on every link."""
        link = self.link_bytes / max(1, self.flows) / self.link_bandwidth if self.link_bandwidth else 0.0
        return self.repeat * (self.alpha_s + max(link, self.hbm_bytes / self.hbm_bandwidth,
                                                 self.dma_bytes / self.dma_bandwidth))


@dataclass(frozen=True)
class AlphaBetaEstimate:
    """The closed-form estimate of a call: a sum of steps ``α_k + max(bytes / bandwidth)`` over
    the algorithm's steps (Thakur et al.; notes §5), with α and the bandwidths from the same
    system config the simulation uses and no contention between flows."""

    collective: str
    algorithm: str
    ranks: int
    nbytes: int
    steps: tuple[EstimateStep, ...]
    formula: str
    assumptions: str

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    @property
    def time_us(self) -> float:
        return self.time_s * 1e6

    @property
    def textbook_s(self) -> float:
        """The same sum with one flow per link (Thakur et al.'s assumption): shorter than
        :attr:`time_s` where a step's flows share a link."""
        return sum(s.textbook_s for s in self.steps)

    @property
    def latency_s(self) -> float:
        """The α part of the time."""
        return sum(s.repeat * s.alpha_s for s in self.steps)

    @property
    def step_count(self) -> int:
        return sum(s.repeat for s in self.steps)

    @property
    def bound(self) -> str:
        if not self.steps:
            return "none"
        if self.latency_s >= self.time_s / 2:
            return "latency"
        by: dict[str, float] = {}
        for s in self.steps:
            by[s.bound] = by.get(s.bound, 0.0) + s.repeat * s.beta_s
        return max(by, key=lambda k: by[k])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(time_s=self.time_s, latency_s=self.latency_s, textbook_s=self.textbook_s, bound=self.bound,
                 step_count=self.step_count)
        return d


@dataclass(frozen=True)
class CollectiveReport:
    """One simulated collective call."""

    collective: str
    algorithm: str
    reason: str  # why this algorithm ("forced" when given)
    system: str
    group: tuple[int, ...]
    nbytes: int
    count: int  # elements per rank buffer, nccl-tests' count
    dtype: str
    tick_hz: int
    start_ticks: tuple[int, ...]  # per rank of ``group``, when it reached the collective
    end_ticks: tuple[int, ...]  # per rank of ``group``, when its part was complete
    time_ticks: int
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    busbw_factor: float
    steps: int  # sequential steps of the schedule
    max_hops: int  # links on the longest route a transfer took
    transfers: int
    chunks: int
    link_bytes: dict[str, int]
    hbm_bytes: dict[str, int]
    dma_bytes: dict[int, int]  # per rank: bytes its DMA engines moved (adds counted at their rate)
    bound: str
    bound_percent: float
    estimate: AlphaBetaEstimate
    overrides: tuple[tuple[str, str], ...] = ()
    timeline: tuple[tuple[str, str, int, int], ...] = field(default=(), repr=False, compare=False)
    placement: str = ""  # where the group sits: instances, ranks on each, chips

    @property
    def ranks(self) -> int:
        return len(self.group)

    @property
    def time_s(self) -> float:
        return self.time_ticks / self.tick_hz

    @property
    def time_us(self) -> float:
        return self.time_ticks * 1e6 / self.tick_hz

    def end_of(self, rank: int) -> int:
        """The tick at which ``rank``'s part of the collective completed."""
        return self.end_ticks[self.group.index(rank)]

    @property
    def max_link_bytes(self) -> int:
        return max(self.link_bytes.values(), default=0)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"] = self.estimate.to_dict()
        d["time_us"] = self.time_us
        d["dma_bytes"] = {str(k): v for k, v in self.dma_bytes.items()}
        if timeline:
            d["timeline"] = [list(s) for s in self.timeline]
        else:
            d.pop("timeline")
        return d
