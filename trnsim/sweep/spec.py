"""A sweep's spec: the YAML file (configs, systems, grid, kernels, collectives, estimates, output)
checked and expanded into :class:`Point` objects (:func:`load_spec`), and the configs of its variants,
loaded once per process."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..config import ChipConfig, ConfigError, clip_text, format_value, load_config, load_yaml_file
from ..config import resolve_config_path as _resolve_config
from ..config import resolve_system_path
from ..config.files import check_output
from ..isa import KernelError
from ..kernels.registry import parse_params, parse_shape
from ..sim.metrics import is_parquet
from .kernels import KernelRef, resolve_kernel, shape_text

SPEC_KEYS = ("config", "system", "grid", "kernels", "collectives", "estimates", "out")
KERNEL_KEYS = ("name", "shape", "shapes", "dtype", "dtypes", "params")

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
        base_system = load_system_variant(system, ())
        config = base_system.chip.name
    base_cfg = load_chip_variant(config, ()) if system is None else base_system.chip
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
    loaded: dict[Any, tuple[tuple[str, str], ...]] = {}
    for variant in variants:
        try:
            cfg = load_chip_variant(config, variant) if system is None else load_system_variant(system, variant)
        except ConfigError as e:
            raise ConfigError(f"{where}: grid: {e}") from None
        same = loaded.setdefault(_physical(cfg), variant)
        if same is not variant:  # 2.4GHz and 2400MHz: two texts, one chip, run twice
            raise ConfigError(f"{where}: grid: {clip_text(_variant_text(variant))} is the same config as "
                              f"{clip_text(_variant_text(same))}; list each value once")
    seen: set[tuple[Any, ...]] = set()
    for e in entries:
        for c in e.combos():
            if c in seen:
                what = " ".join(x for x in (c[0], shape_text(c[1]), c[2], params_text(c[3])) if x)
                raise ConfigError(f"{where}: kernels: {clip_text(what)} is listed twice")
            seen.add(c)
    for kind, pts in (("collective", coll), ("estimate", ests)):  # e.g. allr and all-reduce: one point, run twice
        once: set[tuple[str, ...]] = set()
        for c in pts:
            key = Point((), *c, kind=kind).key()
            if key in once:
                raise ConfigError(f"{where}: {kind}s: {clip_text(' '.join(x for x in key if x))} is listed twice")
            once.add(key)
    combos = [c for e in entries for c in e.build(base_cfg)]
    points = [Point(v, *c) for v in variants for c in combos]
    points += [Point(v, *c, kind="collective") for v in variants for c in coll]
    points += [Point(v, *c, kind="estimate") for v in variants for c in ests]
    return SweepSpec(p, system or config, grid, points, out_path, tuple(base_cfg.engine_clocks), system)


def _physical(cfg: Any) -> Any:
    """A loaded chip or system config less the override texts it records: two grid values that
    spell one quantity (``2.4GHz``, ``2400MHz``) load to equal configs."""
    if hasattr(cfg, "topology"):
        return dataclasses.replace(cfg, overrides=(), chip=_physical(cfg.chip))
    return dataclasses.replace(cfg, overrides=())


def _variant_text(variant: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant)


def _out_path(value: Any, spec: Path, where: str) -> Path:
    if value is None:
        return spec.with_suffix(".csv")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: out: expected a CSV or .parquet path, got {format_value(value)}")
    return spec.parent / value


def _check_format(path: Path, what: str) -> None:
    """Results are CSV or Parquet, chosen by the suffix: any other name (``res.xlsx``) would get
    CSV text under a name that promises something else, so it is refused."""
    from ..sim.metrics import PARQUET_SUFFIXES

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


@lru_cache(maxsize=64)
def load_chip_variant(config: str, variant: tuple[tuple[str, str], ...]) -> ChipConfig:
    return load_config(config, dict(variant))


@lru_cache(maxsize=64)
def load_system_variant(system: str, variant: tuple[tuple[str, str], ...]) -> Any:
    from ..config import load_system

    return load_system(system, dict(variant))
