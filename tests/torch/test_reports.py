"""RunReport: per op and kernel, simulated time from the simulator, library vs generic kernels,
the kernel cache, scoped reports and torch.profiler's neuron::<op> events."""

import pytest
import torch

from torch_bridge import RunReport
from torch_bridge.runtime import runtime
from torch_bridge.timeline import LAUNCH_OVERHEAD_NS


def test_scoped_report_counts_only_the_block():
    x = torch.randn(128, 256, device="neuron")
    w = torch.randn(256, 512, device="neuron")
    with torch.neuron.report_scope() as scope:
        y = (x @ w).relu()
        y.sum()
    rep = scope.report
    assert isinstance(rep, RunReport) and rep.config == "trn2"
    assert {r.op for r in rep.rows} == {"mm", "relu", "sum"}
    mm = rep.row("mm")
    assert mm.calls == 1 and mm.kernel == "matmul" and not mm.generic
    assert mm.matmul_flops == 2 * 128 * 256 * 512 and mm.mfu_percent > 0
    assert rep.row("relu").kernel == "unary" and rep.row("sum").kernel == "reduce"
    assert sum(r.share_percent for r in rep.rows) == pytest.approx(100.0)
    assert rep.total_us == pytest.approx(sum(r.time_us for r in rep.rows))
    assert mm.launch_us == pytest.approx(LAUNCH_OVERHEAD_NS / 1000)
    assert mm.bound in ("Tensor", "DMA/HBM", "Vector", "Scalar", "GpSimd", "Sync", "launch")
    assert "mm" in str(rep) and rep.to_dict()["rows"][0]["op"] == rep.rows[0].op


def test_row_time_is_the_simulated_kernel_plus_launch():
    from trnsim import Chip
    from trnsim.kernels import get_kernel

    a = torch.randn(256, 384, device="neuron")
    b = torch.randn(384, 512, device="neuron")
    with torch.neuron.report_scope() as scope:
        a @ b
    cfg = torch.neuron.config()
    kernel = get_kernel("matmul").make((256, 384, 512), "fp32", cfg, {"transpose_a": True, "transpose_b": False})
    want = Chip(cfg).run(kernel, timing_only=True).report.total_us + LAUNCH_OVERHEAD_NS / 1000
    assert scope.report.row("mm").time_us == pytest.approx(want, rel=1e-9)


def test_ops_without_a_library_kernel_are_generic_and_not_free():
    x = torch.randn(1000, device="neuron")
    with torch.neuron.report_scope() as scope:
        x.cumsum(0)
        x.view(10, 100)
    cum = scope.report.row("cumsum")
    assert cum.generic and cum.kernel == "generic:cumsum"
    assert cum.time_us > LAUNCH_OVERHEAD_NS / 1000 and cum.hbm_bytes >= 2 * 4000
    assert cum.engine_percent["GpSimd"] > 0
    view = scope.report.row("view")
    assert view.kernel == "view (metadata only)" and view.time_us == pytest.approx(LAUNCH_OVERHEAD_NS / 1000)


def test_bigger_work_costs_more():
    with torch.neuron.report_scope() as small:
        torch.ones(128, 512, device="neuron").exp()
    with torch.neuron.report_scope() as big:
        torch.ones(1024, 2048, device="neuron").exp()
    assert big.report.row("exp").time_us > 4 * small.report.row("exp").time_us


def test_identical_kernels_are_simulated_once():
    cache = runtime().lowering.cache
    x = torch.randn(96, 200, device="neuron")
    x.tanh()
    before = cache.simulated
    for _ in range(5):
        x.tanh()
    assert cache.simulated == before


def test_process_report_and_reset():
    torch.neuron.reset_report()
    torch.ones(4, device="neuron").neg()
    rep = torch.neuron.report()
    assert rep.row("neg").calls == 1
    assert 0 in rep.devices and rep.devices[0] > 0


def test_profiler_shows_neuron_ops():
    x = torch.ones(8, 8, device="neuron")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (x @ x).sum()
    keys = {e.key for e in prof.key_averages()}
    assert {"neuron::mm", "neuron::sum"} <= keys


def test_determinism_of_cycles():
    def run() -> list[float]:
        with torch.neuron.report_scope() as scope:
            torch.nn.functional.softmax(torch.ones(64, 300, device="neuron") * 2, dim=-1)
        return [r.time_us for r in scope.report.rows]
    assert run() == run()
