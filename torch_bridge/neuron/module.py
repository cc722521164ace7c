"""``torch.neuron``: the device module, shaped like ``torch.cuda``.

Device and RNG: ``is_available``, ``device_count`` (the config's logical NeuronCores),
``current_device``/``set_device``/``device``, ``synchronize``, and per-device generators
(``manual_seed``, ``get_rng_state``, ``torch.Generator("neuron")``: CUDA's seed + offset state,
independent of CPU's). The current device lives in the native device guard
(:mod:`torch_bridge._native`), so ``.to("neuron")``, factories, autograd's worker threads and
``torch.accelerator`` all follow ``set_device``.

Memory: ``memory_allocated``, ``max_memory_allocated``, ``memory_stats``,
``reset_peak_memory_stats``, ``mem_get_info`` (and ``memory_reserved``, trivial without a
caching allocator on the virtual HBM; ``empty_cache`` releases the host memory kept for reuse).

Simulated time: ``Stream``, ``Event``, ``stream()``, ``current_stream``, ``default_stream``
(see :mod:`trnsim.device` for the model: the host runs ahead of the device until it synchronises).

Chip and reports: ``set_config``, ``config``, ``report``, ``report_scope``, ``reset_report``;
``profiler`` (:mod:`torch_bridge.profiler`): torch.profiler traces down to the engines.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

import torch

from trnsim.device import Recorder
from trnsim.sim.report import RunReport

from .. import _native
from . import profiler
from ..eager import memory as _mem
from ..runtime import is_initialized, runtime, set_config

__all__ = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "default_generator",
    "get_amp_supported_dtype", "is_bf16_supported", "memory_allocated", "max_memory_allocated", "memory_stats",
    "reset_peak_memory_stats", "mem_get_info", "memory_reserved", "max_memory_reserved", "empty_cache",
    "memory_stats_as_nested_dict", "reset_accumulated_memory_stats", "reset_max_memory_allocated", "memory_summary",
    "get_device_name", "get_device_capability", "get_device_properties", "memory", "Stream", "Event", "stream",
    "current_stream", "default_stream",
    "set_config", "config", "report", "report_scope", "reset_report", "RunReport", "profiler",
]

_local = threading.local()
# read as torch.cuda's (torch.utils.checkpoint saves device RNG state only when it is True); the
# device needs no eager initialisation, so it is ready as soon as it is registered
_initialized = True


# ---- devices --------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def device_count() -> int:
    """Logical NeuronCores of the configured chip (``chip.cores / chip.lnc``)."""
    return runtime().device_count


def _check_index(index: Any) -> int:
    """A valid device index for ``index`` (None: the current device); starts the runtime."""
    count = device_count()
    if isinstance(index, torch.device):
        if index.type != "neuron":
            raise ValueError(f"expected a neuron device, got {index}")
        index = index.index if index.index is not None else current_device()
    elif isinstance(index, str):
        return _check_index(torch.device(index))
    if index is None:
        return current_device()
    if not isinstance(index, int) or not 0 <= index < count:
        raise RuntimeError(f"neuron:{index} does not exist: the {config().name} config has {count} "
                           f"logical NeuronCores (neuron:0..neuron:{count - 1})")
    return index


def current_device() -> int:
    """The calling thread's current neuron device (kept by the native device guard, so
    ``torch.accelerator``, autograd's worker threads and ``.to("neuron")`` agree with it)."""
    return _native.lib.trnsim_current_device()


def set_device(index: Any) -> None:
    idx = _check_index(index)
    _native.lib.trnsim_set_device(idx)


@contextlib.contextmanager
def _device_ctx(index: Any) -> Iterator[None]:
    prev = current_device()
    set_device(index)
    try:
        yield
    finally:
        _native.lib.trnsim_set_device(prev)


class device:
    """``with torch.neuron.device(1):`` makes neuron:1 the current device inside the block."""

    def __init__(self, index: Any):
        self.index = index
        self._ctx: Any = None

    def __enter__(self) -> None:
        self._ctx = _device_ctx(self.index)
        self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def synchronize(device: Any = None) -> None:
    """The host waits until every stream of ``device`` has finished (in simulated time)."""
    runtime().device.synchronize(_check_index(device))


def _is_in_bad_fork() -> bool:
    return False


# ---- RNG: one generator per device --------------------------------------------------------------
# Each device has its own default generator (native; state = 64-bit seed + 64-bit Philox offset,
# 16 bytes, as CUDA's), so seeding neuron leaves CPU's random numbers alone and the other way
# round. Random ops on neuron draw from it (torch_bridge.values).


def default_generator(device: Any = None) -> torch.Generator:
    """The default ``torch.Generator`` of ``device`` (None: the current device)."""
    from .generators import device_generator

    return device_generator(_check_index(device))


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (as ``torch.cuda.manual_seed``)."""
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    s = default_generator(0).seed()
    for i in range(1, device_count()):
        default_generator(i).manual_seed(s)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: Any = "neuron") -> torch.Tensor:
    """The generator state of ``device``: a 16-byte uint8 CPU tensor (seed, offset)."""
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "neuron") -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: Any) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True


# ---- memory ---------------------------------------------------------------------------------
def _memory(device: Any) -> _mem.MemoryStats:
    index = _check_index(device)  # first: it may configure the pool
    _mem.settle()  # an ended timing-only run's tensors that died since: their bytes are free
    return _mem.pool.devices[index]


def memory_allocated(device: Any = None) -> int:
    """Bytes of the device's HBM share held by live tensors."""
    return _memory(device).allocated


def max_memory_allocated(device: Any = None) -> int:
    return _memory(device).peak


def memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats``'s keys (``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``,
    ``num_alloc_retries``, ``num_ooms``, ...). The device has no caching allocator: reserved and
    active bytes are the allocated ones, and nothing is ever retried or split."""
    return _memory(device).stats()


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        node = nested
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def reset_peak_memory_stats(device: Any = None) -> None:
    _memory(device).reset_peak()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _memory(device).reset_accumulated()


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_reserved(device: Any = None) -> int:
    """Equal to :func:`memory_allocated`: the device has no caching allocator holding freed blocks."""
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def empty_cache() -> None:
    """The virtual HBM has no caching allocator (``memory_reserved`` equals ``memory_allocated``),
    so no device counter changes; the host memory trnsim keeps to back freed device blocks (see
    ``torch_bridge.memory.host_cache``) goes back to the system."""
    _mem.release_host_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device's HBM share."""
    mem = _memory(device)
    return mem.capacity - mem.allocated, mem.capacity


def _size(n: float) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n):6d} {unit}" if unit == "B  " else f"{n:6.1f} {unit}"
        n /= 1024
    return f"{n} B"


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A table of the device's memory statistics, laid out as ``torch.cuda.memory_summary``'s."""
    index = _check_index(device)
    st = memory_stats(index)
    ooms = f"neuron OOMs: {st['num_ooms']}"
    cap = f"HBM capacity: {_size(st['capacity_bytes']).strip()}"
    line = "|" + "=" * 75 + "|"
    thin = "|" + "-" * 75 + "|"
    out = [line, f"|{f'trnsim neuron memory summary, device ID {index}':^75}|", thin,
           f"|{ooms:^37}|{cap:^37}|",
           line, f"|{'Metric':^23}|{'Cur Usage':^12}|{'Peak Usage':^12}|{'Tot Alloc':^12}|{'Tot Freed':^12}|", thin]
    rows = [("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True), ("Reserved memory", "reserved_bytes", True),
            ("Allocations", "allocation", False), ("Active allocs", "active", False),
            ("Reserved segments", "segment", False)]
    pools = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    for label, key, is_bytes in rows:
        for p in pools:
            name = label if p == "all" else f"      from {p.split('_')[0]} pool"
            cells = [st[f"{key}.{p}.{w}"] for w in ("current", "peak", "allocated", "freed")]
            text = [_size(c) if is_bytes else f"{c:10d}" for c in cells]
            out.append(f"| {name:<22}|" + "|".join(f" {t:>10} " for t in text) + "|")
        out.append(thin)
    out.append(line)
    return "\n".join(out) + "\n"


def _record_memory_history(enabled: Any = "all", context: Any = "all", stacks: str = "all",
                           max_entries: int = 0, device: Any = None, **_: Any) -> None:
    """Start (``enabled="all"`` or True) or stop (None or False) recording every allocation and
    free with its Python stack, as ``torch.cuda.memory._record_memory_history``."""
    if enabled in (None, False, "none"):
        _mem.history.stop()
        return
    _mem.history.start(stacks not in (None, False, "none", "cpp"), int(max_entries or 0))


def _snapshot(device: Any = None) -> dict[str, Any]:
    """CUDA's memory snapshot: live ``segments`` (one block each: there is no caching allocator)
    and the recorded ``device_traces`` (one list per device), for ``torch.cuda.memory._dump_snapshot``
    readers such as ``memory_viz``."""
    segments = []
    for index, nbytes, addr in sorted(_mem.live_blocks(), key=lambda b: (b[0], b[2])):
        kind = "small" if nbytes <= _mem.SMALL_BLOCK else "large"
        segments.append({"device": index, "address": addr, "total_size": nbytes, "allocated_size": nbytes,
                         "active_size": nbytes, "requested_size": nbytes, "stream": 0, "segment_type": kind,
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                         "blocks": [{"address": addr, "size": nbytes, "requested_size": nbytes,
                                     "state": "active_allocated", "frames": []}]})
    traces = [list(_mem.history.snapshot().get(i, ())) for i in range(device_count())]
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_NEURON_ALLOC_CONF": "", "expandable_segments": False}}


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    import pickle

    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)


def _memory_module() -> Any:
    """``torch.neuron.memory``: the memory functions under their ``torch.cuda.memory`` names."""
    import sys
    import types

    mod = types.ModuleType("torch.neuron.memory", "Memory management of the neuron device (torch.cuda.memory's API).")
    for name in ("memory_allocated", "max_memory_allocated", "memory_stats", "memory_stats_as_nested_dict",
                 "reset_peak_memory_stats", "reset_accumulated_memory_stats", "reset_max_memory_allocated",
                 "memory_reserved", "max_memory_reserved", "empty_cache", "mem_get_info", "memory_summary",
                 "_record_memory_history", "_snapshot", "_dump_snapshot"):
        setattr(mod, name, globals()[name])
    sys.modules[mod.__name__] = mod
    return mod


# ---- device properties ------------------------------------------------------------------------
class NeuronDeviceProperties:
    """``torch.neuron.get_device_properties``: the logical NeuronCore, shaped like CUDA's
    ``_CudaDeviceProperties`` where the fields mean the same (``total_memory``,
    ``multi_processor_count`` = physical NeuronCores, ``major``/``minor`` = NeuronCore version).

    ``name`` is the chip as Neuron's own device names it (the config's name: ``"trn2"``,
    ``"trn3"``), which is what training frameworks look up: torchtitan's peak-FLOPs table
    (``torchtitan/tools/utils.py`` ``get_peak_flops``, pytorch/torchtitan #2382) maps
    ``get_device_properties().name`` in ``trn2``/``trn3`` to 79 bf16 TFLOP/s per core x LNC=2,
    once ``get_device_name()`` says ``neuron``. That this core is simulated is in
    ``description`` (``get_device_name``'s text) and ``simulated_by``."""

    def __init__(self, index: int):
        cfg = config()
        self.index = index
        self.config = cfg.name
        self.core_version = cfg.core.version
        self.name = cfg.name
        self.description = get_device_name(index)
        self.simulated_by = "trnsim"
        self.total_memory = _mem.pool.devices[index].capacity
        self.lnc = cfg.chip.lnc
        self.multi_processor_count = cfg.chip.lnc  # physical NeuronCores behind this logical one
        self.major, self.minor = get_device_capability(index)
        self.sbuf_bytes = cfg.core.sbuf.bytes
        self.psum_bytes = cfg.core.psum.bytes
        self.hbm_bandwidth = cfg.hbm_bandwidth_reachable * cfg.chip.lnc  # bytes/s this logical core reaches
        self.peak_bf16_flops = cfg.peak_flops_per_core("bf16") * cfg.chip.lnc
        self.is_integrated = False
        self.is_multi_gpu_board = cfg.logical_cores > 1

    def __repr__(self) -> str:
        return (f"_NeuronDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
                f"simulated_by='{self.simulated_by}')")


def get_device_name(device: Any = None) -> str:
    """``"trn2 NeuronCore-v3 (neuron, LNC=2, simulated by trnsim)"``: the chip config's name and
    core. It names the device type ``neuron`` in lower case, as frameworks test for it
    (torchtitan: ``"neuron" in device_name`` before it reads ``get_device_properties().name``)."""
    _check_index(device)
    cfg = config()
    return f"{cfg.name} {cfg.core.version} (neuron, LNC={cfg.chip.lnc}, simulated by trnsim)"


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """(major, minor) of the NeuronCore version: ``NeuronCore-v3`` -> (3, 0)."""
    _check_index(device)
    version = config().core.version.rsplit("-v", 1)[-1]
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)


def get_device_properties(device: Any = None) -> NeuronDeviceProperties:
    return NeuronDeviceProperties(_check_index(device))


# ---- streams and events in simulated time -------------------------------------------------------
_stream_ids = itertools.count(1)
_stream_lock = threading.Lock()


def _new_stream_id() -> int:
    with _stream_lock:
        return next(_stream_ids)


_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1, as torch.Stream takes a device type


class Stream(torch.Stream):
    """A queue of work on one NeuronCore; streams of a core overlap on its simulated timeline.
    A ``torch.Stream`` (device type ``neuron``), so what takes one takes it:
    ``tensor.record_stream(s)``, ``isinstance(s, torch.Stream)``."""

    def __new__(cls, device: Any = None, priority: int = 0, *, _id: int | None = None) -> "Stream":
        index = _check_index(device)
        sid = _new_stream_id() if _id is None else _id
        return super().__new__(cls, stream_id=sid, device_index=index, device_type=_PRIVATEUSE1)

    def __init__(self, device: Any = None, priority: int = 0, *, _id: int | None = None):
        self._priority = priority

    @property
    def priority(self) -> int:  # type: ignore[override]
        return self._priority

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        dev = runtime().device
        return dev.stream_ready(self.device_index, self.stream_id) <= dev.host

    def synchronize(self) -> None:
        runtime().device.synchronize(self.device_index, self.stream_id)

    def __enter__(self) -> "Stream":
        self._prev = current_stream(self.device_index)
        _set_current(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _set_current(self._prev)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and (other.device_index, other.stream_id) == (self.device_index, self.stream_id)

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"


def _set_current(s: Stream) -> None:
    runtime().device.set_current_stream(s.device_index, s.stream_id)


def current_stream(device: Any = None) -> Stream:
    idx = _check_index(device)
    return Stream(idx, _id=runtime().device.cores[idx].current_stream)


def default_stream(device: Any = None) -> Stream:
    return Stream(_check_index(device), _id=0)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with torch.neuron.stream(s):`` issues the block's ops on ``s`` (None: no change)."""
    if s is None:
        yield
        return
    with s:
        yield


class Event:
    """A point on a stream's simulated timeline, like ``torch.cuda.Event``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.tick: int | None = None
        self.device_index: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self.device_index = stream.device_index
        dev = runtime().device
        # the stream reaches the event when its earlier work is done, and not before the host
        # enqueues it (an idle stream records the host's time, as a CUDA event does)
        self.tick = max(dev.stream_ready(stream.device_index, stream.stream_id), dev.host)

    def wait(self, stream: Stream | None = None) -> None:
        """Work issued later on ``stream`` starts after this event (no effect if never recorded)."""
        if self.tick is None:
            return
        stream = stream or current_stream(self.device_index)
        runtime().device.stream_wait(stream.device_index, stream.stream_id, self.tick)

    def query(self) -> bool:
        if self.tick is None:
            return True
        return self.tick <= runtime().device.host

    def synchronize(self) -> None:
        if self.tick is not None:
            runtime().device.wait_host_until(self.tick)

    def elapsed_time(self, end_event: "Event") -> float:
        """Simulated milliseconds from this event to ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.tick is None or end_event.tick is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not end_event.query():
            raise RuntimeError("end_event has not completed: call end_event.synchronize() first "
                               "(as torch.cuda.Event.elapsed_time requires)")
        return (end_event.tick - self.tick) * 1e3 / config().tick_hz

    def __repr__(self) -> str:
        return f"<torch.neuron.Event tick={self.tick} device={self.device_index}>"


# ---- chip and reports -----------------------------------------------------------------------
def config() -> Any:
    """The chip's :class:`trnsim.ChipConfig` (fixes the config: set_config fails afterwards)."""
    return runtime().config


def report() -> RunReport:
    """Where simulated time went since the process started (or :func:`reset_report`)."""
    return runtime().device.report()


def reset_report(trace: bool = False) -> None:
    """Start the process-wide report afresh; ``trace=True`` also keeps every launch (for a timeline)."""
    runtime().device.reset(trace=trace)


class report_scope:
    """``with torch.neuron.report_scope() as scope: ...`` then ``scope.report``: only the ops
    issued inside the block (``trace=True`` also keeps every launch for a timeline). The host
    does not wait for the device at the end of the block: call ``torch.neuron.synchronize()``
    inside it to include the device's last kernels in ``elapsed_us``."""

    def __init__(self, trace: bool = False):
        self._trace = trace
        self._recorder: Recorder | None = None
        self.report: RunReport | None = None

    def __enter__(self) -> "report_scope":
        if self._recorder is not None:
            raise RuntimeError("torch.neuron.report_scope: this scope is already open (use a new report_scope "
                               "for a nested block)")
        self._recorder = runtime().device.open_scope(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        rec, self._recorder = self._recorder, None
        if rec is None:
            raise RuntimeError("torch.neuron.report_scope: closed without being opened (use it as "
                               "`with torch.neuron.report_scope() as scope:`)")
        self.report = runtime().device.close_scope(rec)


# ---- adaptive eager ---------------------------------------------------------------------------
def set_adaptive_eager(enabled: bool = True) -> None:
    """Adaptive eager: queue launches between synchronisations and replay a sequence seen before
    as one graph launch (one host dispatch); values and kernel order are unchanged. Worth it where
    the run report shows the device waiting on the host (``bound: launch``). Also
    ``TRNSIM_ADAPTIVE_EAGER=1`` or ``trnsim run --adaptive-eager``."""
    runtime().device.set_adaptive(enabled)


@contextlib.contextmanager
def adaptive_eager(enabled: bool = True) -> Iterator[None]:
    """``with torch.neuron.adaptive_eager(): ...``: :func:`set_adaptive_eager` for the block."""
    dev = runtime().device
    before = dev.adaptive
    dev.set_adaptive(enabled)
    try:
        yield
    finally:
        dev.set_adaptive(before)


__all__ += ["set_adaptive_eager", "adaptive_eager"]


# ---- timing-only runs -------------------------------------------------------------------------
def timing_only() -> Any:
    """``with torch.neuron.timing_only():`` - tensors with shapes and no storage; every op is
    charged as in eager, no value is computed (see :mod:`torch_bridge.timing_only`)."""
    from ..timing.fake import timing_only as _timing_only

    return _timing_only()


__all__ += ["timing_only"]


# ---- MX matmul (trn3) -------------------------------------------------------------------------
def mx_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An MX matmul of fp8 operands with E8M0 block scales (one per 32 values along K), timed on
    trn3's ``nc_matmul_mx`` (the ``matmul_mx`` kernel); PyTorch itself reaches MX only on CUDA.
    See :mod:`torch_bridge.mx` for the layout and the values."""
    from ..ops.mx import mx_matmul as op

    return op(a, a_scale, b, b_scale, out_dtype)


__all__ += ["mx_matmul"]


memory = _memory_module()
