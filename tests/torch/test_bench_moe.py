"""benchmarks/bench_moe.py --quick: the Mixtral MoE layer as one moe launch against its ops run
one by one, with equal values, and the ratio printed."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"


def test_moe_benchmark_quick():
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for line in ("simulated elapsed us", "device time us", "kernel launches", "HBM MB", "busiest engines"):
        assert text.count(line) == 2, line
    m = re.search(r"op by op / moe kernel: (\d+\.\d\d)x elapsed, (\d+\.\d\d)x device time, (\d+) launches -> 1", text)
    assert m and float(m[1]) > 1.0 and int(m[3]) > 10
    assert "values equal: True" in text
