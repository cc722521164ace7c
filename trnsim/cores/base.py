"""The interface every engine module implements.

An engine gives each instruction two things (DESIGN.md, "Two models, one instruction stream"):

* :meth:`Engine.plan` — *when*: given the time its dependencies are satisfied, where the
  instruction sits on the engine's own in-order timeline (start, end, when its results become
  visible) and which trace segments it produces. Costs are counted in the engine's own clock
  cycles and converted to integer ticks here.
* :meth:`Engine.execute` — *what*: the numbers, in zero simulated time.

The scheduler (:mod:`trnsim.sim`) never computes data and knows no engine by name: engines
register themselves with :func:`register_engine`, and adding one does not touch it.

This registry is the one table of engines: each class says which instructions it may run
(``runs``), the names a kernel may call it by (``aliases``), where it sits in tables and plots
(``column``, ``title``, ``color``) and whether it has a datapath (``datapath``: Sync only
triggers DMAs, so it never bounds a kernel). The builder's engine choices, the metrics columns,
the plots, the traces and the estimate breakdowns read it (:func:`engine_names`,
:func:`engines_running`, :func:`canonical_engine`); its config section is declared beside the
config schema (:func:`trnsim.config.engine_section`). A new engine is its module, its config
section and the chip YAMLs (tests/cores/test_engine_table.py adds one).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, ClassVar

import numpy as np

from ..config import ChipConfig
from ..isa import DmaCopy, Instruction

__all__ = ["Engine", "Segment", "register_engine", "ENGINE_TYPES", "Numbering", "view_fields", "engine_names",
           "engines_running", "canonical_engine", "datapath_engines"]

# (lane, label, start tick, end tick, instruction index)
Segment = tuple[str, str, int, int, int]

ENGINE_TYPES: dict[str, type["Engine"]] = {}


def first_uses(ids: np.ndarray) -> np.ndarray:
    """Where each number of ``ids`` first appears, number by number, for numbers given in order of
    first use (:class:`Numbering`: 0, then each new one the next): ``np.unique(ids,
    return_index=True)[1]`` without its sort (a new number is one above every earlier one)."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    new = np.empty(len(ids), dtype=bool)
    new[0] = True
    np.greater(ids[1:], np.maximum.accumulate(ids)[:-1], out=new[1:])
    return new.nonzero()[0]


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
    """Add an engine class to the table (its ``name`` must be new; re-registering the same name
    replaces it, as a reloaded module does)."""
    ENGINE_TYPES[cls.name] = cls
    _VIEWS.clear()
    return cls


#: what is derived from ENGINE_TYPES, kept until the next registration
_VIEWS: dict[Any, Any] = {}


def engine_names() -> tuple[str, ...]:
    """The registered engines in table order (``column``, then registration): the order of
    metrics columns, plots, trace lanes and messages. (The simulation numbers engines in
    registration order, ENGINE_TYPES; this order is for people.)"""
    v = _VIEWS.get("names")
    if v is None:
        order = {name: i for i, name in enumerate(ENGINE_TYPES)}
        v = _VIEWS["names"] = tuple(sorted(ENGINE_TYPES, key=lambda n: (ENGINE_TYPES[n].column, order[n])))
    return v  # type: ignore[no-any-return]


def datapath_engines() -> tuple[str, ...]:
    """The engines with a datapath, in table order: the ones whose busy time can bound a kernel."""
    v = _VIEWS.get("datapath")
    if v is None:
        v = _VIEWS["datapath"] = tuple(n for n in engine_names() if ENGINE_TYPES[n].datapath)
    return v  # type: ignore[no-any-return]


def engines_running(ins_type: type) -> tuple[str, ...]:
    """The engines that may run instructions of ``ins_type`` (their ``runs``), in table order."""
    v = _VIEWS.get(ins_type)
    if v is None:
        v = _VIEWS[ins_type] = tuple(n for n in engine_names() if ins_type in ENGINE_TYPES[n].runs)
    return v  # type: ignore[no-any-return]


def canonical_engine(name: Any) -> str:
    """The engine a kernel names: its registered name, in any case, or one of its ``aliases``
    (NKI's ``pe``, ``act``, ``pool``...). A name that is none of these comes back as given (the
    caller says what it expected)."""
    table = _VIEWS.get("aliases")
    if table is None:
        table = {}
        for n in engine_names():
            for a in (n,) + ENGINE_TYPES[n].aliases:
                table[a.lower()] = n
        _VIEWS["aliases"] = table
    text = str(name)
    return table.get(text.lower(), text)  # type: ignore[no-any-return]


class Engine:
    """An in-order engine with its own clock. Subclasses implement :meth:`cycles` (and may
    override :meth:`plan` when an instruction has internal overlap, as TensorE's LS/MM do)."""

    name: ClassVar[str] = "Engine"
    #: the instruction types a kernel may put on this engine (every engine's sequencer may
    #: trigger a DMA copy); the builder offers an instruction to exactly these engines
    runs: ClassVar[frozenset[type]] = frozenset({DmaCopy})
    #: other names a kernel may use for it besides its name in any case (NKI's, the ISA's)
    aliases: ClassVar[tuple[str, ...]] = ()
    #: where it sits in tables, plots, trace lanes and messages (see :func:`engine_names`)
    column: ClassVar[int] = 100
    #: how people call it (metrics column docs)
    title: ClassVar[str] = ""
    #: its colour in plots
    color: ClassVar[str] = "#999999"
    #: it has a datapath, so its busy time can be what bounds a kernel (Sync only triggers DMAs)
    datapath: ClassVar[bool] = True
    #: its instructions may read and write PSUM tiles (the builder refuses a PSUM operand if not)
    reaches_psum: ClassVar[bool] = True
    #: dependencies on this engine's own earlier instructions are satisfied at their *end*
    #: (the engine pipelines them, e.g. PSUM accumulation) rather than after the latency.
    pipelines_own_results: ClassVar[bool] = False
    #: per instruction type (exactly that type), the attribute paths that decide its
    #: :meth:`cycles`, :meth:`latency_cycles`, :meth:`lane` and ``describe()`` on this engine,
    #: given the state named by ``cost_state``: the native scheduler works the costs out once per
    #: distinct key (its simpy reference asks for each instruction). A type not listed is
    #: costed instruction by instruction. Keep in step with cycles(): a field it reads that is
    #: missing here would give instructions that differ only there one cost
    #: (tests/sim/test_sim_equivalence.py compares the two on every library kernel).
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
    def max_free(cls, config: ChipConfig, space: str) -> int | None:
        """The most elements per partition one instruction may touch in ``space`` ("sbuf",
        "psum"); None: no limit of its own (the builder checks operands against it)."""
        return None

    @classmethod
    def lanes(cls) -> tuple[str, ...]:
        """Every lane :meth:`lane` and :meth:`plan` put segments on (trace lanes, in order)."""
        return (cls.name,)

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
