"""The ``trnsim`` command. The only module that imports rich (with :mod:`trnsim.cli_estimate`, its
``estimate`` command).

    trnsim info [CONFIG] [--set K=V ...] [--json]
    trnsim demo [--config CONFIG] [--set K=V ...]
    trnsim kernel NAME [--shape MxKxN] [--dtype bf16] [--config trn2] [--set K=V ...]
                  [--param K=V ...] [--check] [--schedule | --no-schedule] [--json] [--trace out.json]
                  [--metrics out.parquet] [--plot out.png]
    trnsim kernel file.py:nki_kernel --shape 128x512,128x512 [--dtype bf16] ...   (an @nki.jit kernel)
    trnsim kernel --list [--json]
    trnsim sweep SPEC.yaml [--out results.{csv,parquet}] [--jobs N] [--max-points N]
                  [--executor pool|ray] [--address HOST:PORT [--timeout S]]
    trnsim run SCRIPT.py [ARGS ...] [--config trn3] [--trace out.json [--trace-stack]] [--expand OP ...] [--expand-top N]
                  [--metrics out.parquet] [--plot out.png] [--compare-eager] [--adaptive-eager] [--timing-only]
                  [--host-profile] [--cost-cache] [--json]
    trnsim run --nproc N [--system trn2.48xlarge] [--timeout S] SCRIPT.py [ARGS ...]
    trnsim plot RESULTS.{csv,parquet} --x KEY --y METRIC [--hue KEY] [--where K=V ...] -o out.png
    trnsim collective all-reduce [--system trn2.48xlarge] [--ranks 64] [--bytes 8B:4GiB] [--factor 2]
                  [--algo ring] [--dtype bf16] [--set K=V ...] [--json] [--trace out.json]
    trnsim estimate inference|train --model llama-3.3-70b [--system ...] [--tp 64] ... (trnsim.cli_estimate)
    trnsim validate [CATEGORY|ROW ...] [--quick] [--list] [--json] [--out rows.csv] [--plot out.png] ...
                  (trnsim.cli.validate)

Bad input (unknown config, bad override, a kernel that breaks a hardware rule, an output path
that is a FIFO or device) prints one line ``trnsim: error: ...`` on stderr and exits with status
2. ``trnsim kernel --check`` exits with status 1 when the kernel's outputs do not match its
reference. Ctrl-C stops any command with one line and status 130 (a sweep says what it kept);
a sweep whose worker process dies exits with status 1.
"""

from __future__ import annotations

import signal
import sys


def _interrupted_while_loading(signum: int, frame: Any) -> None:
    """Ctrl-C while the modules below load (a second or two on a busy machine): the one line
    main() prints for Ctrl-C later, not the import machinery's traceback."""
    sys.excepthook = lambda *exc: print("trnsim: interrupted", file=sys.stderr)
    raise KeyboardInterrupt


# only where nobody else took Ctrl-C (the `trnsim` command; not a test runner, not a host program)
_SIGINT = signal.getsignal(signal.SIGINT)
if _SIGINT is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn, Sequence  # noqa: E402

from .base import Out as _Out, UsageError, emit, say_written
from ..config import ChipConfig, ConfigError, clip_text, config_names, format_quantity, load_config
from ..config.extras import MissingExtra
from ..config.files import AtomicOutput, OutputError
from ..isa import KernelError
from ..sim.report import KernelReport, bound_of
from .collective import add_collective_parser, cmd_collective
from .kernel import cmd_kernel, cmd_kernel_list  # noqa: F401
from .render import (REPORT_WIDTH, RUN_REPORT_WIDTH, info_data, print_run_report, render_comparison,  # noqa: F401
                     render_info, render_rank_report, render_report, render_run_report, run_report_width)
from ..sweep import DEFAULT_MAX_POINTS, SweepStopped, check_collective_bytes, check_collective_ranks

if _SIGINT is signal.default_int_handler:
    signal.signal(signal.SIGINT, _SIGINT)

__all__ = ["main", "render_info", "render_report", "render_run_report", "render_rank_report", "print_run_report",
           "bound_of", "render_comparison"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        message = _one_line(message, 300)  # argparse quotes the user's arguments whole
        print(f"trnsim: error: {message} (see '{self.prog} --help')", file=sys.stderr)  # prog: 'trnsim estimate serve'
        raise SystemExit(2)


def _console() -> Any:
    return _Out()


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    if args.json:
        emit(json.dumps(info_data(cfg), indent=2))
    else:
        render_info(cfg, _console())
    return 0


DEMO_STEPS = 30


def cmd_demo(args: argparse.Namespace) -> int:
    """The chip summary, then examples/train_gpt2.py on the virtual chip with its run report and
    one of its kernels up close; without PyTorch, a bf16 matmul kernel and its report."""
    cfg = load_config(args.config, args.set)
    console = _console()
    render_info(cfg, console)
    console.print()
    example = _training_example()
    if isinstance(example, str):
        console.print(f"{example}: showing the kernel demo instead of GPT-2 training", markup=False)
        return _kernel_demo(cfg, console)
    return _training_demo(example, cfg, console)


def _training_example() -> Any:
    """examples/train_gpt2.py loaded as a module, or a one-line reason why it cannot run here."""
    import importlib.util

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import torch_bridge  # noqa: F401  (registers the neuron device where autoload is off)
    except ImportError as e:
        return f"{e.name} is not installed (python3 -m pip install -e '.[demo]' adds PyTorch and transformers)"
    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"
    if not path.is_file():
        return f"{path} is missing (the demo runs from a source checkout: pip install -e .)"
    spec = importlib.util.spec_from_file_location("train_gpt2", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _training_demo(example: Any, cfg: ChipConfig, console: Any) -> int:
    import torch

    from ..sim.chip import Chip
    from ..device import Device, KernelSpec

    if not torch.neuron.is_initialized():
        torch.neuron.set_config(cfg)
    elif torch.neuron.config() != cfg:
        raise UsageError(f"demo: the neuron device already runs {torch.neuron.config().name} in this process")
    batch, seq, embd = 8, 64, 64
    console.print(f"[bold]Demo:[/bold] examples/train_gpt2.py trains a small Hugging Face GPT-2 (2 layers, width "
                  f"{embd}, byte tokens) with AdamW on the virtual {cfg.name}: model.to(\"neuron\") is the only "
                  f"change from a CPU script. {DEMO_STEPS} steps, batch {batch} x {seq} bytes:")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels' reduction order, and so every loss digit, fixed
    try:
        for i in range(torch.neuron.device_count()):  # the report starts from an idle device
            torch.neuron.synchronize(i)
        torch.neuron.reset_report()
        example.train(DEMO_STEPS, batch, seq, log_every=10, log=console.print)
        rep = torch.neuron.report()
    finally:
        torch.set_num_threads(threads)
    console.print()
    render_run_report(rep, f"examples/train_gpt2.py on {cfg.name}", _Out(width=RUN_REPORT_WIDTH))
    console.print()
    tokens, hidden = batch * seq, 4 * embd
    spec = KernelSpec.of("matmul", (tokens, embd, hidden), "fp32", {"transpose_a": True, "transpose_b": False})
    kernels = Device(cfg).kernels_of(spec)
    console.print(f"One kernel of the step up close: a block's MLP up-projection, x[{tokens}x{embd}] @ "
                  f"W[{embd}x{hidden}] fp32 (addmm), shared out over the logical core's {len(kernels)} physical "
                  f"core(s); the library matmul kernel physical core 0 ran:")
    render_report(Chip(cfg).run(kernels[0], timing_only=True).report, console, cfg)
    return 0


def _kernel_demo(cfg: ChipConfig, console: Any) -> int:
    import numpy as np

    from ..sim.chip import Chip
    from ..kernels.matmul import build_matmul

    m, k, n = 512, 1024, 1024
    kernel = build_matmul(m, k, n, "bf16", cfg)
    rng = np.random.default_rng(0)
    lhsT = rng.standard_normal((k, m), dtype=np.float32)
    rhs = rng.standard_normal((k, n), dtype=np.float32)
    result = Chip(cfg).run(kernel, {"lhsT": lhsT, "rhs": rhs})
    ref = lhsT.T.astype(np.float64) @ rhs.astype(np.float64)
    err = float(np.max(np.abs(result["out"].astype(np.float64) - ref)) / np.max(np.abs(ref)))
    console.print(f"[bold]Demo:[/bold] bf16 matmul {m}x{k} @ {k}x{n} with trnsim.kernels.matmul "
                  f"({len(kernel)} instructions); max error vs float64 {err:.2e} (bf16 output)")
    render_report(result.report, console, cfg)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..sweep import load_spec, run_sweep

    if args.max_points is not None and args.max_points < 1:
        raise UsageError(f"--max-points {args.max_points}: expected a positive number of points")
    spec = load_spec(args.spec, args.out, args.max_points or DEFAULT_MAX_POINTS)
    err = Console(stderr=True)
    progress = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, disable=not sys.stderr.isatty(), transient=True)
    task = progress.add_task("points", total=len(spec.points))
    try:
        with progress:
            result = run_sweep(spec, args.jobs, lambda done, total: progress.update(task, completed=done),
                               executor=args.executor, address=args.address, timeout=args.timeout)
    except OSError as e:
        raise UsageError(f"sweep: cannot write {spec.out} ({e.strerror or type(e).__name__})") from None
    rows = result.rows
    t = Table(title=f"Sweep {spec.path.name} on {spec.config}: {len(rows)} points", title_justify="left")
    leaves = [key.rsplit(".", 1)[-1] for key in spec.grid]
    for key, leaf in zip(spec.grid, leaves):
        t.add_column(leaf if leaves.count(leaf) == 1 else key, no_wrap=True)
    for col in ("kernel", "shape", "dtype", "cycles", "us", "MFU", "bound"):
        t.add_column(col, justify="right" if col in ("cycles", "us", "MFU") else "left", no_wrap=col != "bound")
    def cell(text: str, fmt: str) -> str:  # estimate rows have no cycles; collective rows no MFU
        return format(float(text), fmt) if text else ""

    for r in rows:
        figures = (["", "", "", f"error: {r['error']}"] if r["error"] else
                   [cell(r["cycles"], ",.0f"), cell(r["us"], ",.3f"),
                    cell(r["mfu_percent"], ".1f") + ("%" if r["mfu_percent"] else ""), r["bound"]])
        t.add_row(*(str(r[k]) for k in spec.grid), r["kernel"], r["shape"], r["dtype"], *figures)
    console = _Out(width=REPORT_WIDTH)
    console.print(t)
    console.print(f"{result.ran} points run, {len(rows) - result.ran} from a previous run; results in {spec.out}",
                  markup=False)
    if result.torn:
        console.print("A torn last row (from a killed run) was dropped and its point run again.")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a PyTorch script on the `neuron` device and print where its simulated time went."""
    try:
        from torch_bridge.run import compare_eager, run_script, split_args
    except ImportError as e:
        raise UsageError(f"trnsim run needs PyTorch and torch_bridge: pip install -e '.[torch]' ({e})") from None
    try:
        script_args, opts = split_args(args.args)
    except ValueError as e:
        raise UsageError(f"run: {e}") from None
    config = opts.get("config", args.config)
    compare = opts.get("compare_eager", args.compare_eager)
    trace, metrics, plot = (opts.get(k, getattr(args, k)) for k in ("trace", "metrics", "plot"))
    overrides = args.set + opts["set"]
    as_json = opts.get("json", args.json)
    nproc = opts.get("nproc", args.nproc)
    system = opts.get("system", args.system)
    timing_only = bool(opts.get("timing_only", args.timing_only))
    host = bool(opts.get("host_profile", args.host_profile))
    from trnsim.device.costcache import device_cache_dir

    try:  # (checked before the script runs: a cache that is a file is one line here)
        cache = device_cache_dir()
        if cache is None and opts.get("cost_cache", args.cost_cache):
            os.environ["TRNSIM_COST_CACHE"] = "on"  # (the ranks of --nproc inherit it)
            if device_cache_dir() is None:
                raise UsageError("run: --cost-cache: the cost cache is off (TRNSIM_CACHE_DIR=off); set "
                                 "TRNSIM_COST_CACHE to a directory for it")
    except ValueError as e:
        raise UsageError(f"run: {e}") from None
    if host and (compare or nproc is not None):
        raise UsageError(f"run: --host-profile profiles one process running the script once; leave out "
                         f"{'--compare-eager' if compare else '--nproc'}")
    if host and trace:
        raise UsageError("run: --host-profile times the simulator's parts, and under --trace torch.profiler's own "
                         "time lands inside them: run with one, then the other")
    if timing_only and (compare or nproc is not None):
        raise UsageError(f"run: --timing-only runs one process once; leave out {'--compare-eager' if compare else '--nproc'}"
                         f" (trnsim estimate simulates a whole system without values)")
    if nproc is not None:
        if compare:
            raise UsageError("run: --compare-eager runs one process; leave out --nproc (or --compare-eager)")
        if metrics or plot:
            raise UsageError(f"run: {'--metrics' if metrics else '--plot'} takes a one-process run; leave out --nproc")
        return _run_ranks(args.script, script_args, nproc, config, overrides, system, trace,
                          opts.get("timeout", args.timeout), as_json)
    if system is not None:
        os.environ["TRNSIM_SYSTEM"] = system  # a script that makes its own process group reads it
    if compare and (trace or metrics or plot):
        which = "--trace" if trace else "--metrics" if metrics else "--plot"
        raise UsageError(f"run: --compare-eager runs the script twice; {which} takes one run (drop one of them)")
    top = opts.get("expand-top", args.expand_top)
    try:  # with --json the script's own output goes to stderr: stdout is the JSON alone
        top = int(top)
        if top < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--expand-top {top}: expected a number of kernels >= 0") from None
    hosts: list[Any] | None = [] if host else None  # run_script appends the run's host profile
    try:  # with --json the script's own output goes to stderr: stdout is the JSON alone
        if compare:
            status, eager, rep = compare_eager(args.script, script_args, config=config, overrides=overrides,
                                               quiet_stdout=bool(as_json))
        else:
            status, rep = run_script(args.script, script_args, config=config, overrides=overrides,
                                     trace=trace, adaptive=opts.get("adaptive_eager", args.adaptive_eager),
                                     metrics=metrics, plot=plot, expand=args.expand + opts["expand"], expand_top=top,
                                     trace_stack=bool(opts.get("trace_stack", args.trace_stack)),
                                     quiet_stdout=bool(as_json), timing_only=timing_only, host_profile=hosts)
    except (FileNotFoundError, RuntimeError) as e:
        raise UsageError(f"run: {e}") from None
    if as_json:
        data = {"eager": eager.to_dict(), "compiled": rep.to_dict()} if compare else rep.to_dict()
        if hosts:
            data["host_profile"] = hosts[0].to_dict()
        emit(json.dumps(data, indent=2))
        return status
    print_run_report(rep, f"{args.script} on {rep.config}" + (" (compiled)" if compare else ""))
    if compare:
        console = _Out(width=RUN_REPORT_WIDTH)
        console.print()
        render_comparison(eager, rep, f"{args.script} on {rep.config}", console)
    if hosts:
        print(f"\nWhere the host's wall time went (the simulator's own time, not the device's; "
              f"{hosts[0].wall:.2f} s in all, the script's imports included):")
        print(hosts[0].table())
    say_written(_Out(width=RUN_REPORT_WIDTH), trace, metrics, plot)
    return status


def _run_ranks(script: str, script_args: list[str], nproc: Any, config: str | None, overrides: list[str],
               system: str | None, trace: str | None, timeout: Any, as_json: bool) -> int:
    """``trnsim run --nproc N``: the script on N ranks (torchrun's launcher), one merged report."""
    from torch_bridge.dist.process_group import parse_seconds
    from torch_bridge.dist.launch import RankFailure, run_ranks

    try:
        n = int(nproc)
        secs = None if timeout is None else parse_seconds(timeout, "--timeout")
    except ValueError as e:
        raise UsageError(f"run: {e}" if "--timeout" in str(e) else
                         f"run: --nproc {nproc}: expected a whole number of ranks >= 1") from None
    try:
        rep = run_ranks(script, script_args, n, config, overrides, system, trace, secs)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"run: {e}") from None
    except RankFailure as e:  # bad use: an error; the script's own failure: its traceback came first
        print(f"trnsim: {'error: ' if e.usage else ''}{_one_line(e.message)}", file=sys.stderr)
        return e.status
    if as_json:
        emit(json.dumps(rep.to_dict(), indent=2))
        return 0
    render_rank_report(rep, f"{script} on {rep.world} ranks of {rep.system}", _Out(width=run_report_width(rep.total)))
    if trace:
        emit(f"Trace written to {trace}: one process per rank, with its streams, its collectives and NeuronLink "
             f"lanes (open it in ui.perfetto.dev)")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a sweep's (or a metrics file's) columns against each other."""
    from ..outputs.plot import plot_sweep, reserve

    out = reserve(args.output, "-o")
    try:
        plot_sweep(args.results, args.x, args.y, out, hue=args.hue, where=args.where, title=args.title)
    finally:
        out.discard()
    print(f"Plot written to {args.output}")
    return 0


#: characters: every report fits a 120-column terminal. Names longer than their column (a
#: compiled region's fused ops, a long op) end in an ellipsis there; --json, --metrics (Parquet)
#: and the trace keep them whole.


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trnsim", description="A cycle-approximate virtual AWS Trainium.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"trnsim {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    i = sub.add_parser("info", help="print a chip config: cores, clocks, peak TFLOP/s, memories, DMA, links")
    i.add_argument("config", nargs="?", default="trnsim-default",
                   help=f"a config name ({', '.join(config_names())}) or a YAML path; default trn2")
    i.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="dotted override, e.g. core.sbuf.partition_bytes=256KiB (repeatable)")
    i.add_argument("--json", action="store_true", help="print the figures as JSON")
    i.set_defaults(fn=cmd_info)
    d = sub.add_parser("demo", help="print trnsim info for a chip, train a small GPT-2 on it (examples/train_gpt2.py) and print the run report and one kernel's cycle report (without PyTorch: a bf16 matmul kernel)")
    d.add_argument("--config", default="trn2", help="config name or YAML path (default trn2)")
    d.add_argument("--set", action="append", default=[], metavar="K=V", help="dotted override (repeatable)")
    d.set_defaults(fn=cmd_demo)
    k = sub.add_parser("kernel", help="run a library or user kernel and print its cycle report")
    k.add_argument("name", nargs="?", metavar="NAME",
                   help="a registered kernel (see --list) or path/to/file.py:function")
    k.add_argument("--list", action="store_true", help="list the registered kernels with dims, dtypes and params")
    k.add_argument("--shape", metavar="AxBxC", help="the kernel's dims, e.g. 4096x4096x4096 (default: the kernel's)")
    k.add_argument("--dtype", help="input dtype, e.g. bf16 (default: the kernel's first)")
    k.add_argument("--config", default="trn2", help="config name or YAML path (default trn2)")
    k.add_argument("--set", action="append", default=[], metavar="K=V", help="dotted config override (repeatable)")
    k.add_argument("--param", action="append", default=[], metavar="K=V", help="kernel parameter (repeatable)")
    k.add_argument("--check", action="store_true",
                   help="also compute values and compare with the kernel's reference (exit 1 on mismatch)")
    k.add_argument("--schedule", action=argparse.BooleanOptionalAction, default=None,
                   help="list-schedule the instruction stream as the Neuron compiler would (trnsim.schedule): "
                        "opt-in for builder kernels, on by default for NKI kernels (--no-schedule keeps their "
                        "program order)")
    k.add_argument("--json", action="store_true", help="print the report as JSON only")
    k.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace of the engine and DMA lanes")
    k.add_argument("--metrics", metavar="OUT.parquet", help="write the kernel's metrics as a Parquet row "
                   "(neuron-profile's names; needs the 'metrics' extra)")
    k.add_argument("--plot", metavar="OUT.png", help="draw the engine-utilisation breakdown (.png/.svg/.pdf; needs "
                   "the 'plot' extra)")
    k.set_defaults(fn=cmd_kernel)
    w = sub.add_parser("sweep", help="run kernels over a grid of chip variants (timing only) into a CSV")
    w.add_argument("spec", metavar="SPEC.yaml", help="sweep spec: config, grid, kernels, out")
    w.add_argument("--out", metavar="FILE", help="results file, .csv or .parquet (default: the spec's 'out', or "
                   "SPEC.csv)")
    w.add_argument("--jobs", type=int, metavar="N", help="worker processes (default: one per CPU)")
    w.add_argument("--max-points", type=int, metavar="N",
                   help=f"run a spec of more than {DEFAULT_MAX_POINTS:,} points (the default limit)")
    w.add_argument("--executor", choices=("pool", "ray"), default="pool",
                   help="where points run: a local process pool (default) or Ray (needs the 'ray' extra)")
    w.add_argument("--address", metavar="HOST:PORT", help="the Ray cluster to run on (default: start a local "
                   "Ray instance of --jobs CPUs); with --executor ray")
    w.add_argument("--timeout", type=float, metavar="SECONDS", help="with --address: how long the cluster may take "
                   "to answer before the sweep gives up (default 20)")
    w.set_defaults(fn=cmd_sweep)
    r = sub.add_parser("run", help="run a PyTorch script on the virtual neuron device and print its run report")
    r.add_argument("script", metavar="SCRIPT.py", help="the script; arguments after it are passed to it")
    r.add_argument("args", nargs=argparse.REMAINDER, help="script arguments (--config/--set/--trace/--json after "
                   "the script are still trnsim's; put script arguments after -- to pass those too)")
    r.add_argument("--config", default=None, help="config name or YAML path (default: $TRNSIM_CONFIG or trn2)")
    r.add_argument("--set", action="append", default=[], metavar="K=V", help="dotted config override (repeatable)")
    r.add_argument("--trace", metavar="OUT.json", help="write one Perfetto trace from the host's aten ops "
                   "(torch.profiler) to the device's streams and the expanded kernels' engines")
    r.add_argument("--trace-stack", action="store_true",
                   help="add torch.profiler's Python function events to the trace (with_stack: every Python call "
                        "of the script, imports included; large)")
    r.add_argument("--expand", action="append", default=[], metavar="OP",
                   help="draw the engine and DMA-queue lanes of this op's or kernel's longest launch in the trace "
                        "(repeatable)")
    r.add_argument("--expand-top", default=3, metavar="N",
                   help="also expand the N busiest (op, kernel) rows (default 3)")
    r.add_argument("--metrics", metavar="OUT.parquet", help="write the report's rows with neuron-profile's metric "
                   "names and their source lines as Parquet (needs the 'metrics' extra)")
    r.add_argument("--plot", metavar="OUT.png", help="draw the per-op time share and engine utilisation "
                   "(needs the 'plot' extra)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument("--compare-eager", action="store_true",
                   help="run the script twice, torch.compile off then on, and print simulated time side by side")
    r.add_argument("--adaptive-eager", action="store_true",
                   help="batch eager launches: a repeated sequence between syncs is replayed as one graph launch")
    r.add_argument("--timing-only", action="store_true", help="run on tensors without values (shapes only): every "
                   "op is charged, nothing is computed, no host memory is taken (torch.neuron.timing_only)")
    r.add_argument("--host-profile", action="store_true",
                   help="also print where the host's wall time went: kernel builds and simulations, the device "
                        "model, the Python path per op, compiled graphs, the fast path and the program "
                        "(torch_bridge.neuron.hostprof; the report and the values are the same without it)")
    r.add_argument("--cost-cache", action="store_true",
                   help="keep the kernels' costs on disk and read them in later runs instead of simulating them "
                        "again (TRNSIM_COST_CACHE=on: the estimates' cache, ~/.cache/trnsim/costs; set "
                        "TRNSIM_COST_CACHE to a directory for another); the report and the values are the same")
    r.add_argument("--nproc", metavar="N", help="run the script on N ranks (torchrun's launcher, one process per "
                                                "rank, rank r on NeuronCore r) and print one merged report")
    r.add_argument("--system", default=None, help="the system the ranks run on (default: $TRNSIM_SYSTEM or "
                                                  "trn2.48xlarge); see trnsim collective --help")
    r.add_argument("--timeout", metavar="SECONDS", help="with --nproc: how long a rank waits for its peers at a "
                                                        "collective before it fails (default: the process group's)")
    r.set_defaults(fn=cmd_run)
    pl = sub.add_parser("plot", help="draw a sweep's results (CSV or Parquet): METRIC against KEY, a series per "
                                     "--hue value (needs the 'plot' extra)")
    pl.add_argument("results", metavar="RESULTS", help="a sweep's results file (.csv or .parquet) or a metrics file")
    pl.add_argument("--x", required=True, metavar="KEY", help="the column on the x axis (e.g. core.tensor.clock)")
    pl.add_argument("--y", required=True, metavar="METRIC", help="the column on the y axis (e.g. us, mfu_percent)")
    pl.add_argument("--hue", metavar="KEY", help="one series per value of this column")
    pl.add_argument("--where", action="append", default=[], metavar="K=V", help="keep only rows with K=V (repeatable)")
    pl.add_argument("--title", help="the figure's title (default: what is plotted)")
    pl.add_argument("-o", "--output", required=True, metavar="OUT.png", help="the image to write (.png/.svg/.pdf)")
    pl.set_defaults(fn=cmd_plot)
    add_collective_parser(sub)
    from .estimate import add_parser as _add_estimate_parser
    from .validate import add_parser as _add_validate_parser

    _add_estimate_parser(sub)
    _add_validate_parser(sub)
    return p


ERROR_CHARS = 2000  # the most of one error line printed: a message is a sentence, not a dump


def _one_line(message: str, limit: int = ERROR_CHARS) -> str:
    """The error as one bounded line, whatever went into it."""
    return clip_text(" ".join(str(message).splitlines()), limit)


def _check_environment() -> None:
    """TRNSIM_* settings are checked before any command runs, so a bad one is a one-line error,
    not a traceback from deep inside a run (or inside the user's script under ``trnsim run``)."""
    from ..builder.kernel import max_instructions
    from ..native import check_env

    check_env()
    max_instructions()


def _keep_script_separator(args: argparse.Namespace, raw: Sequence[str]) -> None:
    """``trnsim run s.py -- --json``: argparse takes a ``--`` right after the script for its own
    end of options and hands the rest as the script's arguments without it, so ``split_args``
    read ``--json`` as trnsim's. The arguments are the tail of the command line; where the token
    before them is that ``--`` and the one before it the script, the ``--`` is put back."""
    rest = list(getattr(args, "args", None) or [])
    n = len(rest)
    if len(raw) >= n + 2 and raw[len(raw) - n - 1] == "--" and raw[len(raw) - n - 2] == args.script \
            and list(raw[len(raw) - n:]) == rest:
        args.args = ["--", *rest]


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = build_parser().parse_known_args(raw)
        if extra:  # (argparse's own message names the top parser: point at the command's help instead)
            prog = " ".join(["trnsim", *[str(v) for v in (getattr(args, "command", None), getattr(args, "mode", None))
                                         if v]])
            _Parser(prog=prog).error(f"unrecognized arguments: {' '.join(extra)}")
    except KeyboardInterrupt:
        print("trnsim: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "command", None) == "run":
        _keep_script_separator(args, raw)
    if getattr(args, "config", None) == "trnsim-default":
        args.config = "trn2"
    try:
        _check_environment()
        return int(args.fn(args))
    except (ConfigError, KernelError, UsageError, OutputError, MissingExtra) as e:
        print(f"trnsim: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except SweepStopped as e:
        print(f"trnsim: {_one_line(str(e))}", file=sys.stderr)
        return 130 if e.interrupted else 1
    except KeyboardInterrupt:
        print("trnsim: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"trnsim: error: the host ran out of memory in 'trnsim {args.command}'; try a smaller shape or "
              f"config, or a timing-only run", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (e.g. `trnsim demo | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
