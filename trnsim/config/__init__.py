"""Chip configurations: frozen, typed dataclasses loaded from YAML.

A config names every hardware figure the model uses; no hardware constant lives in engine code.
Quantities carry their unit in the YAML (``224KiB``, ``2.4GHz``, ``2.9TB/s``, ``1300ns``) and
are parsed once, exactly, into integers (bytes, Hz, bytes/s, picoseconds). Loading rejects
unknown keys, bad units and out-of-range values with a one-line :class:`ConfigError` that names
the file, the key, the value and what was expected.

Overrides use dotted keys (``core.sbuf.partition_bytes=256KiB``) and are applied to the raw
YAML before validation, so they get the same checks and the same messages.

Beside the configs, the package holds how trnsim treats a user's files: :mod:`.loader` reads
them with bounds and one-line errors, :mod:`.files` writes every output atomically (traces,
metrics, sweep results, caches), so the layers above share one set of rules.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .loader import (ERROR_VALUE_CHARS, MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES, ConfigError, clip_text,
                     env_int, file_kind, format_value, load_yaml, load_yaml_file, read_bounded)
from .schema import (MAX_TICK_HZ, MAX_TIME_PS, TYPES, Calibration, build, calibrations_of, override_pairs,
                     override_value)
from .schema import bool_field as _bool
from .schema import float_field as _num
from .schema import int_field as _int
from .schema import quantity_field as _q
from .schema import str_field as _str
from .units import format_quantity, parse_quantity

__all__ = [
    "ConfigError",
    "ChipConfig",
    "CoreConfig",
    "load_config",
    "config_names",
    "parse_quantity",
    "format_quantity",
    "format_value",
    "clip_text",
    "load_yaml",
    "load_yaml_file",
    "file_kind",
    "env_int",
    "Calibration",
    "shipped_dir",
    "ENGINE_SECTIONS",
    "engine_section",
]

def shipped_dir(name: str) -> Path:
    """A data folder of the repository's top level (``configs``, ``validation``): the copy a wheel
    carries in ``trnsim/shipped/`` (setup.py puts it there), else the checkout's own."""
    here = Path(__file__).resolve().parents[1]
    shipped = here / "shipped" / name
    return shipped if shipped.is_dir() else here.parent / name


CONFIG_DIR = shipped_dir("configs")



# ---------------------------------------------------------------------------------------------
# The chip schema
# ---------------------------------------------------------------------------------------------

#: engine name -> (the key of its section under ``core``, the section's dataclass), in the order
#: the sections are declared: the config half of the engine table (trnsim.cores.base holds the
#: other). Every engine clock (:attr:`ChipConfig.engine_clocks`) comes from here. The built-in
#: engines' sections are fields of :class:`CoreConfig`; a section declared by another module (a
#: new engine added without touching this file) is kept in ``CoreConfig.extra_engines`` and is
#: read as ``core.<key>`` all the same, loaded, checked and overridden like the others.
ENGINE_SECTIONS: dict[str, tuple[str, type]] = {}
_SECTIONS_GENERATION = [0]  # bumped on every declaration: configs' clock memos are of one generation


def sections_generation() -> int:
    """A number that changes whenever an engine's config section is declared: what was worked
    out from one engine table stays valid while it is the same."""
    return _SECTIONS_GENERATION[0]


def engine_section(engine: str, key: str) -> Any:
    """Class decorator: declare a frozen dataclass as engine ``engine``'s config section,
    ``core.<key>`` in chip YAMLs. It must have a ``clock`` (Hz) field; every chip config then
    needs the section."""

    def register(cls: type) -> type:
        if not dataclasses.is_dataclass(cls) or "clock" not in {f.name for f in dataclasses.fields(cls)}:
            raise TypeError(f"engine_section({engine!r}): {cls.__name__} must be a dataclass with a clock field")
        ENGINE_SECTIONS[engine] = (key, cls)
        _SECTIONS_GENERATION[0] += 1
        TYPES[cls.__name__] = cls
        return cls

    return register


def _extra_sections() -> dict[str, type]:
    """``core`` key -> dataclass of the engine sections that are not fields of CoreConfig."""
    fields = {f.name for f in dataclasses.fields(CoreConfig)}
    return {key: cls for key, cls in ENGINE_SECTIONS.values() if key not in fields}


@dataclass(frozen=True)
class HbmConfig:
    # (at most 1 EiB: the device's native memory ledger counts bytes in 64-bit integers, and a
    # capacity past 2^64 wrapped there to another, even a negative, one)
    capacity: int = _q("bytes", hi=2**60, doc="device memory per chip, bytes")
    bandwidth: int = _q("bandwidth", doc="chip total, bytes/s")
    stacks: int = _int(1, 64, doc="HBM stacks; cores are attached evenly to stacks")


@dataclass(frozen=True)
class NeuronLinkConfig:
    """What one chip has of NeuronLink. How chips are linked - topology, per-link bandwidth and
    latency - is a system's (``configs/systems/``, :class:`SystemConfig`)."""

    version: str = _str(("v2", "v3", "v4"))
    links: int = _int(1, 64)
    bandwidth: int = _q("bandwidth", doc="per chip, aggregate, bytes/s")


@dataclass(frozen=True)
class ChipLevelConfig:
    cores: int = _int(1, 64, doc="physical NeuronCores per chip")
    lnc: int = _int(1, 8, doc="physical cores per logical NeuronCore")
    hbm: HbmConfig = field(default=None)  # type: ignore[assignment]
    neuronlink: NeuronLinkConfig = field(default=None)  # type: ignore[assignment]


@engine_section("Tensor", "tensor")
@dataclass(frozen=True)
class TensorEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    pe_rows: int = _int(1, 4096)
    pe_cols: int = _int(1, 4096)
    stationary_max_free: int = _int(1, 4096)
    moving_max_free: int = _int(1, 65536)
    moving_max_free_bf16_dst: int = _int(0, 65536, doc="0: bf16 PSUM destinations unsupported")
    max_contraction: int = _int(1, 4096)
    min_issue_cycles: int = _int(0, 100000)
    load_stationary_speedup: int = _int(1, 64)
    overlap_load_stationary: bool = _bool()
    fp32_cost_multiplier: int = _int(1, 64)
    fp8_double_row: bool = _bool()
    mx_quad: bool = _bool()
    throttle_initial_util: float = _num(0.01, 1.0)
    throttle_ramp: int = _q("time", lo=0)
    throttle_idle_reset: int = _q("time", lo=0)


@engine_section("Vector", "vector")
@dataclass(frozen=True)
class VectorEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)
    perf_mode_fast: int = _int(1, 16)
    perf_mode_mid: int = _int(1, 16)
    max_free_sbuf: int = _int(1, 1 << 24, doc="elements per partition one instruction may touch in SBUF")
    max_free_psum: int = _int(1, 1 << 24, doc="elements per partition one instruction may touch in PSUM")


@engine_section("Scalar", "scalar")
@dataclass(frozen=True)
class ScalarEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)
    perf_mode_16bit: int = _int(1, 16)
    reduce_extra_cycles: int = _int(0, 100000)
    table_switch_cycles: int = _int(0, 1000000)


@engine_section("GpSimd", "gpsimd")
@dataclass(frozen=True)
class GpSimdEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    start_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)


@engine_section("Sync", "sync")
@dataclass(frozen=True)
class SyncEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)


@dataclass(frozen=True)
class SbufConfig:
    partitions: int = _int(1, 4096)
    partition_bytes: int = _q("bytes", lo=1, hi=2**30)
    allocation_granule: int = _q("bytes", lo=1, hi=2**20, doc="tile allocations are aligned to this, per partition")

    @property
    def bytes(self) -> int:
        return self.partitions * self.partition_bytes


@dataclass(frozen=True)
class PsumConfig:
    partitions: int = _int(1, 4096)
    partition_bytes: int = _q("bytes", lo=1, hi=2**30)
    banks: int = _int(1, 1024)

    @property
    def bank_bytes(self) -> int:
        return self.partition_bytes // self.banks

    @property
    def bytes(self) -> int:
        return self.partitions * self.partition_bytes


@dataclass(frozen=True)
class DmaConfig:
    engines: int = _int(1, 1024)
    trigger_cycles: int = _int(0, 100000, doc="sequencer cycles of the engine that triggers a DMA")
    queues: int = _int(1, 1024)
    engine_bandwidth: int = _q("bandwidth", doc="per DMA engine, bytes/s")
    start_latency: int = _q("time", lo=0, doc="trigger to data movement, ps")
    transfer_latency: int = _q("time", lo=0, doc="fixed per transfer, ps")
    descriptor_overhead: int = _q("time", lo=0, doc="per contiguous chunk, ps")
    hbm_access_bytes: int = _q("bytes", doc="least HBM bytes one descriptor moves (an element-strided access pays it per element)")
    transpose_rate_hbm: float = _num(0.0, 1.0, doc="DMA transpose HBM->SBUF throughput over a copy's; 0: no DMA transpose")
    transpose_rate_sbuf: float = _num(0.0, 1.0, doc="DMA transpose SBUF->SBUF throughput over a copy's")


@dataclass(frozen=True)
class CoreConfig:
    version: str = _str()
    tensor: TensorEngineConfig = field(default=None)  # type: ignore[assignment]
    vector: VectorEngineConfig = field(default=None)  # type: ignore[assignment]
    scalar: ScalarEngineConfig = field(default=None)  # type: ignore[assignment]
    gpsimd: GpSimdEngineConfig = field(default=None)  # type: ignore[assignment]
    sync: SyncEngineConfig = field(default=None)  # type: ignore[assignment]
    sbuf: SbufConfig = field(default=None)  # type: ignore[assignment]
    psum: PsumConfig = field(default=None)  # type: ignore[assignment]
    dma: DmaConfig = field(default=None)  # type: ignore[assignment]
    #: (key, section) of the engines whose sections are declared outside this module
    extra_engines: tuple[tuple[str, Any], ...] = field(default=(), metadata={"internal": True})

    def __getattr__(self, key: str) -> Any:  # called only for names that are not attributes
        for k, section in self.__dict__.get("extra_engines", ()):
            if k == key:
                return section
        raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")

    def engine(self, name: str) -> Any:
        """The config section of engine ``name`` (:data:`ENGINE_SECTIONS`)."""
        return getattr(self, ENGINE_SECTIONS[name][0])


@dataclass(frozen=True)
class HostConfig:
    """The host that issues launches to the chip's cores (see :mod:`trnsim.device`)."""

    dispatch: int = _q("time", lo=0, doc="host time to issue one launch, ps")
    max_inflight: int = _int(1, 1 << 20, doc="unfinished launches per logical core before the host waits")
    serve_step: int = _q("time", lo=0, doc="host time of one serving-engine iteration (vLLM on Neuron: schedule, "
                                             "prepare inputs, process outputs), ps")


@dataclass(frozen=True)
class ChipConfig:
    """A whole chip. ``source`` is the file it came from; ``overrides`` the dotted overrides;
    ``calibrations`` the parameters set from ledger rows (not overridden)."""

    name: str = _str()
    description: str = _str()
    chip: ChipLevelConfig = field(default=None)  # type: ignore[assignment]
    core: CoreConfig = field(default=None)  # type: ignore[assignment]
    host: HostConfig = field(default=None)  # type: ignore[assignment]
    source: str = field(default="", metadata={"internal": True})
    overrides: tuple[tuple[str, str], ...] = field(default=(), metadata={"internal": True})
    calibrations: tuple[Calibration, ...] = field(default=(), metadata={"internal": True})

    # ---- derived figures ---------------------------------------------------------------------
    @property
    def engine_clocks(self) -> dict[str, int]:
        """Hz per engine, every engine of :data:`ENGINE_SECTIONS`."""
        return dict(self._clock_memo()[1])

    def _clock_memo(self) -> tuple[int, dict[str, int], int]:
        # (engine table generation, clocks, tick rate), worked out once per config and engine
        # table (the config is frozen; a section declared later is another generation): the
        # simulator reads tick_hz thousands of times per small kernel
        memo = self.__dict__.get("_clocks")
        if memo is None or memo[0] != _SECTIONS_GENERATION[0]:
            c = self.core
            clocks = {name: getattr(c, key).clock for name, (key, _) in ENGINE_SECTIONS.items()}
            memo = (_SECTIONS_GENERATION[0], clocks, math.lcm(*clocks.values()))
            object.__setattr__(self, "_clocks", memo)
        return memo

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_clocks", None)  # another process numbers its engine table on its own
        return state

    @property
    def tick_hz(self) -> int:
        """Ticks per second of global simulated time: the LCM of every engine clock, so each
        engine cycle is a whole number of ticks and time stays an exact integer."""
        return self._clock_memo()[2]

    def ticks_per_cycle(self, engine: str) -> int:
        memo = self._clock_memo()
        return memo[2] // memo[1][engine]

    def ps_to_ticks(self, ps: int) -> int:
        """Convert picoseconds to ticks, rounding up (a latency is never shortened)."""
        return -(-ps * self.tick_hz // 10**12)

    @property
    def logical_cores(self) -> int:
        return self.chip.cores // self.chip.lnc

    def peak_flops_per_core(self, dtype: str = "bf16") -> float:
        """Dense TensorE FLOP/s of one physical core for an input dtype (datasheet §1)."""
        t = self.core.tensor
        base = 2.0 * t.pe_rows * t.pe_cols * t.clock
        return base * self.tensor_rate(dtype)

    def tensor_rate(self, dtype: str) -> float:
        """Relative PE throughput of an input dtype against bf16 (neuron-profile multipliers)."""
        t = self.core.tensor
        if dtype in ("fp32", "float32"):
            return 1.0 / t.fp32_cost_multiplier
        if dtype.startswith("fp8") or dtype.startswith("float8"):
            return 2.0 if t.fp8_double_row else 1.0
        if dtype.startswith("mx"):
            return 4.0 if t.mx_quad else 0.0
        return 1.0

    @property
    def hbm_bandwidth_per_core(self) -> float:
        """The core's share of the chip's HBM bandwidth, bytes/s."""
        return self.chip.hbm.bandwidth / self.chip.cores

    @property
    def hbm_bandwidth_reachable(self) -> float:
        """What one core alone can pull from HBM: its DMA engines, capped by its stack."""
        dma = self.core.dma.engines * self.core.dma.engine_bandwidth
        return min(dma, self.chip.hbm.bandwidth / self.chip.hbm.stacks)

    @property
    def source_display(self) -> str:
        """The source path, relative to the repository for built-in configs."""
        p = Path(self.source)
        try:
            return str(p.resolve().relative_to(CONFIG_DIR.parent))
        except ValueError:
            return self.source

    def describe_overrides(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def config_names() -> list[str]:
    """Names of the built-in configs (``configs/*.yaml``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    p = Path(text)
    if p.suffix in (".yaml", ".yml") or os.sep in text or "/" in text:
        try:
            os.lstat(p)
        except FileNotFoundError:
            raise ConfigError(f"{clip_text(text)}: no such config file") from None
        except OSError as e:  # e.g. a name too long for the file system
            raise ConfigError(f"{clip_text(text)}: cannot read it ({e.strerror or type(e).__name__})") from None
        return p
    cand = CONFIG_DIR / f"{text}.yaml"
    if text in config_names():
        return cand
    raise ConfigError(
        f"unknown config '{clip_text(text)}': expected one of {', '.join(config_names())} or a path to a .yaml file"
    )


def _apply_override(raw: dict[str, Any], key: str, value: str, where: str) -> None:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"{where}: bad override key '{clip_text(key)}': expected dotted keys like "
                          f"core.sbuf.partition_bytes")
    node: Any = raw
    cls: Any = ChipConfig
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        extra = _extra_sections() if cls is CoreConfig else {}
        if part not in fields and part not in extra:
            path = ".".join(parts[:i]) or "<top level>"
            raise ConfigError(
                f"{where}: unknown key '{clip_text(key)}': '{clip_text(part, 40)}' is not in {path}; expected one "
                f"of {', '.join([*fields, *extra])}"
            )
        if part in extra:
            if i == len(parts) - 1:
                raise ConfigError(f"{where}: override '{clip_text(key)}' names a section, not a value")
            sub = extra[part]
            node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
            node = node[part]
            cls = sub
            continue
        f = fields[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else TYPES.get(f.type)):
                raise ConfigError(f"{where}: override '{clip_text(key)}' names a section, not a value")
            node[part] = override_value(value, f)
            return
        sub = TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ConfigError(f"{where}: override '{clip_text(key)}': '{part}' is a value, not a section")
        # a copy of the section, so an override never reaches another key that aliases it
        node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
        node = node[part]
        cls = sub


for _cls in (HbmConfig, NeuronLinkConfig, ChipLevelConfig, TensorEngineConfig, VectorEngineConfig,
             ScalarEngineConfig, GpSimdEngineConfig, SyncEngineConfig, SbufConfig, PsumConfig,
             DmaConfig, CoreConfig, HostConfig, ChipConfig):
    TYPES[_cls.__name__] = _cls


def _check_consistency(cfg: ChipConfig, where: str) -> None:
    """Cross-field rules the per-field ranges cannot express."""
    c = cfg.core
    rules = [
        (cfg.chip.cores % cfg.chip.lnc == 0, "chip.lnc", cfg.chip.lnc, f"a divisor of chip.cores ({cfg.chip.cores})"),
        (cfg.chip.cores % cfg.chip.hbm.stacks == 0 or cfg.chip.hbm.stacks % cfg.chip.cores == 0,
         "chip.hbm.stacks", cfg.chip.hbm.stacks, f"a divisor or multiple of chip.cores ({cfg.chip.cores})"),
        (c.psum.partition_bytes % c.psum.banks == 0, "core.psum.banks", c.psum.banks,
         f"a divisor of core.psum.partition_bytes ({c.psum.partition_bytes})"),
        (c.sbuf.partitions == c.tensor.pe_rows, "core.tensor.pe_rows", c.tensor.pe_rows,
         f"equal to core.sbuf.partitions ({c.sbuf.partitions})"),
        (c.psum.partitions == c.sbuf.partitions, "core.psum.partitions", c.psum.partitions,
         f"equal to core.sbuf.partitions ({c.sbuf.partitions})"),
        (c.sbuf.partitions % c.dma.engines == 0 or c.dma.engines % c.sbuf.partitions == 0,
         "core.dma.engines", c.dma.engines, f"a divisor of core.sbuf.partitions ({c.sbuf.partitions})"),
        (c.tensor.stationary_max_free <= c.tensor.pe_cols, "core.tensor.stationary_max_free",
         c.tensor.stationary_max_free, f"<= core.tensor.pe_cols ({c.tensor.pe_cols})"),
        (c.tensor.max_contraction <= c.tensor.pe_rows, "core.tensor.max_contraction",
         c.tensor.max_contraction, f"<= core.tensor.pe_rows ({c.tensor.pe_rows})"),
        (c.tensor.moving_max_free * 4 <= c.psum.partition_bytes, "core.tensor.moving_max_free",
         c.tensor.moving_max_free, f"<= {c.psum.partition_bytes // 4} (fp32 elements in one PSUM partition)"),
    ]
    for ok, key, value, expected in rules:
        if not ok:
            raise ConfigError(f"{where}: {key} = {value!r}: expected {expected}")
    if cfg.tick_hz > MAX_TICK_HZ:
        clocks = ", ".join(f"{k.lower()} {v:,} Hz" for k, v in cfg.engine_clocks.items())
        raise ConfigError(f"{where}: the engine clocks ({clocks}) have no common tick of at least 0.1 fs (their least "
                          f"common multiple is {cfg.tick_hz:.3g} Hz); expected clocks with a larger common divisor, "
                          f"e.g. whole MHz")



def load_config(
    name_or_path: str | os.PathLike[str] | ChipConfig = "trn2",
    overrides: Iterable[str] | Mapping[str, Any] | None = None,
) -> ChipConfig:
    """Load a config by name (``trn2``) or path, applying dotted ``overrides``.

    ``overrides`` is an iterable of ``"key=value"`` strings (as the CLI takes them) or a
    mapping ``{"core.sbuf.partition_bytes": "256KiB"}``. A ChipConfig passed in is returned
    with the overrides applied on top of its source file.
    """
    prior: tuple[tuple[str, str], ...] = ()
    if isinstance(overrides, str):
        overrides = [overrides]
    if not isinstance(name_or_path, (str, os.PathLike, ChipConfig)):
        raise ConfigError(f"a config is a name ({', '.join(config_names())}), a path to a .yaml file or a "
                          f"ChipConfig, got {type(name_or_path).__name__}")
    if isinstance(name_or_path, ChipConfig):
        prior = name_or_path.overrides
        if not overrides:
            return name_or_path
        name_or_path = name_or_path.source
    path = resolve_config_path(name_or_path)
    file = _file_key(path)  # (stat'ed once: the config's key and the YAML's)
    cache_key = _config_key(file, prior, overrides)
    if cache_key is not None:
        got = _CONFIG_CACHE.get(cache_key)
        if got is not None:
            return got
    where = path.name if path.parent == CONFIG_DIR else str(path)
    raw = _read_config(path, where, file)
    if raw is None:
        raw = {}
    cals = calibrations_of(raw, where)
    pairs = override_pairs(prior, overrides)
    for key, value in pairs:
        if isinstance(raw, dict):
            _apply_override(raw, key, value, f"{where} (--set {clip_text(key)}={clip_text(value)})")
    extra = _take_extra_sections(raw, where, dict(pairs))
    cfg = build(ChipConfig, raw, "", where, dict(pairs))
    if extra:
        cfg = dataclasses.replace(cfg, core=dataclasses.replace(cfg.core, extra_engines=extra))
    overridden = {k for k, _ in pairs}
    cfg = dataclasses.replace(cfg, source=str(path), overrides=tuple(pairs),
                              calibrations=tuple(c for c in cals if c.key not in overridden))
    _check_consistency(cfg, where)
    if cache_key is not None:
        if len(_CONFIG_CACHE) >= 64:
            _CONFIG_CACHE.pop(next(iter(_CONFIG_CACHE)))
        _CONFIG_CACHE[cache_key] = cfg
    return cfg


#: a loaded config by everything it is a function of (:func:`_config_key`): configs are frozen,
#: so a config loaded again is the same object (~0.5 ms saved a load; the builder's shared
#: tables and the simulator's memos are per config object)
_CONFIG_CACHE: dict[tuple[Any, ...], ChipConfig] = {}


def _config_key(file: tuple[Any, ...] | None, prior: tuple[tuple[str, str], ...], overrides: Any
                ) -> tuple[Any, ...] | None:
    """What :func:`load_config` makes a config of: the file as it is now (``file``, its
    :func:`_file_key`, as :func:`_read_config` keys its YAML), the overrides, and the engine
    sections declared (a section declared later is another generation). None when the file
    cannot be stat'ed or the overrides are not plain (their error, if any, is met where it
    always was)."""
    if file is None:
        return None
    try:
        pairs = tuple(override_pairs(prior, overrides))
    except (ConfigError, TypeError, ValueError):
        return None
    return file + (pairs, _SECTIONS_GENERATION[0])


def _file_key(path: Path) -> tuple[Any, ...] | None:
    """A config file as it is now: its real path, inode, modification time and size (None if it
    cannot be stat'ed): what the YAML and config caches key on, so an edited file is read again."""
    try:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        return None


def _take_extra_sections(raw: Any, where: str, from_set: Mapping[str, str]) -> tuple[tuple[str, Any], ...]:
    """Build (and take out of ``raw``) the sections of the engines declared outside this module;
    the rest of ``raw`` is the CoreConfig fields' (a malformed ``core`` is left to :func:`build`)."""
    extra = _extra_sections()
    core = raw.get("core") if isinstance(raw, dict) else None
    if not extra or not isinstance(core, dict):
        return ()
    out = []
    for key, cls in extra.items():
        if key not in core:
            raise ConfigError(f"{where}: missing key 'core.{key}'")
        out.append((key, build(cls, core.pop(key), f"core.{key}", where, from_set)))
    return tuple(out)


_RAW_CACHE: dict[tuple[str, int, int, int], Any] = {}


def _read_config(path: Path, where: str, key: tuple[Any, ...] | None) -> Any:
    """The parsed YAML of a config file, cached by its identity and modification time (``key``,
    its :func:`_file_key`; a sweep loads one file once per variant; parsing costs ~10x the
    check). Callers get a copy."""
    if key is not None and key in _RAW_CACHE:
        return copy.deepcopy(_RAW_CACHE[key])
    raw = load_yaml_file(path, where, "config")
    if key is not None:
        if len(_RAW_CACHE) >= 16:
            _RAW_CACHE.pop(next(iter(_RAW_CACHE)))
        _RAW_CACHE[key] = copy.deepcopy(raw)
    return raw



# systems (chips and the links between them) are their own module, which loads its chips here
from .system import (SYSTEM_DIR, CollectivesConfig, SystemConfig, TopologyDimConfig, is_system_key,  # noqa: E402
                     load_system, resolve_system_path, system_names)

__all__ += ["SystemConfig", "TopologyDimConfig", "CollectivesConfig", "load_system", "system_names"]
