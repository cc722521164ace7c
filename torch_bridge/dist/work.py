"""A collective's Work and its future: waiting on either makes the current stream wait for the
collective (as a CUDA stream waits for NCCL's); a collective issued inside a backward pass and
never waited is waited for by the current stream at the end of that backward."""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .. import _torch
from ..runtime import runtime
from .clock import Call

if TYPE_CHECKING:
    from .process_group import NeuronProcessGroup

# ---------------------------------------------------------------------------------------------
# Work and futures
# ---------------------------------------------------------------------------------------------


class _Future(torch.futures.Future):  # type: ignore[misc]
    """A Work's future: waiting on it from Python makes the current stream wait for the
    collective, as ``Work.wait()`` does (C++ callers wait on the value only)."""

    def __init__(self, work: "Work"):
        super().__init__()
        self._work = weakref.ref(work)

    def wait(self) -> Any:  # type: ignore[override]
        w = self._work()
        if w is not None:
            w._resolve()
            w._order()
        return super().wait()


_WorkBase = _torch.work_base()


class Work(_WorkBase):  # type: ignore[misc, valid-type]
    """One call's Work: the gloo works moving its values, the CPU views they use (kept alive:
    a view does not own its memory), a ``finish`` run once when the values are in (AVG's
    division, copying a reduce-scatter's chunk out), and where the call ends on the rank's
    timeline (None: no simulated time, a CPU call). A point-to-point call's timing is resolved
    when waited for (``resolve``), once its peer's arrival is in."""

    def __init__(self, pg: "NeuronProcessGroup", call: Call, inner: Sequence[Any], result: Any, keep: Any,
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
_backward_works: dict[int, list[Work]] = {}


def _after_backward(task: int) -> None:
    for w in _backward_works.pop(task, []):
        if not w.waited and w.end is not None:
            dev = runtime().device
            dev.stream_wait(w.call.core, dev.cores[w.call.core].current_stream, w.end)


def note_backward(work: Work) -> None:
    task = _torch.graph_task_id()
    if task < 0 or work.end is None:
        return
    works = _backward_works.get(task)
    if works is None:
        works = _backward_works[task] = []
        _torch.at_end_of_backward(lambda: _after_backward(task))
    works.append(work)
