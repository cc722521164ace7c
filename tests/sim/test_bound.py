"""What bounds a kernel has one definition (trnsim.sim.report.bound_of / busiest): the report,
the sweep's rows, the CLI, metrics and plots all give its answer."""

from __future__ import annotations

import textwrap

import pytest

import trnsim.cli
import trnsim.sweep
from trnsim import Chip, load_config
from trnsim.kernels import get_kernel
from trnsim.sim.metrics import kernel_rows
from trnsim.sim.report import bound_of, busiest
from trnsim.sweep import load_spec, run_sweep


def test_busiest_names_the_busiest_datapath_engine_or_the_dma_system():
    assert busiest({"Tensor": 5.0, "Vector": 7.0, "Sync": 99.0, "DMA": 6.0}) == "Vector"  # Sync only triggers DMAs
    assert busiest({"Tensor": 5.0, "Vector": 2.0, "Sync": 99.0, "DMA": 6.0}) == "DMA/HBM"
    assert busiest({"Vector": 4.0, "Scalar": 4.0, "DMA": 4.0}) == "Vector"  # a tie: the first in the report's order
    assert busiest({"Sync": 3.0}) == "DMA/HBM"  # nothing with a datapath worked: the DMA system is named


def test_the_apps_use_the_one_definition():
    assert trnsim.sweep.bound_of is bound_of and trnsim.cli.bound_of is bound_of


def test_a_sweeps_rows_and_metrics_give_the_reports_bound(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent("""\
        config: trn2
        grid:
          core.tensor.clock: [2.4GHz]
        kernels:
          - name: matmul
            shape: 512x512x512
          - name: binary
            shape: 300x700
    """))
    rows = run_sweep(load_spec(spec), jobs=1).rows
    cfg = load_config("trn2", {"core.tensor.clock": "2.4GHz"})
    seen = set()
    for r in rows:
        entry = get_kernel(r["kernel"])
        shape = tuple(int(n) for n in r["shape"].split("x"))
        rep = Chip(cfg).run(entry.make(shape, r["dtype"], cfg), timing_only=True).report
        assert r["bound"] == rep.bound == bound_of(rep) == kernel_rows([rep])[0]["bound"]
        seen.add(rep.bound)
    assert len(rows) == 2 and seen <= {"Tensor", "Vector", "Scalar", "GpSimd", "DMA/HBM"}


@pytest.mark.parametrize("name", ["softmax", "rmsnorm"])
def test_bound_of_is_the_busiest_by_ticks(name):
    cfg = load_config("trn2")
    entry = get_kernel(name)
    rep = Chip(cfg).run(entry.make(entry.default_shape, entry.default_dtype, cfg), timing_only=True).report
    busy = {n: t for n, t in rep.busy_ticks.items() if n != "Sync"}
    top = max(busy.values())
    want = next(n for n, t in busy.items() if t == top)
    assert bound_of(rep) == ("DMA/HBM" if want == "DMA" else want)
