"""Before the interpreter finalizes, autograd's device threads finish what they hold.

A backward pass on neuron tensors runs on autograd's thread for the device (``pt_autograd_N``), as
on CUDA. That thread drops its last reference to the finished pass (its GraphTask) just after it
wakes the caller, and the drop can release Python objects (torch 2.13 stashes a context object in
the pass's thread-local state; tensors with Python objects), for which it takes the GIL. If the
thread is kept off the CPU until the interpreter is finalizing, taking the GIL ends the thread
(``PyThread_exit_thread``) inside a C++ destructor, and the process aborts: "terminate called
without an active exception", after a script that did everything right (a torchrun rank that ends
with a backward pass on a loaded machine: CI saw it once in ~50 runs).

:func:`settle` runs at exit (an ``atexit`` handler: before finalization) and waits, with the GIL
free, until every autograd device thread is asleep (state S, its context-switch counts unchanged
over a poll interval): the thread has dropped what it held and waits in its queue. It reads
``/proc`` (Linux); elsewhere, and in a process that never used the device, it returns at once.
The wait is bounded (:data:`LIMIT_S`): a thread still busy then (a backward pass another thread
left running) is left as it was.
"""

from __future__ import annotations

import atexit
import os
import time

__all__ = ["settle", "register"]

#: how long exit waits at most for the device threads (seconds)
LIMIT_S = 10.0
#: how often their state is read (seconds); two equal reads in a row, all asleep, end the wait
POLL_S = 0.002

_TASKS = "/proc/self/task"
_registered = [False]


def _device_threads() -> list[str]:
    """The thread ids of autograd's device threads (named ``pt_autograd_<device>``)."""
    out = []
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().startswith("pt_autograd_"):
                    out.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _state(tid: str) -> tuple[str, str, str] | None:
    """(scheduler state, voluntary and involuntary context switches) of a thread; None if it ended."""
    state = vol = invol = ""
    try:
        with open(f"{_TASKS}/{tid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    state = line.split()[1]
                elif line.startswith("voluntary_ctxt_switches:"):
                    vol = line.split()[1]
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol = line.split()[1]
    except OSError:
        return None
    return state, vol, invol


def settle(limit_s: float = LIMIT_S) -> bool:
    """Wait until autograd's device threads are asleep and stay so over a poll (True), or until
    ``limit_s`` has passed (False). Returns True at once when there are none."""
    tids = _device_threads()
    if not tids:
        return True
    deadline = time.monotonic() + limit_s
    before = None
    while True:
        time.sleep(POLL_S)  # the GIL is free meanwhile: a thread waiting for it takes it
        now = {tid: _state(tid) for tid in tids}
        if now == before and all(s is None or s[0] == "S" for s in now.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        before = now


def _at_exit() -> None:
    from ..runtime import is_initialized

    if is_initialized():  # a neuron tensor was made: its backward passes ran on the device threads
        settle()


def register() -> None:
    """Run :func:`settle` at exit (once per process)."""
    if not _registered[0]:
        _registered[0] = True
        atexit.register(_at_exit)
