"""``trnsim validate``: run the validation ledger and print the error by category (part of the CLI,
with :mod:`trnsim.cli`; the rows are :mod:`trnsim.ledger`'s, the runs :mod:`trnsim.validate.run`'s).

    trnsim validate [NAME ...] [--quick] [--list] [--json | --markdown] [--out rows.csv|rows.parquet]
                    [--plot out.png] [--set K=V ...] [--record] [--check-drift]

NAME is a category (kernels, dma, collectives, inference, training), a row id, or an id prefix
ending in ``*``; none: every row. Rows out of tolerance are results, not errors: the exit status is
0 unless the input is bad (2) or ``--check-drift`` finds a prediction that moved (1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from .base import UsageError, emit
from ..config import is_system_key, load_config, load_system
from ..config.files import AtomicOutput, write_atomic
from ..config.ledger import CATEGORIES, Row, load_ledger
from ..validate.run import EXPECTED, Result, check_drift, expected_text, load_expected, run_rows, summarize

__all__ = ["add_parser", "cmd_validate", "render_summary", "summary_markdown"]


def add_parser(sub: Any) -> None:
    v = sub.add_parser("validate", help="run the validation ledger (validation/*.yaml): every published Trainium "
                                        "figure beside trnsim's prediction, and the error by category")
    v.add_argument("names", nargs="*", metavar="NAME",
                   help=f"a category ({', '.join(CATEGORIES)}), a row id or an id prefix ending in '*' (default: all)")
    v.add_argument("--quick", action="store_true", help="only the rows that take seconds (what CI runs)")
    v.add_argument("--list", action="store_true", help="list the rows with their sources, without running them")
    v.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    v.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table (docs/fidelity.md's)")
    v.add_argument("--out", metavar="ROWS.csv", help="write one line per row (.csv, or .parquet with the 'metrics' "
                                                     "extra)")
    v.add_argument("--plot", metavar="OUT.png", help="draw predicted vs measured on log-log axes, a colour per "
                                                     "category, the +-25%% band (needs the 'plot' extra)")
    v.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="dotted override applied to every row's chip or system config (repeatable)")
    v.add_argument("--ledger", metavar="DIR", help="read the ledger from DIR instead of the repository's validation/")
    v.add_argument("--record", action="store_true", help="with --quick: write the predictions to "
                                                         "validation/expected.yaml (the drift guard's file)")
    v.add_argument("--check-drift", action="store_true", help="with --quick: exit 1 if a prediction moved more "
                                                              "than 1%% from validation/expected.yaml")
    v.set_defaults(fn=cmd_validate)


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:,.0f}"


def _check_overrides(overrides: Sequence[str]) -> None:
    """A bad --set is refused before any row runs (one line, exit 2)."""
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if is_system_key(key):
            load_system("trn2.48xlarge", [o])
        else:
            load_config("trn2", [o])


def _list(rows: Sequence[Row], as_json: bool) -> None:
    if as_json:
        emit(json.dumps([{"id": r.id, "category": r.category, "role": r.role, "kind": r.kind, "chip": r.chip,
                          "system": r.system, "conditions": dict(r.conditions), "metric": r.metric,
                          "value": r.value, "unit": r.unit, "tolerance": r.tolerance, "quick": r.quick,
                          "predict": dict(r.predict), "source": r.cite(), "notes": r.notes} for r in rows],
                         indent=2, default=str))
        return
    print(f"{len(rows)} rows (validation/*.yaml); 'how' is the predictor, or why trnsim cannot predict it yet")
    w = max([len(r.id) for r in rows] + [2])
    for r in rows:
        how = r.how if r.predictable else f"none ({r.reason})"
        print(f"{r.id:<{w}}  {r.category:<11} {r.role:<11} {r.kind:<15} {_fmt(r.value):>9} {r.unit:<6} "
              f"{r.metric}; {r.chip}, {r.system}; {'quick; ' if r.quick else ''}{how}")
        print(f"{'':<{w}}  source: {r.cite()}")


def render_summary(results: Sequence[Result]) -> list[str]:
    """The summary table, as text lines."""
    lines = [f"{'category':<12} {'role':<12} {'rows':>5} {'predicted':>9} {'within':>7} {'measured':>8} "
             f"{'MAPE %':>8} {'median':>7} {'worst':>7}"]
    for s in summarize(results):
        lines.append(f"{s.category:<12} {s.role:<12} {s.rows:>5} {s.predicted:>9} {s.within:>7} {s.measured:>8} "
                     f"{_fmt(s.mape, 3):>8} {_fmt(s.median, 3):>7} {_fmt(s.worst, 3):>7}")
    return lines


def summary_markdown(results: Sequence[Result]) -> str:
    """The summary table as Markdown (what docs/fidelity.md shows)."""
    out = ["| category | role | rows | predicted | within tolerance | measured | MAPE | median ratio | worst ratio |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summarize(results):
        mape = "-" if s.mape is None else f"{s.mape:.1f}%"
        out.append(f"| {s.category} | {s.role} | {s.rows} | {s.predicted} | {s.within} | {s.measured} | {mape} | "
                   f"{_fmt(s.median, 3)} | {_fmt(s.worst, 3)} |")
    return "\n".join(out)


def _row_line(r: Result, w: int) -> str:
    mark = {"ok": "yes", "miss": "NO", "unsupported": "-", "error": "-"}[r.status]
    ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
    tail = f"  {r.status}: {r.reason}" if r.reason else ""
    return (f"{r.row.id:<{w}} {r.row.role[:5]:<5} {_fmt(r.row.value):>10} {_fmt(r.predicted):>10} {r.row.unit:<6} "
            f"{ratio:>7} {mark:>4}{tail}")


def _write_rows(out: AtomicOutput, path: str, results: Sequence[Result]) -> None:
    docs = [r.to_dict() for r in results]
    if path.lower().endswith(".parquet"):
        from ..config.extras import require

        pa = require("pyarrow", "metrics", "--out")
        pq = require("pyarrow.parquet", "metrics", "--out")
        table = pa.Table.from_pylist(docs)
        out.commit(lambda f: pq.write_table(table, f))
        return
    import csv

    def write(f: Any) -> None:
        w = csv.DictWriter(f, fieldnames=list(docs[0]) if docs else ["id"])
        w.writeheader()
        w.writerows(docs)

    out.commit(write)


def plot_results(results: Sequence[Result], out: AtomicOutput) -> None:
    """Predicted against measured, log-log, one colour per category, circles for validation rows
    and triangles for calibration rows (hollow: a bound or a vendor's target), with y = x and the
    +-25% band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pts = [r for r in results if r.predicted is not None]
    fig = Figure(figsize=(7, 6), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2")))
    for cat in CATEGORIES:
        for role, marker in (("validation", "o"), ("calibration", "^")):
            sel = [r for r in pts if r.row.category == cat and r.row.role == role]
            meas = [r for r in sel if r.row.kind.startswith("measured")]
            bound = [r for r in sel if not r.row.kind.startswith("measured")]
            if meas:
                ax.scatter([r.row.value for r in meas], [r.predicted for r in meas], c=colors[cat], marker=marker,
                           s=22, alpha=0.8, label=f"{cat} ({role}, {len(meas)})")
            if bound:  # a bound or a vendor's target: hollow, it is not a measurement
                ax.scatter([r.row.value for r in bound], [r.predicted for r in bound], facecolors="none",
                           edgecolors=colors[cat], marker=marker, s=22, label=f"{cat} ({role}, bound/target, {len(bound)})")
    if pts:
        lo = min(min(r.row.value, r.predicted or 0) for r in pts) / 2
        hi = max(max(r.row.value, r.predicted or 0) for r in pts) * 2
        xs = [lo, hi]
        ax.plot(xs, xs, color="black", lw=0.8, label="predicted = measured")
        ax.fill_between(xs, [x * 0.75 for x in xs], [x * 1.25 for x in xs], color="grey", alpha=0.2,
                        label="+-25%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured / published (the row's unit)")
    ax.set_ylabel("predicted by trnsim (same unit)")
    ax.set_title(f"trnsim validate: {len(pts)} rows predicted of {len(results)}")
    ax.legend(fontsize=7, loc="upper left")
    fmt = {".png": "png", ".svg": "svg", ".pdf": "pdf"}[out.shown[out.shown.rfind("."):].lower()]
    out.commit(lambda f: fig.savefig(f, format=fmt))


def cmd_validate(args: argparse.Namespace) -> int:
    ledger = load_ledger(args.ledger)
    rows = ledger.select(args.names, quick=args.quick)
    if args.list:
        _list(rows, args.json)
        return 0
    if (args.record or args.check_drift) and (not args.quick or args.names or args.set or args.ledger):
        raise UsageError("validate: --record and --check-drift take the whole quick set of the repository's ledger: "
                         "use them with --quick and without NAMEs, --set or --ledger")
    _check_overrides(args.set)
    outs: list[AtomicOutput | None] = [None, None]
    try:
        if args.out:
            if not args.out.lower().endswith((".csv", ".parquet")):
                raise UsageError(f"validate: --out {args.out}: expected a .csv or .parquet file name")
            if args.out.lower().endswith(".parquet"):
                from ..config.extras import require

                require("pyarrow.parquet", "metrics", "--out")
            outs[0] = AtomicOutput(args.out, "--out", text=not args.out.lower().endswith(".parquet"))
        if args.plot:
            from ..outputs.plot import reserve

            outs[1] = reserve(args.plot, "--plot")
        w = max([len(r.id) for r in rows] + [2])
        stream = not (args.json or args.markdown)

        def progress(r: Result) -> None:
            if stream:
                print(_row_line(r, w))
                sys.stdout.flush()

        if stream:
            print(f"{'row':<{w}} {'role':<5} {'measured':>10} {'predicted':>10} {'unit':<6} {'ratio':>7} {'in':>4}")
        t0 = time.perf_counter()
        results = run_rows(rows, args.set, progress)
        wall = time.perf_counter() - t0
        drift = check_drift(results, load_expected()) if args.check_drift else []
        if outs[0] is not None:
            _write_rows(outs[0], args.out, results)
        if outs[1] is not None:
            plot_results(results, outs[1])
    finally:
        for o in outs:
            if o is not None:
                o.discard()
    if args.record:
        write_atomic(EXPECTED, lambda f: f.write(expected_text(results)), "validation/expected.yaml")
    if args.json:
        emit(json.dumps({"rows": [r.to_dict() for r in results], "summary": [s.to_dict() for s in summarize(results)],
                         "seconds": round(wall, 2), "drift": drift}, indent=2))
    elif args.markdown:
        print()
        print(summary_markdown(results))
    else:
        print()
        print("\n".join(render_summary(results)))
        print(f"measured: predicted rows whose value is a measurement (bounds and vendor targets count only in 'within'); "
              f"over them MAPE = mean |predicted/measured - 1|, median and worst = predicted/measured. "
              f"{len(results)} rows in {wall:.1f} s")
        if args.record:
            print(f"recorded {sum(r.predicted is not None for r in results)} predictions in validation/expected.yaml")
        if args.check_drift:
            print("drift: none (every quick prediction within 1% of validation/expected.yaml)" if not drift else
                  "drift: predictions moved more than 1% from validation/expected.yaml (update it in the same "
                  "change: trnsim validate --quick --record):\n  " + "\n  ".join(drift))
    return 1 if drift else 0
