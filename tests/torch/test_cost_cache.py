"""The neuron device's on-disk cost cache ($TRNSIM_COST_CACHE, issue 30's first steps): a program
run again takes its kernels' costs from the disk, with the same report, trace and values as the
run that simulated them and as a run without the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # (every test starts Python processes)

PROGRAM = r"""
import hashlib, json, torch
from torch import nn
from trnsim.outputs.run_trace import run_trace_document
from torch_bridge.runtime import runtime

torch.neuron.reset_report(trace=True)
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)).to("neuron")
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randn(32, 64).to("neuron")
y = torch.randint(0, 10, (32,)).to("neuron")
for _ in range(2):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
r = torch.neuron.report()
digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
dev = runtime().device
sim = dev.simulated
trace = run_trace_document(r, top=3)  # (engine lanes of the 3 busiest rows: their kernels' reports)
print(json.dumps({"loss": loss.item().hex(), "weights": digest([p.detach().cpu().tolist() for p in m.parameters()]),
                  "report": digest(str(r)), "figures": digest(r.to_dict()), "trace": digest(trace),
                  "events": len(trace["traceEvents"]), "simulated": sim, "after_trace": dev.simulated,
                  "device": type(dev).__name__}))
"""


def _process(cache: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRNSIM_COST_CACHE"}
    if cache is not None:
        env["TRNSIM_COST_CACHE"] = cache
    return subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)


def _run(cache: str | None) -> dict:
    out = _process(cache)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_run_reads_its_costs_and_reports_the_same(tmp_path):
    cache = tmp_path / "costs"
    off = _run(None)
    cold = _run(str(cache))
    warm = _run(str(cache))
    assert off["device"] == "Device" and cold["device"] == warm["device"] == "CachedDevice"
    assert off["simulated"] > 0 and cold["simulated"] == off["simulated"]
    assert warm["simulated"] == 0  # every kernel's cost from the disk (before the trace's lanes)
    assert list(cache.rglob("*.json"))
    same = ("loss", "weights", "report", "figures", "trace", "events")
    assert [cold[k] for k in same] == [off[k] for k in same]
    assert [warm[k] for k in same] == [off[k] for k in same]  # the trace's engine lanes simulated when read
    # ... and only theirs: the 3 expanded launches' kernels (2 physical cores each on trn2), not every
    # launch the trace asks whether it ran a kernel
    assert 0 < warm["after_trace"] <= 3 * 2 < off["simulated"]


def test_a_cache_that_is_a_file_is_refused_naming_the_variable(tmp_path):
    """At the device's first use, before anything is written (trnsim run turns it into one line:
    test_cli_run)."""
    f = tmp_path / "costs"
    f.write_text("not a directory")
    out = _process(str(f))
    assert out.returncode != 0 and not out.stdout.strip()
    last = out.stderr.strip().splitlines()[-1]
    assert f"TRNSIM_COST_CACHE={f}: {f} is not a directory" in last and "'on'" in last
    assert f.read_text() == "not a directory"
