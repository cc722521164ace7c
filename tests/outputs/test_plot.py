"""Plots: `trnsim plot` over CSV and Parquet sweep results, `trnsim kernel --plot`, a run's
per-op plot - the files exist, are images of sane sizes, carry titles and unit labels - and the
one-line errors (no matplotlib, a missing column, an unknown format)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trnsim import Chip, load_config
from trnsim.cli import main
from trnsim.device import Device, KernelSpec
from trnsim.kernels import get_kernel
from trnsim.sweep import load_spec, run_sweep

ROOT = Path(__file__).resolve().parents[2]
CFG = load_config("trn2")

mpl = pytest.importorskip("matplotlib")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    spec = d / "spec.yaml"
    spec.write_text("config: trn2\ngrid:\n  core.tensor.clock: [2.0GHz, 2.4GHz, 2.8GHz]\n"
                    "  core.sbuf.partition_bytes: [128KiB, 224KiB]\n"
                    "kernels:\n  - {name: matmul, shapes: [256x512x512, 512x512x1024], dtype: bf16}\n"
                    "  - {name: rmsnorm, shape: 256x1024}\n")
    run_sweep(load_spec(spec, d / "r.csv"), jobs=1)
    return d / "r.csv"


def _figure_texts(monkeypatch):
    """Capture the titles and axis labels of the next saved figure."""
    from matplotlib.figure import Figure

    seen: dict[str, list[str]] = {}
    original = Figure.savefig

    def savefig(self, *a, **k):
        texts = [self.get_suptitle()] if self.get_suptitle() else []
        for ax in self.axes:
            texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        seen["texts"] = [t for t in texts if t]
        return original(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def test_plot_a_sweep_from_csv_with_units(results, tmp_path, monkeypatch, capsys):
    seen = _figure_texts(monkeypatch)
    out = tmp_path / "clock.png"
    assert main(["plot", str(results), "--x", "core.tensor.clock", "--y", "us", "--hue", "kernel", "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"Plot written to {out}\n"
    w, h = png_size(out)
    assert (w, h) == (1500, 825) and out.stat().st_size > 20_000
    assert seen["texts"] == ["us vs core.tensor.clock by kernel (r.csv, 18 points)", "core.tensor.clock (GHz)",
                             "kernel time (us)"]


def test_plot_a_parquet_sweep_with_categorical_x_and_filters(results, tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    spec = results.parent / "spec.yaml"
    run_sweep(load_spec(spec, tmp_path / "r.parquet"), jobs=1)
    seen = _figure_texts(monkeypatch)
    out = tmp_path / "mfu.svg"
    assert main(["plot", str(tmp_path / "r.parquet"), "--x", "shape", "--y", "mfu_percent", "--hue",
                 "core.sbuf.partition_bytes", "--where", "kernel=matmul", "-o", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml") and out.stat().st_size > 10_000
    assert seen["texts"][1:] == ["shape", "MFU (% of the bf16 peak)"]
    assert main(["plot", str(tmp_path / "r.parquet"), "--x", "core.sbuf.partition_bytes", "--y", "cycles",
                 "-o", str(tmp_path / "b.png")]) == 0
    assert seen["texts"][1:] == ["core.sbuf.partition_bytes (KiB)", "kernel time (TensorE cycles)"]


def test_plot_errors_are_one_line(results, tmp_path, capsys):
    cases = [
        (["--x", "clock", "--y", "us"], f"--x clock: r.csv has no such column; its columns: core.tensor.clock, "),
        (["--x", "shape", "--y", "bound"], "--y bound: DMA/HBM is not a number; choose a numeric column"),
        (["--x", "shape", "--y", "us", "--where", "kernel=nope"], "r.csv: no row has a value of us where kernel=nope"),
        (["--x", "shape", "--y", "us", "--where", "nope"], "--where nope: expected COLUMN=VALUE with a column of r.csv"),
    ]
    for args, message in cases:
        assert main(["plot", str(results), *args, "-o", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"trnsim: error: {message}") and err.count("\n") == 1, err
    assert main(["plot", str(results), "--x", "shape", "--y", "us", "-o", str(tmp_path / "x.jpg")]) == 2
    assert capsys.readouterr().err == f"trnsim: error: -o {tmp_path / 'x.jpg'}: expected a .png, .svg or .pdf file name\n"
    assert main(["plot", str(tmp_path / "none.csv"), "--x", "a", "--y", "b", "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == f"trnsim: error: {tmp_path / 'none.csv'}: no such file\n"
    (tmp_path / "spec.yaml").write_text("grid: {core.tensor.clock: [2.4GHz]}\n")
    assert main(["plot", str(tmp_path / "spec.yaml"), "--x", "a", "--y", "b", "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (f"trnsim: error: {tmp_path / 'spec.yaml'}: expected a sweep's results or a "
                                       "metrics file, .csv or Parquet (.parquet, .pq), got '.yaml'\n")
    (tmp_path / "spec.yaml").unlink()
    assert list(tmp_path.iterdir()) == []


def test_kernel_plot(tmp_path, monkeypatch, capsys):
    seen = _figure_texts(monkeypatch)
    out = tmp_path / "k.png"
    assert main(["kernel", "matmul", "--shape", "512x1024x1024", "--plot", str(out)]) == 0
    assert f"Plot written to {out}" in capsys.readouterr().out
    w, h = png_size(out)
    assert (w, h) == (1350, 900) and out.stat().st_size > 20_000
    assert seen["texts"][0].startswith("Kernel 'matmul' on trn2: ") and "bound by Tensor" in seen["texts"][0]
    assert "active time (% of the kernel's" in seen["texts"][1] and seen["texts"][3] == \
        "time since the kernel's first issue (us)"


def test_busy_bins_match_the_reports_busy_time():
    import numpy as np

    from trnsim.plot import _busy_bins

    rep = Chip(CFG).run(get_kernel("matmul").make((256, 512, 1024), "bf16", CFG), timing_only=True).report
    edges = np.linspace(0, rep.total_ticks, 101)
    segs = [(s, e) for lane, _, s, e, _ in rep.timeline if lane.split(" ")[0] == "Tensor"]
    frac = _busy_bins(segs, edges)
    assert frac.max() <= 1 + 1e-12 and frac.min() >= 0
    assert (frac * np.diff(edges)).sum() == pytest.approx(rep.engines["Tensor"].busy_ticks)
    assert list(_busy_bins([(0, 10), (5, 20), (30, 40)], np.array([0, 10, 20, 40]))) == [1.0, 1.0, 0.5]


def test_run_plot(tmp_path, monkeypatch):
    from trnsim.plot import plot_run

    dev = Device(CFG)
    for spec in (KernelSpec.of("matmul", (512, 512, 512), "bf16"), KernelSpec.of("softmax", (256, 1024), "bf16")):
        for _ in range(3):
            dev.launch(0, spec.kernel, dev.cost(spec))
    seen = _figure_texts(monkeypatch)
    out = plot_run(dev.report(), tmp_path / "run.png")
    w, h = png_size(out)
    assert w == 1950 and 500 <= h <= 1200 and out.stat().st_size > 20_000
    assert seen["texts"][0].startswith("neuron run on trn2: ") and "device time, summed over calls (us)" in seen["texts"]


def test_without_matplotlib_a_one_line_error(results, tmp_path):
    block = ("import sys\nsys.modules['matplotlib'] = None\nfrom trnsim.cli import main\n"
             "raise SystemExit(main(sys.argv[1:]))\n")
    for args in (["plot", str(results), "--x", "shape", "--y", "us", "-o", str(tmp_path / "p.png")],
                 ["kernel", "matmul", "--shape", "128x128x128", "--plot", str(tmp_path / "k.png")]):
        out = subprocess.run([sys.executable, "-c", block, *args], capture_output=True, text=True, timeout=120)
        flag = "-o" if args[0] == "plot" else "--plot"
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (f"trnsim: error: {flag} needs matplotlib (the 'plot' extra), which is not installed: "
                              f"python3 -m pip install -e '.[plot]'\n")
    assert list(tmp_path.iterdir()) == []
