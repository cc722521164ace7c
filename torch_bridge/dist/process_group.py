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

import hashlib
import json
import queue
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from trnsim.config import is_system_key

from .. import _torch
from ..eager.memory import cpu_view
from ..runtime import runtime
from .clock import (CLOCK, REDUCE_CODES, Call, cc_lane, collective_log, device_of, enable_trace, record_steps, reduce_name,
                    runtime_started, shapes_text, sim_dtype, step_ticks, tensor_bytes)
from .fsdp import patch_fsdp
from .work import Work, note_backward
from .world import (DEFAULT_SYSTEM, NeuronDistError, config_fingerprint, exited_peers, group_store, group_timeout,
                    join, joined, mark_exit, parse_seconds, rank_info, set_system, system)

__all__ = ["BACKEND", "DEFAULT_SYSTEM", "NeuronDistError", "NeuronProcessGroup", "register", "set_system",
           "system", "rank_info", "collective_log", "step_ticks", "enable_trace",
           "create_process_group", "mark_exit", "record_steps", "parse_seconds", "runtime_started"]

BACKEND = "neuron"
_HEADER = 12  # int64 fields of the arrival header (see _Header)
_MAGIC = 0x7E5E


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)




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


def _desc(call: Call, seq: int, fingerprint: str) -> dict[str, Any]:
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
        self._threads: list[threading.Thread] = []  # their workers
        self._splits = 0  # the groups split from this one so far (split_group)
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
        """Stop the point-to-point workers and let their gloo works go before gloo shuts down
        (a send/recv's work outliving it aborted the process at exit: "terminate called without
        an active exception", found by a distributed values hunt)."""
        with self._lock:
            peers, self._peers = self._peers, {}
            threads, self._threads = self._threads, []
        for q in peers.values():
            q.put(None)
        for t in threads:  # (a worker still waiting on a send or recv its peer never matched is
            t.join(timeout=_JOIN_S)  # freed by gloo's shutdown below)
        self._pending = []
        self.gloo.shutdown()
        for t in threads:
            t.join(timeout=_JOIN_S)

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
        with self._lock:  # every rank of this group makes every split, in the same order
            self._splits += 1
            nth = self._splits
        if self._rank not in members:
            return None
        name = group_name or f"{self._group_name}:split:{','.join(map(str, members))}"
        # the members meet under a key every one of them computes alike: torch's name for the group
        # hashes in how many groups the rank knows, which differs between ranks after a group that
        # left some out (two members waited under different keys for ever; a distributed hunt)
        store = dist.PrefixStore(f"neuron_split/{nth}/{','.join(map(str, members))}/", self.group_store)
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
        self._fp = config_fingerprint()
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

    def _exchange(self, call: Call, arrival: int) -> list[_Header]:
        """Tell the group this rank's call and arrival, check that the ranks agree, and return
        every rank's header (in group order)."""
        if not self._fp:
            self._fp = config_fingerprint()
        with self._lock:
            self._seq += 1
            seq = self._seq
        desc = _desc(call, seq, self._fp)
        mine = (_MAGIC, seq, _hash(call.op), 1 if call.device == "neuron" else 0, _hash(str(call.dtype)),
                _hash(call.signature), call.root, REDUCE_CODES.get(call.reduce, -1), arrival, _hash(self._fp), call.nbytes,
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

    def _disagree(self, call: Call, seq: int, desc: dict[str, Any]) -> None:
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

    def _wait_gloo(self, work: Any, call: Call | str, seq: int | None = None) -> None:
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
            exited = exited_peers(self.store, [r for r in self.ranks if r != self.global_rank])
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
    def _collective(self, call: Call, run: Callable[[], Sequence[Any]], result: Any, keep: Any,
                    finish: Callable[[], None] | None = None, host_waits: bool = False,
                    check: Callable[[int], None] | None = None) -> Work:
        """``check(seq)``: more agreement to check once the ranks agree on the call (the headers
        exchanged), before gloo moves any data."""
        dev = runtime().device if call.device == "neuron" else None
        lane = cc_lane(self.ranks) if call.pairs is None else 0
        arrival = dev.issue_collective(call.core, lane=lane) if dev is not None else 0
        try:
            heads = self._exchange(call, arrival)
            if check is not None:
                check(heads[0].fields[1])
        except BaseException:
            if dev is not None:
                dev.cancel_collective(call.core, arrival)
            raise
        end = None
        if dev is not None:
            start = max(h.arrival for h in heads)
            root = self.ranks[call.root] if call.root >= 0 else None
            nbytes = max(h.nbytes for h in heads) if call.uneven else call.nbytes
            dt = sim_dtype(call.dtype)
            rep = CLOCK.report(call.collective, nbytes, self.ranks, dt, root, call.pairs, start, lane)
            _, end = dev.place_collective(call.core, call.op, CLOCK.cost(rep, self.global_rank), start, arrival, lane)
            CLOCK.note(lane, call.collective, nbytes, self.ranks, dt, root, start, end)
            if CLOCK.trace:
                CLOCK.placed.append((call.op, start, rep))
        work = Work(self, call, run(), result, keep, finish, end, host_waits=host_waits)
        note_backward(work)
        return work

    def _root(self, op: str, root: int) -> int:
        """A rooted collective's root: a rank of the group, or gloo's own refusal in one line (an
        index past the group's ranks was an IndexError traceback; found by a hardening hunt)."""
        if not 0 <= root < self._size:
            raise ValueError(f"ProcessGroupGloo::{op}: invalid root rank: {root} (the group's ranks are "
                             f"0..{self._size - 1})")
        return root

    def _call(self, op: str, collective: str, tensors: Sequence[torch.Tensor], nbytes: int, signature: str,
              root: int = -1, reduce: str = "", pairs: tuple[tuple[int, int], ...] | None = None) -> Call:
        device, core = device_of(tensors)
        dtype = tensors[0].dtype if tensors else None
        return Call(op, collective, nbytes, dtype, signature, device, core, root, reduce, pairs)

    # ---- reductions gloo lacks -------------------------------------------------------------
    def _reduce_opts(self, opts: Any, views: Sequence[torch.Tensor], cls: Any) -> tuple[Any, Callable[[], None] | None]:
        """Gloo options for ``opts.reduceOp`` and what to do after: AVG is SUM then a division,
        PREMUL_SUM a multiplication (now, on the views) then SUM."""
        red = opts.reduceOp
        name = reduce_name(red)
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
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.AllreduceOptions()
        call = self._call("all_reduce", "all-reduce", tensors, tensor_bytes(tensors), shapes_text(tensors),
                          reduce=reduce_name(opts.reduceOp))
        views = [cpu_view(t) for t in tensors]

        def run() -> list[Any]:
            g, _ = gopts
            return [self.gloo.allreduce(views, g)]
        gopts = self._reduce_opts(opts, views, dist.AllreduceOptions)
        return self._collective(call, run, tensors, (tensors, views), gopts[1])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        call = self._call("all_reduce_coalesced", "all-reduce", tensors, tensor_bytes(tensors), shapes_text(tensors),
                          reduce=reduce_name(opts.reduceOp))
        views = [cpu_view(t) for t in tensors]
        g, finish = self._reduce_opts(opts, views, dist.AllreduceCoalescedOptions)
        return self._collective(call, lambda: [self.gloo.allreduce_coalesced(views, g)], tensors, (tensors, views),
                                finish)

    # ---- broadcast -------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.BroadcastOptions()
        call = self._call("broadcast", "broadcast", tensors, tensor_bytes(tensors), shapes_text(tensors),
                          root=self._root("broadcast", opts.rootRank))
        views = [cpu_view(t) for t in tensors]
        return self._collective(call, lambda: [self.gloo.broadcast(views, opts)], tensors, (tensors, views))

    # ---- all-gather ------------------------------------------------------------------------
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Work:
        opts = opts or dist.AllgatherOptions()
        outs = [o for lst in output_tensors for o in lst]
        call = self._call("all_gather", "all-gather", input_tensors, tensor_bytes(input_tensors) * self._size,
                          f"{shapes_text(input_tensors)} into {len(output_tensors[0]) if output_tensors else 0}")
        ins = [cpu_view(t) for t in input_tensors]
        out_views = [[cpu_view(o) for o in lst] for lst in output_tensors]
        return self._collective(call, lambda: [self.gloo.allgather(out_views, ins, opts)], output_tensors,
                                (outs, input_tensors, ins, out_views))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> Work:
        opts = opts or dist.AllgatherOptions()
        call = self._call("all_gather_coalesced", "all-gather", input_list, tensor_bytes(input_list) * self._size,
                          shapes_text(input_list))
        ins = [cpu_view(t) for t in input_list]
        out_views = [[cpu_view(o) for o in lst] for lst in output_lists]
        return self._collective(call, lambda: [self.gloo.allgather_coalesced(out_views, ins, opts)], output_lists,
                                (output_lists, input_list, ins, out_views))

    def _gather_into(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Work:
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self._size:
                raise NeuronDistError(f"neuron backend: {op} on ranks {list(self.ranks)}: the output has {o.numel()} "
                                      f"elements; expected the input's {i.numel()} x {self._size} ranks")
        call = self._call(op, "all-gather", inputs, tensor_bytes(inputs) * self._size, shapes_text(inputs))
        pairs = [(cpu_view(o), cpu_view(i)) for o, i in zip(outputs, inputs)]
        return self._collective(call, lambda: [self.gloo._allgather_base(o, i, opts) for o, i in pairs], outputs,
                                (outputs, inputs, pairs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._gather_into("all_gather_into_tensor", [output], [input], opts or dist.AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        return self._gather_into("all_gather_into_tensor_coalesced", outputs, inputs, opts or dist.AllgatherOptions())

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    # ---- reduce-scatter --------------------------------------------------------------------
    def _scatter_reduced(self, op: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Work:
        """Reduce-scatter by value: gloo all-reduces a host copy of each input (it has no
        reduce-scatter on every build) and this rank's chunk is copied out; the simulated cost
        is a reduce-scatter's."""
        for o, i in zip(outputs, inputs):
            if o.numel() * self._size != i.numel():
                raise NeuronDistError(f"neuron backend: {op} on ranks {list(self.ranks)}: the input has {i.numel()} "
                                      f"elements; expected the output's {o.numel()} x {self._size} ranks")
        call = self._call(op, "reduce-scatter", inputs, tensor_bytes(inputs), shapes_text(inputs),
                          reduce=reduce_name(opts.reduceOp))
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

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self._scatter_reduced("reduce_scatter_tensor", [output], [input], opts or dist.ReduceScatterOptions())

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        return self._scatter_reduced("reduce_scatter_tensor_coalesced", outputs, inputs,
                                     opts or dist.ReduceScatterOptions())

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> Work:
        opts = opts or dist.ReduceScatterOptions()
        flat_inputs = [torch.cat([cpu_view(t).reshape(-1) for t in lst]) for lst in input_lists]
        shapes = [shapes_text(lst) for lst in input_lists]
        call = self._call("reduce_scatter", "reduce-scatter", [t for lst in input_lists for t in lst],
                          sum(tensor_bytes(lst) for lst in input_lists), "; ".join(shapes),
                          reduce=reduce_name(opts.reduceOp))
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
                          input_split_sizes: list[int], opts: Any = None) -> Work:
        opts = opts or dist.AllToAllOptions()
        # the splits differ across ranks by design: only dtype, trailing dims and counts must agree
        sig = f"{str(input.dtype).replace('torch.', '')}[*, {', '.join(map(str, input.shape[1:]))}]"
        call = self._call("all_to_all_single", "all-to-all", [input], tensor_bytes([input]), sig)
        call.uneven = True
        o, i = cpu_view(output), cpu_view(input)
        return self._collective(call, lambda: [self.gloo.alltoall_base(o, i, list(output_split_sizes),
                                                                      list(input_split_sizes), opts)],
                                [output], (output, input, o, i),
                                check=lambda seq: self._check_splits(call, seq, output, input, output_split_sizes,
                                                                     input_split_sizes))

    def _check_splits(self, call: Call, seq: int, output: torch.Tensor | None, input: torch.Tensor | None,
                      output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], unit: str = "rows",
                      hint: str = "each rank's output_split_sizes must be what the others' input_split_sizes "
                                  "send it") -> None:
        """Every rank's splits (an all-gather, once the ranks agree they are at this call): rank
        r's output split for rank j must be rank j's input split for rank r. gloo met splits that
        disagree by aborting the process in C++ (~30 lines and a thread dump; found by a hardening
        hunt); every rank raises the same line instead."""
        n = self._size
        if n == 1:
            return  # (no peer to disagree with: gloo checks the split count)
        ins = list(input_split_sizes) or [input.shape[0] // n if input.dim() else 0] * n
        outs = list(output_split_sizes) or [output.shape[0] // n if output.dim() else 0] * n
        # every rank all-gathers, whatever its splits (one that skipped it would leave the others'
        # all-gather to meet gloo's all-to-all); a wrong split count goes as [-1, inputs, outputs]
        counted = len(ins) == len(outs) == n
        mine = torch.tensor(ins + outs if counted else [-1, len(ins), len(outs)] + [0] * (2 * n - 3), dtype=torch.int64)
        every = [torch.zeros(2 * n, dtype=torch.int64) for _ in range(n)]
        self._wait_gloo(self.gloo.allgather([every], [mine]), call, seq)
        rows = [e.tolist() for e in every]
        where = f"neuron backend: {call.op} #{seq} on ranks {list(self.ranks)}"
        for rank, row in zip(self.ranks, rows):
            if row[0] < 0:
                raise NeuronDistError(f"{where}: rank {rank} gives {row[1]} input splits and {row[2]} output splits; "
                                      f"each rank gives one of each per rank of the group ({n})")
        for r in range(n):
            for j in range(n):
                sent, expected = rows[j][r], rows[r][n + j]
                if sent != expected:
                    raise NeuronDistError(
                        f"{where}: rank {self.ranks[j]} sends {sent} {unit} to rank {self.ranks[r]}, which expects "
                        f"{expected}; {hint}")

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        opts = opts or dist.AllToAllOptions()
        n = self._size
        if len(input_tensors) != n or len(output_tensors) != n:
            raise NeuronDistError(f"neuron backend: all_to_all on ranks {list(self.ranks)}: {len(input_tensors)} input "
                                  f"and {len(output_tensors)} output tensors; give one of each per rank of the group "
                                  f"({n})")
        dtypes = {t.dtype for t in (*input_tensors, *output_tensors)}
        if len(dtypes) > 1:
            raise NeuronDistError(f"neuron backend: all_to_all on ranks {list(self.ranks)}: tensors of "
                                  f"{', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}; every input "
                                  f"and output tensor must have one dtype")
        dtype = input_tensors[0].dtype
        sig = f"{len(input_tensors)} {str(dtype).replace('torch.', '')} tensors"
        call = self._call("all_to_all", "all-to-all", input_tensors, tensor_bytes(input_tensors), sig)
        call.uneven = True
        flat_in = torch.cat([cpu_view(t).reshape(-1) for t in input_tensors])
        out_sizes = [t.numel() for t in output_tensors]
        flat_out = torch.empty(sum(out_sizes), dtype=dtype)
        outs = [cpu_view(t) for t in output_tensors]

        def done() -> None:
            for o, part in zip(outs, flat_out.split(out_sizes)):
                o.copy_(part.view_as(o))
        in_sizes = [t.numel() for t in input_tensors]
        # (each rank's sizes, once the ranks agree on the call: a receiver's tensor larger than what
        # its peer sent kept uninitialised elements, a smaller one aborted the process in gloo)
        return self._collective(call, lambda: [self.gloo.alltoall_base(flat_out, flat_in, out_sizes, in_sizes, opts)],
                                output_tensors, (output_tensors, input_tensors, flat_in, flat_out, outs), done,
                                check=lambda seq: self._check_splits(
                                    call, seq, None, None, out_sizes, in_sizes, "elements",
                                    "each rank's output_tensor_list[j] must hold as many elements as rank j's "
                                    "input_tensor_list sends it"))

    # ---- rooted: scatter, gather, reduce ---------------------------------------------------
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Work:
        opts = opts or dist.ScatterOptions()
        root = self._root("scatter", opts.rootRank)
        g = self.ranks
        # two ranks: the root's one send. More: timed as the gather of the same bytes, mirrored. The
        # network's permute takes one send per rank (a root sending to two was refused: scatter
        # failed on 3 ranks and more), and NeuronLink's links carry the same bandwidth each way,
        # so the root's sends take the time its receives would
        others = [r for r in g if r != g[root]]
        pairs = tuple((g[root], r) if len(others) == 1 else (r, g[root]) for r in others)
        call = self._call("scatter", "permute", output_tensors, tensor_bytes(output_tensors), shapes_text(output_tensors),
                          root=root, pairs=pairs)
        outs = [cpu_view(t) for t in output_tensors]
        ins = [[cpu_view(t) for t in lst] for lst in input_tensors]
        return self._collective(call, lambda: [self.gloo.scatter(outs, ins, opts)], output_tensors,
                                (output_tensors, input_tensors, outs, ins))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> Work:
        opts = opts or dist.GatherOptions()
        root = self._root("gather", opts.rootRank)
        g = self.ranks
        call = self._call("gather", "permute", input_tensors, tensor_bytes(input_tensors), shapes_text(input_tensors),
                          root=root, pairs=tuple((r, g[root]) for r in g if r != g[root]))
        ins = [cpu_view(t) for t in input_tensors]
        outs = [[cpu_view(t) for t in lst] for lst in output_tensors]
        return self._collective(call, lambda: [self.gloo.gather(outs, ins, opts)], output_tensors,
                                (output_tensors, input_tensors, outs, ins))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts or dist.ReduceOptions()
        call = self._call("reduce", "reduce", tensors, tensor_bytes(tensors), shapes_text(tensors),
                          root=self._root("reduce", opts.rootRank),
                          reduce=reduce_name(opts.reduceOp))
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
    def barrier(self, opts: Any = None) -> Work:
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
        call = Call("barrier", "all-reduce", 4, torch.float32, "", "neuron", core)
        return self._collective(call, lambda: [], None, (), host_waits=True)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # ---- point to point --------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        raise NeuronDistError(f"neuron backend: recv from any source is not supported on ranks {list(self.ranks)}: "
                              f"name the source rank (src=...)")

    def _p2p(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> Work:
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
        call = self._call(kind, "send-recv", tensors, tensor_bytes(tensors), shapes_text(tensors))
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
            rep = CLOCK.report("send-recv", call.nbytes, (gsrc, gdst), sim_dtype(call.dtype), None, ((gsrc, gdst),))
            _, end = dev.place_collective(call.core, kind, CLOCK.cost(rep, self.global_rank), start, arrival)
            if CLOCK.trace:
                CLOCK.placed.append((kind, start, rep))
            return end, [task.data]

        return Work(self, call, [], tensors, task, resolve=resolve, futures=False)

    def _p2p_queue(self, peer: int) -> "queue.Queue[_P2P | None]":
        """The worker of one peer: it takes that peer's calls in issue order (gloo matches a
        pair's messages in order), waits for the peer's header, checks it and posts the data."""
        with self._lock:
            q = self._peers.get(peer)
            if q is None:
                q = self._peers[peer] = queue.Queue()
                t = threading.Thread(target=self._p2p_worker, args=(peer, q), daemon=True,
                                     name=f"neuron-p2p-{self.global_rank}-{self.ranks[peer]}")
                t.start()
                self._threads.append(t)
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


_JOIN_S = 5.0  # how long shutdown waits for a point-to-point worker to finish its calls

_P2P_DIMS = 8  # dims a point-to-point header carries (for the message when the two sides differ)


def _p2p_header(arrival: int, call: Call, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
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

    def __init__(self, kind: str, gsrc: int, gdst: int, peer: int, tag: int, call: Call, views: list[torch.Tensor],
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
# registration
# ---------------------------------------------------------------------------------------------


def create_process_group(opts: Any, backend_options: Any = None) -> NeuronProcessGroup:
    """The creator torch calls for each group (extended API: it names the group's global ranks)."""
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    sysc = system()
    if not joined():
        world = len(ranks)
        if world > sysc.ranks:
            raise NeuronDistError(
                f"neuron backend: world size {world} does not fit {sysc.name}: it has {sysc.ranks} ranks "
                f"({sysc.chips} chips x {sysc.ranks_per_chip} logical NeuronCores); use fewer ranks or a larger "
                f"system (TRNSIM_SYSTEM, trnsim run --system)")
        join(dict(rank=ranks[opts.group_rank], world=world, system=sysc.name, config=runtime().config.name,
                  chip=ranks[opts.group_rank] // sysc.ranks_per_chip), opts.store)
        patch_fsdp()
        record_steps()
    pg = NeuronProcessGroup(opts.store, opts.group_rank, opts.group_size, group_timeout(opts.timeout), ranks,
                            opts.group_id)
    pg.store = group_store(opts.store)
    pg.check_config()
    return pg


def register() -> None:
    """Register the ``neuron`` backend for the ``neuron`` device (idempotent): it is then in
    torch's device-to-backend table, so ``init_process_group()`` and ``init_device_mesh("neuron")``
    choose it. (The device's autoload registers it too, without importing this module.)"""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create_process_group, extended_api=True, devices=["neuron"])
