"""The collective benchmarks' --quick variants run and their fidelity checks hold
(benchmarks/fidelity_collectives.py explains them). Wall time is printed, never asserted."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FID = ROOT / "benchmarks" / "fidelity_collectives.py"
BENCH = ROOT / "benchmarks" / "bench_collectives.py"


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fid = _load(FID, "fidelity_collectives")


def test_textbook_form_misses_shared_links_our_form_counts():
    rows = {r.case: (r, tb) for _, r, tb in fid.contended(quick=True)}
    r, textbook = rows["all-reduce rdh on trn2.48xlarge, 16 ranks"]
    assert r.ratio == pytest.approx(1.0, abs=0.02) and textbook < 0.85 * r.sim_us


@pytest.mark.parametrize("script", [FID, BENCH])
def test_quick_scripts_run(script):
    r = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "MISS" not in r.stdout and "Traceback" not in r.stderr  # fidelity exits 1 on a 2% miss
    if script == FID:
        assert "27/27 within 2%" in r.stdout
    if script == BENCH:
        assert "growth with ranks" in r.stdout and "events/s" in r.stdout
