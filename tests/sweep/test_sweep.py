"""`trnsim sweep`: the spec is checked whole before anything runs, each point lands in the CSV
as it finishes, a rerun resumes, and the figures are those of a direct run."""

import csv
import textwrap
from pathlib import Path

import pytest

from trnsim.chip import Chip
from trnsim.cli import main
from trnsim.config import load_config
from trnsim.kernels import get_kernel
from trnsim.sweep import load_spec, run_sweep

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "sweeps" / "sbuf_and_clock.yaml"

# A user kernel file: its whole [128, cols] fp32 tile must fit one SBUF partition.
COPY = '''
import trnsim

def build_copy(rows, cols, config="trn2"):
    k = trnsim.Kernel("copy", config)
    x, y = k.input("x", (rows, cols), "fp32"), k.output("y", (rows, cols), "fp32")
    t = k.sbuf((rows, cols), "fp32")
    k.dma_copy(t, x)
    k.dma_copy(y, t)
    return k
'''


def write_spec(tmp_path, text):
    (tmp_path / "copy_kernel.py").write_text(COPY)
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(text))
    return spec


SMALL = """\
    config: trn2
    grid:
      core.sbuf.partition_bytes: [16KiB, 224KiB]
      core.tensor.clock: [2.4GHz, 3GHz]
    kernels:
      - name: matmul
        shape: 128x256x512
      - name: copy_kernel.py:build_copy
        shapes: [128x1024, 128x8192]
"""


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_example_spec_runs_on_a_process_pool(tmp_path, capsys):
    out = tmp_path / "r.csv"
    assert main(["sweep", str(EXAMPLE), "--out", str(out), "--jobs", "2"]) == 0
    text, err = capsys.readouterr()
    rows = read_csv(out)
    spec = load_spec(EXAMPLE, out)
    assert len(rows) == len(spec.points) == 24 and err == ""
    assert list(rows[0]) == spec.columns
    assert all(r["error"] == "" and float(r["cycles"]) > 0 for r in rows)
    assert "24 points run, 0 from a previous run" in text
    assert main(["sweep", str(EXAMPLE), "--out", str(out)]) == 0
    assert "0 points run, 24 from a previous run" in capsys.readouterr()[0]
    assert len(read_csv(out)) == 24


def test_rows_match_a_direct_run_and_a_rerun_resumes(tmp_path):
    spec = load_spec(write_spec(tmp_path, SMALL))
    assert spec.out == tmp_path / "spec.csv" and len(spec.points) == 12
    seen = []
    first = run_sweep(spec, jobs=1, progress=lambda done, total: seen.append((done, total)))
    rows = first.rows
    assert first.ran == 12
    assert seen[0] == (0, 12) and seen[-1] == (12, 12)
    cfg = load_config("trn2", {"core.sbuf.partition_bytes": "224KiB", "core.tensor.clock": "3GHz"})
    rep = Chip(cfg).run(get_kernel("matmul").make((128, 256, 512), "bf16", cfg), timing_only=True).report
    (row,) = [r for r in rows if r["kernel"] == "matmul" and r["core.sbuf.partition_bytes"] == "224KiB"
              and r["core.tensor.clock"] == "3GHz"]
    assert float(row["cycles"]) == round(rep.total_cycles, 1) and row["dtype"] == "bf16"
    assert float(row["tensor_active_percent"]) == round(rep.engines["Tensor"].active_percent, 2)
    # a variant that cannot build a point records why instead of stopping the sweep
    (bad,) = [r for r in rows if r["shape"] == "128x8192" and r["core.sbuf.partition_bytes"] == "16KiB"
              and r["core.tensor.clock"] == "3GHz"]
    assert bad["cycles"] == "" and "SBUF" in bad["error"]
    # drop the last three rows as if the run had been killed: a rerun runs exactly those
    lines = spec.out.read_text().splitlines(keepends=True)
    spec.out.write_text("".join(lines[:-3]))
    seen.clear()
    again = run_sweep(spec, jobs=1, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(9, 12), (10, 12), (11, 12), (12, 12)]
    assert again.rows == rows and again.ran == 3
    assert len(read_csv(spec.out)) == 12


def test_a_csv_from_another_spec_is_refused(tmp_path, capsys):
    spec = write_spec(tmp_path, SMALL)
    (tmp_path / "spec.csv").write_text("kernel,shape\nmatmul,1x1x1\n")
    assert main(["sweep", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trnsim: error: {tmp_path / 'spec.csv'}: its columns (kernel, shape) are not this spec's")
    assert err.endswith("; delete it or choose another --out\n")


@pytest.mark.parametrize("text,message", [
    ("config: trn2\ngrids: {}\nkernels: [{name: matmul}]\n",
     "spec.yaml: unknown key 'grids'; expected config, system, grid, kernels, collectives, estimates, out"),
    # a config or system the spec names is named with the spec and its key (the fuzz harness's
    # long run, seed 125: 'unknown config' alone did not say which file gave it)
    ("config: trn9\nkernels: [{name: matmul}]\n", "spec.yaml: config: unknown config 'trn9': expected one of trn1, "
                                                  "trn2, trn3 or a path to a .yaml file"),
    ("config: trn2\n  core.tensor\n", "spec.yaml: config: unknown config 'trn2 core.tensor'"),
    ("config: mine.yaml\nkernels: [{name: matmul}]\n", "spec.yaml: config: "),
    ("system: trn9\ncollectives: [{op: all-reduce, bytes: 1MiB}]\n",
     "spec.yaml: system: unknown system 'trn9': expected one of "),
    ("grid: {core.sbuf.bytez: [1KiB]}\nkernels: [{name: matmul}]\n", "spec.yaml: grid: "),
    ("grid: {core.sbuf.partition_bytes: [224KiB, lots]}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid: trn2.yaml (--set core.sbuf.partition_bytes=lots): core.sbuf.partition_bytes = 'lots': "
     "expected a bytes quantity like '224KiB'"),
    ("grid: {core.tensor.clock: []}\nkernels: [{name: matmul}]\n",
     "spec.yaml: grid.core.tensor.clock: expected a non-empty list"),
    ("kernels: []\n", "spec.yaml: kernels: expected a non-empty list of {name, shape(s), dtype(s), params}"),
    ("kernels: [{name: nope}]\n", "spec.yaml: kernels[0] (nope): unknown kernel 'nope'; expected one of "),
    ("kernels: [{name: matmul, shape: 128x128}]\n",
     "spec.yaml: kernels[0] (matmul): kernel 'matmul': --shape needs 3 dims MxKxN, got 128x128"),
    ("kernels: [{name: matmul, shape: 128x128x512, dtypes: [bf16, int8]}]\n",
     "spec.yaml: kernels[0] (matmul): kernel 'matmul': dtype int8 not supported; expected one of "),
    ("kernels: [{name: matmul, shape: 128x128x512, params: {bufs: 2}}]\n",
     "spec.yaml: kernels[0] (matmul): kernel 'matmul': unknown parameter 'bufs'; it takes: "),
    ("kernels: [{name: matmul, shape: 128x128x512, shapes: [128x128x512]}]\n",
     "spec.yaml: kernels[0]: give 'shape' or 'shapes', not both"),
    ("kernels: [{name: matmul, size: 1}]\n",
     "spec.yaml: kernels[0]: unknown key 'size'; expected name, shape, shapes, dtype, dtypes, params"),
    ("kernels: [{name: copy_kernel.py:build_copy}]\n",
     "spec.yaml: kernels[0] (copy_kernel.py:build_copy): a file kernel needs 'shape' or 'shapes'"),
    ("kernels: [{name: copy_kernel.py:build_copy, shape: 128x262144}]\n",
     "spec.yaml: kernels[0] (copy_kernel.py:build_copy): SBUF tile "),
    ("kernels: [{name: matmul}\n", "spec.yaml: line "),
    ("kernels: [{name: matmul, shape: 128x128x512}, {name: matmul, shapes: [128x128x512], dtype: bf16}]\n",
     "spec.yaml: kernels: matmul 128x128x512 bf16 is listed twice\n"),
])
def test_bad_specs_fail_before_running_with_one_line(tmp_path, capsys, text, message):
    spec = write_spec(tmp_path, text)
    assert main(["sweep", str(spec)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("trnsim: error: " + message) and err.count("\n") == 1, err
    assert not (tmp_path / "spec.csv").exists()


def test_missing_spec_and_bad_jobs(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err == f"trnsim: error: sweep spec '{tmp_path / 'none.yaml'}' not found\n"
    spec = write_spec(tmp_path, SMALL)
    assert main(["sweep", str(spec), "--jobs", "0"]) == 2
    assert capsys.readouterr().err == "trnsim: error: --jobs 0: expected a positive number of worker processes\n"
    with pytest.raises(SystemExit) as e:
        main(["sweep", str(spec), "--jobs", "two"])
    assert e.value.code == 2


def test_a_pool_started_beside_other_threads_starts_its_workers_from_a_forkserver(tmp_path):
    """A forked worker inherits the locks other threads hold at the fork (Ray's driver threads after
    a Ray sweep in the same process hung a forked child on one): beside other threads the local pool
    uses forkserver, and its rows are those of a run in this process."""
    import threading

    from trnsim.sweep import _pool_context

    spec = load_spec(write_spec(tmp_path, SMALL))
    direct = run_sweep(spec, jobs=1).rows
    spec.out.unlink()
    gate = threading.Event()
    other = threading.Thread(target=gate.wait)
    other.start()
    try:
        assert _pool_context().get_start_method() == "forkserver"
        pooled = run_sweep(load_spec(tmp_path / "spec.yaml"), jobs=2)
    finally:
        gate.set()
        other.join()
    assert pooled.ran == 12 and pooled.rows == direct
