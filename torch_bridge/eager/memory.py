"""Device memory of the `neuron` device: real host storage, relabelled, counted against HBM.

PyTorch has no Python API for a PrivateUse1 allocator, so a device tensor is a CPU allocation
whose DLPack capsule is relabelled as device ``kDLExtDev`` (PyTorch maps it to PrivateUse1):
``from_dlpack`` then returns a plain ``neuron:i`` tensor that owns the CPU memory, with zero
copies. Compute runs on zero-copy CPU views of that memory (:func:`cpu_view`).

Every allocation is counted against the chip config's HBM capacity per logical NeuronCore
(``chip.hbm.capacity / logical cores``), checked *before* the host allocator is asked, so a
request bigger than the virtual HBM raises ``torch.OutOfMemoryError`` with the sizes instead of
exhausting the host. Frees are seen through a weak reference to the CPU tensor the DLPack
capsule keeps alive. The counters live in the native extension's ledger and are updated there
under one lock (ops may run on several threads, a free may arrive from the garbage collector in
the middle of an allocation, and the native fast path allocates without Python).
"""

from __future__ import annotations

import ctypes
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any, Sequence

import torch

from trnsim.config import format_quantity

from .. import _torch

__all__ = ["MemoryStats", "Pool", "relabel", "cpu_view", "cpu_views", "native_views", "native_viewable", "adopt", "allocate", "host_scope", "pool"]

_KDL_EXT_DEV = 12  # DLPack's kDLExtDev: PyTorch reads it as PrivateUse1
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    """The leading fields of DLPack's ``DLTensor``: the data pointer, then the device."""

    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


SMALL_BLOCK = 1 << 20  # CUDA's small pool: requests up to 1 MiB (kSmallSize)
_POOLS = ("all", "large_pool", "small_pool")
_BYTE_STATS = ("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes")
_COUNT_STATS = ("allocation", "active", "segment")


# A MemoryStats is one row of int64 counters (the native ledger's layout, csrc/neuron.cpp):
# [bytes, count][all, large_pool, small_pool][current, peak, allocated, freed], then ooms and
# capacity. The native extension updates the eager device's rows in place (its fast path allocates
# without Python), so Python's figures and the fast path's are one set of counters.
_STAT_LEN, _OOMS, _CAPACITY = 26, 24, 25
_FIELDS = ("current", "peak", "allocated", "freed")
_Row = ctypes.c_int64 * _STAT_LEN


class _Stat:
    """One of CUDA's allocator counters in a row: current, peak, allocated (cumulative), freed."""

    __slots__ = ("_row", "_at")

    def __init__(self, row: Any, at: int) -> None:
        self._row, self._at = row, at

    current = property(lambda self: self._row[self._at], lambda self, v: self._set(0, v))
    peak = property(lambda self: self._row[self._at + 1], lambda self, v: self._set(1, v))
    allocated = property(lambda self: self._row[self._at + 2], lambda self, v: self._set(2, v))
    freed = property(lambda self: self._row[self._at + 3], lambda self, v: self._set(3, v))

    def _set(self, i: int, v: int) -> None:
        self._row[self._at + i] = v


class _Zero:
    current = peak = allocated = freed = 0


def _row_add(row: Any, nbytes: int) -> None:
    """The native ledger's add, for a row without the extension loaded."""
    pool = 2 if nbytes <= SMALL_BLOCK else 1
    for at, n in ((0, nbytes), (4 * pool, nbytes), (12, 1), (12 + 4 * pool, 1)):
        row[at] += n
        row[at + 2] += n
        if row[at] > row[at + 1]:
            row[at + 1] = row[at]


def _row_sub(row: Any, nbytes: int, undo: bool) -> None:
    pool = 2 if nbytes <= SMALL_BLOCK else 1
    for at, n in ((0, nbytes), (4 * pool, nbytes), (12, 1), (12 + 4 * pool, 1)):
        row[at] -= n
        if undo:  # an allocation that never happened: not a free
            row[at + 2] -= n
        else:
            row[at + 3] += n


_loaded: list[Any] = []  # the native extension once loaded (it stays loaded: no import per call)


def _lib() -> Any:
    if _loaded:
        return _loaded[0]
    from .. import _native

    lib = _native.lib
    if lib is not None:
        _loaded.append(lib)
    return lib


class MemoryStats:
    """Allocation statistics of one NeuronCore's share of HBM, reported under CUDA's caching
    allocator keys (``memory_stats``). There is no cache: every live tensor's bytes are
    allocated, active, requested and reserved at once, and a free returns them to the device,
    so one byte counter and one allocation counter per pool hold every figure."""

    def __init__(self, capacity: int) -> None:
        self.row = _Row()
        self.row[_CAPACITY] = capacity
        self.bytes_ = {p: _Stat(self.row, 4 * i) for i, p in enumerate(_POOLS)}
        self.count_ = {p: _Stat(self.row, 12 + 4 * i) for i, p in enumerate(_POOLS)}

    @property
    def capacity(self) -> int:
        return self.row[_CAPACITY]

    @property
    def ooms(self) -> int:
        return self.row[_OOMS]

    @ooms.setter
    def ooms(self, v: int) -> None:
        self.row[_OOMS] = v

    @property
    def allocated(self) -> int:
        return self.row[0]

    @property
    def peak(self) -> int:
        return self.row[1]

    def try_add(self, nbytes: int) -> bool:
        """Count ``nbytes`` if they fit in the capacity (else count an OOM and return False)."""
        lib = _lib()
        if lib is not None:
            return bool(lib.trnsim_mem_reserve(self.row, nbytes))
        if self.row[0] + nbytes > self.row[_CAPACITY]:
            self.row[_OOMS] += 1
            return False
        _row_add(self.row, nbytes)
        return True

    def add(self, nbytes: int) -> None:
        _row_add(self.row, nbytes)

    def sub(self, nbytes: int, undo: bool = False) -> None:
        lib = _lib()
        if lib is not None:
            lib.trnsim_mem_sub(self.row, nbytes, int(undo))
        else:
            _row_sub(self.row, nbytes, undo)

    def reset_peak(self) -> None:
        for st in (*self.bytes_.values(), *self.count_.values()):
            st.peak = st.current

    def reset_accumulated(self) -> None:
        for st in (*self.bytes_.values(), *self.count_.values()):
            st.allocated = st.freed = 0
        self.ooms = 0

    def stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats``'s keys (training frameworks read them by name)."""
        out: dict[str, int] = {}
        fams: list[tuple[str, dict[str, Any]]] = [(name, self.bytes_) for name in _BYTE_STATS]
        fams += [(name, self.count_) for name in _COUNT_STATS]
        zero = _Zero()
        fams += [("inactive_split", {p: zero for p in _POOLS}), ("inactive_split_bytes", {p: zero for p in _POOLS})]
        for name, pools in fams:
            for p, st in pools.items():
                for what in _FIELDS:
                    out[f"{name}.{p}.{what}"] = getattr(st, what)
        for name in ("oversize_allocations", "oversize_segments"):
            for what in _FIELDS:
                out[f"{name}.{what}"] = 0
        seg = self.count_["all"]
        out.update({"num_alloc_retries": 0, "num_ooms": self.ooms, "num_sync_all_streams": 0,
                    "num_device_alloc": seg.allocated, "num_device_free": seg.freed, "max_split_size": -1,
                    "capacity_bytes": self.capacity})
        return dict(sorted(out.items()))


_forget_at_exit: list[bool] = []


class Pool:
    """Per-device :class:`MemoryStats`: the eager device's :data:`pool` is configured when the
    chip config is first needed (``native``: its rows are the native fast path's ledger); a
    timing-only estimate makes one of its own per simulated rank (``Pool(count, capacity_per_device)``)."""

    def __init__(self, count: int = 0, capacity_per_device: int = 0, native: bool = False) -> None:
        self.devices: list[MemoryStats] = []
        self.native = native
        self.lock = threading.RLock()  # re-entrant: a GC-driven free can run inside reserve()
        self.configure(count, capacity_per_device)

    def configure(self, count: int, capacity_per_device: int) -> None:
        self.devices = [MemoryStats(capacity_per_device) for _ in range(count)]
        lib = _lib() if self.native else None
        if lib is not None:
            rows = (ctypes.POINTER(ctypes.c_int64) * max(1, count))(
                *[ctypes.cast(m.row, ctypes.POINTER(ctypes.c_int64)) for m in self.devices])
            lib.trnsim_mem_set_pool(rows, count)
            if not _forget_at_exit:  # the rows are Python memory: frees while Python shuts down must not reach them
                import atexit

                atexit.register(lambda: lib.trnsim_mem_set_pool(None, 0))
                _forget_at_exit.append(True)

    def reserve(self, index: int, nbytes: int) -> None:
        """Count ``nbytes`` on device ``index`` or raise ``torch.OutOfMemoryError``."""
        mem = self.devices[index]
        if not mem.try_add(nbytes) and not self._settled_retry(mem, nbytes):
            allocated, capacity = mem.allocated, mem.capacity
            raise torch.OutOfMemoryError(
                f"neuron:{index} out of memory: tried to allocate {nbytes} bytes "
                f"({format_quantity(nbytes, 'bytes')}); {allocated} bytes in use of {capacity} capacity "
                f"({format_quantity(capacity - allocated, 'bytes')} free)"
            )

    @staticmethod
    def _settled_retry(mem: MemoryStats, nbytes: int) -> bool:
        """After a refusal: release the bytes of storages already dead but not yet swept
        (:func:`settle`) and try once more. Without this, an ended timing-only run's dead tensors
        could make an allocation that fits fail. One refusal counts one OOM."""
        if not settlers:
            return False
        mem.ooms -= 1  # the retry counts it again if it fails too
        settle()
        return mem.try_add(nbytes)

    def unreserve(self, index: int, nbytes: int) -> None:
        """Undo a :meth:`reserve` whose allocation the host could not back (an OOM, not a free)."""
        mem = self.devices[index]
        mem.sub(nbytes, undo=True)
        mem.ooms += 1

    def release(self, index: int, nbytes: int) -> None:
        devices = self.devices
        if index < len(devices):  # a reconfigured pool forgets earlier devices
            devices[index].sub(nbytes)


pool = Pool(native=True)

# Callables that release the bytes of storages already dead but not yet swept (an ended
# timing-only run's tensors that died after it): run before the allocated bytes are read.
settlers: list[Any] = []


def settle() -> None:
    for f in settlers:
        f()


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def relabel(cpu: torch.Tensor, index: int, counted: bool = False) -> torch.Tensor:
    """Turn the CPU tensor ``cpu`` into a ``neuron:index`` tensor over the same memory (no copy).

    Unless ``counted`` (the caller already reserved the bytes), its storage is counted now, which
    may raise ``torch.OutOfMemoryError``. The common case is counted and relabelled in one native
    call (:func:`adopt`'s: the fast path's own bookkeeping, the same figures, ~1 us against ~3).
    """
    if not counted:
        native = (_native_ops or _ops())[1]
        if native is not None:
            t = native(cpu, index)  # (None for what it does not take: the rest below, and its errors)
            if t is not None:
                return t
    if cpu.requires_grad:
        cpu = cpu.detach()
    if cpu.is_conj() or cpu.is_neg():  # DLPack carries no conj/neg bit: a lazily conjugated result
        cpu = cpu.resolve_conj().resolve_neg()  # (vdot's) would come back unconjugated
    st = cpu.untyped_storage()
    nbytes, addr = st.nbytes(), st.data_ptr()
    if not counted:
        pool.reserve(index, nbytes)
    _live[weakref.ref(cpu, _freed)] = (index, nbytes, addr)
    if history.enabled:
        history.record(index, "alloc", addr, nbytes)
    cap = _torch.to_dlpack(cpu)  # the capsule keeps this very tensor alive
    head = _DLTensorHead.from_address(_get_pointer(cap, b"dltensor"))
    head.device.device_type = _KDL_EXT_DEV
    head.device.device_id = index
    return _torch.from_dlpack(cap)


# weak reference to a relabelled CPU tensor -> (device, bytes, address) to release when it dies. A bare
# weakref with a callback costs a tenth of weakref.finalize, and relabel runs once per op result.
_live: dict[weakref.ref[torch.Tensor], tuple[int, int, int]] = {}


def _freed(ref: weakref.ref[torch.Tensor]) -> None:
    index, nbytes, addr = _live.pop(ref)
    pool.release(index, nbytes)
    if history.enabled:
        history.record(index, "free_completed", addr, nbytes)


def live_blocks() -> list[tuple[int, int, int]]:
    """(device, bytes, address) of every live device allocation (the fast path's too)."""
    with pool.lock:
        blocks = list(_live.values())
    lib = _lib()
    if lib is not None:
        cap = 0
        while True:
            buf = (ctypes.c_int64 * (3 * cap + 3))()
            n = lib.trnsim_fast_blocks(buf, cap)
            if n <= cap:
                blocks += [(buf[3 * i], buf[3 * i + 1], buf[3 * i + 2]) for i in range(n)]
                break
            cap = n + 64  # more blocks appeared meanwhile: ask again with room to spare
    return blocks


_BRIDGE = str(__import__("pathlib").Path(__file__).parent.parent)  # the device's own frames are left out


class _History:
    """``torch.neuron.memory._record_memory_history``: alloc/free events per device, with the
    Python stack that made them, in CUDA's snapshot format (``memory_viz`` reads it)."""

    def __init__(self) -> None:
        self.enabled = False
        self.stacks = True
        self.max_entries = 0
        self.traces: dict[int, deque[dict[str, Any]]] = {}

    def start(self, stacks: bool, max_entries: int) -> None:
        self._take_native()
        self.enabled, self.stacks, self.max_entries = True, stacks, max_entries
        self.traces = {}
        lib = _lib()
        if lib is not None:  # allocations take the Python path (which records them) meanwhile
            lib.trnsim_fast_history(1)

    def stop(self) -> None:
        self._take_native()
        self.enabled = False
        lib = _lib()
        if lib is not None:
            lib.trnsim_fast_history(0)

    def snapshot(self) -> dict[int, deque[dict[str, Any]]]:
        """The traces so far, with the fast path's frees recorded natively."""
        self._take_native()
        return self.traces

    def _take_native(self) -> None:
        """Record the frees of fast-path blocks the native ledger saw while history was on (it
        cannot call Python: they have no stack)."""
        lib = _lib()
        if lib is None:
            return
        while True:
            buf = (ctypes.c_int64 * 1024)()
            n = lib.trnsim_fast_freed(buf, 256)
            for i in range(n):
                index, addr, nbytes, us = buf[4 * i: 4 * i + 4]
                if self.enabled:
                    self._append(index, {"action": "free_completed", "addr": addr, "size": nbytes, "stream": 0,
                                         "time_us": us, "frames": []})
            if n < 256:
                return

    def record(self, index: int, action: str, addr: int, nbytes: int) -> None:
        frames = []
        if self.stacks:
            frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}  # innermost first, as CUDA's
                      for f in reversed(traceback.extract_stack(limit=32)) if _BRIDGE not in f.filename]
        self._append(index, {"action": action, "addr": addr, "size": nbytes, "stream": 0,
                             "time_us": time.time_ns() // 1000, "frames": frames})

    def _append(self, index: int, entry: dict[str, Any]) -> None:
        trace = self.traces.get(index)
        if trace is None:
            trace = self.traces[index] = deque(maxlen=self.max_entries or None)
        trace.append(entry)


history = _History()


class host_scope:
    """While inside, this thread's CPU allocations back neuron memory: blocks of
    :func:`host_cache_min` bytes or more come from the host cache of freed device blocks
    (csrc/neuron.cpp, "host memory") instead of fresh pages, which glibc faults in again every
    step. For host-side computations whose results become device tensors (a compiled region's
    values and its intermediates, a foreach kernel's lists); values and the HBM ledger are
    unaffected. Without the native extension it does nothing."""

    __slots__ = ("_lib",)

    def __enter__(self) -> "host_scope":
        self._lib = _lib()
        if self._lib is not None:
            self._lib.trnsim_host_scope(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lib is not None:
            self._lib.trnsim_host_scope(-1)


def allocate(size: Sequence[int], stride: Sequence[int] | None, dtype: torch.dtype, index: int) -> torch.Tensor:
    """A new uninitialised ``neuron:index`` tensor; HBM capacity is checked first."""
    probe = torch.empty_strided(size, stride, dtype=dtype, device="meta") if stride is not None else \
        torch.empty(size, dtype=dtype, device="meta")
    pool.reserve(index, probe.untyped_storage().nbytes())
    nbytes = probe.untyped_storage().nbytes()
    try:
        with host_scope():  # the block comes from the host cache
            cpu = torch.empty_strided(size, probe.stride(), dtype=dtype)
    except RuntimeError as e:
        pool.unreserve(index, nbytes)
        raise torch.OutOfMemoryError(
            f"neuron:{index} out of memory: the host could not back {nbytes} bytes of device memory "
            f"({format_quantity(nbytes, 'bytes')}; the virtual HBM had room): {str(e).splitlines()[0]}") from None
    return relabel(cpu, index, counted=True)


# (address, bytes) -> a non-owning CPU storage over that device memory. Reusing one is safe even
# after the memory is freed and reallocated: it only ever names the address range.
_aliases: dict[tuple[int, int], Any] = {}
_ALIAS_CACHE = 4096
# (storage address, storage bytes, offset, sizes, strides, dtype, conj, neg) -> a CPU view built
# for it. Building one (empty + set_) costs ~5 us and an op needs one per neuron argument; the
# same windows recur all the time (weights, optimizer state, activations read again in backward).
_views: dict[tuple[Any, ...], torch.Tensor] = {}
_VIEW_CACHE = 8192


def _fresh_view(t: torch.Tensor, cst: Any, offset: int, size: Any, stride: Any) -> torch.Tensor:
    v = torch.empty(0, dtype=t.dtype).set_(cst, offset, size, stride)
    if t.is_conj():
        v = _torch.conj_view(v)
    if t.is_neg():
        v = _torch.neg_view(v)
    return v


def check_within_storage(t: torch.Tensor, nbytes: int) -> None:
    """Refuse a tensor whose storage (of ``nbytes``) holds fewer bytes than its elements reach: one
    whose memory ``untyped_storage().resize_(0)`` freed (FSDP2 frees its unsharded parameters so)
    or shrank. Its CPU view got a fresh, uninitialised storage of the size it needed (``set_`` grows
    a resizable one), so ``.cpu()``, ``.tolist()``, ``copy_`` and ``mm`` read garbage and writes were
    lost, where CPU refuses (``item``, ``mm``, ``to``) or crashes; the native fast path refuses it
    in the same words (csrc/neuron.cpp ``check_within_storage``)."""
    n = t.numel()
    if not n:
        return
    need = (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    if nbytes < need:
        raise RuntimeError(f"neuron: a tensor of {n} elements over {nbytes} bytes of memory (it needs {need}): "
                           "its storage was freed or shrunk (untyped_storage().resize_()); re-allocate it "
                           "(untyped_storage().resize_(n)) before using the tensor")


def cpu_view(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same memory as the neuron tensor ``t`` (same sizes, strides, offset,
    conj/neg bits). It does not own the memory: keep ``t`` alive while it is used. The same
    window may return the same CPU tensor again; it is checked first, in case a CPU kernel
    changed its sizes or strides in place (an out= resize, ``t_``)."""
    st = t.untyped_storage()
    ptr, nbytes, offset, size, stride = st.data_ptr(), st.nbytes(), t.storage_offset(), t.shape, t.stride()
    if nbytes == 0:
        check_within_storage(t, nbytes)
        # distinct empty tensors share a null window: a cached view would make them one tensor,
        # and in-place kernels would then refuse them as overlapping (put/take on empty inputs)
        return _fresh_view(t, torch.empty(0, dtype=torch.uint8).untyped_storage(), offset, size, stride)
    vkey = (ptr, nbytes, offset, size, stride, t.dtype, t.is_conj(), t.is_neg())
    v = _views.get(vkey)
    if v is not None and v.storage_offset() == offset and v.shape == size and v.stride() == stride \
            and v.untyped_storage().data_ptr() == ptr:
        return v
    check_within_storage(t, nbytes)
    key = (ptr, nbytes)
    cst = _aliases.get(key)
    if cst is None:
        if len(_aliases) >= _ALIAS_CACHE:
            _aliases.clear()
        cst = _aliases[key] = _torch.storage_from_pointer(ptr, torch.device("cpu"), nbytes)
    v = _fresh_view(t, cst, offset, size, stride)
    if len(_views) >= _VIEW_CACHE:
        _views.clear()
    _views[vkey] = v
    return v


# ---- blocks for the native storage resize ------------------------------------------------------
# ``untyped_storage().resize_(n)`` (FSDP2 frees and re-allocates parameters that way) is served in
# C++ (csrc/neuron.cpp), which asks for device memory here: a block is a neuron uint8 tensor,
# counted like any other allocation, kept alive under a token until the storage lets it go.
_blocks: dict[int, torch.Tensor] = {}
_next_token = [0]


def _alloc_block(index: int, nbytes: int, ptr: Any, error: Any, error_len: int) -> int:
    try:
        t = allocate((int(nbytes),), None, torch.uint8, int(index))
    except Exception as e:  # reported by C++ as torch.OutOfMemoryError with this message
        msg = str(e).splitlines()[0].encode()[:error_len]
        ctypes.memmove(error, msg, len(msg))
        return 0
    with pool.lock:
        _next_token[0] += 1
        token = _next_token[0]
        _blocks[token] = t
    ptr[0] = t.data_ptr()
    return token


def _release_block(token: int) -> None:
    with pool.lock:
        _blocks.pop(int(token), None)


_callbacks: list[Any] = []


def install_resize_allocator(lib: Any) -> None:
    """Give the native resize its allocator (and take it back at exit: a storage freed while the
    interpreter shuts down must not call into Python)."""
    import atexit

    from .._native import ALLOC_FN, RELEASE_FN

    alloc, release = ALLOC_FN(_alloc_block), RELEASE_FN(_release_block)
    _callbacks[:] = [alloc, release]  # ctypes callbacks must outlive every call
    lib.trnsim_set_allocator(alloc, release)
    atexit.register(lambda: lib.trnsim_set_allocator(ALLOC_FN(), RELEASE_FN()))


# trnsim_host_stats' row, in its order
_HOST_KEYS = ("installed", "kept_bytes", "limit_bytes", "reused", "fresh", "blocks", "min_bytes")


def host_cache() -> dict[str, int]:
    """The host cache of freed device blocks (csrc/neuron.cpp, "host memory"): whether it is the
    CPU allocator yet, the bytes it keeps free for reuse and its limit, how many allocations it
    served from kept blocks and how many took new memory, the blocks it owns, and the smallest
    block it serves (smaller ones glibc keeps mapped). Host-side only: no HBM counter sees it."""
    lib = _lib()
    if lib is None:
        return dict.fromkeys(_HOST_KEYS, 0)
    out = (ctypes.c_int64 * len(_HOST_KEYS))()
    lib.trnsim_host_stats(out)
    return dict(zip(_HOST_KEYS, out))


_cache_min: list[int] = []


def host_cache_min() -> int:
    """The smallest block the host cache serves (csrc/neuron.cpp's ``kCacheMin``, as the
    extension reports it; 4 KiB without the extension, when :class:`host_scope` does nothing)."""
    if not _cache_min:
        _cache_min.append(host_cache()["min_bytes"] or 4 * 1024)
    return _cache_min[0]


def release_host_cache() -> int:
    """Give the host cache's kept blocks back to the system; returns the bytes released."""
    lib = _lib()
    return int(lib.trnsim_host_release()) if lib is not None else 0


# ---- the native helpers of compiled regions (csrc/neuron.cpp's trnsim.cpu_views and trnsim.adopt) ----
# [cpu_views, adopt] once looked up, as their C++ callables (OpOverload.__call__ adds a Python frame
# to calls made several times per region and attention call); [None, None] without them
_native_ops: list[Any] = []


def _ops() -> list[Any]:
    if not _native_ops:
        if _lib() is None:
            return [None, None]  # not loaded (yet): looked up again on the next call
        ns = torch.ops.trnsim
        try:
            _native_ops.extend([_torch.cpp_op(ns.cpu_views.default), _torch.cpp_op(ns.adopt.default)])
        except (AttributeError, RuntimeError):
            _native_ops.extend([None, None])
    return _native_ops


def native_views() -> Any:
    """The native op :func:`cpu_views` uses for the common windows (a list of tensors
    :func:`native_viewable` takes; it raises ``RuntimeError`` for any other), or None without the
    extension."""
    return _ops()[0]


def native_viewable(t: torch.Tensor) -> bool:
    """A neuron tensor the native views take: strided, without conj/neg bits, over memory that exists."""
    return t.device.type == "neuron" and t.layout == torch.strided and not t.is_conj() and not t.is_neg() \
        and bool(t.untyped_storage().nbytes())


def cpu_views(args: Any) -> list[Any]:
    """``args`` with each neuron tensor replaced by a CPU tensor over its memory (:func:`cpu_view`'s
    windows; the common ones made in one native call, not cached), everything else as it is."""
    native = _ops()[0]
    out = list(args)
    if native is not None:  # the native op first: it takes the common windows and refuses the rest
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "neuron"]
        try:
            views = native([args[i] for i in at]) if at else ()
        except RuntimeError:  # one it does not take: each tensor on its own, as below
            pass
        else:
            for i, v in zip(at, views):
                out[i] = v
            return out
    common = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            if native is not None and native_viewable(a):
                common.append(i)
            else:
                out[i] = cpu_view(a)
    if common:
        for i, v in zip(common, native([args[i] for i in common])):
            out[i] = v
    return out


def adopt(cpu: torch.Tensor, index: int) -> torch.Tensor:
    """:func:`relabel` for a fresh host tensor (counted against HBM as the native fast path counts its
    results; the same figures), in one native call where it can (as relabel now does itself)."""
    return relabel(cpu, index)


# ---- neuron tensors sent to another process ---------------------------------------------------
def install_process_transfer() -> None:
    """Let ``multiprocessing`` send neuron tensors the one way their meaning survives: a
    DataLoader worker's batch. torch's reducer shares a tensor's memory with the receiving
    process (a file descriptor on CPU, CUDA IPC on a GPU); a neuron tensor's memory is neither,
    and the reducer's ``_share_fd_`` failed in the queue's feeder thread, so a DataLoader whose
    dataset returned neuron tensors waited for that batch for ever. In a DataLoader worker the
    batch is now sent as a copy (through CPU shared memory, a neuron tensor again on the same
    device index in the receiver: the batch arrives on the device); anywhere else a neuron
    tensor is refused in one line, since a copy would silently break what sharing means there
    (Hogwild-style training of a model shared with ``share_memory()``). CPU tensors keep torch's
    own reducer."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    torch_reduce = reductions.reduce_tensor

    def reduce_tensor(tensor: torch.Tensor) -> Any:
        if tensor.device.type != "neuron":
            return torch_reduce(tensor)
        if torch.utils.data.get_worker_info() is None or tensor.requires_grad:
            raise RuntimeError(
                f"neuron: a {'tensor that requires grad' if tensor.requires_grad else 'neuron tensor'} cannot be "
                f"sent to another process: device memory is not shared between processes here (CUDA shares it "
                f"through IPC); send CPU tensors (share_memory_() to share them) and move them to the device in the "
                f"receiving process")
        return _rebuild_on_device, (tensor.detach().cpu(), tensor.device.index or 0)

    reducers = getattr(ForkingPickler, "_extra_reducers", {})  # (CPython's table of them; torch registers there)
    for cls in (torch.Tensor, torch.nn.Parameter):
        if reducers.get(cls) is torch_reduce:
            ForkingPickler.register(cls, reduce_tensor)


def _rebuild_on_device(cpu: torch.Tensor, index: int) -> torch.Tensor:
    return cpu.to(torch.device("neuron", index))
