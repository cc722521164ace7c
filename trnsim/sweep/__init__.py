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
import hashlib
import importlib.util
import io
import itertools
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..config import ChipConfig, ConfigError, clip_text, format_value, load_config, load_yaml_file
from ..config import resolve_config_path as _resolve_config
from ..config import resolve_system_path
from ..config.extras import require
from ..outputs.files import OutputError, check_output, lock_exclusive, write_atomic
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..kernels.registry import KernelEntry, call_build, get_kernel, parse_params, parse_shape
from ..outputs.metrics import is_parquet, read_sweep_parquet, write_sweep_parquet
from ..native.dtypes import get_dtype
from ..sim.report import bound_of  # the one definition (re-exported here: an old name)

__all__ = ["KernelRef", "Point", "SweepSpec", "SweepResult", "SweepStopped", "resolve_kernel", "load_spec", "run_sweep",
           "bound_of", "check_collective_bytes", "check_collective_ranks", "MAX_COLLECTIVE_RANKS", "DEFAULT_MAX_POINTS"]

SPEC_KEYS = ("config", "system", "grid", "kernels", "collectives", "estimates", "out")
KERNEL_KEYS = ("name", "shape", "shapes", "dtype", "dtypes", "params")


# ---------------------------------------------------------------------------------------------
# kernels by name or by path:function
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelRef:
    """A kernel the CLI can build: a registry entry, or a user's ``file.py:function`` (which
    follows the registry's calling convention but has no defaults, inputs or reference)."""

    name: str
    build: Callable[..., Kernel]
    entry: KernelEntry | None = None

    @property
    def default_shape(self) -> tuple[int, ...] | None:
        return self.entry.default_shape if self.entry else None

    @property
    def params(self) -> Mapping[str, Any] | None:
        """Parameter defaults (None: unknown, the user's function checks its own)."""
        return self.entry.params if self.entry else None

    def dtype(self, dtype: str | None) -> str | None:
        """``dtype`` normalised to its short name, or the kernel's default."""
        if dtype is None:
            return self.entry.default_dtype if self.entry else None
        try:
            return get_dtype(dtype).short
        except ValueError as e:
            raise KernelError(f"kernel '{self.name}': {e}") from None

    def make(self, shape: tuple[int, ...], dtype: str | None, config: ChipConfig,
             params: Mapping[str, Any]) -> Kernel:
        """Build the kernel. A user's function that raises is a one-line KernelError naming it
        and its exception (a library kernel's bug keeps its traceback)."""
        if self.entry is not None:
            return self.entry.make(shape, dtype or self.entry.default_dtype, config, params)
        what = f"kernel '{clip_text(self.name, 300)}'"
        try:
            return call_build(self.build, shape, dtype, config, params, what=what)
        except (KernelError, ConfigError):
            raise
        except RecursionError:
            raise KernelError(f"{what}: {getattr(self.build, '__name__', 'it')} recursed too deeply") from None
        except Exception as e:
            raise KernelError(f"{what}: {getattr(self.build, '__name__', 'it')} raised "
                              f"{type(e).__name__}: {clip_text(e, 200)}") from None


_USER_MODULES: dict[Path, Any] = {}


def _load_file(path: Path) -> Any:
    """Import a kernel file under a private module name (once per process), so a user's
    ``kernels.py`` never shadows or replaces an installed module of the same name."""
    shown = clip_text(path)
    try:
        path = path.resolve()
        if path in _USER_MODULES:
            return _USER_MODULES[path]
        found = path.is_file()
    except OSError as e:  # e.g. a name too long for the file system
        raise KernelError(f"kernel file '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if not found:
        raise KernelError(f"kernel file '{shown}' not found")
    mod_name = "_trnsim_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise KernelError(f"kernel file '{shown}' cannot be imported; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    # its own folder first while it loads, as `python file.py` (and `trnsim run`) would have it:
    # a kernel file that imports a module beside it loads from any working directory
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise KernelError(f"kernel file '{shown}' failed to import: {type(e).__name__}: {clip_text(e, 200)}") from None
    finally:
        if sys.path and sys.path[0] == str(path.parent):
            del sys.path[0]
    _USER_MODULES[path] = module
    return module


def resolve_kernel(name: str, base_dir: Path | None = None) -> KernelRef:
    """``matmul`` (registered) or ``path/to/file.py:function`` (relative to ``base_dir``, default
    the working directory)."""
    file, sep, fn = name.rpartition(":")
    if not sep or not file.endswith(".py"):
        return KernelRef(name, get_kernel(name).build, get_kernel(name))
    path = Path(file) if base_dir is None else base_dir / file
    module = _load_file(path)
    build = getattr(module, fn, None)
    if not callable(build):
        raise KernelError(f"kernel file '{clip_text(file)}' has no function '{clip_text(fn)}'")
    return KernelRef(name, build)


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


# ---------------------------------------------------------------------------------------------
# the spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One simulation: a chip variant (its overrides), a kernel, a shape, a dtype, params."""

    variant: tuple[tuple[str, str], ...]
    kernel: str
    shape: tuple[int, ...]
    dtype: str  # "" for a user kernel run without a dtype
    params: tuple[tuple[str, Any], ...] = ()
    kind: str = "kernel"  # or "collective": kernel is the collective, shape (ranks, bytes); or "estimate": the model, (tp, pp, dp)

    def key(self) -> tuple[str, ...]:
        """The point's identity as CSV cells, to skip points a previous run wrote."""
        if self.kind == "collective":
            from ..collectives.sweep_points import shape_of

            shape = shape_of(*self.shape)
        elif self.kind == "estimate":
            from .estimates import shape_text as estimate_shape

            shape = estimate_shape(self.shape)
        else:
            shape = shape_text(self.shape)
        return (*(v for _, v in self.variant), self.kernel, shape, self.dtype, params_text(self.params))


#: ranks one simulated collective may span: every chunk of every transfer is simulated, and a
#: group of this many takes minutes at gigabytes (the full group of every shipped system fits;
#: a 65,536-chip system's 262,144 ranks would not finish)
MAX_COLLECTIVE_RANKS = 1024


def check_collective_ranks(system: Any, ranks: int | None, what: str) -> None:
    """Refuse a collective group of more than :data:`MAX_COLLECTIVE_RANKS` ranks (``ranks``
    None: all of ``system``'s) before it is simulated, naming ``what`` sets it."""
    n = system.ranks if ranks is None else ranks
    if isinstance(n, int) and n > MAX_COLLECTIVE_RANKS:
        raise ConfigError(f"{what}: {n:,} ranks of {system.name} ({system.chips:,} chips) in one collective; a "
                          f"collective is simulated chunk by chunk, at most {MAX_COLLECTIVE_RANKS:,} ranks in one; "
                          f"give a group of its ranks")


def check_collective_bytes(system: Any, ranks: int | None, nbytes: int, what: str) -> None:
    """Refuse a collective buffer of ``nbytes`` (nccl-tests' S, bytes per rank) that no rank of
    ``system`` can hold: empty, or larger than a rank's share of its chip's HBM (the chip's
    capacity over the ranks placed on it, rank r on chip r // ranks per chip). ``ranks`` None:
    all of the system's. One-line :class:`ConfigError` naming ``what``."""
    from ..config import format_quantity

    if nbytes < 1:
        raise ConfigError(f"{what}: a collective moves at least 1 byte per rank, got {nbytes}")
    per_chip = max(1, min(ranks if isinstance(ranks, int) and ranks > 0 else system.ranks, system.ranks_per_chip))
    cap = system.chip.chip.hbm.capacity // per_chip
    if nbytes > cap:
        shown = f"{nbytes:,}" if nbytes < 10**16 else f"{nbytes:.3g}"
        share = f"{format_quantity(cap, 'bytes')}: {format_quantity(system.chip.chip.hbm.capacity, 'bytes')} of HBM " \
                f"over {per_chip} rank{'s' if per_chip > 1 else ''}" if per_chip > 1 else \
                f"{format_quantity(cap, 'bytes')} of HBM"
        raise ConfigError(f"{what}: {shown} bytes per rank, more than a rank's share of its chip on {system.name} "
                          f"({share})")


def params_text(params: Sequence[tuple[str, Any]]) -> str:
    return ";".join(f"{k}={v}" for k, v in params)


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    config: str
    grid: dict[str, list[str]]
    points: list[Point]
    out: Path
    engines: tuple[str, ...]  # engine names, for the per-engine columns
    system: str | None = None  # a system name or path: the grid varies it, collectives run on it

    @property
    def key_columns(self) -> list[str]:
        return [*self.grid, "kernel", "shape", "dtype", "params"]

    @property
    def columns(self) -> list[str]:
        extra: list[str] = []
        if any(p.kind == "collective" for p in self.points):
            from ..collectives.sweep_points import COLLECTIVE_COLUMNS

            extra = list(COLLECTIVE_COLUMNS)
        if any(p.kind == "estimate" for p in self.points):
            from .estimates import ESTIMATE_COLUMNS

            extra += list(ESTIMATE_COLUMNS)
        return [*self.key_columns, "cycles", "us", "mfu_percent", "mbu_percent", "bound",
                *(f"{e.lower()}_active_percent" for e in self.engines), "dma_active_percent",
                "instructions", "hbm_bytes", "dma_bytes", "matmul_flops", *extra, "error"]


def _config_ref(text: str, base_dir: Path) -> str:
    """A config name stays a name; a path is taken relative to the spec."""
    if text.endswith((".yaml", ".yml")) or "/" in text:
        return str(base_dir / text)
    return text


def _as_list(value: Any, where: str) -> list[Any]:
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: expected a non-empty list")
        return value
    if isinstance(value, (dict, type(None))):
        raise ConfigError(f"{where}: expected a value or a list of values, got {type(value).__name__}")
    return [value]


def _scalars(value: Any, where: str) -> list[str]:
    """A grid axis or a kernel's shapes/dtypes: scalars as text, each once. A list or mapping
    where a value belongs is refused (an alias bomb's expansion never reaches ``str``)."""
    out: list[str] = []
    seen: set[str] = set()
    for v in _as_list(value, where):
        if isinstance(v, (list, dict)) or v is None:
            raise ConfigError(f"{where}: expected a value, got {format_value(v)}")
        text = str(v)
        if text in seen:
            raise ConfigError(f"{where}: {clip_text(text)} is listed twice")
        seen.add(text)
        out.append(text)
    return out


#: Points a spec may have unless the user says more (``trnsim sweep --max-points N``): a typo in
#: a grid can multiply into millions of runs, and listing them alone takes gigabytes.
DEFAULT_MAX_POINTS = 10_000


def load_spec(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
              max_points: int | None = DEFAULT_MAX_POINTS) -> SweepSpec:
    """Read and check a sweep spec; every error is a one-line ConfigError naming the key.

    The number of points is counted before any is listed or built: more than ``max_points``
    (None: no limit) is an error that says how many there would be."""
    p = Path(path)
    where = clip_text(p.name)
    raw = load_yaml_file(p, where, "sweep spec")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = [k for k in raw if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {format_value(unknown[0])}; expected {', '.join(SPEC_KEYS)}")
    base_dir = p.parent
    system = raw.get("system")
    if system is not None and "config" in raw:
        raise ConfigError(f"{where}: give 'config' (a chip) or 'system' (chips and links), not both")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}: system: expected a system name or a YAML path, got {system!r}")
    for section in ("collectives", "estimates"):
        if system is None and raw.get(section) is not None:
            raise ConfigError(f"{where}: {section} need a 'system' (e.g. system: trn2.48xlarge)")
    system = _config_ref(system, base_dir) if system is not None else None
    if system is not None:
        try:
            resolve_system_path(system)
        except ConfigError as e:  # an unknown name or a missing file, named as the spec gives it
            raise ConfigError(f"{where}: system: {e}") from None
    config = raw.get("config", "trn2")
    if not isinstance(config, str):
        raise ConfigError(f"{where}: config: expected a config name or a YAML path, got {format_value(config)}")
    config = _config_ref(config, base_dir)
    if system is None:
        try:
            _resolve_config(config)
        except ConfigError as e:  # an unknown name or a missing file, named as the spec gives it
            raise ConfigError(f"{where}: config: {e}") from None
    out_path = Path(out) if out else _out_path(raw.get("out"), p, where)
    check_output(out_path, "sweep results", missing_dirs=True)  # a FIFO or a read-only directory: now
    _check_format(out_path, f"--out {clip_text(os.fspath(out))}" if out else f"{where}: out: {clip_text(str(raw.get('out')))}")
    grid_raw = raw.get("grid") or {}
    if not isinstance(grid_raw, dict):
        raise ConfigError(f"{where}: grid: expected a mapping of dotted override key -> list of values")
    grid = {clip_text(k): _scalars(vals, f"{where}: grid.{clip_text(k)}") for k, vals in grid_raw.items()}
    if system is not None:
        base_system = _load_system(system, ())
        config = base_system.chip.name
    base_cfg = _load(config, ()) if system is None else base_system.chip
    kernels = raw.get("kernels")
    if (raw.get("collectives") is None and raw.get("estimates") is None) or kernels is not None:
        if not isinstance(kernels, list) or not kernels:
            raise ConfigError(f"{where}: kernels: expected a non-empty list of {{name, shape(s), dtype(s), params}}")
    entries = [_kernel_entry(k, i, where, base_dir) for i, k in enumerate(kernels or [])]
    coll: list[Any] = []
    if raw.get("collectives") is not None:
        from ..collectives.sweep_points import collective_points

        coll = collective_points(raw["collectives"], where, base_system)
        for name, (ranks, nbytes), _, _ in coll:
            check_collective_ranks(base_system, ranks, f"{where}: collectives ({name}): ranks")
            check_collective_bytes(base_system, ranks, nbytes, f"{where}: collectives ({name} on {ranks} ranks): bytes")
    ests: list[Any] = []
    if raw.get("estimates") is not None:
        from .estimates import estimate_points

        ests = estimate_points(raw["estimates"], where, base_system)
    n_variants = math.prod(len(v) for v in grid.values())
    per_variant = sum(e.count for e in entries) + len(coll) + len(ests)
    n_points = n_variants * per_variant
    if max_points is not None and n_points > max_points:
        what = "kernel points" if not (coll or ests) else "kernel and collective points" if not ests else \
            "kernel, collective and estimate points"
        raise ConfigError(f"{where}: {n_variants:,} chip variants x {per_variant:,} {what} "
                          f"= {n_points:,} points, more than the limit of {max_points:,}; check the grid, or pass "
                          f"--max-points {n_points} to run them all")
    variants = [tuple(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    for variant in variants:
        try:
            _load(config, variant) if system is None else _load_system(system, variant)
        except ConfigError as e:
            raise ConfigError(f"{where}: grid: {e}") from None
    seen: set[tuple[Any, ...]] = set()
    for e in entries:
        for c in e.combos():
            if c in seen:
                what = " ".join(x for x in (c[0], shape_text(c[1]), c[2], params_text(c[3])) if x)
                raise ConfigError(f"{where}: kernels: {clip_text(what)} is listed twice")
            seen.add(c)
    combos = [c for e in entries for c in e.build(base_cfg)]
    points = [Point(v, *c) for v in variants for c in combos]
    points += [Point(v, *c, kind="collective") for v in variants for c in coll]
    points += [Point(v, *c, kind="estimate") for v in variants for c in ests]
    return SweepSpec(p, system or config, grid, points, out_path, tuple(base_cfg.engine_clocks), system)


def _out_path(value: Any, spec: Path, where: str) -> Path:
    if value is None:
        return spec.with_suffix(".csv")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: out: expected a CSV or .parquet path, got {format_value(value)}")
    return spec.parent / value


def _check_format(path: Path, what: str) -> None:
    """Results are CSV or Parquet, chosen by the suffix: any other name (``res.xlsx``) would get
    CSV text under a name that promises something else, so it is refused."""
    from ..outputs.metrics import PARQUET_SUFFIXES

    if path.suffix.lower() != ".csv" and not is_parquet(path):
        got = f"'{clip_text(path.suffix, 20)}'" if path.suffix else "no suffix"
        raise ConfigError(f"{what}: expected a results file ending in {', '.join(('.csv',) + PARQUET_SUFFIXES[:-1])} "
                          f"or {PARQUET_SUFFIXES[-1]} (CSV or Parquet), got {got}")


@dataclass(frozen=True)
class _Entry:
    """One ``kernels[i]`` of a spec, parsed but not built yet (so points can be counted first)."""

    loc: str
    ref: KernelRef
    name: str
    shapes: list[tuple[int, ...]]
    dtypes: list[str | None]
    params: dict[str, Any]

    @property
    def count(self) -> int:
        return len(self.shapes) * len(self.dtypes)

    def combos(self) -> list[tuple[str, tuple[int, ...], str, tuple[tuple[str, Any], ...]]]:
        params = tuple(sorted(self.params.items()))
        return [(self.name, shape, dtype or "", params) for shape in self.shapes for dtype in self.dtypes]

    def build(self, cfg: ChipConfig) -> list[tuple[str, tuple[int, ...], str, tuple[tuple[str, Any], ...]]]:
        """The combinations, each built once on ``cfg``: fail now, not after half the sweep."""
        try:
            for shape in self.shapes:
                for dtype in self.dtypes:
                    self.ref.make(shape, dtype, cfg, self.params)
        except (KernelError, ConfigError) as e:
            raise ConfigError(f"{self.loc}: {e}") from None
        return self.combos()


def _kernel_entry(k: Any, i: int, where: str, base_dir: Path) -> _Entry:
    """Parse ``kernels[i]``: resolve the kernel (importing a file kernel), its shapes, dtypes
    and params."""
    loc = f"{where}: kernels[{i}]"
    if not isinstance(k, dict) or "name" not in k:
        raise ConfigError(f"{loc}: expected a mapping with a 'name'")
    unknown = [key for key in k if key not in KERNEL_KEYS]
    if unknown:
        raise ConfigError(f"{loc}: unknown key {format_value(unknown[0])}; expected {', '.join(KERNEL_KEYS)}")
    for one, many in (("shape", "shapes"), ("dtype", "dtypes")):
        if one in k and many in k:
            raise ConfigError(f"{loc}: give '{one}' or '{many}', not both")
    if not isinstance(k["name"], str):
        raise ConfigError(f"{loc}: name: expected a kernel name or path/to/file.py:function, got "
                          f"{format_value(k['name'])}")
    name = k["name"]
    loc = f"{loc} ({clip_text(name)})"
    try:
        ref = resolve_kernel(name, base_dir)
        raw_shapes = k.get("shape", k.get("shapes"))
        if raw_shapes is None:
            if ref.default_shape is None:
                raise KernelError("a file kernel needs 'shape' or 'shapes'")
            shapes = [ref.default_shape]
        else:
            shapes = [parse_shape(s) for s in _scalars(raw_shapes, "shape")]
        raw_dtypes = k.get("dtype", k.get("dtypes"))
        dtypes = [ref.dtype(None)] if raw_dtypes is None else [ref.dtype(d) for d in _scalars(raw_dtypes, "dtype")]
        params_raw = k.get("params") or {}
        if not isinstance(params_raw, dict):
            raise KernelError(f"params: expected a mapping NAME: VALUE, got {format_value(params_raw)}")
        for pk, pv in params_raw.items():
            if isinstance(pv, (list, dict)) or pv is None:
                raise KernelError(f"params.{clip_text(pk)}: expected a value, got {format_value(pv)}")
        params = parse_params([f"{pk}={str(pv).lower() if isinstance(pv, bool) else pv}"
                               for pk, pv in params_raw.items()], ref.params, f"kernel '{clip_text(name)}'")
    except (KernelError, ConfigError) as e:
        raise ConfigError(f"{loc}: {e}") from None
    return _Entry(loc, ref, name, shapes, dtypes, params)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _load(config: str, variant: tuple[tuple[str, str], ...]) -> ChipConfig:
    return load_config(config, dict(variant))


@lru_cache(maxsize=64)
def _load_system(system: str, variant: tuple[tuple[str, str], ...]) -> Any:
    from ..config import load_system

    return load_system(system, dict(variant))


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

        return run_estimate_point(_load_system(task.system, pt.variant), pt.kernel, pt.shape, pt.dtype,  # type: ignore[arg-type]
                                  dict(pt.params))
    if pt.kind == "collective":
        from ..collectives.sweep_points import run_collective_point

        return run_collective_point(_load_system(task.system, pt.variant), pt.kernel, pt.shape,  # type: ignore[arg-type]
                                    pt.dtype, dict(pt.params))
    try:
        cfg = _load(task.config, pt.variant) if task.system is None else _load_system(task.system, pt.variant).chip
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
    (an :class:`~trnsim.files.OutputError`), each row is appended whole, a torn last row is
    dropped and rerun, and Ctrl-C or a dead worker ends the sweep with :class:`SweepStopped`
    after every finished row is in the file. A ``.parquet`` results file is rewritten
    atomically (every :data:`PARQUET_FLUSH_SECONDS` and at the end) from a journal beside it,
    ``.<name>.journal``, which takes each row at once with the CSV's guarantees and is removed
    when the sweep ends; a killed Parquet sweep's rows are in the two together."""
    cpus = os.cpu_count() or 1
    if jobs is None:
        jobs = cpus
    max_jobs = max(8, 4 * cpus)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= max_jobs:
        raise ConfigError(f"--jobs {jobs}: expected a positive number of worker processes, at most {max_jobs} "
                          f"on this machine ({cpus} CPUs)" if isinstance(jobs, int) and jobs > max_jobs else
                          f"--jobs {jobs}: expected a positive number of worker processes")
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


def _run_on_pool(tasks: list[_Task], jobs: int, f: Any, record: Callable[[Point, dict[str, Any]], None],
                 stopped: Callable[[str, bool], SweepStopped]) -> None:
    """The points on a local process pool of ``jobs`` workers, each row recorded as it finishes."""
    ctx = multiprocessing.get_context()
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
