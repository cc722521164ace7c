"""The merged run trace without torch: device lanes, the simulated dispatch lane, flows, engine
lanes of expanded kernels, source lines, and host events moved onto the simulated clock."""

from __future__ import annotations

import json

import pytest

from trnsim import load_config
from trnsim.device import Device, KernelSpec
from trnsim.trace import ticks_to_us
from trnsim.run_trace import (FLOW_CATEGORY, SIM_HOST_PID, HostCall, _TimeMap, _without_simulator, device_pid,
                              engines_pid, run_trace_document, stream_tid, write_run_trace)


@pytest.fixture(scope="module")
def run():
    """Three launches on neuron:0 (two ops from two source lines) and one on neuron:1's stream 5."""
    dev = Device(load_config("trn2"))
    dev.reset(trace=True, sources=True)
    mm = dev.cost(KernelSpec.of("matmul", (256, 256, 512), "bf16"))
    add = dev.cost(KernelSpec.of("binary", (256, 512), "bf16", {"op": "add"}))
    prev = dev.set_context("model.py:10", 0)
    dev.launch(0, "mm", mm)
    dev.set_context("model.py:11", 1)
    dev.launch(0, "add", add)
    dev.set_context("model.py:10", 2)
    dev.launch(0, "mm", mm)
    dev.restore_context(prev)
    dev.cores[1].current_stream = 5
    dev.launch(1, "add", add)
    return dev, dev.report()


def _names(doc):
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    return procs, threads


def test_launches_carry_their_call_source_and_kernel_reports(run):
    dev, rep = run
    assert [(e.op, e.source, e.call) for e in rep.events] == [
        ("mm", "model.py:10", 0), ("add", "model.py:11", 1), ("mm", "model.py:10", 2), ("add", "", -1)]
    assert all(len(e.reports) == 2 for e in rep.events)  # LNC=2: one kernel per physical core
    assert rep.row("mm").source_line == "model.py:10" and rep.row("add").source_line == "model.py:11"
    mm = rep.row("mm")
    assert mm.dma_bytes > 0 and mm.hbm_read_bytes + mm.hbm_write_bytes == mm.hbm_bytes


def test_device_lanes_dispatch_lane_and_flows(run):
    dev, rep = run
    doc = run_trace_document(rep, dispatch_ticks=dev.dispatch)
    procs, threads = _names(doc)
    assert procs[SIM_HOST_PID] == "host (simulated)"
    assert procs[device_pid(0)] == "neuron:0 (trn2, simulated)" and procs[device_pid(1)] == "neuron:1 (trn2, simulated)"
    assert threads[(device_pid(0), stream_tid(0))] == "stream 0 (default)"
    assert threads[(device_pid(1), stream_tid(5))] == "stream 5"
    to_us = 1e6 / rep.tick_hz
    device = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["pid"] in (device_pid(0), device_pid(1))]
    assert [(e["name"], e["ts"], e["dur"]) for e in device] == [
        (e.op, ticks_to_us(e.start, rep.tick_hz), ticks_to_us(e.end - e.start, rep.tick_hz)) for e in rep.events]
    assert device[0]["args"]["source"] == "model.py:10" and "source" not in device[3]["args"]
    dispatch = [e for e in doc["traceEvents"] if e.get("cat") == "dispatch"]
    assert [(e["ts"] + e["dur"]) for e in dispatch] == pytest.approx([e.issued * to_us for e in rep.events])
    assert all(e["dur"] == pytest.approx(dev.dispatch * to_us) for e in dispatch)
    starts = {e["id"]: e for e in doc["traceEvents"] if e.get("ph") == "s"}
    ends = {e["id"]: e for e in doc["traceEvents"] if e.get("ph") == "f"}
    assert len(starts) == len(ends) == len(rep.events) and starts.keys() == ends.keys()
    for fid, s in starts.items():  # each flow: from a dispatch slice to the kernel it issued, forward in time
        f = ends[fid]
        assert s["cat"] == f["cat"] == FLOW_CATEGORY and f["bp"] == "e"
        assert (s["pid"], s["tid"]) == (SIM_HOST_PID, 1) and f["ts"] >= s["ts"]
        assert any(d["ts"] == f["ts"] and d["pid"] == f["pid"] and d["tid"] == f["tid"] for d in device)


def test_expanded_kernels_get_engine_lanes_at_their_launch(run):
    _, rep = run
    doc = run_trace_document(rep, expand=["add"], top=0)
    procs, threads = _names(doc)
    assert doc["expanded"] == ["add (binary)"] and doc["not_expanded"] == []
    assert procs[engines_pid(0, 0)] == "neuron:0 engines, physical core 0 (expanded kernels)"
    lanes = {name for (pid, _), name in threads.items() if pid == engines_pid(0, 0)}
    assert {"Kernel", "Vector", "qSyncIO0"} <= lanes
    add = next(e for e in rep.events if e.op == "add" and e.core == 0)
    kernel = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["pid"] == engines_pid(0, 0)]
    assert len(kernel) == 1 and kernel[0]["ts"] == pytest.approx(add.start * 1e6 / rep.tick_hz)
    engine = [e for e in doc["traceEvents"] if e.get("cat") in ("engine", "dma") and e["pid"] == engines_pid(0, 0)]
    assert len(engine) == len(add.reports[0].timeline)
    assert min(e["ts"] for e in engine) >= kernel[0]["ts"]
    top = run_trace_document(rep, expand=["nope"], top=1)
    assert top["expanded"] == [f"{rep.rows[0].op} ({rep.rows[0].kernel})"] and top["not_expanded"] == ["nope"]


def test_host_events_move_onto_the_simulated_clock(run):
    """A host trace as torch.profiler exports it: each neuron::<op> record ends, on the trace's
    clock, when its launch was issued; nesting and order are kept; real durations stay in args."""
    _, rep = run
    tid = 4242
    calls = [HostCall("mm", tid), HostCall("add", tid), HostCall("mm", tid)]
    host = []
    t = 1000.0
    for c in calls:  # aten::op encloses neuron::op, 50 us apart, real ops much slower than the model's host
        host.append({"ph": "X", "name": f"aten::{c.label}", "cat": "cpu_op", "pid": 7, "tid": tid, "ts": t, "dur": 40.0})
        host.append({"ph": "X", "name": f"neuron::{c.label}", "cat": "cpu_op", "pid": 7, "tid": tid, "ts": t + 5,
                     "dur": 30.0})
        t += 50.0
    doc = run_trace_document(rep, {"traceEvents": host, "baseTimeNanoseconds": 1}, calls,
                             start=(990.0, rep.events[0].issued - 100))
    to_us = 1e6 / rep.tick_hz
    moved = [e for e in doc["traceEvents"] if e.get("pid") == 7 and e["ph"] == "X"]
    records = [e for e in moved if e["name"].startswith("neuron::")]
    issued = [e.issued * to_us for e in rep.events[:3]]
    assert [r["ts"] + r["dur"] for r in records] == pytest.approx(issued)
    assert [r["args"]["wall_dur_us"] for r in records] == [30.0] * 3
    assert [r["args"]["source"] for r in records] == ["model.py:10", "model.py:11", "model.py:10"]
    for outer, inner in zip(moved[::2], moved[1::2]):
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-9
    flows = {e["id"]: e for e in doc["traceEvents"] if e.get("ph") == "s"}
    assert {(f["pid"], f["tid"]) for f in flows.values()} == {(7, tid), (SIM_HOST_PID, 1)}
    assert sorted(f["ts"] for f in flows.values() if f["pid"] == 7) == pytest.approx([r["ts"] for r in records])
    assert doc["host_calls_matched"] == 3 and doc["baseTimeNanoseconds"] == 1


def test_the_time_map_is_monotone_and_runs_at_real_rate_outside_its_anchors():
    m = _TimeMap([(10.0, 100.0), (20.0, 105.0), (30.0, 103.0), (30.0, 200.0)])
    assert (m(0.0), m(10.0), m(15.0), m(20.0), m(25.0), m(30.0), m(40.0)) == (90.0, 100.0, 102.5, 105.0, 152.5,
                                                                                200.0, 210.0)
    assert _TimeMap([])(5.0) == 5.0


def test_the_simulators_own_python_calls_are_dropped():
    ev = [
        {"ph": "X", "cat": "python_function", "name": "train.py(3): step", "args": {"Python id": 1, "Python parent id": None}},
        {"ph": "X", "cat": "python_function", "name": "torch_bridge/runtime.py(40): cost",
         "args": {"Python id": 2, "Python parent id": 1}},
        {"ph": "X", "cat": "python_function", "name": "trnsim/sim.py(12): run", "args": {"Python id": 3, "Python parent id": 2}},
        {"ph": "X", "cat": "python_function", "name": "<built-in function len>", "args": {"Python id": 4, "Python parent id": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "args": {}},
    ]
    kept, dropped = _without_simulator(ev)
    assert [e["name"] for e in kept] == ["train.py(3): step", "torch_bridge/runtime.py(40): cost", "aten::mm"]
    assert dropped == 2


def test_write_run_trace_is_atomic_json(run, tmp_path):
    _, rep = run
    path = write_run_trace(tmp_path / "t.json", rep, top=1)
    doc = json.loads(path.read_text())
    assert doc["generator"] == "trnsim" and doc["launches"] == 4 and [p.name for p in tmp_path.iterdir()] == ["t.json"]
