"""The schema machinery of chip and system configs: each leaf field declares its kind and range in
its metadata (:func:`quantity_field` and friends); :func:`build` checks raw YAML against a
dataclass, one leaf at a time, with one-line errors naming the file, the key, the value and what
was expected; ``{value, calibrated, fit}`` leaves give a parameter's calibration provenance."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .loader import ConfigError, clip_text, format_value, load_yaml
from .units import format_quantity, parse_quantity

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


def quantity_field(kind: str, lo: float = 1, hi: float = math.inf, doc: str = "") -> Any:
    if kind == "time" and hi == math.inf:
        hi = MAX_TIME_PS
    return field(metadata={"kind": kind, "lo": lo, "hi": hi, "doc": doc})


def int_field(lo: int = 1, hi: float = math.inf, doc: str = "") -> Any:
    return field(metadata={"kind": "int", "lo": lo, "hi": hi, "doc": doc})


def float_field(lo: float = 0.0, hi: float = math.inf, doc: str = "") -> Any:
    return field(metadata={"kind": "float", "lo": lo, "hi": hi, "doc": doc})


def bool_field(doc: str = "") -> Any:
    return field(metadata={"kind": "bool", "doc": doc})


def str_field(choices: tuple[str, ...] | None = None, doc: str = "") -> Any:
    return field(metadata={"kind": "str", "choices": choices, "doc": doc})



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


def override_value(text: str, f: dataclasses.Field[Any]) -> Any:
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


def build(cls: Any, raw: Any, path: str, where: str, from_set: Mapping[str, str] | None = None) -> Any:
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
        sub = TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if sub is not None and dataclasses.is_dataclass(sub):
            values[name] = build(sub, raw[name], loc, where, from_set)
        else:
            w = f"{where} (--set {loc}={clip_text(from_set[loc])})" if from_set and loc in from_set else where
            values[name] = leaf(raw[name], f, loc, w)
    return cls(**values)


def leaf(value: Any, f: dataclasses.Field[Any], loc: str, where: str) -> Any:
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


#: dataclass name -> class, for fields whose annotation is a string (``from __future__ import annotations``)
TYPES: dict[str, Any] = {}


_CALIBRATION_KEYS = ("value", "calibrated", "fit")


def take_calibrations(node: Any, path: str, where: str, out: list[Calibration]) -> None:
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
            take_calibrations(sub, loc, where, out)


def check_calibrations(cals: Iterable[Calibration], where: str) -> None:
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



def calibrations_of(raw: Any, where: str) -> list[Calibration]:
    """Take the provenance out of a config file's raw YAML (leaving the values) and check that every
    row it names is a calibration row of the ledger."""
    cals: list[Calibration] = []
    take_calibrations(raw, "", where, cals)
    check_calibrations(cals, where)
    return cals


def override_pairs(prior: Iterable[tuple[str, str]],
                   overrides: Iterable[str] | Mapping[str, Any] | str | None) -> list[tuple[str, str]]:
    """The overrides a loaded config already carries, then the new ones: ``"key=value"`` strings
    (one or many, as the CLI takes them) or a mapping, in order."""
    pairs = list(prior)
    if isinstance(overrides, str):
        overrides = [overrides]
    if overrides:
        items = overrides.items() if isinstance(overrides, Mapping) else (split_override(o) for o in overrides)
        pairs.extend((str(k), str(v)) for k, v in items)
    return pairs


def split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"bad override '{clip_text(text)}': expected KEY=VALUE, e.g. core.sbuf.partition_bytes=256KiB")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()
