"""Costs that follow the work: small batched matmuls are packed, depthwise convolutions run on
their own kernel, and the benchmarks that measure first-step simulation and per-op host cost run."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
    if str(BENCH) not in sys.path:  # (a script's siblings, as when it runs: _args)
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _report(fn):
    with torch.neuron.report_scope() as scope:
        fn()
    return scope.report


def test_many_small_matmuls_cost_about_what_their_flops_do():
    a, b = torch.randn(192, 11, 16, device="neuron"), torch.randn(192, 16, 11, device="neuron")
    bmm = _report(lambda: torch.bmm(a, b)).row("bmm")
    assert bmm.kernel == "bmm_packed"
    one = _report(lambda: torch.randn(192 * 11, 16, device="neuron") @ torch.randn(16, 11, device="neuron"))
    # was ~170 us against ~8 us for one matmul of the same FLOPs (one DMA round trip per item)
    assert bmm.time_us < 6 * one.row("mm").time_us


def test_large_items_keep_the_general_bmm():
    a, b = torch.randn(4, 256, 128, device="neuron"), torch.randn(4, 128, 256, device="neuron")
    assert _report(lambda: torch.bmm(a, b)).row("bmm").kernel == "bmm"


def test_depthwise_convolution_runs_on_its_kernel_with_its_flops():
    x, w = torch.randn(2, 32, 28, 28, device="neuron"), torch.randn(32, 1, 3, 3, device="neuron")
    row = _report(lambda: F.conv2d(x, w, padding=1, groups=32)).row("convolution")
    assert row.kernel == "dwconv2d" and not row.generic
    assert row.engine_flops == 2 * 2 * 32 * 28 * 28 * 9 and row.matmul_flops == 0


def test_first_step_benchmark_runs(capsys):
    assert _bench("bench_first_step").main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "neuron first step" in out and "kernels simulated" in out and "x CPU" in out


def test_op_overhead_benchmark_runs(capsys):
    assert _bench("bench_op_overhead").main(["--iters", "50"]) == 0
    out = capsys.readouterr().out
    assert "x + 1" in out and "goal <= 10.0 us" in out


def test_zoo_benchmark_runs(capsys):
    assert _bench("bench_zoo_ci").main(["--models", "gpt2,separable_block"]) == 0
    out = capsys.readouterr().out
    assert "steady-state wall ratio vs CPU" in out and "gpt2" in out


# ---- timing that follows the dtype: fp8 on TensorE's double-row path --------------------------
def _fp8(*shape, dtype=torch.float8_e4m3fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _tensor_us(row):
    return row.engine_percent["Tensor"] * row.time_us / 100


def test_fp8_matmuls_run_at_the_double_row_rate():
    """fp8 @ fp8 lowers to the matmul kernel's fp8 path in both formats: TensorE contracts 256
    rows per pass instead of bf16's 128, so it is busy about half as long (A stored as lhsT, so
    no on-chip transpose is in the way; at this size the launch and DMA hide part of it)."""
    m, k, n = 512, 1024, 512
    xt, w = torch.randn(k, m), torch.randn(k, n)
    bf16 = _report(lambda: xt.to("neuron", torch.bfloat16).t() @ w.to("neuron", torch.bfloat16)).row("mm")
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = xt.to(dt).t(), w.to(dt)
        assert torch.equal(_bits((a.to("neuron") @ b.to("neuron")).cpu()), _bits(a @ b))  # CPU's fp8 matmul
        fp8 = _report(lambda: a.to("neuron") @ b.to("neuron")).row("mm")
        assert fp8.kernel == "matmul" and fp8.matmul_flops == bf16.matmul_flops == 2 * m * k * n
        assert _tensor_us(bf16) / 2 <= _tensor_us(fp8) < 0.6 * _tensor_us(bf16), (dt, fp8, bf16)
        assert fp8.time_us < bf16.time_us


SCALED = {  # name -> (call, on which device): torch._scaled_mm's scalings, as torchao's float8 training calls it
    "tensorwise": lambda d, a, w: torch._scaled_mm(a.to(d), w.to(d).t(), torch.tensor(0.5).to(d),
                                                   torch.tensor(2.0).to(d), out_dtype=torch.bfloat16),
    "rowwise": lambda d, a, w: torch._scaled_mm(a.to(d), w.to(d).t(), (torch.arange(256.0) / 256).view(-1, 1).to(d),
                                                (torch.arange(384.0) / 384).view(1, -1).to(d), out_dtype=torch.bfloat16),
    "bias_fp32_out": lambda d, a, w: torch._scaled_mm(a.to(d), w.to(d).t(), torch.tensor(0.5).to(d),
                                                      torch.tensor(2.0).to(d), bias=torch.ones(384).to(d),
                                                      out_dtype=torch.float32),
    "fp8_out": lambda d, a, w: torch._scaled_mm(a.to(d), w.to(d).t(), torch.tensor(0.5).to(d), torch.tensor(2.0).to(d),
                                                scale_result=torch.tensor(0.25).to(d)),
    "e4m3_x_e5m2": lambda d, a, w: torch._scaled_mm(a.to(d), w.to(torch.float8_e5m2).to(d).t(), torch.tensor(1.0).to(d),
                                                    torch.tensor(1.0).to(d), out_dtype=torch.bfloat16),
    "F.scaled_mm": lambda d, a, w: F.scaled_mm(a.to(d), w.to(d).t(), torch.tensor(0.5).to(d), F.ScalingType.TensorWise,
                                               torch.tensor(2.0).to(d), F.ScalingType.TensorWise,
                                               output_dtype=torch.bfloat16),
}


def test_scaled_mm_is_an_fp8_matmul_with_its_scaling_in_the_evacuation():
    """torch._scaled_mm (and F.scaled_mm's _scaled_mm_v2) ran as a generic streaming kernel with no
    matmul FLOPs; it is the fp8 matmul whose PSUM evacuation applies the scales and the bias
    (matmul_fused), charged its FLOPs on TensorE, with CPU's values bit for bit."""
    a, w = _fp8(256, 512), _fp8(384, 512, seed=1)
    plain = _report(lambda: a.to("neuron") @ w.to("neuron").t()).row("mm")
    for name, call in SCALED.items():
        want = call("cpu", a, w)
        got = call("neuron", a, w)
        assert got.dtype == want.dtype and torch.equal(_bits(got.cpu()), _bits(want)), name
        rep = _report(lambda: call("neuron", a, w))
        row, = [r for r in rep.rows if r.op.startswith("_scaled_mm")]
        assert row.kernel == "matmul_fused" and not row.generic, name
        assert row.matmul_flops >= 2 * 256 * 512 * 384, name
        assert plain.time_us <= row.time_us < 1.5 * plain.time_us, (name, row.time_us, plain.time_us)


def test_scaled_mm_costs_the_same_without_values():
    a, w = _fp8(256, 512), _fp8(384, 512, seed=1)
    eager = _report(lambda: SCALED["rowwise"]("neuron", a, w)).rows
    with torch.neuron.timing_only():
        fake = _report(lambda: SCALED["rowwise"]("neuron", a, w)).rows
    pick = lambda rows: [(r.kernel, r.time_us) for r in rows if r.op == "_scaled_mm"]  # noqa: E731
    assert pick(fake) == pick(eager) and pick(eager)


# ---- MX: torch.neuron.mx_matmul on trn3's nc_matmul_mx --------------------------------------------
def _mx(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(k, n, generator=g).to(torch.float8_e5m2)
    sa = torch.randint(124, 131, (m, k // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sb = torch.randint(124, 131, (k // 32, n), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return a, sa, b, sb


MX_ON_TRN3 = """
import json, torch
from tests_mx import _mx
a, sa, b, sb = _mx(256, 1024, 384)
want = torch.neuron.mx_matmul(a, sa, b, sb)  # CPU: the dequantized operands' fp32 matmul, to bf16
dev = [t.to("neuron") for t in (a, sa, b, sb)]
got = torch.neuron.mx_matmul(*dev)
with torch.neuron.report_scope() as mx:
    torch.neuron.mx_matmul(*dev)
x, w = a.to("neuron", torch.bfloat16), b.to("neuron", torch.bfloat16)
with torch.neuron.report_scope() as bf16:
    x @ w
row, = [r for r in mx.report.rows if r.op == "mx_matmul"]
with torch.neuron.timing_only():
    fake = [torch.empty(t.shape, dtype=t.dtype, device="neuron") for t in (a, sa, b, sb)]
    with torch.neuron.report_scope() as shapes_only:
        torch.neuron.mx_matmul(*fake)
compiled = torch.compile(lambda *x: torch.neuron.mx_matmul(*x), backend="neuron")
with torch.neuron.report_scope() as graph:
    out = compiled(*dev)
print(json.dumps({"equal": torch.equal(got.cpu(), want), "dtype": str(got.dtype), "kernel": row.kernel,
                  "flops": row.matmul_flops, "mx_us": row.time_us, "bf16_us": bf16.report.row("mm").time_us,
                  "timing_only_us": shapes_only.report.row("mx_matmul").time_us,
                  "compiled": [torch.equal(out.cpu(), want), [(r.op, r.kernel) for r in graph.report.rows]]}))
"""


def test_mx_matmul_lowers_to_nc_matmul_mx_on_trn3(tmp_path):
    import inspect
    import json
    import os
    import subprocess

    (tmp_path / "tests_mx.py").write_text("import torch\n\n" + inspect.getsource(_mx))
    run = subprocess.run([sys.executable, "-c", MX_ON_TRN3], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "TRNSIM_CONFIG": "trn3", "PYTHONPATH": os.pathsep.join(
                             [str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["equal"] and got["dtype"] == "torch.bfloat16" and got["kernel"] == "matmul_mx"
    assert got["flops"] == 2 * 256 * 1024 * 384 and got["mx_us"] < got["bf16_us"]  # (the 4x: test_kernels_matmul)
    assert got["timing_only_us"] == got["mx_us"]
    assert got["compiled"] == [True, [["mx_matmul", "matmul_mx"]]]


def test_mx_matmul_is_refused_where_the_core_has_no_mx():
    a, sa, b, sb = _mx(128, 256, 128)
    with pytest.raises(RuntimeError, match=r"^torch.neuron.mx_matmul: trn2 has no MX matmul \(nc_matmul_mx is "
                                           r"NeuronCore-v4's, core.tensor.mx_quad\); use a trn3 config, or "
                                           r"aten::_scaled_mm for fp8$"):
        torch.neuron.mx_matmul(*(t.to("neuron") for t in (a, sa, b, sb)))
    with pytest.raises(ValueError, match=r"^torch.neuron.mx_matmul: a_scale must be float8_e8m0fnu "):
        torch.neuron.mx_matmul(a, sa.view(torch.uint8), b, sb)


def test_zoo_benchmark_runs_a_program_against_cpu_and_the_slow_path(capsys):
    assert _bench("bench_zoo").main(["--quick", "--programs", "lstm", "--rounds", "1", "--steps", "1",
                                     "--check-slow", "--warm"]) == 0
    out = capsys.readouterr().out
    assert "lstm" in out and "median ratio" in out and "fast path off: values and ticks identical" in out
    warm = next(line for line in out.splitlines() if "cost cache:" in line)  # (--warm: two runs, one cache)
    assert "(0 simulated)" in warm and warm.endswith("values and ticks identical") and "storing (0" not in warm
