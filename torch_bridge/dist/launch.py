"""``trnsim run --nproc N script.py``: a script on N ranks, through torchrun's launcher, and one
merged report.

The launcher is torch's own (``torch.distributed.launcher.api.elastic_launch``, what
``torchrun --standalone`` runs): a c10d rendezvous on localhost, one worker per rank (forked by a forkserver),
the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), and the whole
group stopped when one rank fails. Each worker fixes the chip and the system, runs the script
as ``__main__`` and hands back its :class:`~trnsim.report.RunReport` (the launcher returns each
worker's return value); the parent merges them (:func:`trnsim.ranks.merge_ranks`).

A rank that fails with a :class:`~torch_bridge.distributed.NeuronDistError` (bad use: ranks that
disagree, a world the system cannot hold, a timeout) is reported as that one line; any other
failure prints the rank's traceback (from the worker) and a line naming the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trnsim.config import is_system_key, load_system
from trnsim.device.ranks import MultiRankReport, link_segments, merge_ranks, write_rank_trace

__all__ = ["run_ranks", "RankFailure"]

_DIST_ERROR = "NeuronDistError"


@dataclass
class RankFailure(Exception):
    """A rank failed: ``message`` is the one line to print, ``usage`` whether it was bad use
    of the distributed API (exit status 2) rather than the script's own failure (status 1)."""

    message: str
    usage: bool
    status: int = 1

    def __str__(self) -> str:
        return self.message


def _worker(script: str, args: Sequence[str], config: str | None, chip_overrides: Sequence[str], system: str,
            system_overrides: Sequence[str], trace: bool, timeout: float | None, exits: str,
            environ: dict[str, str]) -> dict[str, Any]:
    """One rank (runs in a worker process the launcher started)."""
    _adopt_environ(environ)
    import torch_bridge
    from torch_bridge import runtime
    from torch_bridge.neuron import module as device
    from torch_bridge.dist import process_group as nd

    torch_bridge.register()
    for stream in (sys.stdout, sys.stderr):  # a rank's line reaches the shared terminal whole, in one write
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)
    if config is not None or chip_overrides:
        runtime.set_config(config or os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2", list(chip_overrides))
    nd.set_system(system, list(system_overrides))
    if timeout is not None:
        os.environ["TRNSIM_DIST_TIMEOUT"] = str(timeout)
    nd.enable_trace(trace)
    nd.record_steps()
    device.reset_report(trace=True)  # events: the overlap of collectives and compute is measured on them
    saved_argv = sys.argv
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    how = "finished its script"
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            how = f"exited with status {e.code if isinstance(e.code, int) else 1}"
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            raise
    except nd.NeuronDistError:
        how = "failed at a collective"
        raise  # one line, printed by the parent (every rank of the group raises the same)
    except BaseException as e:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(e, (SignalException, KeyboardInterrupt)):  # the launcher stopping this rank
            how = "was stopped"
            raise
        what = " ".join(str(e).split())
        how = f"raised {type(e).__name__}" + (f": {what[:200]}" if what else "")
        if isinstance(e, Exception):
            traceback.print_exc()
        raise
    finally:
        sys.argv = saved_argv
        sys.stdout.flush()  # this rank's prints whole, before another rank's (the launcher does not tee)
        _leave(nd, how, exits)
    for i in range(device.device_count()):
        device.synchronize(i)
    info = nd.rank_info()
    rank = int(info.get("rank", os.environ.get("RANK", "0")))
    sysc = nd.system()
    rep = device.report()
    if not trace:  # the launcher merges rows and events: only a trace draws the kernels' engine lanes
        rep = dataclasses.replace(rep, events=tuple(dataclasses.replace(e, reports=()) for e in rep.events))
    links = link_segments(rank, nd.collective_log(), sysc.ranks_per_chip) if trace else []
    return {"rank": rank, "report": rep, "chip": rank // sysc.ranks_per_chip, "steps": nd.step_ticks(),
            "system": sysc.name, "links": links}


def _leave(nd: Any, how: str, exits: str) -> None:
    """The script is over on this rank (``how``: "finished its script", "raised RuntimeError:
    ...", "exited with status 7"): say so to the other ranks and to the launcher (a file in
    ``exits``: the launcher stops the group at the first failure it sees, which is often a peer
    left waiting at a collective, before this rank's own failure is recorded), and close its
    process groups, so a rank still waiting for it fails at once, naming it, instead of waiting
    for the timeout (this process lives on until the launcher has its report)."""
    import torch.distributed as dist

    rank = os.environ.get("RANK", "0")
    try:
        Path(exits, f"rank{rank}").write_text(how)
    except OSError:  # the launcher is gone; nobody to tell
        pass
    nd.mark_exit(how)
    if dist.is_initialized():
        dist.destroy_process_group()


def _text(failure: Any) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return str(msg or "").strip()


def _is_dist_error(text: str) -> bool:
    return text.startswith(_DIST_ERROR) or f".{_DIST_ERROR}:" in text.split(" ")[0]


def _failure(err: Any, exits: Path) -> RankFailure:
    """The one line for the launcher's ChildFailedError. The rank whose own script failed
    (``exits`` holds how each rank's script ended) is the one named: its peers then fail at the
    collective it left, often before its own failure reaches the launcher; a failure at a
    collective is named only when no script failed (bad use of the API)."""
    ended = {}
    for f in exits.glob("rank*"):
        try:
            ended[int(f.name[4:])] = f.read_text()
        except (OSError, ValueError):
            continue
    for rank, how in sorted(ended.items()):
        if how.startswith("exited with status "):
            code = int(how.rsplit(" ", 1)[1]) if how.rsplit(" ", 1)[1].isdigit() else 1
            return RankFailure(f"rank {rank} {how}; the other ranks were stopped", False, code or 1)
    for rank, how in sorted(ended.items()):
        if how.startswith("raised "):
            return RankFailure(f"rank {rank} failed ({how[7:]}); the other ranks were stopped", False, 1)
    failures = sorted(err.failures.items(), key=lambda rf: (rf[1].timestamp, rf[0]))
    own = [(r, f) for r, f in failures if not _is_dist_error(_text(f))]
    if not own:
        return RankFailure(_text(failures[0][1]).split(":", 1)[1].strip(), True, 2)
    rank, failure = own[0]
    text, code = _text(failure), failure.exitcode
    others = "; the other ranks were stopped"
    if code and code < 0:
        return RankFailure(f"rank {rank} was stopped by signal {-code}{others}", False, 1)
    first = text.splitlines()[0] if text else ""
    if not first or first.startswith(("SystemExit", "To enable traceback")):
        return RankFailure(f"rank {rank} exited with status {code}{others}", False, code or 1)
    return RankFailure(f"rank {rank} failed ({first[:300]}){others}", False, code or 1)


#: what the forkserver imports once, before it forks the workers: torch and what _worker imports
_PRELOAD = ["torch", "torch_bridge", "torch_bridge.runtime", "torch_bridge.neuron.module",
            "torch_bridge.dist.process_group", "torch_bridge.dist.launch"]


def _start_method() -> str:
    """The forkserver where the platform has it, else spawn; never a plain fork.

    A plain fork copied the launcher's process: torch's elastic agent runs its rendezvous
    TCPStore server and keep-alive threads in it, and a lock one of them held at the fork stays
    held in the child forever (a CI run hung: one rank of four idle in its store client's
    constructor, the other three waiting for it in gloo's rendezvous). The forkserver is a fresh
    single-threaded interpreter that imports torch and the bridge once (:data:`_PRELOAD`) and
    forks each worker from itself: the workers still start with torch imported (spawn re-imports
    it in every worker, seconds per rank), and the server costs one import of torch a launch."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.set_forkserver_preload(_PRELOAD)
        return "forkserver"
    return "spawn"


def _trnsim_environ() -> dict[str, str]:
    """This process's ``TRNSIM_*`` variables, handed to each worker: a forkserver's workers
    inherit the server's environment, which is this process's when the server started (a
    process that launches twice may have changed them since)."""
    return {k: v for k, v in os.environ.items() if k.startswith("TRNSIM_")}


def _adopt_environ(environ: dict[str, str]) -> None:
    for k in [k for k in os.environ if k.startswith("TRNSIM_") and k not in environ]:
        del os.environ[k]
    os.environ.update(environ)


def run_ranks(script: str, args: Sequence[str], nproc: int, config: str | None = None,
              overrides: Sequence[str] = (), system: str | None = None, trace: str | None = None,
              timeout: float | None = None) -> MultiRankReport:
    """Run ``script`` on ``nproc`` ranks of ``system`` (default ``TRNSIM_SYSTEM`` or
    trn2.48xlarge) and return the merged report. ``overrides`` are dotted keys of the chip or,
    under ``topology.``/``collectives.``, of the system. Raises :class:`RankFailure` when a rank
    fails, ValueError for a world the system cannot hold, FileNotFoundError for a missing
    script; with ``trace``, writes one Perfetto process per rank with NeuronLink lanes. The
    workers import the calling program's main script, as multiprocessing's spawn does: a script
    that calls this runs it under ``if __name__ == "__main__":``."""
    from trnsim.config.files import AtomicOutput

    from .process_group import DEFAULT_SYSTEM

    if not Path(script).is_file():
        raise FileNotFoundError(f"{script}: a directory, not a Python script" if Path(script).is_dir()
                                else f"no such script: {script}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc {nproc}: expected a whole number of ranks >= 1")
    if system is not None and not system.strip():
        raise ValueError("--system '': expected a system name or a YAML path (leave --system out for "
                         "$TRNSIM_SYSTEM or trn2.48xlarge)")
    system = system or os.environ.get("TRNSIM_SYSTEM", "").strip() or DEFAULT_SYSTEM
    chip_overrides = [o for o in overrides if not is_system_key(o.split("=", 1)[0].strip())]
    sys_overrides = [o for o in overrides if is_system_key(o.split("=", 1)[0].strip())]
    sysc = load_system(system, list(sys_overrides) + chip_overrides)  # a bad name or override fails here
    if config is not None and sysc.chip.name != Path(config).stem and sysc.chip.name != config:
        raise ValueError(f"--config {config}: the system {sysc.name} is built of {sysc.chip.name} chips; choose a "
                         f"{config} system with --system, or leave --config out")
    if nproc > sysc.ranks:
        raise ValueError(f"--nproc {nproc} does not fit {sysc.name}: it has {sysc.ranks} ranks ({sysc.chips} chips x "
                         f"{sysc.ranks_per_chip} logical NeuronCores); use fewer ranks or a larger system (--system)")
    out = AtomicOutput(trace, "--trace") if trace is not None else None  # refused now, not after the run
    start_method = _start_method()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the launcher's own warnings (stopping the other ranks...): trnsim reports a failure in one line
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="trnsim_ranks_") as logs:
            cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                               rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                               monitor_interval=0.1, start_method=start_method,
                               logs_specs=DefaultLogsSpecs(log_dir=logs))
            exits = Path(logs, "exits")
            exits.mkdir()
            try:
                results = elastic_launch(cfg, _worker)(script, list(args), config, chip_overrides, sysc.source,
                                                       sys_overrides, trace is not None, timeout, str(exits),
                                                       _trnsim_environ())
            except ChildFailedError as e:
                raise _failure(e, exits) from None
        by_rank = {r["rank"]: r for r in results.values()}
        merged = merge_ranks(sysc.name, {r: v["report"] for r, v in by_rank.items()},
                             {r: v["chip"] for r, v in by_rank.items()}, {r: v["steps"] for r, v in by_rank.items()})
        if out is not None:
            write_rank_trace(out, merged, {r: v["links"] for r, v in by_rank.items()})
            out = None
        return merged
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
        if out is not None:
            out.discard()
