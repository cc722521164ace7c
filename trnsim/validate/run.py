"""Running ledger rows, summarising their error, and the drift guard.

:func:`run_rows` predicts each row (a row trnsim cannot predict yet keeps its reason; a setup
trnsim refuses keeps its one-line error), :func:`summarize` gives per category and role the
count, the MAPE and the median and worst ratio, and :func:`check_drift` compares a run with the
predictions recorded in ``validation/expected.yaml``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..config import format_value, load_yaml_file
from ..config.ledger import CATEGORIES, ROLES, VALIDATION_DIR, LedgerError, Row, to_unit, unit_dimension
from .predictors import PredictionError, predict

__all__ = ["Result", "Summary", "run_rows", "summarize", "EXPECTED", "DRIFT", "check_drift", "expected_text",
           "load_expected"]

EXPECTED = VALIDATION_DIR / "expected.yaml"
DRIFT = 0.01  # a recorded prediction may move this much (relative) before the guard fails


@dataclass(frozen=True)
class Result:
    """A row and what trnsim made of it. ``status``: ``ok`` (within the row's tolerance), ``miss``
    (outside it), ``unsupported`` (``how: none``: ``reason`` says why) or ``error`` (trnsim refused
    the setup: ``reason`` is its message). ``predicted`` is in the row's unit."""

    row: Row
    status: str
    predicted: float | None
    reason: str
    seconds: float

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.row.value

    @property
    def error(self) -> float | None:
        """|predicted / measured - 1|."""
        r = self.ratio
        return None if r is None else abs(r - 1.0)

    def to_dict(self) -> dict[str, Any]:
        r = self.row
        return {"id": r.id, "category": r.category, "role": r.role, "chip": r.chip, "system": r.system,
                "metric": r.metric, "kind": r.kind, "unit": r.unit, "measured": r.value, "predicted": self.predicted,
                "ratio": self.ratio, "tolerance": r.tolerance, "status": self.status, "reason": self.reason,
                "how": r.how, "quick": r.quick, "source": r.cite(), "conditions": json.dumps(dict(r.conditions),
                                                                                             sort_keys=True),
                "seconds": round(self.seconds, 3)}


def _key(row: Row, run: Sequence[str]) -> str:
    args = {k: v for k, v in row.predict.items() if k != "output"}
    return json.dumps([row.chip, args, list(run)], sort_keys=True, default=str)


def run_rows(rows: Iterable[Row], overrides: Sequence[str] = (),
             progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Predict every row (rows sharing a predictor call share one run). ``overrides`` (dotted
    ``K=V``) apply to every row's chip and system config; ``progress`` sees each result as it
    comes. A malformed ``predict`` is a LedgerError naming the row."""
    cache: dict[str, tuple[dict[str, Any] | None, str, float]] = {}
    out: list[Result] = []
    for row in rows:
        if not row.predictable:
            res = Result(row, "unsupported", None, row.reason, 0.0)
        else:
            key = _key(row, overrides)
            if key not in cache:
                args = {k: v for k, v in row.predict.items() if k not in ("how", "output")}
                t0 = time.perf_counter()
                try:
                    cache[key] = (predict(row.how, args, row.chip, overrides), "", time.perf_counter() - t0)
                except PredictionError as e:
                    cache[key] = (None, str(e), time.perf_counter() - t0)
                except LedgerError as e:
                    raise LedgerError(f"{row.file}: row '{row.id}': {e}") from None
                seconds = cache[key][2]
            else:
                seconds = 0.0
            figures, why, _ = cache[key]
            if figures is None:
                res = Result(row, "error", None, why, seconds)
            else:
                out_name = str(row.predict["output"])
                if out_name not in figures:
                    raise LedgerError(f"{row.file}: row '{row.id}': output {format_value(out_name)}: predictor "
                                      f"{row.how} gives {', '.join(figures)}")
                dim, value = figures[out_name]
                if unit_dimension(row.unit) != dim:
                    raise LedgerError(f"{row.file}: row '{row.id}': unit {row.unit} measures "
                                      f"{unit_dimension(row.unit)}, but output {out_name} is a {dim}")
                pred = to_unit(value, dim, row.unit)
                if not math.isfinite(pred) or pred <= 0:
                    res = Result(row, "error", None, f"the prediction is {pred!r}", seconds)
                else:
                    res = Result(row, "ok" if row.within(pred) else "miss", pred, "", seconds)
        out.append(res)
        if progress is not None:
            progress(res)
    return out


@dataclass(frozen=True)
class Summary:
    """One category x role: rows in the ledger, rows predicted, rows within their tolerance, and,
    over the predicted rows whose value is a measurement (not a bound a test enforced, not a
    vendor's target), their count, mean absolute percentage error and median and worst (farthest
    from 1, as a factor) predicted/measured ratio."""

    category: str
    role: str
    rows: int
    predicted: int
    within: int
    measured: int
    mape: float | None
    median: float | None
    worst: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _worst(ratios: Sequence[float]) -> float:
    return max(ratios, key=lambda r: abs(math.log(r)))


def summarize(results: Sequence[Result]) -> list[Summary]:
    """Per category (in :data:`CATEGORIES` order) and role, then an ``all`` line per role."""
    out = []
    for cat in (*CATEGORIES, "all"):
        for role in ROLES:
            rs = [r for r in results if r.row.role == role and (cat == "all" or r.row.category == cat)]
            if not rs:
                continue
            ratios = [r.ratio for r in rs if r.ratio is not None and r.row.kind.startswith("measured")]
            out.append(Summary(cat, role, len(rs), sum(r.predicted is not None for r in rs),
                               sum(r.status == "ok" for r in rs), len(ratios),
                               100 * statistics.fmean(abs(x - 1) for x in ratios) if ratios else None,
                               statistics.median(ratios) if ratios else None, _worst(ratios) if ratios else None))
    return out


# ---------------------------------------------------------------------------------------------
# the drift guard
# ---------------------------------------------------------------------------------------------

_HEADER = """\
# Recorded predictions of the ledger's quick rows (trnsim validate --quick), in each row's unit.
# tests/validate/test_validate.py runs the quick rows and fails when a prediction moves by more than 1% from
# the value here: a change that moves one updates this file in the same commit, so the move is seen
# in review. Regenerate with:  trnsim validate --quick --record
"""


def expected_text(results: Sequence[Result]) -> str:
    """The expected-predictions file for ``results`` (quick rows that were predicted)."""
    lines = [_HEADER, "predictions:"]
    for r in results:
        if r.predicted is not None:
            lines.append(f"  {r.row.id}: {r.predicted:.6g}  # {r.row.unit}")
    return "\n".join(lines) + "\n"


def load_expected(path: str | Path = EXPECTED) -> dict[str, float]:
    raw = load_yaml_file(path, Path(path).name, "expected predictions file")
    preds = raw.get("predictions") if isinstance(raw, dict) else None
    if not isinstance(preds, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in preds.values()):
        raise LedgerError(f"{Path(path).name}: expected 'predictions:' mapping row ids to numbers")
    return {str(k): float(v) for k, v in preds.items()}


def check_drift(results: Sequence[Result], expected: Mapping[str, float], tolerance: float = DRIFT) -> list[str]:
    """One line per quick row whose prediction moved by more than ``tolerance`` from the recorded
    one, or that was recorded and is no longer predicted (or the reverse). Empty: no drift."""
    problems = []
    got = {r.row.id: r for r in results}
    for rid, res in got.items():
        if not res.row.quick:
            continue
        rec = expected.get(rid)
        if res.predicted is None:
            if rec is not None:
                problems.append(f"{rid}: recorded {rec:.6g} {res.row.unit}, now not predicted ({res.status}: "
                                f"{res.reason})")
            continue
        if rec is None:
            problems.append(f"{rid}: predicted {res.predicted:.6g} {res.row.unit}, not recorded")
        elif abs(res.predicted / rec - 1) > tolerance:
            problems.append(f"{rid}: predicted {res.predicted:.6g} {res.row.unit}, recorded {rec:.6g} "
                            f"({100 * (res.predicted / rec - 1):+.2f}%)")
    for rid in expected:
        if rid not in got:
            problems.append(f"{rid}: recorded, but no quick row of this id ran")
    return problems
