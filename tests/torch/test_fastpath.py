"""The native fast path of eager ops (torch_bridge.fastpath, csrc/neuron.cpp): it serves tiny
ops without Python, steps aside whenever a launch depends on more than its op and cost, and the
device model sees exactly what the Python fallback would have launched (same rows, same cycles,
same memory figures, same values)."""

import contextlib
import gc

import pytest
import torch

from torch_bridge import fastpath
from torch_bridge.runtime import runtime


fast = fastpath.turned

def served(fn) -> int:
    """How many ops of ``fn()`` the fast path served (each signature is costed once first)."""
    fn()
    torch.neuron.synchronize()
    before = fastpath.hits()
    fn()
    return fastpath.hits() - before


def tensors():
    return torch.ones(16, device="neuron"), torch.full((16,), 0.5, device="neuron")


def test_tiny_ops_take_the_fast_path():
    x, y = tensors()
    assert served(lambda: x + 1) == 1
    assert served(lambda: x * y) == 1
    assert served(lambda: torch.relu(x)) == 1
    assert served(lambda: x.sum()) == 1
    assert served(lambda: x.add_(y)) == 1  # in place: add.out with out=self
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1, rtol=0, atol=0)


def test_a_view_is_a_host_op_without_python():
    x, _ = tensors()
    x.view(4, 4)
    before = torch.neuron.report().host_ops.get("view", 0)
    v = x.view(4, 4)
    assert torch.neuron.report().host_ops["view"] == before + 1
    assert v.device == x.device and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_it_steps_aside():
    x, y = tensors()
    dev = runtime().device
    assert served(lambda: x * y) == 1
    with fast(False):
        assert served(lambda: x * y) == 0
    with torch.neuron.adaptive_eager():
        assert served(lambda: x * y) == 0
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        assert served(lambda: x * y) == 0
    prev = dev.set_context("model.py:1", -1)
    try:
        assert served(lambda: x * y) == 0
    finally:
        dev.restore_context(prev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert served(lambda: x * y) == 0
    torch.neuron.memory._record_memory_history()
    try:
        assert served(lambda: x * y) == 0
    finally:
        torch.neuron.memory._record_memory_history(enabled=None)
    g = torch.Generator("neuron")
    assert served(lambda: torch.randn(16, device="neuron", generator=g)) == 0  # random
    assert served(lambda: torch.nn.functional.dropout(x, 0.5)) == 0  # random without a generator
    out = torch.empty(0, device="neuron")
    assert served(lambda: torch.mul(x, y, out=out)) == 0  # an empty out= Python computes fresh
    assert served(lambda: x * y) == 1  # and back once nothing is in the way


def test_python_errors_come_through_unchanged():
    x, _ = tensors()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x * torch.ones(16)
    with pytest.raises(RuntimeError, match="must match the size"):
        x * torch.ones(3, device="neuron")


@contextlib.contextmanager
def _room(nbytes: int):
    """Device 0's capacity set to the bytes in use plus ``nbytes`` (no host memory spent),
    restored after. An earlier test's ended timing-only run's dead tensors are released first,
    not mid-test (a refused allocation releases them and fits)."""
    from torch_bridge.eager import memory

    stats = memory.pool.devices[0]
    capacity = stats.capacity
    memory.settle()
    stats.row[memory._CAPACITY] = stats.allocated + nbytes
    try:
        yield
    finally:
        stats.row[memory._CAPACITY] = capacity


def test_out_of_memory_is_the_python_path_s_error():
    x, _ = tensors()
    x + 1
    x + 1  # costed: the next one takes the fast path
    with _room(64):  # room for one more 16-float result
        hits = fastpath.hits()
        keep = x + 1
        assert fastpath.hits() == hits + 1
        before = torch.neuron.memory_stats()["num_ooms"]
        with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: tried to allocate 64 bytes"):
            x + 1
        assert torch.neuron.memory_stats()["num_ooms"] == before + 1
        del keep
        assert (x + 1).device == x.device


def _program(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(5, 8).to("neuron")
    for _ in range(3):
        loss = (model(data).softmax(-1) * 3 + 1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        (data.view(40)[:8] * 2).relu_().sum()
        (data.to("neuron:1") + 1).mul_(2).sum()  # another core's timeline
        # item(): the host waits for a core's work (served natively, the wait taken from the log in its place)
        seen = loss.item() + (data.to("neuron:1") * 2).sum().item()
    return [p.detach().cpu() for p in model.parameters()] + [loss.detach().cpu(), torch.tensor(seen)]


@contextlib.contextmanager
def _in_graph():
    """The program as a compiled graph's ops run: collected into graph launches, with a muted
    block (a fused region's ops, charged another way) inside."""
    dev = runtime().device
    with dev.graph():
        x = torch.ones(16, device="neuron")
        x * 2
        with dev.muted():
            (x + 3).relu_()
        yield


def _run(on: bool, block=contextlib.nullcontext, program=None):
    program = program or _program
    with fast(on):
        with block():
            program(0)  # cost every signature first: both runs then launch the same cached costs
        torch.neuron.synchronize()
        torch.neuron.reset_peak_memory_stats()
        hits = fastpath.hits()
        with torch.neuron.report_scope(trace=True) as scope:
            with block():
                values = program(0)
            torch.neuron.synchronize()
        mem = torch.neuron.memory_stats()
        return values, scope.report, mem, fastpath.hits() - hits


@pytest.mark.parametrize("block", [contextlib.nullcontext, _in_graph], ids=["eager", "graph"])
def test_same_rows_cycles_memory_and_values_as_the_python_path(block):
    """... in eager mode and inside graph captures: the fast path's launches there are collected
    into the capture, in order with Python's (one graph launch per run), or dropped when muted."""
    slow_values, slow, slow_mem, slow_hits = _run(False, block)
    fast_values, quick, fast_mem, fast_hits = _run(True, block)
    assert slow_hits == 0 and fast_hits > 50
    if block is _in_graph:
        assert quick.graph_launches == slow.graph_launches > 0
    for a, b in zip(slow_values, fast_values):
        assert torch.equal(a, b)
    assert quick.rows == slow.rows
    assert quick.host_ops == slow.host_ops
    assert (quick.elapsed_us, quick.device_us, quick.host_us, quick.dispatches) == \
        (slow.elapsed_us, slow.device_us, slow.host_us, slow.dispatches)
    assert quick.cores == slow.cores
    def timeline(rep):  # relative to the block's first launch: the two runs start at different ticks
        t0 = rep.events[0].issued
        return [(e.core, e.stream, e.op, e.kernel, e.issued - t0, e.start - t0, e.end - t0, e.source, e.call)
                for e in rep.events]

    assert timeline(quick) == timeline(slow)
    for key in ("allocated_bytes.all.peak", "allocated_bytes.all.current", "allocation.all.current",
                "allocated_bytes.small_pool.peak"):
        assert fast_mem[key] == slow_mem[key], key


def _composite_program(seed: int):
    """Composite ops whose CPU kernels write an out= tensor without memory (``at::empty({0})``)
    the result then lives in, and index ops whose indices are a ``Tensor?[]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g).to("neuron")
    mask = x > 0
    rows = torch.tensor([4, 0, 4, 2]).to("neuron")
    out = [torch.arange(7, device="neuron"), torch.arange(1.0, 2.0, 0.25, device="neuron"),
           torch.logical_not(mask), ~mask, x[mask], x[rows], x[rows, 1:], x[:, rows[:2]], x[mask.any(1)]]
    user = torch.empty(0, device="neuron", dtype=torch.int64)
    torch.arange(3, 9, out=user)  # a caller's own empty out adopts the result too
    out.append(user)
    y = x.clone()
    y[rows] = 2.5  # index_put_ through a Tensor?[] of the device
    y.index_put_((rows,), torch.ones(4, 5, device="neuron"), accumulate=True)
    out.append(y)
    return [t.cpu() for t in out] + [torch.tensor([t.stride() for t in out[:2]])]


def test_composite_out_ops_and_tensor_lists_are_served_as_the_python_path():
    """arange, logical_not, ~, indexing by masks and by index tensors, index_put_: served natively
    (the out= tensor adopts the result's memory, as Python's set_ does), with the Python path's
    values, rows, cycles and memory figures."""
    slow_values, slow, slow_mem, slow_hits = _run(False, program=_composite_program)
    fast_values, quick, fast_mem, fast_hits = _run(True, program=_composite_program)
    assert slow_hits == 0 and fast_hits >= 12
    for a, b in zip(slow_values, fast_values, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert _figures(quick) == _figures(slow)
    for key in ("allocated_bytes.all.peak", "allocated_bytes.all.current", "allocation.all.current"):
        assert fast_mem[key] == slow_mem[key], key
    x = torch.randn(6, 5).to("neuron")
    assert served(lambda: torch.arange(7, device="neuron")) == 1
    assert served(lambda: torch.logical_not(x > 0)) == 2
    assert served(lambda: x[x > 0]) == 3  # gt, the mask's nonzero, index


def _second_call_figures(fn):
    """The report figures of ``fn()``'s second call (the first costs its signatures)."""
    fn()
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        fn()
        torch.neuron.synchronize()
    return _figures(scope.report)


def test_cat_is_claimed_directly_with_the_composite_s_rows_and_cpu_s_values():
    """torch.cat is one device dispatch (it came as its composite's empty + cat.out, ~3x CPU's time
    for a KV cache's cat) with the same report rows and cycles as that explicit empty + cat.out,
    and CPU's values, dtypes, strides and errors: promotion, a legacy empty operand, channels_last
    and mixed layouts, transposed operands."""
    ts = [torch.randn(4, 3, 5).to("neuron"), torch.randn(4, 2, 5).to("neuron")]

    composite = _second_call_figures(lambda: torch.ops.aten.cat.out(ts, 1, out=torch.empty(4, 5, 5, device="neuron")))
    assert _second_call_figures(lambda: torch.cat(ts, 1)) == composite
    assert served(lambda: torch.cat(ts, 1)) == 1
    with torch.profiler.profile() as prof:
        torch.cat(ts, 1)
    names = {e.name for e in prof.events()}
    assert "aten::cat" in names and "aten::empty" not in names  # not the composite's empty + cat.out
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    cl = torch.channels_last
    cases = [([a.contiguous(memory_format=cl), b.contiguous(memory_format=cl)], 1),
             ([a.contiguous(memory_format=cl), b], 1),
             ([torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bfloat16)], 0),
             ([torch.randn(2, 3), torch.empty(0), torch.randn(1, 3)], 0),
             ([torch.randn(2, 3), torch.randn(2, 1)], -1),
             ([torch.randn(3, 2).t(), torch.randn(4, 2).t()], 1)]
    for operands, dim in cases:
        want = torch.cat(operands, dim)
        got = torch.cat([t.to("neuron") for t in operands], dim)
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(got.cpu(), want)
    msg = r"^Sizes of tensors must match except in dimension 0. Expected size 3 but got size 4 for tensor number 1"
    with pytest.raises(RuntimeError, match=msg):
        torch.cat([torch.randn(2, 3), torch.randn(2, 4)])
    with pytest.raises(RuntimeError, match=msg):
        torch.cat([torch.randn(2, 3).to("neuron"), torch.randn(2, 4).to("neuron")])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([torch.randn(2).to("neuron"), torch.randn(2)])


# The ops a generate() step made most often through their composite's empty + op.out (stopping
# criteria, masks, rotary embeddings), each as its functional call and that explicit round trip.
_DIRECT_CASES = {
    "isin": (lambda x, n: torch.isin(n, n[:3]),
             lambda x, n: torch.ops.aten.isin.Tensor_Tensor_out(n, n[:3], out=_empty(n.shape, torch.bool))),
    "all": (lambda x, n: torch.all(x), lambda x, n: torch.ops.aten.all.all_out(x, out=_empty((), torch.bool))),
    "all.dim": (lambda x, n: torch.all(x, 1),
                lambda x, n: torch.ops.aten.all.out(x, 1, out=_empty((x.shape[0],), torch.bool))),
    "any": (lambda x, n: torch.any(x), lambda x, n: torch.ops.aten.any.all_out(x, out=_empty((), torch.bool))),
    "any.dim": (lambda x, n: torch.any(x, 1),
                lambda x, n: torch.ops.aten.any.out(x, 1, out=_empty((x.shape[0],), torch.bool))),
    "isneginf": (lambda x, n: torch.isneginf(x),
                 lambda x, n: torch.ops.aten.isneginf.out(x, out=_empty(x.shape, torch.bool))),
    "cos": (lambda x, n: torch.cos(x), lambda x, n: torch.ops.aten.cos.out(x, out=_empty(x.shape, x.dtype))),
    "sin": (lambda x, n: torch.sin(x), lambda x, n: torch.ops.aten.sin.out(x, out=_empty(x.shape, x.dtype))),
    "argmax": (lambda x, n: torch.argmax(x, -1),
               lambda x, n: torch.ops.aten.argmax.out(x, -1, out=_empty((x.shape[0],), torch.int64))),
    "bitwise_not": (lambda x, n: torch.bitwise_not(n),
                    lambda x, n: torch.ops.aten.bitwise_not.out(n, out=_empty(n.shape, n.dtype))),
    "eq.Scalar": (lambda x, n: torch.eq(n, 2),
                  lambda x, n: torch.ops.aten.eq.Scalar_out(n, 2, out=_empty(n.shape, torch.bool))),
}


def _empty(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="neuron")


@pytest.mark.parametrize("name", sorted(_DIRECT_CASES))
def test_generate_s_frequent_functional_ops_are_claimed_with_the_composite_s_rows_and_cpu_s_values(name):
    """isin, all, any, isneginf, cos, sin, argmax, bitwise_not and eq.Scalar are one device
    dispatch each (they came as their composite's empty + op.out), with the same report rows and
    cycles as that explicit round trip, and CPU's values, dtypes and strides: float32, bfloat16 and
    int inputs, transposed, channels-last and empty ones."""
    functional, round_trip = _DIRECT_CASES[name]
    x, n = torch.randn(8, 6).to("neuron"), torch.randint(0, 4, (8, 6)).to("neuron")

    assert _second_call_figures(lambda: functional(x, n)) == _second_call_figures(lambda: round_trip(x, n))
    assert served(lambda: functional(x, n)) == 1

    def empties(*args):
        with torch.profiler.profile() as prof:
            functional(*args)
        return [e.name for e in prof.events()].count("aten::empty")

    assert empties(x, n) == empties(x.cpu(), n.cpu())  # CPU's own kernel's, not the composite's empty + op.out
    g = torch.Generator().manual_seed(5)
    floats = torch.randn(2, 3, 4, 5, generator=g)
    floats[0, 1, 2] = float("-inf")
    ints = torch.randint(-3, 4, (2, 3, 4, 5), generator=g)
    cl = torch.channels_last
    for x, n in [(floats, ints), (floats.bfloat16(), ints.to(torch.int16)),
                 (floats.transpose(1, 3), ints.transpose(1, 3)),
                 (floats.contiguous(memory_format=cl), ints.contiguous(memory_format=cl)),
                 (floats[:, :0], ints[:, :0])]:
        if name == "argmax" and x.shape[-1] == 0:
            continue
        want = functional(x, n)
        got = functional(x.to("neuron"), n.to("neuron"))
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)  # cos(-inf) is nan


def test_claimed_functional_ops_raise_cpu_s_errors():
    """Claimed, argmax of an empty tensor, bitwise_not of a float, all over a dim out of range and cos into
    an int out= raise CPU's error type with CPU's message (a kernel CPU lacks is also named as the
    device's)."""
    cases = [(lambda d: torch.argmax(torch.empty(0, device=d)), IndexError, "numel"),
             (lambda d: torch.bitwise_not(torch.ones(3, device=d)), RuntimeError, "not implemented for 'Float'"),
             (lambda d: torch.all(torch.ones(3, 2, device=d), 2), IndexError, "Dimension out of range"),
             (lambda d: torch.cos(torch.ones(3, device=d), out=torch.empty(3, dtype=torch.int64, device=d)),
              RuntimeError, "result type")]
    for fn, exc, part in cases:
        with pytest.raises(exc, match=part) as want:
            fn("cpu")
        with pytest.raises(exc) as got:
            fn("neuron")
        assert type(got.value) is type(want.value) and str(want.value) in str(got.value)  # ours names the device


def test_a_composite_out_that_does_not_fit_is_the_python_path_s_out_of_memory():
    torch.arange(100, device="neuron")
    torch.arange(100, device="neuron")  # costed and served: the next one would be too
    with _room(64):  # no room for 800 bytes
        hits, before = fastpath.hits(), torch.neuron.memory_stats()["num_ooms"]
        with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: tried to allocate 800 bytes"):
            torch.arange(100, device="neuron")
        assert fastpath.hits() == hits and torch.neuron.memory_stats()["num_ooms"] == before + 1
    assert torch.equal(torch.arange(100, device="neuron").cpu(), torch.arange(100))


def _figures(rep):
    return (rep.rows, rep.host_ops, rep.cores, rep.elapsed_us, rep.device_us, rep.host_us, rep.dispatches)


def _timelines(dev, h0: int, cores=(0, 1)):
    """Two cores' bookings, in-flight ends, ready and busy ticks (from host tick ``h0``) and
    streams: what the device's next launches are placed against."""
    return [([(b[0], b[1] - h0, b[2] - h0, b[3]) for b in c.bookings], [t - h0 for t in c.inflight],
             c.ready[0] - h0, c.busy_until - h0, sorted(c.streams)) for c in (dev.cores[i] for i in cores)]


def test_natively_placed_launches_leave_the_figures_of_the_python_loop(monkeypatch):
    """Without a trace the device lets the native log place its launches (Device._place, not a
    Python loop per launch): every report figure is the loop's and the Python path's, in an outer
    scope and an inner one (two recorders), with two cores' timelines; the placements' rows are
    added when a report reads them, or whenever a few are deferred (Recorder.defer_rows)."""
    import trnsim.device as device
    from trnsim.device import recorder

    dev = runtime().device

    def run(on: bool, place_min: int, defer_max: int = recorder.DEFER_MAX):
        monkeypatch.setattr(device, "PLACE_MIN", place_min)
        monkeypatch.setattr(recorder, "DEFER_MAX", defer_max)
        with fast(on):
            _program(1)
            torch.neuron.synchronize()
            h0 = dev.host
            with torch.neuron.report_scope() as outer:
                _program(1)
                with torch.neuron.report_scope() as inner:
                    values = _program(1)
                    torch.neuron.synchronize()
                _program(1)
                torch.neuron.synchronize()
        return values, outer.report, inner.report, _timelines(dev, h0)

    placed = run(True, 2)
    folding = run(True, 2, defer_max=1)  # every placement's rows added at once
    looped = run(True, 10 ** 9)
    slow = run(False, 2)
    for other in (folding, looped, slow):
        for a, b in zip(placed[0], other[0]):
            assert torch.equal(a, b)
        assert _figures(placed[1]) == _figures(other[1])
        assert _figures(placed[2]) == _figures(other[2])
        assert placed[3] == other[3]  # the cores' in-flight kernels and bookings (streams side by side share them)


@pytest.mark.parametrize("trace", [False, True])
def test_captured_launches_taken_in_bulk_leave_the_figures_of_the_python_loop(monkeypatch, trace):
    """Inside graph captures (a compiled graph's run) the device takes the log's captured launches
    and host ops in bulk (Device._take_captured), not one entry at a time: the same values, report
    figures and graph launches as the loop, with eager launches logged between the captures."""
    import trnsim.device as device

    def run(captured_min: int):
        monkeypatch.setattr(device, "CAPTURED_MIN", captured_min)
        with fast(True):
            _program(1)
            torch.neuron.synchronize()
            with torch.neuron.report_scope(trace=trace) as scope:
                with _in_graph():
                    values = _program(1)
                values += _program(2)  # eager, between graphs
                with _in_graph():
                    values += _program(3)
                torch.neuron.synchronize()
        return values, scope.report

    bulk, loop = run(1), run(10 ** 9)
    for a, b in zip(bulk[0], loop[0]):
        assert torch.equal(a, b)
    assert _figures(bulk[1]) == _figures(loop[1])
    assert bulk[1].graph_launches == loop[1].graph_launches > 0 and bulk[1].host_ops


def _native_places(monkeypatch, what):
    """``what(got)`` of each native placement that took entries (NativeLog.place), in a list that
    fills as the test runs."""
    from torch_bridge.eager.fastpath import NativeLog

    place = NativeLog.place
    seen = []

    def counted(self, *args):
        got = place(self, *args)
        if got is not None:
            seen.append(what(got))
        return got

    monkeypatch.setattr(NativeLog, "place", counted)
    return seen


def _graphs(seed: int):
    """Graph captures as a compiled program runs them, with every launch of each in the log: fast
    ops on two cores (runs of one and of several launches per core), host ops (views) among them,
    an empty capture, one with a muted block inside, one with a recorded block inside (its host
    ops learned, not counted), and eager launches between the captures."""
    dev = runtime().device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=g).to("neuron:2")  # (cores no other test gives a second stream: the
    y = torch.randn(64, generator=g).to("neuron:3")  # native placement takes a core's launches only then)
    out = []
    for _ in range(3):
        with dev.graph():
            a = (x * 2 + 1).relu()
            b = (y * 3).exp()  # another core: a run of its own
            c = a.view(8, 8).t().exp().t().reshape(64) + x  # host ops inside the capture
            b = b - y  # core 1 again
        with dev.graph():
            c = c + 1
            with dev.recorded():
                c.view(4, 16).t()  # host ops learned by the recorded block
            c = c.view(2, 32).view(64)
        with dev.graph():
            pass  # launches nothing
        with dev.graph():  # a muted block inside: its launches dropped at its end in the log
            c = c * 2
            with dev.muted():
                (c + 1).neg_()
            c = c - 1
        d = (c * c).sum()  # eager, between the captures
        with dev.graph():
            e = d + 1  # a run of one launch
        out += [c, d, e, b]
    return [t.cpu() for t in out]


def test_a_graph_s_launches_placed_at_its_close_in_the_log_leave_the_figures_of_the_block_s_end(monkeypatch):
    """A capture whose launches are all in the log is closed there (NativeLog.close) and issued
    (a muted one's dropped) when the log is drained, natively (Device._place) or by the Python
    loop, instead of at the block's end: the same values, report figures, graph launches and
    cores' timelines as the block's end issuing them (the close off) and as the Python path; no
    capture is left behind."""
    import trnsim.device as device
    from torch_bridge.eager.fastpath import NativeLog

    dev = runtime().device
    close = NativeLog.close
    # (closes, graph launches) of each native placement
    placed_natively = _native_places(monkeypatch, lambda got: (got[6], sum(u[13] for u in got[2])))

    def run(on: bool, place_min: int, closes: bool):
        monkeypatch.setattr(device, "PLACE_MIN", place_min)
        monkeypatch.setattr(NativeLog, "close", close if closes else lambda self, token, keep=True: False)
        with fast(on):
            _graphs(1)
            torch.neuron.synchronize()
            h0 = dev.host
            with torch.neuron.report_scope() as outer:
                _graphs(1)
                with torch.neuron.report_scope() as inner:
                    values = _graphs(1)
                    torch.neuron.synchronize()
                torch.neuron.synchronize()
        assert not dev._tokens and not dev._closed
        return values, outer.report, inner.report, _timelines(dev, h0, (2, 3))

    placed = run(True, 2, True)
    assert placed[1].graph_launches > 0
    # every capture of its three programs (6 a round, 3 rounds each, the recorded block's too) closed,
    # and all but the round's capture around the recorded block placed natively (its learned host ops
    # are the loop's); each graph's runs of 2+ launches (4 a round) as graph launches
    assert placed[1].host_ops
    assert sum(c for c, _ in placed_natively) >= 45 and sum(g for _, g in placed_natively) >= 36
    for other in (run(True, 10 ** 9, True), run(True, 2, False), run(False, 2, True)):
        for a, b in zip(placed[0], other[0], strict=True):
            assert torch.equal(a, b)
        for rep, orep in ((placed[1], other[1]), (placed[2], other[2])):
            assert _figures(rep) == _figures(orep)
            assert rep.graph_launches == orep.graph_launches
        assert placed[3] == other[3]


def _after_a_stream(seed: int):
    """Eager launches on the default stream of a core that has run a kernel on another stream
    (the first round's matmul overlaps them; later rounds' do not), and the host waiting for the
    core's work (item(): every stream's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=g).to("neuron:3")
    s = torch.neuron.Stream("neuron:3")
    seen = 0.0
    for _ in range(3):
        with torch.neuron.stream(s):
            y = x @ x  # another stream
        z = x
        for _ in range(12):
            z = (z * 0.5 + 1).relu()
        seen += z.sum().item() + y[0, 0].item()
        torch.neuron.synchronize()
    return [z.cpu(), torch.tensor(seen)]


def test_a_core_that_ran_another_stream_is_still_placed_natively(monkeypatch):
    """Once a core has run a kernel on a second stream, its default stream's launches are still
    placed by the native log where they start after that stream's kernels end (nothing to share
    the engines with), and by the Python loop where they would run beside them: the same values,
    report figures and cores' timelines as the Python loop and the Python path."""
    import trnsim.device as device

    dev = runtime().device
    natively = _native_places(monkeypatch, lambda got: sum(u[4] for u in got[2] if u[0] == 3))  # on core 3

    def run(on: bool, place_min: int):
        monkeypatch.setattr(device, "PLACE_MIN", place_min)
        with fast(on):
            _after_a_stream(1)
            torch.neuron.synchronize()
            h0 = dev.host
            with torch.neuron.report_scope() as scope:
                values = _after_a_stream(1)
                torch.neuron.synchronize()
        return values, scope.report, _timelines(dev, h0, (3,))[0][:4]  # (each run makes its own streams)

    placed = run(True, 2)
    assert len(dev.cores[3].streams) > 1 and sum(natively) >= 24
    for other in (run(True, 10 ** 9), run(False, 2)):
        for a, b in zip(placed[0], other[0], strict=True):
            assert torch.equal(a, b)
        assert _figures(placed[1]) == _figures(other[1])
        assert placed[2] == other[2]


def test_fast_blocks_are_counted_listed_and_freed():
    x, _ = tensors()
    x + 1
    x + 1
    before = torch.neuron.memory_allocated()
    hits = fastpath.hits()
    z = x + 1
    assert fastpath.hits() == hits + 1
    assert torch.neuron.memory_allocated() == before + 64
    assert "64" in torch.neuron.memory_summary() or torch.neuron.memory_summary()
    from torch_bridge import memory

    assert any(b[2] == z.untyped_storage().data_ptr() for b in memory.live_blocks())
    del z
    assert torch.neuron.memory_allocated() == before


def _adamw_lists(device: str):
    torch.manual_seed(1)
    params = [torch.randn(s).to(device) for s in ((8, 4), (4,), (3, 5))]
    grads = [torch.randn(p.shape).to(device) for p in params]
    return params, grads


def _adamw_update(params, grads, avgs, sqs, device: str):
    """AdamW's and clip_grad_norm_'s in-place foreach calls (torch.optim's multi-tensor path)."""
    torch._foreach_mul_(grads, torch.tensor(0.5).to(device))  # clipping's coefficient, a 0-dim tensor
    torch._foreach_mul_(params, 1 - 1e-3 * 0.01)
    torch._foreach_lerp_(avgs, grads, 0.1)
    torch._foreach_mul_(sqs, 0.999)
    torch._foreach_addcmul_(sqs, grads, grads, 1 - 0.999)
    denom = torch._foreach_sqrt(sqs)  # functional: Python's (it relabels a list of fresh results)
    torch._foreach_div_(denom, [0.3, 0.7, 0.9])
    torch._foreach_add_(denom, 1e-8)
    torch._foreach_addcdiv_(params, avgs, denom, [-1e-3, -2e-3, -3e-3])


def test_in_place_foreach_ops_are_served_with_python_s_values_costs_and_memory():
    params, grads = _adamw_lists("neuron")
    avgs = [torch.zeros_like(p) for p in params]
    sqs = [torch.zeros_like(p) for p in params]
    step = lambda: _adamw_update(params, grads, avgs, sqs, "neuron")  # noqa: E731
    step()  # every signature costed once
    torch.neuron.synchronize()
    hits = fastpath.hits()
    allocated = torch.neuron.memory_allocated()
    with torch.neuron.report_scope() as fast_scope:
        step()
        torch.neuron.synchronize()
    # 8 in-place foreach ops, sqrt's result list and the 0-dim coefficient's cast
    assert fastpath.hits() - hits >= 9
    assert torch.neuron.memory_allocated() == allocated  # nothing kept: sqrt's results are freed again
    with fast(False), torch.neuron.report_scope() as slow_scope:
        step()
        torch.neuron.synchronize()
    assert fast_scope.report.rows == slow_scope.report.rows
    assert fast_scope.report.device_us == slow_scope.report.device_us
    # the same values as CPU's foreach kernels (three identical updates)
    cpu_params, cpu_grads = _adamw_lists("cpu")
    cpu_avgs = [torch.zeros_like(p) for p in cpu_params]
    cpu_sqs = [torch.zeros_like(p) for p in cpu_params]
    for _ in range(3):
        _adamw_update(cpu_params, cpu_grads, cpu_avgs, cpu_sqs, "cpu")
    for a, b in zip(params + avgs + sqs + grads, cpu_params + cpu_avgs + cpu_sqs + cpu_grads):
        assert torch.equal(a.cpu(), b)


def _functional_foreach_calls(params, grads):
    return [lambda: torch._foreach_sqrt(params), lambda: torch._foreach_add(params, grads, alpha=0.5),
            lambda: torch._foreach_mul(grads, 3.0), lambda: torch._foreach_norm(grads),
            lambda: torch._foreach_addcmul(params, grads, grads, [0.5] * len(params)),
            lambda: torch._foreach_maximum(params, grads)]


def test_functional_foreach_ops_are_served_with_python_s_values_costs_and_memory():
    """A _foreach_* op that returns a fresh list (Adam's sqrt, clipping's norm) is served natively:
    one CPU foreach kernel over the aliases, each result counted and adopted, one launch; the same
    values, report rows, device time and bytes allocated as Python's path."""
    params, grads = _adamw_lists("neuron")
    params = [p.abs() for p in params]
    cpu_params, cpu_grads = [p.cpu() for p in params], [g.cpu() for g in grads]
    for f, cpu_f in zip(_functional_foreach_calls(params, grads), _functional_foreach_calls(cpu_params, cpu_grads)):
        assert served(f) == 1
        torch.neuron.synchronize()
        before = torch.neuron.memory_stats()["allocated_bytes.all.allocated"]
        with torch.neuron.report_scope() as fast_scope:
            quick = f()
            torch.neuron.synchronize()
        fast_made = torch.neuron.memory_stats()["allocated_bytes.all.allocated"] - before
        with fast(False), torch.neuron.report_scope() as slow_scope:
            before = torch.neuron.memory_stats()["allocated_bytes.all.allocated"]
            slow = f()
            torch.neuron.synchronize()
            slow_made = torch.neuron.memory_stats()["allocated_bytes.all.allocated"] - before
        assert fast_made == slow_made == sum(t.untyped_storage().nbytes() for t in quick)
        assert all(t.device == torch.device("neuron:0") for t in quick)
        for a, b, c in zip(quick, slow, cpu_f()):
            assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c)
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert fast_scope.report.rows == slow_scope.report.rows
        assert fast_scope.report.device_us == slow_scope.report.device_us
        del quick, slow


def test_foreach_steps_aside_for_what_python_handles():
    params, grads = _adamw_lists("neuron")
    assert served(lambda: torch._foreach_add_(params, grads)) == 1
    assert served(lambda: torch._foreach_copy_(params, grads)) == 0  # may copy from host tensors
    assert served(lambda: torch._foreach_add(params, grads)) == 1  # functional: a list of fresh results
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add(params, [g.cpu() for g in grads])  # stepped aside: Python's error
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add_(params, [g.cpu() for g in grads])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add_(params, [g.to("neuron:1") for g in grads])
    with pytest.raises(RuntimeError):  # the CPU kernel's own error, in Python's words
        torch._foreach_add_(params, grads[:2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert served(lambda: torch._foreach_add_(params, grads)) == 0


def _matmuls(dtype=torch.float32):
    torch.manual_seed(2)
    a, b, c = torch.randn(33, 70), torch.randn(70, 5), torch.randn(5)
    an, bn, cn = (t.to(dtype).to("neuron") for t in (a, b, c))
    a3, b3 = (torch.randn(*s).to(dtype).to("neuron") for s in ((3, 9, 130), (3, 130, 7)))
    return [lambda: torch.mm(an, bn), lambda: torch.mm(bn.t(), an.t()), lambda: torch.addmm(cn, an, bn),
            lambda: torch.addmm(cn.view(1, 5), an, bn, beta=0.5, alpha=2), lambda: torch.addmm(cn, an, bn, beta=0),
            lambda: torch.bmm(a3, b3), lambda: torch.bmm(b3.transpose(1, 2), a3.transpose(1, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmuls_run_the_datapath_natively_with_python_s_values_costs_and_memory(dtype):
    """mm/addmm/bmm of float32, bfloat16 and float16 operands: the datapath's float32 PSUM result
    (addmm's bias added in float32), rounded to the operands' dtype, bit for bit as Python's path
    computes it, with its costs and memory."""
    calls = _matmuls(dtype)
    for f in calls:
        assert served(f) >= 1
        torch.neuron.synchronize()
        allocated = torch.neuron.memory_allocated()
        with torch.neuron.report_scope() as fast_scope:
            quick = f()
            torch.neuron.synchronize()
        assert torch.neuron.memory_allocated() == allocated + quick.untyped_storage().nbytes()
        with fast(False), torch.neuron.report_scope() as slow_scope:
            slow = f()
            torch.neuron.synchronize()
        assert torch.equal(_bits(quick.cpu()), _bits(slow.cpu()))  # bit for bit: the same datapath call
        assert (quick.shape, quick.stride(), quick.dtype, quick.device) == (slow.shape, slow.stride(), slow.dtype,
                                                                            slow.device)
        assert fast_scope.report.rows == slow_scope.report.rows
        assert fast_scope.report.device_us == slow_scope.report.device_us
        del quick, slow
    before = fastpath.datapath_seconds()
    calls[0]()
    assert fastpath.datapath_seconds() > before


def test_matmuls_step_aside_for_what_python_handles(monkeypatch):
    x = torch.randn(8, 8, device="neuron")
    mm = lambda: x @ x  # noqa: E731
    assert served(mm) == 1
    xb = x.bfloat16()
    assert served(lambda: torch.mm(xb, xb)) == 1  # (its PSUM result rounded to bf16 natively)
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):  # CPU's error, from Python
        torch.mm(xb, x)
    with pytest.raises(RuntimeError, match="self and mat2 must have the same dtype"):
        torch.addmm(x[0], xb, xb)
    xd = x.double()
    assert served(lambda: torch.mm(xd, xd)) == 0  # not a datapath dtype
    monkeypatch.setenv("TRNSIM_NATIVE", "0")  # the numpy reference
    assert served(mm) == 0
    monkeypatch.delenv("TRNSIM_NATIVE")
    monkeypatch.setenv("TRNSIM_NATIVE_THREADS", "two")
    from trnsim.config import ConfigError

    with pytest.raises(ConfigError, match="TRNSIM_NATIVE_THREADS='two'"):
        mm()
    monkeypatch.setenv("TRNSIM_NATIVE_THREADS", "2")
    assert served(mm) == 1
    monkeypatch.delenv("TRNSIM_NATIVE_THREADS")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(x, torch.randn(3, 3, device="neuron"))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(x, x.to("neuron:1"))
    assert served(lambda: torch.mm(torch.empty(0, 8, device="neuron"), x)) == 0  # empty: no datapath call


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rnn_cells_and_copies_and_allocations_are_the_python_path_s_bit_for_bit(rnn, bias, dtype, monkeypatch):
    """nn.LSTM's and nn.GRU's cells (fast_cell), their allocations (fast_empty) and copies
    (fast_copy): the same values, bits, simulated time and memory figures as with every op on
    the Python path. (The composite's ops: a float32 layer otherwise runs as one op,
    tests/torch/test_rnn_whole.py.)"""
    from torch_bridge.ops import rnn as whole

    monkeypatch.setattr(whole, "enabled", False)

    def run():
        gc.collect()
        mem0 = torch.neuron.memory_allocated()
        torch.manual_seed(0)
        m = rnn(8, 16, num_layers=2, batch_first=True, bias=bias).to(dtype).to("neuron")
        x = torch.randn(3, 5, 8).to(dtype).to("neuron").requires_grad_()
        dev = runtime().device
        t0 = dev.now()
        res = []
        for it in range(3):  # the first costs every signature, the later ones are served natively
            h0 = torch.randn(2, 3, 16).to(dtype).to("neuron")
            state = None if it < 2 else (h0, h0) if rnn is torch.nn.LSTM else h0
            out, hc = m(x, state)
            h, c = hc if rnn is torch.nn.LSTM else (hc, hc)
            (out.float().square().sum() + c.float().sum() * (it == 1)).backward()
            res += [out.cpu(), h.cpu(), c.cpu(), x.grad.cpu()] + [p.grad.cpu() for p in m.parameters()]
            m.zero_grad()
            x.grad = None
        gc.collect()
        return res, dev.now() - t0, torch.neuron.memory_allocated() - mem0

    with fast(False):
        want, want_ticks, want_mem = run()
    before = fastpath.hits()
    got, ticks, mem = run()
    assert fastpath.hits() - before > 100
    assert ticks == want_ticks and mem == want_mem
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))


def test_set_is_a_host_op_without_python_and_counts_as_before():
    """set_ (storage swaps) is metadata only, natively as in Python; a factory's out= adopting its
    fresh result is part of that op, not a set_ of the program's."""
    def run():
        with torch.neuron.report_scope() as scope:
            a = torch.arange(5, device="neuron")  # its out= adopts the result: no set_ counted
            t = torch.ones(3, 4, device="neuron")
            t.set_(torch.zeros(2, 2, device="neuron"))
        return dict(scope.report.host_ops), a.cpu(), t.shape

    with fast(False):
        want = run()
    got = run()
    assert got[0] == want[0] and got[0]["set_"] == 2 and torch.equal(got[1], want[1]) and got[2] == want[2]


_FIRST_BATCH_NORM = """
import copy, torch, torch.nn as nn
out = []
for fmt in (torch.contiguous_format, torch.channels_last):
    cpu = nn.BatchNorm2d(4)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(3)).to(memory_format=fmt)
    cpu(x)
    dev(x.to("neuron"))
    out.append(torch.equal(cpu.running_mean, dev.running_mean.cpu()) and
               torch.equal(cpu.running_var, dev.running_var.cpu()))
print(out)
"""


def test_the_first_batch_norm_of_a_process_moves_the_running_statistics_once():
    """native_batch_norm writes running_mean/var without an alias annotation in its schema: the
    fast path read it as functional and, learning its cost on the first call of a process, ran it
    twice (running statistics moved by 0.19 instead of 0.1). Only a fresh process shows it."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _FIRST_BATCH_NORM], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[True, True]"


def test_the_fast_path_steps_aside_while_torch_compile_traces():
    """Kernels torch.compile runs while it traces (constants evaluated for real, with or without a
    fake mode on) are the compiler's: Python's path charges none of them. The native side cannot
    read dynamo's TracingContext (a Python thread-local); it is told on entering and leaving it, and
    a copy whose signature eager code taught is not charged inside a trace (issue 25)."""
    from torch._guards import TracingContext, tracing

    x = torch.randn(8, 4, device="neuron")
    host = torch.randn(8, 4)
    with fast(True):
        assert served(lambda: (x.clone(), host.to("neuron"))) >= 2  # both copies' signatures taught
        torch.neuron.synchronize()
        with torch.neuron.report_scope() as scope:
            with tracing(TracingContext(None)):
                y, z = x.clone(), host.to("neuron")
            torch.neuron.synchronize()
        assert scope.report.launches == 0, [(r.op, r.calls) for r in scope.report.rows]
        assert torch.equal(y.cpu(), x.cpu()) and torch.equal(z.cpu(), host)
        with torch.neuron.report_scope() as after:  # and served again once the trace is left
            before = fastpath.hits()
            x.clone(), host.to("neuron")
            torch.neuron.synchronize()
        assert fastpath.hits() - before == 2 and after.report.launches == 2


# (input, weight, stride, padding, dilation, groups): pointwise (one image's few pixels, and many),
# im2col with stride, padding and dilation, depthwise (trn_conv2d_grouped), and a grouped convolution
# with more than 8 output channels per group (Python's bmm over the groups: the fast path steps aside)
_CONVS = [((2, 4, 1, 1), (96, 4, 1, 1), 1, 0, 1, 1), ((2, 16, 8, 8), (24, 16, 1, 1), 1, 0, 1, 1),
          ((2, 3, 9, 9), (8, 3, 3, 3), 2, 1, 1, 1), ((1, 5, 7, 6), (4, 5, 3, 2), (2, 1), (1, 0), (1, 2), 1),
          ((2, 8, 8, 8), (8, 1, 5, 5), 2, 2, 1, 8), ((2, 8, 6, 6), (40, 2, 3, 3), 1, 1, 1, 4)]


@pytest.mark.parametrize("case", _CONVS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convolutions_and_their_backward_are_the_python_path_s_bit_for_bit(case, bias, layout, dtype):
    """fast_conv (float32 forward on the datapath) and fast_conv_backward (CPU's kernel, its
    launches taught as a list): the same values, bits, strides, report rows, simulated time and
    memory figures as with every op on the Python path."""
    xs, ws, st, pad, dil, groups = case

    def run():
        gc.collect()
        mem0 = torch.neuron.memory_allocated()
        torch.manual_seed(0)
        x = torch.randn(xs).to(dtype).to(memory_format=layout).to("neuron").requires_grad_()
        w = torch.randn(ws).to(dtype).to("neuron").requires_grad_()
        b = torch.randn(ws[0]).to(dtype).to("neuron").requires_grad_() if bias else None
        dev = runtime().device
        t0 = dev.now()
        res = []
        with torch.neuron.report_scope() as scope:
            for _ in range(3):  # the first costs every signature, the later ones are served natively
                y = torch.nn.functional.conv2d(x, w, b, st, pad, dil, groups)
                y.float().square().sum().backward()
                res += [y.cpu(), y.stride(), x.grad.cpu(), x.grad.stride(), w.grad.cpu()] + ([b.grad.cpu()] if bias else [])
                x.grad = w.grad = None
                if bias:
                    b.grad = None
            torch.neuron.synchronize()
        gc.collect()
        return res, dev.now() - t0, torch.neuron.memory_allocated() - mem0, scope.report.rows

    with fast(False):
        want, want_ticks, want_mem, want_rows = run()
    got, ticks, mem, rows = run()
    assert ticks == want_ticks and mem == want_mem and rows == want_rows
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b)) if isinstance(a, torch.Tensor) else a == b


def test_convolutions_are_served_natively_where_python_would_take_the_datapath():
    torch.manual_seed(1)
    x, w = torch.randn(2, 3, 9, 9, device="neuron"), torch.randn(8, 3, 3, 3, device="neuron")
    g = torch.randn(2, 8, 9, 9, device="neuron")
    assert fastpath.kind(torch.ops.aten.convolution_overrideable.default) == "conv"
    assert fastpath.kind(torch.ops.aten.convolution_backward_overrideable.default) == "conv_backward"
    conv = lambda: torch.nn.functional.conv2d(x, w, padding=1)  # noqa: E731
    assert served(conv) == 1
    backward = lambda: torch.ops.aten.convolution_backward(g, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,  # noqa: E731
                                                           [True, True, True])
    assert served(backward) == 1
    # a bf16 forward rounds in Python; a grouped convolution with 10 output channels per group is one bmm there
    xb, wb = x.bfloat16(), w.bfloat16()
    assert served(lambda: torch.nn.functional.conv2d(xb, wb, padding=1)) == 0
    x2, wg = x[:, :2].contiguous(), torch.randn(20, 1, 3, 3, device="neuron")
    assert served(lambda: torch.nn.functional.conv2d(x2, wg, groups=2)) == 0
    wt = w.transpose(0, 1).contiguous()
    assert served(lambda: torch.nn.functional.conv_transpose2d(x, wt)) == 0


def test_convolutions_step_aside_for_inputs_the_datapath_must_not_take_and_for_cpu_s_errors():
    """Inputs whose products may overflow or that are not finite take CPU's convolution in Python
    (tensore.bounded), here too; CPU's refusals come through in its words."""
    torch.manual_seed(2)
    w = torch.randn(4, 3, 3, 3)
    for special in (float("inf"), float("nan"), 3e38):
        x = torch.randn(1, 3, 6, 6)
        x[0, 1, 2, 3] = special
        xn, wn = x.to("neuron"), w.to("neuron")
        conv = lambda: torch.nn.functional.conv2d(xn, wn, padding=1)  # noqa: E731
        conv()
        quick = conv()
        with fast(False):
            slow = conv()
        assert torch.equal(quick.cpu(), slow.cpu()) or (quick.cpu().isnan() == slow.cpu().isnan()).all()
        assert torch.equal(torch.nan_to_num(quick.cpu()), torch.nan_to_num(slow.cpu()))
        assert torch.equal(torch.nan_to_num(quick.cpu()), torch.nan_to_num(torch.nn.functional.conv2d(x, w, padding=1)))
    xn = torch.randn(1, 3, 6, 6, device="neuron")
    with pytest.raises(RuntimeError, match="expected input"):
        torch.nn.functional.conv2d(xn, torch.randn(4, 2, 3, 3, device="neuron"))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.nn.functional.conv2d(xn, torch.randn(4, 3, 3, 3, device="neuron:1"))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_is_the_python_path_s_bit_for_bit_and_moves_its_statistics_once(affine, track, dtype):
    """fast_batch_norm: training and eval steps give the same outputs, gradients, running
    statistics, report rows, simulated time and memory figures as the Python path."""
    def run():
        gc.collect()
        mem0 = torch.neuron.memory_allocated()
        torch.manual_seed(0)
        m = torch.nn.BatchNorm2d(6, affine=affine, track_running_stats=track).to(dtype).to("neuron")
        x = torch.randn(3, 6, 4, 5).to(dtype).to("neuron").requires_grad_()
        dev = runtime().device
        t0 = dev.now()
        res = []
        with torch.neuron.report_scope() as scope:
            for it in range(4):  # the first costs every signature, the later ones are served natively
                m.train(it != 2)
                y = m(x)
                y.float().square().sum().backward()
                res += [y.cpu(), x.grad.cpu()] + [t.cpu() for t in (*m.parameters(), *m.buffers())]
                x.grad = None
            torch.neuron.synchronize()
        gc.collect()
        return res, dev.now() - t0, torch.neuron.memory_allocated() - mem0, scope.report.rows

    with fast(False):
        want, want_ticks, want_mem, want_rows = run()
    before = fastpath.hits()
    got, ticks, mem, rows = run()
    assert fastpath.hits() > before
    assert ticks == want_ticks and mem == want_mem and rows == want_rows
    assert len(got) == len(want)
    assert all(torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b) for a, b in zip(got, want))
    assert fastpath.kind(torch.ops.aten.native_batch_norm.default) == "batch_norm"
    x = torch.randn(2, 3, 4, device="neuron")
    rm, rv = torch.zeros(3, device="neuron"), torch.ones(3, device="neuron")
    bn = lambda: torch.ops.aten.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)  # noqa: E731
    assert served(bn) == 1


def test_the_finiteness_scan_of_a_matmul_result_finds_every_special_value_anywhere():
    """all_finite_f32 (its AVX2 loop where the CPU has it): an infinity or a NaN at any position
    of a result - the vector body or its tail - sends the matmul to Python's path."""
    import numpy as np

    from torch_bridge import _native

    lib = _native.lib
    for n in (*range(1, 40), 4096, 65536 + 5):
        a = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3e37
        assert lib.trnsim_fast_all_finite(a.ctypes.data, n) == 1
        for pos in {0, n // 2, n - 1, max(0, n - 8)}:
            for special in (np.inf, -np.inf, np.nan, -np.nan):
                b = a.copy()
                b[pos] = special
                assert lib.trnsim_fast_all_finite(b.ctypes.data, n) == 0
    assert lib.trnsim_fast_all_finite(np.zeros(1, np.float32).ctypes.data, 0) == 1


def _conversions():
    x = torch.randn(4, 6, 5, 3, generator=torch.Generator().manual_seed(5)).to("neuron")
    return [lambda: x.to(torch.bfloat16), lambda: x.to(torch.float16, memory_format=torch.channels_last),
            lambda: x.transpose(0, 2).to(torch.bfloat16), lambda: x.to("neuron:0", torch.int32),
            lambda: x.to(torch.bfloat16).float(), lambda: x.to(torch.float32, copy=True),
            lambda: x[:, 1].to(dtype=torch.float64, memory_format=torch.contiguous_format)]


def test_dtype_conversions_on_the_device_are_served_natively_as_python_s():
    """Tensor.to(dtype) / .float() / .half() within a device (aten::_to_copy) take the fast path:
    the calls Python's kernel makes (empty_like in the new dtype and format, then copy_), with its
    values, strides, costs and memory (the bytes allocated: cumulative, others' frees aside), and
    no Python kernel on the way."""
    from torch_bridge.neuron import hostprof

    def made() -> int:
        return torch.neuron.memory_stats()["allocated_bytes.all.allocated"]

    assert fastpath.kind(torch.ops.aten._to_copy.default) == "to_copy"
    for f in _conversions():
        f()
        torch.neuron.synchronize()
        before = made()
        with hostprof.profile() as prof, torch.neuron.report_scope() as fast_scope:
            quick = f()
            torch.neuron.synchronize()
        fast_made = made() - before
        assert not [name for name, _, _ in prof.parts() if name.startswith("python")]
        with fast(False), torch.neuron.report_scope() as slow_scope:
            before = made()
            slow = f()
            torch.neuron.synchronize()
            slow_made = made() - before
        assert fast_made == slow_made >= quick.untyped_storage().nbytes()
        assert torch.equal(quick.cpu(), slow.cpu())
        assert (quick.shape, quick.stride(), quick.dtype, quick.device) == (slow.shape, slow.stride(), slow.dtype,
                                                                            slow.device)
        assert fast_scope.report.rows == slow_scope.report.rows
        assert fast_scope.report.device_us == slow_scope.report.device_us
        del quick, slow


def test_dtype_conversions_leave_other_devices_and_the_host_to_python():
    x = torch.arange(12.0).view(3, 4).to("neuron")
    assert torch.equal(x.to("cpu", torch.int64), torch.arange(12).view(3, 4))
    y = x.to("neuron:1", torch.bfloat16)
    assert y.device == torch.device("neuron:1") and torch.equal(y.cpu(), torch.arange(12.0).view(3, 4).bfloat16())
    with torch.neuron.device(1):
        z = x.to("neuron", torch.float16)  # "neuron" alone is the current device, as for CUDA
    assert z.device == torch.device("neuron:1")


def test_charges_made_from_python_are_logged_natively_with_the_device_s_figures():
    """runtime.charge (the Python path's ops, attention, the MoE op) logs its launch where the fast
    path logs its own, in order with them: the same timeline as Device.launch gives (fast path off);
    the default stream only (another stream's launches take Device.launch, as the fast path's do)."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 4, 8, 16).to("neuron") for _ in range(3))

    def program():
        out = F.scaled_dot_product_attention(q, k, v)  # the fused op: charged from Python
        return (out * 2 + 1).sum().cpu()

    program()
    torch.neuron.synchronize()
    log = runtime().device._log
    F.scaled_dot_product_attention(q, k, v)
    assert log.pending() >= 1  # (logged, not yet issued)
    torch.neuron.synchronize()
    reports = []
    for on in (True, False):
        with fast(on), torch.neuron.report_scope(trace=True) as scope:
            value = program()
            torch.neuron.synchronize()
        t0 = scope.report.events[0].issued
        reports.append((value, scope.report.rows, [(e.op, e.kernel, e.issued - t0, e.start - t0, e.end - t0)
                                                   for e in scope.report.events]))
    assert torch.equal(reports[0][0], reports[1][0])
    assert reports[0][1:] == reports[1][1:]
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        before = log.pending()
        F.scaled_dot_product_attention(q, k, v)
        assert log.pending() == before  # Device.launch, on the stream
    torch.neuron.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
                                   torch.uint8, torch.int64, torch.bool, torch.complex64])
def test_item_is_served_natively_with_cpus_value_for_every_dtype(dtype):
    """item() reads the value from the device memory natively: CPU's value and type (NaN, inf and
    a signed zero included) for every dtype, a one-element view of a bigger tensor included; a
    conjugated view and a tensor of more than one element take Python's path (its value, CPU's
    error)."""
    import math

    floats = dtype.is_floating_point or dtype.is_complex
    for v in ([1.5, -2.25, float("nan"), float("inf"), -0.0] if floats else [3, 0, 1]):
        cpu = torch.tensor([[7, v]], dtype=torch.float64).to(dtype)[0, 1:]
        dev = cpu.to("neuron")
        dev.item()  # (the signature costed once)
        before = fastpath.hits()
        got, want = dev.item(), cpu.item()
        assert fastpath.hits() - before == 1
        assert type(got) is type(want)
        parts = (lambda x: (x.real, x.imag)) if isinstance(want, complex) else (lambda x: (x,))
        for g, w in zip(parts(got), parts(want)):
            assert (math.isnan(g) and math.isnan(w)) if isinstance(w, float) and math.isnan(w) else \
                (g == w and str(g) == str(w))  # (str tells -0.0 from 0.0)
    if dtype.is_complex:
        z = torch.tensor([1 + 2j], dtype=dtype)
        assert z.to("neuron").conj().item() == z.conj().item() == 1 - 2j
    with pytest.raises(RuntimeError, match="a Tensor with 2 elements cannot be converted to Scalar"):
        torch.ones(2, dtype=dtype, device="neuron").item()
