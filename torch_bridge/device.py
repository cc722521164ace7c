"""``torch.neuron``: the device module, shaped like ``torch.cuda``.

Device and RNG: ``is_available``, ``device_count`` (the config's logical NeuronCores),
``current_device``/``set_device``/``device``, ``synchronize``, ``manual_seed``. ``set_device``
steers factories (``torch.empty(..., device="neuron")``) and the streams API; ``.to("neuron")``
without an index always means neuron:0, because PyTorch resolves it through the C++ device guard,
which a Python backend cannot make stateful (torch 2.13): name ``"neuron:1"`` explicitly. The device
draws random numbers from PyTorch's host generator (PrivateUse1 has no Python generator API), so
a seeded neuron run draws the same numbers as the same CPU run.

Memory: ``memory_allocated``, ``max_memory_allocated``, ``memory_stats``,
``reset_peak_memory_stats``, ``mem_get_info`` (and ``memory_reserved``/``empty_cache``, trivial
without a caching allocator).

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
from trnsim.report import RunReport

from . import memory, profiler
from .runtime import is_initialized, runtime, set_config

__all__ = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state",
    "get_amp_supported_dtype", "is_bf16_supported", "memory_allocated", "max_memory_allocated", "memory_stats",
    "reset_peak_memory_stats", "mem_get_info", "memory_reserved", "max_memory_reserved", "empty_cache", "Stream", "Event", "stream", "current_stream", "default_stream",
    "set_config", "config", "report", "report_scope", "reset_report", "RunReport", "profiler",
]

_local = threading.local()


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
    return getattr(_local, "device", 0)


def set_device(index: Any) -> None:
    _local.device = _check_index(index)


@contextlib.contextmanager
def _device_ctx(index: Any) -> Iterator[None]:
    prev = current_device()
    set_device(index)
    try:
        yield
    finally:
        _local.device = prev


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


# ---- RNG: the host generator ------------------------------------------------------------------
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: Any = "neuron") -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "neuron") -> None:
    torch.default_generator.set_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True


# ---- memory ---------------------------------------------------------------------------------
def _memory(device: Any) -> memory.MemoryStats:
    index = _check_index(device)  # first: it may configure the pool
    return memory.pool.devices[index]


def memory_allocated(device: Any = None) -> int:
    """Bytes of the device's HBM share held by live tensors."""
    return _memory(device).allocated


def max_memory_allocated(device: Any = None) -> int:
    return _memory(device).peak


def memory_stats(device: Any = None) -> dict[str, int]:
    return _memory(device).stats()


def reset_peak_memory_stats(device: Any = None) -> None:
    mem = _memory(device)
    mem.peak = mem.allocated


def memory_reserved(device: Any = None) -> int:
    """Equal to :func:`memory_allocated`: the device has no caching allocator holding freed blocks."""
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def empty_cache() -> None:
    """Nothing to release (no caching allocator); here so CUDA-style scripts run unchanged."""


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device's HBM share."""
    mem = _memory(device)
    return mem.capacity - mem.allocated, mem.capacity


# ---- streams and events in simulated time -------------------------------------------------------
_stream_ids = itertools.count(1)
_stream_lock = threading.Lock()


def _new_stream_id() -> int:
    with _stream_lock:
        return next(_stream_ids)


class Stream:
    """A queue of work on one NeuronCore; streams of a core overlap on its simulated timeline."""

    def __init__(self, device: Any = None, priority: int = 0, *, _id: int | None = None):
        self.device_index = _check_index(device)
        self.priority = priority
        self.stream_id = _new_stream_id() if _id is None else _id

    @property
    def device(self) -> torch.device:
        return torch.device("neuron", self.device_index)

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
    runtime().device.cores[s.device_index].current_stream = s.stream_id


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
        self._recorder = runtime().device.open_scope(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._recorder is not None
        self.report = runtime().device.close_scope(self._recorder)


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
