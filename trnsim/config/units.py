"""Quantities with their units (``224KiB``, ``2.4GHz``, ``2.9TB/s``, ``1300ns``), parsed once,
exactly, into integers (bytes, Hz, bytes/s, picoseconds), and formatted back for messages."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

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
