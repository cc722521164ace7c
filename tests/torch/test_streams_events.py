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
    """Device-bound work (each kernel longer than the host's dispatch): the first kernel starts
    once the host has issued it, the second follows it back to back."""
    a = torch.ones(1024, 1024, device="neuron")
    with torch.neuron.report_scope() as scope:
        a @ a
    kernel_ms = scope.report.row("mm").time_us / 1e3
    dispatch_ms = torch.neuron.config().host.dispatch / 1e9
    assert kernel_ms > dispatch_ms
    one = _timed(lambda: a @ a)
    two = _timed(lambda: (a @ a, a @ a))
    assert one == pytest.approx(dispatch_ms + kernel_ms, rel=1e-9)
    assert two == pytest.approx(dispatch_ms + 2 * kernel_ms, rel=1e-9)


def _on_streams(first, second) -> float:
    """Simulated ms for ``first`` on one stream and ``second`` on another, started together."""
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    torch.neuron.synchronize()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    s1.wait_event(start)
    s2.wait_event(start)
    with torch.neuron.stream(s1):
        first()
    with torch.neuron.stream(s2):
        second()
    torch.neuron.current_stream().wait_stream(s1)
    torch.neuron.current_stream().wait_stream(s2)
    end.record()
    torch.neuron.synchronize()
    return start.elapsed_time(end)


def test_streams_share_the_cores_engines():
    """Two TensorE-bound matmuls on two streams take about as long as one after the other (they
    share TensorE); a TensorE-bound matmul and a DMA-bound add overlap."""
    a = torch.ones(4096, 4096, device="neuron", dtype=torch.bfloat16)
    x = torch.ones(4096, 4096, device="neuron")
    mm, add = (lambda: a @ a), (lambda: x + x)
    with torch.neuron.report_scope() as scope:
        mm()
        add()
    assert scope.report.row("mm").bound == "Tensor" and scope.report.row("add").bound == "DMA/HBM"
    serial_mm = _timed(lambda: (mm(), mm()))
    assert _on_streams(mm, mm) == pytest.approx(serial_mm, rel=0.1)
    serial_mixed = _timed(lambda: (mm(), add()))
    assert _on_streams(mm, add) < 0.8 * serial_mixed


def test_event_wait_orders_streams():
    s = torch.neuron.Stream()
    torch.neuron.synchronize()
    e = torch.neuron.Event()
    _work()
    e.record()
    s.wait_event(e)
    assert runtime().device.stream_ready(0, s.stream_id) >= e.tick


def test_query_and_synchronize():
    torch.neuron.synchronize()
    e = torch.neuron.Event()
    _work()
    e.record()
    assert not e.query()  # the host ran ahead; the device is still busy in simulated time
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


def test_the_report_shows_what_streams_overlapped_and_what_sharing_cost(capsys):
    """Issue 25: streams that ran side by side showed only as device time above elapsed; the
    report now says how much device time overlapped and how much sharing the engines added."""
    from trnsim.cli import print_run_report

    a = torch.ones(1024, 1024, device="neuron")
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        with torch.neuron.stream(s1):
            for _ in range(4):
                a @ a
        with torch.neuron.stream(s2):
            for _ in range(4):
                a @ a
        torch.neuron.synchronize()
    rep = scope.report
    assert rep.overlap_us > 0 and rep.contention_us > 0  # two TensorE-bound streams: they share TensorE
    assert rep.overlap_us == pytest.approx(sum(c.device_us - c.busy_us for c in rep.cores.values()))
    assert rep.to_dict()["overlap_us"] == rep.overlap_us and rep.to_dict()["contention_us"] == rep.contention_us
    print_run_report(rep, "two streams")
    out = capsys.readouterr().out
    assert (f"streams: {rep.overlap_us:,.1f} us of device time ran beside another stream's kernel on the same core" in
            " ".join(out.split("\n")))
    with torch.neuron.report_scope() as one:
        for _ in range(4):
            a @ a
        torch.neuron.synchronize()
    assert one.report.overlap_us == 0 and one.report.contention_us == 0
    print_run_report(one.report, "one stream")
    assert "streams:" not in capsys.readouterr().out


def test_a_neuron_stream_is_a_torch_stream():
    """What takes a ``torch.Stream`` takes it: ``record_stream`` (CUDA code keeps a tensor alive
    for a side stream's use), ``isinstance`` checks; it failed with "argument 'stream' must be
    Stream, not Stream"."""
    s = torch.neuron.Stream(priority=-1)
    assert isinstance(s, torch.Stream) and s.device_type == 20 and s.device == torch.device("neuron", 0)
    assert s.priority == -1 and s.stream_id != 0
    x = torch.ones(4, device="neuron")
    with torch.neuron.stream(s):
        y = x * 2
        y.record_stream(torch.neuron.current_stream())
        assert torch.neuron.current_stream() == s
    x.record_stream(s)
    assert torch.equal(y.cpu(), torch.full((4,), 2.0))
    assert torch.neuron.default_stream().stream_id == 0 and torch.neuron.default_stream() != s
