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

import copy
import dataclasses
import functools
import math
import os
import re
import reprlib
import stat
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
    "format_value",
    "clip_text",
    "load_yaml",
    "load_yaml_file",
    "file_kind",
    "env_int",
    "Calibration",
    "shipped_dir",
]

def shipped_dir(name: str) -> Path:
    """A data folder of the repository's top level (``configs``, ``validation``): the copy a wheel
    carries in ``trnsim/shipped/`` (setup.py puts it there), else the checkout's own."""
    here = Path(__file__).resolve().parents[1]
    shipped = here / "shipped" / name
    return shipped if shipped.is_dir() else here.parent / name


CONFIG_DIR = shipped_dir("configs")


class ConfigError(ValueError):
    """A chip config (file, key or override) is invalid. The message is one line."""


# ---------------------------------------------------------------------------------------------
# Bounded YAML and bounded error values
# ---------------------------------------------------------------------------------------------

#: Limits of what one YAML document (a config, a sweep spec, a --set value) may be. A chip config
#: is ~100 values four levels deep; these leave room for big sweep specs while keeping a
#: malicious or mistaken file (alias bombs, 10,000-deep lists, a 1 GB file) to a one-line error
#: in milliseconds instead of gigabytes and minutes.
MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 100_000  # nodes after expanding every alias
ERROR_VALUE_CHARS = 80  # how much of a user's value an error message quotes

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 6, 6
_REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _REPR.maxarray = 6
_REPR.maxstring = _REPR.maxother = ERROR_VALUE_CHARS
_REPR.maxlong = 40


def format_value(value: Any, limit: int = ERROR_VALUE_CHARS) -> str:
    """``repr(value)`` for an error message, bounded in time, memory and length whatever the
    value is (a nested alias bomb, a 50 MB string, a 5,000-digit integer) and on one line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails must not turn an error into a traceback
        text = f"<{type(value).__name__}>"
    return clip_text(text, limit, quoted=False)


def clip_text(text: Any, limit: int = ERROR_VALUE_CHARS, *, quoted: bool = False) -> str:
    """A user's text for an error message: printable text as is, anything else escaped (so a
    newline cannot break the one-line rule), cut to ``limit`` characters with the length of the
    whole. ``quoted`` gives it Python quotes, like ``repr``."""
    s = text if isinstance(text, str) else str(text)
    head = s[:limit]
    if quoted:
        shown = repr(head)
    elif head.isprintable():
        shown = head
    else:
        shown = repr(head)[1:-1]  # escaped, without the quotes
    return shown if len(s) <= limit else f"{shown}... ({len(s):,} characters)"


class _BoundedYamlError(yaml.MarkedYAMLError):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with limits: depth and alias expansion are counted while the document
    is composed (before any value is built), a mapping's duplicate keys are refused naming both
    lines, and values the constructors choke on (a 13th month, a 5,000-digit integer) become YAML
    errors at their line instead of stray ValueErrors."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._sizes:
                raise _BoundedYamlError(None, None, f"alias *{clip_text(event.anchor, 40)} refers to a value that "
                                        f"contains it (a recursive structure)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _BoundedYamlError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                        self.peek_event().start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if id(node) not in self._sizes:
            if isinstance(node, yaml.MappingNode):
                kids = [x for kv in node.value for x in kv]
            elif isinstance(node, yaml.SequenceNode):
                kids = node.value
            else:
                kids = []
            values = 1 + sum(self._sizes[id(k)][0] for k in kids)
            depth = 1 + max((self._sizes[id(k)][1] for k in kids), default=0)
            if values > MAX_YAML_VALUES:
                raise _BoundedYamlError(None, None, f"anchors and aliases expand to more than {MAX_YAML_VALUES:,} "
                                        f"values; write the values out or use fewer aliases", node.start_mark)
            if depth > MAX_YAML_DEPTH:
                raise _BoundedYamlError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels once aliases "
                                        f"are expanded", node.start_mark)
            self._sizes[id(node)] = (values, depth)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    prev = first.setdefault(key, key_node)
                except TypeError:
                    continue  # unhashable: the base class reports it
                if prev is not key_node:
                    raise _BoundedYamlError(None, None, f"duplicate key {format_value(key, 40)} (first at line "
                                            f"{prev.start_mark.line + 1}); a key may appear once",
                                            key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as e:
            raise _BoundedYamlError(None, None, f"cannot read the value: {clip_text(e, 120)}", node.start_mark) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """' line N: problem' for a YAML error (line of the problem, 1-based)."""
    if isinstance(e, yaml.reader.ReaderError):
        if isinstance(e.character, int):
            return f" character {e.position + 1}: #x{e.character:04x} is not allowed in YAML"
        return f" {clip_text(e.reason)}"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = f" line {mark.line + 1}:" if mark is not None else ""
    return f"{line} {clip_text(getattr(e, 'problem', None) or getattr(e, 'context', None) or 'invalid YAML', 200)}"


_DENSE_BRACKETS = re.compile(r"(?:[\[{][ \t]*){%d}" % (MAX_YAML_DEPTH + 1))


def load_yaml(text: str, where: str) -> Any:
    """Parse one YAML document with PyYAML's safe loader, within the limits above. Errors are
    a one-line :class:`ConfigError` ``"<where>: line N: <problem>"``."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: {len(text):,} characters of YAML; at most {MAX_YAML_BYTES:,} are read")
    dense = _DENSE_BRACKETS.search(text)
    if dense:  # PyYAML's scanner takes ~1 s to reach the depth limit through a wall of brackets
        raise ConfigError(f"{where}: line {text.count(chr(10), 0, dense.start()) + 1}: nested deeper than "
                          f"{MAX_YAML_DEPTH} levels")
    loader = None
    try:
        loader = _BoundedLoader(text)
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}:{_yaml_problem(e)}") from None
    except RecursionError:  # pragma: no cover - the depth limit comes first
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for a ``st_mode`` (``"a regular file"``): what a path
    names when it is not the regular file a reader (here) or a writer (:mod:`trnsim.outputs.files`) wants."""
    for test, name in _FILE_KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def read_bounded(path: str | os.PathLike[str], where: str, what: str) -> str:
    """The text of a config-like file, read safely: a missing file, a FIFO or device (never
    opened: it could block forever), a file over the size limit or one that is not UTF-8 is a
    one-line :class:`ConfigError` naming ``what`` and the path (whole, with anything unprintable
    escaped so a newline in a file name cannot break the one-line rule)."""
    name = os.fspath(path)
    shown = clip_text(name, limit=max(1, len(name)))
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise ConfigError(f"{what} '{shown}' not found") from None
    except OSError as e:
        raise ConfigError(f"{what} '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} '{shown}': it is {file_kind(st.st_mode)}, not a regular file")
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_YAML_BYTES // 2**20} MiB; a {what} is at most that")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start + 1})") from None


def load_yaml_file(path: str | os.PathLike[str], where: str, what: str = "YAML file") -> Any:
    """Read and parse a YAML file with :func:`load_yaml`, after :func:`read_bounded`'s checks."""
    return load_yaml(read_bounded(path, where, what), where)


def env_int(name: str, default: int, lo: int, hi: int, what: str) -> int:
    """An integer setting from the environment variable ``name`` (unset or blank: ``default``).
    Anything but a whole number in ``lo..hi`` is a one-line :class:`ConfigError` naming the
    variable, its value and ``what`` it should be."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    # ASCII digits only: int() also takes other scripts' digits and "1_000"
    n = int(text) if len(text) <= 20 and digits.isascii() and digits.isdigit() else None
    if n is None or not lo <= n <= hi:
        raise ConfigError(f"{name}={clip_text(text, 40, quoted=True)}: expected {what}, {lo}..{hi:,}")
    return n


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

_BIN = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
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

    kinds: ``bytes`` (B, KiB, MiB, GiB, TiB, PiB and KB ... PB), ``hz`` (Hz, kHz, MHz, GHz),
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
    m = _QTY.match(text) if len(text) <= 64 else None
    if not m:
        raise ValueError(f"expected a {kind} quantity like '{example}'")
    try:
        dec = Decimal(m.group(1))
        if not -40 <= dec.adjusted() <= 40:  # 1e999999999 would be a 400 MB integer
            raise ValueError(f"expected a {kind} quantity like '{example}' (the number {m.group(1)} is out of range)")
        num = Fraction(dec)
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
        "bytes": (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)),
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


#: the longest any one latency or duration of a config may be, ps: a second is beyond every
#: figure of the chip and its links, and keeps each in range of the simulator's 64-bit ticks
MAX_TIME_PS = 10**12
#: the fastest simulation tick (the engine clocks' least common multiple), Hz: a 0.1 fs tick
#: still counts 15 minutes of simulated time in 64 bits (whole-MHz clocks stay far below it;
#: 2.4GHz against 2.400000001GHz would need a tick of 10^-28 s)
MAX_TICK_HZ = 10**16


def _q(kind: str, lo: float = 1, hi: float = math.inf, doc: str = "") -> Any:
    if kind == "time" and hi == math.inf:
        hi = MAX_TIME_PS
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
    max_free_sbuf: int = _int(1, 1 << 24, doc="elements per partition one instruction may touch in SBUF")
    max_free_psum: int = _int(1, 1 << 24, doc="elements per partition one instruction may touch in PSUM")


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


@dataclass(frozen=True)
class HostConfig:
    """The host that issues launches to the chip's cores (see :mod:`trnsim.device`)."""

    dispatch: int = _q("time", lo=0, doc="host time to issue one launch, ps")
    max_inflight: int = _int(1, 1 << 20, doc="unfinished launches per logical core before the host waits")


@dataclass(frozen=True)
class Calibration:
    """A parameter set from calibration rows of the validation ledger (``validation/*.yaml``).

    In a config file the parameter is written as a mapping instead of a bare value::

        descriptor_overhead:
          value: 10ns
          calibrated: [dma.trn2.some-row]      # ledger rows of role 'calibration'
          fit: what was solved from the rows, and how

    Loading checks that every row exists and is a calibration row: a validation row never feeds a
    parameter (see validation/README.md)."""

    key: str  # dotted, e.g. core.dma.descriptor_overhead
    rows: tuple[str, ...]
    fit: str


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
        return dict(self._clocks)

    @functools.cached_property
    def _clocks(self) -> dict[str, int]:
        # worked out once per config (it is frozen): the simulator reads tick_hz thousands of
        # times per kernel; a copy of it is what engine_clocks hands out
        c = self.core
        return {"Tensor": c.tensor.clock, "Vector": c.vector.clock, "Scalar": c.scalar.clock,
                "GpSimd": c.gpsimd.clock, "Sync": c.sync.clock}

    @functools.cached_property
    def tick_hz(self) -> int:
        """Ticks per second of global simulated time: the LCM of every engine clock, so each
        engine cycle is a whole number of ticks and time stays an exact integer."""
        return math.lcm(*self._clocks.values())

    def ticks_per_cycle(self, engine: str) -> int:
        return self.tick_hz // self._clocks[engine]

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
        if part not in fields:
            path = ".".join(parts[:i]) or "<top level>"
            raise ConfigError(
                f"{where}: unknown key '{clip_text(key)}': '{clip_text(part, 40)}' is not in {path}; expected one "
                f"of {', '.join(fields)}"
            )
        f = fields[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else _TYPES.get(f.type)):
                raise ConfigError(f"{where}: override '{clip_text(key)}' names a section, not a value")
            node[part] = _override_value(value, f)
            return
        sub = _TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ConfigError(f"{where}: override '{clip_text(key)}': '{part}' is a value, not a section")
        # a copy of the section, so an override never reaches another key that aliases it
        node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
        node = node[part]
        cls = sub


def _override_value(text: str, f: dataclasses.Field[Any]) -> Any:
    """Overrides arrive as strings; give YAML scalars their YAML meaning (1, 0.5, true)."""
    kind = f.metadata.get("kind")
    if kind in ("int", "float", "bool"):
        try:
            value = load_yaml(text, "--set")
        except ConfigError:
            return text
        # a list or mapping is never a scalar's value: keep the text, which the check quotes
        return value if isinstance(value, (int, float, bool)) else text
    return text


def _build(cls: Any, raw: Any, path: str, where: str, from_set: Mapping[str, str] | None = None) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {path or '<top level>'} must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in raw:
        if key not in fields:
            loc = clip_text(f"{path}.{key}" if path else str(key))
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
            w = f"{where} (--set {loc}={clip_text(from_set[loc])})" if from_set and loc in from_set else where
            values[name] = _leaf(raw[name], f, loc, w)
    return cls(**values)


def _leaf(value: Any, f: dataclasses.Field[Any], loc: str, where: str) -> Any:
    md = f.metadata
    kind = md["kind"]
    shown = format_value(value)
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
             DmaConfig, CoreConfig, HostConfig, ChipConfig):
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
    if cfg.tick_hz > MAX_TICK_HZ:
        clocks = ", ".join(f"{k.lower()} {v:,} Hz" for k, v in cfg.engine_clocks.items())
        raise ConfigError(f"{where}: the engine clocks ({clocks}) have no common tick of at least 0.1 fs (their least "
                          f"common multiple is {cfg.tick_hz:.3g} Hz); expected clocks with a larger common divisor, "
                          f"e.g. whole MHz")


_CALIBRATION_KEYS = ("value", "calibrated", "fit")


def _take_calibrations(node: Any, path: str, where: str, out: list[Calibration]) -> None:
    """Replace every ``{value, calibrated, fit}`` leaf under ``node`` (raw YAML) by its value and
    collect its provenance in ``out``; malformed provenance is a one-line ConfigError."""
    if not isinstance(node, dict):
        return
    for key, sub in list(node.items()):
        loc = f"{path}.{key}" if path else str(key)
        if isinstance(sub, dict) and "calibrated" in sub:
            bad = [k for k in sub if k not in _CALIBRATION_KEYS]
            if bad:
                raise ConfigError(f"{where}: {loc}: unknown key '{clip_text(str(bad[0]), 40)}' beside calibrated: "
                                  f"expected value, calibrated and fit")
            rows = sub["calibrated"]
            if (not isinstance(rows, list) or not rows
                    or not all(isinstance(r, str) and r.strip() for r in rows)):
                raise ConfigError(f"{where}: {loc}: calibrated = {format_value(rows)}: expected a list of ledger "
                                  f"row ids, e.g. [dma.trn2.engine-rate]")
            fit = sub.get("fit")
            if not isinstance(fit, str) or not fit.strip():
                raise ConfigError(f"{where}: {loc}: calibrated needs 'fit': what was solved from the rows, and how")
            if "value" not in sub:
                raise ConfigError(f"{where}: {loc}: calibrated needs 'value': the parameter's value")
            node[key] = sub["value"]
            out.append(Calibration(loc, tuple(r.strip() for r in rows), fit.strip()))
        elif isinstance(sub, dict):
            _take_calibrations(sub, loc, where, out)


def _check_calibrations(cals: Iterable[Calibration], where: str) -> None:
    """Every row a calibrated parameter names must be a calibration row of the ledger."""
    cals = list(cals)
    if not cals:
        return
    from .ledger import row_roles  # the ledger reads YAML through this module: import it late

    roles = row_roles({r for c in cals for r in c.rows})
    for c in cals:
        for r in c.rows:
            role = roles.get(r)
            if role is None:
                raise ConfigError(f"{where}: {c.key}: calibrated row '{clip_text(r, 60)}' is not in the validation "
                                  f"ledger (validation/*.yaml)")
            if role != "calibration":
                raise ConfigError(f"{where}: {c.key}: calibrated row '{clip_text(r, 60)}' is a {role} row; only "
                                  f"calibration rows may set a parameter")


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
    where = path.name if path.parent == CONFIG_DIR else str(path)
    raw = _read_config(path, where)
    if raw is None:
        raw = {}
    cals: list[Calibration] = []
    _take_calibrations(raw, "", where, cals)
    _check_calibrations(cals, where)
    pairs: list[tuple[str, str]] = list(prior)
    if overrides:
        items = overrides.items() if isinstance(overrides, Mapping) else (_split_override(o) for o in overrides)
        pairs.extend((str(k), str(v)) for k, v in items)
    for key, value in pairs:
        if isinstance(raw, dict):
            _apply_override(raw, key, value, f"{where} (--set {clip_text(key)}={clip_text(value)})")
    cfg = _build(ChipConfig, raw, "", where, dict(pairs))
    overridden = {k for k, _ in pairs}
    cfg = dataclasses.replace(cfg, source=str(path), overrides=tuple(pairs),
                              calibrations=tuple(c for c in cals if c.key not in overridden))
    _check_consistency(cfg, where)
    return cfg


_RAW_CACHE: dict[tuple[str, int, int, int], Any] = {}


def _read_config(path: Path, where: str) -> Any:
    """The parsed YAML of a config file, cached by its identity and modification time (a sweep
    loads one file once per variant; parsing costs ~10x the check). Callers get a copy."""
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key is not None and key in _RAW_CACHE:
        return copy.deepcopy(_RAW_CACHE[key])
    raw = load_yaml_file(path, where, "config")
    if key is not None:
        if len(_RAW_CACHE) >= 16:
            _RAW_CACHE.pop(next(iter(_RAW_CACHE)))
        _RAW_CACHE[key] = copy.deepcopy(raw)
    return raw


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"bad override '{clip_text(text)}': expected KEY=VALUE, e.g. core.sbuf.partition_bytes=256KiB")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


# ---------------------------------------------------------------------------------------------
# Systems: chips and the links between them (configs/systems/*.yaml)
# ---------------------------------------------------------------------------------------------
#
# A system names a chip config and a topology: an ordered list of dimensions, the first fastest
# in a chip's id (ASTRA-sim's multi-dimensional topology, notes/collectives.md §4.1). Overrides
# share one namespace with the chip's: ``topology.*``, ``collectives.*``, ``name``,
# ``description`` and ``chip`` are the system's; every other key (``core.dma.engine_bandwidth``,
# ``chip.lnc``) goes to its chip config, so ``--set`` means the same as for ``trnsim info``.

__all__ += ["SystemConfig", "TopologyDimConfig", "CollectivesConfig", "load_system", "system_names"]

SYSTEM_DIR = CONFIG_DIR / "systems"
_SYSTEM_KEYS = ("name", "description", "chip", "topology", "collectives")
_DIM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class TopologyDimConfig:
    """One dimension of a system's topology.

    ``ring``: each chip links to its two neighbours along the dimension, one link per direction
    (a torus is rings in every dimension); ``full``: a direct link from each chip to every other
    chip along the dimension; ``switch``: each chip has one port (up and down) into a switch that
    reaches every chip that shares its coordinates above this dimension."""

    kind: str = _str(("ring", "switch", "full"), doc="ring, switch or full")
    size: int = _int(1, 4096, doc="chips along the dimension")
    bandwidth: int = _q("bandwidth", doc="per link (ring, full) or per chip port (switch), each direction, bytes/s")
    latency: int = _q("time", lo=0, doc="per link hop (a switch is two hops: up and down), ps")
    inter_instance: bool = _bool(doc="the dimension joins instances (hierarchical algorithms split there)")
    proxy: bool = _bool(doc="traffic across it goes through the runtime's network proxy thread (EFA)")
    name: str = field(default="", metadata={"internal": True})


@dataclass(frozen=True)
class CollectivesConfig:
    """How collectives run on the system: CC cores, DMA packets, reductions and the size rule."""

    cc_cores_per_core: int = _int(1, 64, doc="CC cores per physical NeuronCore; concurrent collectives per core")
    packet_bytes: int = _q("bytes", doc="CC DMA packet size, bytes")
    max_chunks: int = _int(1, 1 << 20, doc="most chunks a transfer is cut into (simulation granularity)")
    window: int = _int(1, 1024, doc="chunks of one transfer in flight at once")
    reduce_engine: str = _str(("dma", "vector"), doc="who adds: DMA accumulate or VectorE")
    dma_accumulate_rate: float = _num(0.01, 1.0, doc="DMA accumulate throughput as a fraction of a copy's")
    mesh_below: int = _q("bytes", lo=0, doc="Mesh below this size, bytes")
    rdh_below: int = _q("bytes", lo=0, doc="RDH below this size (and at least mesh_below), bytes")
    rule_ranks: int = _int(1, 1 << 20, doc="the group size mesh_below and rdh_below are stated for; other groups "
                                           "compare their bytes per rank")
    pipeline_segments: int = _int(1, 4096, doc="segments of a pipelined broadcast/reduce chain")
    dma_duplication: bool = _bool(doc="a DMA write can go to two destinations from one read (KangaRing needs it)")
    # the Neuron runtime's costs (trnsim.collectives.runtime): zero them, and dma_rings to a
    # core's engines, for the network alone
    launch: int = _q("time", lo=0, doc="per call: host -> runtime -> CC core, before a rank's first transfer, ps")
    step_sync: int = _q("time", lo=0, doc="per transfer: the semaphore handshake with its peers before data moves, ps")
    issue: int = _q("time", lo=0, doc="CC core time to issue one transfer; a rank's CC core issues one at a time, ps")
    dma_rings: int = _int(1, 1024, doc="DMA rings (one engine each) per physical core a collective's transfers share")
    p2p_rings: int = _int(1, 1024, doc="DMA rings per physical core of a point-to-point transfer (send/recv, permute)")
    efa_proxy: int = _q("time", lo=0, doc="network proxy thread time per transfer that leaves the instance over EFA, ps")
    ranks_per_proxy: int = _int(1, 1 << 16, doc="ranks that share one network proxy thread")
    flat_ring_channels: int = _int(1, 64, doc="channels (cycles side by side, each leaving an instance "
                                                          "from a different chip) of a flat ring across instances")


@dataclass(frozen=True)
class _SystemHead:
    name: str = _str()
    description: str = _str()
    chip: str = _str(doc="a chip config name or a path relative to the system file")


@dataclass(frozen=True)
class SystemConfig:
    """A whole system: ``chip`` is the loaded chip config, ``topology`` its dimensions in order."""

    name: str
    description: str
    chip: ChipConfig
    topology: tuple[TopologyDimConfig, ...]
    collectives: CollectivesConfig
    source: str = ""
    overrides: tuple[tuple[str, str], ...] = ()
    calibrations: tuple[Calibration, ...] = ()  # the system's own (its chip's are chip.calibrations)

    @property
    def chips(self) -> int:
        return math.prod(d.size for d in self.topology)

    @property
    def ranks_per_chip(self) -> int:
        """Logical NeuronCores per chip: the ranks a chip holds, as on Neuron."""
        return self.chip.logical_cores

    @property
    def ranks(self) -> int:
        return self.chips * self.ranks_per_chip

    @property
    def instance_chips(self) -> int:
        return math.prod(d.size for d in self.topology if not d.inter_instance)

    @property
    def tick_hz(self) -> int:
        return self.chip.tick_hz

    def dim(self, name: str) -> TopologyDimConfig:
        for d in self.topology:
            if d.name == name:
                return d
        raise KeyError(name)

    def describe_overrides(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides)


for _cls in (TopologyDimConfig, CollectivesConfig, _SystemHead):
    _TYPES[_cls.__name__] = _cls


def system_names() -> list[str]:
    """Names of the built-in systems (``configs/systems/*.yaml``)."""
    return sorted(p.stem for p in SYSTEM_DIR.glob("*.yaml"))


def resolve_system_path(text: str) -> Path:
    p = Path(text)
    shown = clip_text(text)
    if p.suffix in (".yaml", ".yml") or os.sep in text or "/" in text:
        try:
            found = p.is_file()
        except OSError as e:  # e.g. a name too long for the file system
            raise ConfigError(f"{shown}: cannot read it ({e.strerror or type(e).__name__})") from None
        if not found:
            raise ConfigError(f"{shown}: no such system file")
        return p
    if text in system_names():  # a name, not a probe of the file system (a 3,000-character name is not a file)
        return SYSTEM_DIR / f"{text}.yaml"
    raise ConfigError(f"unknown system '{shown}': expected one of {', '.join(system_names())} or a path to a .yaml "
                      f"file")


def is_system_key(key: str) -> bool:
    """Whether a dotted override belongs to the system (else to its chip config)."""
    head = key.split(".", 1)[0]
    return key == "chip" or head in ("topology", "collectives", "name", "description")


def _fields_of(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _apply_system_override(raw: dict[str, Any], key: str, value: str, where: str) -> None:
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"{where}: bad override key '{key}': expected dotted keys like topology.x.bandwidth")
    head = parts[0]
    if head in ("name", "description", "chip"):
        if len(parts) != 1:  # pragma: no cover - chip.* goes to the chip config
            raise ConfigError(f"{where}: override '{key}': '{head}' is a value, not a section")
        raw[head] = value
        return
    if head == "collectives":
        fields = _fields_of(CollectivesConfig)
        if len(parts) != 2 or parts[1] not in fields:
            bad = parts[1] if len(parts) > 1 else "<nothing>"
            raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not in collectives; expected one of "
                              f"{', '.join(fields)}")
        sec = raw.get("collectives")
        raw["collectives"] = sec = dict(sec) if isinstance(sec, dict) else {}
        sec[parts[1]] = _override_value(value, fields[parts[1]])
        return
    topo = raw.get("topology")
    dims = list(topo) if isinstance(topo, dict) else []
    if len(parts) < 2 or parts[1] not in dims:
        bad = parts[1] if len(parts) > 1 else "<nothing>"
        raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not a dimension of topology; expected one of "
                          f"{', '.join(dims)}")
    fields = _fields_of(TopologyDimConfig)
    if len(parts) != 3 or parts[2] not in fields:
        bad = parts[2] if len(parts) > 2 else "<nothing>"
        raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not in topology.{parts[1]}; expected one of "
                          f"{', '.join(fields)}")
    assert isinstance(topo, dict)
    raw["topology"] = topo = dict(topo)
    dim = topo[parts[1]]
    topo[parts[1]] = dim = dict(dim) if isinstance(dim, dict) else {}
    dim[parts[2]] = _override_value(value, fields[parts[2]])


def _read_system_yaml(path: Path, where: str) -> Any:
    """A system file through the bounded YAML loader (aliases, depth, duplicate keys, size)."""
    return load_yaml_file(path, where, "system config")


def load_system(
    name_or_path: str | os.PathLike[str] | SystemConfig = "trn2.48xlarge",
    overrides: Iterable[str] | Mapping[str, Any] | None = None,
) -> SystemConfig:
    """Load a system by name (``trn2.48xlarge``) or path, applying dotted ``overrides``.

    Keys under ``topology.``/``collectives.`` (and ``name``, ``description``, ``chip``) change the
    system; any other key is passed to its chip config (``core.dma.engine_bandwidth=40GB/s``).
    Errors are one-line :class:`ConfigError`\\ s naming the file, the key, the value and what was
    expected."""
    if isinstance(overrides, str):
        overrides = [overrides]
    prior: tuple[tuple[str, str], ...] = ()
    if isinstance(name_or_path, SystemConfig):
        prior = name_or_path.overrides
        if not overrides:
            return name_or_path
        name_or_path = name_or_path.source
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"a system is a name ({', '.join(system_names())}), a path to a .yaml file or a "
                          f"SystemConfig, got {type(name_or_path).__name__}")
    path = resolve_system_path(os.fspath(name_or_path))
    where = path.name if path.parent == SYSTEM_DIR else str(path)
    raw = _read_system_yaml(path, where)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(_SYSTEM_KEYS)}")
    cals: list[Calibration] = []
    _take_calibrations(raw, "", where, cals)
    _check_calibrations(cals, where)
    pairs: list[tuple[str, str]] = list(prior)
    if overrides:
        items = overrides.items() if isinstance(overrides, Mapping) else (_split_override(o) for o in overrides)
        pairs.extend((str(k), str(v)) for k, v in items)
    chip_pairs = [(k, v) for k, v in pairs if not is_system_key(k)]
    sys_pairs = {k: v for k, v in pairs if is_system_key(k)}
    for key, value in sys_pairs.items():
        _apply_system_override(raw, key, value, f"{where} (--set {key}={value})")
    for key in raw:
        if key not in _SYSTEM_KEYS:
            raise ConfigError(f"{where}: unknown key '{key}': expected one of {', '.join(_SYSTEM_KEYS)}")
    for key in _SYSTEM_KEYS:
        if key not in raw:
            raise ConfigError(f"{where}: missing key '{key}'")
    head = _build(_SystemHead, {k: raw[k] for k in ("name", "description", "chip")}, "", where, sys_pairs)
    topo_raw = raw["topology"]
    if not isinstance(topo_raw, dict) or not topo_raw:
        raise ConfigError(f"{where}: topology must be a mapping of dimension name -> {{kind, size, bandwidth, "
                          f"latency, inter_instance}}, first dimension fastest")
    dims = []
    for dname, draw in topo_raw.items():
        if not isinstance(dname, str) or not _DIM_NAME.match(dname):
            raise ConfigError(f"{where}: topology.{dname}: expected a dimension name like x or efa "
                              f"(lower case letters, digits, _)")
        d = _build(TopologyDimConfig, draw, f"topology.{dname}", where, sys_pairs)
        dims.append(dataclasses.replace(d, name=dname))
    coll = _build(CollectivesConfig, raw["collectives"], "collectives", where, sys_pairs)
    seen_inter = None
    for d in dims:
        if d.inter_instance:
            seen_inter = d.name
        elif seen_inter is not None:
            raise ConfigError(f"{where}: topology.{d.name}.inter_instance = False: expected the dimensions inside an "
                              f"instance to come before the ones between instances ('{seen_inter}')")
    if coll.rdh_below < coll.mesh_below:
        raise ConfigError(f"{where}: collectives.rdh_below = {coll.rdh_below} bytes: expected at least "
                          f"collectives.mesh_below ({coll.mesh_below} bytes)")
    chips = math.prod(d.size for d in dims)
    if chips > 65536:
        raise ConfigError(f"{where}: topology has {chips:,} chips: expected at most 65,536")
    chip_ref = head.chip
    if chip_ref.endswith((".yaml", ".yml")) or "/" in chip_ref:
        chip_ref = str(path.parent / chip_ref)
    try:
        resolve_config_path(chip_ref)
    except ConfigError as e:  # named where it was given: the system's file or its --set
        given = f" (--set chip={sys_pairs['chip']})" if "chip" in sys_pairs else ""
        raise ConfigError(f"{where}{given}: chip: {e}") from None
    chip = load_config(chip_ref, dict(chip_pairs))
    return SystemConfig(name=head.name, description=head.description, chip=chip, topology=tuple(dims),
                        collectives=coll, source=str(path), overrides=tuple(pairs),
                        calibrations=tuple(c for c in cals if c.key not in sys_pairs))
