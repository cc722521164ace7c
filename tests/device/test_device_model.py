"""The device model without torch: the host issue model, streams sharing a core's engines, LNC=2
kernels on both physical cores, report scopes - exact timelines, as SimPy's own tests assert."""

from __future__ import annotations

import pytest

from trnsim import Chip, load_config
from trnsim.device import Device, KernelSpec, OpCost
from trnsim.kernels import get_kernel


def _device(**overrides: str) -> Device:
    return Device(load_config("trn2", {"host.dispatch": "10ns", **overrides}))


def _cost(ticks: int, **demand: int) -> OpCost:
    return OpCost("k", False, ticks, dict(demand), 2, 0, 0, dict(demand))


def _timeline(dev: Device) -> list[tuple[int, int, int]]:
    return [(e.issued, e.start, e.end) for e in dev.report().events]


def test_tiny_kernels_are_host_bound():
    """Kernels shorter than the host's dispatch: each starts when the host has issued it, and the
    device idles between them, waiting on the host."""
    dev = _device()
    dev.reset(trace=True)
    d = dev.dispatch
    assert d == 48  # 10 ns at trn2's 4.8 GHz tick
    tiny = _cost(20, Vector=20)
    for _ in range(4):
        dev.launch(0, "add", tiny)
    assert _timeline(dev) == [(48, 48, 68), (96, 96, 116), (144, 144, 164), (192, 192, 212)]
    rep = dev.report()
    assert rep.row("add").bound == "launch"
    assert rep.host_wait_us == pytest.approx((48 + 3 * 28) / 4.8e9 * 1e6)
    assert rep.cores[0].busy_us == pytest.approx(80 / 4.8e9 * 1e6)


def test_big_kernels_are_device_bound_and_the_host_runs_ahead():
    """Kernels longer than the dispatch run back to back; the host runs ahead until
    ``host.max_inflight`` (3) launches are unfinished, then waits for the oldest."""
    dev = _device()
    dev.reset(trace=True)
    big = _cost(1000, Tensor=990)
    for _ in range(5):
        dev.launch(0, "mm", big)
    assert _timeline(dev) == [(48, 48, 1048), (96, 1048, 2048), (144, 2048, 3048),
                              (1096, 3048, 4048), (2096, 4048, 5048)]
    rep = dev.report()
    assert rep.row("mm").bound == "Tensor"
    assert rep.host_wait_us == pytest.approx(48 / 4.8e9 * 1e6)  # only before the first kernel
    dev.synchronize(0)
    assert dev.host == 5048


def test_two_streams_share_tensore():
    """Two TensorE-bound kernels on two streams, issued together, take about as long as one after
    the other: the second stretches until both kernels' TensorE demand fits (2 physical TensorEs
    of an LNC=2 core, each kernel asking 2 x 990 ticks of them)."""
    dev = _device()
    dev.reset(trace=True)
    k = _cost(1000, Tensor=2 * 990)
    dev.launch(0, "mm", k, stream=1)
    dev.launch(0, "mm", k, stream=2)
    (_, s1, e1), (_, s2, e2) = _timeline(dev)
    assert (s1, e1) == (48, 1048)
    assert s2 == 96 and e2 - s2 > 1900  # alone it would take 1000
    assert e2 - s1 == pytest.approx(2000, rel=0.03)


def test_tensore_and_dma_bound_kernels_overlap():
    dev = _device()
    dev.reset(trace=True)
    dev.launch(0, "mm", _cost(1000, Tensor=2 * 990, DMA=2 * 200), stream=1)
    dev.launch(0, "add", _cost(1000, Vector=100, DMA=2 * 780), stream=2)
    (_, s1, e1), (_, s2, e2) = _timeline(dev)
    assert (s1, e1) == (48, 1048)
    assert s2 == 96 and e2 == 96 + 1000  # DMA: 780 + 200 per engine lane fits in the 1000 window


def test_same_stream_kernels_never_share():
    dev = _device()
    dev.reset(trace=True)
    k = _cost(1000, Tensor=2 * 990)
    dev.launch(0, "mm", k)
    dev.launch(0, "mm", k)
    assert [(s, e) for _, s, e in _timeline(dev)] == [(48, 1048), (1048, 2048)]


def test_metadata_only_ops_cost_nothing():
    dev = _device()
    for _ in range(3):
        dev.host_op("view")
    rep = dev.report()
    assert rep.host_ops == {"view": 3} and rep.launches == 0 and rep.device_us == 0 and dev.host == 0


def test_host_ops_counted_at_once_as_one_by_one():
    """Device.host_ops (a replay's views, counted in one call) leaves the report host_op would."""
    one, many = _device(), _device()
    for dev in (one, many):
        dev.launch(0, "k", _cost(100, Vector=100))
    for op in ("view", "t", "view"):
        one.host_op(op)
    many.host_ops({"view": 2, "t": 1})
    a, b = one.report(), many.report()
    assert a.host_ops == b.host_ops == {"view": 2, "t": 1}
    assert (a.launches, a.device_us, one.host) == (b.launches, b.device_us, many.host)


def test_report_scope_sees_only_its_launches():
    dev = _device()
    dev.launch(0, "before", _cost(100, Vector=100))
    rec = dev.open_scope()
    dev.launch(1, "inside", _cost(100, Vector=100))
    rep = dev.close_scope(rec)
    assert [r.op for r in rep.rows] == ["inside"] and set(rep.cores) == {1}
    assert [r.op for r in dev.report().rows] == ["before", "inside"]


def test_library_kernel_runs_on_both_physical_cores_at_lnc2():
    """A logical core of trn2 (LNC=2) splits a matmul between its two physical cores: one launch
    takes as long as the slower half, simulated together on their shared HBM stack, and its MFU
    against the logical core's peak goes past the 50% a single physical core could reach."""
    cfg = load_config("trn2")
    dev = Device(cfg)
    spec = KernelSpec.of("matmul", (4096, 4096, 4096), "bf16", {"transpose_a": False, "transpose_b": False})
    cost = dev.cost(spec)
    assert cost.cores == 2 and cost.matmul_flops == 2 * 4096 ** 3
    halves = [get_kernel("matmul").make((2048, 4096, 4096), "bf16", cfg, dict(spec.params))] * 2
    want = max(r.report.total_ticks for r in Chip(cfg).run_spmd(halves, timing_only=True))
    assert cost.ticks == want
    dev.launch(0, "mm", cost)
    assert dev.report().row("mm").mfu_percent > 80.0
    assert dev.cost(spec) is cost and dev.simulated == 2  # cached: simulated once


def test_lnc1_runs_each_kernel_on_one_core():
    dev = Device(load_config("trn1"))
    cost = dev.cost(KernelSpec.of("binary", (1024, 1024), "bf16", {"op": "add"}))
    assert cost.cores == 1


def test_a_refused_kernel_falls_back():
    dev = _device()
    fallback = KernelSpec.of("stream", (1024, 1024, 1024), "fp32", {"engine": "vector"}, label="generic:x",
                             generic=True)
    spec = KernelSpec.of("softmax", (128, 1 << 24), "fp32", fallback=fallback)  # a row beyond SBUF
    cost = dev.cost(spec)
    assert cost.kernel == "generic:x" and cost.generic


def test_trnsim_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import trnsim, trnsim.device, trnsim.kernels, trnsim.cli, trnsim.sweep, trnsim.trace\n"
            "d = trnsim.device.Device(trnsim.load_config('trn2'))\n"
            "d.launch(0, 'add', d.cost(trnsim.device.KernelSpec.of('binary', (256, 256), 'bf16', {'op': 'add'})))\n"
            "print(d.report().rows[0].kernel)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "binary", r.stderr


def test_a_graph_launch_costs_one_dispatch_and_runs_its_kernels_back_to_back():
    """A compiled graph is one executable: one host dispatch, then its kernels one after another
    on the stream, with no host gap between them."""
    dev = _device()
    dev.reset(trace=True)
    tiny = _cost(20, Vector=20)
    assert dev.launch_graph(0, [("add", tiny), ("mul", tiny), ("exp", tiny)]) == [(48, 68), (68, 88), (88, 108)]
    assert _timeline(dev) == [(48, 48, 68), (48, 68, 88), (48, 88, 108)]
    rep = dev.report()
    assert (rep.launches, rep.dispatches, rep.graph_launches) == (3, 1, 1)
    assert rep.host_wait_us == pytest.approx(48 / 4.8e9 * 1e6)  # only before the graph's first kernel
    dev.launch(0, "add", tiny)  # the next dispatch follows the graph's
    assert _timeline(dev)[-1] == (96, 108, 128)


def _state(dev: Device, recs) -> list:
    """Everything a launch changes: each core's timeline and each recorder's figures."""
    out: list = [dev._host]
    for c in dev.cores:
        out.append((dict(c.ready), c.busy_until, list(c.inflight), list(c.bookings), set(c.streams)))
    for rec in recs:
        out.append(({k: list(v) for k, v in rec.rows.items()}, rec.host_ticks, rec.dispatches, rec.graph_launches,
                    {i: (t.launches, t.wait, t.busy, [list(iv) for iv in t.open], t.last_end, t.ticks)
                     for i, t in rec.cores.items()}))
    return out


def test_a_graph_on_a_stream_of_its_own_is_recorded_in_aggregate_with_the_same_figures(monkeypatch):
    """Device._issue_run (a graph whose stream has its core to itself, no trace) leaves the state
    and figures that booking and recording each kernel leaves: two recorders, zero-tick kernels,
    repeated costs, a queue that fills, two cores, a second stream afterwards."""
    tiny, zero, big, mid = _cost(20, Vector=20), _cost(0), _cost(1000, Tensor=990), _cost(300, DMA=250)

    def scenario() -> list:
        dev = _device()
        outer = dev.recorders[0]
        dev.launch(0, "add", tiny)
        inner = dev.open_scope()
        for i in range(6):
            dev.launch_graph(0, [("add", tiny), ("nop", zero), ("mm", big), ("add", tiny), ("mm", big), ("nop", zero)])
            dev.launch(0, "mul", tiny)
            dev.launch_graph(1, [("copy", mid)] * (i + 2))
            if i == 3:
                dev.synchronize(1)
        dev.launch_graph(0, [("nop", zero), ("nop", zero)])
        dev.launch_graph(0, [("copy", mid), ("add", tiny)], stream=1)  # a second stream: booked one by one
        dev.launch_graph(0, [("copy", mid), ("add", tiny)])
        state = _state(dev, [outer, inner])
        rep = dev.close_scope(inner)
        return state + [rep, dev.report()]

    aggregate = scenario()
    calls = []
    real = Device._issue_run

    def spy(self, *a):
        calls.append(1)
        return real(self, *a)

    monkeypatch.setattr(Device, "_issue_run", spy)
    assert scenario() == aggregate and len(calls) == 13  # (the graphs before stream 1 of core 0 was used)
    monkeypatch.setattr(Device, "_issue_run", Device._issue_each)
    assert scenario() == aggregate


def test_a_graph_counts_once_against_max_inflight():
    dev = _device()
    dev.reset(trace=True)
    big = _cost(1000, Tensor=990)
    for _ in range(3):
        dev.launch_graph(0, [("mm", big), ("mm", big)])
    dev.launch(0, "mm", big)  # three graphs unfinished: the host waits for the first (ends at 2048)
    assert _timeline(dev)[-1] == (2096, 6048, 7048)


def test_graph_block_collects_launches_and_muted_drops_them():
    dev = _device()
    dev.reset(trace=True)
    tiny = _cost(20, Vector=20)
    with dev.graph() as cap:
        dev.launch(0, "add", tiny)
        dev.launch(0, "mul", tiny)
        assert len(cap) == 2 and not dev.recorders[0].rows  # collected, not issued yet
    with dev.muted():
        dev.launch(0, "exp", tiny)
    assert _timeline(dev) == [(48, 48, 68), (48, 68, 88)]
    with dev.graph():
        dev.launch(0, "add", tiny)
        dev.synchronize(0)  # a sync inside the block issues what was collected first
        dev.launch(0, "mul", tiny)
    assert _timeline(dev)[2:] == [(96, 96, 116), (164, 164, 184)]


def test_adaptive_eager_replays_a_repeated_sequence_as_one_graph():
    """The first time a sequence runs between two synchronisations it is issued op by op (the
    capture); the second time it is one graph launch."""
    dev = _device()
    dev.reset(trace=True)
    dev.set_adaptive(True)
    tiny = _cost(20, Vector=20)
    for _ in range(2):
        for op in ("add", "mul", "exp"):
            assert dev.launch(0, op, tiny) is None  # queued
        dev.synchronize(0)
    assert _timeline(dev) == [(48, 48, 68), (96, 96, 116), (144, 144, 164),
                              (212, 212, 232), (212, 232, 252), (212, 252, 272)]
    rep = dev.report()
    assert (rep.launches, rep.dispatches, rep.graph_launches) == (6, 4, 1)
    dev.set_adaptive(False)
    dev.launch(0, "add", tiny)
    assert _timeline(dev)[-1] == (320, 320, 340)


def test_compile_time_is_reported_not_charged():
    dev = _device()
    dev.reset()
    dev.note_compile(1.5)
    rep = dev.report()
    assert (rep.compiled_graphs, rep.compile_seconds, rep.elapsed_us) == (1, 1.5, 0.0)


def test_a_collective_beside_a_dma_bound_kernel_slows_both():
    """A collective, simulated by the NeuronLink model and charged through the device model,
    runs on the core's collective stream beside compute: it waits for the compute issued before
    it, overlaps what comes after, and shares the core's DMA with it."""
    from trnsim.collectives import simulate_collective
    from trnsim.device import COLLECTIVE_STREAM

    cfg = load_config("trn2")
    dev = Device(cfg)
    # on all 16 of each core's DMA engines (the runtime gives a collective 2 rings by default,
    # which a kernel streaming on 16 barely notices)
    rep = simulate_collective("trn2.48xlarge", "all-reduce", 64 << 20, ranks=4, dtype="bf16",
                              overrides=["collectives.dma_rings=16"])
    assert rep.group == (0, 1, 2, 3)
    coll = dev.collective_cost(rep, 0)
    assert coll.ticks == rep.end_of(0) - rep.start_ticks[0] and coll.demand["DMA"] > 0
    dma_bound = dev.cost(KernelSpec.of("binary", (8192, 8192), "bf16", {"op": "add"}))
    assert dma_bound.kernel == "binary"
    dev.reset(trace=True)
    small = dev.cost(KernelSpec.of("binary", (128, 128), "bf16", {"op": "add"}))
    dev.launch(0, "add", small)  # the collective's input
    dev.launch_collective(0, "all_reduce", coll)
    dev.launch(0, "add", dma_bound)  # compute issued after the collective overlaps it
    first, ar, add = dev.report().events
    assert ar.stream == COLLECTIVE_STREAM and ar.start >= first.end
    assert add.start < ar.end  # they overlap ...
    alone = max(coll.ticks, dma_bound.ticks)
    assert add.end - add.start > dma_bound.ticks or ar.end - ar.start > coll.ticks  # ... and share DMA
    assert max(ar.end, add.end) - ar.start > alone


def test_a_collective_issued_now_is_placed_when_its_group_has_arrived():
    """issue_collective charges the host's dispatch and returns the arrival (after the compute
    issued before it); place_collective puts it on the collective stream from the group's start,
    counting the wait for peers."""
    from trnsim.device import COLLECTIVE_STREAM, CollectiveLaunch

    dev = _device()
    dev.reset(trace=True)
    d = dev.dispatch
    dev.launch(0, "mm", _cost(1000, Tensor=990))  # issued at d, runs d .. d + 1000
    arrival = dev.issue_collective(0)
    assert arrival == d + 1000 and dev.host == 2 * d  # waits for the matmul; the host ran ahead
    coll = OpCost("all-reduce:ring", False, 500, {"DMA": 400}, 2, 0, 0, {"DMA": 400},
                  collective=CollectiveLaunch("all-reduce", "ring", 2, 4096, 500, 1.0, "link"))
    dev.launch(0, "add", _cost(300, Vector=300))  # issued after: runs beside the collective
    start, end = dev.place_collective(0, "all_reduce", coll, arrival + 200, arrival)  # a peer arrived 200 later
    assert (start, end) == (arrival + 200, arrival + 700)
    rep = dev.report()
    row = rep.row("all_reduce")
    assert row.bound == "link" and row.collective.peer_wait_us == pytest.approx(200 / 4.8e9 * 1e6)
    assert row.collective.bytes == 4096 and row.collective.busbw == pytest.approx(4096 / (500 / 4.8e9))
    assert [(e.op, e.stream) for e in rep.events] == [("mm", 0), ("add", 0), ("all_reduce", COLLECTIVE_STREAM)]
    # the core's busy time is the union: mm, then add and the collective side by side
    assert rep.cores[0].busy_us == pytest.approx((1000 + (end - (d + 1000))) / 4.8e9 * 1e6)


def test_deferred_rows_are_the_rows_added_one_by_one():
    """A native placement's rows are deferred (Recorder.defer_rows) and added when read: the same
    rows, in the same order, as adding each in turn; a report reads them; a direct launch after
    them, a folding limit and add_rows all keep the order."""
    from trnsim.device import recorder
    from trnsim.device.recorder import Recorder

    costs = [_cost(10 * (i + 1), Vector=5) for i in range(3)]
    table = [(f"op{i}", c, (f"op{i}", id(c))) for i, c in enumerate(costs)]
    batches = [[2, 1, 30, 4, 0, 2, 20, 0], [1, 1, 20, 0, 2, 3, 90, 7], [0, 5, 50, 1]]

    def one_by_one() -> Recorder:
        rec = Recorder(0)
        for flat in batches:
            for j in range(0, len(flat), 4):
                op, cost, key = table[flat[j]]
                rec.add_rows([(key, cost, *flat[j + 1:j + 4])])
        return rec

    want = list(one_by_one().rows.items())
    assert [k for k, _ in want] == [table[2][2], table[0][2], table[1][2]]
    for limit in (recorder.DEFER_MAX, 1):
        old, recorder.DEFER_MAX = recorder.DEFER_MAX, limit
        try:
            rec = Recorder(0)
            for flat in batches:
                rec.defer_rows(flat, table)
        finally:
            recorder.DEFER_MAX = old
        rec.fold()
        assert list(rec.rows.items()) == want
    dev = _device()
    rec = dev.recorders[0]
    rec.defer_rows(batches[0], table)
    dev.launch(0, "op1", costs[1])  # folds the deferred rows first: op2 and op0 keep their places
    rec.defer_rows(batches[1], table)
    rep = dev.report()
    assert [(r.op, r.calls) for r in sorted(rep.rows, key=lambda r: r.op)] == [("op0", 2), ("op1", 2), ("op2", 4)]
    assert list(rec.rows) == [table[2][2], table[0][2], table[1][2]]
