"""TensorE fidelity: simulated GEMM folds against the weight-stationary closed forms and SCALE-Sim v3.

What is measured. A kernel loads the operands of F folds into one SBUF tile with one DMA, then
issues F ``nc_matmul``: fold f multiplies its own 128x128 bf16 stationary (distinct, used once)
with its own [128, M] bf16 moving tile and accumulates into one PSUM bank, so the F folds are
the K-blocks of ``out[128, M] = A[128·F, 128]ᵀ @ B[128·F, M]``. The figure is the TensorE time,
in PE cycles, from the start of the first LoadStationary (``report.segments("Tensor (LS)")``) to
``report.total_ticks``, the instant the last fold's result is visible in PSUM (the kernel ends
with the matmuls, so that is the last MultiplyMoving's end plus its R+C-2 fill/drain). The
dI/dt power ramp is off (``core.tensor.throttle_initial_util=1``): neither closed form has one.

Closed forms (R = PE rows, C = PE cols, F folds, M = moving free size):

* pipelined weight stationary, ``T = R + F·max(M,R) + (R+C-2)``: the next stationary loads
  (R cycles) while the current fold streams;
* SCALE-Sim v3 weight stationary, ``T = F·(2R+C+M-2)``: load, stream, drain, one fold at a time
  (``core.tensor.overlap_load_stationary=false``).

What the comparison found (the tables print the numbers):

1. Both forms load a stationary in R cycles, one row per cycle. Trainium's LoadStationary is
   the "fast" one, ~C/4 = 32 cycles for 128 columns (datasheet §7, S8/S11; configs say
   ``load_stationary_speedup: 4``). Against the forms the simulator therefore runs with
   ``load_stationary_speedup=1``; the shipped trn2 config is printed beside the same derivation
   with its own load time and issue interval (L = 32, I = max(min(64, 128), M), datasheet §7).
2. For M < R the pipelined form charges max(M,R) to every fold, the last one too. The last
   fold has no next stationary to wait for, so it ends M cycles after it starts: the form
   over-counts by R-M (64 cycles at M = 64: 12.5% of one fold, 0.75% of 64 folds). Those rows
   are checked against the form with the last fold corrected,
   ``T' = R + (F-1)·max(M,R) + M + (R+C-2)``; the form's own error is printed next to it.
3. SCALE-Sim prints ``F·(2R+C+M-2) - 1``: its "Total Cycles" is the largest cycle index at which
   an output row is written, counting from cycle 0; ours is the number of cycles elapsed.

Exit status 1 if a checked tolerance is missed (2% pipelined, 1% SCALE-Sim form and SCALE-Sim).

    python benchmarks/fidelity_tensor.py [--quick] [--scalesim]

``--scalesim`` runs SCALE-Sim v3.0.0 itself on every (F, M): a 128x128 weight-stationary array,
GEMM M x N x K = M x 128 x 128·F (F row folds of M streamed rows), with its config and topology
files written to a temp dir and large SRAMs so no stalls arise. If scalesim is not importable it
is installed with pip; SCALE-Sim 3.0.0 crashes on numpy >= 2.4 (``int()`` of a 1-element array
in its memory model, SCALE-Sim#160), so it then runs in a subprocess with numpy<2.4 installed
into a private directory on its PYTHONPATH, leaving this environment's numpy alone.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy

from trnsim import Chip, Kernel

FOLDS = (1, 4, 16, 64)
MOVING = (64, 128, 256, 512)
QUICK_FOLDS = (1, 4)
QUICK_MOVING = (64, 512)
PIPELINED_TOL = 0.02
SCALESIM_TOL = 0.01

NO_RAMP = {"core.tensor.throttle_initial_util": 1.0}
#: the forms' array: a stationary loads in R cycles, one row per cycle
FORM_ARRAY = {**NO_RAMP, "core.tensor.load_stationary_speedup": 1}
NO_OVERLAP = {"core.tensor.overlap_load_stationary": False}


def fold_kernel(chip: Chip, folds: int, m: int, *, store: bool = False) -> Kernel:
    """F folds of a GEMM, operands resident in SBUF before the first LoadStationary.

    One DMA fills one tile ``[128, F·(C+M)]`` (fold f's stationary, then its moving tile), so
    every matmul finds its operands ready at the same instant and only TensorE sets the pace.
    ``store=True`` appends a PSUM->SBUF copy and a DMA to output ``out`` for a value check; the
    timing runs leave it off so the kernel ends with the last fold's result.
    """
    t = chip.config.core.tensor
    rows, cols = t.pe_rows, t.stationary_max_free
    width = folds * (cols + m)
    k = chip.kernel(f"ws_folds_F{folds}_M{m}")
    src = k.input("ops", (rows, width), "bf16")
    ops = k.sbuf((rows, width), "bf16", name="ops")
    k.dma_copy(ops, src)
    acc = k.psum((cols, m), "fp32", name="acc")
    for f in range(folds):
        base = f * (cols + m)
        k.nc_matmul(acc, ops[:, base:base + cols], ops[:, base + cols:base + cols + m], accumulate=f > 0)
    if store:
        res = k.sbuf((cols, m), "fp32", name="res")
        k.tensor_copy(res, acc)
        k.dma_copy(k.output("out", (cols, m), "fp32"), res)
    return k


def measure(chip: Chip, folds: int, m: int) -> int:
    """PE cycles from the first LoadStationary to the last fold's result visible in PSUM."""
    rep = chip.run(fold_kernel(chip, folds, m), timing_only=True).report
    loads = rep.segments("Tensor (LS)")
    if len(loads) != folds:
        raise RuntimeError(f"expected {folds} LoadStationary, the timeline has {len(loads)}")
    dma_end = max(end for lane, _, _, end, _ in rep.timeline if lane.startswith("q"))
    first = min(start for _, _, start, _, _ in loads)
    if first < dma_end:
        raise RuntimeError("a LoadStationary started before the operand DMA finished")
    span, rest = divmod(rep.total_ticks - first, chip.config.ticks_per_cycle("Tensor"))
    if rest:
        raise RuntimeError(f"interval of {rep.total_ticks - first} ticks is not whole PE cycles")
    return span


# ---- closed forms (they check the simulator; the simulator never uses them) ----------------
def pipelined_form(folds: int, m: int, r: int, c: int) -> int:
    """The textbook pipelined weight-stationary form, as given: every fold costs max(M, R)."""
    return r + folds * max(m, r) + (r + c - 2)


def scalesim_form(folds: int, m: int, r: int, c: int) -> int:
    """SCALE-Sim v3 weight stationary: load R, stream M, drain R+C-2 per fold, no overlap."""
    return folds * (2 * r + c + m - 2)


def ws_derived(folds: int, load: int, issue: int, drain: int, overlap: bool) -> int:
    """First-principles span of F folds with load time ``load`` and issue interval ``issue``.

    Overlapped, the next load starts when the current fold starts streaming, so folds start
    max(issue, load) apart; the last fold ends ``issue`` after its start and drains. Without
    overlap each fold loads, streams and drains alone.
    """
    if overlap:
        return load + (folds - 1) * max(issue, load) + issue + drain
    return folds * (load + issue + drain)


@dataclass(frozen=True)
class Array:
    """The PE array figures the forms need, read from a chip config."""

    rows: int
    cols: int
    load: int   # LoadStationary cycles of a full [128, C] stationary
    min_issue: int

    @classmethod
    def of(cls, chip: Chip) -> "Array":
        t = chip.config.core.tensor
        c = t.stationary_max_free
        return cls(t.pe_rows, t.pe_cols, -(-c // t.load_stationary_speedup), min(t.min_issue_cycles, c))

    @property
    def drain(self) -> int:
        return self.rows + self.cols - 2

    def derived(self, folds: int, m: int, overlap: bool) -> int:
        return ws_derived(folds, self.load, max(self.min_issue, m), self.drain, overlap)


def rel(a: float, b: float) -> float:
    return (a - b) / b


# ---- SCALE-Sim v3 ---------------------------------------------------------------------------
SCALESIM_CFG = """\
[general]
run_name = trnsim_ws

[architecture_presets]
ArrayHeight : {rows}
ArrayWidth : {cols}
IfmapSramSzkB : 65536
FilterSramSzkB : 65536
OfmapSramSzkB : 65536
IfmapOffset : 0
FilterOffset : 10000000
OfmapOffset : 20000000
Dataflow : ws
Bandwidth : 10
ReadRequestBuffer : 32
WriteRequestBuffer : 32

[layout]
IfmapCustomLayout : False
IfmapSRAMBankBandwidth : 10
IfmapSRAMBankNum : 10
IfmapSRAMBankPort : 2
FilterCustomLayout : False
FilterSRAMBankBandwidth : 10
FilterSRAMBankNum : 10
FilterSRAMBankPort : 2

[sparsity]
SparsitySupport : false
SparseRep : ellpack_block
OptimizedMapping : false
BlockSize : 8
RandomNumberGeneratorSeed : 40

[run_presets]
InterfaceBandwidth : CALC
UseRamulatorTrace : False
"""

#: run in a subprocess: argv = config, topology, layout, output dir
SCALESIM_RUN = ("import sys; from scalesim.scale_sim import scalesim; "
                "scalesim(save_disk_space=True, verbose=False, config=sys.argv[1], topology=sys.argv[2], "
                "layout=sys.argv[3], input_type_gemm=True).run_scale(top_path=sys.argv[4])")


def _pip(*args: str) -> str | None:
    """Run pip in this interpreter; None on success, else the last line of its output."""
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    if p.returncode == 0:
        return None
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1] if lines else f"pip exited {p.returncode}"


def scalesim_env() -> tuple[dict[str, str] | None, str]:
    """An environment in which SCALE-Sim 3.0.0 runs, or None and why not."""
    if importlib.util.find_spec("scalesim") is None:
        err = _pip("scalesim==3.0.0")
        if err or importlib.util.find_spec("scalesim") is None:
            return None, f"pip install scalesim==3.0.0 failed: {err}"
    env = dict(os.environ)
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 4):
        return env, f"scalesim 3.0.0, numpy {numpy.__version__}"
    private = Path(tempfile.gettempdir()) / "trnsim-scalesim-numpy"
    if not (private / "numpy").is_dir():
        err = _pip("--target", str(private), "numpy<2.4")
        if err:
            return None, f"SCALE-Sim 3.0.0 needs numpy<2.4 (SCALE-Sim#160) and installing it failed: {err}"
    env["PYTHONPATH"] = os.pathsep.join([str(private), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env, f"scalesim 3.0.0 in a subprocess with numpy<2.4 from {private} (numpy {numpy.__version__} crashes it)"


def run_scalesim(points: list[tuple[int, int]], arr: Array, env: dict[str, str]) -> dict[tuple[int, int], int]:
    """SCALE-Sim's "Total Cycles" for each (F, M), one process per GEMM (it holds ~10 KB per cycle)."""
    out: dict[tuple[int, int], int] = {}
    with tempfile.TemporaryDirectory(prefix="trnsim-scalesim-") as tmp:
        d = Path(tmp)
        cfg = d / "ws.cfg"
        cfg.write_text(SCALESIM_CFG.format(rows=arr.rows, cols=arr.cols))
        for folds, m in points:
            name = f"F{folds}_M{m}"
            topo, layout = d / f"{name}.csv", d / f"{name}_layout.csv"
            # GEMM M x N x K: M streamed rows, N = C filter columns, K = R·F (F row folds)
            topo.write_text(f"Layer, M, N, K,\n{name}, {m}, {arr.cols}, {arr.rows * folds},\n")
            layout.write_text(f"Layer,\n{name},\n")
            res = d / name
            p = subprocess.run([sys.executable, "-c", SCALESIM_RUN, str(cfg), str(topo), str(layout), str(res)],
                               env=env, capture_output=True, text=True)
            if p.returncode != 0:
                tail = (p.stderr or p.stdout).strip().splitlines()
                raise RuntimeError(f"SCALE-Sim failed on {name}: {tail[-1] if tail else p.returncode}")
            with open(res / "trnsim_ws" / "COMPUTE_REPORT.csv", newline="") as f:
                row = next(csv.DictReader(f, skipinitialspace=True))
            if int(row["Stall Cycles"]) != 0:
                raise RuntimeError(f"SCALE-Sim stalled on {name}: {row['Stall Cycles']} cycles")
            out[(folds, m)] = int(row["Total Cycles"])
    return out


# ---- tables ---------------------------------------------------------------------------------
def _row(cells: list[object], widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def pipelined_table(points: list[tuple[int, int]]) -> list[str]:
    """Table 1; returns the failures."""
    chip = Chip("trn2", FORM_ARRAY)
    arr = Array.of(chip)
    r, c = arr.rows, arr.cols
    print(f"1. Pipelined weight stationary, R=C={r}, overlap on, LoadStationary = R cycles "
          f"(load_stationary_speedup=1), bf16, tolerance {PIPELINED_TOL:.0%}")
    print("   form  = R + F*max(M,R) + (R+C-2);  form' = R + (F-1)*max(M,R) + M + (R+C-2) (last fold not padded to R)")
    w = [4, 4, 7, 7, 7, 9, 9, 6]
    print(_row(["F", "M", "form", "form'", "sim", "vs form", "vs form'", "check"], w))
    fails = []
    for folds, m in points:
        sim = measure(chip, folds, m)
        form, exact = pipelined_form(folds, m, r, c), arr.derived(folds, m, overlap=True)
        e_form, e_exact = rel(sim, form), rel(sim, exact)
        ok = abs(e_exact) <= PIPELINED_TOL and (m < r or abs(e_form) <= PIPELINED_TOL)
        note = "ok" if ok else "FAIL"
        if ok and abs(e_form) > PIPELINED_TOL:
            note = "ok*"
        print(_row([folds, m, form, exact, sim, _pct(e_form), _pct(e_exact), note], w))
        if not ok:
            fails.append(f"pipelined F={folds} M={m}: sim {sim} vs form {form} / form' {exact}")
    print("   ok* = M < R: the form pads the last fold to R cycles; checked against form'\n")
    return fails


def scalesim_table(points: list[tuple[int, int]], ss: dict[tuple[int, int], int] | None) -> list[str]:
    """Table 2; returns the failures."""
    chip = Chip("trn2", {**FORM_ARRAY, **NO_OVERLAP})
    fast = Chip("trn2", {**NO_RAMP, **NO_OVERLAP})
    arr, farr = Array.of(chip), Array.of(fast)
    print(f"2. SCALE-Sim v3 weight stationary, overlap off, LoadStationary = R cycles, tolerance {SCALESIM_TOL:.0%}")
    print(f"   form = F*(2R+C+M-2); SCALE-Sim prints form-1 (last cycle index from 0). Last column: "
          f"shipped fast LoadStationary ({farr.load} cycles), not checked")
    w = [4, 4, 7, 7, 9, 9, 9, 6, 12]
    print(_row(["F", "M", "form", "sim", "vs form", "SCALE-Sim", "vs SS", "check", "fastLS vs f"], w))
    fails = []
    for folds, m in points:
        sim = measure(chip, folds, m)
        form = scalesim_form(folds, m, arr.rows, arr.cols)
        e = rel(sim, form)
        ok = abs(e) <= SCALESIM_TOL
        ss_cells: list[object] = ["-", "-"]
        if ss is not None:
            e_ss = rel(sim, ss[(folds, m)])
            ss_cells = [ss[(folds, m)], _pct(e_ss)]
            ok = ok and abs(e_ss) <= SCALESIM_TOL
        fast_sim = measure(fast, folds, m)
        print(_row([folds, m, form, sim, _pct(e), *ss_cells, "ok" if ok else "FAIL", _pct(rel(fast_sim, form))], w))
        if not ok:
            fails.append(f"scalesim F={folds} M={m}: sim {sim} vs form {form}"
                         + (f" / SCALE-Sim {ss[(folds, m)]}" if ss else ""))
    print()
    return fails


def shipped_table(points: list[tuple[int, int]]) -> list[str]:
    """Table 3 (trn2 as shipped, ramp off); returns the failures."""
    chip = Chip("trn2", NO_RAMP)
    arr = Array.of(chip)
    print(f"3. trn2 as shipped (fast LoadStationary L={arr.load} cycles, issue I=max({arr.min_issue},M), overlap on), "
          f"tolerance {PIPELINED_TOL:.0%} against the derivation")
    print("   derived = L + (F-1)*max(I,L) + I + (R+C-2); 'vs form' is how far Trainium is from the R-cycle-load form")
    w = [4, 4, 7, 8, 7, 9, 9, 6]
    print(_row(["F", "M", "form", "derived", "sim", "vs form", "vs deriv", "check"], w))
    fails = []
    for folds, m in points:
        sim = measure(chip, folds, m)
        form, der = pipelined_form(folds, m, arr.rows, arr.cols), arr.derived(folds, m, overlap=True)
        ok = abs(rel(sim, der)) <= PIPELINED_TOL
        print(_row([folds, m, form, der, sim, _pct(rel(sim, form)), _pct(rel(sim, der)), "ok" if ok else "FAIL"], w))
        if not ok:
            fails.append(f"shipped F={folds} M={m}: sim {sim} vs derived {der}")
    print()
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"F in {QUICK_FOLDS}, M in {QUICK_MOVING}")
    ap.add_argument("--scalesim", action="store_true", help="also run SCALE-Sim v3.0.0 on the same folds")
    args = ap.parse_args()
    folds, moving = (QUICK_FOLDS, QUICK_MOVING) if args.quick else (FOLDS, MOVING)
    points = [(f, m) for f in folds for m in moving]
    print("Interval: first LoadStationary start -> last fold's result visible in PSUM, TensorE cycles; "
          "trn2, bf16, power ramp off\n")
    ss = None
    if args.scalesim:
        env, how = scalesim_env()
        if env is None:
            print(f"SCALE-Sim not run: {how}\n")
        else:
            try:
                ss = run_scalesim(points, Array.of(Chip("trn2", FORM_ARRAY)), env)
                print(f"SCALE-Sim: {how}\n")
            except (RuntimeError, OSError, KeyError, ValueError, StopIteration) as exc:
                print(f"SCALE-Sim not run: {exc}\n")
    fails = pipelined_table(points) + scalesim_table(points, ss) + shipped_table(points)
    if fails:
        print("MISSED:\n  " + "\n  ".join(fails))
        return 1
    print("all checked tolerances met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
