"""RunReport: per op and kernel, simulated time from the simulator, library vs generic kernels,
metadata-only ops on the host, the host issue model, costs from metadata alone, the kernel
cache, scoped reports and torch.profiler's neuron::<op> events."""

import pytest
import torch

from torch_bridge import RunReport, lowering
from torch_bridge.runtime import runtime


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
    assert rep.device_us == pytest.approx(sum(r.time_us for r in rep.rows))
    assert rep.launches == 3 and rep.host_us == pytest.approx(3 * 13.0)
    assert mm.bound in ("Tensor", "DMA/HBM", "Vector", "Scalar", "GpSimd", "launch")
    assert "mm" in str(rep) and rep.to_dict()["rows"][0]["op"] == rep.rows[0].op


def test_a_scope_misused_says_so_in_one_line():
    scope = torch.neuron.report_scope()
    with pytest.raises(RuntimeError, match="closed without being opened"):
        scope.__exit__(None, None, None)
    with scope:
        with pytest.raises(RuntimeError, match="already open"):
            scope.__enter__()
        torch.ones(3, device="neuron").sum()
    assert scope.report.row("sum").calls == 1
    with scope:  # (a closed scope may be opened again: its report is the new block's)
        torch.ones(3, device="neuron").neg()
    assert "neg" in {r.op for r in scope.report.rows} and "sum" not in {r.op for r in scope.report.rows}


def test_row_time_is_the_simulated_kernel_on_both_physical_cores():
    """trn2 runs LNC=2: the op's matmul is split between the logical core's two physical cores
    (N, the larger dim, in halves) and the row's time is the pair simulated together."""
    from trnsim import Chip
    from trnsim.kernels import get_kernel

    a = torch.randn(256, 384, device="neuron")
    b = torch.randn(384, 512, device="neuron")
    with torch.neuron.report_scope() as scope:
        a @ b
    cfg = torch.neuron.config()
    half = get_kernel("matmul").make((256, 384, 256), "fp32", cfg, {"transpose_a": True, "transpose_b": False})
    want = max(r.report.total_us for r in Chip(cfg).run_spmd([half, half], timing_only=True))
    assert scope.report.row("mm").time_us == pytest.approx(want, rel=1e-9)


def test_ops_without_a_library_kernel_are_generic_and_not_free():
    x = torch.randn(1000, device="neuron")
    with torch.neuron.report_scope() as scope:
        x.cumsum(0)
    cum = scope.report.row("cumsum")
    assert cum.generic and cum.kernel == "generic:cumsum"
    assert cum.time_us > 0 and cum.hbm_bytes >= 2 * 4000
    assert cum.engine_percent["GpSimd"] > 0


def test_metadata_only_ops_launch_nothing():
    """Views and other metadata-only ops never reach a device queue: they are counted apart as
    host-only ops, with no device time and no host dispatch."""
    x = torch.randn(64, 32, device="neuron")
    with torch.neuron.report_scope() as scope:
        x.view(32, 64)
        x.t()
        x[:, 1:].expand(2, 64, 31)
        x.as_strided((8, 8), (1, 8))
        x.detach()
        x.unsqueeze(0)
    rep = scope.report
    assert rep.launches == 0 and rep.rows == () and rep.device_us == 0 and rep.host_us == 0
    assert rep.host_only_calls >= 6  # t, expand, detach, unsqueeze arrive as as_strided
    assert set(rep.host_ops) == {"view", "as_strided"}
    with pytest.raises(KeyError, match="op 'view' launched no kernel"):
        rep.row("view")


def _events(fn) -> list:
    torch.neuron.synchronize()
    with torch.neuron.report_scope(trace=True) as scope:
        fn()
    return list(scope.report.events)


def test_a_loop_of_tiny_ops_is_host_bound():
    """Each tiny kernel is shorter than the host's 13 us dispatch: it starts the moment the host
    issues it and the device idles until the next one."""
    x = torch.zeros(16, device="neuron")
    x.add_(1)
    ev = _events(lambda: [x.add_(1) for _ in range(6)])
    dispatch = torch.neuron.config().ps_to_ticks(torch.neuron.config().host.dispatch)
    assert [e.start for e in ev] == [e.issued for e in ev]
    assert [b.issued - a.issued for a, b in zip(ev, ev[1:])] == [dispatch] * 5
    assert all(b.start > a.end for a, b in zip(ev, ev[1:]))
    assert {e.end - e.start for e in ev} == {ev[0].end - ev[0].start}  # one cached kernel
    with torch.neuron.report_scope() as scope:
        for _ in range(6):
            x.add_(1)
    assert scope.report.row("add").bound == "launch"


def test_a_loop_of_big_matmuls_is_device_bound():
    """Each matmul is longer than the dispatch: kernels run back to back, the host runs ahead
    (issuing before the device is ready) until the runtime's queue of 3 is full."""
    a = torch.randn(1024, 1024, device="neuron")
    a @ a
    ev = _events(lambda: [a @ a for _ in range(6)])
    assert all(b.start == a_.end for a_, b in zip(ev, ev[1:]))
    assert all(e.issued < e.start for e in ev[1:])
    with torch.neuron.report_scope() as scope:
        for _ in range(6):
            a @ a
    assert scope.report.row("mm").bound != "launch"


def test_synchronising_calls_make_the_host_wait():
    a = torch.randn(1024, 1024, device="neuron")
    b = a @ a
    dev = runtime().device
    b.sum().item()
    assert dev.host == dev.now(0)  # item(): the host waited for the value
    c = a @ a
    assert dev.host < dev.now(0)
    c.cpu()
    assert dev.host == dev.now(0)  # a copy to the host waits for the copy


def test_cost_comes_from_metadata_a_meta_tensor_costs_what_a_real_one_does():
    real = [torch.randn(96, 200, device="neuron"), torch.randn(96, 200, device="neuron")]
    meta = [torch.empty(96, 200, device="meta"), torch.empty(96, 200, device="meta")]
    out_real, out_meta = real[0] + real[1], torch.empty(96, 200, device="meta")
    dev = runtime().device
    for name, args in (("add", ()), ("tanh", ()), ("cumsum", (0,))):
        r = lowering.op_spec(name, (real[0], *real[1:2 if name == "add" else 1], *args), {}, real, [out_real])
        m = lowering.op_spec(name, (meta[0], *meta[1:2 if name == "add" else 1], *args), {}, meta, [out_meta])
        assert r == m
        assert dev.cost(r).ticks == dev.cost(m).ticks > 0
    assert lowering.matmul_spec(1, 96, 200, 64, torch.float32, *lowering.matmul_layout(real[0], real[1].t())) == \
        lowering.matmul_spec(1, 96, 200, 64, torch.float32, *lowering.matmul_layout(meta[0], meta[1].t()))


def test_lnc2_matmul_reaches_past_half_the_logical_cores_peak():
    a = torch.ones(4096, 4096, device="neuron", dtype=torch.bfloat16)
    with torch.neuron.report_scope() as scope:
        a @ a
    assert scope.report.row("mm").mfu_percent > 50.0


def test_bigger_work_costs_more():
    with torch.neuron.report_scope() as small:
        torch.ones(128, 512, device="neuron").exp()
    with torch.neuron.report_scope() as big:
        torch.ones(1024, 2048, device="neuron").exp()
    assert big.report.row("exp").time_us > 4 * small.report.row("exp").time_us


def test_identical_kernels_are_simulated_once():
    dev = runtime().device
    x = torch.randn(96, 200, device="neuron")
    x.tanh()
    before = dev.simulated
    for _ in range(5):
        x.tanh()
    assert dev.simulated == before


def test_process_report_and_reset():
    torch.neuron.reset_report()
    torch.ones(4, device="neuron").neg()
    rep = torch.neuron.report()
    assert rep.row("neg").calls == 1
    assert 0 in rep.cores and rep.cores[0].launches >= 1 and rep.elapsed_us > 0


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
