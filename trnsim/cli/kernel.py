"""``trnsim kernel``: a library kernel, or an ``@nki.jit`` kernel from a file, built, simulated
and reported (``--check`` against its reference, ``--trace``/``--metrics``/``--plot``), and
``trnsim kernel --list``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .base import Out, UsageError, emit, reserve_outputs, say_written
from ..config import ChipConfig, clip_text, format_quantity, load_config
from ..config.files import AtomicOutput
from ..isa import KernelError
from ..sim.report import bound_of
from .render import render_dma_queues, render_report


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
        emit(json.dumps(data, indent=2))
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
    console = Out()
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
    outputs = reserve_outputs(args.trace, args.metrics, args.plot)
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
            from ..sim.metrics import write_kernel_metrics

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
        emit(json.dumps(doc, indent=2))
        return 0 if ok else 1
    console = Out()
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
    say_written(console, args.trace, args.metrics, args.plot)
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
        emit(json.dumps(doc, indent=2))
        return 0
    console = Out()
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
