"""The simulated clock of the distributed backend: what a call moves, as the NeuronLink model
names it; the model, once per distinct call (beside the call's sibling groups); the optimizer
steps this process took, for the step time the slowest rank saw."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.optim.optimizer as _optim

from trnsim.collectives import CollectiveError, CollectiveReport, simulate_collective, simulate_with_siblings

from ..runtime import runtime
from .world import NeuronDistError, system, world_size

# ---------------------------------------------------------------------------------------------
# what a call moves, as the NeuronLink model names it
# ---------------------------------------------------------------------------------------------

_SIM_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "uint8",
               torch.int8: "int8", torch.int16: "int16", torch.int32: "int32"}
_BY_SIZE = {1: "uint8", 2: "bf16", 4: "fp32", 8: "fp32", 16: "fp32"}  # bytes move alike; wider as 4-byte words


def sim_dtype(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "fp32"
    return _SIM_DTYPES.get(dtype) or _BY_SIZE.get(torch.empty((), dtype=dtype).element_size(), "uint8")


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(map(str, t.shape))}]"


def shapes_text(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(_shape(t) for t in tensors) or "nothing"


@dataclass
class Call:
    """One call on a group: ``op`` is the torch-facing name reports show, ``collective`` the
    NeuronLink model's, ``nbytes`` nccl-tests' S; ``signature`` is what must agree across ranks
    (shown in the error when it does not)."""

    op: str
    collective: str
    nbytes: int
    dtype: torch.dtype | None
    signature: str
    device: str  # "neuron" or "cpu"
    core: int
    root: int = -1  # group rank
    reduce: str = ""
    pairs: tuple[tuple[int, int], ...] | None = None  # global ranks (scatter, gather)
    uneven: bool = False  # ranks may move different byte counts (all-to-all with splits): S is the largest


REDUCE_CODES = {"SUM": 0, "AVG": 1, "PRODUCT": 2, "MIN": 3, "MAX": 4, "BAND": 5, "BOR": 6, "BXOR": 7, "PREMUL_SUM": 8}


def reduce_name(op: Any) -> str:
    kind = getattr(op, "op", op)
    return str(kind).rsplit(".", 1)[-1]


def device_of(tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
    for t in tensors:
        if t.device.type == "neuron":
            return "neuron", t.device.index or 0
    return "cpu", 0


# ---------------------------------------------------------------------------------------------
# the NeuronLink model, once per distinct call
# ---------------------------------------------------------------------------------------------


def multistream() -> bool:
    """NxD's multistream collectives (``NEURON_NXD_FSDP_CC_MULTISTREAM=1``; JAX's
    ``NEURON_FSDP_CC_MULTISTREAM=1``): CC stream 0 carries TP collectives, stream 1 FSDP/DP
    (Neuron SDK ``neuron-runtime/explore/compute-comm-overlap.rst``). Off, the runtime's default:
    one CC stream per core, so a rank's collectives run one after another."""
    return any(os.environ.get(k, "").strip() == "1"
               for k in ("NEURON_NXD_FSDP_CC_MULTISTREAM", "NEURON_FSDP_CC_MULTISTREAM"))


def cc_lane(group: Sequence[int]) -> int:
    """The CC stream a collective on ``group`` runs on: 0, or with :func:`multistream` 1 for a
    data-parallel group (NxD numbers TP groups as consecutive ranks and DP groups strided by the
    TP size: a group whose ranks are not consecutive is DP/FSDP)."""
    if not multistream() or not group:
        return 0
    return 0 if max(group) - min(group) + 1 == len(group) else 1


class _Clock:
    """Simulated collectives, cached: a call on its group is the same from any start (all ranks
    start together, at the latest arrival), so it is simulated once from tick 0. An SPMD program
    makes the same call on every sibling group at once (a 2D mesh's other TP groups, or other DP
    groups: :func:`trnsim.collectives.sibling_groups` in the world), so a collective call is
    simulated beside its siblings' on the links, HBM stacks and DMA engines they share, and alone
    too: the report's ``shared`` column is the ratio (point-to-point calls run alone). With
    :func:`multistream`, a call that starts while this rank's call of the other CC stream runs
    (a TP all-reduce beside the DP reduce-scatter) is simulated beside that one and its siblings
    too, from when each started (the running call's own time is the one placed already)."""

    def __init__(self) -> None:
        self.reports: dict[tuple[Any, ...], CollectiveReport] = {}
        self.alone: dict[int, CollectiveReport] = {}  # id(report beside its siblings) -> the call alone
        self.costs: dict[tuple[Any, ...], Any] = {}
        self.trace = False
        self.placed: list[tuple[str, int, CollectiveReport]] = []  # (op, start tick, report) while tracing
        #: this rank's collectives placed, by CC stream: (lane, collective, bytes, group, dtype,
        #: root, start, end) while they may still run when the next one starts
        self.running: list[tuple[int, str, int, tuple[int, ...], str, int | None, int, int]] = []
        self.lock = threading.Lock()

    def note(self, lane: int, collective: str, nbytes: int, group: tuple[int, ...], dtype: str, root: int | None,
             start: int, end: int) -> None:
        """A collective placed on CC stream ``lane`` from ``start`` to ``end`` (for the calls
        that start beside it)."""
        self.running = [x for x in self.running if x[7] > start] + [(lane, collective, nbytes, group, dtype, root,
                                                                      start, end)]

    def report(self, collective: str, nbytes: int, group: tuple[int, ...], dtype: str, root: int | None,
               pairs: tuple[tuple[int, int], ...] | None, start: int = 0, lane: int = 0) -> CollectiveReport:
        world = int(world_size() or (max(group) + 1))
        beside = () if pairs is not None else tuple(
            (c, nb, g, dt, rt, start - s0) for ln, c, nb, g, dt, rt, s0, e0 in self.running
            if ln != lane and s0 <= start < e0)
        key = (collective, nbytes, group, dtype, root, pairs, self.trace, world, beside)
        rep = self.reports.get(key)
        if rep is None:
            alone = None
            try:
                if pairs is None:  # a collective: beside its sibling groups' same call (and another stream's)
                    rep, alone = simulate_with_siblings(system(), collective, nbytes, group, world, dtype=dtype,
                                                        root=root, trace=self.trace, beside=beside)
                else:
                    rep = simulate_collective(system(), collective, nbytes, group=group, dtype=dtype, root=root,
                                              pairs=pairs, trace=self.trace)
            except CollectiveError as e:
                raise NeuronDistError(f"neuron backend: {e}") from None
            with self.lock:
                if len(self.reports) > 4096:
                    self.reports.clear()
                    self.costs.clear()
                    self.alone.clear()
                self.reports[key] = rep
                if alone is not None and alone is not rep:
                    self.alone[id(rep)] = alone
        return rep

    def cost(self, rep: CollectiveReport, rank: int) -> Any:
        key = (id(rep), rank)
        c = self.costs.get(key)
        if c is None:
            c = self.costs[key] = runtime().device.collective_cost(rep, rank, self.alone.get(id(rep)))
        return c


CLOCK = _Clock()


def enable_trace(on: bool = True) -> None:
    """Keep every collective's NeuronLink timeline (links and CC DMA queues) for a trace."""
    CLOCK.trace = on


def collective_log() -> list[tuple[str, int, CollectiveReport]]:
    """The collectives this process placed while tracing: (op, start tick, report simulated
    from tick 0)."""
    return list(CLOCK.placed)


# ---------------------------------------------------------------------------------------------
# steps (the optimizer's), for the step time the slowest rank saw
# ---------------------------------------------------------------------------------------------

_steps: list[int] = []
_step_depth = [0]


def _step_pre(opt: Any, args: Any, kwargs: Any) -> None:
    _step_depth[0] += 1


def _on_device(opt: Any) -> bool:
    """Whether ``opt`` updates parameters on the neuron device: a script's CPU optimizer (a
    reference copy of the model, say) steps nothing the device runs."""
    return any(getattr(p, "device", None) is not None and p.device.type == "neuron"
               for g in getattr(opt, "param_groups", ()) for p in g.get("params", ()))


def _step_post(opt: Any, args: Any, kwargs: Any) -> None:
    _step_depth[0] -= 1
    # ZeroRedundancyOptimizer steps an inner optimizer: the outer step is the one counted
    if _step_depth[0] == 0 and runtime_started() and _on_device(opt):
        _steps.append(runtime().device.now())


def runtime_started() -> bool:
    from ..runtime import is_initialized

    return is_initialized()


_hooked = [False]


def record_steps() -> None:
    """Record the tick every optimizer step of this process ends at (idempotent)."""
    if not _hooked[0]:
        _optim.register_optimizer_step_pre_hook(_step_pre)
        _optim.register_optimizer_step_post_hook(_step_post)
        _hooked[0] = True


def step_ticks() -> list[int]:
    """The simulated tick each optimizer step of this process ended (all its work issued so
    far finished), in order."""
    return list(_steps)
