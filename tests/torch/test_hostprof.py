"""torch_bridge.hostprof: where a neuron run's host wall time goes. It measures host time only:
the values and the simulated time are the same with it on or off (no wall time is asserted)."""

import subprocess
import sys
import tempfile

import torch

from torch_bridge.neuron import hostprof


def _step(model, x):
    model.zero_grad()
    out = model(x)
    loss = out.square().sum()
    loss.backward()
    return loss.item(), [p.grad.cpu().clone() for p in model.parameters()]


def test_a_profile_names_the_python_path_ops_and_changes_no_value_or_tick():
    torch.manual_seed(0)
    model = torch.nn.ConvTranspose1d(8, 16, 3).to("neuron")  # a transposed convolution takes the Python path
    x = torch.randn(2, 8, 5, device="neuron")
    from torch_bridge.runtime import runtime

    device = runtime().device
    _step(model, x)  # costs simulated once
    t0 = device.now()
    want = _step(model, x)
    plain = device.now() - t0
    t0 = device.now()
    with hostprof.profile() as prof:
        got = _step(model, x)
    profiled = device.now() - t0
    assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert profiled == plain
    assert hostprof.active is None
    parts = dict((k, c) for k, _, c in prof.parts())
    assert parts["python convolution_overrideable"] == 1
    assert "python _local_scalar_dense" not in parts  # item(): served natively, its wait taken from the log
    assert "device model" in parts
    s = prof.summary()
    assert abs(sum(s.values()) - prof.wall) < 1e-9 and prof.wall > 0
    text = prof.table(1, cpu_wall=0.001)
    assert "convolution_overrideable" in text and "rest: fast path" in text
    # the wrapped methods are restored
    from trnsim.device import Device

    assert not hasattr(Device.launch, "__wrapped__")


def test_profiles_do_not_nest():
    import pytest

    with hostprof.profile():
        with pytest.raises(RuntimeError, match="recording already"):
            with hostprof.profile():
                pass


def test_a_compiled_graphs_time_is_split_into_its_regions_and_its_other_ops():
    """A compiled function's calls: its regions' host values and the graph's other ops are parts
    of their own (one call each per run of the function), values and ticks as without the profile."""
    import torch_bridge.compile as neuron_compile
    from torch_bridge.compile.graph import CompiledGraph, RegionKernel
    from torch_bridge.runtime import runtime

    neuron_compile.register()

    def fn(x, w):
        return torch.tanh(x @ w) * 0.5 + x.sum()

    x, w = torch.randn(16, 32, device="neuron"), torch.randn(32, 32, device="neuron")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    want = compiled(x, w).cpu()  # compiled and costed
    device = runtime().device
    t0 = device.now()
    compiled(x, w).cpu()
    plain = device.now() - t0
    t0 = device.now()
    with hostprof.profile() as prof:
        got = compiled(x, w).cpu()
    assert torch.equal(got, want) and device.now() - t0 == plain
    parts = dict((k, c) for k, _, c in prof.parts())
    assert parts[hostprof.GRAPHS] == 1 and parts[hostprof.REGIONS] >= 1
    assert hostprof.COMPILE not in parts  # compiled before the profile
    assert hostprof.REGIONS in prof.table() and hostprof.GRAPHS in prof.table()
    assert not hasattr(RegionKernel.__call__, "__wrapped__") and not hasattr(CompiledGraph.__call__, "__wrapped__")


def test_a_profile_loads_no_compiler_module_and_times_a_graph_compiled_inside_it():
    """A profile in a program that has not compiled imports nothing of the compiler (its custom
    ops stay unregistered); a function compiled inside the profile is still split into its
    regions and its other ops, and the wrappers are gone afterwards. A fresh process: this test
    run has compiled already."""
    code = """
import sys, torch
from torch_bridge.neuron import hostprof
x = torch.ones(4, device="neuron")
with hostprof.profile() as prof:
    (x + 1).sum().item()
    before = "torch_bridge.compile.graph" in sys.modules, hasattr(torch.ops.trnsim, "attention")
    f = torch.compile(lambda a: torch.tanh(a) * 2 + 1, backend="neuron")
    f(x).cpu()
    f(x).cpu()
parts = dict((k, c) for k, _, c in prof.parts())
from torch_bridge.compile.graph import CompiledGraph, RegionKernel
from torch._dynamo import convert_frame
s = prof.summary()
print(before, parts.get(hostprof.REGIONS), parts.get(hostprof.GRAPHS), parts.get(hostprof.COMPILE),
      0 < prof.compile <= s[hostprof.COMPILE] and prof.to_dict()["backend_compile_s"] == prof.compile,
      "compile (Dynamo" in prof.table() and "of which the backend, with AOT" in prof.table(),
      any(hasattr(f, "__wrapped__") for f in (CompiledGraph.__call__, RegionKernel.__call__, CompiledGraph.__init__,
                                                convert_frame._compile)))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir())
    assert got.returncode == 0, got.stderr[-2000:]
    # compile: Dynamo's compile of the frame, and inside it the backend's graph (once: the second
    # call runs the compiled graph); the backend's own share (the device's count) is within it
    assert got.stdout.split() == ["(False,", "False)", "2", "2", "2", "True", "True", "False"], got.stdout


def test_a_parts_time_leaves_out_the_fast_paths_datapath(monkeypatch):
    """The fast path's matmuls inside a part (a compiled graph's mm nodes) are the datapath row's:
    a part's seconds leave them out, nested parts' too, so the rest (wall less the parts less the
    datapath) is not counted twice. Fake clocks: a part running 7 s with 5 s of datapath is 2 s."""
    now, dp = [0.0], [0.0]

    def spend(wall, datapath=0.0):
        now[0] += wall
        dp[0] += datapath

    monkeypatch.setattr(hostprof, "_clock", lambda: now[0])
    prof = hostprof.Profile(datapath=lambda: dp[0])
    prof.call("graphs", spend, (7.0, 5.0), {})
    assert prof.seconds["graphs"] == 2.0

    def outer():
        spend(1.0)
        prof.call("regions", spend, (3.0, 2.0), {})  # nested: 1 s its own
        spend(2.0, 1.0)  # a datapath call in the outer part itself

    prof.call("outer", outer, (), {})
    assert prof.seconds["regions"] == 1.0 and prof.seconds["outer"] == 2.0
