"""`trnsim run --compare-eager`: the same script with torch.compile off, then on; the simulated
time side by side, and the compiled run's regions in its report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm = nn.Linear(128, 512), nn.Linear(512, 128), nn.LayerNorm(128)

        def forward(self, x):
            return self.norm(x + self.fc2(nn.functional.gelu(self.fc1(x))))

    torch.manual_seed(0)
    model = torch.compile(Block().to("neuron"), backend="neuron")
    x = torch.randn(256, 128, device="neuron")
    for _ in range(2):
        model(x).sum().backward()
    print("done")
""")


def _trnsim(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_compare_eager_prints_both_runs(tmp_path):
    script = tmp_path / "block.py"
    script.write_text(SCRIPT)
    out = _trnsim("run", str(script), "--compare-eager", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.count("done") == 2  # the script ran twice
    assert re.search(r"compiled: 2 graphs compiled in \d+\.\d\d s wall \(not charged to the device\); 4 graph "
                     r"launches", text)
    assert "compiled regions: " in text and "matmul_fused" in text
    assert "eager vs compiled:" in text
    for row in ("elapsed us (simulated)", "device time us", "device waiting on the host us", "kernel launches",
                "host dispatches", "HBM MB"):
        assert row in text
    assert re.search(r"compiled is \d+\.\d\dx (faster|slower) in simulated time", text)


def test_compare_eager_json_and_bad_flags(tmp_path):
    script = tmp_path / "block.py"
    script.write_text(SCRIPT)
    out = _trnsim("run", str(script), "--compare-eager", "--json", cwd=tmp_path)
    data = json.loads(out.stdout[out.stdout.index("{"):])
    assert data["eager"]["compiled_graphs"] == 0 and data["compiled"]["compiled_graphs"] == 2
    assert data["compiled"]["launches_saved"] > 0 and data["compiled"]["hbm_bytes_saved"] > 0
    assert data["eager"]["graph_launches"] == 0 and data["compiled"]["graph_launches"] == 4
    bad = _trnsim("run", str(script), "--compare-eager", "--trace", str(tmp_path / "t.json"), cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("trnsim: error: run: --compare-eager runs the script twice; --trace takes one run "
                                  "(drop one of them)")
