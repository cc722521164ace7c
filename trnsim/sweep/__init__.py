"""Design-space sweeps: many chip variants x kernels x shapes, timing-only, into one CSV or Parquet file.

A spec is a YAML file::

    config: trn2                       # base config: a name or a YAML path (relative to the spec)
    grid:                              # dotted override -> values; the cartesian product is
      core.sbuf.partition_bytes: [192KiB, 224KiB]   # the set of chip variants
      core.tensor.clock: [2.4GHz, 2.8GHz]
    kernels:
      - {name: matmul, shapes: [512x1024x1024], dtype: bf16, params: {}}
      - {name: ../../examples/softmax_kernel.py:build_softmax, shape: 1024x2048}
    out: results.csv                   # optional; default <spec name>.csv beside the spec (.parquet: Parquet)

The whole spec is checked before any point runs (every variant loads, every kernel resolves and
builds once on the base config), so a typo costs a one-line error, not half a sweep. Each
finished point is appended to the results at once; a rerun skips the points already there, so an
interrupted sweep resumes where it stopped. Points run on a local process pool or, with
``executor="ray"``, on a Ray cluster (:mod:`trnsim.sweep_ray`).

This module holds no rendering: the CLI draws the progress bar and the summary table.
"""

from __future__ import annotations

import csv
import io
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..config import ConfigError, clip_text
from ..config.extras import require
from ..config.files import OutputError, check_output, lock_exclusive, write_atomic
from ..isa import KernelError
from ..sim.metrics import is_parquet, read_sweep_parquet, write_sweep_parquet
from ..sim.report import bound_of  # the one definition (re-exported here: an old name)
from .kernels import KernelRef, resolve_kernel, shape_text  # noqa: F401 - their own modules; re-exported
from .spec import (DEFAULT_MAX_POINTS, KERNEL_KEYS, MAX_COLLECTIVE_RANKS, SPEC_KEYS, Point, SweepSpec,  # noqa: F401
                   check_collective_bytes, check_collective_ranks, load_chip_variant, load_spec, load_system_variant,
                   params_text)

__all__ = ["KernelRef", "Point", "SweepSpec", "SweepResult", "SweepStopped", "resolve_kernel", "load_spec", "run_sweep", "check_jobs",
           "bound_of", "check_collective_bytes", "check_collective_ranks", "MAX_COLLECTIVE_RANKS", "DEFAULT_MAX_POINTS"]


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    config: str
    base_dir: str
    point: Point
    system: str | None = None


def run_point(task: _Task) -> dict[str, Any]:
    """Simulate one point timing-only and return its CSV row (an ``error`` cell instead of
    figures when this variant cannot build or run the kernel, e.g. SBUF too small)."""
    from ..sim.chip import Chip

    pt = task.point
    row: dict[str, Any] = {"error": ""}
    if pt.kind == "estimate":
        from .estimates import run_estimate_point

        return run_estimate_point(load_system_variant(task.system, pt.variant), pt.kernel, pt.shape, pt.dtype,  # type: ignore[arg-type]
                                  dict(pt.params))
    if pt.kind == "collective":
        from ..collectives.sweep_points import run_collective_point

        return run_collective_point(load_system_variant(task.system, pt.variant), pt.kernel, pt.shape,  # type: ignore[arg-type]
                                    pt.dtype, dict(pt.params))
    try:
        cfg = load_chip_variant(task.config, pt.variant) if task.system is None else load_system_variant(task.system, pt.variant).chip
        ref = resolve_kernel(pt.kernel, Path(task.base_dir))
        kernel = ref.make(pt.shape, pt.dtype or None, cfg, dict(pt.params))
        rep = Chip(cfg).run(kernel, timing_only=True).report
    except (KernelError, ConfigError) as e:
        row["error"] = str(e)
        return row
    row.update({
        "cycles": round(rep.total_cycles, 1), "us": round(rep.total_us, 4),
        "mfu_percent": round(rep.mfu_estimated_percent, 2), "mbu_percent": round(rep.mbu_estimated_percent, 2),
        "bound": bound_of(rep),
        **{f"{e.lower()}_active_percent": round(s.active_percent, 2) for e, s in rep.engines.items()},
        "dma_active_percent": round(rep.dma.active_percent, 2),
        "instructions": sum(rep.instruction_counts.values()), "hbm_bytes": rep.hbm_read_bytes + rep.hbm_write_bytes,
        "dma_bytes": rep.dma.bytes, "matmul_flops": rep.matmul_flops,
    })
    return row


class SweepStopped(Exception):
    """A sweep stopped before its last point (Ctrl-C, or a worker process that died). The rows
    finished so far are in the results file; a rerun resumes. ``str()`` is the one-line summary;
    ``interrupted`` tells Ctrl-C (exit status 130) from a failure (status 1)."""

    def __init__(self, message: str, interrupted: bool):
        super().__init__(message)
        self.interrupted = interrupted


def _row_line(columns: Sequence[str], row: Mapping[str, str]) -> bytes:
    """One CSV record as one physical line (cells never hold a newline), so a torn write can only
    ever damage the last line of the file, which :func:`_read_done` then recognises."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(
        [" ".join(str(row.get(c, "")).splitlines()) for c in columns])
    return buf.getvalue().encode("utf-8")


def _read_done(spec: SweepSpec, f: Any, shown: str) -> tuple[dict[tuple[str, ...], dict[str, str]] | None, bool]:
    """(the rows already in the locked results file ``f`` by point key, or None when it is empty;
    whether a torn last line was dropped). Every record is one line ending in a newline, so text
    after the last newline is what a kill or a full disk left mid-write: the file is cut back
    to its last complete row, and that point runs again."""
    f.seek(0)
    data = f.read()
    cut = data.rfind(b"\n") + 1
    torn = cut < len(data)
    if torn:
        f.truncate(cut)
        data = data[:cut]
    if not data:
        return None, torn
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{shown}: byte {e.start + 1} is not UTF-8 text; not a results file of trnsim sweep: "
                          f"delete it or choose another --out") from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header != spec.columns:
        raise ConfigError(f"{shown}: its columns ({clip_text(', '.join(header or []), 200)}) are not this spec's "
                          f"({', '.join(spec.columns)}); delete it or choose another --out")
    rows: dict[tuple[str, ...], dict[str, str]] = {}
    n = len(spec.columns)
    for cells in reader:
        if len(cells) != n:
            raise ConfigError(f"{shown} line {reader.line_num}: {len(cells)} cells, expected {n}; the file is damaged: "
                              f"delete that line to rerun its point, or choose another --out")
        row = dict(zip(spec.columns, cells))
        rows[tuple(row[c] for c in spec.key_columns)] = row
    return rows, torn


@dataclass(frozen=True)
class SweepResult:
    rows: list[dict[str, str]]  # every point's CSV row (as text), in the spec's point order
    ran: int  # points simulated by this run; the others came from the CSV of an earlier run
    torn: bool = False  # the results file ended in a torn row (a killed write), dropped and rerun


def _worker_init(sweep: int, forked: bool, inherited_fd: int) -> None:
    """Pool workers: die with the sweep (process ``sweep``), leave Ctrl-C to it, drop its results
    file (``inherited_fd``, -1 unless ``forked``).

    A worker outlives a SIGKILLed sweep otherwise, forever, holding its pipes. A forked worker is
    the sweep's child: Linux kills it at once (PR_SET_PDEATHSIG), and a watchdog thread sees it
    reparented within half a second (elsewhere, or if the sweep died before the prctl). A
    forkserver or spawned worker's parent is another process (which, for forkserver, waits for
    its workers), so the watchdog also watches the sweep itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sweep stops itself and its workers
    if inherited_fd >= 0:
        try:
            os.close(inherited_fd)  # a forked worker must not keep the sweep's lock alive
        except OSError:
            pass
    if forked and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            pass
    ppid = os.getppid()
    if forked and ppid != sweep:
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != ppid or not _alive(sweep):
                os._exit(1)
            threading.Event().wait(0.5)

    threading.Thread(target=watch, name="trnsim-sweep-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now (they ignore SIGINT). A second Ctrl-C
    meanwhile is ignored: this takes a moment, and a traceback from it would help nobody."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        procs = list((getattr(pool, "_processes", None) or {}).values())  # no public way before 3.14
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        # with the workers gone the pool's manager thread ends; joining it now keeps its pipe from
        # being woken after it is closed at interpreter exit (an "Exception ignored" traceback)
        pool.shutdown(wait=True)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


#: The ``error`` of a point whose worker failed (crashed, lost, raised): a rerun runs it again,
#: unlike a point error (e.g. SBUF too small for its tiles), which is the point's result.
WORKER_FAILED = "worker failed: "
#: Parquet results are rewritten (atomically) at most this often while a sweep runs, and at its end
PARQUET_FLUSH_SECONDS = 5.0
EXECUTORS = ("pool", "ray")


def _open_locked(path: Path, shown: str) -> Any:
    """``path`` opened for appending and locked against other sweeps. The file may be unlinked
    by the sweep that held it (a Parquet sweep's journal, when it ends): a lock taken on a file
    no longer at ``path`` is dropped and taken again on the one that is."""
    for _ in range(100):
        try:
            f = open(path, "a+b")
        except OSError as e:
            raise OutputError(f"sweep results {shown}: cannot write it ({e.strerror or type(e).__name__})") from None
        try:
            lock_exclusive(f, shown, "sweep results", holder="another trnsim sweep")
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
            except FileNotFoundError:
                same = False
        except BaseException:
            f.close()
            raise
        if same:
            return f
        f.close()
    raise OutputError(f"sweep results {shown}: cannot lock it (its lock file keeps being replaced)")  # pragma: no cover


def check_jobs(jobs: int | None) -> int:
    """The number of worker processes a sweep runs (``None``: one per CPU), or :class:`ConfigError`
    for one that is not a whole number from 1 to ``max(8, 4 x CPUs)``."""
    cpus = os.cpu_count() or 1
    if jobs is None:
        return cpus
    max_jobs = max(8, 4 * cpus)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= max_jobs:
        raise ConfigError(f"--jobs {jobs}: expected a positive number of worker processes, at most {max_jobs} "
                          f"on this machine ({cpus} CPUs)" if isinstance(jobs, int) and jobs > max_jobs else
                          f"--jobs {jobs}: expected a positive number of worker processes")
    return jobs


def run_sweep(spec: SweepSpec, jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None, executor: str = "pool",
              address: str | None = None, timeout: float | None = None) -> SweepResult:
    """Run every point of ``spec`` not already in its results file, adding each row as it finishes.

    ``jobs`` worker processes (default: one per CPU; 1 runs in this process) on the local
    ``executor="pool"``, or ``executor="ray"``: the points run as Ray tasks on the cluster at
    ``address`` (``HOST:PORT``, which must answer within ``timeout`` seconds; None starts a
    local Ray instance of ``jobs`` CPUs), see :mod:`trnsim.sweep_ray`; Ray is reached before the
    results file is touched, so a cluster that cannot be joined leaves nothing behind. ``progress(done, total)`` is called once before and after each point.

    The results file is safe to kill, share and resume: it is locked against a second sweep
    (an :class:`~trnsim.config.files.OutputError`), each row is appended whole, a torn last row is
    dropped and rerun, and Ctrl-C or a dead worker ends the sweep with :class:`SweepStopped`
    after every finished row is in the file. A ``.parquet`` results file is rewritten
    atomically (every :data:`PARQUET_FLUSH_SECONDS` and at the end) from a journal beside it,
    ``.<name>.journal``, which takes each row at once with the CSV's guarantees and is removed
    when the sweep ends; a killed Parquet sweep's rows are in the two together."""
    jobs = check_jobs(jobs)
    if executor not in EXECUTORS:
        raise ConfigError(f"--executor {clip_text(executor)}: expected one of {', '.join(EXECUTORS)}")
    if address is not None and executor != "ray":
        raise ConfigError(f"--address {clip_text(address)}: a cluster address needs --executor ray")
    if timeout is not None and (address is None or not 0 < timeout <= 3600):
        raise ConfigError(f"--timeout {timeout:g}: expected seconds in 0..3600 for reaching --address"
                          if address is not None else "--timeout: it bounds reaching --address; give one")
    out = spec.out
    shown = str(out)
    parquet = is_parquet(out)
    if parquet:
        require("pyarrow.parquet", "metrics", f"sweep results {shown}")
    check_output(out, "sweep results", missing_dirs=True)
    ray_started = False
    if executor == "ray":
        from .on_ray import CONNECT_SECONDS, start_ray

        ray_started = start_ray(jobs, address, CONNECT_SECONDS if timeout is None else timeout)
    try:
        return _run_into(spec, out, parquet, jobs, progress, executor)
    finally:
        if ray_started:
            import ray

            ray.shutdown()


def _run_into(spec: SweepSpec, out: Path, parquet: bool, jobs: int, progress: Callable[[int, int], None] | None,
              executor: str) -> SweepResult:
    """:func:`run_sweep` once its options are checked and Ray (if asked for) is up."""
    shown = str(out)
    store = out.with_name(f".{out.name}.journal") if parquet else out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"sweep results {shown}: cannot write it ({e.strerror or type(e).__name__})") from None
    f = _open_locked(store, shown)
    with f:
        existing, torn = _read_done(spec, f, shown if not parquet else str(store))
        done: dict[tuple[str, ...], dict[str, str]] = {}
        if parquet and out.exists():
            columns, old = read_sweep_parquet(out)
            if columns != spec.columns:
                raise ConfigError(f"{shown}: its columns ({clip_text(', '.join(columns), 200)}) are not this "
                                  f"spec's ({', '.join(spec.columns)}); delete it or choose another --out")
            done.update((tuple(r[c] for c in spec.key_columns), r) for r in old)
        journal_rows = len(existing or {})
        done.update(existing or {})
        todo = [pt for pt in spec.points
                if pt.key() not in done or done[pt.key()]["error"].startswith(WORKER_FAILED)]
        total, finished = len(spec.points), len(spec.points) - len(todo)
        if progress:
            progress(finished, total)
        rows: dict[tuple[str, ...], dict[str, str]] = dict(done)
        base_dir = str(spec.path.parent)
        header = _row_line(spec.columns, {c: c for c in spec.columns})
        if existing is None:
            f.write(header)
            f.flush()
        ran = 0
        unsaved = journal_rows  # rows in the journal, not yet in the Parquet file
        last_flush = time.monotonic()

        def flush() -> None:
            """Rewrite the Parquet file from every row (the spec's points in order, then rows of
            other points an earlier spec left), then empty the journal."""
            nonlocal unsaved, last_flush
            keys = [pt.key() for pt in spec.points]
            ordered = [rows[k] for k in keys if k in rows]
            wanted = set(keys)
            ordered += [r for k, r in rows.items() if k not in wanted]
            meta = {"kind": "sweep", "spec": str(spec.path), "config": spec.config, "grid": spec.grid}
            write_atomic(out, lambda g: write_sweep_parquet(g, spec.columns, spec.key_columns, ordered, meta),
                         "sweep results", text=False)
            f.seek(0)
            f.truncate(0)
            f.write(header)
            f.flush()
            unsaved = 0
            last_flush = time.monotonic()

        def record(pt: Point, result: dict[str, Any]) -> None:
            nonlocal finished, ran, unsaved
            # as text, as the CSV holds it, so fresh and resumed rows look alike
            row = {c: "" for c in spec.columns}
            row.update(zip(spec.key_columns, pt.key()))
            row.update((k, " ".join(str(v).splitlines())) for k, v in result.items())
            line = _row_line(spec.columns, row)
            masked = _block_sigint()
            try:  # a Ctrl-C waits until the row is whole in the file
                f.write(line)
                f.flush()
            finally:
                _restore_sigint(masked)
            rows[pt.key()] = row
            finished += 1
            ran += 1
            unsaved += 1
            if parquet and time.monotonic() - last_flush >= PARQUET_FLUSH_SECONDS:
                flush()
            if progress:
                progress(finished, total)

        def stopped(why: str, interrupted: bool) -> SweepStopped:
            return SweepStopped(f"sweep {why}: {finished} of {total} points are in {shown} ({ran} run now); "
                                f"run the same command again to resume", interrupted)

        tasks = [_Task(spec.config, base_dir, pt, spec.system) for pt in todo]
        try:
            if executor == "ray":
                from .on_ray import run_on_ray

                run_on_ray(tasks, jobs, run_point, record, stopped, WORKER_FAILED)
            elif jobs == 1 or len(tasks) <= 1:
                try:
                    for t in tasks:
                        record(t.point, run_point(t))
                except KeyboardInterrupt:
                    raise stopped("interrupted", True) from None
            else:
                _run_on_pool(tasks, jobs, f, record, stopped)
        finally:
            if parquet and unsaved:
                flush()  # whatever ended the sweep, its rows are in the Parquet file
        if parquet:
            os.unlink(store)  # still locked: a sweep that opened it meanwhile finds it gone and retries
    return SweepResult([rows[pt.key()] for pt in spec.points], ran, torn)


def _pool_context() -> Any:
    """The platform's default start method, unless it is fork and this process runs other threads
    (Ray's driver after a Ray sweep, OpenMP's pool, a user's own): a forked child inherits every lock
    those threads held at the fork, unlocked by nobody, and can hang on the first one it takes.
    forkserver starts workers from a clean single-threaded server instead."""
    ctx = multiprocessing.get_context()
    if ctx.get_start_method() == "fork" and _threads_running() > 1:
        return multiprocessing.get_context("forkserver")
    return ctx


def _threads_running() -> int:
    """This process's threads, C ones included (Ray's and OpenMP's are not Python threads)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _run_on_pool(tasks: list[_Task], jobs: int, f: Any, record: Callable[[Point, dict[str, Any]], None],
                 stopped: Callable[[str, bool], SweepStopped]) -> None:
    """The points on a local process pool of ``jobs`` workers, each row recorded as it finishes."""
    ctx = _pool_context()
    # a forked worker is this process's child and holds a copy of the locked file's
    # descriptor; a spawned or forkserver one is neither
    forked = ctx.get_start_method() == "fork"
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx, initializer=_worker_init,
                               initargs=(os.getpid(), forked, f.fileno() if forked else -1))
    try:
        pending = {pool.submit(run_point, t): t.point for t in tasks}
        while pending:
            finished_now, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished_now:
                record(pending.pop(fut), fut.result())
    except KeyboardInterrupt:
        _stop_pool(pool)
        raise stopped("interrupted", True) from None
    except BrokenProcessPool:
        _stop_pool(pool)
        raise stopped("stopped: a worker process died (out of memory, or killed)", False) from None
    except BaseException:
        _stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def _block_sigint() -> bool:
    """Hold SIGINT back (main thread, POSIX) so it cannot tear a row; True if it was held."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return True


def _restore_sigint(masked: bool) -> None:
    if masked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a held Ctrl-C arrives now
