"""The parallelism APIs users run, unchanged, on virtual NeuronCores: DDP, FSDP2, ZeRO, tensor
parallelism (with and without sequence parallelism), pipelining, SimpleFSDP-style compiled FSDP
and a 2D mesh (FSDP x TP) train examples/train_gpt2_parallel.py's GPT-2 to the losses of the same
run in one process.

Two launches only (multi-process runs are slow on CI machines): the 2-rank modes in turn in one
process group (tests/torch/parallel_driver.py), and the 4-rank 2D mesh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "torch" / "parallel_driver.py"
STEPS = 2  # the second loss already depends on the first update
TWO_RANKS = ("ddp", "fsdp2", "zero", "tp", "tp+sp", "pp", "simplefsdp")


def _run(nproc: int, out: Path, modes: tuple[str, ...]) -> dict:
    run = subprocess.run([sys.executable, "-m", "trnsim.cli", "run", "--nproc", str(nproc), "--json", str(DRIVER),
                          str(out), str(STEPS), *modes], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The same GPT-2, data and AdamW steps in one process, no torch.distributed."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt2_parallel import train

    return train("none", STEPS, 8, 32, "neuron")


def test_two_rank_parallelisms_match_one_process(reference, tmp_path):
    losses = _run(2, tmp_path / "losses.json", TWO_RANKS)
    assert set(losses) == set(TWO_RANKS)
    for mode in TWO_RANKS:
        assert losses[mode] == pytest.approx(reference, rel=1e-5), mode
    assert reference[-1] < reference[0]  # it trains


def test_2d_fsdp_x_tp_on_four_ranks_matches_one_process(reference, tmp_path):
    losses = _run(4, tmp_path / "losses.json", ("2d",))
    assert losses["2d"] == pytest.approx(reference, rel=1e-5)
