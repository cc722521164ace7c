"""Chip configurations: frozen, typed dataclasses loaded from YAML.

A config names every hardware figure the model uses; no hardware constant lives in engine code.
Quantities carry their unit in the YAML (``224KiB``, ``2.4GHz``, ``2.9TB/s``, ``1300ns``) and
are parsed once, exactly, into integers (bytes, Hz, bytes/s, picoseconds). Loading rejects
unknown keys, bad units and out-of-range values with a one-line :class:`ConfigError` that names
the file, the key, the value and what was expected.

Overrides use dotted keys (``core.sbuf.partition_bytes=256KiB``) and are applied to the raw
YAML before validation, so they get the same checks and the same messages.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

__all__ = [
    "ConfigError",
    "ChipConfig",
    "CoreConfig",
    "load_config",
    "config_names",
    "parse_quantity",
    "format_quantity",
]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A chip config (file, key or override) is invalid. The message is one line."""


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

_BIN = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DEC = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_TIME = {"ps": Fraction(1), "ns": Fraction(10**3), "us": Fraction(10**6), "µs": Fraction(10**6),
         "ms": Fraction(10**9), "s": Fraction(10**12)}

# unit kind -> (example for messages, canonical unit name)
_KINDS = {
    "bytes": ("224KiB", "bytes"),
    "hz": ("2.4GHz", "Hz"),
    "bandwidth": ("2.9TB/s", "bytes/s"),
    "time": ("1300ns", "ps"),
}

_QTY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def parse_quantity(text: Any, kind: str) -> int:
    """Parse ``text`` as a quantity of ``kind`` and return an exact integer in base units.

    kinds: ``bytes`` (B, KiB, MiB, GiB, KB, MB, GB), ``hz`` (Hz, kHz, MHz, GHz),
    ``bandwidth`` (B/s with SI or binary prefixes, or B/ns), ``time`` (ps, ns, us, ms, s; result
    in picoseconds). Raises ValueError naming the expectation when the text does not parse or
    the value is not a whole number of base units.
    """
    example, base = _KINDS[kind]
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"expected a {kind} quantity like '{example}'")
    if isinstance(text, (int, float)):
        # bare numbers are ambiguous for every kind we parse: require the unit
        raise ValueError(f"expected a {kind} quantity with its unit, like '{example}'")
    m = _QTY.match(text)
    if not m:
        raise ValueError(f"expected a {kind} quantity like '{example}'")
    try:
        num = Fraction(Decimal(m.group(1)))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"expected a {kind} quantity like '{example}'") from None
    unit = m.group(2)
    scale: Fraction | None = None
    if kind == "bytes" and unit.endswith("B"):
        p = unit[:-1]
        scale = Fraction(_BIN.get(p) or _DEC.get(p) or 0) or None
    elif kind == "hz" and unit.endswith("Hz"):
        p = unit[:-2]
        scale = Fraction(_DEC[p]) if p in _DEC else None
    elif kind == "bandwidth":
        if unit == "B/ns":
            scale = Fraction(10**9)
        elif unit.endswith("B/s"):
            p = unit[:-3]
            scale = Fraction(_BIN.get(p) or _DEC.get(p) or 0) or None
    elif kind == "time":
        scale = _TIME.get(unit)
    if scale is None:
        raise ValueError(f"expected a {kind} quantity like '{example}' (unknown unit '{unit}')")
    value: Fraction = num * scale
    if value.denominator != 1:
        raise ValueError(f"expected a whole number of {base}, got {float(value)} {base}")
    return int(value)


def format_quantity(value: float, kind: str) -> str:
    """Render a base-unit quantity for humans (``229376`` bytes -> ``224 KiB``)."""
    units: dict[str, tuple[tuple[str, float], ...]] = {
        "bytes": (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)),
        "hz": (("GHz", 1e9), ("MHz", 1e6), ("kHz", 1e3), ("Hz", 1)),
        "bandwidth": (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("B/s", 1)),
        "time": (("s", 1e12), ("ms", 1e9), ("us", 1e6), ("ns", 1e3), ("ps", 1)),  # from picoseconds
    }
    fmt = "g" if kind in ("bytes", "hz") else ".4g"
    for unit, scale in units[kind]:
        if value >= scale or scale == 1:
            return f"{value / scale:{fmt}} {unit}"
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Schema: each leaf field says its kind and range in its metadata
# ---------------------------------------------------------------------------------------------


def _q(kind: str, lo: float = 1, hi: float = math.inf, doc: str = "") -> Any:
    return field(metadata={"kind": kind, "lo": lo, "hi": hi, "doc": doc})


def _int(lo: int = 1, hi: float = math.inf, doc: str = "") -> Any:
    return field(metadata={"kind": "int", "lo": lo, "hi": hi, "doc": doc})


def _num(lo: float = 0.0, hi: float = math.inf, doc: str = "") -> Any:
    return field(metadata={"kind": "float", "lo": lo, "hi": hi, "doc": doc})


def _bool(doc: str = "") -> Any:
    return field(metadata={"kind": "bool", "doc": doc})


def _str(choices: tuple[str, ...] | None = None, doc: str = "") -> Any:
    return field(metadata={"kind": "str", "choices": choices, "doc": doc})


@dataclass(frozen=True)
class HbmConfig:
    capacity: int = _q("bytes", doc="device memory per chip, bytes")
    bandwidth: int = _q("bandwidth", doc="chip total, bytes/s")
    stacks: int = _int(1, 64, doc="HBM stacks; cores are attached evenly to stacks")


@dataclass(frozen=True)
class NeuronLinkConfig:
    version: str = _str()
    links: int = _int(1, 64)
    bandwidth: int = _q("bandwidth", doc="per chip, aggregate, bytes/s")
    intra_instance_bandwidth: int = _q("bandwidth")
    inter_instance_bandwidth: int = _q("bandwidth")
    hop_latency: int = _q("time", lo=0, doc="per hop, ps")
    topology: str = _str(("torus2d", "torus3d", "ring", "switch"))
    instance_chips: int = _int(1, 4096)


@dataclass(frozen=True)
class ChipLevelConfig:
    cores: int = _int(1, 64, doc="physical NeuronCores per chip")
    lnc: int = _int(1, 8, doc="physical cores per logical NeuronCore")
    hbm: HbmConfig = field(default=None)  # type: ignore[assignment]
    neuronlink: NeuronLinkConfig = field(default=None)  # type: ignore[assignment]


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


@dataclass(frozen=True)
class VectorEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)
    perf_mode_fast: int = _int(1, 16)
    perf_mode_mid: int = _int(1, 16)


@dataclass(frozen=True)
class ScalarEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)
    perf_mode_16bit: int = _int(1, 16)
    reduce_extra_cycles: int = _int(0, 100000)
    table_switch_cycles: int = _int(0, 1000000)


@dataclass(frozen=True)
class GpSimdEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)
    min_ii_cycles: int = _int(0, 100000)
    start_cycles: int = _int(0, 100000)
    dependency_latency_cycles: int = _int(0, 100000)


@dataclass(frozen=True)
class SyncEngineConfig:
    clock: int = _q("hz", lo=1e6, hi=1e11)


@dataclass(frozen=True)
class SbufConfig:
    partitions: int = _int(1, 4096)
    partition_bytes: int = _q("bytes", lo=1, hi=2**30)

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


@dataclass(frozen=True)
class ChipConfig:
    """A whole chip. ``source`` is the file it came from; ``overrides`` the dotted overrides."""

    name: str = _str()
    description: str = _str()
    chip: ChipLevelConfig = field(default=None)  # type: ignore[assignment]
    core: CoreConfig = field(default=None)  # type: ignore[assignment]
    source: str = field(default="", metadata={"internal": True})
    overrides: tuple[tuple[str, str], ...] = field(default=(), metadata={"internal": True})

    # ---- derived figures ---------------------------------------------------------------------
    @property
    def engine_clocks(self) -> dict[str, int]:
        c = self.core
        return {"Tensor": c.tensor.clock, "Vector": c.vector.clock, "Scalar": c.scalar.clock,
                "GpSimd": c.gpsimd.clock, "Sync": c.sync.clock}

    @property
    def tick_hz(self) -> int:
        """Ticks per second of global simulated time: the LCM of every engine clock, so each
        engine cycle is a whole number of ticks and time stays an exact integer."""
        return math.lcm(*self.engine_clocks.values())

    def ticks_per_cycle(self, engine: str) -> int:
        return self.tick_hz // self.engine_clocks[engine]

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


def _resolve(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    p = Path(text)
    if p.suffix in (".yaml", ".yml") or os.sep in text or "/" in text:
        if not p.is_file():
            raise ConfigError(f"{text}: no such config file")
        return p
    cand = CONFIG_DIR / f"{text}.yaml"
    if cand.is_file():
        return cand
    raise ConfigError(
        f"unknown config '{text}': expected one of {', '.join(config_names())} or a path to a .yaml file"
    )


def _apply_override(raw: dict[str, Any], key: str, value: str, where: str) -> None:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"{where}: bad override key '{key}': expected dotted keys like core.sbuf.partition_bytes")
    node: Any = raw
    cls: Any = ChipConfig
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        if part not in fields:
            path = ".".join(parts[:i]) or "<top level>"
            raise ConfigError(
                f"{where}: unknown key '{key}': '{part}' is not in {path}; expected one of {', '.join(fields)}"
            )
        f = fields[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else _TYPES.get(f.type)):
                raise ConfigError(f"{where}: override '{key}' names a section, not a value")
            node[part] = _override_value(value, f)
            return
        sub = _TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ConfigError(f"{where}: override '{key}': '{part}' is a value, not a section")
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
        cls = sub


def _override_value(text: str, f: dataclasses.Field[Any]) -> Any:
    """Overrides arrive as strings; give YAML scalars their YAML meaning (1, 0.5, true)."""
    kind = f.metadata.get("kind")
    if kind in ("int", "float", "bool"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    return text


def _build(cls: Any, raw: Any, path: str, where: str, from_set: Mapping[str, str] | None = None) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {path or '<top level>'} must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in raw:
        if key not in fields:
            loc = f"{path}.{key}" if path else str(key)
            raise ConfigError(
                f"{where}: unknown key '{loc}': expected one of {', '.join(fields)}"
            )
    values: dict[str, Any] = {}
    for name, f in fields.items():
        loc = f"{path}.{name}" if path else name
        if name not in raw:
            raise ConfigError(f"{where}: missing key '{loc}'")
        sub = _TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if sub is not None and dataclasses.is_dataclass(sub):
            values[name] = _build(sub, raw[name], loc, where, from_set)
        else:
            w = f"{where} (--set {loc}={from_set[loc]})" if from_set and loc in from_set else where
            values[name] = _leaf(raw[name], f, loc, w)
    return cls(**values)


def _leaf(value: Any, f: dataclasses.Field[Any], loc: str, where: str) -> Any:
    md = f.metadata
    kind = md["kind"]
    shown = repr(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {loc} = {shown}: expected a string")
        choices = md.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{where}: {loc} = {shown}: expected one of {', '.join(choices)}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {loc} = {shown}: expected true or false")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {loc} = {shown}: expected an integer")
        out: float = value
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {loc} = {shown}: expected a number")
        out = float(value)
    else:
        try:
            out = parse_quantity(value, kind)
        except ValueError as e:
            raise ConfigError(f"{where}: {loc} = {shown}: {e}") from None
    lo, hi = md["lo"], md["hi"]
    if not (lo <= out <= hi):
        rng = f"{_fmt_bound(lo, kind)}..{_fmt_bound(hi, kind)}" if hi != math.inf else f">= {_fmt_bound(lo, kind)}"
        raise ConfigError(f"{where}: {loc} = {shown}: out of range, expected {rng}")
    return out


def _fmt_bound(b: float, kind: str) -> str:
    if kind in ("bytes", "hz", "bandwidth", "time"):
        return format_quantity(b, kind).replace(" ", "")
    return f"{b:g}"


_TYPES: dict[str, Any] = {}
for _cls in (HbmConfig, NeuronLinkConfig, ChipLevelConfig, TensorEngineConfig, VectorEngineConfig,
             ScalarEngineConfig, GpSimdEngineConfig, SyncEngineConfig, SbufConfig, PsumConfig,
             DmaConfig, CoreConfig, ChipConfig):
    _TYPES[_cls.__name__] = _cls


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
    path = _resolve(name_or_path)
    where = path.name if path.parent == CONFIG_DIR else str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, IsADirectoryError, PermissionError) as e:
        raise ConfigError(f"{where}: cannot read it as a YAML config ({type(e).__name__})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{where}:{line} {problem}") from None
    if raw is None:
        raw = {}
    pairs: list[tuple[str, str]] = list(prior)
    if overrides:
        items = overrides.items() if isinstance(overrides, Mapping) else (_split_override(o) for o in overrides)
        pairs.extend((str(k), str(v)) for k, v in items)
    for key, value in pairs:
        if isinstance(raw, dict):
            _apply_override(raw, key, value, f"{where} (--set {key}={value})")
    cfg = _build(ChipConfig, raw, "", where, dict(pairs))
    cfg = dataclasses.replace(cfg, source=str(path), overrides=tuple(pairs))
    _check_consistency(cfg, where)
    return cfg


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"bad override '{text}': expected KEY=VALUE, e.g. core.sbuf.partition_bytes=256KiB")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()
