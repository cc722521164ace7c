"""The collective benchmark's --quick variant runs (benchmarks/bench_collectives.py). Wall time
is printed, never asserted. (The network against its closed form is tests/collectives/test_collective_forms.py;
the published figures are ledger rows, trnsim validate collectives.)"""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_collectives.py"


def test_quick_benchmark_runs():
    r = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "growth with ranks" in r.stdout and "events/s" in r.stdout
    assert "symmetry: alike ranks" in r.stdout and " NO " not in r.stdout
