"""Graph breaks and dynamic shapes under the neuron backend: each graph is one launch, a new
shape recompiles (or, with dynamic=True, reuses one symbolic graph whose kernels are costed per
concrete shape)."""

from __future__ import annotations

import torch

import torch_bridge.compile as neuron_compile

neuron_compile.register()


def _f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x * 2 + b).softmax(-1)


def test_graph_break_gives_two_graphs_each_one_launch():
    calls = []

    def broken(x):
        y = torch.tanh(x) * 3 + 1
        calls.append(1)  # a side effect dynamo cannot trace: a graph break
        torch._dynamo.graph_break()
        return torch.sigmoid(y) * y

    x = torch.randn(64, 128, device="neuron")
    torch._dynamo.reset()
    f = torch.compile(broken, backend="neuron")
    with torch.neuron.report_scope() as scope:
        out = f(x)
    assert torch.equal(out.cpu(), broken(x).cpu())
    rep = scope.report
    assert rep.compiled_graphs == 2 and rep.graph_launches + rep.dispatches >= 2
    assert len(rep.regions) == 2  # each graph's chain is one fused kernel
    assert all(r.calls == 1 for r in rep.regions)


def test_new_shape_recompiles_static():
    torch._dynamo.reset()
    f = torch.compile(_f, backend="neuron", dynamic=False)
    b = torch.randn(256, device="neuron")
    for rows in (32, 64):
        x = torch.randn(rows, 256, device="neuron")
        with torch.neuron.report_scope() as scope:
            out = f(x, b)
        assert torch.equal(out.cpu(), _f(x, b).cpu())
        assert scope.report.compiled_graphs == 1  # one compile per shape
    with torch.neuron.report_scope() as scope:
        f(torch.randn(32, 256, device="neuron"), b)
    assert scope.report.compiled_graphs == 0  # the first shape's graph is reused


def test_dynamic_shapes_one_graph_costed_per_shape():
    torch._dynamo.reset()
    f = torch.compile(_f, backend="neuron", dynamic=True)
    b = torch.randn(256, device="neuron")
    times = {}
    with torch.neuron.report_scope() as all_runs:
        for rows in (48, 96, 1024):
            x = torch.randn(rows, 256, device="neuron")
            with torch.neuron.report_scope() as scope:
                out = f(x, b)
            assert torch.equal(out.cpu(), _f(x, b).cpu())
            (region,) = scope.report.regions
            times[rows] = region.time_us
    assert all_runs.report.compiled_graphs == 1  # one symbolic graph for every batch size
    assert times[48] < times[1024]  # each shape's fused kernel simulated on its own
