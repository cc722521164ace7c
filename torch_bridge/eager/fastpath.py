"""The native fast path of the `neuron` device's eager ops (``csrc/neuron.cpp``, "the fast path").

An eager op costs its host time in the boxed fallback's Python (:mod:`torch_bridge.values`):
converting arguments, relabelling the result, the cost lookup and the launch. For the common
case - an op whose tensors are all strided on one neuron device (or 0-dim host scalars), no
out=, no generator, a fresh result or self - the native kernel registered on PrivateUse1 does
all of it in C++: it runs the CPU kernel on CPU aliases of the arguments' memory, counts a fresh
result against HBM in the native ledger (the same counters ``torch.neuron.memory_stats`` reads)
and logs the launch of the op's cost, found by a signature key that Python taught it the first
time it costed that call. In-place ``_foreach_*`` ops (the optimizer's) are written-argument ops
like ``add_``: one CPU foreach kernel over the lists' aliases, one logged launch, nothing
allocated. float32 ``mm``/``addmm``/``bmm`` call trnsim's C datapath directly, with the arguments
:func:`trnsim.native.matmul` passes it (same values, same cost key as
:func:`torch_bridge.values.mm`'s), and so do float32 2-d convolutions (im2col matmuls, or the
grouped kernel for depthwise ones, as :func:`torch_bridge.tensore.conv_f32` calls them). View ops are redispatched to their CPU kernels on the neuron tensors
and logged as host ops. Everything else runs the Python fallback, registered on PrivateUse2 for
the fast kernel to redispatch to.

:class:`NativeLog` is the log as the device model sees it (:class:`trnsim.device.LaunchLog`): the
device takes the logged launches before it issues or reports anything, and issues each exactly
as :meth:`~trnsim.device.Device.launch` would have, so reports, traces and cycles are the same
with the fast path on or off. The device closes the log's gate while a launch would depend on
more than its op and cost (graph capture, adaptive eager, a launch context, another stream), and
the native side steps aside by itself while torch.profiler records or memory history is on, and
while torch.compile traces (a fake mode is on, or dynamo's TracingContext: :func:`torch_bridge._torch.watch_tracing`
tells it), so the kernels the compiler runs then are Python's, which charges none of them.

``TRNSIM_FASTPATH=0`` turns the fast path off (every op runs the Python fallback).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import os
import threading
from typing import Any, Iterator

from trnsim.device import OpCost

from .. import _torch

__all__ = ["NativeLog", "enabled", "set_enabled", "turned", "teach", "teach_many", "launch", "launch_kept", "handle",
           "launch_handle", "hits", "install",
           "attach", "datapath_seconds"]

_LOG_MAX = 1 << 15  # entries the native log holds (kLogMax)
_PLACE_IN, _PLACE_OUT, _PLACE_CORES = 16, 64, 64  # trnsim_log_place's rows (kPlaceIn, kPlaceOut) and its core limit
_ZEROS = (0,) * 8

_lock = threading.Lock()
_handles: dict[tuple[str, int], int] = {}  # (op, id(cost)) -> handle
_table: list[tuple[str, OpCost, tuple[str, int]]] = []  # handle -> (op, cost, row key); keeps each cost alive
_names: dict[int, str] = {}  # native name id -> op name (host ops)
_lib: Any = None
_on = False
_device: Any = None  # the device model the log feeds (attach)


def _handle(op: str, cost: OpCost) -> int:
    key = (op, id(cost))
    with _lock:
        h = _handles.get(key)
        if h is None:
            h = _handles[key] = len(_table)
            _table.append((op, cost, key))
            _lib.trnsim_fast_ticks(h, int(cost.ticks))  # (for the native placement: NativeLog.place)
        return h


class NativeLog:
    """The native launch log, for :meth:`trnsim.device.Device.attach_log`."""

    def __init__(self, lib: Any):
        self.lib = lib
        self._count = ctypes.c_int64.from_address(lib.trnsim_log_count_ptr())
        self._buf = (ctypes.c_int64 * (3 * _LOG_MAX))()
        self._io = (ctypes.c_int64 * (8 + _PLACE_IN * _PLACE_CORES))()
        self._cores_out = (ctypes.c_int64 * (_PLACE_OUT * _PLACE_CORES))()
        self._rows = (ctypes.c_int64 * (4 * _LOG_MAX))()
        self._hops = (ctypes.c_int64 * (2 * _LOG_MAX))()
        self._io_q, self._cores_q, self._rows_q, self._hops_q = (
            memoryview(b).cast("B").cast("q") for b in (self._io, self._cores_out, self._rows, self._hops))
        self._io_at, self._cores_at, self._rows_at, self._hops_at = (
            ctypes.addressof(b) for b in (self._io, self._cores_out, self._rows, self._hops))
        self._counts = (ctypes.c_int64 * 2)()  # take_captured's launches and host-op names
        self._counts_at = ctypes.addressof(self._counts)
        self._buf_q = memoryview(self._buf).cast("B").cast("q")
        self._buf_at = ctypes.addressof(self._buf)

    def pending(self) -> int:
        return self._count.value

    def place(self, host: int, dispatch: int, cores: list[tuple[bool, int, int, int, Any, int]]
              ) -> tuple[int, int, list[Any], list[Any], list[Any], int] | None:
        """Place the log's first launches natively (``trnsim_log_place``: the arithmetic of
        :meth:`trnsim.device.Device._drain`'s common case, for the entries up to the first it cannot
        take). ``cores``: per core (simple, max_inflight, ready of stream 0, busy_until, in-flight
        ends, the last open interval's end in any recorder, the last end of another stream's kernel
        it keeps, the latest ready tick of its other streams). Returns None when it took nothing, else
        (entries taken, the host's tick, per core used: (core, ready, busy_until, in-flight ends,
        launches, wait, ticks, last end, last host, ticks folded, open intervals, bookings, host
        dispatches, graph launches), the rows
        as (flat ints: handle, launches, ticks, wait per cost; the table whose entry ``handle`` is
        (op, cost, row key)), per host op: (name, count), the ticks the host waited for a core's
        work (item(): the log's waits, which are not dispatch time), the graph captures whose end
        (``close``) it took)."""
        if len(cores) > _PLACE_CORES:
            return None
        vals = [host, dispatch, len(cores), 0, 0, 0, 0, 0]
        for simple, max_inflight, ready, busy, inflight, last_open, others, ready_other in cores:
            n = len(inflight)
            if n > 8 or not simple:
                vals += (0, max_inflight, ready, busy, 0, 0, 0, 0, 0, 0, 0, 0, 0, last_open, 0, 0)
            else:
                vals += (1, max_inflight, ready, busy, n, *inflight, *_ZEROS[n:], last_open, others, ready_other)
        io = self._io_q
        io[:len(vals)] = array.array("q", vals)
        got = self.lib.trnsim_log_place(self._io_at, self._cores_at, self._rows_at, self._hops_at)
        if got <= 0:
            return None
        head = io[:8].tolist()
        table = _table
        out = self._cores_q
        used = []
        for k in range(head[3]):
            o = out[k * _PLACE_OUT:(k + 1) * _PLACE_OUT].tolist()
            core = o[0]
            b = 8 + core * _PLACE_IN
            st = io[b:b + _PLACE_IN].tolist()
            keep = [[o[8 + 2 * j], o[9 + 2 * j]] for j in range(o[7])]
            bookings = [(0, o[33 + 3 * j], o[34 + 3 * j], table[o[35 + 3 * j]][1].demand) for j in range(o[32])]
            used.append((core, st[2], st[3], st[5:5 + st[4]], o[1], o[2], o[3], o[4], o[5], o[6], keep, bookings,
                         o[60], o[61]))
        rows = self._rows_q[:4 * head[4]].tolist()  # (handle, launches, ticks, wait) per row: Recorder.defer_rows
        return got, head[0], used, (rows, table), self._host_ops(head[5]), head[6], head[7]

    def take_captured(self) -> tuple[list[tuple[int, int, str, OpCost]], list[tuple[str, int]]] | None:
        """The log's first entries while they are launches made inside a graph capture still open
        (a closed one's wait for its close) or host ops (``trnsim_log_take_captured``): (the
        launches in order as (capture token, core, op, cost), the host ops counted by name in
        first-use order), or None when the first entry is neither.
        Collecting the one kind and counting the other is all :meth:`trnsim.device.Device._drain`
        does with them, so it needs no loop over the entries' tuples (~1 us each) for them."""
        counts = self._counts
        if self.lib.trnsim_log_take_captured(self._buf_at, _LOG_MAX, self._hops_at, self._counts_at) <= 0:
            return None
        flat = self._buf_q[:3 * counts[0]].tolist()
        table = _table
        launches = [(flat[i + 2], flat[i], *table[flat[i + 1]][:2]) for i in range(0, len(flat), 3)]
        return launches, self._host_ops(counts[1])

    def _host_ops(self, n: int) -> list[tuple[str, int]]:
        """The first ``n`` (name id, count) pairs the native side wrote into the host-op buffer,
        as (name, count)."""
        hops = []
        if n:
            hv = self._hops_q[:2 * n].tolist()
            for j in range(0, len(hv), 2):
                ident = hv[j]
                name = _names.get(ident)
                if name is None:
                    name = _names[ident] = self.lib.trnsim_fast_name(ident).decode()
                hops.append((name, hv[j + 1]))
        return hops

    def take(self) -> Iterator[tuple[int, str, OpCost | None, Any, int]]:
        """The entries, oldest first, one at a time (a list of thousands of tuples would keep
        Python's garbage collector busy while the device issues them)."""
        n = self.lib.trnsim_log_take(self._buf, _LOG_MAX)
        flat = memoryview(self._buf).cast("B").cast("q")[:3 * n].tolist()
        table = _table
        for i in range(0, 3 * n, 3):
            kind = flat[i]
            if kind == -1:  # the host waits for the core's work (an item() served natively)
                yield flat[i + 1], None, None, None, 0
            elif kind == -2:  # graph capture flat[i + 1] ends here (close)
                yield -1, None, None, None, flat[i + 1]
            elif kind != 1:  # a launch: 0 issued, 2 + token collected by that graph capture
                op, cost, key = table[flat[i + 2]]
                yield flat[i + 1], op, cost, key, kind - 2 if kind else 0
            else:
                ident = flat[i + 2]
                name = _names.get(ident)
                if name is None:
                    name = _names[ident] = self.lib.trnsim_fast_name(ident).decode()
                yield 0, name, None, None, flat[i + 1]  # a host op (made inside capture flat[i + 1] where not 0)

    def gate(self, on: bool) -> None:
        self.lib.trnsim_fast_gate(int(on))

    def close(self, token: int, keep: bool = True) -> bool:
        """Capture ``token`` ends here (``trnsim_log_close``): its launches, all in the log, are
        issued where this entry stands (dropped where not ``keep``: a muted block's); False (nothing
        logged) when the log is full."""
        return bool(self.lib.trnsim_log_close(int(token), int(bool(keep))))

    def learning(self, token: int, on: bool) -> None:
        """Capture ``token`` learns its host ops (``Device.recorded``) while ``on``: the natively
        handled prefixes (:meth:`place`, :meth:`take_captured`) stop at them; any other capture's
        host ops count as made outside it, as Device._drain's loop counts them."""
        self.lib.trnsim_log_learning(int(token), int(bool(on)))

    def capture(self, token: int) -> None:
        self.lib.trnsim_fast_capture(int(token))


def install(lib: Any, names: list[str], screened: list[str]) -> None:
    """Register the native kernel (the PrivateUse1 fallback and ``names``' own kernels) once,
    leaving the ``screened`` overloads ("name.overload") to Python's path, which screens their
    arguments first (:func:`torch_bridge.eager.values.screened_overloads`)."""
    global _lib
    listed = "\0".join(screened).encode()
    lib.trnsim_fast_screen(listed, len(listed))  # (before any op is classified: classifications are kept)
    blob = "\0".join(names).encode()
    if lib.trnsim_fast_register(blob, len(blob)) != 0:
        raise RuntimeError("trnsim: registering the neuron device's native fast path failed")
    _lib = lib
    set_enabled(os.environ.get("TRNSIM_FASTPATH", "").strip() != "0")
    # kernels torch.compile runs while it traces are Python's (which charges none of them): the
    # native side cannot see dynamo's TracingContext, so it is told on entering and leaving it
    _torch.watch_tracing(lambda on: lib.trnsim_fast_tracing(int(on)))


def attach(device: Any, k_chunk: int) -> None:
    """Feed ``device`` (the eager :class:`trnsim.device.Device`) from the native log, and give the
    fast path's mm/addmm/bmm (float32, bfloat16, float16) the datapath (``k_chunk``: the chip's
    contraction rows per matmul instruction, as :mod:`torch_bridge.tensore` passes it)."""
    global _device
    if _lib is None:
        return
    _device = device
    device.attach_log(NativeLog(_lib))
    from trnsim import native

    try:
        address, (f32, f16, bf16), fma_on = native.batched_entry()
    except ImportError:  # the datapath is not built: the matmuls take Python's path (and its error)
        return
    _lib.trnsim_fast_datapath(address, f32, f16, bf16, fma_on, int(k_chunk))
    _lib.trnsim_fast_conv_datapath(native.grouped_entry())


def datapath_seconds() -> float:
    """Wall time the fast path's matmuls have spent in the datapath in this process (the training
    benchmark reports it beside :mod:`torch_bridge.tensore`'s)."""
    return _lib.trnsim_fast_datapath_ns() * 1e-9 if _lib is not None else 0.0


def enabled() -> bool:
    return _on


def set_enabled(on: bool) -> None:
    """Turn the fast path on or off (off: every op runs the Python fallback). Launches it logged
    are issued first."""
    global _on
    if _lib is None:
        return
    if _device is not None:
        _device.now()  # takes the log
    _on = bool(on)
    _lib.trnsim_fast_enable(int(_on))


@contextlib.contextmanager
def turned(on: bool) -> Iterator[None]:
    """The fast path on or off inside the block (:func:`set_enabled`), as it was after it."""
    before = enabled()
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)


def teach(qualified: str, op: str, cost: OpCost) -> None:
    """The Python fallback is costing ``qualified`` ("aten::add.Tensor") as one launch of
    ``cost`` for the fast kernel, which asked: teach it the handle for that call's signature."""
    if _lib is not None and _lib.trnsim_fast_learning(qualified.encode()):
        _lib.trnsim_fast_learn(_handle(op, cost))


def launch(core: int, op: str, cost: OpCost) -> bool:
    """Log one launch of ``cost`` for ``op`` on ``core`` natively, as the fast path logs its ops'
    (the device issues it in order, or its graph capture collects it, exactly as
    :meth:`trnsim.device.Device.launch` would); False when the fast path would not log it now
    (the caller launches it itself)."""
    return _on and bool(_lib.trnsim_fast_launch(core, _handle(op, cost)))


def handle(op: str, cost: OpCost) -> int | None:
    """The native log's handle for launches of ``cost`` for ``op`` (None without the fast path's
    library), for a caller that launches one pair many times (:func:`launch_handle`)."""
    return _handle(op, cost) if _lib is not None else None


def launch_handle(core: int, h: int) -> bool:
    """:func:`launch` of the pair :func:`handle` gave ``h`` for."""
    return _on and bool(_lib.trnsim_fast_launch(core, h))


_KEPT_MAX = 1 << 16  # distinct (op, cost) handles launch_kept makes; past it, Device.launch (a bound on _table)


def launch_kept(core: int, op: str, cost: OpCost) -> bool:
    """:func:`launch` for a charge made from Python (runtime.charge), whose costs are the device's
    cached ones (a handle keeps its cost alive for the log): False, for the caller to launch it,
    once :data:`_KEPT_MAX` handles exist and this pair has none."""
    if not _on:
        return False
    h = _handles.get((op, id(cost)))
    if h is None:
        if len(_table) >= _KEPT_MAX:
            return False
        h = _handle(op, cost)
    return bool(_lib.trnsim_fast_launch(core, h))


def batch(charges: list[tuple[str, OpCost]]) -> Any:
    """The native log's handles for ``charges`` ((op, cost), in order), for :func:`launch_batch`
    to log them all in one call; None without the fast path's library or once
    :data:`_KEPT_MAX` handles exist."""
    if _lib is None or len(_table) + len(charges) >= _KEPT_MAX:
        return None
    return (ctypes.c_int64 * len(charges))(*[_handle(op, cost) for op, cost in charges])


def launch_batch(core: int, handles: Any) -> bool:
    """:func:`launch_kept` of every launch :func:`batch` made ``handles`` for, in order, in one
    call; False when none was logged (the caller launches them itself)."""
    return _on and bool(_lib.trnsim_fast_launch_many(core, handles, len(handles)))


def teach_many(qualified: str, charges: list[tuple[str, OpCost]]) -> None:
    """The Python fallback is costing ``qualified`` as the launches ``charges`` ((op, cost), in
    order) for the fast kernel, which asked: teach it their handles for that call's signature."""
    if _lib is not None and charges and _lib.trnsim_fast_learning(qualified.encode()):
        handles = (ctypes.c_int64 * len(charges))(*[_handle(op, cost) for op, cost in charges])
        _lib.trnsim_fast_learn_many(handles, len(charges))


# csrc/neuron.cpp's OpKind: how the fast path serves an op (0: it never does; Python's path serves it)
KINDS = {0: "python", 1: "view", 2: "functional", 3: "writes", 4: "mm", 5: "addmm", 6: "bmm", 7: "empty",
         8: "empty_strided", 9: "copy", 10: "lstm_cell", 11: "lstm_cell_backward", 12: "gru_cell",
         13: "gru_cell_backward", 14: "conv",
         15: "conv_backward", 16: "batch_norm", 17: "to_copy", 18: "item"}


def kind(op: Any) -> str | None:
    """How the native fast path serves ``op`` (an OpOverload): a :data:`KINDS` name ("functional":
    it runs the CPU kernel on the arguments' memory, reading the schema's alias annotations to know
    what it writes), or None without the native extension."""
    if _lib is None:
        return None
    schema = _torch.op_schema(op)
    code = _lib.trnsim_fast_kind(schema.name.encode(), schema.overload_name.encode())
    return KINDS.get(code)


def hits() -> int:
    """Ops the fast path has served in this process (tests use it)."""
    return int(_lib.trnsim_fast_hits()) if _lib is not None else 0
