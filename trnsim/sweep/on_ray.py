"""Sweep points as Ray tasks: ``trnsim sweep spec.yaml --executor ray [--address HOST:PORT]``.

Ray schedules the points (one CPU each) over its cluster; this module only submits them and
hands each result back as it arrives, so results stream into the same file under the same lock,
resume and torn-row rules as on the local pool (:func:`trnsim.sweep.run_sweep` owns the file).

* Without an address a local Ray instance of ``jobs`` CPUs is started for the sweep and shut down
  after it. With one, the sweep joins that cluster (``ray start --head`` on one machine, ``ray
  start --address=HOST:PORT`` on the others); every node needs the same trnsim installed, and a
  spec's ``file.py:function`` kernels and config files must be at the same path on every node.
* At most twice the cluster's CPUs of points are in flight at once, so Ctrl-C has little to
  cancel and a huge sweep does not flood the scheduler.
* A point whose worker fails (the task raised, its worker process died, its node was lost, Ray
  killed it for memory) is recorded with ``error`` = ``worker failed: ...`` instead of being
  lost; a rerun of the same command runs those points again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable

from ..config import ConfigError, clip_text
from ..config.extras import require

__all__ = ["start_ray", "run_on_ray", "CONNECT_SECONDS"]

#: how long ``--address`` may take to answer before the sweep gives up, seconds
CONNECT_SECONDS = 20.0

_OBJECT_STORE = 256 << 20  # bytes for a local instance's object store: results are a few hundred bytes


def _absolute(task: Any) -> Any:
    """A task whose paths do not depend on the worker's working directory."""
    base = os.path.abspath(task.base_dir)
    config = os.path.abspath(task.config) if os.path.exists(task.config) else task.config
    system = task.system
    if system is not None and os.path.exists(system):
        system = os.path.abspath(system)
    return replace(task, base_dir=base, config=config, system=system)


def _failure(e: BaseException, prefix: str) -> str:
    cause = getattr(e, "cause", None)  # a RayTaskError carries what the task raised
    err = cause if isinstance(cause, BaseException) else e
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{prefix}{type(err).__name__}: {clip_text(text, 300)}"


def _reach(address: str, timeout: float) -> None:
    """Refuse an ``--address`` that nothing answers at within ``timeout`` seconds, before Ray is
    asked: Ray retries a dead or unroutable cluster for ever, logging a line every few seconds."""
    import socket

    shown = clip_text(address)
    hostport = address.split("://", 1)[-1].rstrip("/")
    if hostport in ("auto", "local"):
        return  # Ray finds (or starts) the cluster of this machine itself
    host, sep, port_text = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--address {shown}: expected HOST:PORT of a Ray cluster's head (ray start --head), "
                          f"e.g. 10.0.0.1:6379")
    try:
        socket.create_connection((host, int(port_text)), timeout=timeout).close()
    except socket.timeout:
        raise ConfigError(f"--address {shown}: no answer from a Ray cluster there within {timeout:g} s (is the head "
                          f"running and the port reachable? --timeout waits longer)") from None
    except OSError as e:
        why = e.strerror or (str(e.args[-1]) if e.args else type(e).__name__)
        raise ConfigError(f"--address {shown}: cannot reach a Ray cluster there ({why})") from None


def start_ray(jobs: int, address: str | None, timeout: float = CONNECT_SECONDS) -> bool:
    """Join the Ray cluster at ``address`` (reachable within ``timeout`` seconds) or start a
    local instance of ``jobs`` CPUs; returns whether this call started Ray (and so must shut it
    down: :func:`run_on_ray` does). Failures are one-line :class:`ConfigError`\\ s."""
    import importlib.util

    if address and importlib.util.find_spec("ray") is not None:
        _reach(address, timeout)  # first: importing Ray takes seconds
    ray = require("ray", "ray", "--executor ray")
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=jobs, object_store_memory=_OBJECT_STORE, **options)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        where = f"the Ray cluster at {clip_text(address)}" if address else "a local Ray instance"
        raise ConfigError(f"--executor ray: cannot start or join {where} "
                          f"({type(e).__name__}: {clip_text(' '.join(str(e).split()), 200)})") from None
    return True


def run_on_ray(tasks: list[Any], jobs: int, run_point: Callable[[Any], dict[str, Any]],
               record: Callable[[Any, dict[str, Any]], None], stopped: Callable[[str, bool], BaseException],
               failed: str) -> None:
    """Run ``run_point(task)`` for each of ``tasks`` (:class:`trnsim.sweep._Task`) as Ray tasks on
    the Ray that :func:`start_ray` joined (the caller shuts it down), calling ``record(point,
    row)`` for each as it finishes (a failed worker's row: ``error`` = ``failed`` + what went
    wrong); Ctrl-C cancels what is in flight and raises ``stopped(...)``."""
    ray = require("ray", "ray", "--executor ray")

    remote = ray.remote(num_cpus=1, max_retries=1)(run_point)
    pending: dict[Any, Any] = {}
    try:
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", jobs)))
        queue = iter(tasks)

        def submit() -> None:
            task = next(queue, None)
            if task is not None:
                pending[remote.remote(_absolute(task))] = task.point

        for _ in range(window):
            submit()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                point = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:
                    result = {"error": _failure(e, failed)}
                record(point, result)
                submit()
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise stopped("interrupted", True) from None
