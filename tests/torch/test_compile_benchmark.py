"""benchmarks/bench_compile.py --quick: both models train eager and compiled with equal losses
(GPT-2's compiled AdamW step against its capturable form run eagerly),
and the script prints the simulated step both ways with its ratio, launches, dispatches, HBM
bytes, wall times and compile time."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compile.py"


def test_compile_benchmark_quick():
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for line in ("simulated step us (elapsed)", "kernel launches per step", "host dispatches per step",
                 "HBM MB per step", "wall ms per step (steady state)"):
        assert text.count(line) == 2, line  # the GPT-2 and the CNN
    assert len(re.findall(r"compile wall time \d+\.\d\d s", text)) == 2
    # the steady compiled step against eager's, from interleaved pairs (a ratio, never judged by the test)
    assert len(re.findall(r"steady compiled wall / eager wall on neuron, 2 interleaved pairs: \d+\.\d{3}x", text)) == 2
    # ... split into the step's phases, each a CPU time per mode
    assert len(re.findall(r"by phase, process CPU ms \(eager -> compiled, medians of the pairs\): forward [\d,.]+ -> "
                          r"[\d,.]+; backward [\d,.]+ -> [\d,.]+; optimizer step [\d,.]+ -> [\d,.]+", text)) == 2
    ratio = float(re.search(r"compiled / eager: (\d+\.\d\d)x faster in simulated time \(goal >= 1\.5x", text)[1])
    assert ratio > 1.2  # fusion and graph launches save time on the GPT-2 step
    assert "largest relative difference 0.0e+00" in text  # the CNN: SGD's compiled step is eager's
    assert "losses against eager capturable AdamW (the form the compiled step computes): equal bit for bit" in text


def test_compile_benchmark_llama_quick():
    """``--model llama``: Hugging Face's Llama at the GPT-2's size (grouped-query attention,
    SwiGLU, RMSNorm, rotary positions) trains compiled with the losses of its eager capturable
    AdamW, bit for bit, and fewer launches and dispatches than eager."""
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--model", "llama"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert text.count("simulated step us (elapsed)") == 1 and "small Llama (4 layers" in text
    launches = re.search(r"kernel launches per step\s+([\d,]+)\s+([\d,]+)", text)
    assert int(launches[2].replace(",", "")) < int(launches[1].replace(",", ""))
    assert "losses against eager capturable AdamW (the form the compiled step computes): equal bit for bit" in text
