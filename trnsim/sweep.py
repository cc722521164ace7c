"""Design-space sweeps: many chip variants x kernels x shapes, timing-only, into one CSV.

A spec is a YAML file::

    config: trn2                       # base config: a name or a YAML path (relative to the spec)
    grid:                              # dotted override -> values; the cartesian product is
      core.sbuf.partition_bytes: [192KiB, 224KiB]   # the set of chip variants
      core.tensor.clock: [2.4GHz, 2.8GHz]
    kernels:
      - {name: matmul, shapes: [512x1024x1024], dtype: bf16, params: {}}
      - {name: ../../examples/softmax_kernel.py:build_softmax, shape: 1024x2048}
    out: results.csv                   # optional; default <spec name>.csv beside the spec

The whole spec is checked before any point runs (every variant loads, every kernel resolves and
builds once on the base config), so a typo costs a one-line error, not half a sweep. Each
finished point is appended to the CSV at once; a rerun skips the points already there, so an
interrupted sweep resumes where it stopped.

This module holds no rendering: the CLI draws the progress bar and the summary table.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from .config import ChipConfig, ConfigError, load_config
from .isa import KernelError
from .kernel import Kernel
from .kernels.registry import KernelEntry, call_build, get_kernel, parse_params, parse_shape
from .native.dtypes import get_dtype
from .report import KernelReport

__all__ = ["KernelRef", "Point", "SweepSpec", "SweepResult", "resolve_kernel", "load_spec", "run_sweep", "bound_of"]

SPEC_KEYS = ("config", "system", "grid", "kernels", "collectives", "out")
KERNEL_KEYS = ("name", "shape", "shapes", "dtype", "dtypes", "params")


def bound_of(report: KernelReport) -> str:
    """The resource that limits the kernel: the busiest engine or the DMA system."""
    busy = {name: s.active_percent for name, s in report.engines.items() if name != "Sync"}
    busy["DMA/HBM"] = report.dma.active_percent
    return max(busy, key=lambda k: busy[k])


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
        if self.entry is not None:
            return self.entry.make(shape, dtype or self.entry.default_dtype, config, params)
        return call_build(self.build, shape, dtype, config, params, what=f"kernel '{self.name}'")


_USER_MODULES: dict[Path, Any] = {}


def _load_file(path: Path) -> Any:
    """Import a kernel file under a private module name (once per process), so a user's
    ``kernels.py`` never shadows or replaces an installed module of the same name."""
    shown, path = path, path.resolve()
    if path in _USER_MODULES:
        return _USER_MODULES[path]
    if not path.is_file():
        raise KernelError(f"kernel file '{shown}' not found")
    mod_name = "_trnsim_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise KernelError(f"kernel file '{shown}' cannot be imported; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise KernelError(f"kernel file '{shown}' failed to import: {type(e).__name__}: {e}") from None
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
        raise KernelError(f"kernel file '{file}' has no function '{fn}'")
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
    kind: str = "kernel"  # or "collective": kernel is the collective, shape (ranks, bytes)

    def key(self) -> tuple[str, ...]:
        """The point's identity as CSV cells, to skip points a previous run wrote."""
        if self.kind == "collective":
            from .collectives.sweep_points import shape_of

            shape = shape_of(*self.shape)
        else:
            shape = shape_text(self.shape)
        return (*(v for _, v in self.variant), self.kernel, shape, self.dtype, params_text(self.params))


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
            from .collectives.sweep_points import COLLECTIVE_COLUMNS

            extra = list(COLLECTIVE_COLUMNS)
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


def load_spec(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> SweepSpec:
    """Read and check a sweep spec; every error is a one-line ConfigError naming the key."""
    p = Path(path)
    where = p.name
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"sweep spec '{path}' not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"sweep spec '{path}': cannot read it ({type(e).__name__})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        raise ConfigError(f"{where}:{line} {getattr(e, 'problem', None) or 'invalid YAML'}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = [k for k in raw if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'; expected {', '.join(SPEC_KEYS)}")
    base_dir = p.parent
    system = raw.get("system")
    if system is not None and "config" in raw:
        raise ConfigError(f"{where}: give 'config' (a chip) or 'system' (chips and links), not both")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}: system: expected a system name or a YAML path, got {system!r}")
    if system is None and raw.get("collectives") is not None:
        raise ConfigError(f"{where}: collectives need a 'system' (e.g. system: trn2.48xlarge)")
    system = _config_ref(system, base_dir) if system is not None else None
    config = raw.get("config", "trn2")
    if not isinstance(config, str):
        raise ConfigError(f"{where}: config: expected a config name or a YAML path, got {config!r}")
    config = _config_ref(config, base_dir)
    grid_raw = raw.get("grid") or {}
    if not isinstance(grid_raw, dict):
        raise ConfigError(f"{where}: grid: expected a mapping of dotted override key -> list of values")
    grid = {str(k): [str(v) for v in _as_list(vals, f"{where}: grid.{k}")] for k, vals in grid_raw.items()}
    if system is not None:
        base_system = _load_system(system, ())
        config = base_system.chip.name
    base_cfg = _load(config, ()) if system is None else base_system.chip
    variants = [tuple(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    for variant in variants:
        try:
            _load(config, variant) if system is None else _load_system(system, variant)
        except ConfigError as e:
            raise ConfigError(f"{where}: grid: {e}") from None
    kernels = raw.get("kernels")
    if raw.get("collectives") is None or kernels is not None:
        if not isinstance(kernels, list) or not kernels:
            raise ConfigError(f"{where}: kernels: expected a non-empty list of {{name, shape(s), dtype(s), params}}")
    combos = [c for i, k in enumerate(kernels or []) for c in _kernel_points(k, i, where, base_dir, base_cfg)]
    seen = set()
    for c in combos:
        if c in seen:
            what = " ".join(x for x in (c[0], shape_text(c[1]), c[2], params_text(c[3])) if x)
            raise ConfigError(f"{where}: kernels: {what} is listed twice")
        seen.add(c)
    points = [Point(v, *c) for v in variants for c in combos]
    if raw.get("collectives") is not None:
        from .collectives.sweep_points import collective_points

        coll = collective_points(raw["collectives"], where, base_system)
        points += [Point(v, *c, kind="collective") for v in variants for c in coll]
    out_path = Path(out) if out else _out_path(raw.get("out"), p, where)
    return SweepSpec(p, system or config, grid, points, out_path, tuple(base_cfg.engine_clocks), system)


def _out_path(value: Any, spec: Path, where: str) -> Path:
    if value is None:
        return spec.with_suffix(".csv")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: out: expected a CSV path, got {value!r}")
    return spec.parent / value


def _kernel_points(k: Any, i: int, where: str, base_dir: Path, cfg: ChipConfig
                   ) -> list[tuple[str, tuple[int, ...], str, tuple[tuple[str, Any], ...]]]:
    """The (kernel, shape, dtype, params) combinations of ``kernels[i]``, each built once."""
    loc = f"{where}: kernels[{i}]"
    if not isinstance(k, dict) or "name" not in k:
        raise ConfigError(f"{loc}: expected a mapping with a 'name'")
    unknown = [key for key in k if key not in KERNEL_KEYS]
    if unknown:
        raise ConfigError(f"{loc}: unknown key '{unknown[0]}'; expected {', '.join(KERNEL_KEYS)}")
    for one, many in (("shape", "shapes"), ("dtype", "dtypes")):
        if one in k and many in k:
            raise ConfigError(f"{loc}: give '{one}' or '{many}', not both")
    name = str(k["name"])
    loc = f"{loc} ({name})"
    try:
        ref = resolve_kernel(name, base_dir)
        raw_shapes = k.get("shape", k.get("shapes"))
        if raw_shapes is None:
            if ref.default_shape is None:
                raise KernelError("a file kernel needs 'shape' or 'shapes'")
            shapes = [ref.default_shape]
        else:
            shapes = [parse_shape(str(s)) for s in _as_list(raw_shapes, "shape")]
        raw_dtypes = k.get("dtype", k.get("dtypes"))
        dtypes = [ref.dtype(None)] if raw_dtypes is None else [ref.dtype(str(d)) for d in _as_list(raw_dtypes, "dtype")]
        params_raw = k.get("params") or {}
        if not isinstance(params_raw, dict):
            raise KernelError(f"params: expected a mapping NAME: VALUE, got {params_raw!r}")
        params = parse_params([f"{pk}={str(pv).lower() if isinstance(pv, bool) else pv}"
                               for pk, pv in params_raw.items()], ref.params, f"kernel '{name}'")
        out = []
        for shape in shapes:
            for dtype in dtypes:
                ref.make(shape, dtype, cfg, params)  # fail now, not after half the sweep
                out.append((name, shape, dtype or "", tuple(sorted(params.items()))))
        return out
    except (KernelError, ConfigError) as e:
        raise ConfigError(f"{loc}: {e}") from None


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _load(config: str, variant: tuple[tuple[str, str], ...]) -> ChipConfig:
    return load_config(config, dict(variant))


@lru_cache(maxsize=64)
def _load_system(system: str, variant: tuple[tuple[str, str], ...]) -> Any:
    from .config import load_system

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
    from .chip import Chip

    pt = task.point
    row: dict[str, Any] = {"error": ""}
    if pt.kind == "collective":
        from .collectives.sweep_points import run_collective_point

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


def _read_done(spec: SweepSpec, out: Path) -> dict[tuple[str, ...], dict[str, str]] | None:
    """The rows already in ``out`` by point key; None when there is no file (or an empty one)."""
    if not out.exists() or out.stat().st_size == 0:
        return None
    with out.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != spec.columns:
            raise ConfigError(f"{out}: its columns ({', '.join(reader.fieldnames or [])}) are not this spec's "
                              f"({', '.join(spec.columns)}); delete it or choose another --out")
        return {tuple(r[c] for c in spec.key_columns): r for r in reader}


@dataclass(frozen=True)
class SweepResult:
    rows: list[dict[str, str]]  # every point's CSV row (as text), in the spec's point order
    ran: int  # points simulated by this run; the others came from the CSV of an earlier run


def run_sweep(spec: SweepSpec, jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> SweepResult:
    """Run every point of ``spec`` not already in its CSV, appending each row as it finishes.

    ``jobs`` worker processes (default: one per CPU; 1 runs in this process). ``progress(done,
    total)`` is called once before and after each point."""
    if jobs is None:
        jobs = os.cpu_count() or 1
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: expected a positive number of worker processes")
    out = spec.out
    existing = _read_done(spec, out)
    done = existing or {}
    todo = [pt for pt in spec.points if pt.key() not in done]
    total, finished = len(spec.points), len(spec.points) - len(todo)
    if progress:
        progress(finished, total)
    rows: dict[tuple[str, ...], dict[str, str]] = dict(done)
    base_dir = str(spec.path.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=spec.columns)
        if existing is None:
            writer.writeheader()
            f.flush()

        def record(pt: Point, result: dict[str, Any]) -> None:
            nonlocal finished
            # as text, as the CSV holds it, so fresh and resumed rows look alike
            row = {c: "" for c in spec.columns}
            row.update(zip(spec.key_columns, pt.key()))
            row.update((k, str(v)) for k, v in result.items())
            writer.writerow(row)
            f.flush()
            rows[pt.key()] = row
            finished += 1
            if progress:
                progress(finished, total)

        tasks = [_Task(spec.config, base_dir, pt, spec.system) for pt in todo]
        if jobs == 1 or len(tasks) <= 1:
            for t in tasks:
                record(t.point, run_point(t))
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
                futures = {pool.submit(run_point, t): t.point for t in tasks}
                for fut in as_completed(futures):
                    record(futures[fut], fut.result())
    return SweepResult([rows[pt.key()] for pt in spec.points], len(todo))
