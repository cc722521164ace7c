"""The ``neuron`` process-group backend: torch.distributed across virtual NeuronCores.

``dist.init_process_group("neuron")`` (or ``init_process_group()`` on a machine whose
accelerator is neuron, or ``init_device_mesh("neuron", ...)``) under ``torchrun`` gives one rank
per process. Rank r is logical NeuronCore r of the system (``TRNSIM_SYSTEM`` or
:func:`set_system`; default trn2.48xlarge): chip r // cores per chip. Each rank computes on
``neuron:0`` of its own process and carries its NeuronCore identity as rank metadata (autograd
on ``neuron:1``+ in one process needs the conformance work first).

Values and time take separate paths (DESIGN.md):

* **Values** move through an inner gloo group over zero-copy CPU views of the device tensors
  (:func:`torch_bridge.memory.cpu_view`): every collective and point-to-point call DDP, FSDP2,
  DTensor, pipelining and ZeroRedundancyOptimizer make, sync and async, coalesced, the
  ``_base``/``_single`` variants, barrier, and the object collectives built on them. Gloo has
  no AVG and no PREMUL_SUM: they are a SUM with the scaling before or after, on the views.
* **Time.** At a collective every rank issues it on its core (the host pays the dispatch; the
  collective waits for the compute issued before it on the current stream: its *arrival*), the
  ranks exchange their arrival ticks together with what they called (op, shapes, dtype, root,
  reduce op, config), and the collective starts at the latest arrival. The NeuronLink model
  (:func:`trnsim.collectives.simulate_collective`, the same call ``trnsim collective`` makes)
  gives each rank's completion for that group, size and algorithm, simulated beside the same
  call of the group's siblings in the world (an SPMD step's other TP or DP groups, which share
  its links, HBM stacks and DMA engines; the report's ``shared`` column is the slowdown against
  the call alone); the device model puts it on
  the core's collective stream (:meth:`trnsim.device.Device.place_collective`), where it
  overlaps the compute issued after it and shares the core's DMA with it. ``Work.wait()`` (and
  a future's ``wait()``) makes the *current stream* wait for it, as a CUDA stream waits for
  NCCL's; a collective issued inside a backward pass and never waited (DDP's bucketed
  all-reduce, whose future C++ waits on) is waited for by the current stream at the end of that
  backward. ``barrier`` also makes the host wait. Point-to-point calls (send/recv) exchange
  their arrivals with the peer without blocking and are placed when waited for. Collectives on
  CPU tensors move values and take no simulated time (host memory is not on NeuronLink).
  Everything is deterministic: the same script on the same ranks gives the same ticks.
* **Bad use fails on every rank with one line and no hang**: a world the system cannot hold,
  ranks on different configs, a collective whose ranks disagree (shapes, dtypes, ops, roots,
  order) - found in the exchange, before gloo sees mismatched buffers - and a peer that never
  arrives (the group's timeout names the rank, the collective and the peers that exited).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import re
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.optim.optimizer as _optim

from trnsim.collectives import CollectiveError, CollectiveReport, simulate_collective, simulate_with_siblings
from trnsim.config import ConfigError, SystemConfig, is_system_key, load_system

from .. import _torch
from ..eager.memory import cpu_view
from ..runtime import runtime

__all__ = ["BACKEND", "DEFAULT_SYSTEM", "NeuronDistError", "NeuronProcessGroup", "register", "set_system",
           "system", "rank_info", "collective_log", "step_ticks", "enable_trace",
           "create_process_group", "mark_exit", "record_steps", "parse_seconds"]

BACKEND = "neuron"
DEFAULT_SYSTEM = "trn2.48xlarge"
_HEADER = 12  # int64 fields of the arrival header (see _Header)
_MAGIC = 0x7E5E


class NeuronDistError(dist.DistError):
    """A distributed call that cannot go on as written: the message is one line and names the
    rank, the call and what was expected. Every rank of the group raises it together."""


# ---------------------------------------------------------------------------------------------
# the system and this process's place in it
# ---------------------------------------------------------------------------------------------


_state_lock = threading.RLock()
_requested_system: SystemConfig | None = None
_system: SystemConfig | None = None


def set_system(name_or_path: str | os.PathLike[str] | SystemConfig,
               overrides: Sequence[str] = ()) -> SystemConfig:
    """Choose the system the ranks run on (a name such as ``trn2-ultraserver``, a YAML path or a
    SystemConfig, with dotted ``topology.``/``collectives.`` overrides) before the first process
    group; ``TRNSIM_SYSTEM`` does the same from the environment."""
    global _requested_system
    with _state_lock:
        if _system is not None:
            raise RuntimeError(f"neuron backend: the system is already {_system.name}; call set_system before "
                               f"init_process_group")
        sysc = load_system(name_or_path, list(overrides))  # a bad name fails here
        _requested_system = sysc
        return sysc


def system() -> SystemConfig:
    """The system the ranks run on, built on the neuron device's chip config (its overrides
    included). Its chip must be the device's: a trn2 system cannot hold trn3 NeuronCores."""
    global _system
    with _state_lock:
        if _system is not None:
            return _system
        cfg = runtime().config
        base: SystemConfig | str = _requested_system or os.environ.get("TRNSIM_SYSTEM", "").strip() or DEFAULT_SYSTEM
        chip_overrides = [f"{k}={v}" for k, v in cfg.overrides if not is_system_key(k)]
        try:
            sysc = load_system(base, chip_overrides)
        except ConfigError as e:
            raise NeuronDistError(f"neuron backend: {e}") from None
        if sysc.chip.name != cfg.name:
            raise NeuronDistError(
                f"neuron backend: the system {sysc.name} is built of {sysc.chip.name} chips, but this rank's neuron "
                f"device runs {cfg.name}: choose a {cfg.name} system (TRNSIM_SYSTEM) or the {sysc.chip.name} chip "
                f"(TRNSIM_CONFIG)")
        _system = sysc
        return sysc


def _fingerprint() -> str:
    """What every rank must agree on: the chip config and the system, overrides included."""
    cfg, sysc = runtime().config, system()
    return json.dumps([cfg.name, list(map(list, cfg.overrides)), sysc.name, list(map(list, sysc.overrides))])


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


# ---------------------------------------------------------------------------------------------
# what a call moves, as the NeuronLink model names it
# ---------------------------------------------------------------------------------------------

_SIM_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "uint8",
               torch.int8: "int8", torch.int16: "int16", torch.int32: "int32"}
_BY_SIZE = {1: "uint8", 2: "bf16", 4: "fp32", 8: "fp32", 16: "fp32"}  # bytes move alike; wider as 4-byte words


def _sim_dtype(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "fp32"
    return _SIM_DTYPES.get(dtype) or _BY_SIZE.get(torch.empty((), dtype=dtype).element_size(), "uint8")


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(map(str, t.shape))}]"


def _shapes(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(_shape(t) for t in tensors) or "nothing"


@dataclass
class _Call:
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


_RED = {"SUM": 0, "AVG": 1, "PRODUCT": 2, "MIN": 3, "MAX": 4, "BAND": 5, "BOR": 6, "BXOR": 7, "PREMUL_SUM": 8}


def _reduce_name(op: Any) -> str:
    kind = getattr(op, "op", op)
    return str(kind).rsplit(".", 1)[-1]


def _device_of(tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
    for t in tensors:
        if t.device.type == "neuron":
            return "neuron", t.device.index or 0
    return "cpu", 0


# ---------------------------------------------------------------------------------------------
# the NeuronLink model, once per distinct call
# ---------------------------------------------------------------------------------------------


class _Clock:
    """Simulated collectives, cached: a call on its group is the same from any start (all ranks
    start together, at the latest arrival), so it is simulated once from tick 0. An SPMD program
    makes the same call on every sibling group at once (a 2D mesh's other TP groups, or other DP
    groups: :func:`trnsim.collectives.sibling_groups` in the world), so a collective call is
    simulated beside its siblings' on the links, HBM stacks and DMA engines they share, and alone
    too: the report's ``shared`` column is the ratio (point-to-point calls run alone)."""

    def __init__(self) -> None:
        self.reports: dict[tuple[Any, ...], CollectiveReport] = {}
        self.alone: dict[int, CollectiveReport] = {}  # id(report beside its siblings) -> the call alone
        self.costs: dict[tuple[Any, ...], Any] = {}
        self.trace = False
        self.placed: list[tuple[str, int, CollectiveReport]] = []  # (op, start tick, report) while tracing
        self.lock = threading.Lock()

    def report(self, collective: str, nbytes: int, group: tuple[int, ...], dtype: str, root: int | None,
               pairs: tuple[tuple[int, int], ...] | None) -> CollectiveReport:
        world = int(_info.get("world") or (max(group) + 1))
        key = (collective, nbytes, group, dtype, root, pairs, self.trace, world)
        rep = self.reports.get(key)
        if rep is None:
            alone = None
            try:
                if pairs is None:  # a collective: beside its sibling groups' same call
                    rep, alone = simulate_with_siblings(system(), collective, nbytes, group, world, dtype=dtype,
                                                        root=root, trace=self.trace)
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


_clock = _Clock()


def enable_trace(on: bool = True) -> None:
    """Keep every collective's NeuronLink timeline (links and CC DMA queues) for a trace."""
    _clock.trace = on


def collective_log() -> list[tuple[str, int, CollectiveReport]]:
    """The collectives this process placed while tracing: (op, start tick, report simulated
    from tick 0)."""
    return list(_clock.placed)


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


# ---------------------------------------------------------------------------------------------
# Work and futures
# ---------------------------------------------------------------------------------------------


class _Future(torch.futures.Future):  # type: ignore[misc]
    """A Work's future: waiting on it from Python makes the current stream wait for the
    collective, as ``Work.wait()`` does (C++ callers wait on the value only)."""

    def __init__(self, work: "_Work"):
        super().__init__()
        self._work = weakref.ref(work)

    def wait(self) -> Any:  # type: ignore[override]
        w = self._work()
        if w is not None:
            w._resolve()
            w._order()
        return super().wait()


_WorkBase = _torch.work_base()


class _Work(_WorkBase):  # type: ignore[misc, valid-type]
    """One call's Work: the gloo works moving its values, the CPU views they use (kept alive:
    a view does not own its memory), a ``finish`` run once when the values are in (AVG's
    division, copying a reduce-scatter's chunk out), and where the call ends on the rank's
    timeline (None: no simulated time, a CPU call). A point-to-point call's timing is resolved
    when waited for (``resolve``), once its peer's arrival is in."""

    def __init__(self, pg: "NeuronProcessGroup", call: _Call, inner: Sequence[Any], result: Any, keep: Any,
                 finish: Callable[[], None] | None = None, end: int | None = None,
                 resolve: Callable[[], tuple[int | None, list[Any]]] | None = None, host_waits: bool = False,
                 futures: bool = True):
        super().__init__()
        self.pg = pg
        self.call = call
        self.inner = list(inner)
        self.result_value = result
        self.keep = keep
        self.finish = finish
        self.end = end
        self.resolver = resolve
        self.host_waits = host_waits
        self.waited = False
        self._done = False
        self._lock = threading.Lock()
        self.fut = _Future(self)
        if not self.inner and resolve is None:
            self._complete()
        elif futures:
            try:
                futs = [w.get_future() for w in self.inner]
            except RuntimeError:  # gloo's send/recv works have no future: completed on wait()
                futs = None
            if futs is not None:
                torch.futures.collect_all(futs).then(self._on_inner)

    def _on_inner(self, fut: Any) -> None:
        try:
            for f in fut.value():
                f.value()
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
            if not self.fut.done():
                self.fut.set_exception(e)
            return
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self.finish is not None:
            self.finish()
        if not self.fut.done():
            self.fut.set_result(self.result_value)

    def _resolve(self) -> None:
        """Place a point-to-point call on the timeline (its peer's arrival is needed first)."""
        if self.resolver is not None:
            resolve, self.resolver = self.resolver, None
            self.end, inner = resolve()
            self.inner.extend(inner)

    def _order(self) -> None:
        """The current stream (and for a barrier the host) waits for the call's end."""
        if self.end is None or self.waited:
            return
        self.waited = True
        dev = runtime().device
        core = self.call.core
        dev.stream_wait(core, dev.cores[core].current_stream, self.end)
        if self.host_waits:
            dev.wait_host_until(self.end)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._resolve()
        for w in self.inner:
            self.pg._wait_gloo(w, self.call)
        self._complete()
        self._order()
        if self.fut.done():
            self.fut.value()  # an error in the values' path surfaces here
        return True

    def is_completed(self) -> bool:
        return self._done or (self.resolver is None and all(w.is_completed() for w in self.inner))

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def result(self) -> Any:
        return self.result_value

    def source_rank(self) -> int:
        return self.call.root

    def synchronize(self) -> None:
        self.wait()


# collectives issued inside a backward pass, per graph task, waited for at its end
_backward_works: dict[int, list[_Work]] = {}


def _after_backward(task: int) -> None:
    for w in _backward_works.pop(task, []):
        if not w.waited and w.end is not None:
            dev = runtime().device
            dev.stream_wait(w.call.core, dev.cores[w.call.core].current_stream, w.end)


def _note_backward(work: _Work) -> None:
    task = _torch.graph_task_id()
    if task < 0 or work.end is None:
        return
    works = _backward_works.get(task)
    if works is None:
        works = _backward_works[task] = []
        _torch.at_end_of_backward(lambda: _after_backward(task))
    works.append(work)


# ---------------------------------------------------------------------------------------------
# the process group
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Header:
    """What a rank tells its group at a collective (one int64 each): magic, sequence number,
    op, device, dtype, signature hash, root, reduce op, arrival tick, config hash, bytes and the
    length of its description (sent only when the group disagrees)."""

    fields: tuple[int, ...]

    @property
    def arrival(self) -> int:
        return self.fields[8]

    @property
    def nbytes(self) -> int:
        return self.fields[10]

    def agreement(self, with_bytes: bool = True) -> tuple[int, ...]:
        f = self.fields
        return f[:8] + f[9:10] + (f[10:11] if with_bytes else ())


def _desc(call: _Call, seq: int, fingerprint: str) -> dict[str, Any]:
    return {"op": call.op, "seq": seq, "device": call.device, "signature": call.signature, "root": call.root,
            "reduce": call.reduce, "config": fingerprint}


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _by_value(values: dict[int, str]) -> str:
    """``{rank: value}`` as 'rank 0 has X, ranks 1, 2 have Y' (ranks that agree listed together)."""
    groups: dict[str, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(v, []).append(r)
    return ", ".join(f"{_ranks_text(rs)} {v}" for v, rs in groups.items())


class NeuronProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """The ``neuron`` backend's process group (a Python ProcessGroup: torch 2.13 lets Python
    subclass ProcessGroup, not the C++ Backend). ``ranks`` are the group's global ranks: the
    NeuronCores its collectives run on."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, ranks: Sequence[int] | None = None,
                 name: str = ""):
        super().__init__(rank, size)
        gloo_cls = _torch.gloo_process_group()
        opts = gloo_cls._Options()
        opts._timeout = timeout
        opts._devices = [gloo_cls.create_default_device()]
        self.gloo = gloo_cls(dist.PrefixStore("neuron_gloo", store), rank, size, opts)
        self.group_store = store  # the store torch made this group with (groups split from it nest under it)
        self.store = store
        self.timeout = timeout
        self._rank = rank
        self._size = size
        self.ranks = tuple(ranks) if ranks else tuple(range(size))
        self.global_rank = self.ranks[rank]
        self._group_name = name
        self._group_desc = ""
        self._seq = 0
        self._lock = threading.RLock()
        self._fp = ""
        self._peers: dict[int, queue.Queue[_P2P | None]] = {}
        self._pending: list[_P2P] = []

    # ---- identity (the trampolined methods C++ calls) ------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def abort(self) -> None:
        self.gloo.abort()

    def shutdown(self) -> None:
        for q in self._peers.values():
            q.put(None)
        self.gloo.shutdown()

    def __repr__(self) -> str:
        return f"<NeuronProcessGroup rank {self._rank} of ranks {list(self.ranks)}>"

    # ---- the group as the neuron device's backend ----------------------------------------------
    # torch asks a group for the backend that serves a device (``_get_backend``) wherever a device
    # is bound to it, as ``init_process_group(device_id=torch.device("neuron:0"))`` does for cuda and
    # nccl: it connects that backend eagerly (which binds the group: ``bound_device_id``), and with
    # a bound default group it splits later groups (``new_group``, a DeviceMesh's dimensions) from
    # it. torch 2.13 cannot put a Python backend under a group (a Python class cannot subclass the
    # C++ Backend), and this group serves neuron tensors itself, so for the neuron device it is its
    # own backend: connecting binds it (gloo connected when the group was made), and splitting
    # makes a neuron group of the given ranks, as the creator makes any other.
    supports_splitting = True
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False
    options = None  # split_group copies the parent backend's options (this backend has none)

    def _get_backend(self, device: Any) -> Any:
        if torch.device(device).type == "neuron":
            return self
        return super()._get_backend(device)

    def eager_connect_single_device(self, device: Any) -> None:
        self.bound_device_id = torch.device(device)

    def perform_nocolor_split(self, device: Any) -> None:
        """A rank outside a group being split off makes nothing (only a group's members connect)."""

    def _set_sequence_number_for_group(self) -> None:
        """Collectives are numbered per group from its first call (``_exchange``): nothing to agree on."""

    def get_group_store(self) -> Any:
        return self.group_store

    def split_group(self, ranks: Sequence[int], timeout: timedelta | None = None, opts: Any = None,
                    group_name: str | None = None, group_desc: str | None = None, device_types: Any = None
                    ) -> "NeuronProcessGroup | None":
        """The group of this group's ``ranks`` (group ranks) that contains this rank, or None for
        a rank outside it; every member calls it (``torch.distributed.split_group``)."""
        members = sorted(int(r) for r in ranks)
        if self._rank not in members:
            return None
        name = group_name or f"{self._group_name}:split:{','.join(map(str, members))}"
        store = dist.PrefixStore(f"neuron_split/{name}/", self.group_store)
        pg = NeuronProcessGroup(store, members.index(self._rank), len(members), timeout or self.timeout,
                                [self.ranks[r] for r in members], name)
        pg.store = self.store
        if group_desc:
            pg.setGroupDesc(group_desc)
        pg.check_config()
        return pg

    # ---- the exchange ----------------------------------------------------------------------
    def check_config(self) -> None:
        """Every rank runs the same chip config and system (checked when the group is made)."""
        self._fp = _fingerprint()
        descs = self._allgather_text(self._fp, "init_process_group")
        if len(set(descs)) > 1:
            shown = {}
            for r, d in zip(self.ranks, descs):
                cfg, over, sysn, sover = json.loads(d)
                extra = ", ".join(f"{k}={v}" for k, v in over + [kv for kv in sover if is_system_key(kv[0])])
                shown[r] = f"runs {cfg} on {sysn}" + (f" ({extra})" if extra else "")
            raise NeuronDistError(f"neuron backend: ranks run different configs: {_by_value(shown)}; every rank must "
                                  f"simulate the same chip and system (set TRNSIM_CONFIG and TRNSIM_SYSTEM alike)")

    def _allgather_text(self, text: str, what: str) -> list[str]:
        """Every rank's ``text`` (two gloo all-gathers: lengths, then the padded bytes)."""
        data = text.encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        self._wait_gloo(self.gloo.allgather([lens], [n]), what)
        width = max(int(x.item()) for x in lens)
        buf = torch.zeros(max(1, width), dtype=torch.uint8)
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        outs = [torch.zeros_like(buf) for _ in range(self._size)]
        self._wait_gloo(self.gloo.allgather([outs], [buf]), what)
        return [bytes(o[:int(n_.item())].tolist()).decode() for o, n_ in zip(outs, lens)]

    def _exchange(self, call: _Call, arrival: int) -> list[_Header]:
        """Tell the group this rank's call and arrival, check that the ranks agree, and return
        every rank's header (in group order)."""
        if not self._fp:
            self._fp = _fingerprint()
        with self._lock:
            self._seq += 1
            seq = self._seq
        desc = _desc(call, seq, self._fp)
        mine = (_MAGIC, seq, _hash(call.op), 1 if call.device == "neuron" else 0, _hash(str(call.dtype)),
                _hash(call.signature), call.root, _RED.get(call.reduce, -1), arrival, _hash(self._fp), call.nbytes,
                len(json.dumps(desc)))
        if self._size == 1:
            return [_Header(mine)]
        hdr = torch.tensor(mine, dtype=torch.int64)
        outs = [torch.zeros(_HEADER, dtype=torch.int64) for _ in range(self._size)]
        self._wait_gloo(self.gloo.allgather([outs], [hdr]), call, seq)
        heads = [_Header(tuple(int(v) for v in o.tolist())) for o in outs]
        if len({h.agreement(not call.uneven) for h in heads}) > 1:
            self._disagree(call, seq, desc)
        return heads

    def _disagree(self, call: _Call, seq: int, desc: dict[str, Any]) -> None:
        """The group's headers differ: exchange the descriptions and raise the same error on
        every rank, naming what differs."""
        texts = self._allgather_text(json.dumps(desc), call.op)
        descs = {r: json.loads(t) for r, t in zip(self.ranks, texts)}
        where = f"neuron backend: {call.op} #{seq} on ranks {list(self.ranks)}"

        def differs(key: str) -> bool:
            return len({json.dumps(d[key]) for d in descs.values()}) > 1

        if differs("seq"):
            msg = (f"the ranks are at different calls: {_by_value({r: 'at #' + str(d['seq']) for r, d in descs.items()})}; "
                   f"a rank skipped a collective or made an extra one")
        elif differs("op"):
            msg = (f"the ranks made different calls: {_by_value({r: d['op'] for r, d in descs.items()})}; every rank "
                   f"of a group must make the same collectives in the same order")
        elif differs("config"):
            msg = "the ranks run different configs; every rank must simulate the same chip and system"
        elif differs("device"):
            msg = (f"the ranks passed tensors on different devices: "
                   f"{_by_value({r: d['device'] for r, d in descs.items()})}")
        elif differs("signature"):
            msg = (f"the tensors differ across ranks: {_by_value({r: 'has ' + d['signature'] for r, d in descs.items()})}"
                   f"; every rank must pass tensors of the same shapes and dtypes")
        elif differs("root"):
            msg = (f"the ranks name different roots: "
                   f"{_by_value({r: 'names ' + str(d['root']) for r, d in descs.items()})}")
        else:
            msg = (f"the ranks use different reduce ops: "
                   f"{_by_value({r: d['reduce'] or '-' for r, d in descs.items()})}")
        raise NeuronDistError(f"{where}: {msg}")

    def _wait_gloo(self, work: Any, call: _Call | str, seq: int | None = None) -> None:
        """Wait for a gloo work; its failures become one line naming this rank and the call."""
        try:
            work.wait()
        except NeuronDistError:
            raise
        except RuntimeError as e:
            what = call if isinstance(call, str) else call.op
            if seq is not None:
                what += f" #{seq}"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's [source file:line] prefix
            first = first.split(". ")[0].rstrip(".")  # its first sentence
            exited = _exited_peers(self.store, [r for r in self.ranks if r != self.global_rank])
            timed_out = "timed out" in first.lower() or "timeout" in first.lower()
            why = f"timed out after {self.timeout.total_seconds():g} s waiting for its peers" if timed_out else "failed"
            if exited:
                peers = "; " + _by_value({r: how for r, how in exited.items()})
            elif timed_out:
                peers = "; the other ranks did not arrive (stuck before this call, or in another one)"
            else:
                peers = ""
            raise NeuronDistError(f"neuron backend: rank {self.global_rank} {why} in {what} on ranks "
                                  f"{list(self.ranks)}{peers} (gloo: {first[:200]})") from None

    # ---- the common path of a collective ---------------------------------------------------
    def _collective(self, call: _Call, run: Callable[[], Sequence[Any]], result: Any, keep: Any,
                    finish: Callable[[], None] | None = None, host_waits: bool = False) -> _Work:
        dev = runtime().device if call.device == "neuron" else None
        arrival = dev.issue_collective(call.core) if dev is not None else 0
        try:
            heads = self._exchange(call, arrival)
        except BaseException:
            if dev is not None:
                dev.cancel_collective(call.core, arrival)
            raise
        end = None
        if dev is not None:
            start = max(h.arrival for h in heads)
            root = self.ranks[call.root] if call.root >= 0 else None
            nbytes = max(h.nbytes for h in heads) if call.uneven else call.nbytes
            rep = _clock.report(call.collective, nbytes, self.ranks, _sim_dtype(call.dtype), root, call.pairs)
            _, end = dev.place_collective(call.core, call.op, _clock.cost(rep, self.global_rank), start, arrival)
            if _clock.trace:
                _clock.placed.append((call.op, start, rep))
        work = _Work(self, call, run(), result, keep, finish, end, host_waits=host_waits)
        _note_backward(work)
        return work

    def _call(self, op: str, collective: str, tensors: Sequence[torch.Tensor], nbytes: int, signature: str,
              root: int = -1, reduce: str = "", pairs: tuple[tuple[int, int], ...] | None = None) -> _Call:
        device, core = _device_of(tensors)
        dtype = tensors[0].dtype if tensors else None
        return _Call(op, collective, nbytes, dtype, signature, device, core, root, reduce, pairs)

    # ---- reductions gloo lacks -------------------------------------------------------------
    def _reduce_opts(self, opts: Any, views: Sequence[torch.Tensor], cls: Any) -> tuple[Any, Callable[[], None] | None]:
        """Gloo options for ``opts.reduceOp`` and what to do after: AVG is SUM then a division,
        PREMUL_SUM a multiplication (now, on the views) then SUM."""
        red = opts.reduceOp
        name = _reduce_name(red)
        out = cls()
        out.timeout = opts.timeout
        if name == "AVG":
            out.reduceOp = dist.ReduceOp.SUM
            size = self._size

            def divide() -> None:
                for v in views:
                    if v.is_floating_point() or v.is_complex():
                        v.div_(size)
                    else:
                        v.floor_divide_(size)
            return out, divide
        if name == "PREMUL_SUM":
            factor = red.factor
            for v in views:
                v.mul_(factor.item() if isinstance(factor, torch.Tensor) else factor)
            out.reduceOp = dist.ReduceOp.SUM
            return out, None
        out.reduceOp = red
        return out, None

    # ---- all-reduce ------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts or dist.AllreduceOptions()
        call = self._call("all_reduce", "all-reduce", tensors, _nbytes(tensors), _shapes(tensors),
                          reduce=_reduce_name(opts.reduceOp))
        views = [cpu_view(t) for t in tensors]

        def run() -> list[Any]:
            g, _ = gopts
            return [self.gloo.allreduce(views, g)]
        gopts = self._reduce_opts(opts, views, dist.AllreduceOptions)
        return self._collective(call, run, tensors, (tensors, views), gopts[1])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        call = self._call("all_reduce_coalesced", "all-reduce", tensors, _nbytes(tensors), _shapes(tensors),
                          reduce=_reduce_name(opts.reduceOp))
        views = [cpu_view(t) for t in tensors]
        g, finish = self._reduce_opts(opts, views, dist.AllreduceCoalescedOptions)
        return self._collective(call, lambda: [self.gloo.allreduce_coalesced(views, g)], tensors, (tensors, views),
                                finish)

    # ---- broadcast -------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts or dist.BroadcastOptions()
        call = self._call("broadcast", "broadcast", tensors, _nbytes(tensors), _shapes(tensors), root=opts.rootRank)
        views = [cpu_view(t) for t in tensors]
        return self._collective(call, lambda: [self.gloo.broadcast(views, opts)], tensors, (tensors, views))

    # ---- all-gather ------------------------------------------------------------------------
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> _Work:
        opts = opts or dist.AllgatherOptions()
        outs = [o for lst in output_tensors for o in lst]
        call = self._call("all_gather", "all-gather", input_tensors, _nbytes(input_tensors) * self._size,
                          f"{_shapes(input_tensors)} into {len(output_tensors[0]) if output_tensors else 0}")
        ins = [cpu_view(t) for t in input_tensors]
        out_views = [[cpu_view(o) for o in lst] for lst in output_tensors]
        return self._collective(call, lambda: [self.gloo.allgather(out_views, ins, opts)], output_tensors,
                                (outs, input_tensors, ins, out_views))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> _Work:
        opts = opts or dist.AllgatherOptions()
        call = self._call("all_gather_coalesced", "all-gather", input_list, _nbytes(input_list) * self._size,
                          _shapes(input_list))
        ins = [cpu_view(t) for t in input_list]
        out_views = [[cpu_view(o) for o in lst] for lst in output_lists]
        return self._collective(call, lambda: [self.gloo.allgather_coalesced(out_views, ins, opts)], output_lists,
                                (output_lists, input_list, ins, out_views))

    def _gather_into(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> _Work:
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self._size:
                raise NeuronDistError(f"neuron backend: {op} on ranks {list(self.ranks)}: the output has {o.numel()} "
                                      f"elements; expected the input's {i.numel()} x {self._size} ranks")
        call = self._call(op, "all-gather", inputs, _nbytes(inputs) * self._size, _shapes(inputs))
        pairs = [(cpu_view(o), cpu_view(i)) for o, i in zip(outputs, inputs)]
        return self._collective(call, lambda: [self.gloo._allgather_base(o, i, opts) for o, i in pairs], outputs,
                                (outputs, inputs, pairs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._gather_into("all_gather_into_tensor", [output], [input], opts or dist.AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        return self._gather_into("all_gather_into_tensor_coalesced", outputs, inputs, opts or dist.AllgatherOptions())

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> _Work:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    # ---- reduce-scatter --------------------------------------------------------------------
    def _scatter_reduced(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> _Work:
        """Reduce-scatter by value: gloo all-reduces a host copy of each input (it has no
        reduce-scatter on every build) and this rank's chunk is copied out; the simulated cost
        is a reduce-scatter's."""
        for o, i in zip(outputs, inputs):
            if o.numel() * self._size != i.numel():
                raise NeuronDistError(f"neuron backend: {op} on ranks {list(self.ranks)}: the input has {i.numel()} "
                                      f"elements; expected the output's {o.numel()} x {self._size} ranks")
        call = self._call(op, "reduce-scatter", inputs, _nbytes(inputs), _shapes(inputs),
                          reduce=_reduce_name(opts.reduceOp))
        copies = [cpu_view(i).clone() for i in inputs]
        g, finish = self._reduce_opts(opts, copies, dist.AllreduceOptions)
        outs = [cpu_view(o) for o in outputs]
        me = self._rank

        def done() -> None:
            if finish is not None:
                finish()
            for o, c in zip(outs, copies):
                o.copy_(c.reshape(-1).chunk(self._size)[me].view_as(o))
        return self._collective(call, lambda: [self.gloo.allreduce([c], g) for c in copies], outputs,
                                (outputs, inputs, copies, outs), done)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._scatter_reduced("reduce_scatter_tensor", [output], [input], opts or dist.ReduceScatterOptions())

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        return self._scatter_reduced("reduce_scatter_tensor_coalesced", outputs, inputs,
                                     opts or dist.ReduceScatterOptions())

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:
        opts = opts or dist.ReduceScatterOptions()
        flat_inputs = [torch.cat([cpu_view(t).reshape(-1) for t in lst]) for lst in input_lists]
        shapes = [_shapes(lst) for lst in input_lists]
        call = self._call("reduce_scatter", "reduce-scatter", [t for lst in input_lists for t in lst],
                          sum(_nbytes(lst) for lst in input_lists), "; ".join(shapes),
                          reduce=_reduce_name(opts.reduceOp))
        g, finish = self._reduce_opts(opts, flat_inputs, dist.AllreduceOptions)
        outs = [cpu_view(o) for o in output_tensors]
        me = self._rank

        def done() -> None:
            if finish is not None:
                finish()
            for k, (o, lst) in enumerate(zip(outs, input_lists)):
                sizes = [t.numel() for t in lst]
                o.copy_(flat_inputs[k].split(sizes)[me].view_as(o))
        return self._collective(call, lambda: [self.gloo.allreduce([f], g) for f in flat_inputs], output_tensors,
                                (output_tensors, input_lists, flat_inputs, outs), done)

    # ---- all-to-all ------------------------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> _Work:
        opts = opts or dist.AllToAllOptions()
        # the splits differ across ranks by design: only dtype, trailing dims and counts must agree
        sig = f"{str(input.dtype).replace('torch.', '')}[*, {', '.join(map(str, input.shape[1:]))}]"
        call = self._call("all_to_all_single", "all-to-all", [input], _nbytes([input]), sig)
        call.uneven = True
        o, i = cpu_view(output), cpu_view(input)
        return self._collective(call, lambda: [self.gloo.alltoall_base(o, i, list(output_split_sizes),
                                                                      list(input_split_sizes), opts)],
                                [output], (output, input, o, i))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> _Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> _Work:
        opts = opts or dist.AllToAllOptions()
        dtype = input_tensors[0].dtype
        sig = f"{len(input_tensors)} {str(dtype).replace('torch.', '')} tensors"
        call = self._call("all_to_all", "all-to-all", input_tensors, _nbytes(input_tensors), sig)
        call.uneven = True
        flat_in = torch.cat([cpu_view(t).reshape(-1) for t in input_tensors])
        out_sizes = [t.numel() for t in output_tensors]
        flat_out = torch.empty(sum(out_sizes), dtype=dtype)
        outs = [cpu_view(t) for t in output_tensors]

        def done() -> None:
            for o, part in zip(outs, flat_out.split(out_sizes)):
                o.copy_(part.view_as(o))
        return self._collective(call, lambda: [self.gloo.alltoall_base(flat_out, flat_in, out_sizes,
                                                                      [t.numel() for t in input_tensors], opts)],
                                output_tensors, (output_tensors, input_tensors, flat_in, flat_out, outs), done)

    # ---- rooted: scatter, gather, reduce ---------------------------------------------------
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> _Work:
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        g = self.ranks
        call = self._call("scatter", "permute", output_tensors, _nbytes(output_tensors), _shapes(output_tensors),
                          root=root, pairs=tuple((g[root], r) for r in g if r != g[root]))
        outs = [cpu_view(t) for t in output_tensors]
        ins = [[cpu_view(t) for t in lst] for lst in input_tensors]
        return self._collective(call, lambda: [self.gloo.scatter(outs, ins, opts)], output_tensors,
                                (output_tensors, input_tensors, outs, ins))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> _Work:
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        g = self.ranks
        call = self._call("gather", "permute", input_tensors, _nbytes(input_tensors), _shapes(input_tensors),
                          root=root, pairs=tuple((r, g[root]) for r in g if r != g[root]))
        ins = [cpu_view(t) for t in input_tensors]
        outs = [[cpu_view(t) for t in lst] for lst in output_tensors]
        return self._collective(call, lambda: [self.gloo.gather(outs, ins, opts)], output_tensors,
                                (output_tensors, input_tensors, outs, ins))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts or dist.ReduceOptions()
        call = self._call("reduce", "reduce", tensors, _nbytes(tensors), _shapes(tensors), root=opts.rootRank,
                          reduce=_reduce_name(opts.reduceOp))
        views = [cpu_view(t) for t in tensors]
        g, finish = self._reduce_opts(opts, views, dist.ReduceOptions)
        g.rootRank = opts.rootRank
        g.rootTensor = opts.rootTensor
        me = self._rank

        def done() -> None:
            if finish is not None and me == opts.rootRank:
                finish()
        return self._collective(call, lambda: [self.gloo.reduce(views, g)], tensors, (tensors, views), done)

    # ---- barrier ---------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> _Work:
        """Every rank waits for the last (the exchange of arrivals is itself the barrier), and
        the NeuronLink model times it as a 4-byte all-reduce; the host waits for it too."""
        opts = opts or dist.BarrierOptions()
        ids = list(getattr(opts, "device_ids", []) or [])
        count = runtime().device_count
        bad = [i for i in ids if not 0 <= i < count]
        if bad:
            raise NeuronDistError(f"neuron backend: barrier(device_ids={ids}): neuron:{bad[0]} does not exist "
                                  f"(this rank has neuron:0..neuron:{count - 1})")
        core = ids[0] if ids else 0
        call = _Call("barrier", "all-reduce", 4, torch.float32, "", "neuron", core)
        return self._collective(call, lambda: [], None, (), host_waits=True)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # ---- point to point --------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise NeuronDistError(f"neuron backend: recv from any source is not supported on ranks {list(self.ranks)}: "
                              f"name the source rank (src=...)")

    def _p2p(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        """A send or recv. The two ranks swap headers (arrival, dtype, shape) on control tags,
        never blocking the caller, so a batch of sends and recvs in any order cannot deadlock;
        the peer's worker thread moves the data through gloo once the headers agree (gloo
        aborts the process on a message larger than the buffer posted for it). When waited
        for, the call is placed on the timeline at the later arrival, timed by the NeuronLink
        model as a send-recv."""
        if not 0 <= peer < self._size or peer == self._rank:
            raise NeuronDistError(f"neuron backend: {kind} on ranks {list(self.ranks)}: peer {peer} is not another "
                                  f"rank of the group (0..{self._size - 1})")
        src, dst = (self._rank, peer) if kind == "send" else (peer, self._rank)
        gsrc, gdst = self.ranks[src], self.ranks[dst]
        call = self._call(kind, "send-recv", tensors, _nbytes(tensors), _shapes(tensors))
        dev = runtime().device if call.device == "neuron" else None
        arrival = dev.issue_collective(call.core) if dev is not None else 0
        task = _P2P(kind, gsrc, gdst, self.ranks[peer], int(tag), call, [cpu_view(t) for t in tensors], tensors,
                    _p2p_header(arrival, call, tensors))
        base = (1 << 24) + 2 * int(tag)  # control tags: headers src -> dst on base, replies dst -> src on base + 1
        if kind == "send":
            task.ctl = [self.gloo.send([task.mine], peer, base), self.gloo.recv([task.theirs], peer, base + 1)]
        else:
            task.ctl = [self.gloo.recv([task.theirs], peer, base), self.gloo.send([task.mine], peer, base + 1)]
        self._p2p_queue(peer).put(task)

        def resolve() -> tuple[int | None, list[Any]]:
            task.done.wait()
            if task.error is not None:
                if dev is not None:
                    dev.cancel_collective(call.core, arrival)
                raise task.error
            if dev is None:
                return None, [task.data]
            start = max(arrival, int(task.theirs[1]))
            rep = _clock.report("send-recv", call.nbytes, (gsrc, gdst), _sim_dtype(call.dtype), None, ((gsrc, gdst),))
            _, end = dev.place_collective(call.core, kind, _clock.cost(rep, self.global_rank), start, arrival)
            if _clock.trace:
                _clock.placed.append((kind, start, rep))
            return end, [task.data]

        return _Work(self, call, [], tensors, task, resolve=resolve, futures=False)

    def _p2p_queue(self, peer: int) -> "queue.Queue[_P2P | None]":
        """The worker of one peer: it takes that peer's calls in issue order (gloo matches a
        pair's messages in order), waits for the peer's header, checks it and posts the data."""
        with self._lock:
            q = self._peers.get(peer)
            if q is None:
                q = self._peers[peer] = queue.Queue()
                threading.Thread(target=self._p2p_worker, args=(peer, q), daemon=True,
                                 name=f"neuron-p2p-{self.global_rank}-{self.ranks[peer]}").start()
            return q

    def _p2p_worker(self, peer: int, q: "queue.Queue[_P2P | None]") -> None:
        while True:
            task = q.get()
            if task is None:
                return
            try:
                what = f"{task.kind} {'to' if task.kind == 'send' else 'from'} rank {task.peer}"
                for w in task.ctl:
                    self._wait_gloo(w, what)
                task.check(self.global_rank)
                views, tag = task.views, task.tag
                task.data = self.gloo.send(views, peer, tag) if task.kind == "send" else self.gloo.recv(views, peer, tag)
                self._pending = [p for p in self._pending if not p.data.is_completed()] + [task]  # buffers alive
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                task.error = e
            finally:
                task.done.set()


_P2P_DIMS = 8  # dims a point-to-point header carries (for the message when the two sides differ)


def _p2p_header(arrival: int, call: _Call, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    t = tensors[0] if tensors else None
    dims = list(t.shape)[:_P2P_DIMS] if t is not None else []
    code = _DTYPE_CODES.get(t.dtype, 0) if t is not None else 0
    head = [_MAGIC, arrival, _hash(call.signature), call.nbytes, 1 if call.device == "neuron" else 0, code,
            len(dims), len(tensors)] + dims + [0] * (_P2P_DIMS - len(dims))
    return torch.tensor(head, dtype=torch.int64)


_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                  torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                  torch.bool, torch.complex64))}


def _header_shape(head: Sequence[int]) -> str:
    name = next((str(dt).replace("torch.", "") for dt, c in _DTYPE_CODES.items() if c == head[5]), "?")
    text = f"{name}[{', '.join(str(int(d)) for d in head[8:8 + int(head[6])])}]"
    return text if head[7] <= 1 else f"{text} and {int(head[7]) - 1} more"


class _P2P:
    """One send or recv in flight: its headers, control works, data work and outcome."""

    def __init__(self, kind: str, gsrc: int, gdst: int, peer: int, tag: int, call: _Call, views: list[torch.Tensor],
                 tensors: list[torch.Tensor], mine: torch.Tensor):
        self.kind, self.gsrc, self.gdst, self.peer, self.tag = kind, gsrc, gdst, peer, tag
        self.call, self.views, self.tensors = call, views, tensors
        self.mine = mine
        self.theirs = torch.zeros_like(mine)
        self.ctl: list[Any] = []
        self.data: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def check(self, me: int) -> None:
        """Both sides see both headers and raise the same complaint when they differ."""
        a, b = self.mine.tolist(), self.theirs.tolist()
        if a[2] == b[2] and a[4] == b[4]:
            return
        send, recv = (a, b) if self.kind == "send" else (b, a)
        where = ("neuron", "CPU")
        what = (f"rank {self.gsrc} sends {_header_shape(send)} ({send[3]} bytes{', on ' + where[1 - send[4]] if send[4] != recv[4] else ''}) "
                f"but rank {self.gdst} receives into {_header_shape(recv)} ({recv[3]} bytes"
                f"{', on ' + where[1 - recv[4]] if send[4] != recv[4] else ''})")
        raise NeuronDistError(f"neuron backend: send from rank {self.gsrc} to rank {self.gdst}: {what}; both must "
                              f"name tensors of the same shapes and dtypes")


# ---------------------------------------------------------------------------------------------
# exits (so a waiting rank can say which peer is gone) and registration
# ---------------------------------------------------------------------------------------------

_stores: list[Any] = []


def _exit_key(rank: int) -> str:
    return f"trnsim/exited/{rank}"


def mark_exit(how: str = "exited") -> None:
    """Tell the other ranks this one is gone (``how``: "finished its script", "exited"), so a
    rank left waiting for it at a collective can name it."""
    rank = _info.get("rank")
    if rank is None:
        return
    for store in _stores:
        try:
            if not store.check([_exit_key(rank)]):
                store.set(_exit_key(rank), how)
        except Exception:  # noqa: BLE001 - the store may be gone at exit
            pass


def _exited_peers(store: Any, peers: Sequence[int]) -> dict[int, str]:
    gone: dict[int, str] = {}
    for r in peers:
        try:
            if store.check([_exit_key(r)]):
                gone[r] = store.get(_exit_key(r)).decode()
        except Exception:  # noqa: BLE001
            break
    return gone


_info: dict[str, Any] = {}


def rank_info() -> dict[str, Any]:
    """This process's rank, world size and system (empty before init_process_group)."""
    return dict(_info)


def parse_seconds(text: Any, what: str) -> float:
    """A timeout in seconds (a number > 0, as torchrun takes them); ValueError naming ``what``."""
    try:
        secs = float(text)
        if not 0 < secs < 1e9:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what} {text}: expected a number of seconds > 0") from None
    return secs


def _timeout(given: timedelta) -> timedelta:
    """The group's timeout: ``TRNSIM_DIST_TIMEOUT`` (seconds; ``trnsim run --timeout``) if set."""
    text = os.environ.get("TRNSIM_DIST_TIMEOUT", "").strip()
    if not text:
        return given
    try:
        return timedelta(seconds=parse_seconds(text, "TRNSIM_DIST_TIMEOUT="))
    except ValueError as e:
        raise NeuronDistError(f"neuron backend: {e}") from None


def create_process_group(opts: Any, backend_options: Any = None) -> NeuronProcessGroup:
    """The creator torch calls for each group (extended API: it names the group's global ranks)."""
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    sysc = system()
    if not _info:
        world = len(ranks)
        if world > sysc.ranks:
            raise NeuronDistError(
                f"neuron backend: world size {world} does not fit {sysc.name}: it has {sysc.ranks} ranks "
                f"({sysc.chips} chips x {sysc.ranks_per_chip} logical NeuronCores); use fewer ranks or a larger "
                f"system (TRNSIM_SYSTEM, trnsim run --system)")
        _info.update(rank=ranks[opts.group_rank], world=world, system=sysc.name, config=runtime().config.name,
                     chip=ranks[opts.group_rank] // sysc.ranks_per_chip)
        root = dist.PrefixStore("trnsim", opts.store)
        _stores.append(root)
        atexit.register(mark_exit)
        _patch_fsdp()
        record_steps()
    pg = NeuronProcessGroup(opts.store, opts.group_rank, opts.group_size, _timeout(opts.timeout), ranks, opts.group_id)
    pg.store = _stores[0] if _stores else opts.store
    pg.check_config()
    return pg


def register() -> None:
    """Register the ``neuron`` backend for the ``neuron`` device (idempotent): it is then in
    torch's device-to-backend table, so ``init_process_group()`` and ``init_device_mesh("neuron")``
    choose it. (The device's autoload registers it too, without importing this module.)"""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create_process_group, extended_api=True, devices=["neuron"])


# ---------------------------------------------------------------------------------------------
# FSDP2 on a device without storage resize
# ---------------------------------------------------------------------------------------------


def _resize_works() -> bool:
    t = torch.empty(1, device="neuron")
    try:
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4)
        return True
    except (NotImplementedError, RuntimeError):
        return False


def _patch_fsdp() -> None:
    """FSDP2 frees and re-allocates unsharded parameters by resizing their storage, which a
    Python PrivateUse1 device cannot do in torch 2.13: for neuron tensors the storage keeps its
    memory instead (the values are the same; the unsharded parameters stay counted in the
    device's memory). Nothing changes where the device can resize. FSDP is patched when it is
    imported (importing it takes seconds: a program without FSDP does not pay for it)."""
    if _resize_works():
        return
    from ..imports import after_import

    after_import(_torch.FSDP_PARAM_GROUP_MODULE, lambda _module: _patch_fsdp_now())


def _patch_fsdp_now() -> None:
    alloc, free = _torch.fsdp_storage()
    if getattr(alloc, "_neuron", False):
        return

    def alloc_storage(tensor: torch.Tensor) -> None:
        if tensor.device.type != "neuron":
            alloc(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.device.type != "neuron":
            free(tensor)

    alloc_storage._neuron = True  # type: ignore[attr-defined]
    _torch.patch_fsdp_storage(alloc_storage, free_storage)
