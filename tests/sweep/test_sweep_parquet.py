"""Sweeps into Parquet (`out: results.parquet`) keep the CSV's guarantees: the same rows (typed),
each finished row kept at once (in the journal beside the file), resume after a kill or Ctrl-C,
a torn journal row dropped and rerun, a second sweep refused, foreign files refused, and a
one-line error without pyarrow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import trnsim.sweep as sweep_mod
from test_sweep_safety import data_lines, rows_of, start, wait_for, write_spec
from trnsim.cli import main
from trnsim.config import ConfigError
from trnsim.sweep import SweepStopped, load_spec, run_sweep

pq = pytest.importorskip("pyarrow.parquet")


def parquet_rows(path):
    return [{k: "" if v is None else str(v) for k, v in r.items()} for r in pq.read_table(path).to_pylist()]


def journal(tmp_path, name="r.parquet"):
    return tmp_path / f".{name}.journal"


def test_parquet_rows_equal_the_csv_rows_and_are_typed(tmp_path):
    spec_path = write_spec(tmp_path, clocks=3)
    csv_result = run_sweep(load_spec(spec_path, tmp_path / "r.csv"), jobs=1)
    result = run_sweep(load_spec(spec_path, tmp_path / "r.parquet"), jobs=2)
    assert result.rows == csv_result.rows and result.ran == 3
    assert parquet_rows(tmp_path / "r.parquet") == rows_of(tmp_path / "r.csv")
    schema = pq.read_schema(tmp_path / "r.parquet")
    types = {f.name: str(f.type) for f in schema}
    assert (types["core.tensor.clock"], types["kernel"], types["cycles"], types["instructions"], types["bound"]) == \
        ("string", "string", "double", "int64", "string")
    assert schema.field("us").metadata[b"unit"] == b"us"
    assert not journal(tmp_path).exists()  # the journal goes when the sweep ends
    again = run_sweep(load_spec(spec_path, tmp_path / "r.parquet"), jobs=1)
    assert again.ran == 0 and again.rows == result.rows


def test_ctrl_c_keeps_every_finished_row_in_the_parquet_file(tmp_path, monkeypatch):
    spec = load_spec(write_spec(tmp_path, clocks=5), tmp_path / "r.parquet")
    monkeypatch.setattr(sweep_mod, "PARQUET_FLUSH_SECONDS", 1e9)  # no rewrite while it runs: only at the stop

    def progress(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(SweepStopped) as e:
        run_sweep(spec, jobs=1, progress=progress)
    assert e.value.interrupted and "3 of 5 points are in" in str(e.value)
    assert len(parquet_rows(tmp_path / "r.parquet")) == 3
    assert data_lines(journal(tmp_path)) == 0  # emptied: its rows are in the Parquet file now
    result = run_sweep(spec, jobs=1)
    assert result.ran == 2 and len(parquet_rows(tmp_path / "r.parquet")) == 5 and not journal(tmp_path).exists()


def test_a_killed_parquet_sweep_resumes_from_its_journal(tmp_path, capsys):
    spec = write_spec(tmp_path, extra="out: r.parquet\n")
    proc = start(spec, "--jobs", "1", TRNSIM_TEST_SLOW="0.4")
    try:
        wait_for(lambda: data_lines(journal(tmp_path)) >= 2, what="two rows in the journal")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    kept = data_lines(journal(tmp_path))
    assert 2 <= kept < 6
    assert main(["sweep", str(spec), "--jobs", "1"]) == 0
    assert f"{6 - kept} points run, {kept} from a previous run; results in {tmp_path / 'r.parquet'}" in \
        capsys.readouterr().out
    rows = parquet_rows(tmp_path / "r.parquet")
    assert len(rows) == 6 and len({r["core.tensor.clock"] for r in rows}) == 6
    assert not journal(tmp_path).exists()


def test_a_torn_journal_row_is_dropped_and_rerun(tmp_path):
    spec = load_spec(write_spec(tmp_path, clocks=3), tmp_path / "r.parquet")
    full = run_sweep(spec, jobs=1)
    csv_spec = load_spec(spec.path, tmp_path / "j.csv")
    run_sweep(csv_spec, jobs=1)
    lines = (tmp_path / "j.csv").read_bytes().splitlines(keepends=True)
    os.unlink(tmp_path / "r.parquet")
    journal(tmp_path).write_bytes(b"".join(lines[:3]) + lines[3][:10])  # 2 rows whole, the third torn
    result = run_sweep(spec, jobs=1)
    assert result.torn and result.ran == 1 and result.rows == full.rows


def test_a_second_sweep_on_the_same_parquet_file_is_refused(tmp_path, capsys):
    spec = write_spec(tmp_path, extra="out: r.parquet\n")
    first = start(spec, "--jobs", "1", TRNSIM_TEST_SLOW="0.3")
    try:
        wait_for(lambda: data_lines(journal(tmp_path)) >= 1, what="the first sweep's first row")
        assert main(["sweep", str(spec), "--jobs", "1"]) == 2
        assert capsys.readouterr().err == (f"trnsim: error: sweep results {tmp_path / 'r.parquet'}: another trnsim "
                                           f"sweep is writing it; wait for it to finish or choose another file\n")
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert len(parquet_rows(tmp_path / "r.parquet")) == 6


def test_foreign_parquet_files_are_refused(tmp_path):
    spec = load_spec(write_spec(tmp_path, clocks=2), tmp_path / "r.parquet")
    (tmp_path / "r.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"r\.parquet: not a readable Parquet file \("):
        run_sweep(spec, jobs=1)
    other = load_spec(write_spec(tmp_path, clocks=2, extra=""), tmp_path / "o.parquet")
    run_sweep(other, jobs=1)
    os.replace(tmp_path / "o.parquet", tmp_path / "r.parquet")
    pq.write_table(pq.read_table(tmp_path / "r.parquet").drop_columns(["bound"]), tmp_path / "r.parquet")
    with pytest.raises(ConfigError, match=r"r\.parquet: its columns \(.*\) are not this spec's \(.*\); delete it or "
                                          r"choose another --out$"):
        run_sweep(spec, jobs=1)


def test_without_pyarrow_a_parquet_sweep_is_refused_before_it_starts(tmp_path):
    spec = write_spec(tmp_path, clocks=2, extra="out: r.parquet\n")
    block = ("import sys\nsys.modules['pyarrow'] = sys.modules['pyarrow.parquet'] = None\n"
             "from trnsim.cli import main\nraise SystemExit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", block, "sweep", str(spec)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"trnsim: error: sweep results {tmp_path / 'r.parquet'} needs pyarrow (the 'metrics' extra), "
                          f"which is not installed: python3 -m pip install -e '.[metrics]'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.py", "spec.yaml"]
