"""benchmarks/bench_sweep_executors.py --quick runs and both executors write the same rows (the
wall times it prints are never asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_sweep_on_pool_and_ray():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sweep_executors.py"), "--quick", "--jobs", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("sweep of 8 points, timing-only, 2 workers; load average before: ")
    assert "  pool  " in out.stdout
    assert "rows identical" in out.stdout or "ray   not installed" in out.stdout
