"""The validation ledger as data: every published Trainium figure trnsim is measured against.

The ledger is ``validation/*.yaml`` at the top of the repository, one file per source family
(``validation/README.md`` documents the schema with an example). This module reads and checks it
and nothing else: running the rows is :mod:`trnsim.validate`'s (an app), while the chip and
system configs (:mod:`trnsim.config`) ask it which rows exist and what their role is, because a
parameter's ``calibrated: [row ids]`` provenance must name calibration rows.

A row says where a figure comes from (``source`` + ``where``), what was measured under which
conditions (``chip``, ``system``, ``conditions``, ``metric``, ``value``, ``unit``, ``kind``), whether
it may set a parameter (``role``: ``calibration``) or only judges the model (``validation``), how
close a prediction must come (``tolerance``, a fraction), and how trnsim predicts it (``predict``:
the predictor's name and its arguments, or ``how: none`` with the reason it cannot yet).

Every problem is one :class:`LedgerError` line naming the file, the row and the field.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import ConfigError, clip_text, format_value, load_yaml_file, shipped_dir

__all__ = [
    "LedgerError",
    "Row",
    "Source",
    "Ledger",
    "load_ledger",
    "row_roles",
    "VALIDATION_DIR",
    "CATEGORIES",
    "ROLES",
    "KINDS",
    "UNITS",
    "unit_dimension",
    "to_unit",
]

VALIDATION_DIR = shipped_dir("validation")

#: the categories the summary reports, in its order
CATEGORIES = ("kernels", "dma", "collectives", "inference", "training")
ROLES = ("calibration", "validation")
#: what kind of figure a row's value is
KINDS = {
    "measured": "a measurement whose statistic the source does not name",
    "measured-mean": "the mean of repeated measurements",
    "measured-median": "the median (p50) of repeated measurements",
    "measured-p99": "the 99th percentile of repeated measurements",
    "threshold-max": "an upper bound a test enforces (a prediction at or below it passes)",
    "threshold-min": "a lower bound a test enforces (a prediction at or above it passes)",
    "target": "a vendor's target or claim, not a measurement",
}
#: unit -> (dimension, factor to the dimension's base unit: s, B/s, %, 1/s, 1)
UNITS: dict[str, tuple[str, float]] = {
    "ns": ("time", 1e-9), "us": ("time", 1e-6), "ms": ("time", 1e-3), "s": ("time", 1.0),
    "B/s": ("bandwidth", 1.0), "GB/s": ("bandwidth", 1e9), "GiB/s": ("bandwidth", 2.0**30),
    "TB/s": ("bandwidth", 1e12),
    "%": ("percent", 1.0),
    "tok/s": ("rate", 1.0), "seq/s": ("rate", 1.0), "samples/s": ("rate", 1.0), "1/s": ("rate", 1.0),
    "x": ("ratio", 1.0),
}
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,79}$")
_CHIPS = ("trn1", "trn2", "trn3", "inf2")
_FILE_KEYS = ("family", "about", "sources", "defaults", "rows")
_ROW_KEYS = ("id", "category", "source", "where", "chip", "system", "conditions", "metric", "value", "unit",
             "kind", "role", "tolerance", "predict", "quick", "notes")
_REQUIRED = ("id", "category", "source", "where", "chip", "system", "conditions", "metric", "value", "unit",
             "kind", "role", "predict")
_SOURCE_KEYS = ("repo", "commit", "path", "url", "title")


class LedgerError(ConfigError):
    """The ledger (a file, a row or a field) is invalid. The message is one line."""


@dataclass(frozen=True)
class Source:
    """A document a row cites: a repository file at a commit, or a URL."""

    key: str
    repo: str = ""
    commit: str = ""
    path: str = ""
    url: str = ""
    title: str = ""

    def cite(self) -> str:
        if self.url:
            return self.url
        return f"{self.repo}@{self.commit[:8]}:{self.path}"


@dataclass(frozen=True)
class Row:
    """One published figure and how trnsim predicts it (see the module docstring)."""

    id: str
    category: str
    source: Source
    where: str
    chip: str
    system: str
    conditions: Mapping[str, Any]
    metric: str
    value: float
    unit: str
    kind: str
    role: str
    tolerance: float
    predict: Mapping[str, Any]
    quick: bool
    notes: str
    file: str  # the ledger file's name

    @property
    def how(self) -> str:
        return str(self.predict["how"])

    @property
    def predictable(self) -> bool:
        return self.how != "none"

    @property
    def reason(self) -> str:
        """Why trnsim cannot predict the row yet (``how: none`` rows)."""
        return str(self.predict.get("reason", ""))

    def cite(self) -> str:
        return f"{self.source.cite()} § {self.where}"

    def within(self, predicted: float) -> bool:
        """Is ``predicted`` (in the row's unit) within the row's tolerance? A threshold passes on
        its side of the bound and within the tolerance beyond it."""
        if self.kind == "threshold-max":
            return predicted <= self.value * (1 + self.tolerance)
        if self.kind == "threshold-min":
            return predicted >= self.value * (1 - self.tolerance)
        return abs(predicted / self.value - 1) <= self.tolerance


@dataclass(frozen=True)
class Ledger:
    rows: tuple[Row, ...]
    files: tuple[str, ...]
    families: Mapping[str, str] = field(default_factory=dict)  # file name -> its 'about'

    def by_id(self) -> dict[str, Row]:
        return {r.id: r for r in self.rows}

    def select(self, wanted: Iterable[str] = (), quick: bool = False) -> list[Row]:
        """Rows by category or id (none given: all), in ledger order; ``quick`` keeps the rows
        marked quick. An unknown name is a LedgerError naming it."""
        wanted = list(wanted)
        ids = self.by_id()
        picked: list[Row] = []
        if not wanted:
            picked = list(self.rows)
        else:
            seen: set[str] = set()
            for w in wanted:
                if w in CATEGORIES:
                    rows = [r for r in self.rows if r.category == w]
                elif w in ids:
                    rows = [ids[w]]
                elif w.endswith("*") and any(r.id.startswith(w[:-1]) for r in self.rows):
                    rows = [r for r in self.rows if r.id.startswith(w[:-1])]
                else:
                    raise LedgerError(f"unknown row or category '{clip_text(w, 60)}': expected a category "
                                      f"({', '.join(CATEGORIES)}), a row id (see 'trnsim validate --list') or an "
                                      f"id prefix ending in '*'")
                for r in rows:
                    if r.id not in seen:
                        seen.add(r.id)
                        picked.append(r)
            order = {r.id: i for i, r in enumerate(self.rows)}
            picked.sort(key=lambda r: order[r.id])
        if quick:
            picked = [r for r in picked if r.quick]
        return picked


def unit_dimension(unit: str) -> str:
    return UNITS[unit][0]


def to_unit(value: float, dimension: str, unit: str) -> float:
    """A value in ``dimension``'s base unit (s, B/s, %, 1/s) expressed in ``unit``."""
    dim, factor = UNITS[unit]
    if dim != dimension:
        raise LedgerError(f"unit {unit} measures {dim}, not {dimension}")
    return value / factor


def _text(v: Any, where: str, key: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise LedgerError(f"{where}: '{key}' = {format_value(v)}: expected a non-empty string")
    return v.strip()


def _sources(raw: Any, where: str) -> dict[str, Source]:
    if not isinstance(raw, dict) or not raw:
        raise LedgerError(f"{where}: 'sources' must be a mapping of source keys to documents "
                          f"({{repo, commit, path}} or {{url}})")
    out: dict[str, Source] = {}
    for key, doc in raw.items():
        w = f"{where}: source '{clip_text(str(key), 40)}'"
        if not isinstance(doc, dict):
            raise LedgerError(f"{w}: expected a mapping with repo, commit and path, or url")
        bad = [k for k in doc if k not in _SOURCE_KEYS]
        if bad:
            raise LedgerError(f"{w}: unknown key '{clip_text(str(bad[0]), 40)}': expected {', '.join(_SOURCE_KEYS)}")
        vals = {k: _text(v, w, k) for k, v in doc.items()}
        if "url" not in vals:
            missing = [k for k in ("repo", "commit", "path") if k not in vals]
            if missing:
                raise LedgerError(f"{w}: missing '{missing[0]}': a document is a repository path at a commit "
                                  f"(repo, commit, path) or a url")
            if not re.fullmatch(r"[0-9a-f]{7,40}", vals["commit"]):
                raise LedgerError(f"{w}: commit {format_value(vals['commit'])}: expected a git commit hash")
        out[str(key)] = Source(str(key), **vals)
    return out


def _merge(defaults: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for k, v in row.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def _row(raw: Any, defaults: Mapping[str, Any], sources: Mapping[str, Source], fname: str, index: int) -> Row:
    if not isinstance(raw, dict):
        raise LedgerError(f"{fname}: row {index + 1}: expected a mapping, got {type(raw).__name__}")
    rid = raw.get("id")
    where = f"{fname}: row {index + 1}" if not isinstance(rid, str) else f"{fname}: row '{clip_text(rid, 60)}'"
    d = _merge(defaults, raw)
    for k in d:
        if k not in _ROW_KEYS:
            raise LedgerError(f"{where}: unknown key '{clip_text(str(k), 40)}': expected one of {', '.join(_ROW_KEYS)}")
    for k in _REQUIRED:
        if k not in d or d[k] is None or d[k] == "":
            raise LedgerError(f"{where}: missing '{k}'" + (": every row cites the document its figure comes from"
                                                          if k in ("source", "where") else ""))
    if not isinstance(rid, str) or not _ID.match(rid):
        raise LedgerError(f"{where}: id {format_value(rid)}: expected lower-case letters, digits, '.', '_' or '-' "
                          f"(at most 80)")
    if d["category"] not in CATEGORIES:
        raise LedgerError(f"{where}: category {format_value(d['category'])}: expected one of {', '.join(CATEGORIES)}")
    src = d["source"]
    if not isinstance(src, str) or src not in sources:
        raise LedgerError(f"{where}: source {format_value(src)} is not in the file's sources "
                          f"({', '.join(sources)})")
    if d["chip"] not in _CHIPS:
        raise LedgerError(f"{where}: chip {format_value(d['chip'])}: expected one of {', '.join(_CHIPS)}")
    if not isinstance(d["conditions"], dict) or not d["conditions"]:
        raise LedgerError(f"{where}: 'conditions' must be a non-empty mapping (shapes, dtypes, ranks, ...)")
    value = d["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise LedgerError(f"{where}: value {format_value(value)}: expected a positive number")
    if d["unit"] not in UNITS:
        raise LedgerError(f"{where}: unit {format_value(d['unit'])}: expected one of {', '.join(UNITS)}")
    if d["kind"] not in KINDS:
        raise LedgerError(f"{where}: kind {format_value(d['kind'])}: expected one of {', '.join(KINDS)}")
    if d["role"] not in ROLES:
        raise LedgerError(f"{where}: role {format_value(d['role'])}: expected calibration or validation")
    tol = d.get("tolerance", 0.25)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 < tol <= 10):
        raise LedgerError(f"{where}: tolerance {format_value(tol)}: expected a fraction in (0, 10], e.g. 0.25")
    pred = d["predict"]
    if not isinstance(pred, dict) or not isinstance(pred.get("how"), str):
        raise LedgerError(f"{where}: 'predict' must be a mapping with 'how' (a predictor, or none with a reason)")
    if pred["how"] == "none":
        if not isinstance(pred.get("reason"), str) or not pred["reason"].strip():
            raise LedgerError(f"{where}: predict how: none needs a 'reason': why trnsim cannot predict it yet")
    elif not isinstance(pred.get("output"), str):
        raise LedgerError(f"{where}: predict needs 'output': which of the predictor's figures the value is")
    quick = d.get("quick", False)
    if not isinstance(quick, bool):
        raise LedgerError(f"{where}: quick {format_value(quick)}: expected true or false")
    notes = d.get("notes", "")
    if not isinstance(notes, str):
        raise LedgerError(f"{where}: notes: expected a string")
    return Row(id=rid, category=d["category"], source=sources[src], where=_text(d["where"], where, "where"),
               chip=d["chip"], system=_text(d["system"], where, "system"), conditions=d["conditions"],
               metric=_text(d["metric"], where, "metric"), value=float(value), unit=d["unit"], kind=d["kind"],
               role=d["role"], tolerance=float(tol), predict=pred, quick=quick, notes=notes.strip(), file=fname)


def _load_file(path: Path) -> tuple[list[Row], str]:
    fname = path.name
    try:
        raw = load_yaml_file(path, fname, "ledger file")
    except LedgerError:
        raise
    except ConfigError as e:  # the YAML itself: one line, as a ledger error
        raise LedgerError(str(e)) from None
    if not isinstance(raw, dict):
        raise LedgerError(f"{fname}: expected a mapping with {', '.join(_FILE_KEYS)}")
    for k in raw:
        if k not in _FILE_KEYS:
            raise LedgerError(f"{fname}: unknown key '{clip_text(str(k), 40)}': expected one of {', '.join(_FILE_KEYS)}")
    for k in ("family", "about", "sources", "rows"):
        if k not in raw:
            raise LedgerError(f"{fname}: missing '{k}'")
    about = _text(raw["about"], fname, "about")
    sources = _sources(raw["sources"], fname)
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise LedgerError(f"{fname}: 'defaults' must be a mapping of row keys")
    if "id" in defaults:
        raise LedgerError(f"{fname}: 'defaults' cannot give an id")
    rows = raw["rows"]
    if not isinstance(rows, list) or not rows:
        raise LedgerError(f"{fname}: 'rows' must be a non-empty list")
    return [_row(r, defaults, sources, fname, i) for i, r in enumerate(rows)], about


_CACHE: dict[tuple[Any, ...], Ledger] = {}


def _ledger_files(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as it:
            names = sorted(e.name for e in it if e.name.endswith(".yaml") and e.name != "expected.yaml")
    except OSError:
        return []
    return [directory / n for n in names]


def _stamp(directory: Path) -> tuple[Any, ...]:
    """What identifies the ledger's current contents: each file's name, mtime and size."""
    out: list[Any] = [str(directory)]
    for p in _ledger_files(directory):
        try:
            st = os.stat(p)
            out.append((p.name, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((p.name, None, None))
    return tuple(out)


def load_ledger(directory: str | os.PathLike[str] | None = None) -> Ledger:
    """Read and check every ledger file (``*.yaml`` but ``expected.yaml``) of ``directory``
    (default: the repository's ``validation/``). Cached until a file changes."""
    d = Path(directory) if directory is not None else VALIDATION_DIR
    if not d.is_dir():
        raise LedgerError(f"no ledger directory '{clip_text(str(d))}' (validation/ at the top of the repository)")
    key = _stamp(d)
    if key in _CACHE:
        return _CACHE[key]
    rows: list[Row] = []
    families: dict[str, str] = {}
    files = _ledger_files(d)
    if not files:
        raise LedgerError(f"ledger directory '{clip_text(str(d))}' has no *.yaml files")
    seen: dict[str, str] = {}
    for p in files:
        file_rows, about = _load_file(p)
        families[p.name] = about
        for r in file_rows:
            if r.id in seen:
                raise LedgerError(f"{p.name}: row '{r.id}': the id is also used in {seen[r.id]}")
            seen[r.id] = p.name
        rows.extend(file_rows)
    ledger = Ledger(tuple(rows), tuple(p.name for p in files), families)
    if len(_CACHE) >= 4:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = ledger
    return ledger


_ROLE_CACHE: dict[tuple[str, int, int], dict[str, str]] = {}
_SCAN_CACHE: dict[tuple[Any, ...], dict[str, str]] = {}


def _file_roles(path: Path) -> dict[str, str]:
    """Row id -> role of one ledger file, parsed with libyaml when PyYAML has it: the configs ask
    this on every load, so it must cost milliseconds, not the full check's second."""
    import yaml

    st = os.stat(path)
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key in _ROLE_CACHE:
        return _ROLE_CACHE[key]
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f.read(), Loader=loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise LedgerError(f"{path.name}: cannot read it ({' '.join(str(e).split())[:200]})") from None
    out: dict[str, str] = {}
    if isinstance(raw, dict) and isinstance(raw.get("rows"), list):
        default = (raw.get("defaults") or {}).get("role") if isinstance(raw.get("defaults"), dict) else None
        for r in raw["rows"]:
            if isinstance(r, dict) and isinstance(r.get("id"), str):
                out[r["id"]] = str(r.get("role", default))
    _ROLE_CACHE[key] = out
    return out


def row_roles(ids: Iterable[str], directory: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The role of each of ``ids`` that the ledger has (an id it lacks is absent), for the
    configs' ``calibrated:`` provenance check. Only the files that mention an id are parsed."""
    d = Path(directory) if directory is not None else VALIDATION_DIR
    wanted = frozenset(ids)
    key = (_stamp(d), wanted)
    if key in _SCAN_CACHE:
        return dict(_SCAN_CACHE[key])
    out: dict[str, str] = {}
    for p in _ledger_files(d):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if any(f"id: {i}" in text for i in wanted):
            roles = _file_roles(p)
            out.update({i: roles[i] for i in wanted if i in roles})
    if len(_SCAN_CACHE) >= 16:
        _SCAN_CACHE.pop(next(iter(_SCAN_CACHE)))
    _SCAN_CACHE[key] = dict(out)
    return out
