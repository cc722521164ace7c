"""`trnsim estimate serve` on the tiny model: the vllm-bench-serve table, JSON, a rate sweep with its
plot, step times from the lowered model's simulated steps, and one-line errors."""

import json
from pathlib import Path

import pytest

from torch_bridge import nxdi
from torch_bridge.estimate_kernels import StepCosts
from trnsim.cli import main
from trnsim.config import load_system
from trnsim.estimate import Plan
from trnsim.models import load_model

TINY = str(Path(__file__).parent.parent / "data" / "tiny-llama.json")
BASE = ["estimate", "serve", "--model", TINY, "--tp", "4", "--requests", "12", "--input", "200", "--output", "8",
        "--rate", "50"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(tmp_path_factory.mktemp("costs")))


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # an argparse error
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_serve_prints_what_vllm_bench_serve_prints(capsys):
    code, out, err = run(capsys, *BASE)
    assert code == 0 and err == ""
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Mean TTFT (ms):", "Median TTFT (ms):", "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):",
                 "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert line in out
    assert "Successful requests:                            12" in out


def test_json_step_times_are_the_simulated_steps(capsys):
    code, out, _ = run(capsys, *BASE, "--json", "--rate", "inf", "--max-batch", "4")
    d = json.loads(out)
    assert code == 0 and d["requests"] == 12 and d["max_running"] <= 4
    # one request alone: TTFT is the prefill step of its context bucket, TPOT the decode step of batch 1
    code, out, _ = run(capsys, *BASE[:6], "--requests", "1", "--input", "200", "--output", "8", "--json",
                       "--serving", "none")
    one = json.loads(out)
    costs = StepCosts(load_model(TINY), load_system("trn2.48xlarge"), Plan(4, 1, 1, True),
                      nxdi.Shards(4, 1, True))
    assert one["ttft"]["mean_ms"] == pytest.approx(costs.prefill(1, 208) * 1e3)  # 208 = 200 + 8: the largest bucket
    assert one["tpot"]["mean_ms"] == pytest.approx(costs.decode(1, 256) * 1e3)
    # vLLM Neuron's engine (the default): the prefill and the first decode after it pay the host's
    # iteration in full, the later decodes max(host, device)
    code, out, _ = run(capsys, *BASE[:6], "--requests", "1", "--input", "200", "--output", "8", "--json")
    host = load_system("trn2.48xlarge").chip.host.serve_step * 1e-12
    d = costs.decode(1, 256)
    eng = json.loads(out)
    assert eng["setup"]["serving"] == "vllm-neuron" and eng["setup"]["host_step_ms"] == pytest.approx(host * 1e3)
    assert eng["ttft"]["mean_ms"] == pytest.approx((costs.prefill(1, 208) + host) * 1e3)
    assert eng["tpot"]["mean_ms"] == pytest.approx((host + d + 6 * max(host, d)) / 7 * 1e3)


def test_a_sweep_prints_latency_against_rate_and_plots_it(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "lat.png"
    code, out, _ = run(capsys, *BASE[:-2], "--sweep", "5,500", "--plot", str(png))
    assert code == 0 and "Latency against request rate" in out and png.stat().st_size > 1000
    d = json.loads(run(capsys, *BASE[:-2], "--sweep", "5,500", "--json")[1])
    assert [r["setup"]["rate"] for r in d] == [5, 500]
    assert d[1]["ttft"]["p99_ms"] > d[0]["ttft"]["p99_ms"]  # requests queue behind each other


def test_data_parallel_replicas_share_the_requests(capsys):
    code, out, _ = run(capsys, *BASE, "--rate", "inf", "--json")
    one = json.loads(out)
    code, out, _ = run(capsys, *BASE, "--rate", "inf", "--json", "--dp", "2")
    two = json.loads(out)
    assert code == 0 and two["setup"]["dp"] == 2 and two["requests"] == 12
    assert two["duration_s"] < one["duration_s"] and two["ttft"]["mean_ms"] < one["ttft"]["mean_ms"]
    code, out, _ = run(capsys, *BASE, "--dp", "2")
    assert code == 0 and "TP=4 x DP=2 replicas" in out


@pytest.mark.parametrize("argv,message", [
    (["--rate", "0"], "argument --rate: '0': expected a positive number"),
    (["--dp", "0"], "--dp 0: expected a whole number in 1..4,096"),
    (["--serving", "vllm"], "argument --serving: invalid choice: 'vllm'"),
    (["--requests", "1000000000"], "--requests 1000000000: expected a whole number in 1..100,000"),
    (["--max-batch", "0"], "--max-batch 0: expected a whole number in 1..1,024"),
    (["--kv-tokens", "10"], "request 1: 208 tokens of KV cache, more than its capacity of 10 tokens"),
    (["--trace", "no/such.csv", "--rate", "2"], "--trace gives the arrivals: not with --rate or --sweep"),
    (["--trace", "no/such.csv"], "trace 'no/such.csv' not found"),
    (["--plot", "x.png"], "--plot draws a --sweep of request rates"),
    (["--rate", "5", "--sweep", "1,2"], "--sweep gives the request rates: not with --rate"),  # --rate was dropped
    (["--prefix-len", "300"], "--prefix-len 300: longer than --input 200"),
    (["--ep", "2"], "--ep 2: tiny-llama has no MoE experts to split"),
    (["--kv-buckets", "1,x"], "--kv-buckets '1,x': expected a comma-separated list"),
    (["--input", "5000"], "a request of 5,008 tokens (prompt + output): more than tiny-llama's"),
])
def test_bad_serve_options_are_one_line(capsys, argv, message):
    argv_base = [a for a in BASE]
    if "--rate" in argv or "--trace" in argv:
        i = argv_base.index("--rate")
        del argv_base[i:i + 2]
    code, out, err = run(capsys, *argv_base, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
