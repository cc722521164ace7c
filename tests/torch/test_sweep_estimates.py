"""Estimate points in sweeps: a spec names a system, its grid varies the chip or links, each
estimate row holds what a direct estimate gives, and kernels repeat through the cost cache."""

import re
import textwrap
from pathlib import Path

import pytest

from torch_bridge.estimate import estimate_inference
from trnsim.config import ConfigError, load_system
from trnsim.sweep import load_spec, run_sweep

TINY = Path(__file__).parent.parent / "data" / "tiny-llama.json"

SPEC = f"""\
    system: trn2.48xlarge
    grid:
      core.dma.start_latency: [1300ns, 2600ns]
    estimates:
      - {{mode: inference, model: {TINY}, tp: 4, input: 64, output: 4, samples: 2, serving: none}}
      - {{mode: train, model: {TINY}, tp: 2, dp: 2, seq: 64}}
"""


def write(tmp_path, text):
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_estimate_rows_match_direct_estimates(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(tmp_path / "costs"))
    spec = load_spec(write(tmp_path, SPEC))
    assert len(spec.points) == 4 and spec.columns[-7:-1] == ["ttft_ms", "tpot_ms", "tokens_per_s", "step_ms",
                                                             "mfu_percent_step", "hbm_peak_bytes"]
    rows = {(r["core.dma.start_latency"], r["shape"]): r for r in run_sweep(spec, jobs=1).rows}
    inf = rows[("1300ns", "tp=4 pp=1 dp=1")]
    direct, _ = estimate_inference(str(TINY), "trn2.48xlarge", tp=4, input_tokens=64, output_tokens=4, samples=2,
                                   serving="none")  # the device's steps: what a hardware grid moves
    assert inf["error"] == "" and float(inf["ttft_ms"]) == pytest.approx(direct.ttft_ms, abs=1e-4)
    assert float(inf["tpot_ms"]) == pytest.approx(direct.tpot_ms, abs=1e-4)
    slow = rows[("2600ns", "tp=4 pp=1 dp=1")]
    assert float(slow["tpot_ms"]) > float(inf["tpot_ms"])  # each small kernel waits longer for its DMA
    train = rows[("1300ns", "tp=2 pp=1 dp=2")]
    assert float(train["step_ms"]) > 0 and float(train["mfu_percent_step"]) > 0 and train["kernel"] == str(TINY)


@pytest.mark.parametrize("entry,message", [
    ("{mode: inference, model: llama-9}", "estimates[0] (llama-9): unknown model 'llama-9'"),
    ("{mode: serve, model: llama-3.1-8b}", "estimates[0]: expected a mapping with 'mode' (inference or train) and "
                                           "'model'"),
    ("{mode: train, model: llama-3.1-8b, input: 5}", "estimates[0]: unknown key 'input' for train; expected mode, "
                                                     "model, tp, pp, dp, sp, dtype, micro_batch, seq, global_batch"),
    ("{mode: inference, model: llama-3.3-70b, tp: 128}", "estimates[0] (llama-3.3-70b): --tp 128 x --pp 1 x --dp 1 = "
                                                         "128 ranks, but trn2.48xlarge has 64"),
    ("{mode: inference, model: llama-3.1-8b, batch: 0}", "estimates[0] (llama-3.1-8b): batch: expected a positive "
                                                         "whole number, got 0"),
    ("{mode: inference, model: llama-3.1-8b, serving: vllm}", "estimates[0] (llama-3.1-8b): serving: expected one of "
                                                              "vllm-neuron, vllm-v0, none, got 'vllm'"),
])
def test_bad_estimate_entries_are_one_line(tmp_path, entry, message):
    with pytest.raises(ConfigError, match="^" + re.escape("spec.yaml: " + message)):
        load_spec(write(tmp_path, f"system: trn2.48xlarge\nestimates:\n  - {entry}\n"))


def test_estimates_need_a_system(tmp_path):
    with pytest.raises(ConfigError, match=r"^spec.yaml: estimates need a 'system' \(e.g. system: trn2.48xlarge\)$"):
        load_spec(write(tmp_path, "estimates:\n  - {mode: inference, model: llama-3.1-8b}\n"))
    assert load_system("trn2.48xlarge").ranks == 64


def test_the_cli_summary_shows_estimate_rows_on_every_run(tmp_path, monkeypatch, capsys):
    """Issue 25: the summary table took every row's cycles as a number; an estimate row has none,
    so ``trnsim sweep`` wrote every row and then died, on every rerun too."""
    from trnsim.cli import main

    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(tmp_path / "costs"))
    # the model by a short relative path: the table's row names it, and a deep checkout's
    # absolute path wrapped the row over two lines
    (tmp_path / "tiny.json").write_text(TINY.read_text())
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, """\
        system: trn2.48xlarge
        estimates:
          - {mode: inference, model: tiny.json, tp: 4, input: 64, output: 4, samples: 2}
    """)
    for rerun in (False, True):
        assert main(["sweep", str(spec), "--jobs", "1"]) == 0
        out, err = capsys.readouterr()
        assert err == "" and f"{int(rerun)} from a previous run" in out
        row = next(line for line in out.splitlines() if "tp=4 pp=1 dp=1" in line)
        # no cycles, its time in us, and what bounds its decode step
        assert "│ bf16  │        │ " in row and any(f"│ {b}" in row for b in ("HBM", "collectives", "compute"))


@pytest.mark.parametrize("entry,message", [
    ("{mode: inference, model: llama-3.1-8b, samples: 1000000}",
     "estimates[0] (llama-3.1-8b): --samples 1,000,000: expected 1..64 decode steps simulated (the others are "
     "interpolated between them)"),
    ("{mode: train, model: llama-3.1-8b, global_batch: 100000000}",
     "estimates[0] (llama-3.1-8b): --global-batch: 100,000,000 micro-batches per data-parallel replica and step; at "
     "most 4,096 (the pipeline schedule is simulated task by task)"),
    ("{mode: inference, model: llama-3.3-70b}",
     "estimates[0] (llama-3.3-70b): llama-3.3-70b (80 layers, hidden 8,192, bf16): its weights need at least 94.457 "
     "GiB on each of the --tp 1 x --pp 1 ranks holding them, more than a logical core's 24 GiB of HBM on "
     "trn2.48xlarge; shard it over more ranks (--tp, --pp) or run fewer --layers"),
    ("{mode: inference, model: llama-3.1-8b, tp: 8, batch: 100000000000000000000}",
     "estimates[0] (llama-3.1-8b): --batch 100,000,000,000,000,000,000: the KV cache of "
     "100,000,000,000,000,000,000 x 1,152 tokens needs at least 1.67638e+12 PiB on each rank, more than a logical "
     "core's 24 GiB of HBM on trn2.48xlarge; a smaller --batch, or shard it (--tp, --pp)"),
    # ran, every variant's row recording "--dtype 5: expected one of ..."
    ("{mode: inference, model: llama-3.1-8b, tp: 8, dtype: 5}",
     "estimates[0] (llama-3.1-8b): dtype: expected one of bf16, fp16, fp32, got 5"),
    ("{mode: train, model: llama-3.1-8b, tp: 8, dtype: fp8}",
     "estimates[0] (llama-3.1-8b): dtype: expected one of bf16, fp16, fp32, got 'fp8'"),
])
def test_estimate_sizes_are_bounded_when_the_spec_loads(tmp_path, entry, message):
    """Issue 25: the bounds of ``trnsim estimate`` hold for a sweep's estimate entries too."""
    with pytest.raises(ConfigError) as e:
        load_spec(write(tmp_path, f"system: trn2.48xlarge\nestimates:\n  - {entry}\n"))
    assert str(e.value) == f"spec.yaml: {message}"


def test_an_estimate_listed_twice_is_refused_when_the_spec_loads(tmp_path):
    """It ran twice and wrote two rows of one key (kernel points listed twice were refused)."""
    entry = "{mode: inference, model: llama-3.2-1b, input: 64, output: 4}"
    with pytest.raises(ConfigError, match=r"^spec.yaml: estimates: llama-3.2-1b tp=1 pp=1 dp=1 bf16 batch=1;.* is "
                                          r"listed twice$"):
        load_spec(write(tmp_path, f"system: trn2.48xlarge\nestimates:\n  - {entry}\n  - {entry}\n"))
