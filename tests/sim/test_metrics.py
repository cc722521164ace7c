"""Metrics as Parquet: the schema (neuron-profile's names, types, units), a round trip through
pyarrow for run and kernel reports, extra report fields as columns, and one-line errors without
pyarrow."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from trnsim import Chip, load_config
from trnsim.device import Device, KernelSpec
from trnsim.extras import MissingExtra
from trnsim.kernels import get_kernel
from trnsim.sim.metrics import columns, metrics_table, run_rows, write_kernel_metrics

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CFG = load_config("trn2")


@pytest.fixture(scope="module")
def run_report():
    dev = Device(CFG)
    dev.reset(sources=True)
    mm = dev.cost(KernelSpec.of("matmul", (256, 512, 512), "bf16"))
    add = dev.cost(KernelSpec.of("binary", (256, 512), "bf16", {"op": "add"}))
    dev.set_context("net.py:3")
    for _ in range(3):
        dev.launch(0, "mm", mm)
    dev.set_context("net.py:4")
    dev.launch(0, "add", add)
    dev.launch(1, "add", add)
    return dev.report()


@pytest.fixture(scope="module")
def kernel_report():
    return Chip(CFG).run(get_kernel("matmul").make((256, 512, 1024), "bf16", CFG), timing_only=True).report


def test_the_schema_uses_neuron_profiles_names_with_units(tmp_path, run_report):
    schema = pq.read_schema(run_report.to_parquet(tmp_path / "m.parquet"))
    assert schema.names[:len(columns())] == [c[0] for c in columns()]
    for name in ("tensor_engine_active_time_percent", "vector_engine_active_time_percent",
                 "dma_active_time_percent", "mfu_estimated_percent", "hbm_read_bytes", "hbm_write_bytes",
                 "dma_bytes", "bound", "source_line", "total_time"):
        assert name in schema.names
    types = {f.name: str(f.type) for f in schema}
    assert (types["op"], types["calls"], types["total_time"], types["hbm_read_bytes"], types["generic"]) == \
        ("string", "int64", "double", "int64", "bool")
    units = {f.name: f.metadata[b"unit"].decode() for f in schema}
    assert (units["total_time"], units["mfu_estimated_percent"], units["dma_bytes"]) == ("s", "%", "bytes")
    meta = json.loads(schema.metadata[b"trnsim"])
    assert meta["kind"] == "run" and meta["launches"] == run_report.launches == 5
    assert meta["elapsed_us"] == pytest.approx(run_report.elapsed_us)


def test_run_report_round_trip(tmp_path, run_report):
    rows = pq.read_table(run_report.to_parquet(tmp_path / "m.parquet")).to_pylist()
    assert [(r["level"], r["op"], r["kernel"]) for r in rows] == [("op", r.op, r.kernel) for r in run_report.rows]
    for got, want in zip(rows, run_report.rows):
        assert got["calls"] == want.calls and got["bound"] == want.bound and got["config"] == "trn2"
        assert got["total_time"] == pytest.approx(want.time_us / 1e6)
        assert got["host_wait_time"] == pytest.approx(want.host_wait_us / 1e6)
        assert got["mfu_estimated_percent"] == pytest.approx(want.mfu_percent)
        assert got["tensor_engine_active_time_percent"] == pytest.approx(want.engine_percent["Tensor"])
        assert got["dma_active_time_percent"] == pytest.approx(want.engine_percent["DMA"])
        assert (got["hbm_read_bytes"], got["hbm_write_bytes"], got["dma_bytes"]) == \
            (want.hbm_read_bytes, want.hbm_write_bytes, want.dma_bytes)
        assert got["hbm_read_bytes"] + got["hbm_write_bytes"] == want.hbm_bytes
        assert got["core"] is None and got["total_cycles"] is None  # kernel-level columns
    assert {r["op"]: r["source_line"] for r in rows} == {"mm": "net.py:3", "add": "net.py:4"}


def test_kernel_report_round_trip(tmp_path, kernel_report):
    rep = kernel_report
    (row,) = pq.read_table(rep.to_parquet(tmp_path / "k.parquet")).to_pylist()
    assert (row["level"], row["kernel"], row["op"], row["core"], row["calls"]) == ("kernel", "matmul", None, 0, 1)
    assert row["total_time"] == pytest.approx(rep.total_us / 1e6)
    assert row["total_cycles"] == pytest.approx(rep.total_cycles)
    assert row["tensor_engine_active_time_percent"] == pytest.approx(rep.engines["Tensor"].active_percent)
    assert row["mbu_estimated_percent"] == pytest.approx(rep.mbu_estimated_percent)
    assert (row["hbm_read_bytes"], row["sbuf_write_bytes"], row["dma_bytes"], row["dma_transfers"]) == \
        (rep.hbm_read_bytes, rep.sbuf_write_bytes, rep.dma.bytes, rep.dma.transfers)
    assert row["instructions"] == sum(rep.instruction_counts.values()) and row["bound"] == rep.bound
    assert row["mm_arithmetic_intensity"] == pytest.approx(rep.matmul_flops / (rep.hbm_read_bytes + rep.hbm_write_bytes))


def test_run_and_kernel_files_concatenate(tmp_path, run_report, kernel_report):
    a = pq.read_table(run_report.to_parquet(tmp_path / "a.parquet"))
    b = pq.read_table(write_kernel_metrics(tmp_path / "b.parquet", [kernel_report]))
    both = pa.concat_tables([a, b], promote_options="default")  # run rows carry OpRow's extra fields too
    assert both.num_rows == len(run_report.rows) + 1 and set(both.column("level").to_pylist()) == {"op", "kernel"}


def test_fields_other_parts_add_to_oprow_become_columns(run_report):
    from trnsim.report import OpRow

    @dataclasses.dataclass(frozen=True)
    class Row(OpRow):
        region: str = "graph_0"
        ranks: tuple = (0, 1)
        per_rank_us: dict = dataclasses.field(default_factory=lambda: {"0": 1.5})
        groups: tuple = ((0, 1), (2, 3))

    r0 = run_report.rows[0]
    rep = dataclasses.replace(run_report, rows=(Row(**{f.name: getattr(r0, f.name) for f in dataclasses.fields(r0)}),))
    table = metrics_table(run_rows(rep))
    row = table.to_pylist()[0]
    assert (row["region"], row["ranks"], row["per_rank_us.0"], row["groups"]) == ("graph_0", [0, 1], 1.5,
                                                                                  "[[0, 1], [2, 3]]")
    assert {"fused_ops", "eager_launches", "eager_time_us"} <= set(table.column_names)  # the compiled-region fields


def test_without_pyarrow_a_one_line_error(monkeypatch, tmp_path, run_report):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtra) as e:
        run_report.to_parquet(tmp_path / "m.parquet")
    assert str(e.value) == ("Parquet metrics needs pyarrow (the 'metrics' extra), which is not installed: "
                            "python3 -m pip install -e '.[metrics]'")
    assert list(tmp_path.iterdir()) == []


BLOCK = ("import sys\nfor m in ('pyarrow', 'pyarrow.parquet', 'matplotlib', 'ray'): sys.modules[m] = None\n"
         "from trnsim.cli import main\nraise SystemExit(main(sys.argv[1:]))\n")


def test_cli_without_pyarrow_refuses_before_running(tmp_path):
    out = subprocess.run([sys.executable, "-c", BLOCK, "kernel", "matmul", "--shape", "128x128x128", "--metrics",
                          str(tmp_path / "k.parquet")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("trnsim: error: --metrics needs pyarrow (the 'metrics' extra), which is not installed: "
                          "python3 -m pip install -e '.[metrics]'\n")
    assert list(tmp_path.iterdir()) == []


def test_cli_kernel_metrics(tmp_path):
    from trnsim.cli import main

    assert main(["kernel", "rmsnorm", "--shape", "256x1024", "--metrics", str(tmp_path / "k.parquet")]) == 0
    table = pq.read_table(tmp_path / "k.parquet")
    (row,) = table.to_pylist()
    assert (row["kernel"], row["level"]) == ("rmsnorm", "kernel")
    assert json.loads(table.schema.metadata[b"trnsim"])["shape"] == [256, 1024]
