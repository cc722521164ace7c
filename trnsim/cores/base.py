"""The interface every engine module implements.

An engine gives each instruction two things (DESIGN.md, "Two models, one instruction stream"):

* :meth:`Engine.plan` — *when*: given the time its dependencies are satisfied, where the
  instruction sits on the engine's own in-order timeline (start, end, when its results become
  visible) and which trace segments it produces. Costs are counted in the engine's own clock
  cycles and converted to integer ticks here.
* :meth:`Engine.execute` — *what*: the numbers, in zero simulated time.

The scheduler (:mod:`trnsim.sim`) never computes data and knows no engine by name: engines
register themselves with :func:`register_engine`, and adding one does not touch it.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, ClassVar

from ..config import ChipConfig
from ..isa import DmaCopy, Instruction

__all__ = ["Engine", "Segment", "register_engine", "ENGINE_TYPES", "Numbering", "view_fields"]

# (lane, label, start tick, end tick, instruction index)
Segment = tuple[str, str, int, int, int]

ENGINE_TYPES: dict[str, type["Engine"]] = {}


class Numbering(dict):  # type: ignore[type-arg]
    """Numbers keys 0, 1, 2... in order of first lookup: ``map(numbering.__getitem__, keys)``
    runs at C speed (a miss calls ``__missing__``), for per-instruction lookups in bulk."""

    def __missing__(self, key: Any) -> int:
        k = self[key] = len(self)
        return k


def view_fields(*operands: str) -> tuple[str, ...]:
    """The attribute paths of a view operand that a cost formula may read: its dtype (a dtype is
    its name), its memory space and its dims (free size and innermost stride)."""
    return tuple(f"{op}.{a}" for op in operands for a in ("dtype.name", "alloc.space", "dims"))


def register_engine(cls: type["Engine"]) -> type["Engine"]:
    ENGINE_TYPES[cls.name] = cls
    return cls


class Engine:
    """An in-order engine with its own clock. Subclasses implement :meth:`cycles` (and may
    override :meth:`plan` when an instruction has internal overlap, as TensorE's LS/MM do)."""

    name: ClassVar[str] = "Engine"
    #: dependencies on this engine's own earlier instructions are satisfied at their *end*
    #: (the engine pipelines them, e.g. PSUM accumulation) rather than after the latency.
    pipelines_own_results: ClassVar[bool] = False
    #: per instruction type (exactly that type), the attribute paths that decide its
    #: :meth:`cycles`, :meth:`latency_cycles`, :meth:`lane` and ``describe()`` on this engine,
    #: given the state named by ``cost_state``: the native scheduler works the costs out once per
    #: distinct key (its simpy reference asks for each instruction). A type not listed is
    #: costed instruction by instruction. Keep in step with cycles(): a field it reads that is
    #: missing here would give instructions that differ only there one cost
    #: (tests/test_sim_equivalence.py compares the two on every library kernel).
    cost_fields: ClassVar[dict[type, tuple[str, ...]]] = {}
    #: the engine attributes :meth:`cycles` reads and changes (ScalarE's loaded table): with
    #: any, costs are worked out in program order per (key, state)
    cost_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ChipConfig):
        self.config = config
        self.tpc = config.ticks_per_cycle(self.name)  # ticks per engine cycle
        self.free = 0  # tick at which the engine can start its next instruction
        self._exec: dict[str, Callable[[Any, Any], None]] = {}

    # ---- timing ----------------------------------------------------------------------------
    def cycles(self, ins: Instruction) -> int:
        """Busy cycles of ``ins`` on this engine (its issue interval)."""
        raise NotImplementedError(f"{self.name} engine has no cost for {ins.opcode}")

    def latency_cycles(self, ins: Instruction) -> int:
        """Cycles after the end before a dependent instruction may use the result."""
        return 0

    def lane(self, ins: Instruction) -> str:
        return self.name

    @classmethod
    def cost_key(cls, ins_type: type) -> Callable[[Any], Any] | None:
        """The key function of ``cost_fields[ins_type]`` (None: not listed). A subclass that
        overrides a cost method without listing its own ``cost_fields`` gets none."""
        keys = cls.__dict__.get("_cost_keys")
        if keys is None:
            owner = next(c for c in cls.__mro__ if "cost_fields" in c.__dict__)
            same = all(getattr(cls, m) is getattr(owner, m) for m in ("cycles", "latency_cycles", "lane"))
            keys = {t: operator.attrgetter(*f) for t, f in cls.cost_fields.items()} if same else {}
            setattr(cls, "_cost_keys", keys)
        return keys.get(ins_type)

    def trigger_ticks(self) -> int:
        """Ticks this engine's sequencer spends writing a DMA descriptor trigger."""
        return self.config.core.dma.trigger_cycles * self.tpc

    @staticmethod
    def trigger_label(queue: str) -> str:
        """The trace label of a DMA trigger onto queue lane ``queue``."""
        return f"DmaTrigger[{queue}]"

    def plan(self, ins: Instruction, t_dep: int, t_first: int) -> tuple[int, int, int, list[Segment]]:
        """Place ``ins``: return (start, end, ready, segments), all in ticks.

        ``t_dep`` is when all its dependencies are satisfied, ``t_first`` when those of its
        first phase are (see ``Instruction.first_deps``)."""
        start = max(t_dep, self.free)
        if isinstance(ins, DmaCopy):
            # the sequencer writes the descriptor trigger; the transfer is the DMA system's
            end = start + self.trigger_ticks()
            self.free = end
            return start, end, end, [(self.name, self.trigger_label(ins.queue), start, end, ins.index)]
        end = start + self.cycles(ins) * self.tpc
        self.free = end
        ready = end + self.latency_cycles(ins) * self.tpc
        return start, end, ready, [(self.lane(ins), ins.describe(), start, end, ins.index)]

    # ---- numbers ---------------------------------------------------------------------------
    def execute(self, ins: Instruction, mem: Any) -> None:
        """Compute ``ins``'s results into ``mem`` (a :class:`trnsim.memory.state.DeviceMemory`)."""
        fn = getattr(self, f"exec_{ins.opcode}", None)
        if fn is None:
            raise NotImplementedError(f"{self.name} engine cannot execute {ins.opcode}")
        fn(ins, mem)

    def exec_DmaCopy(self, ins: DmaCopy, mem: Any) -> None:
        from ..memory.dma import execute_dma

        execute_dma(ins, mem)

    def exec_DmaTranspose(self, ins: DmaCopy, mem: Any) -> None:
        from ..memory.dma import execute_transpose

        execute_transpose(ins, mem)

    def exec_DmaGather(self, ins: DmaCopy, mem: Any) -> None:
        from ..memory.dma import execute_indirect_dma

        execute_indirect_dma(ins, mem)

    exec_DmaScatter = exec_DmaGather
