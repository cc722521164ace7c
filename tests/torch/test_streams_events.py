"""Streams and events in simulated time: overlap across streams, CUDA-like event semantics."""

import pytest
import torch

from torch_bridge.runtime import runtime


def _work(n: int = 256) -> torch.Tensor:
    a = torch.ones(n, n, device="neuron")
    return a @ a


def _timed(fn) -> float:
    torch.neuron.synchronize()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.neuron.synchronize()
    return start.elapsed_time(end)


def test_elapsed_time_is_simulated_ms_of_the_work():
    one = _timed(lambda: _work())
    two = _timed(lambda: (_work(), _work()))
    assert one > 0 and two == pytest.approx(2 * one, rel=1e-9)


def test_two_streams_overlap_on_the_timeline():
    _work()  # warm the kernel cache (timing does not depend on it, but keep the runs alike)
    serial = _timed(lambda: (_work(), _work()))
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    torch.neuron.synchronize()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    s1.wait_event(start)
    s2.wait_event(start)
    with torch.neuron.stream(s1):
        _work()
    with torch.neuron.stream(s2):
        _work()
    torch.neuron.current_stream().wait_stream(s1)
    torch.neuron.current_stream().wait_stream(s2)
    end.record()
    torch.neuron.synchronize()
    assert start.elapsed_time(end) == pytest.approx(serial / 2, rel=1e-9)


def test_event_wait_orders_streams():
    s = torch.neuron.Stream()
    torch.neuron.synchronize()
    e = torch.neuron.Event()
    _work()
    e.record()
    s.wait_event(e)
    clock = runtime().clocks[0]
    assert clock.ready[s.stream_id] >= e.tick


def test_query_and_synchronize():
    torch.neuron.synchronize()
    e = torch.neuron.Event()
    _work()
    e.record()
    assert not e.query()  # the host issued instantly; the device is still busy in simulated time
    e.synchronize()
    assert e.query()
    s = torch.neuron.current_stream()
    _work()
    assert not s.query()
    s.synchronize()
    assert s.query()


def test_elapsed_time_errors_like_cuda():
    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match=r"^Both events must be created with argument 'enable_timing=True'\.$"):
        a.elapsed_time(b)
    c = torch.neuron.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match=r"^Both events must be recorded"):
        c.elapsed_time(torch.neuron.Event(enable_timing=True))


def test_streams_compare_and_default():
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    assert s.device == torch.device("neuron", 0)
