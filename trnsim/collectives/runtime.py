"""The Neuron runtime's costs of a collective, apart from the links, HBM and DMA engines.

A collective on Trainium is software as much as wires (notes/neuron-software-stack.md §1.1-1.2):
the host and the runtime launch it on the CC cores, the CC cores' program handshakes each step
with semaphores and issues DMA-ring entries one at a time, the rings the runtime built for it
use some of a core's DMA engines, and traffic between instances goes through a host proxy
thread that drives EFA. Each is a named parameter of the system's ``collectives:`` section, with
its provenance (a datasheet section, ``estimate``, or the ledger rows it was calibrated on):

``launch``          per call, per rank, of a collective run by itself (an nccom-test op, a
                    torch.distributed call): the runtime starting it on the CC core and its
                    program starting, before the rank's first transfer.
``graph_launch``    the same for a collective that is one step of a compiled graph (a decode or
                    prefill NEFF, a training step: ``trnsim estimate``): the compiler's
                    PseudoTriggerCollective2, rewritten into writes in the engines' instruction
                    stream, triggers the CC core with no runtime step between ops
                    (:func:`in_graph` puts it in ``launch``'s place).
``step_sync``       per transfer: the semaphore handshake with its peers (the receiver's buffer
                    is free, the sender may write) before its data moves; a latency, paid by a
                    step's transfers side by side.
``reduce_sync``     per transfer that adds what it reads (a reduce step of a reduce-scatter or
                    all-reduce): the runtime's own step before the reduction, on top of
                    ``step_sync``. Zero where the figures leave no room for it (SDK 2.32's ring
                    all-reduces); an earlier release's runtime may have it (``runtimes:``).
                    A simulated call's α-β estimate charges it per reduce step of its
                    schedule; ``estimate_collective`` alone (no schedule) does not.
``issue``           CC core time per transfer it starts (descriptors, semaphore set-up): a
                    rank's CC core issues one after another, so a mesh step's p-1 transfers
                    cost p-1 issues and a ring step one.
``dma_rings``       the DMA rings (one engine each) per physical core a transfer's data is
                    spread over: the ring/queue assignment the runtime gives a collective, the
                    same at every size (a 16 KiB transfer is cut into as many slices as a 1 GiB
                    one). A rank's concurrent transfers (both directions of a ring) take rings of
                    their own, round robin over the core's engines.
``p2p_rings``       the rings of a point-to-point transfer (send/recv, permute): one channel, where
                    a collective runs several.
``efa_proxy``       per transfer that leaves the instance over EFA: the time the sending rank's
                    network proxy thread spends on it (posting it to libfabric and reaping its
                    completion); ``ranks_per_proxy`` ranks share one thread, which serves them
                    one transfer at a time.

``collectives.sdk`` names the Neuron SDK release whose runtime these costs describe; a system
file's ``runtimes:`` lists what another release's runtime does differently (its own values, each
with its provenance), and ``collectives.sdk=<release>`` selects it: a ledger row measured on that
release says so (``predict: {sdk: ...}``).

The EFA tier's latency and bandwidth are the topology's ``efa`` dimension. With every cost at
zero and ``dma_rings`` at a core's engine count the model is the network alone (links, HBM and
DMA engines), which :func:`network_only` sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SystemConfig

__all__ = ["RuntimeCosts", "network_only", "in_graph", "RUNTIME_KEYS", "POINT_TO_POINT"]

#: the collectives keys that are the runtime's costs (the rest are the network's and the size rule)
RUNTIME_KEYS = ("launch", "graph_launch", "step_sync", "reduce_sync", "issue", "dma_rings", "p2p_rings", "efa_proxy",
                "ranks_per_proxy")
#: the collectives that run as one channel of point-to-point writes
POINT_TO_POINT = ("send-recv", "permute")


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's costs of one system, in ticks of its chip config (``*_ps`` in picoseconds)."""

    launch: int
    step_sync: int
    issue: int
    dma_rings: int
    p2p_rings: int
    efa_proxy: int
    ranks_per_proxy: int
    launch_ps: int
    step_sync_ps: int
    issue_ps: int
    efa_proxy_ps: int
    reduce_sync: int = 0
    reduce_sync_ps: int = 0

    @classmethod
    def of(cls, system: SystemConfig) -> "RuntimeCosts":
        c = system.collectives
        t = system.chip.ps_to_ticks
        engines = system.chip.core.dma.engines
        return cls(t(c.launch), t(c.step_sync), t(c.issue), min(c.dma_rings, engines), min(c.p2p_rings, engines),
                   t(c.efa_proxy), c.ranks_per_proxy, c.launch, c.step_sync, c.issue, c.efa_proxy,
                   t(c.reduce_sync), c.reduce_sync)

    def rings(self, collective: str) -> int:
        """DMA rings per physical core a call of ``collective`` holds."""
        return self.p2p_rings if collective in POINT_TO_POINT else self.dma_rings


def network_only(system: SystemConfig | str) -> list[str]:
    """Overrides that take the runtime out: every cost zero, a transfer on all of a core's DMA
    engines (``load_system(name, network_only(name))``)."""
    from ..config import load_system

    sysc = system if isinstance(system, SystemConfig) else load_system(system)
    return ["collectives.launch=0ns", "collectives.graph_launch=0ns", "collectives.step_sync=0ns",
            "collectives.reduce_sync=0ns", "collectives.issue=0ns",
            f"collectives.dma_rings={sysc.chip.core.dma.engines}", f"collectives.p2p_rings={sysc.chip.core.dma.engines}",
            "collectives.efa_proxy=0ns"]


def in_graph(system: SystemConfig) -> SystemConfig:
    """``system`` as a compiled graph's collectives see it: ``graph_launch`` in ``launch``'s
    place (the runner charges ``launch`` per call and rank)."""
    import dataclasses

    c = system.collectives
    if c.launch == c.graph_launch:
        return system
    return dataclasses.replace(system, collectives=dataclasses.replace(c, launch=c.graph_launch))
