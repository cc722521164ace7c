"""benchmarks/bench_datapath_step.py --quick: every matmul of the small GPT-2's training step
through the bridge's datapath call and through torch, values checked against the definition,
and the step totals printed (wall-clock figures are reported, never asserted)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_datapath_step.py"


def test_datapath_step_benchmark_quick():
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert len(re.findall(r"^  \S.* \d+\.\d\dx$", text, re.M)) == 15  # one row per step shape
    assert re.search(r"step total \(21\.3 GFLOP\): datapath [\d.]+ ms .* ratio \d+\.\d\dx", text)
    assert "values vs reference: bit-identical" in text
