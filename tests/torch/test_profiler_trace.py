"""torch.profiler down to the engines: one merged trace with the host's Python and aten events,
the device's stream lanes, expanded kernels' engine lanes, flows from each host op to its
kernels and the Python line of each launch; `trnsim run --trace/--metrics/--plot`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from trnsim.run_trace import FLOW_CATEGORY, SIM_HOST_PID, device_pid, engines_pid

HERE = Path(__file__).name


def _lines(fn):
    """The source lines of ``fn`` by their text, as ``file:line``."""
    import inspect

    src, first = inspect.getsourcelines(fn)
    return {text.strip(): f"tests/torch/{HERE}:{first + i}" for i, text in enumerate(src)}


def _model_step(x, w):
    y = torch.relu(x @ w)
    loss = y.sum()
    loss.backward()
    return loss.item()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    x = torch.randn(64, 128, device="neuron", requires_grad=True)
    w = torch.randn(128, 256, device="neuron")
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        _model_step(x, w)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    torch.neuron.profiler.export_trace(prof, path, expand=["relu"], top=1)
    doc = json.loads(path.read_text())
    return doc, torch.neuron.profiler.last_session().report


def _procs_threads(doc):
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    return procs, threads


def test_host_and_device_lanes(traced):
    doc, rep = traced
    procs, threads = _procs_threads(doc)
    ev = doc["traceEvents"]
    host = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function")]
    assert {"aten::mm", "neuron::mm", "aten::relu", "neuron::relu", "neuron::threshold_backward"} <= \
        {e["name"] for e in host}
    assert any(e["cat"] == "python_function" and e["name"].endswith("_model_step") for e in host)
    assert not any(e["cat"] == "python_function" and e["name"].startswith("trnsim/") for e in host)
    assert doc["simulator_python_events_dropped"] > 0
    host_pids = {e["pid"] for e in host}
    assert len(host_pids) == 1 and procs[host_pids.pop()]  # torch.profiler's own process, named by it
    assert procs[SIM_HOST_PID] == "host (simulated)"
    assert procs[device_pid(0)] == "neuron:0 (trn2, simulated)"
    assert threads[(device_pid(0), 2)] == "stream 0 (default)"
    device = [e for e in ev if e.get("pid") == device_pid(0) and e.get("ph") == "X"]
    assert [e["name"] for e in device] == [e.op for e in rep.events]
    assert {"mm", "relu", "sum", "threshold_backward"} <= {e["name"] for e in device}
    assert all(e["args"]["kernel"] for e in device)


def test_expanded_kernels_have_engine_and_dma_lanes(traced):
    doc, rep = traced
    procs, threads = _procs_threads(doc)
    assert doc["expanded"][0] == "relu (unary)" and len(doc["expanded"]) == 2  # relu, then the busiest row
    assert procs[engines_pid(0, 0)] == "neuron:0 engines, physical core 0 (expanded kernels)"
    lanes = {name for (pid, _), name in threads.items() if pid == engines_pid(0, 0)}
    assert {"Kernel", "Tensor", "Vector", "Scalar"} <= lanes and any(n.startswith("q") for n in lanes)
    relu = next(e for e in doc["traceEvents"] if e.get("pid") == device_pid(0) and e.get("name") == "relu")
    assert relu["args"]["expanded"] is True
    spans = [e for e in doc["traceEvents"] if e.get("pid") == engines_pid(0, 0) and e.get("cat") == "kernel"]
    assert relu["ts"] in [s["ts"] for s in spans]


def test_every_launch_has_a_flow_from_its_host_op(traced):
    doc, rep = traced
    ev = doc["traceEvents"]
    starts = {e["id"]: e for e in ev if e.get("ph") == "s" and e.get("cat") == FLOW_CATEGORY}
    ends = {e["id"]: e for e in ev if e.get("ph") == "f" and e.get("cat") == FLOW_CATEGORY}
    assert starts.keys() == ends.keys() and len(starts) == len(rep.events)
    records = [e for e in ev if e.get("ph") == "X" and str(e.get("name")).startswith("neuron::")]
    by_start = {(r["pid"], r["tid"], r["ts"]): r for r in records}
    device = {(e["ts"], e["tid"]): e for e in ev if e.get("pid") == device_pid(0) and e.get("ph") == "X"}
    for fid, s in starts.items():
        rec = by_start[(s["pid"], s["tid"], s["ts"])]  # the flow leaves the neuron::<op> host record
        kernel = device[(ends[fid]["ts"], ends[fid]["tid"])]
        assert rec["name"] == f"neuron::{kernel['name']}"
        assert rec["ts"] + rec["dur"] <= kernel["ts"] + 1e-6  # one time base: the op is issued before it runs
        assert ends[fid]["bp"] == "e"


def test_device_events_name_the_source_line_that_launched_them(traced):
    doc, _ = traced
    lines = _lines(_model_step)
    device = [e for e in doc["traceEvents"] if e.get("pid") == device_pid(0) and e.get("ph") == "X"]
    by_op = {}
    for e in device:
        by_op.setdefault(e["name"], set()).add(e["args"]["source"])
    assert by_op["mm"] >= {lines["y = torch.relu(x @ w)"], lines["loss.backward()"]}  # forward, and backward's
    assert by_op["relu"] == {lines["y = torch.relu(x @ w)"]}
    assert by_op["threshold_backward"] == {lines["loss.backward()"]}  # run by autograd's thread for backward()
    assert by_op["_local_scalar_dense"] == {lines["return loss.item()"]}
    host = [e for e in doc["traceEvents"] if e.get("name") == "neuron::relu"]
    assert host[0]["args"]["source"] == lines["y = torch.relu(x @ w)"]


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_trace_handler_writes_each_cycle(tmp_path):
    x = torch.ones(32, 32, device="neuron")
    handler = torch.neuron.profiler.trace_handler(str(tmp_path / "t-{step}.json"), top=0)
    sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=2)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=handler) as prof:
        for _ in range(4):
            (x + 1).sum()  # recorded in the active steps only
            prof.step()
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["t-2.json", "t-4.json"]
    for name in written:
        doc = json.loads((tmp_path / name).read_text())
        assert [e["name"] for e in doc["traceEvents"] if e.get("pid") == device_pid(0) and e.get("ph") == "X"] == \
            ["add", "sum"]


def test_a_session_without_neuron_ops_has_host_events_only(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(2) + 1
    doc = json.loads(torch.neuron.profiler.export_trace(prof, tmp_path / "t.json").read_text())
    assert doc["launches"] == 0 and any(e.get("name") == "aten::add" for e in doc["traceEvents"])
    assert not any(e.get("pid") == device_pid(0) for e in doc["traceEvents"])


def test_export_needs_a_finished_session(tmp_path):
    import torch_bridge.profiler as p

    saved = list(p._closed)
    p._closed.clear()
    try:
        with pytest.raises(RuntimeError, match="^torch.neuron.profiler: no torch.profiler session ran neuron ops"):
            torch.neuron.profiler.export_trace(object(), tmp_path / "t.json")
        assert list(tmp_path.iterdir()) == []
    finally:
        p._closed[:] = saved


SCRIPT = textwrap.dedent("""
    import torch
    x = torch.randn(64, 128, device="neuron", requires_grad=True)
    w = torch.randn(128, 256, device="neuron")
    for _ in range(2):
        y = (x @ w).relu()
        y.sum().backward()
    print("done")
""")


def _trnsim(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_trnsim_run_trace_metrics_and_plot(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("matplotlib")
    (tmp_path / "train.py").write_text(SCRIPT)
    out = _trnsim("run", "train.py", "--trace", "t.json", "--expand", "mm", "--expand", "nope", "--expand-top", "1",
                  "--metrics", "m.parquet", "--plot", "p.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "trnsim: note: --expand nope: no launch of such an op or kernel in the trace" in out.stderr
    for line in ("Trace written to t.json", "Metrics written to m.parquet (Parquet)", "Plot written to p.png"):
        assert line in out.stdout
    doc = json.loads((tmp_path / "t.json").read_text())
    procs, _ = _procs_threads(doc)
    assert procs[device_pid(0)].startswith("neuron:0") and engines_pid(0, 0) in procs
    sources = {e["args"].get("source") for e in doc["traceEvents"] if e.get("pid") == device_pid(0) and e.get("ph") == "X"}
    assert {"train.py:6", "train.py:7"} <= sources
    assert any(e.get("name") == "neuron::mm" for e in doc["traceEvents"])
    rows = pq.read_table(tmp_path / "m.parquet").to_pylist()
    assert {r["op"]: r["source_line"] for r in rows}["relu"] == "train.py:6"
    assert {r["op"]: r["source_line"] for r in rows}["threshold_backward"] == "train.py:7"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.parquet", "p.png", "t.json", "train.py"]


def test_kineto_names_with_quotes_are_repaired(tmp_path):
    """Kineto writes Python frame names unescaped: a function named with a quote breaks the JSON."""
    raw = ('{\n  "traceEvents": [\n  {\n    "ph": "X", "cat": "python_function",\n'
           '    "name": "attr/converters.py(0): "",\n    "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0,\n'
           '    "args": {\n      "name": "a \\\\ b"\n    }\n  }\n  ]\n}\n')
    path = tmp_path / "host.json"
    path.write_text(raw)
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    doc = torch.neuron.profiler.load_chrome_trace(path)
    assert doc["traceEvents"][0]["name"] == 'attr/converters.py(0): "'
    assert doc["traceEvents"][0]["args"]["name"] == "a \\ b"
