"""Metrics as data: run, kernel and sweep results as Parquet files, for automated analysis.

Needs pyarrow (the ``metrics`` extra); without it every writer raises
:class:`trnsim.extras.MissingExtra`, one line naming the extra.

**Run and kernel metrics** share one table layout, so files of runs and kernels can be read
together: one row per (op, kernel) of a :class:`~trnsim.report.RunReport` (``level`` = ``"op"``)
or per :class:`~trnsim.report.KernelReport` (``level`` = ``"kernel"``), with neuron-profile's
metric names where it has one (:func:`columns`; a column that does not apply to a level is
null). Every column's unit is in its field metadata (``unit``), and the file's metadata
``trnsim`` holds the run's totals as JSON. Fields that other parts of trnsim add to ``OpRow``
appear as extra columns after these, named after the field (a mapping ``f`` becomes ``f.key``,
a tuple of values a list column), e.g. a compiled region's ``fused_ops`` and ``eager_*`` figures.

**Sweep results** (``out: results.parquet``) keep the CSV's columns, typed: text for the point's
keys (grid values as written, kernel, shape, dtype, params) and the bound, numbers for the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import IO, Any, Iterable, Mapping, Sequence

from ..config import ConfigError
from ..config.extras import require
from ..cores.base import ENGINE_TYPES, engine_names
from ..config.files import AtomicOutput, OutputError

__all__ = ["reserve", "columns", "engine_column", "run_rows", "kernel_rows", "write_run_metrics", "write_kernel_metrics",
           "metrics_table", "unit_of", "is_parquet", "write_sweep_parquet", "read_sweep_parquet", "read_table",
           "PARQUET_SUFFIXES"]

PARQUET_SUFFIXES = (".parquet", ".pq")

# (column, arrow type, unit, what it is). neuron-profile's names where it has one (datasheet §12);
# one activity column per engine of the engine table goes between these two parts (columns()).
_HEAD: tuple[tuple[str, str, str, str], ...] = (
    ("level", "string", "", "'op': one (op, kernel) of a run; 'kernel': one simulated kernel"),
    ("config", "string", "", "chip config"),
    ("op", "string", "", "the PyTorch op (op rows)"),
    ("kernel", "string", "", "the kernel it ran"),
    ("core", "int64", "", "physical core of a kernel row"),
    ("generic", "bool", "", "no library kernel expressed the op: the generic streaming kernel was charged"),
    ("calls", "int64", "launches", "launches (1 for a kernel row)"),
    ("source_line", "string", "", "the Python line whose launches took most of the row's device time"),
    ("total_time", "double", "s", "device time, summed over calls"),
    ("total_cycles", "double", "cycles", "TensorE-clock cycles of a kernel row"),
    ("share_percent", "double", "%", "of the run's device time"),
    ("host_wait_time", "double", "s", "device idle before these launches, waiting for the host"),
)
_TAIL: tuple[tuple[str, str, str, str], ...] = (
    ("dma_active_time_percent", "double", "%", "any DMA queue moving data / time"),
    ("mfu_estimated_percent", "double", "%", "matmul FLOPs over the bf16 peak for the time"),
    ("hfu_estimated_percent", "double", "%", "BF16-equivalent hardware FLOPs over the peak (kernel rows)"),
    ("mbu_estimated_percent", "double", "%", "HBM bytes over what one core reaches for the time (kernel rows)"),
    ("hbm_read_bytes", "int64", "bytes", ""),
    ("hbm_write_bytes", "int64", "bytes", ""),
    ("sbuf_read_bytes", "int64", "bytes", "kernel rows"),
    ("sbuf_write_bytes", "int64", "bytes", "kernel rows"),
    ("psum_read_bytes", "int64", "bytes", "kernel rows"),
    ("psum_write_bytes", "int64", "bytes", "kernel rows"),
    ("dma_bytes", "int64", "bytes", "moved by the DMA engines (trnsim's name)"),
    ("dma_transfers", "int64", "transfers", "kernel rows (trnsim's name)"),
    ("dma_transfer_average_bytes", "double", "bytes", "kernel rows"),
    ("matmul_flops", "int64", "FLOP", "2 x MACs"),
    ("mm_arithmetic_intensity", "double", "FLOP/byte", "matmul FLOPs per HBM byte"),
    ("sbuf_peak_bytes", "int64", "bytes", "per partition (kernel rows)"),
    ("psum_peak_bytes", "int64", "bytes", "per partition (kernel rows)"),
    ("instructions", "int64", "instructions", "kernel rows"),
    ("bound", "string", "", "what limits it: an engine, DMA/HBM, or launch (the host)"),
)


def engine_column(engine: str) -> str:
    """The activity column of an engine as reports key it (``"DMA"``: the DMA system)."""
    return "dma_active_time_percent" if engine == "DMA" else f"{engine.lower()}_engine_active_time_percent"


def columns() -> tuple[tuple[str, str, str, str], ...]:
    """The run and kernel metrics columns, in order: one activity column per registered engine
    (the engine table, :func:`trnsim.cores.base.engine_names`) among the fixed ones."""
    engines = tuple((engine_column(n), "double", "%", f"{ENGINE_TYPES[n].title or n} busy / time")
                    for n in engine_names())
    return _HEAD + engines + _TAIL


_UNITS = {name: unit for name, _, unit, _ in _HEAD + _TAIL}
# OpRow fields these columns already hold (other fields become columns of their own)
_OPROW_KNOWN = {"op", "kernel", "generic", "calls", "time_us", "share_percent", "host_wait_us", "engine_percent",
                "hbm_bytes", "matmul_flops", "mfu_percent", "bound", "hbm_read_bytes", "hbm_write_bytes",
                "dma_bytes", "source_line"}


def reserve(path: str | os.PathLike[str], what: str = "--metrics") -> AtomicOutput:
    """Check that pyarrow is there and ``path`` can be written, before any work: the
    reservation to pass to a ``write_*`` function."""
    suffix = Path(os.fspath(path)).suffix.lower()
    if suffix in _NOT_PARQUET:  # (Parquet bytes under a .csv name fool every reader of the file)
        raise OutputError(f"{what} {os.fspath(path)}: the metrics are written as Parquet, not {suffix[1:].upper()}; "
                          f"give a .parquet file")
    require("pyarrow.parquet", "metrics", what)
    return AtomicOutput(path, what, text=False)


#: suffixes of other formats a --metrics file is refused under (any other name is written as given)
_NOT_PARQUET = (".csv", ".json", ".jsonl", ".tsv", ".txt", ".png", ".svg", ".pdf", ".yaml", ".yml")


def unit_of(column: str) -> str:
    """The unit of a metrics or sweep column ("" when it has none or is unknown)."""
    if column in _UNITS:
        return _UNITS[column]
    if column in _SWEEP_UNITS:
        return _SWEEP_UNITS[column]
    if column.endswith("_percent"):
        return "%"
    if column.endswith("_bytes"):
        return "bytes"
    if column.endswith("_us"):
        return "us"
    return ""


def _intensity(flops: int, hbm: int) -> float | None:
    return flops / hbm if hbm else None


def run_rows(report: Any) -> list[dict[str, Any]]:
    """One row per (op, kernel) of a RunReport, keyed by column name."""
    rows = []
    for r in report.rows:
        row: dict[str, Any] = {
            "level": "op", "config": report.config, "op": r.op, "kernel": r.kernel, "generic": r.generic,
            "calls": r.calls, "source_line": r.source_line or None, "total_time": r.time_us / 1e6,
            "share_percent": r.share_percent, "host_wait_time": r.host_wait_us / 1e6,
            "mfu_estimated_percent": r.mfu_percent, "hbm_read_bytes": r.hbm_read_bytes,
            "hbm_write_bytes": r.hbm_write_bytes, "dma_bytes": r.dma_bytes, "matmul_flops": r.matmul_flops,
            "mm_arithmetic_intensity": _intensity(r.matmul_flops, r.hbm_bytes), "bound": r.bound,
        }
        for engine, pct in r.engine_percent.items():
            row[engine_column(engine)] = pct
        for f in dataclasses.fields(r):  # fields other parts of trnsim add to OpRow, as they are
            if f.name not in _OPROW_KNOWN:
                _put(row, f.name, getattr(r, f.name))
        rows.append(row)
    return rows


def _put(row: dict[str, Any], name: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _put(row, f"{name}.{k}", v)
    elif value is None or isinstance(value, (bool, int, float, str)):
        row[name] = value
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        row[name] = list(value)  # a list column
    else:
        row[name] = json.dumps(value, default=str)


def kernel_rows(reports: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per KernelReport."""
    rows = []
    for rep in reports:
        hbm = rep.hbm_read_bytes + rep.hbm_write_bytes
        row: dict[str, Any] = {
            "level": "kernel", "config": rep.config, "op": None, "kernel": rep.kernel, "core": rep.core,
            "generic": False, "calls": 1, "total_time": rep.total_us / 1e6, "total_cycles": rep.total_cycles,
            "dma_active_time_percent": rep.dma.active_percent, "mfu_estimated_percent": rep.mfu_estimated_percent,
            "hfu_estimated_percent": rep.hfu_estimated_percent, "mbu_estimated_percent": rep.mbu_estimated_percent,
            "hbm_read_bytes": rep.hbm_read_bytes, "hbm_write_bytes": rep.hbm_write_bytes,
            "sbuf_read_bytes": rep.sbuf_read_bytes, "sbuf_write_bytes": rep.sbuf_write_bytes,
            "psum_read_bytes": rep.psum_read_bytes, "psum_write_bytes": rep.psum_write_bytes,
            "dma_bytes": rep.dma.bytes, "dma_transfers": rep.dma.transfers,
            "dma_transfer_average_bytes": rep.dma.average_bytes, "matmul_flops": rep.matmul_flops,
            "mm_arithmetic_intensity": _intensity(rep.matmul_flops, hbm), "sbuf_peak_bytes": rep.sbuf_peak_bytes,
            "psum_peak_bytes": rep.psum_peak_bytes, "instructions": sum(rep.instruction_counts.values()),
            "bound": rep.bound,
        }
        for engine, stats in rep.engines.items():
            row[engine_column(engine)] = stats.active_percent
        rows.append(row)
    return rows


def metrics_table(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> Any:
    """A pyarrow Table of metric rows: :func:`columns` first (typed, with units), then any
    other keys the rows hold (types inferred)."""
    pa = require("pyarrow", "metrics", "Parquet metrics")
    cols = columns()
    fields = [pa.field(name, pa.type_for_alias(typ), metadata={"unit": unit, "doc": doc})
              for name, typ, unit, doc in cols]
    known = {name for name, *_ in cols}
    extra: list[str] = []
    for row in rows:
        extra += [k for k in row if k not in known and k not in extra]
    arrays = [pa.array([row.get(f.name) for row in rows], type=f.type) for f in fields]
    for name in extra:
        arr = pa.array([row.get(name) for row in rows])
        fields.append(pa.field(name, arr.type, metadata={"unit": unit_of(name)}))
        arrays.append(arr)
    schema = pa.schema(fields, metadata={"trnsim": json.dumps(dict(meta or {}), default=str)})
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(path: str | os.PathLike[str] | AtomicOutput, table: Any, what: str) -> Path:
    pq = require("pyarrow.parquet", "metrics", what)
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, what, text=False)
    return out.commit(lambda f: pq.write_table(table, f))


def write_run_metrics(path: str | os.PathLike[str] | AtomicOutput, report: Any) -> Path:
    """``report`` (a RunReport) as a Parquet file of op rows; the run's totals in its metadata."""
    meta = {"kind": "run", "config": report.config, "elapsed_us": report.elapsed_us, "device_us": report.device_us,
            "host_us": report.host_us, "host_wait_us": report.host_wait_us, "launches": report.launches,
            "hbm_bytes": report.hbm_bytes, "matmul_flops": report.matmul_flops, "mfu_percent": report.mfu_percent,
            "host_ops": report.host_ops}
    return _write(path, metrics_table(run_rows(report), meta), "metrics")


def write_kernel_metrics(path: str | os.PathLike[str] | AtomicOutput, reports: Sequence[Any],
                         meta: Mapping[str, Any] | None = None) -> Path:
    """KernelReports as a Parquet file of kernel rows."""
    return _write(path, metrics_table(kernel_rows(reports), {"kind": "kernel", **(meta or {})}), "metrics")


def read_table(path: str | os.PathLike[str]) -> Any:
    """A Parquet file as a pyarrow Table (one-line ConfigErrors for a missing or damaged file)."""
    pq = require("pyarrow.parquet", "metrics", "reading Parquet")
    shown = os.fspath(path)
    try:
        return pq.read_table(shown)
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such file") from None
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for files that are not Parquet
        raise ConfigError(f"{shown}: not a readable Parquet file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None


# ---------------------------------------------------------------------------------------------
# sweep results
# ---------------------------------------------------------------------------------------------

_SWEEP_UNITS = {"cycles": "cycles", "us": "us", "instructions": "instructions", "hbm_bytes": "bytes",
                "dma_bytes": "bytes", "matmul_flops": "FLOP", "algbw_gib_s": "GiB/s", "busbw_gib_s": "GiB/s",
                "estimate_us": "us"}
_SWEEP_INTS = ("instructions", "hbm_bytes", "dma_bytes", "matmul_flops")
_SWEEP_TEXT = ("kernel", "shape", "dtype", "params", "bound", "error", "algorithm")


def is_parquet(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


def _sweep_type(column: str, key_columns: Sequence[str]) -> str:
    if column in key_columns or column in _SWEEP_TEXT:
        return "string"
    if column in _SWEEP_INTS:
        return "int64"
    return "double"


def _typed(values: list[str], typ: str) -> list[Any] | None:
    """CSV cells as ``typ`` ("" is null), or None when one of them is not a number."""
    if typ == "string":
        return [v if v != "" else None for v in values]
    conv = int if typ == "int64" else float
    try:
        return [conv(v) if v != "" else None for v in values]
    except ValueError:
        return None


def write_sweep_parquet(f: IO[bytes], columns: Sequence[str], key_columns: Sequence[str],
                        rows: Sequence[Mapping[str, str]], meta: Mapping[str, Any]) -> None:
    """Sweep rows (CSV text cells) as a typed Parquet file written to ``f``. A figure column
    with a cell that is not a number is written as text, so no cell is ever lost."""
    pa = require("pyarrow", "metrics", "Parquet sweep results")
    pq = require("pyarrow.parquet", "metrics", "Parquet sweep results")
    fields, arrays = [], []
    for c in columns:
        cells = [row.get(c, "") for row in rows]
        typ = _sweep_type(c, key_columns)
        values = _typed(cells, typ)
        if values is None:
            typ, values = "string", _typed(cells, "string")
        fields.append(pa.field(c, pa.type_for_alias(typ), metadata={"unit": unit_of(c)}))
        arrays.append(pa.array(values, type=pa.type_for_alias(typ)))
    schema = pa.schema(fields, metadata={"trnsim": json.dumps(dict(meta), default=str)})
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), f)


def read_sweep_parquet(path: str | os.PathLike[str]) -> tuple[list[str], list[dict[str, str]]]:
    """(columns, rows as CSV text: the cells a sweep wrote, "" for null) of a Parquet results file."""
    table = read_table(path)
    rows = [{c: "" if v is None else str(v) for c, v in row.items()} for row in table.to_pylist()]
    return list(table.column_names), rows
