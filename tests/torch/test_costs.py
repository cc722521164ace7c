"""Costs that follow the work: small batched matmuls are packed, depthwise convolutions run on
their own kernel, and the benchmarks that measure first-step simulation and per-op host cost run."""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
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
    assert _bench("bench_zoo").main(["--models", "gpt2,separable_block"]) == 0
    out = capsys.readouterr().out
    assert "steady-state wall ratio vs CPU" in out and "gpt2" in out
