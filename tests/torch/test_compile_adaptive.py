"""Adaptive eager: a launch-bound eager loop of small ops, the same values, the host's dispatches
batched: the step's sequence is issued op by op once (the capture), then replayed as one graph
launch per step, so the device stops waiting on the host."""

from __future__ import annotations

import torch


def _step(x: torch.Tensor, w: torch.Tensor) -> float:
    for _ in range(4):
        x = torch.tanh(x @ w) * 0.5 + x
    return x.sum().item()  # the host reads a value: a synchronisation, the end of a sequence


def _run(adaptive: bool) -> tuple[list[float], object]:
    torch.manual_seed(0)
    x = torch.randn(32, 64).to("neuron")
    w = (torch.randn(64, 64) * 0.1).to("neuron")
    _step(x, w)  # kernels simulated, the first sequence captured
    with torch.neuron.adaptive_eager(adaptive):
        _step(x, w)
        torch.neuron.synchronize()
        with torch.neuron.report_scope() as scope:
            vals = [_step(x, w) for _ in range(3)]
            torch.neuron.synchronize()
    return vals, scope.report


def test_adaptive_eager_replays_steps_as_graph_launches():
    plain_vals, plain = _run(False)
    vals, rep = _run(True)
    assert vals == plain_vals  # bit for bit: only the host's dispatches change
    assert rep.launches == plain.launches
    assert plain.graph_launches == 0 and rep.graph_launches == 3  # one per step
    assert rep.dispatches == 3 and plain.dispatches == plain.launches
    assert plain.rows[0].bound == "launch" or plain.host_wait_us > plain.device_us / 2  # launch-bound
    assert rep.elapsed_us < 0.5 * plain.elapsed_us
    assert rep.host_wait_us < plain.host_wait_us


def test_adaptive_eager_is_off_by_default_and_restored():
    dev = torch.neuron.report  # noqa: F841  (the device exists)
    from torch_bridge.runtime import runtime

    assert runtime().device.adaptive is False
    with torch.neuron.adaptive_eager():
        assert runtime().device.adaptive is True
    assert runtime().device.adaptive is False
