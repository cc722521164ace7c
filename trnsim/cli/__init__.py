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
                  [--metrics out.parquet] [--plot out.png] [--compare-eager] [--adaptive-eager] [--timing-only] [--json]
    trnsim run --nproc N [--system trn2.48xlarge] [--timeout S] SCRIPT.py [ARGS ...]
    trnsim plot RESULTS.{csv,parquet} --x KEY --y METRIC [--hue KEY] [--where K=V ...] -o out.png
    trnsim collective all-reduce [--system trn2.48xlarge] [--ranks 64] [--bytes 8B:4GiB] [--factor 2]
                  [--algo ring] [--dtype bf16] [--set K=V ...] [--json] [--trace out.json]
    trnsim estimate inference|train --model llama-3.3-70b [--system ...] [--tp 64] ... (trnsim.cli_estimate)
    trnsim validate [CATEGORY|ROW ...] [--quick] [--list] [--json] [--out rows.csv] [--plot out.png] ...
                  (trnsim.validate.cli)

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

from .base import Out as _Out, UsageError
from ..config import ChipConfig, ConfigError, clip_text, config_names, format_quantity, load_config
from ..config.extras import MissingExtra
from ..outputs.files import AtomicOutput, OutputError
from ..isa import KernelError
from ..sim.report import KernelReport, bound_of
from ..sweep import DEFAULT_MAX_POINTS, SweepStopped, check_collective_bytes, check_collective_ranks

if _SIGINT is signal.default_int_handler:
    signal.signal(signal.SIGINT, _SIGINT)

__all__ = ["main", "render_info", "render_report", "render_run_report", "render_rank_report", "print_run_report",
           "bound_of", "render_comparison"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        message = _one_line(message, 300)  # argparse quotes the user's arguments whole
        print(f"trnsim: error: {message} (see 'trnsim {self.prog.split()[-1]} --help')"
              if " " in self.prog else f"trnsim: error: {message} (see 'trnsim --help')", file=sys.stderr)
        raise SystemExit(2)


def _console() -> Any:
    return _Out()


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def info_data(cfg: ChipConfig) -> dict[str, Any]:
    """The figures ``trnsim info`` prints, as plain data."""
    c, chip = cfg.core, cfg.chip
    dtypes = ["bf16", "fp16", "fp8", "fp32"] + (["mxfp8"] if c.tensor.mx_quad else [])
    peaks = {d: cfg.peak_flops_per_core(d) for d in dtypes}
    dma_core = c.dma.engines * c.dma.engine_bandwidth
    return {
        "name": cfg.name,
        "description": cfg.description,
        "source": cfg.source,
        "overrides": dict(cfg.overrides),
        "core_version": c.version,
        "physical_cores": chip.cores,
        "lnc": chip.lnc,
        "logical_cores": cfg.logical_cores,
        "clocks_hz": cfg.engine_clocks,
        "tick_hz": cfg.tick_hz,
        "pe_array": [c.tensor.pe_rows, c.tensor.pe_cols],
        "peak_flops_per_core": peaks,
        "peak_flops_per_chip": {d: v * chip.cores for d, v in peaks.items()},
        "sbuf_bytes_per_core": c.sbuf.bytes,
        "sbuf_partitions": c.sbuf.partitions,
        "sbuf_partition_bytes": c.sbuf.partition_bytes,
        "psum_bytes_per_core": c.psum.bytes,
        "psum_banks": c.psum.banks,
        "psum_bank_bytes": c.psum.bank_bytes,
        "hbm_bytes": chip.hbm.capacity,
        "hbm_bandwidth": chip.hbm.bandwidth,
        "hbm_stacks": chip.hbm.stacks,
        "hbm_bandwidth_per_core": cfg.hbm_bandwidth_per_core,
        "dma_engines_per_core": c.dma.engines,
        "dma_queues_per_engine": c.dma.queues,
        "dma_engine_bandwidth": c.dma.engine_bandwidth,
        "dma_bandwidth_per_core": dma_core,
        "dma_bandwidth_per_chip": dma_core * chip.cores,
        "dma_start_latency_ns": c.dma.start_latency / 1000,
        "neuronlink": {
            "version": chip.neuronlink.version,
            "links": chip.neuronlink.links,
            "bandwidth": chip.neuronlink.bandwidth,
        },
        "host_dispatch_ns": cfg.host.dispatch / 1000,
        "host_max_inflight": cfg.host.max_inflight,
    }


def render_info(cfg: ChipConfig, console: Any) -> None:
    from rich.table import Table

    d = info_data(cfg)
    c = cfg.core
    title = f"{cfg.name}: {cfg.description}"
    if cfg.overrides:
        title += f"  (with {cfg.describe_overrides()})"
    t = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    bw = lambda v: format_quantity(v, "bandwidth")  # noqa: E731
    hz = lambda v: format_quantity(v, "hz")  # noqa: E731
    by = lambda v: format_quantity(v, "bytes")  # noqa: E731
    t.add_row("Cores", f"{d['physical_cores']} physical {c.version}, LNC={d['lnc']} -> {d['logical_cores']} logical")
    t.add_row("Clocks", ", ".join(f"{k} {hz(v)}" for k, v in d["clocks_hz"].items()))
    t.add_row("PE array", f"{c.tensor.pe_rows} x {c.tensor.pe_cols}, moving tile <= {c.tensor.moving_max_free}, "
                          f"stationary <= {c.tensor.stationary_max_free}")
    peaks = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in d["peak_flops_per_core"].items())
    chip_peaks = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in d["peak_flops_per_chip"].items())
    t.add_row("Peak TFLOP/s", f"per core: {peaks}")
    t.add_row("", f"per chip: {chip_peaks}")
    t.add_row("SBUF", f"{by(c.sbuf.bytes)} per core = {c.sbuf.partitions} partitions x {by(c.sbuf.partition_bytes)}")
    t.add_row("PSUM", f"{by(c.psum.bytes)} per core = {c.psum.partitions} partitions x {c.psum.banks} banks x "
                      f"{by(c.psum.bank_bytes)}")
    t.add_row("HBM", f"{by(cfg.chip.hbm.capacity)}, {bw(cfg.chip.hbm.bandwidth)} over {cfg.chip.hbm.stacks} stacks "
                     f"({bw(cfg.hbm_bandwidth_per_core)} per core)")
    t.add_row("DMA", f"{c.dma.engines} engines x {c.dma.queues} queues per core, {bw(c.dma.engine_bandwidth)} per "
                     f"engine = {bw(d['dma_bandwidth_per_core'])} per core, {bw(d['dma_bandwidth_per_chip'])} per chip; "
                     f"start latency {format_quantity(c.dma.start_latency, 'time')}")
    nl = cfg.chip.neuronlink
    t.add_row("NeuronLink", f"{nl.version}, {nl.links} links, {bw(nl.bandwidth)} per chip; systems in configs/systems/")
    t.add_row("Host", f"{format_quantity(cfg.host.dispatch, 'time')} to issue a launch, up to "
                      f"{cfg.host.max_inflight} unfinished launches per logical core")
    t.add_row("Source", cfg.source_display)
    console.print(t)


# ---------------------------------------------------------------------------------------------
# kernel reports
# ---------------------------------------------------------------------------------------------


def render_report(report: KernelReport, console: Any, config: ChipConfig | None = None) -> None:
    from rich.table import Table

    head = Table(title=f"Kernel '{report.kernel}' on {report.config} (core {report.core})",
                 show_header=False, title_justify="left", box=None, padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Total", f"{report.total_cycles:,.0f} cycles ({report.total_us:,.3f} us) at the TensorE clock, "
                          f"first issue to last result")
    head.add_row("MFU", f"{report.mfu_estimated_percent:.2f}%  (HFU {report.hfu_estimated_percent:.2f}%, "
                        f"{report.achieved_flops_per_s / 1e12:.2f} TFLOP/s)")
    hbm = report.hbm_read_bytes + report.hbm_write_bytes
    head.add_row("HBM", f"read {format_quantity(report.hbm_read_bytes, 'bytes')}, written "
                        f"{format_quantity(report.hbm_write_bytes, 'bytes')}; MBU {report.mbu_estimated_percent:.1f}%")
    if report.matmul_flops and hbm:
        head.add_row("Intensity", f"{report.matmul_flops / hbm:.1f} FLOP/byte of HBM traffic")
    head.add_row("DMA", f"{report.dma.transfers} transfers, {format_quantity(report.dma.bytes, 'bytes')}, "
                        f"avg {format_quantity(report.dma.average_bytes, 'bytes')}, "
                        f"{format_quantity(report.dma.achieved_bytes_per_s, 'bandwidth')}, "
                        f"active {report.dma.active_percent:.1f}%")
    head.add_row("SBUF peak", f"{format_quantity(report.sbuf_peak_bytes, 'bytes')} per partition; PSUM peak "
                              f"{format_quantity(report.psum_peak_bytes, 'bytes')} per partition")
    head.add_row("Bound by", bound_of(report))
    console.print(head)
    t = Table(title="Engines", title_justify="left")
    for col in ("engine", "instructions", "busy cycles (own clock)", "busy us", "active"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for name, s in report.engines.items():
        t.add_row(name, f"{s.instructions:,}", f"{s.busy_cycles:,.0f}", f"{s.busy_us:,.3f}", f"{s.active_percent:.1f}%")
    t.add_row("DMA", f"{report.dma.transfers:,}", "", f"{report.dma.active_percent * report.total_us / 100:,.3f}",
              f"{report.dma.active_percent:.1f}%")
    console.print(t)
    c = Table(title="Instructions", title_justify="left")
    c.add_column("kind")
    c.add_column("count", justify="right")
    for kind, n in sorted(report.instruction_counts.items(), key=lambda kv: -kv[1]):
        c.add_row(kind, f"{n:,}")
    console.print(c)


def render_dma_queues(report: KernelReport, console: Any) -> None:
    """Per DMA queue: transfers, bytes, busy time (any transfer in flight) and the bandwidth
    achieved while busy."""
    from rich.table import Table

    if not report.dma.queues:
        return
    t = Table(title="DMA queues", title_justify="left")
    for col in ("queue", "transfers", "bytes", "busy us", "bandwidth while busy", "active"):
        t.add_column(col, justify="left" if col == "queue" else "right")
    for lane, q in sorted(report.dma.queues.items()):
        busy_us = q["busy_us"]
        bw = q["bytes"] / (busy_us * 1e-6) if busy_us else 0.0
        t.add_row(lane, f"{q['transfers']:,.0f}", format_quantity(q["bytes"], "bytes"), f"{busy_us:,.3f}",
                  format_quantity(bw, "bandwidth"), f"{100 * busy_us / report.total_us if report.total_us else 0:.1f}%")
    console.print(t)


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    if args.json:
        print(json.dumps(info_data(cfg), indent=2))
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


def _list_data() -> list[dict[str, Any]]:
    from ..kernels import get_kernel, kernel_names

    out = []
    for name in kernel_names():
        e = get_kernel(name)
        out.append({"name": name, "dims": e.shape_doc, "dtypes": list(e.dtypes), "default_shape": list(e.default_shape),
                    "default_dtype": e.default_dtype, "params": dict(e.params), "summary": e.summary,
                    "checkable": e.reference is not None})
    return out


def cmd_kernel_list(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    data = _list_data()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    t = Table(title=f"{len(data)} kernels: trnsim kernel NAME [--shape ...] [--dtype ...] [--param K=V ...]",
              title_justify="left", show_header=False, box=None, padding=(0, 2, 1, 0))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for d in data:
        dtypes = ", ".join(f"{x} (default)" if x == d["default_dtype"] else x for x in d["dtypes"])
        params = ", ".join(f"{k}={json.dumps(v)}" for k, v in d["params"].items()) or "none"
        check = "" if d["checkable"] else "; no reference (timing only)"
        t.add_row(d["name"], Text(f"{d['summary']}\nshape {d['dims']}, default "
                                  f"{'x'.join(map(str, d['default_shape']))}; dtypes {dtypes}\n"
                                  f"params: {params}{check}"))
    console = _console()
    console.print(t)
    console.print("A kernel in a file: trnsim kernel path/to/file.py:function --shape ...")
    return 0


def cmd_kernel(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from ..sim.chip import Chip
    from ..kernels.check import check_entry
    from ..kernels.registry import parse_params, parse_shape
    from ..sweep import resolve_kernel
    from ..outputs.trace import write_trace

    if args.list:
        return cmd_kernel_list(args)
    if not args.name:
        raise UsageError("kernel: give a kernel NAME (see 'trnsim kernel --list') or path/to/file.py:function")
    cfg = load_config(args.config, args.set)
    ref = resolve_kernel(args.name)
    if _is_nki(ref.build):
        return cmd_kernel_nki(args, ref.build, cfg)
    if args.shape is not None:
        shape = parse_shape(args.shape)
    elif ref.default_shape is not None:
        shape = ref.default_shape
    else:
        raise UsageError(f"kernel '{clip_text(args.name)}': --shape is required for a kernel from a file, e.g. "
                         f"--shape 1024x2048")
    dtype = ref.dtype(args.dtype)
    params = parse_params(args.param, ref.params, f"kernel '{clip_text(args.name)}'")
    check: dict[str, Any] | None = None
    if args.check and (ref.entry is None or ref.entry.reference is None):
        raise UsageError(f"kernel '{clip_text(args.name)}': --check needs a registered kernel with a reference; "
                         f"run it without --check for timing only")
    # outputs that cannot be written (or need a missing extra) are refused now, before the run
    outputs = _reserve_outputs(args.trace, args.metrics, args.plot)
    trace, metrics, plot = outputs
    try:
        if args.check:
            assert ref.entry is not None
            check = check_entry(ref.entry, shape, dtype or ref.entry.default_dtype, cfg, params,
                                schedule=bool(args.schedule))
            report = check["report"]
        else:
            kernel = ref.make(shape, dtype, cfg, params)
            if args.schedule:
                from ..sim.list_schedule import schedule

                kernel = schedule(kernel)
            report = Chip(cfg).run(kernel, timing_only=True).report
        if trace is not None:
            write_trace(trace, report)
        if metrics is not None:
            from ..outputs.metrics import write_kernel_metrics

            write_kernel_metrics(metrics, [report], {"shape": list(shape), "dtype": dtype, "params": params,
                                                     "overrides": dict(cfg.overrides)})
        if plot is not None:
            from ..outputs.plot import plot_kernel

            plot_kernel(report, plot)
    finally:
        for o in outputs:
            if o is not None:
                o.discard()
    ok = check is None or bool(check["ok"])
    if args.json:
        doc: dict[str, Any] = {"kernel": args.name, "shape": list(shape), "dtype": dtype, "config": cfg.name,
                               "overrides": dict(cfg.overrides), "params": params, "bound": bound_of(report)}
        if check is not None:
            doc["check"] = {"ok": ok, "max_error": check["errors"]}
        doc["report"] = report.to_dict()
        print(json.dumps(doc, indent=2))
        return 0 if ok else 1
    console = _console()
    what = f"{ref.entry.shape_doc} = " if ref.entry else ""
    run = "values checked against the reference" if check is not None else "timing only"
    line = f"[bold]{escape(args.name)}[/bold] {what}{'x'.join(map(str, shape))}"
    line += f", {dtype}" if dtype else ""
    line += "".join(f", {k}={escape(str(v))}" for k, v in params.items())
    line += f" on {cfg.name}" + (f" ({cfg.describe_overrides()})" if cfg.overrides else "") + f"; {run}"
    line += "; list-scheduled" if args.schedule else ""
    console.print(line)
    render_report(report, console, cfg)
    render_dma_queues(report, console)
    _say_written(console, args.trace, args.metrics, args.plot)
    if check is not None:
        errs = ", ".join(f"{name} {err:.2e}" for name, err in check["errors"].items())
        console.print(f"Check: max error relative to max |reference|: {errs} -> {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _is_nki(obj: Any) -> bool:
    from ..nki import JitKernel

    return isinstance(obj, JitKernel)


def cmd_kernel_nki(args: argparse.Namespace, kernel: Any, cfg: ChipConfig) -> int:
    """``trnsim kernel file.py:kernel`` for an ``@nki.jit`` kernel: random inputs of the given
    shapes, values and the cycle report of the scheduled kernel, and a summary of the outputs."""
    import inspect
    import math

    import numpy as np
    from rich.markup import escape
    from rich.table import Table

    from .. import nki
    from ..kernels.registry import parse_params, parse_shape
    from ..native.dtypes import get_dtype
    from ..outputs.trace import write_trace

    if args.check:
        raise UsageError(f"kernel '{clip_text(args.name)}': --check needs a registered kernel with a reference; an NKI kernel "
                         f"runs with values already (compare its outputs in Python: trnsim.nki.run)")
    sig = inspect.signature(kernel.fn)
    tensors = [p.name for p in sig.parameters.values()
               if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    options = {p.name: p.default for p in sig.parameters.values() if p.default is not inspect.Parameter.empty}
    if not args.shape:
        raise UsageError(f"kernel '{clip_text(args.name)}': --shape is required for an NKI kernel: one shape per tensor "
                         f"argument ({', '.join(tensors)}), separated by commas, e.g. --shape 128x512,128x512")
    shapes = [parse_shape(s) for s in args.shape.split(",")]
    if len(shapes) == 1:
        shapes *= len(tensors)
    try:
        itemsize = get_dtype(args.dtype or "fp32").itemsize
    except ValueError:
        itemsize = 4  # refused below, naming the dtype
    total = sum(math.prod(s) for s in shapes) * itemsize
    share = cfg.chip.hbm.capacity // cfg.logical_cores
    if total > share:  # the inputs are HBM tensors of the logical core the kernel runs on
        raise UsageError(f"kernel '{clip_text(args.name)}': --shape {clip_text(args.shape, 60)}: the input tensors "
                         f"take {format_quantity(total, 'bytes')}, more than a logical core's share of HBM on "
                         f"{cfg.name} ({format_quantity(share, 'bytes')})")
    if len(shapes) != len(tensors):
        raise UsageError(f"kernel '{clip_text(args.name)}': --shape gives {len(shapes)} shapes but {kernel.fn.__name__} takes "
                         f"{len(tensors)} tensors ({', '.join(tensors)}); give one per tensor, separated by commas")
    try:
        dt = get_dtype(args.dtype or "fp32")
    except ValueError as e:
        raise KernelError(f"kernel '{clip_text(args.name)}': {e}") from None
    params = parse_params(args.param, options, f"kernel '{clip_text(args.name)}'")
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32).astype(dt.np_dtype) if dt.is_float
              else rng.integers(0, 8, s).astype(dt.np_dtype) for s in shapes]
    # a trace that cannot be written is refused now, before the run, not after it
    trace = AtomicOutput(args.trace, "--trace") if args.trace else None
    try:
        run = nki.JitKernel(kernel.fn, grid=kernel.grid, schedule=args.schedule is not False,
                         config=cfg).run(*arrays, **params)
        report, st = run.report, run.schedule_stats
        if trace is not None:
            write_trace(trace, report)
    finally:
        if trace is not None:
            trace.discard()
    outs = run.outputs if isinstance(run.outputs, (tuple, list)) else () if run.outputs is None else (run.outputs,)
    summary = []
    for i, o in enumerate(outs):
        f = np.asarray(o, dtype=np.float64)
        finite = f[np.isfinite(f)]
        summary.append({"output": i, "shape": list(f.shape), "dtype": str(o.dtype),
                        "min": float(finite.min()) if finite.size else None,
                        "max": float(finite.max()) if finite.size else None,
                        "mean": float(finite.mean()) if finite.size else None, "nonfinite": int(f.size - finite.size)})
    sched = {"policy": st.policy, "instructions": st.instructions, "moved": st.moved, "ticks": st.ticks,
             "program_order_ticks": st.as_built_ticks}
    if args.json:
        doc = {"kernel": args.name, "shapes": [list(s) for s in shapes], "dtype": dt.short, "config": cfg.name,
               "overrides": dict(cfg.overrides), "params": params, "bound": bound_of(report), "schedule": sched,
               "outputs": summary, "report": report.to_dict()}
        print(json.dumps(doc, indent=2))
        return 0
    console = _console()
    dims = ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in zip(tensors, shapes))
    line = f"[bold]{escape(args.name)}[/bold] (NKI) {dims}, {dt.short}"
    line += "".join(f", {k}={escape(str(v))}" for k, v in params.items())
    line += f" on {cfg.name}" + (f" ({cfg.describe_overrides()})" if cfg.overrides else "")
    line += "; values from random inputs (seed 0)"
    console.print(line)
    if st.policy == "program order":
        console.print(f"Program order kept ({st.instructions} instructions, tiles laid out by the scheduling pass)")
    else:
        console.print(f"Scheduled ({st.policy}): {st.moved} of {st.instructions} instructions moved; "
                      f"{st.as_built_ticks / max(st.ticks, 1):.2f}x faster than in program order")
    render_report(report, console, cfg)
    render_dma_queues(report, console)
    t = Table(title="Outputs")
    for col in ("output", "shape", "dtype", "min", "max", "mean", "non-finite"):
        t.add_column(col, justify="right" if col not in ("dtype",) else "left")
    for o in summary:
        fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
        t.add_row(str(o["output"]), "x".join(map(str, o["shape"])), o["dtype"], fmt(o["min"]), fmt(o["max"]),
                  fmt(o["mean"]), str(o["nonfinite"]))
    console.print(t)
    if args.trace:
        console.print(f"Trace written to {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
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
    try:  # with --json the script's own output goes to stderr: stdout is the JSON alone
        if compare:
            status, eager, rep = compare_eager(args.script, script_args, config=config, overrides=overrides,
                                               quiet_stdout=bool(as_json))
        else:
            status, rep = run_script(args.script, script_args, config=config, overrides=overrides,
                                     trace=trace, adaptive=opts.get("adaptive_eager", args.adaptive_eager),
                                     metrics=metrics, plot=plot, expand=args.expand + opts["expand"], expand_top=top,
                                     trace_stack=bool(opts.get("trace_stack", args.trace_stack)),
                                     quiet_stdout=bool(as_json), timing_only=timing_only)
    except (FileNotFoundError, RuntimeError) as e:
        raise UsageError(f"run: {e}") from None
    if as_json:
        data = {"eager": eager.to_dict(), "compiled": rep.to_dict()} if compare else rep.to_dict()
        print(json.dumps(data, indent=2))
        return status
    print_run_report(rep, f"{args.script} on {rep.config}" + (" (compiled)" if compare else ""))
    if compare:
        console = _Out(width=RUN_REPORT_WIDTH)
        console.print()
        render_comparison(eager, rep, f"{args.script} on {rep.config}", console)
    _say_written(_Out(width=RUN_REPORT_WIDTH), trace, metrics, plot)
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
        print(json.dumps(rep.to_dict(), indent=2))
        return 0
    render_rank_report(rep, f"{script} on {rep.world} ranks of {rep.system}", _Out(width=run_report_width(rep.total)))
    if trace:
        print(f"Trace written to {trace}: one process per rank, with its streams, its collectives and NeuronLink "
              f"lanes (open it in ui.perfetto.dev)")
    return 0


def render_comparison(eager: Any, compiled: Any, title: str, console: Any) -> None:
    """The same run eager and compiled, side by side (``trnsim run --compare-eager``)."""
    from rich.table import Table

    t = Table(title=f"eager vs compiled: {title}", title_justify="left")
    for col in ("", "eager", "compiled", "compiled / eager"):
        t.add_column(col, justify="left" if not col else "right")

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}x" if a else "-"

    for name, a, b, fmt in (("elapsed us (simulated)", eager.elapsed_us, compiled.elapsed_us, "{:,.1f}"),
                            ("device time us", eager.device_us, compiled.device_us, "{:,.1f}"),
                            ("device waiting on the host us", eager.host_wait_us, compiled.host_wait_us, "{:,.1f}"),
                            ("kernel launches", eager.launches, compiled.launches, "{:,}"),
                            ("host dispatches", eager.dispatches, compiled.dispatches, "{:,}"),
                            ("HBM MB", eager.hbm_bytes / 1e6, compiled.hbm_bytes / 1e6, "{:,.2f}")):
        t.add_row(name, fmt.format(a), fmt.format(b), ratio(a, b))
    console.print(t)
    speedup = eager.elapsed_us / compiled.elapsed_us if compiled.elapsed_us else 0.0
    console.print(f"compiled is {speedup:.2f}x faster in simulated time" if speedup >= 1 else
                  f"compiled is {1 / speedup:.2f}x slower in simulated time" if speedup else "nothing ran")
    if not compiled.compiled_graphs:
        console.print("(the script compiled nothing: wrap the model in torch.compile(..., backend=\"neuron\") to "
                      "compare)")


def _render_regions(rep: Any, console: Any) -> None:
    """The compiled regions of a run: what each fused kernel replaced and what that saved."""
    cols = ("region (fused aten ops)", "kernel", "calls", "time us", "eager us", "HBM MB", "eager HBM MB",
            "launches saved")
    rows = [[" ".join(r.fused_ops), r.kernel, f"{r.calls:,}", f"{r.time_us:,.1f}", f"{r.eager_time_us:,.1f}",
             f"{r.hbm_bytes / 1e6:,.2f}", f"{r.eager_hbm_bytes / 1e6:,.2f}", f"{r.eager_launches - r.calls:,}"]
            for r in rep.regions]
    console.print(_fitted_table(f"compiled regions: {len(rep.regions)} fused kernels", cols, rows,
                                names=cols[:2]))


def _reserve_outputs(trace: str | None, metrics: str | None, plot: str | None) -> list[Any]:
    """The output files a command writes, each refused now (not after the run) when it cannot be
    written or needs an extra that is missing."""
    from ..outputs.files import reserve_all
    from ..outputs.metrics import reserve as reserve_metrics
    from ..outputs.plot import reserve as reserve_plot

    return reserve_all([lambda: AtomicOutput(trace, "--trace") if trace else None,
                        lambda: reserve_metrics(metrics, "--metrics") if metrics else None,
                        lambda: reserve_plot(plot, "--plot") if plot else None])


def _say_written(console: Any, trace: str | None, metrics: str | None, plot: str | None) -> None:
    from rich.markup import escape

    if trace:
        console.print(f"Trace written to {escape(trace)} (open it in ui.perfetto.dev or chrome://tracing)")
    if metrics:
        console.print(f"Metrics written to {escape(metrics)} (Parquet)")
    if plot:
        console.print(f"Plot written to {escape(plot)}")


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
REPORT_WIDTH = 120
RUN_REPORT_WIDTH = REPORT_WIDTH
NAME_COLUMN = 28  # characters of an op, kernel or region name in a table


def run_report_width(rep: Any) -> int:
    """The console width of a run report (:data:`REPORT_WIDTH`, whatever its rows)."""
    return REPORT_WIDTH


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1, two decimals (4.12 MiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _fitted_table(title: str, cols: Sequence[str], rows: Sequence[Sequence[str]], names: Sequence[str] = (),
                  left: Sequence[str] = ()) -> Any:
    """A report table that fits :data:`REPORT_WIDTH`: figures are never cut (each column as wide as
    its widest cell or its header's longest word; a longer header takes two lines), the ``names``
    columns share what is left, at most :data:`NAME_COLUMN` each, and cut a longer name with an
    ellipsis (the data - --json, Parquet, the trace - keeps it whole). ``left``: columns aligned
    left besides the names."""
    import textwrap

    from rich import box
    from rich.table import Table

    widths = [max([len(r[i]) for r in rows] + [len(w) for w in col.split()]) for i, col in enumerate(cols)]
    named = [i for i, col in enumerate(cols) if col in names]
    for i in named:
        widths[i] = min(max([len(r[i]) for r in rows] + [len(cols[i])]), NAME_COLUMN)
    # the SIMPLE_HEAD box: one space of padding each side of a cell, a separator between cells and
    # at each edge
    room = REPORT_WIDTH - (3 * len(cols) + 1) - sum(w for i, w in enumerate(widths) if i not in named)
    while named and sum(widths[i] for i in named) > room and max(widths[i] for i in named) > 4:
        widest = max(named, key=lambda i: widths[i])
        widths[widest] -= 1
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, col in enumerate(cols):
        header = col if i in named else textwrap.fill(col, widths[i])
        t.add_column(header, justify="left" if i in named or col in left else "right", width=widths[i],
                     no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*r)
    return t


def render_run_report(rep: Any, title: str, console: Any) -> None:
    """A RunReport as a table, busiest op first (``trnsim run``, ``trnsim demo`` and
    examples/train_gpt2.py print it this way), then the run's time figures and its host-only ops.
    Collective rows (torch.distributed on the neuron backend) add what they moved: bytes (S),
    busbw and the time waiting for the group's last rank."""
    colls = any(r.collective is not None for r in rep.rows)
    cols = ["op", "kernel", "calls", "time us", "share", "wait us", "MFU", "HBM MB", "bound"]
    if colls:
        cols += ["bytes", "busbw GiB/s", "peers us", "shared"]
    rows = []
    for r in rep.rows:
        cells = [r.op, r.kernel + (" *" if r.generic else ""), f"{r.calls:,}", f"{r.time_us:,.1f}",
                 f"{r.share_percent:.1f}%", f"{r.host_wait_us:,.1f}", f"{r.mfu_percent:.1f}%",
                 f"{r.hbm_bytes / 1e6:,.2f}", r.bound]
        if colls:
            c = r.collective
            cells += [_size(c.bytes), f"{c.busbw / 2**30:,.2f}", f"{c.peer_wait_us:,.1f}", f"{c.slowdown:.2f}x"] \
                if c is not None else ["", "", "", ""]
        rows.append(cells)
    console.print(_fitted_table(f"neuron run report: {title}", cols, rows, names=("op", "kernel", "bound")))
    console.print(f"elapsed: {rep.elapsed_us:,.1f} us simulated; {rep.launches:,} launches: {rep.device_us:,.1f} us "
                  f"of device time, {rep.host_wait_us:,.1f} us of device idle waiting on the host")
    console.print(f"host: {rep.host_us:,.1f} us issuing launches; MFU {rep.mfu_percent:.1f}%")
    if rep.overlap_us >= 0.05:
        console.print(f"streams: {rep.overlap_us:,.1f} us of device time ran beside another stream's kernel on the same "
                      f"core (so device time can exceed elapsed); sharing the core's engines added "
                      f"{rep.contention_us:,.1f} us to those kernels (contention)")
    if rep.compiled_graphs or rep.graph_launches:
        console.print(f"compiled: {rep.compiled_graphs} graphs compiled in {rep.compile_seconds:.2f} s wall (not "
                      f"charged to the device); {rep.graph_launches:,} graph launches ({rep.dispatches:,} host "
                      f"dispatches for {rep.launches:,} kernels)")
    if rep.regions:
        console.print(f"fused regions: {sum(r.calls for r in rep.regions):,} launches of {len(rep.regions)} fused "
                      f"kernels instead of {sum(r.eager_launches for r in rep.regions):,} eager ones: "
                      f"{rep.launches_saved:,} launches and {rep.hbm_bytes_saved / 1e6:,.2f} MB of HBM traffic saved")
        _render_regions(rep, console)
    if rep.host_ops:
        ops = ", ".join(f"{op} {n:,}" for op, n in sorted(rep.host_ops.items(), key=lambda kv: (-kv[1], kv[0])))
        console.print(f"host-only ops (metadata, no device kernel): {rep.host_only_calls:,} calls: {ops}")
    console.print("(* generic kernel: DMA + engine streaming, no library kernel; wait: device idle waiting on the host; "
                  "bound launch: the device waited longer than it worked)")
    if colls:
        console.print("(collective rows: kernel is collective:algorithm of the NeuronLink model; bytes is nccl-tests' "
                      "S summed over calls; busbw over the model's time; peers: waiting for the group's last rank; "
                      "shared: the model's time over the same calls' alone, each simulated beside its sibling groups' "
                      "(the other TP or DP groups of an SPMD step); bound: what held the collective back in the model)")


def render_rank_report(rep: Any, title: str, console: Any) -> None:
    """A :class:`trnsim.ranks.MultiRankReport`: the rows of every rank summed (collectives beside
    compute), then one line per rank and the step time as the slowest rank saw it."""
    render_run_report(rep.total, f"{title} (all ranks)", console)

    def pct(part: float, whole: float) -> str:
        return f"{100.0 * part / whole:.0f}%" if whole else "-"
    rows = [[str(r), str(s.chip), f"{s.elapsed_us:,.1f}", f"{s.compute_us:,.1f}", f"{s.collective_us:,.1f}",
             pct(s.overlapped_us, s.collective_us), pct(s.beside_compute_us, s.collective_us),
             f"{s.exposed_us:,.1f}", f"{s.peer_wait_us:,.1f}", f"{s.collectives:,}", str(len(s.step_ends_us))]
            for r, s in sorted(rep.summaries.items())]
    console.print(_fitted_table(f"per rank ({rep.world} ranks of {rep.system}, rank r = NeuronCore r)",
                                ("rank", "chip", "elapsed us", "compute us", "collective us", "overlapped",
                                 "beside compute", "exposed us", "peers us", "collectives", "steps"), rows))
    slow = max(rep.summaries.values(), key=lambda s: s.elapsed_us)
    if rep.step_times_us:
        console.print(f"step: {rep.step_us:,.1f} us simulated as the slowest rank saw it "
                      f"({len(rep.step_times_us)} optimizer steps; the first, with setup, took "
                      f"{rep.step_times_us[0]:,.1f} us); slowest rank {slow.rank}: {slow.elapsed_us:,.1f} us elapsed")
    else:
        console.print(f"no optimizer steps; slowest rank {slow.rank}: {slow.elapsed_us:,.1f} us elapsed")
    console.print("(compute/collective: union of the rank's kernels / collectives on its timeline; exposed: collective "
                  "time with compute stalled on it (a kernel issued and held back, none running); overlapped: the rest, "
                  "hidden behind compute or the host still issuing; beside compute: with a kernel running at the same "
                  "time; peers: waiting for the last rank of a group)")


def print_run_report(rep: Any, title: str) -> None:
    """:func:`render_run_report` to stdout, wide enough for op and kernel names."""
    render_run_report(rep, title, _Out(width=run_report_width(rep)))


# ---------------------------------------------------------------------------------------------
# collective
# ---------------------------------------------------------------------------------------------


def _gib(v: float) -> str:
    return f"{v / 2**30:.2f}"


def cmd_collective(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from ..collectives import CollectiveError, simulate_collective
    from ..collectives.runner import parse_sizes
    from ..collectives.trace import write_collective_trace
    from ..config import load_system

    system = load_system(args.system, args.set)
    reps = []
    try:
        sizes = parse_sizes(args.bytes, args.factor)
        check_collective_ranks(system, args.ranks, "--ranks" if args.ranks is not None else args.collective)
        for n in sizes:
            check_collective_bytes(system, args.ranks, n, f"--bytes {clip_text(args.bytes, 60)}")
        for i, n in enumerate(sizes):
            trace = bool(args.trace) and i == len(sizes) - 1
            reps.append(simulate_collective(system, args.collective, n, ranks=args.ranks, dtype=args.dtype,
                                            algorithm=args.algo, trace=trace, instances=args.nodes))
    except CollectiveError as e:
        raise UsageError(str(e)) from None
    last = reps[-1]
    if args.trace:
        try:
            write_collective_trace(args.trace, [last], system.ranks_per_chip)
        except OSError as e:
            raise UsageError(f"--trace {args.trace}: cannot write it ({e.strerror or type(e).__name__})") from None
    if args.json:
        doc = {"collective": last.collective, "system": system.name, "ranks": last.ranks, "dtype": last.dtype,
               "placement": last.placement,
               "overrides": dict(system.overrides), "units": {"time": "us", "algbw": "GiB/s", "busbw": "GiB/s"},
               "results": [{"size(B)": r.nbytes, "count(elems)": r.count, "type": r.dtype, "time:avg(us)": r.time_us,
                            "algbw(GiB/s)": r.algbw / 2**30, "busbw(GiB/s)": r.busbw / 2**30,
                            "algorithm": r.algorithm, "estimate(us)": r.estimate.time_us, "report": r.to_dict()}
                           for r in reps]}
        print(json.dumps(doc, indent=2))
        return 0
    console = _Out(width=REPORT_WIDTH)
    cfg = system.chip
    head = (f"[bold]{last.collective}[/bold] on {escape(system.name)} ({system.chips} chips of "
            f"{system.ranks_per_chip} logical cores, LNC={cfg.chip.lnc}): {escape(last.placement)}, {last.dtype}")
    if system.overrides:
        head += f" ({escape(system.describe_overrides())})"
    console.print(head)
    t = Table(box=None, padding=(0, 1, 0, 1), pad_edge=False, collapse_padding=True, show_edge=False)
    cols = ("size(B)", "count(elems)", "type", "time(us)", "algbw(GiB/s)", "busbw(GiB/s)", "algorithm", "steps",
            "hops", "bound", "a-b(us)")
    why: dict[str, str] = {}
    rows = []
    for r in reps:
        why.setdefault(r.algorithm, r.reason)
        bound = r.bound if r.bound == "latency" else f"{r.bound} {r.bound_percent:.0f}%"
        rows.append((str(r.nbytes), str(r.count), r.dtype, f"{r.time_us:.2f}", _gib(r.algbw), _gib(r.busbw),
                     r.algorithm, str(r.steps), str(r.max_hops), bound, f"{r.estimate.time_us:.2f}"))
    for i, col in enumerate(cols):
        # figures are never cut; the algorithm and the bound give way (an ellipsis; --json has them whole)
        text = col in ("type", "algorithm", "bound")
        t.add_column(col, justify="left" if text else "right", no_wrap=True, overflow="ellipsis",
                     min_width=None if col in ("algorithm", "bound") else max(len(col), *(len(row[i]) for row in rows)))
    for row in rows:
        t.add_row(*(escape(c) for c in row))
    console.print(t)
    avg = sum(r.busbw for r in reps) / len(reps)
    console.print(f"Avg bus bandwidth: {_gib(avg)} GiB/s")
    factor = {"all-reduce": "2(n-1)/n", "all-gather": "(n-1)/n", "reduce-scatter": "(n-1)/n",
              "all-to-all": "(n-1)/n"}.get(last.collective, "1")
    console.print(f"algbw = size / time, busbw = algbw x {factor} = {last.busbw_factor:.4g} (nccl-tests' factor); "
                  f"both in GiB/s (2^30 bytes/s), as nccom-test prints them.")
    console.print("a-b(us): the alpha-beta estimate of the same call. bound: what held the chunks back longest "
                  "(latency: nothing, half the time).")
    for algo, reason in why.items():
        console.print(f"{algo}: {escape(reason)}")
    top = max(last.link_bytes.items(), key=lambda kv: kv[1], default=None)
    links = (f"; busiest link {escape(top[0])}: {format_quantity(top[1], 'bytes')} over {len(last.link_bytes)} "
             f"link directions used" if top else "; no link used (one chip: HBM to HBM)")
    console.print(f"At {format_quantity(last.nbytes, 'bytes')}: {last.transfers:,} transfers in {last.chunks:,} "
                  f"chunks{links}.")
    if args.trace:
        console.print(f"Trace of the {format_quantity(last.nbytes, 'bytes')} run written to {escape(args.trace)} "
                      f"(open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trnsim", description="A cycle-approximate virtual AWS Trainium.")
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
    _add_collective_parser(sub)
    from .estimate import add_parser as _add_estimate_parser
    from ..validate.cli import add_parser as _add_validate_parser

    _add_estimate_parser(sub)
    _add_validate_parser(sub)
    return p


def _add_collective_parser(sub: Any) -> None:
    from ..collectives import ALGORITHMS, COLLECTIVES
    from ..config import system_names

    c = sub.add_parser("collective", help="simulate a collective over a system's chips and links and print an "
                                          "nccom-test style table (size, count, type, time, algbw, busbw)")
    c.add_argument("collective", metavar="COLLECTIVE", help=f"one of {', '.join(COLLECTIVES)} (or nccom-test's "
                                                            f"allr, allg, redsct, alltoall, sendrecv)")
    c.add_argument("--system", default="trn2.48xlarge",
                   help=f"a system ({', '.join(system_names())}) or a YAML path; default trn2.48xlarge")
    c.add_argument("--ranks", type=int, help="ranks (logical NeuronCores, rank r on chip r // cores per chip); "
                                             "a divisor of the system's; default all")
    c.add_argument("--bytes", default="8B:4GiB", help="SIZE, MIN:MAX (times --factor each step) or SIZE,SIZE,...; "
                                                      "nccl-tests' S (the all-reduce buffer, the all-gather output...); "
                                                      "default 8B:4GiB")
    c.add_argument("-N", "--nodes", type=int, help="instances the ranks spread over, equally, as nccom-test's -N "
                                                   "(default: every instance of the system when they divide)")
    c.add_argument("--factor", type=int, default=2, help="growth factor of a MIN:MAX range (default 2)")
    c.add_argument("--algo", help=f"force an algorithm: {', '.join(ALGORITHMS)} (default: the size rule)")
    c.add_argument("--dtype", default="bf16", help="element type (default bf16; int64, uint64, fp64 move as 8-byte "
                                                   "words)")
    c.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="dotted override of the system (topology.x.bandwidth=128GB/s) or its chip "
                        "(core.dma.engine_bandwidth=40GB/s) (repeatable)")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.add_argument("--trace", metavar="OUT.json", help="write a Perfetto trace of the largest size: link lanes "
                                                       "and the ranks' CC DMA queues")
    c.set_defaults(fn=cmd_collective)


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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("trnsim: interrupted", file=sys.stderr)
        return 130
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
