"""Plots for a design review: a sweep's axes, a kernel's engine utilisation, a run's op time.

Needs matplotlib (the ``plot`` extra); without it every function raises
:class:`trnsim.extras.MissingExtra`, one line naming the extra. Figures are drawn with
matplotlib's object API on the Agg canvas (no window, no global pyplot state) and written
through :class:`trnsim.config.files.AtomicOutput`; the format follows the file's suffix (``.png``,
``.svg``, ``.pdf``). Every figure has a title and axis labels with units.

* :func:`plot_sweep` - ``trnsim plot results.{csv,parquet} --x KEY --y METRIC [--hue KEY]``: one
  series per value of ``--hue`` (and per value of any other key that varies, so points of
  different kernels or shapes are never joined); a numeric x axis (plain numbers, or quantities
  such as ``2.4GHz`` or ``192KiB``, drawn in their unit) gets lines, a categorical one bars.
* :func:`plot_kernel` - ``trnsim kernel --plot``: active % per engine and the DMA system, and each
  engine's utilisation over the kernel's time.
* :func:`plot_run` - ``trnsim run --plot``: the busiest ops' device time and share, and the
  engine utilisation of each.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Sequence

from ..config import ConfigError, clip_text, parse_quantity
from ..config.extras import require
from ..cores.base import ENGINE_TYPES, engine_names
from ..config.files import AtomicOutput

__all__ = ["PlotError", "FORMATS", "reserve", "plot_sweep", "plot_kernel", "plot_run", "load_results"]

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_DPI = 150
#: colours of what bounds a row besides the engines (whose colours are in the engine table)
_OTHER_BOUND_COLORS = {"DMA/HBM": "#dd8452", "launch": "#937860"}


def _bound_colors() -> dict[str, str]:
    return {**{n: ENGINE_TYPES[n].color for n in engine_names()}, **_OTHER_BOUND_COLORS}

# friendlier axis labels for the sweep columns people plot most
_LABELS = {"us": "kernel time (us)", "cycles": "kernel time (TensorE cycles)",
           "mfu_percent": "MFU (% of the bf16 peak)", "mbu_percent": "MBU (% of the HBM bandwidth one core reaches)",
           "total_time": "device time (s)"}


class PlotError(ConfigError):
    """A plot cannot be drawn as asked (a missing column, nothing to plot). One line."""


def reserve(path: str | os.PathLike[str], what: str = "--plot") -> AtomicOutput:
    """Check that matplotlib is there and that ``path`` is a writable image file of a known
    format, before any work: the reservation to pass to a ``plot_*`` function."""
    require("matplotlib", "plot", what)
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise PlotError(f"{what} {clip_text(os.fspath(path))}: expected a .png, .svg or .pdf file name")
    return AtomicOutput(path, what, text=False)


def new_figure(width: float, height: float) -> Any:
    require("matplotlib", "plot", "plotting")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, out: str | os.PathLike[str] | AtomicOutput, what: str) -> Path:
    target = out if isinstance(out, AtomicOutput) else reserve(out, what)
    fmt = FORMATS.get(Path(target.shown).suffix.lower(), "png")
    return target.commit(lambda f: fig.savefig(f, format=fmt, dpi=_DPI))


# ---------------------------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------------------------


def load_results(path: str | os.PathLike[str]) -> tuple[list[str], list[dict[str, str]], dict[str, str]]:
    """(columns, rows as text, units by column) of a sweep's CSV or Parquet results file or a
    metrics Parquet file. A CSV row with the wrong number of cells (a torn last line of a
    sweep still writing) is skipped."""
    from ..sim.metrics import PARQUET_SUFFIXES, is_parquet, read_table, unit_of

    shown = os.fspath(path)
    if is_parquet(path):
        table = read_table(path)
        columns = list(table.column_names)
        units = {}
        for field in table.schema:
            meta = field.metadata or {}
            units[field.name] = (meta.get(b"unit") or b"").decode() or unit_of(field.name)
        rows = [{c: "" if v is None else str(v) for c, v in r.items()} for r in table.to_pylist()]
        return columns, rows, units
    suffix = Path(shown).suffix
    if suffix.lower() != ".csv":  # a spec.yaml read as CSV named its first line as columns
        got = f"'{suffix}'" if suffix else "no suffix"
        raise PlotError(f"{shown}: expected a sweep's results or a metrics file, .csv or Parquet "
                        f"({', '.join(PARQUET_SUFFIXES)}), got {got}")
    try:
        with open(shown, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        raise PlotError(f"{shown}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"{shown}: cannot read it as a CSV file ({type(e).__name__})") from None
    reader = csv.reader(io.StringIO(text))
    columns = next(reader, None) or []
    if not columns:
        raise PlotError(f"{shown}: the file is empty")
    rows = [dict(zip(columns, cells)) for cells in reader if len(cells) == len(columns)]
    return columns, rows, {c: unit_of(c) for c in columns}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


_SCALES = {  # kind -> (base unit -> display: (unit, divisor) from the largest down)
    "hz": (("GHz", 1e9), ("MHz", 1e6), ("kHz", 1e3), ("Hz", 1)),
    "bytes": (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1)),
    "bandwidth": (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("B/s", 1)),
    "time": (("ms", 1e9), ("us", 1e6), ("ns", 1e3), ("ps", 1)),
}


def _numeric_axis(values: Sequence[str], unit: str) -> tuple[list[float], str] | None:
    """The values as numbers and their unit: plain numbers, or quantities with units (all of
    one kind, shown in the unit that suits their largest value); None when categorical."""
    nums = [_number(v) for v in values]
    if all(n is not None for n in nums):
        return [float(n) for n in nums], unit  # type: ignore[arg-type]
    for kind, scales in _SCALES.items():
        try:
            base = [parse_quantity(v, kind) for v in values]
        except ValueError:
            continue
        top = max(base)
        name, div = next(((n, d) for n, d in scales if top >= d), scales[-1])
        return [b / div for b in base], name
    return None


def _label(column: str, unit: str) -> str:
    if column in _LABELS:
        return _LABELS[column]
    return f"{column} ({unit})" if unit and unit not in column else column


def _key_columns(columns: Sequence[str]) -> list[str]:
    """The columns that name a point: a sweep's up to ``params``; a metrics file's level, config,
    op, kernel, core."""
    if "params" in columns:
        return list(columns[:columns.index("params") + 1])
    return [c for c in ("level", "config", "op", "kernel", "core") if c in columns]


def plot_sweep(results: str | os.PathLike[str], x: str, y: str, out: str | os.PathLike[str] | AtomicOutput,
               hue: str | None = None, where: Sequence[str] = (), title: str | None = None) -> Path:
    """Draw ``y`` against ``x`` from a results file, a series per ``hue`` value; ``where`` keeps
    the rows with ``KEY=VALUE`` (repeatable). Rows with an ``error`` or no ``y`` are left out."""
    columns, rows, units = load_results(results)
    shown = Path(results).name
    for flag, col in (("--x", x), ("--y", y), ("--hue", hue)):
        if col is not None and col not in columns:
            raise PlotError(f"{flag} {clip_text(col)}: {shown} has no such column; its columns: {', '.join(columns)}")
    for cond in where:
        key, eq, value = cond.partition("=")
        if not eq or key not in columns:
            raise PlotError(f"--where {clip_text(cond)}: expected COLUMN=VALUE with a column of {shown}")
        rows = [r for r in rows if r.get(key) == value]
    rows = [r for r in rows if not r.get("error") and r.get(y, "") != ""]
    if not rows:
        raise PlotError(f"{shown}: no row has a value of {y}" + (" where " + ", ".join(where) if where else "")
                        + " (rows with an error are left out)")
    ys = []
    for r in rows:
        v = _number(r[y])
        if v is None:
            raise PlotError(f"--y {y}: {clip_text(r[y])} is not a number; choose a numeric column")
        ys.append(v)
    axis = _numeric_axis([r[x] for r in rows], units.get(x, ""))
    keys = [c for c in _key_columns(columns) if c not in (x, hue)]
    varying = [c for c in keys if len({r.get(c) for r in rows}) > 1]
    group_cols = ([hue] if hue else []) + varying
    series: dict[tuple[str, ...], list[int]] = {}
    for i, r in enumerate(rows):
        series.setdefault(tuple(r.get(c, "") for c in group_cols), []).append(i)

    fig = new_figure(10.0, 5.5)
    ax = fig.add_subplot()
    if axis is not None:
        xs, xunit = axis
        for label, idx in series.items():
            idx = sorted(idx, key=lambda i: xs[i])
            ax.plot([xs[i] for i in idx], [ys[i] for i in idx], marker="o",
                    label=", ".join(label) if label else None)
        ax.set_xlabel(_label(x, xunit) if xunit else x)
    else:
        cats: list[str] = []
        for r in rows:
            if r[x] not in cats:
                cats.append(r[x])
        width = 0.8 / max(1, len(series))
        for k, (label, idx) in enumerate(series.items()):
            vals = {rows[i][x]: ys[i] for i in idx}
            pos = [c + (k - (len(series) - 1) / 2) * width for c in range(len(cats))]
            ax.bar([p for p, c in zip(pos, cats) if c in vals], [vals[c] for c in cats if c in vals], width,
                   label=", ".join(label) if label else None)
        ax.set_xticks(range(len(cats)), cats, rotation=30 if max(len(c) for c in cats) > 8 else 0, ha="right"
                      if max(len(c) for c in cats) > 8 else "center")
        ax.set_xlabel(x)
    ax.set_ylabel(_label(y, units.get(y, "")))
    ax.grid(True, alpha=0.3)
    if any(series):  # beside the axes, so it never hides a point
        fig.legend(title=", ".join(group_cols), fontsize="small", loc="outside right center")
    fig.suptitle(title or f"{y} vs {x}" + (f" by {hue}" if hue else "") + f" ({shown}, {len(rows)} points)")
    return save_figure(fig, out, "-o")


# ---------------------------------------------------------------------------------------------
# a kernel
# ---------------------------------------------------------------------------------------------


def _busy_bins(intervals: list[tuple[int, int]], edges: Any) -> Any:
    """Busy fraction of each bin between ``edges`` (ticks) for possibly overlapping intervals."""
    import numpy as np

    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if not merged:
        return np.zeros(len(edges) - 1)
    starts = np.array([m[0] for m in merged], dtype=float)
    ends = np.array([m[1] for m in merged], dtype=float)
    done = np.concatenate([[0.0], np.cumsum(ends - starts)])

    t = np.asarray(edges, dtype=float)
    k = np.searchsorted(starts, t, side="left")  # intervals starting before each edge
    j = np.maximum(k - 1, 0)  # the last of them: every earlier one ended before it started
    b = np.where(k > 0, done[j] + np.clip(np.minimum(t, ends[j]) - starts[j], 0, None), 0.0)
    return np.diff(b) / np.diff(edges)


def plot_kernel(report: Any, out: str | os.PathLike[str] | AtomicOutput, title: str | None = None,
                bins: int = 200) -> Path:
    """A kernel's engine utilisation: active % per engine (and the DMA system), and how busy each
    was over the kernel's time."""
    import numpy as np

    from ..sim.report import bound_of

    engines = list(report.engines) + ["DMA"]
    active = [report.engines[e].active_percent if e != "DMA" else report.dma.active_percent for e in engines]
    fig = new_figure(9.0, 6.0)
    top, bottom = fig.subplots(2, 1, height_ratios=[1, 1.2])
    bars = top.barh(engines, active, color=["#4c72b0" if e != "DMA" else "#dd8452" for e in engines])
    top.bar_label(bars, [f"{a:.1f}%" for a in active], padding=3, fontsize="small")
    top.invert_yaxis()
    top.set_xlim(0, 110)
    top.set_xlabel(f"active time (% of the kernel's {report.total_us:,.2f} us)")
    top.set_ylabel("engine")
    top.grid(True, axis="x", alpha=0.3)
    total = max(report.total_ticks, 1)
    edges = np.linspace(0, total, bins + 1)
    lanes: dict[str, list[tuple[int, int]]] = {e: [] for e in engines}
    for lane, _, start, end, _ in report.timeline:
        name = "DMA" if lane.startswith("q") else lane.split(" ")[0]
        if name in lanes:
            lanes[name].append((start, end))
    grid = np.array([_busy_bins(lanes[e], edges) * 100 for e in engines])
    us = report.total_us
    img = bottom.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=100, interpolation="nearest",
                        extent=(0, us, len(engines) - 0.5, -0.5))
    bottom.set_yticks(range(len(engines)), engines)
    bottom.set_xlabel("time since the kernel's first issue (us)")
    bottom.set_ylabel("engine")
    fig.colorbar(img, ax=bottom, label="busy (% of each time bin)")
    fig.suptitle(title or f"Kernel '{report.kernel}' on {report.config}: {report.total_us:,.2f} us "
                          f"({report.total_cycles:,.0f} cycles), MFU {report.mfu_estimated_percent:.1f}%, "
                          f"bound by {bound_of(report)}")
    return save_figure(fig, out, "--plot")


# ---------------------------------------------------------------------------------------------
# a run
# ---------------------------------------------------------------------------------------------


def plot_run(report: Any, out: str | os.PathLike[str] | AtomicOutput, title: str | None = None,
             top: int = 15) -> Path:
    """A run's busiest ``top`` (op, kernel) rows: device time with its share of the run, coloured
    by what bounds the row, and each row's engine utilisation."""
    import numpy as np

    rows = list(report.rows[:top])
    if not rows:
        raise PlotError("--plot: the run launched nothing on the neuron device, so there is nothing to plot")
    rest = report.rows[top:]
    labels = [f"{r.op} ({r.kernel}{' *' if r.generic else ''})" for r in rows]
    fig = new_figure(13.0, max(3.5, 0.42 * len(rows) + 2.0))
    left, right = fig.subplots(1, 2, width_ratios=[1.4, 1])
    times = [r.time_us for r in rows]
    colors = _bound_colors()
    bars = left.barh(labels, times, color=[colors.get(r.bound, "#999999") for r in rows])
    left.bar_label(bars, [f"{r.share_percent:.1f}%" for r in rows], padding=3, fontsize="small")
    left.invert_yaxis()
    left.set_xlabel("device time, summed over calls (us)")
    left.set_xlim(0, max(times) * 1.18 if max(times) > 0 else 1)
    left.grid(True, axis="x", alpha=0.3)
    seen = []
    for r in rows:
        if r.bound not in seen:
            seen.append(r.bound)
    from matplotlib.patches import Patch

    left.legend([Patch(color=colors.get(b, "#999999")) for b in seen], seen, title="bound", fontsize="small")
    if rest:
        left.set_ylabel(f"op (kernel); {len(rest)} more rows: {sum(r.share_percent for r in rest):.1f}% of device time")
    else:
        left.set_ylabel("op (kernel)")
    engines = [e for e in engine_names() + ("DMA",) if any(e in r.engine_percent for r in rows)]
    grid = np.array([[r.engine_percent.get(e, 0.0) for e in engines] for r in rows])
    img = right.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=100)
    right.set_xticks(range(len(engines)), engines, rotation=45, ha="right")
    right.set_yticks(range(len(rows)), [""] * len(rows))
    for i in range(len(rows)):
        for j in range(len(engines)):
            v = grid[i, j]
            right.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize="x-small",
                       color="white" if v < 60 else "black")
    right.set_xlabel("engine")
    fig.colorbar(img, ax=right, label="engine active (% of the row's device time)")
    fig.suptitle(title or f"neuron run on {report.config}: {report.elapsed_us:,.1f} us elapsed, {report.launches:,} "
                          f"launches, {report.device_us:,.1f} us device time, MFU {report.mfu_percent:.1f}%")
    return save_figure(fig, out, "--plot")
