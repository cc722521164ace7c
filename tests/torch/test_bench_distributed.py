"""benchmarks/bench_distributed.py --quick runs (the demo GPT-2's DDP step on 2 ranks against one
process) and prints its table; wall time is printed, never asserted."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_prints_wall_and_simulated_step_and_collective_share():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_distributed.py"), "--quick"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ranks"))
    assert "wall s/step" in lines[head] and "sim us/step" in lines[head] and "overlapped" in lines[head]
    base, two = lines[head + 1].split(), lines[head + 2].split()
    assert base[0] == "1*" and base[2] == "1.00x" and two[0] == "2"
    assert float(two[5].replace(",", "")) > 0  # rank 0 spent time in collectives
