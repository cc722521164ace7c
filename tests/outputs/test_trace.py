"""Perfetto/Chrome traces: the JSON parses, lanes are named, no lane overlaps itself, and the
busy time drawn per lane is the busy time the report counts."""

import json
from pathlib import Path

import pytest

import trnsim.trace as trace_mod
from trnsim.chip import Chip
from trnsim.config import load_config
from trnsim.report import union_length
from trnsim.sweep import resolve_kernel
from trnsim.trace import write_trace

ROOT = Path(__file__).resolve().parents[2]
CFG = load_config("trn2")


def _report(name, shape, core=0):
    kernel = resolve_kernel(name, ROOT).make(shape, None, CFG, {})
    return Chip(CFG).run(kernel, timing_only=True, core=core).report


@pytest.fixture(scope="module")
def reports():
    # softmax keeps two loads in flight on one DMA queue, so it exercises the overflow lanes
    return [_report("matmul", (256, 512, 1024)), _report("examples/softmax_kernel.py:build_softmax", (512, 1024))]


def _load(path):
    doc = json.loads(Path(path).read_text())
    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    lanes = {}
    for e in events:
        if e["ph"] == "X":
            lanes.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return events, lanes


@pytest.mark.parametrize("which", [0, 1])
def test_lanes_are_named_disjoint_and_add_up_to_the_report(tmp_path, reports, which):
    rep = reports[which]
    out = write_trace(tmp_path / "t.json", rep)
    events, lanes = _load(out)
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["NeuronCore 0 (trn2)"]
    assert {"Kernel", "Vector", "Scalar", "qSyncIO0"} <= set(lanes)
    for lane, evs in lanes.items():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-9, f"overlap in lane {lane}"
    assert sum(len(v) for k, v in lanes.items() if k != "Kernel") == len(rep.timeline)
    (span,) = lanes["Kernel"]
    assert span["dur"] == pytest.approx(rep.total_us) and span["name"] == rep.kernel

    def busy_ticks(prefix):
        return union_length((e["args"]["start_tick"], e["args"]["end_tick"]) for lane, evs in lanes.items()
                            for e in evs if lane == prefix or lane.startswith(prefix + " ("))

    for engine, stats in rep.engines.items():
        assert busy_ticks(engine) == stats.busy_ticks, engine
    for queue, q in rep.dma.queues.items():
        assert busy_ticks(queue) * 1e6 / rep.tick_hz == pytest.approx(q["busy_us"]), queue
    for lane, evs in lanes.items():
        for e in evs:
            if lane != "Kernel":
                ticks = e["args"]["end_tick"] - e["args"]["start_tick"]
                assert e["dur"] == pytest.approx(ticks * 1e6 / rep.tick_hz)


def test_overlapping_transfers_of_one_queue_get_their_own_lanes(tmp_path, reports):
    _, lanes = _load(write_trace(tmp_path / "t.json", reports[1]))
    assert "qSyncIO0 (2)" in lanes
    instrs = [e["args"]["instruction"] for lane, evs in lanes.items() if lane.startswith("qSyncIO0") for e in evs]
    assert sorted(instrs) == sorted(s[4] for s in reports[1].timeline if s[0] == "qSyncIO0")


def test_kernels_on_one_core_run_end_to_end_and_cores_get_processes(tmp_path, reports):
    other = _report("matmul", (256, 512, 1024), core=1)
    events, lanes = _load(write_trace(tmp_path / "t.json", [*reports, other]))
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "NeuronCore 0 (trn2)", 1: "NeuronCore 1 (trn2)"}
    spans = sorted((e["pid"], e["ts"], e["dur"], e["name"]) for e in lanes["Kernel"])
    assert spans[0][1] == 0 and spans[1][1] == pytest.approx(spans[0][2]) and spans[2][:2] == (1, 0)
    assert [s[3] for s in spans] == ["matmul", "softmax", "matmul"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, reports, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text("old")

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(trace_mod.json, "dump", boom)
    with pytest.raises(RuntimeError):
        write_trace(path, reports[0])
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_reports_of_different_clocks_are_refused(reports):
    fast = load_config("trn2", {"core.vector.clock": "1GHz"})
    rep = Chip(fast).run(resolve_kernel("matmul").make((128, 128, 512), None, fast, {}), timing_only=True).report
    with pytest.raises(ValueError, match="different tick rates"):
        trace_mod.trace_events([reports[0], rep])
