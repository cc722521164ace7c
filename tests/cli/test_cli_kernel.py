"""`trnsim kernel`: golden report and list, JSON, value checks, user kernel files, traces, and
one-line errors with exit status 2.

The goldens change whenever a library kernel is retuned or registered; regenerate them with

    python -m trnsim.cli kernel matmul --shape 512x1024x1024 > tests/golden/kernel_matmul_trn2.txt
    python -m trnsim.cli kernel --list > tests/golden/kernel_list.txt

and read the diff: the cycle figures should move only for the reason the kernel changed.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from trnsim.chip import Chip
from trnsim.cli import main
from trnsim.config import load_config
from trnsim.kernel import Kernel
from trnsim.kernels import get_kernel, kernel_names
from trnsim.kernels.registry import KERNELS, KernelEntry

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# relative to the checkout (the tests run from it, _at_root): the name is quoted whole in one-line errors
# and in the report's title, which an absolute path of a deep checkout would shorten or wrap
SOFTMAX = "examples/softmax_kernel.py:build_softmax"


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_matmul_report_golden(capsys):
    code, out, err = run(capsys, "kernel", "matmul", "--shape", "512x1024x1024")
    assert code == 0 and err == ""
    assert out == (GOLDEN / "kernel_matmul_trn2.txt").read_text()


def test_list_golden(capsys):
    code, out, err = run(capsys, "kernel", "--list")
    assert code == 0 and err == ""
    assert out == (GOLDEN / "kernel_list.txt").read_text()


def test_list_json_has_every_kernel(capsys):
    code, out, _ = run(capsys, "kernel", "--list", "--json")
    data = json.loads(out)
    assert [d["name"] for d in data] == kernel_names()
    mm = next(d for d in data if d["name"] == "matmul")
    assert mm["dims"] == "MxKxN" and "bf16" in mm["dtypes"] and mm["checkable"]


def test_json_is_the_report_of_the_same_run(capsys):
    code, out, _ = run(capsys, "kernel", "matmul", "--shape", "256x512x1024", "--dtype", "fp16", "--config", "trn3",
                       "--set", "core.tensor.clock=2GHz", "--json")
    doc = json.loads(out)
    cfg = load_config("trn3", ["core.tensor.clock=2GHz"])
    want = Chip(cfg).run(get_kernel("matmul").make((256, 512, 1024), "fp16", cfg), timing_only=True).report
    assert code == 0
    assert (doc["kernel"], doc["shape"], doc["dtype"], doc["config"]) == ("matmul", [256, 512, 1024], "fp16", "trn3")
    assert doc["overrides"] == {"core.tensor.clock": "2GHz"}
    assert doc["report"]["total_ticks"] == want.total_ticks
    assert doc["report"]["engines"]["Tensor"]["busy_ticks"] == want.engines["Tensor"].busy_ticks
    assert doc["bound"] in ("Tensor", "Vector", "Scalar", "GpSimd", "DMA/HBM")


def test_check_runs_values_and_reports_the_error(capsys):
    code, out, _ = run(capsys, "kernel", "matmul", "--shape", "128x256x512", "--check")
    assert code == 0
    assert "values checked against the reference" in out
    assert out.rstrip().splitlines()[-1].startswith("Check: max error relative to max |reference|: out ")
    assert out.rstrip().endswith("-> ok")


def _copy_kernel(rows, cols, dtype="fp32", config="trn2"):
    k = Kernel("copy", config)
    x, y = k.input("x", (rows, cols), dtype), k.output("y", (rows, cols), dtype)
    t = k.sbuf((rows, cols), dtype)
    k.dma_copy(t, x)
    k.dma_copy(y, t)
    return k


def test_check_mismatch_exits_1(capsys, monkeypatch):
    kernel_names()  # load the library before adding to it
    monkeypatch.setitem(KERNELS, "wrong_copy", KernelEntry(
        name="wrong_copy", build=_copy_kernel, dims=("R", "C"), dtypes=("fp32",), default_shape=(128, 64),
        default_dtype="fp32", summary="a copy checked against x + 1",
        inputs=lambda shape, dtype, params, rng: {"x": rng.standard_normal(shape, dtype=np.float32)},
        reference=lambda inputs, shape, dtype, params: {"y": inputs["x"] + 1}))
    code, out, _ = run(capsys, "kernel", "wrong_copy", "--check")
    assert code == 1 and out.rstrip().endswith("-> MISMATCH")
    code, out, _ = run(capsys, "kernel", "wrong_copy", "--check", "--json")
    assert code == 1 and json.loads(out)["check"]["ok"] is False


def test_user_kernel_file_runs_timing_only(capsys):
    code, out, _ = run(capsys, "kernel", SOFTMAX, "--shape", "256x512")
    assert code == 0
    assert "Kernel 'softmax' on trn2 (core 0)" in out and "timing only" in out.splitlines()[0]


def test_trace_flag_writes_a_trace(capsys, tmp_path):
    path = tmp_path / "mm.json"
    code, out, _ = run(capsys, "kernel", "matmul", "--shape", "128x128x512", "--trace", str(path))
    assert code == 0 and f"Trace written to {path}" in out
    assert any(e.get("args", {}).get("name") == "Tensor" for e in json.loads(path.read_text())["traceEvents"])


@pytest.mark.parametrize("argv,message", [
    (["kernel", "nope"], "trnsim: error: unknown kernel 'nope'; expected one of "),
    (["kernel", "matmul", "--shape", "12xabc"],
     "trnsim: error: --shape '12xabc': expected positive integers joined by 'x', e.g. 4096x4096x4096\n"),
    (["kernel", "matmul", "--shape", "128x128"],
     "trnsim: error: kernel 'matmul': --shape needs 3 dims MxKxN, got 128x128\n"),
    (["kernel", "matmul", "--dtype", "int8", "--shape", "128x128x512"],
     "trnsim: error: kernel 'matmul': dtype int8 not supported; expected one of "),
    (["kernel", "matmul", "--dtype", "float7"], "trnsim: error: kernel 'matmul': unknown dtype 'float7': expected "),
    (["kernel", "matmul", "--param", "bufs=3"], "trnsim: error: kernel 'matmul': unknown parameter 'bufs'; it takes: "),
    (["kernel", "matmul", "--param", "transpose_a=maybe"],
     "trnsim: error: kernel 'matmul': parameter 'transpose_a' expects true or false, got 'maybe'\n"),
    (["kernel", "matmul", "--set", "core.sbuf.partition_bytes=lots"],
     "trnsim: error: trn2.yaml (--set core.sbuf.partition_bytes=lots): core.sbuf.partition_bytes = 'lots': "
     "expected a bytes quantity like '224KiB'\n"),
    (["kernel"], "trnsim: error: kernel: give a kernel NAME (see 'trnsim kernel --list') or "
                 "path/to/file.py:function\n"),
    (["kernel", "no/such_file.py:build"], "trnsim: error: kernel file 'no/such_file.py' not found\n"),
    (["kernel", SOFTMAX.replace(":build_softmax", ":build_nothing"), "--shape", "128x128"],
     "trnsim: error: kernel file '"),
    (["kernel", SOFTMAX], f"trnsim: error: kernel '{SOFTMAX}': --shape is required for a kernel from a file, "
                          f"e.g. --shape 1024x2048\n"),
    (["kernel", SOFTMAX, "--shape", "128x128", "--check"],
     f"trnsim: error: kernel '{SOFTMAX}': --check needs a registered kernel with a reference; run it without "
     f"--check for timing only\n"),
    (["kernel", SOFTMAX, "--shape", "128x128x1"], f"trnsim: error: kernel '{SOFTMAX}': cannot call build_softmax"),
    (["kernel", "matmul", "--shape", "128x128x512", "--trace", "/dev/null/t.json"],
     "trnsim: error: --trace /dev/null/t.json: cannot write it (Not a directory)\n"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.endswith("\n") and err.count("\n") == 1, err


def test_missing_function_names_it(capsys):
    code, _, err = run(capsys, "kernel", SOFTMAX.replace(":build_softmax", ":build_nothing"), "--shape", "128x128")
    assert code == 2 and err.endswith("has no function 'build_nothing'\n")


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["kernel", "matmul", "--frobnicate"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "trnsim: error: unrecognized arguments: --frobnicate (see 'trnsim kernel --help')\n"


USER_KERNELS = '''
import trnsim

def raises(rows, cols, config="trn2"):
    raise KeyError("no table " * 100)

def frees_another(rows, cols, config="trn2"):
    a, b = trnsim.Kernel("a", config), trnsim.Kernel("b", config)
    b.free(a.sbuf((rows, cols), "fp32"))
    return b
'''


@pytest.mark.parametrize("fn,message", [
    ("raises", "raises raised KeyError: '" + ("no table " * 23)[:199] + "... (902 characters)\n"),
    ("frees_another", "free: tile 'sbuf1' belongs to another kernel, not 'b'; a kernel uses only its own tiles\n"),
])
def test_a_user_kernel_that_raises_is_one_line(capsys, tmp_path, fn, message):
    (tmp_path / "k.py").write_text(USER_KERNELS)
    name = f"{tmp_path / 'k.py'}:{fn}"
    code, out, err = run(capsys, "kernel", name, "--shape", "128x64")
    assert code == 2 and out == ""
    assert err in (f"trnsim: error: kernel '{name}': {message}", f"trnsim: error: {message}"), err


@pytest.mark.parametrize("argv,env,message", [
    (["--param", "scale=nan"], {}, "kernel 'matmul': parameter 'scale' = 'nan': expected a finite number"),
    (["--param", "transpose_a=inf"], {}, "kernel 'matmul': parameter 'transpose_a' = 'inf': expected a finite number"),
    ([], {"TRNSIM_NATIVE_THREADS": "abc"}, "TRNSIM_NATIVE_THREADS='abc': expected a whole number of matmul threads, "
                                           "1..64"),
    ([], {"TRNSIM_NATIVE_THREADS": "0"}, "TRNSIM_NATIVE_THREADS='0': expected a whole number of matmul threads, "
                                         "1..64"),
    ([], {"TRNSIM_NATIVE_THREADS": "-1"}, "TRNSIM_NATIVE_THREADS='-1': expected a whole number of matmul threads, "
                                          "1..64"),
])
def test_bad_params_and_environment_are_one_line(capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run(capsys, "kernel", "matmul", "--shape", "128x128x512", "--check", *argv)
    assert code == 2 and out == "" and err == f"trnsim: error: {message}\n"


def test_check_holds_only_the_sbuf_a_kernel_uses_and_refuses_what_the_host_cannot(capsys, monkeypatch):
    # 128 partitions x 1 GiB is in range; the kernel's values need only the SBUF it allocates
    argv = ["kernel", "matmul", "--shape", "128x128x512", "--set", "core.sbuf.partition_bytes=1GiB", "--check"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == "" and "-> ok" in out
    monkeypatch.setattr("trnsim.chip.host_available_bytes", lambda: 2**20)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == ("trnsim: error: kernel 'matmul': computing its values needs 3.625 MiB of host memory (SBUF 128 x "
                   "2.25 KiB, PSUM 128 x 2 KiB, HBM tensors 288 KiB, inputs and reference 2.8125 MiB) but 1 MiB is "
                   "available; run it timing-only (timing_only=True, or without --check)\n")


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Chip, "run", interrupted)
    code, out, err = run(capsys, "kernel", "matmul", "--shape", "128x128x512")
    assert code == 130 and out == "" and err == "trnsim: interrupted\n"


def test_a_missing_output_directory_is_made_when_written_as_sweep_does(tmp_path, capsys, monkeypatch):
    """Issue 25: ``sweep --out new/r.csv`` made new/, ``--trace new/t.json`` was refused. Every
    output now makes its missing directories when it is written, and only then."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "kernel", "matmul", "--shape", "128x128x512", "--param", "nope=1",
                       "--trace", "a/b/t.json")
    assert code == 2 and err.startswith("trnsim: error: ") and list(tmp_path.iterdir()) == []  # a failed run: none
    code, out, _ = run(capsys, "kernel", "matmul", "--shape", "128x128x512", "--trace", "a/b/t.json")
    assert code == 0 and "Trace written to a/b/t.json" in out
    assert json.loads((tmp_path / "a" / "b" / "t.json").read_text())["traceEvents"]
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["t.json"]
    spec = tmp_path / "spec.yaml"
    spec.write_text("kernels: [{name: matmul, shape: 128x128x128}]\n")
    assert main(["sweep", str(spec), "--jobs", "1", "--out", "c/d/r.csv"]) == 0
    assert (tmp_path / "c" / "d" / "r.csv").read_text().startswith("kernel,")


@pytest.mark.parametrize("flags,message", [
    (["--trace", "same.out", "--metrics", "same.out"],
     "--trace and --metrics name the same file same.out; give each output a file of its own"),
    (["--trace", "p.png", "--plot", "./p.png"], "--trace and --plot name the same file ./p.png; "),
    (["--metrics", "m.csv"], "--metrics m.csv: the metrics are written as Parquet, not CSV; give a .parquet file"),
])
def test_outputs_that_would_clobber_each_other_or_lie_about_their_format_are_refused(tmp_path, capsys, monkeypatch,
                                                                                    flags, message):
    """`--trace X --metrics X` ran, and the trace was replaced by Parquet; `--metrics m.csv` wrote
    Parquet under a CSV name (found by the hardening hunt). Refused before the run, nothing written."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "kernel", "softmax", "--shape", "128x128", *flags)
    assert code == 2 and out == "" and err.startswith("trnsim: error: " + message), err
    assert list(tmp_path.iterdir()) == []


def test_a_kernel_file_imports_its_neighbours_from_any_directory(tmp_path, capsys, monkeypatch):
    """Issue 25: a kernel file importing a module beside it loaded only when the working
    directory was its own (and under python -m, not the trnsim command)."""
    (tmp_path / "kd").mkdir()
    (tmp_path / "kd" / "helper_beside_25.py").write_text("COLS = 64\n")
    (tmp_path / "kd" / "k.py").write_text(
        "import trnsim\nfrom helper_beside_25 import COLS\n\ndef build(rows, cols, config='trn2'):\n"
        "    k = trnsim.Kernel('copy', config)\n    x, y = k.input('x', (rows, COLS), 'fp32'), k.output('y', (rows, "
        "COLS), 'fp32')\n    t = k.sbuf((rows, COLS), 'fp32')\n    k.dma_copy(t, x)\n    k.dma_copy(y, t)\n    return k\n")
    monkeypatch.chdir(tmp_path)
    before = list(__import__("sys").path)
    code, out, err = run(capsys, "kernel", "kd/k.py:build", "--shape", "128x64")
    assert (code, err) == (0, "") and out.startswith("kd/k.py:build 128x64 on trn2")
    assert __import__("sys").path == before


def test_nki_inputs_beyond_a_cores_hbm_are_refused_before_they_are_made(capsys):
    """Found by the fuzz harness (issue 25): --shape 128x99999999 made 51 GB of random inputs on
    the host (MemoryError, status 1) for a kernel whose HBM could not hold them."""
    code, out, err = run(capsys, "kernel", str(ROOT / "examples" / "nki_rmsnorm.py") + ":rmsnorm_kernel",
                         "--shape", "128x99999999,99999999")
    assert (code, out) == (2, "")
    assert err.endswith(": --shape 128x99999999,99999999: the input tensors take 48.0562 GiB, more than a logical "
                        "core's share of HBM on trn2 (24 GiB)\n") and err.count("\n") == 1
