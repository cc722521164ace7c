"""The ways in: a kernel file written for neuronxcc.nki run with its imports changed and nothing
else, nki.simulate_kernel / nki.simulate / nki.baremetal / nki.benchmark, inputs updated in
place, timing-only runs, the target from the environment, and `trnsim kernel file.py:kernel`."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trnsim.nki as nki
import trnsim.nki.language as nl
from trnsim.cli import main

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(5)

# written against neuronxcc.nki (the legacy namespace), as a Neuron user has it
NEURON_KERNEL = textwrap.dedent('''
    import numpy as np
    import neuronxcc.nki as nki
    import neuronxcc.nki.language as nl
    import neuronxcc.nki.isa as nisa
    from neuronxcc.nki.typing import tensor


    @nki.jit
    def scaled_softmax(x, scale=2.0):
        """Row softmax of scale * x, 128 rows a tile."""
        R, C = x.shape
        out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
        for t in nl.affine_range(R // 128):
            tile: tensor[128, C] = nl.load(x[t * 128:(t + 1) * 128, :])
            negmax = nisa.tensor_reduce(np.max, tile, axis=1, negate=True)
            bias = nisa.tensor_scalar(negmax, np.multiply, scale)
            total = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
            e = nisa.activation(op=np.exp, data=tile, bias=bias, scale=scale, reduce_op=np.add, reduce_res=total)
            nl.store(out[t * 128:(t + 1) * 128, :], value=nl.divide(e, total))
        return out
''')


def port(source: str) -> str:
    """The one change a Neuron user makes: the imports."""
    return source.replace("neuronxcc.nki", "trnsim.nki")


@pytest.fixture()
def kernel_file(tmp_path):
    path = tmp_path / "softmax_kernel.py"
    path.write_text(port(NEURON_KERNEL))
    return path


def _softmax(x, scale):
    e = np.exp(scale * (x - x.max(1, keepdims=True)))
    return e / e.sum(1, keepdims=True)


def test_a_neuron_kernel_file_runs_with_its_imports_changed(kernel_file):
    assert port(NEURON_KERNEL).count("\n") == NEURON_KERNEL.count("\n")  # nothing but the imports differ
    ns: dict = {}
    exec(compile(kernel_file.read_text(), str(kernel_file), "exec"), ns)
    x = RNG.standard_normal((256, 384), dtype=np.float32)
    out = ns["scaled_softmax"](x)                    # as on a Neuron device: arrays in, arrays out
    assert np.allclose(out, _softmax(x, 2.0), rtol=1e-5, atol=1e-7)
    rep = ns["scaled_softmax"].last_run.report       # and the cycle report of that run
    assert rep.total_ticks > 0 and rep.engines["Scalar"].instructions == 2


def test_simulate_kernel_simulate_baremetal_and_benchmark(tmp_path):
    @nki.jit
    def double(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.multiply(nl.load(x), 2.0))
        return out

    x = RNG.standard_normal((128, 256), dtype=np.float32)
    for out in (nki.simulate_kernel(double, x), nki.simulate(double)(x), nki.baremetal(double)(x),
                nki.run(double.fn, x).outputs):  # a plain function works too
        assert np.array_equal(out, 2 * x)
    trace = tmp_path / "double.json"
    bench = nki.benchmark(warmup=2, iters=10, save_trace_name=str(trace))(double)
    assert np.array_equal(bench(x), 2 * x)
    latency = bench.benchmark_result.nc_latency
    us = nki.run(double, x).report.total_us
    assert latency.get_latency_percentile(50) == latency.get_latency_percentile(99) == us  # deterministic
    assert json.loads(trace.read_text())["traceEvents"]
    with pytest.raises(nki.NkiError, match=r"^nki.benchmark: unexpected argument 'warmpu'$"):
        nki.benchmark(warmpu=1)(double)


def test_inputs_the_kernel_writes_are_updated_in_place():
    @nki.jit
    def scale_in_place(x, out):
        nl.store(out, value=nl.multiply(nl.load(x), 3.0))

    x = RNG.standard_normal((128, 64), dtype=np.float32)
    out = np.zeros_like(x)
    assert scale_in_place(x, out) is None
    assert np.array_equal(out, 3 * x)


def test_timing_only_with_tensor_specs_and_the_target_from_the_environment(monkeypatch):
    @nki.jit
    def ident(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    spec = nki.tensor_spec((128, 4096), "bf16")
    r2 = nki.run(ident, spec, timing_only=True)
    assert r2.outputs is None and r2.report.config == "trn2"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen4")
    r3 = nki.run(ident, spec, timing_only=True)
    assert r3.report.config == "trn3" and r3.report.total_ticks != r2.report.total_ticks
    with pytest.raises(nki.NkiError, match=r"^ident: tensor_spec arguments carry no values; run with timing_only=True$"):
        nki.run(ident, spec)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(nki.NkiError, match=r"^NEURON_PLATFORM_TARGET_OVERRIDE='trn9': expected trn1\|gen2, trn2\|gen3 or "
                                           r"trn3\|gen4$"):
        nki.run(ident, spec, timing_only=True)


# ---- the CLI ------------------------------------------------------------------------------------

def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_runs_an_nki_kernel_from_a_file(capsys, kernel_file):
    code, out, err = run_cli(capsys, "kernel", f"{kernel_file}:scaled_softmax", "--shape", "256x384",
                             "--param", "scale=0.5")
    assert code == 0 and err == ""
    assert f"{kernel_file}:scaled_softmax (NKI) x=256x384, fp32, scale=0.5 on trn2; values from random" in out.replace("\n", " ")
    assert "Scheduled (" in out and "Kernel 'scaled_softmax' on trn2" in out and "Outputs" in out
    code, out, _ = run_cli(capsys, "kernel", f"{kernel_file}:scaled_softmax", "--shape", "256x384", "--json",
                           "--no-schedule")
    doc = json.loads(out)
    assert doc["schedule"]["policy"] == "program order" and doc["outputs"][0]["shape"] == [256, 384]
    assert 0 <= doc["outputs"][0]["min"] and doc["outputs"][0]["max"] <= 1  # softmax values
    assert doc["report"]["total_ticks"] == doc["schedule"]["ticks"]


@pytest.mark.parametrize("argv, message", [
    ([], "kernel '{f}:scaled_softmax': --shape is required for an NKI kernel: one shape per tensor argument (x), "
         "separated by commas, e.g. --shape 128x512,128x512"),
    (["--shape", "128x4,128x4"], "kernel '{f}:scaled_softmax': --shape gives 2 shapes but scaled_softmax takes 1 "
                                 "tensors (x); give one per tensor, separated by commas"),
    (["--shape", "128x4", "--param", "colour=red"], "kernel '{f}:scaled_softmax': unknown parameter 'colour'; it "
                                                     "takes: scale"),
    (["--shape", "128x70000"], "softmax_kernel.py:16: tensor_reduce(max): tile 'nl.load result' access pattern "
                               "[(1, 70000)] needs sizes <= 65535 and strides within -32768..32767 elements"),
    (["--shape", "128x4", "--dtype", "fp64"], "kernel '{f}:scaled_softmax': unknown dtype 'fp64': expected one of bf16, "
                                              "fp16, fp32, fp8_e4m3, fp8_e4m3fn, fp8_e5m2, int8, uint8, int16, int32, uint32"),
])
def test_cli_errors_are_one_line(capsys, kernel_file, argv, message, monkeypatch):
    monkeypatch.chdir(kernel_file.parent)  # a short name: errors clip long ones
    code, out, err = run_cli(capsys, "kernel", f"{kernel_file.name}:scaled_softmax", *argv)
    assert code == 2 and out == ""
    assert err == "trnsim: error: " + message.format(f=kernel_file.name) + "\n"


def test_cli_nki_kernel_in_a_subprocess_exits_zero(kernel_file):
    r = subprocess.run([sys.executable, "-m", "trnsim.cli", "kernel", f"{kernel_file}:scaled_softmax", "--shape",
                        "128x512", "--dtype", "bf16", "--config", "trn3"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "on trn3" in r.stdout and "bfloat16" in r.stdout


def test_cli_report_of_the_example_kernel_golden(capsys, monkeypatch):
    """Regenerate with: python -m trnsim.cli kernel examples/nki_rmsnorm.py:rmsnorm_kernel
    --shape 1024x2048,2048 > tests/golden/kernel_nki_rmsnorm_trn2.txt (and read the diff)."""
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, "kernel", "examples/nki_rmsnorm.py:rmsnorm_kernel", "--shape", "1024x2048,2048")
    assert code == 0 and err == ""
    assert out == (ROOT / "tests" / "golden" / "kernel_nki_rmsnorm_trn2.txt").read_text()


def test_the_example_script_runs():
    r = subprocess.run([sys.executable, "examples/nki_rmsnorm.py"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    error = float(r.stdout.split("max error ")[1].split(",")[0])
    assert error < 1e-5 and "us simulated" in r.stdout
