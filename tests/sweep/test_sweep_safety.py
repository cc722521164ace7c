"""Sweep results that cannot be corrupted: a torn last row is dropped and rerun, a second sweep on
the same CSV is refused, pool workers die with a SIGKILLed parent, Ctrl-C stops cleanly with a
one-line summary, a dead worker is one line; and specs are bounded (point limit, duplicate or
structured grid values refused)."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from trnsim.cli import main
from trnsim.config import ConfigError
from trnsim.sweep import load_spec, run_sweep

ROOT = Path(__file__).resolve().parents[2]

# A user kernel: one [128, cols] fp32 copy; TRNSIM_TEST_SLOW seconds of sleep per build (so a
# subprocess sweep is caught mid-run); TRNSIM_TEST_DIE kills the worker process that builds it.
KERNEL = '''
import multiprocessing, os, signal, time
import trnsim

def build(rows, cols, config="trn2"):
    if os.environ.get("TRNSIM_TEST_DIE") and multiprocessing.parent_process() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("TRNSIM_TEST_SLOW", "0")))
    k = trnsim.Kernel("copy", config)
    x, y = k.input("x", (rows, cols), "fp32"), k.output("y", (rows, cols), "fp32")
    t = k.sbuf((rows, cols), "fp32")
    k.dma_copy(t, x)
    k.dma_copy(y, t)
    return k
'''


def write_spec(tmp_path, clocks=6, extra=""):
    (tmp_path / "copy.py").write_text(KERNEL)
    spec = tmp_path / "spec.yaml"
    values = ", ".join(f"{1 + i}GHz" for i in range(clocks))
    spec.write_text(f"grid:\n  core.tensor.clock: [{values}]\nkernels:\n  - {{name: copy.py:build, shape: 128x64}}\n"
                    f"{extra}")
    return spec


def rows_of(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def start(spec, *args, method=None, **env):
    """``trnsim sweep spec args`` in a subprocess; ``method``: the multiprocessing start method."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    code = (f"import multiprocessing, sys; multiprocessing.set_start_method({method!r}); " if method else
            "import sys; ") + "from trnsim.cli import main; sys.exit(main(sys.argv[1:]))"
    # Ctrl-C as a terminal delivers it: a suite started in the background of a non-interactive
    # shell ignores SIGINT, and a child would inherit that
    return subprocess.Popen([sys.executable, "-c", code, "sweep", str(spec), *args], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def descendants(pid):
    kids = children(pid)
    return kids + [d for k in kids for d in descendants(k)]


def wait_for(cond, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid):
    """Live (not zombie) child processes of ``pid``, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def alive(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def data_lines(path):
    return max(0, path.read_bytes().count(b"\n") - 1) if path.exists() else 0


# ---- torn tails and damaged files -------------------------------------------------------------


@pytest.mark.parametrize("cut", ["half a row", "a row without its newline", "half the header"])
def test_a_torn_last_row_is_dropped_and_rerun(tmp_path, capsys, cut):
    spec_path = write_spec(tmp_path)
    spec = load_spec(spec_path)
    full = run_sweep(spec, jobs=1)
    text = spec.out.read_bytes()
    lines = text.splitlines(keepends=True)
    if cut == "half a row":  # a kill or a full disk mid-write
        torn = b"".join(lines[:4]) + lines[4][: len(lines[4]) // 2]
    elif cut == "a row without its newline":
        torn = b"".join(lines[:4]) + lines[4][:-1]
    else:
        torn = lines[0][:20]
    spec.out.write_bytes(torn)
    assert main(["sweep", str(spec_path), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    kept = 0 if cut == "half the header" else 3
    assert f"{6 - kept} points run, {kept} from a previous run" in out
    assert "\nA torn last row (from a killed run) was dropped and its point run again.\n" in out
    again = rows_of(spec.out)
    assert len(again) == 6 and sorted(map(str, again)) == sorted(map(str, full.rows))
    assert spec.out.read_bytes().endswith(b"\n") and spec.out.read_bytes().count(b"\n") == 7


def test_a_damaged_row_inside_the_file_is_refused_naming_its_line(tmp_path, capsys):
    spec_path = write_spec(tmp_path)
    spec = load_spec(spec_path)
    run_sweep(spec, jobs=1)
    lines = spec.out.read_text().splitlines(keepends=True)
    lines[2] = "1GHz,copy.py:build\n"
    spec.out.write_text("".join(lines))
    before = spec.out.read_bytes()
    assert main(["sweep", str(spec_path)]) == 2
    n = len(spec.columns)
    assert capsys.readouterr().err == (f"trnsim: error: {spec.out} line 3: 2 cells, expected {n}; the file is damaged: "
                                       f"delete that line to rerun its point, or choose another --out\n")
    assert spec.out.read_bytes() == before
    spec.out.write_bytes(b"\xff\xfe\x00garbage\n")
    assert main(["sweep", str(spec_path)]) == 2
    assert capsys.readouterr().err.startswith(f"trnsim: error: {spec.out}: byte 1 is not UTF-8 text")


def test_error_cells_stay_on_one_line(tmp_path):
    (tmp_path / "copy.py").write_text(KERNEL + "\ndef bad(rows, cols, config='trn2'):\n"
                                               "    if config.core.tensor.clock > 2.5e9:\n"
                                               "        raise ValueError('line one\\nline two')\n"
                                               "    return build(rows, cols, config)\n")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text("grid: {core.tensor.clock: [1GHz, 3GHz]}\nkernels: [{name: copy.py:bad, shape: 128x64}]\n")
    spec = load_spec(spec_path)
    rows = run_sweep(spec, jobs=1).rows
    assert rows[1]["error"] == "kernel 'copy.py:bad': bad raised ValueError: line one\\nline two"
    assert spec.out.read_bytes().count(b"\n") == 3


# ---- concurrency and signals -------------------------------------------------------------------


def test_a_second_sweep_on_the_same_results_is_refused_and_the_first_finishes(tmp_path, capsys):
    spec = write_spec(tmp_path)
    first = start(spec, "--jobs", "1", TRNSIM_TEST_SLOW="0.3")
    try:
        wait_for(lambda: data_lines(tmp_path / "spec.csv") >= 1, what="the first sweep's first row")
        assert main(["sweep", str(spec), "--jobs", "1"]) == 2
        assert capsys.readouterr().err == (f"trnsim: error: sweep results {tmp_path / 'spec.csv'}: another trnsim "
                                           f"sweep is writing it; wait for it to finish or choose another file\n")
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err
    rows = rows_of(tmp_path / "spec.csv")
    assert len(rows) == 6 and len({r["core.tensor.clock"] for r in rows}) == 6


@pytest.mark.parametrize("method", ["fork", "forkserver"])  # Linux's default before Python 3.14, and after
def test_workers_die_with_a_sigkilled_parent(tmp_path, method):
    spec = write_spec(tmp_path, clocks=8)
    proc = start(spec, "--jobs", "2", method=method, TRNSIM_TEST_SLOW="1")
    try:
        # forkserver: the server and the resource tracker are children, the workers grandchildren
        workers = wait_for(lambda: len(descendants(proc.pid)) >= (2 if method == "fork" else 4)
                           and descendants(proc.pid), what="the pool's processes")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not any(alive(w) for w in workers), timeout=30, what="the orphaned workers to exit")
    finally:
        proc.kill()
    # nothing holds the results file any more: a rerun resumes and completes it
    assert main(["sweep", str(spec), "--jobs", "1"]) == 0
    assert len(rows_of(tmp_path / "spec.csv")) == 8


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_stops_with_a_one_line_summary_and_a_rerun_resumes(tmp_path, capsys, jobs):
    spec = write_spec(tmp_path)
    proc = start(spec, "--jobs", jobs, TRNSIM_TEST_SLOW="1")
    try:
        wait_for(lambda: data_lines(tmp_path / "spec.csv") >= 1, what="a first row")
        workers = children(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    m = re.fullmatch(rf"trnsim: sweep interrupted: (\d) of 6 points are in {re.escape(str(tmp_path / 'spec.csv'))} "
                     rf"\((\d) run now\); run the same command again to resume\n", err)
    assert m and m.group(1) == m.group(2), err
    kept = int(m.group(1))
    assert 1 <= kept < 6 and data_lines(tmp_path / "spec.csv") == kept
    wait_for(lambda: not any(alive(w) for w in workers), timeout=30, what="the workers to exit")
    assert main(["sweep", str(spec), "--jobs", "1"]) == 0
    assert f"{6 - kept} points run, {kept} from a previous run" in capsys.readouterr().out
    assert len(rows_of(tmp_path / "spec.csv")) == 6


def test_a_worker_that_dies_stops_the_sweep_with_one_line(tmp_path):
    spec = write_spec(tmp_path)
    proc = start(spec, "--jobs", "2", TRNSIM_TEST_DIE="1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and out == ""
    assert re.fullmatch(r"trnsim: sweep stopped: a worker process died \(out of memory, or killed\): 0 of 6 points are "
                        r"in .*spec\.csv \(0 run now\); run the same command again to resume\n", err), err


# ---- bounded specs --------------------------------------------------------------------------------


def test_the_point_count_is_limited_before_anything_is_listed(tmp_path, capsys):
    # like the 727-byte spec (64M variants: 8 GB and silence before this limit)
    axes = ["core.tensor.clock", "core.vector.clock", "core.scalar.clock", "core.gpsimd.clock", "core.sync.clock",
            "core.tensor.min_issue_cycles", "core.vector.min_ii_cycles", "core.scalar.min_ii_cycles"]
    lines = [f"  {a}: [{', '.join(str(v) + ('GHz' if 'clock' in a else '') for v in range(1, 10))}]" for a in axes]
    spec = tmp_path / "big.yaml"
    spec.write_text("grid:\n" + "\n".join(lines) + "\nkernels: [{name: matmul, shape: 128x128x128}]\n")
    tracemalloc.start()
    try:
        assert main(["sweep", str(spec)]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert capsys.readouterr().err == ("trnsim: error: big.yaml: 43,046,721 chip variants x 1 kernel points = "
                                       "43,046,721 points, more than the limit of 10,000; check the grid, or pass "
                                       "--max-points 43046721 to run them all\n")
    assert peak < 32 * 2**20
    small = write_spec(tmp_path, clocks=6)
    assert main(["sweep", str(small), "--max-points", "5"]) == 2
    assert "6 points, more than the limit of 5; check the grid, or pass --max-points 6" in capsys.readouterr().err
    assert main(["sweep", str(small), "--max-points", "6", "--jobs", "1"]) == 0
    assert main(["sweep", str(small), "--max-points", "0"]) == 2
    assert capsys.readouterr().err.endswith("trnsim: error: --max-points 0: expected a positive number of points\n")


@pytest.mark.parametrize("text,message", [
    ("grid: {core.tensor.clock: [2.4GHz, 3GHz, 2.4GHz]}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid.core.tensor.clock: 2.4GHz is listed twice"),
    ("grid: {core.tensor.clock: [2.4GHz, 2400MHz]}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid: core.tensor.clock=2400MHz is the same config as core.tensor.clock=2.4GHz; list each value once"),
    ("grid: {core.tensor.clock: [2.4GHz, 2.8GHz], core.sbuf.partition_bytes: [192KiB, 196608B]}\n"
     "kernels: [{name: matmul}]\n",
     "spec.yaml: grid: core.tensor.clock=2.4GHz, core.sbuf.partition_bytes=196608B is the same config as "
     "core.tensor.clock=2.4GHz, core.sbuf.partition_bytes=192KiB; list each value once"),
    ("grid: {core.tensor.clock: [2.4GHz, null]}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid.core.tensor.clock: expected a value, got None"),
    ("grid: {core.tensor.clock: [{a: 1}]}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid.core.tensor.clock: expected a value, got {'a': 1}"),
    ("kernels: [{name: matmul, shapes: [128x128x128, 128x128x128]}]\n",
     "spec.yaml: kernels[0] (matmul): shape: 128x128x128 is listed twice"),
    ("kernels: [{name: matmul, shape: 128x128x128, dtypes: [bf16, bf16]}]\n",
     "spec.yaml: kernels[0] (matmul): dtype: bf16 is listed twice"),
    ("kernels: [{name: copy.py:boom, shape: 128x64}]\n",
     "spec.yaml: kernels[0] (copy.py:boom): kernel 'copy.py:boom': boom raised RuntimeError: no"),
])
def test_bad_grids_and_kernel_lists_are_refused(tmp_path, capsys, text, message):
    (tmp_path / "copy.py").write_text(KERNEL + "\ndef boom(rows, cols, config=None):\n    raise RuntimeError('no')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    assert main(["sweep", str(spec)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"trnsim: error: {message}\n"
    assert not (tmp_path / "spec.csv").exists()


def test_jobs_beyond_the_machine_are_refused(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    cpus = os.cpu_count() or 1
    with pytest.raises(ConfigError, match=rf"^--jobs 100000: expected a positive number of worker processes, at most "
                                          rf"{max(8, 4 * cpus)} on this machine \({cpus} CPUs\)$"):
        run_sweep(spec, jobs=100_000)
    assert not spec.out.exists()


@pytest.mark.parametrize("argv,extra,message", [
    (["--out", "res.xlsx"], "", "--out res.xlsx: expected a results file ending in .csv, .parquet or .pq (CSV or "
                                "Parquet), got '.xlsx'"),
    (["--out", "results"], "", "--out results: expected a results file ending in .csv, .parquet or .pq (CSV or "
                               "Parquet), got no suffix"),
    ([], "out: r.XLSX\n", "spec.yaml: out: r.XLSX: expected a results file ending in .csv, .parquet or .pq (CSV or "
                          "Parquet), got '.XLSX'"),
])
def test_a_results_name_that_is_neither_csv_nor_parquet_is_refused(tmp_path, capsys, monkeypatch, argv, extra, message):
    """Issue 25: ``--out res.xlsx`` wrote CSV text into an .xlsx."""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, clocks=1, extra=extra)
    assert main(["sweep", str(spec), "--jobs", "1", *argv]) == 2
    assert capsys.readouterr() == ("", f"trnsim: error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.py", "spec.yaml"]
