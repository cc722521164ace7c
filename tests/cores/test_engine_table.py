"""The engine table (trnsim.cores.base + trnsim.config.ENGINE_SECTIONS) is the one place that
names engines: a new engine is its module, its config section and the chip YAMLs, and the
builder, the simulation, metrics, plots and traces take it from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trnsim import Chip, load_config
from trnsim.config import ENGINE_SECTIONS
from trnsim.cores.base import ENGINE_TYPES, canonical_engine, datapath_engines, engine_names, engines_running
from trnsim.isa import DmaGather, DmaTranspose, KernelError, Memset, TensorCopy, TensorScalar, TensorTensor
from trnsim.kernels import get_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_in_table():
    assert engine_names() == ("Tensor", "Vector", "Scalar", "GpSimd", "Sync")
    assert datapath_engines() == ("Tensor", "Vector", "Scalar", "GpSimd")
    assert set(ENGINE_SECTIONS) == set(ENGINE_TYPES)  # every engine has a config section, and no more
    assert engines_running(TensorTensor) == ("Vector", "GpSimd")
    assert engines_running(TensorScalar) == engines_running(TensorCopy) == engines_running(Memset) \
        == ("Vector", "Scalar", "GpSimd")
    assert engines_running(DmaTranspose) == ("Scalar", "GpSimd", "Sync")
    assert engines_running(DmaGather) == ("GpSimd",)
    assert [canonical_engine(a) for a in ("pe", "DVE", "act", "activation", "pool", "sp", "gpsimd")] == \
        ["Tensor", "Vector", "Scalar", "Scalar", "GpSimd", "Sync", "GpSimd"]
    assert canonical_engine("npu") == "npu"


# small shapes, one per kind of engine use (TensorE, ScalarE/VectorE, GpSimd gathers, DMA transposes)
SHAPES = {"matmul": (128, 256, 512), "softmax": (200, 1000), "rmsnorm": (200, 1000), "embedding": (130, 1000, 256),
          "transpose": (300, 700), "attention_tkg": (2, 4, 1, 2, 256, 64)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_instruction_of_a_library_kernel_is_on_an_engine_that_runs_it(name):
    cfg = load_config("trn2")
    entry = get_kernel(name)
    k = entry.make(SHAPES[name], entry.default_dtype, cfg)
    seen = {(type(ins), ins.engine) for ins in k.instructions}
    assert seen
    for t, eng in seen:
        assert t in ENGINE_TYPES[eng].runs, (t.__name__, eng)


def test_the_builder_offers_an_instruction_to_the_engines_that_run_it():
    from trnsim import Kernel

    k = Kernel("k", "trn2")
    a = k.sbuf((128, 64), "float32")
    b = k.sbuf((128, 64), "float32")
    with pytest.raises(KernelError, match="expected one of vector, gpsimd$"):
        k.tensor_tensor(a, a, b, "add", engine="act")
    with pytest.raises(KernelError, match="expected one of vector, scalar, gpsimd$"):
        k.tensor_copy(a, b, engine="pe")
    assert k.tensor_copy(a, b, engine="pool").engine == "GpSimd"


TOY_MODULE = '''
"""A toy engine: a copy unit with a clock of its own, costing a fixed start plus a cycle per element."""
from dataclasses import dataclass

from trnsim.config import engine_section
from trnsim.config.schema import int_field, quantity_field
from trnsim.cores.alu import ElementwiseExec
from trnsim.cores.base import Engine, register_engine
from trnsim.isa import TensorCopy


@engine_section("Toy", "toy")
@dataclass(frozen=True)
class ToyEngineConfig:
    clock: int = quantity_field("hz", lo=1e6, hi=1e11)
    start_cycles: int = int_field(0, 100000)


@register_engine
class ToyEngine(ElementwiseExec, Engine):
    name = "Toy"
    runs = Engine.runs | {TensorCopy}
    aliases = ("tx",)
    color = "#123456"
    reaches_psum = False

    @classmethod
    def max_free(cls, config, space):
        return 1000  # elements per partition one of its instructions may touch

    def cycles(self, ins):
        if isinstance(ins, TensorCopy):
            return self.config.core.toy.start_cycles + ins.data.free_size
        return super().cycles(ins)
'''

TOY_RUN = '''
import json, sys
import numpy as np
import matplotlib
matplotlib.rcParams["svg.fonttype"] = "none"  # keep the labels as text, to read them back

import toy_engine  # noqa: F401  (the module alone registers the engine and its config section)
from trnsim import Chip, Kernel, load_config
from trnsim.isa import KernelError
from trnsim.sim import simulate
from trnsim.sim.metrics import columns, kernel_rows, write_kernel_metrics
from trnsim.outputs.plot import plot_kernel
from trnsim.outputs.trace import trace_events

out = {}
cfg = load_config(sys.argv[1], sys.argv[2:])
k = Kernel("toy_copy", cfg)
x = k.input("x", (128, 1000), "float32")
y = k.output("y", (128, 1000), "float32")
a = k.sbuf((128, 1000), "float32")
b = k.sbuf((128, 1000), "float32")
k.dma_copy(a, x, queue=0)
k.tensor_copy(b, a, engine="tx")
k.dma_copy(y, b, queue=1)
try:
    k.tensor_tensor(b, a, a, "add", engine="toy")
except KernelError as e:
    out["tt_error"] = str(e)
try:
    k.tensor_copy(k.psum((128, 64), "float32"), a[:, :64], engine="toy")
except KernelError as e:
    out["psum_error"] = str(e)
try:
    k.tensor_copy(k.sbuf((128, 1024), "float32"), k.sbuf((128, 1024), "float32"), engine="toy")
except KernelError as e:
    out["free_error"] = str(e)
data = np.arange(128 * 1000, dtype=np.float32).reshape(128, 1000)
run = Chip(cfg).run(k, {"x": data})
rep = run.report
out["values_equal"] = bool(np.array_equal(run["y"], data))
out["engines"] = list(rep.engines)
out["toy_busy_cycles"] = rep.engines["Toy"].busy_cycles
out["toy_tpc"] = cfg.ticks_per_cycle("Toy")
out["toy_clock"] = cfg.engine_clocks["Toy"]
out["ticks"] = {e: simulate(cfg, [k], timeline=e)[0].total_ticks for e in ("native", "simpy")}
out["bound"] = rep.bound
row = kernel_rows([rep])[0]
out["metric"] = row.get("toy_engine_active_time_percent")
out["active_percent"] = rep.engines["Toy"].active_percent
out["in_columns"] = "toy_engine_active_time_percent" in [c[0] for c in columns()]
import pyarrow.parquet as pq
out["parquet_names"] = pq.read_schema(write_kernel_metrics(sys.argv[0] + ".parquet", [rep])).names
svg = plot_kernel(rep, sys.argv[0] + ".svg").read_text()
out["plot_has_toy"] = ">Toy<" in svg
out["lanes"] = sorted({e["args"]["name"] for e in trace_events([rep]) if e.get("name") == "thread_name"})
print(json.dumps(out))
'''


def _run_toy(tmp_path: Path, *overrides: str) -> dict:
    (tmp_path / "toy_engine.py").write_text(TOY_MODULE)
    (tmp_path / "toy_run.py").write_text(TOY_RUN)
    yaml = (ROOT / "configs" / "trn2.yaml").read_text()
    head = "core:\n  version: NeuronCore-v3\n"
    assert head in yaml
    (tmp_path / "trn2_toy.yaml").write_text(yaml.replace(head, head + "  toy:\n    clock: 1GHz\n    start_cycles: 50\n"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "TRNSIM_CACHE_DIR": "off"}
    p = subprocess.run([sys.executable, str(tmp_path / "toy_run.py"), str(tmp_path / "trn2_toy.yaml"), *overrides],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_new_engine_is_a_module_a_config_section_and_a_yaml(tmp_path):
    out = _run_toy(tmp_path)
    assert out["values_equal"]
    assert "Toy" in out["engines"] and out["toy_clock"] == 10**9
    assert out["toy_busy_cycles"] == 50 + 1000  # its own cost formula, in its own clock
    assert out["ticks"]["native"] == out["ticks"]["simpy"]  # both timelines place it alike
    assert out["tt_error"].endswith("expected one of vector, gpsimd")  # it runs only what it says
    assert "Toy cannot access PSUM" in out["psum_error"]  # and touches only what it says
    assert "has 1024 elements per partition; a Toy instruction may touch at most 1000 in SBUF" in out["free_error"]
    assert out["in_columns"] and "toy_engine_active_time_percent" in out["parquet_names"]
    assert out["metric"] == out["active_percent"] > 0
    assert out["plot_has_toy"]
    assert "Toy" in out["lanes"]


def test_a_new_engines_config_is_overridden_like_the_others(tmp_path):
    out = _run_toy(tmp_path, "core.toy.start_cycles=80")
    assert out["toy_busy_cycles"] == 80 + 1000


def test_a_chip_without_the_new_engines_section_is_refused(tmp_path):
    (tmp_path / "toy_engine.py").write_text(TOY_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    p = subprocess.run([sys.executable, "-c", "import toy_engine; from trnsim import load_config; load_config('trn2')"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode != 0 and "trn2.yaml: missing key 'core.toy'" in p.stderr


def test_the_built_in_engines_figures_are_read_through_the_table():
    cfg = load_config("trn2")
    assert cfg.engine_clocks == {n: getattr(cfg.core, ENGINE_SECTIONS[n][0]).clock for n in engine_names()}
    assert cfg.core.engine("Vector") is cfg.core.vector
    assert Chip(cfg).config is cfg
