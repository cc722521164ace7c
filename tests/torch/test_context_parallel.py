"""Context parallelism (issue 29): ring attention over a CP group, worked by hand for one layer of
the tiny Llama (8 query heads and 2 KV heads of 32) at DP=2 split into one CP group of 2, seq 512.

Each rank holds 256 tokens of the sequence (chunks i and 3 - i of 4). Forward: step 0 attends its
own block causally (flash kernel, 1 x 8 x 256 x 32, causal); step 1 the other rank's block, of
which half survives the causal mask (flash kernel on two query halves, 2 x 8 x 128 x 32, not
causal), while one permute brings that block: k and v of 2 heads x 256 tokens x 32 x 2 bytes =
65,536 bytes. Backward: both steps' flash backward (3 passes each), the block passed on again
(1 permute) and each block's key/value gradient sent on (2 permutes, the last one home).
"""

from pathlib import Path

import pytest

from torch_bridge.estimate import estimate_train
from trnsim.cli import main

TINY = str(Path(__file__).parent.parent / "data" / "tiny-llama.json")
SYSTEM = "trn2.48xlarge"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


def _kind(report, name):
    return next((k for k in report.kinds if k.kind == name), None)


def test_ring_attention_step_worked_by_hand(cache):
    import torch_bridge.timing.parallel as par

    calls = []
    charge = par.Comm.charge

    def record(self, collective, nbytes, group, *a, **k):
        calls.append((collective, nbytes, tuple(group)))
        return charge(self, collective, nbytes, group, *a, **k)

    par.Comm.charge = record
    try:
        est, _ = estimate_train(TINY, SYSTEM, layers=1, dp=2, seq=512, cache_dir=cache, cp=2)
    finally:
        par.Comm.charge = charge
    assert [c for c in calls if c[0] == "permute"] == [("permute", 65_536, (0, 1))] * 4  # 1 forward, 3 backward
    assert _kind(est.forward, "attention").calls == 2 and _kind(est.backward, "attention").calls == 6
    assert [c[:3] for c in est.forward.collectives] == [("permute", "mesh", 1)]
    assert [c[:3] for c in est.backward.collectives] == [("permute", "mesh", 3)]
    # one sequence a step (the CP group shares it), every token counted once
    assert est.global_batch == 1 and est.tokens_per_s == pytest.approx(512 / (est.step_ms / 1e3))
    assert "CP=2 (ring attention)" in ", ".join(est.assumptions) or est.recipe["cp"] == 2
    # the rank keeps what a 256-token step keeps: its queries, keys, values, output and statistics
    half, _ = estimate_train(TINY, SYSTEM, layers=1, dp=2, seq=256, cache_dir=cache)
    assert est.train_memory[0].activations == half.train_memory[0].activations


@pytest.mark.parametrize("argv,message", [
    (["--dp", "2", "--cp", "3", "--seq", "96"], "--cp 3: context parallelism splits the data-parallel ranks and each "
     "sequence in 6 load-balanced chunks; --dp 2 is not a multiple of 3"),
    (["--dp", "2", "--cp", "2", "--seq", "70"], "--cp 2: context parallelism splits the data-parallel ranks and each "
     "sequence in 4 load-balanced chunks; --seq 70 is not a multiple of 4"),
    (["--dp", "2", "--cp", "0"], "--cp 0: expected a whole number 1..65,536"),
])
def test_cli_refuses_a_cp_that_does_not_divide(argv, message, capsys):
    code = main(["estimate", "train", "--model", TINY, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == f"trnsim: error: {message}\n"
