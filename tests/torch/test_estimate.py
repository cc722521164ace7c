"""`trnsim estimate`: a model sharded over a system, one rank per role, collectives from the
NeuronLink model, TTFT/TPOT/tokens/s and a training step; CLI text, JSON, trace and errors."""

import json
from pathlib import Path

import pytest

from trnsim.collectives import simulate_collective

from torch_bridge.estimate import estimate_inference, estimate_train
from torch_bridge.parallel import Plan
from trnsim.cli import main
from trnsim.config import ConfigError, load_system

TINY = str(Path(__file__).parent.parent / "data" / "tiny-llama.json")
GOLDEN = Path(__file__).parent.parent / "golden"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tp4_collectives_are_what_trnsim_collective_simulates(cache, capsys):
    """Every TP=4 all-reduce of a decode step (a 512-byte hidden state) and of the prefill (128
    tokens: 64 KiB) costs the rank what `trnsim collective` gives for that size on 4 ranks, less
    the runtime's per-op launch: inside a compiled graph a collective pays ``graph_launch``."""
    from trnsim.collectives.runtime import in_graph

    graph = in_graph(load_system("trn2.48xlarge"))
    assert graph.collectives.launch == graph.collectives.graph_launch < load_system("trn2.48xlarge").collectives.launch
    est, _ = estimate_inference(TINY, eager=True, tp=4, input_tokens=128, output_tokens=8, samples=2, cache_dir=cache)
    code, out, _ = run(capsys, "collective", "all-reduce", "--ranks", "4", "--bytes", "512B,64KiB", "--json")
    assert code == 0
    cli = {r["size(B)"]: r for r in json.loads(out)["results"]}
    for step, nbytes, rule in ((est.decode, 512, "mesh"), (est.prefill, 65536, "rdh")):
        (op, algo, calls, ms), = [c for c in step.collectives if c[0] == "all_reduce"]
        assert calls == 2 * 4  # o_proj and down_proj of each of the 4 layers
        assert algo == cli[nbytes]["algorithm"] == rule  # 64 KiB on 4 ranks is 1 MiB per 64: past mesh
        # rank 0's own part: from its start to its completion, which the call's time (to the last
        # rank's completion, what the CLI prints) bounds
        rep = simulate_collective(graph, "all-reduce", nbytes, ranks=4)
        own = (rep.end_of(0) - rep.start_ticks[0]) * 1e6 / rep.tick_hz
        assert ms * 1e3 / calls == pytest.approx(own, rel=1e-9) and own <= cli[nbytes]["time:avg(us)"]
    gathers = {c[0]: c[2] for c in est.decode.collectives}
    assert gathers["all_gather"] == 2  # the embedding's lookup and the LM head's logits


def test_the_estimate_of_a_small_model(cache):
    est, _ = estimate_inference(TINY, eager=True, tp=4, input_tokens=128, output_tokens=16, samples=3, cache_dir=cache,
                                serving="none")  # the device's steps alone (the engine's host loop: test_serve)
    assert est.ranks == 4 and est.roles_simulated == 1 and est.plan == {"tp": 4, "pp": 1, "dp": 1, "sp": False}
    assert [n for n, _ in est.decode_samples] == [129, 136, 143]
    first, last = est.decode_samples[0][1], est.decode_samples[-1][1]
    assert 0 < first <= last  # a longer KV cache takes longer
    # (the samples may cost the same: decode attention reads its cache in 128-key tiles; the mean
    # of equal samples may round an ulp off them)
    assert est.tpot_first_ms == first and min(first, last) * (1 - 1e-12) <= est.tpot_ms <= max(first, last) * (1 + 1e-12)
    assert est.tokens_per_s == pytest.approx(16 / ((est.ttft_ms + 15 * est.tpot_ms) / 1e3))
    assert est.prefill.time_ms == pytest.approx(est.ttft_ms)
    kinds = {k.kind for k in est.prefill.kinds}
    assert {"matmul", "attention", "collectives"} <= kinds
    mem = est.memory[0]
    # per rank: q/o 1/4 of theirs, k/v one replicated head each (2 KV heads over 4 ranks), MLP 1/4, embedding and
    # head 1/4 (hidden across ranks, vocab across ranks), norms whole; bf16
    layer = 256 * 64 * 2 + 256 * 32 * 2 + 256 * 128 * 3 + 2 * 256
    assert mem.weights_bytes == 2 * (4 * layer + 1024 * 64 + 256 * 256 + 256) + 2 * 16 * 4
    assert mem.kv_bytes == 2 * 4 * 144 * 32 * 2  # K and V, 4 layers, 144 tokens, 1 head of 32, bf16
    assert mem.peak_bytes >= mem.weights_bytes + mem.kv_bytes


def test_replaying_layers_gives_the_estimate_of_running_them(cache):
    a, _ = estimate_inference(TINY, eager=True, tp=2, input_tokens=64, output_tokens=4, samples=2, cache_dir=cache)
    b, _ = estimate_inference(TINY, eager=True, tp=2, input_tokens=64, output_tokens=4, samples=2, cache_dir=cache, replay=False)
    assert a.ttft_ms == pytest.approx(b.ttft_ms, rel=1e-12) and a.tpot_ms == pytest.approx(b.tpot_ms, rel=1e-12)
    assert a.decode.kinds == b.decode.kinds


def test_sequence_parallel_prefill(cache):
    est, _ = estimate_inference(TINY, eager=True, tp=4, sp=True, input_tokens=126, output_tokens=2, samples=1, cache_dir=cache)
    colls: dict[str, int] = {}
    for c in est.prefill.collectives:  # an op's calls may run more than one algorithm (by size)
        colls[c[0]] = colls.get(c[0], 0) + c[2]
    # per layer: attention and MLP gather the sequence and reduce-scatter their output; then the last layer's output,
    # and the embedding and logits (hidden and vocab sharded) are gathered
    assert colls == {"all_gather": 2 * 4 + 1 + 2, "reduce_scatter": 2 * 4}
    assert "prompt padded to 128 tokens for sequence parallelism" in est.assumptions
    plain = {c[0] for c in est.decode.collectives}
    assert plain == {"all_gather", "all_reduce"}  # one token: plain tensor parallelism


def test_sequence_parallelism_over_one_rank_is_none(cache):
    """--sp with --tp 1 splits nothing (Megatron turns it off): the estimate does not say SP."""
    train, _ = estimate_train(TINY, tp=1, sp=True, micro_batch=1, seq=64, cache_dir=cache)
    infer, _ = estimate_inference(TINY, eager=True, tp=1, sp=True, input_tokens=32, output_tokens=2, samples=1,
                                  cache_dir=cache)
    kernels, _ = estimate_inference(TINY, tp=1, sp=True, input_tokens=32, output_tokens=2, samples=1, cache_dir=cache)
    assert [e.plan["sp"] for e in (train, infer, kernels)] == [False, False, False]
    assert estimate_train(TINY, tp=1, micro_batch=1, seq=64, cache_dir=cache)[0].step_ms == train.step_ms


def test_pipeline_stages_add_up(cache):
    one, _ = estimate_inference(TINY, eager=True, tp=2, input_tokens=64, output_tokens=2, samples=1, cache_dir=cache)
    two, _ = estimate_inference(TINY, eager=True, tp=2, pp=2, input_tokens=64, output_tokens=2, samples=1, cache_dir=cache)
    assert two.roles_simulated == 2 and two.ranks == 4
    assert [m.stage for m in two.memory] == [0, 1]
    assert sum(m.weights_bytes for m in two.memory) < 1.01 * one.memory[0].weights_bytes + 4096
    assert two.ttft_ms > 0.5 * one.ttft_ms


def test_a_training_step(cache):
    est, _ = estimate_train(TINY, tp=2, pp=2, dp=2, micro_batch=1, seq=64, global_batch=8, cache_dir=cache)
    assert est.ranks == 8 and est.micro_batches == 4 and est.roles_simulated == 2
    assert est.step_ms == pytest.approx(est.pipeline_ms + est.dp_reduce_ms + est.optimizer_ms)
    fwd = [f for f, _ in est.stage_ms]
    bwd = [b for _, b in est.stage_ms]
    assert est.pipeline_ms >= 4 * max(f + b for f, b in est.stage_ms) and all(b > f for f, b in zip(fwd, bwd))
    assert est.seq_per_s == pytest.approx(8 / (est.step_ms / 1e3))
    assert 0 < est.mfu_percent < 100 and est.dp_reduce_ms > 0 and est.optimizer_ms > 0
    for m in est.memory:  # fp32 gradients (4 bytes a parameter), fp32 master and moments sharded by ZeRO-1 over
        # DP=2 (12 / 2): five times the bf16 weights
        assert 5 * m.weights_bytes * 0.995 <= m.state_bytes <= 5.05 * m.weights_bytes


def test_a_backward_that_does_not_fit_is_an_oom_not_an_abort(cache):
    """The backward runs on the autograd engine's device thread, where a raised exception aborts
    the process: the OOM is held until the backward returns, then raised with the same hint."""
    import torch

    with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: .* - timing-only: the tensors do not "
                                                     r"fit one logical core's HBM; shard the model"):
        # 22 MiB per core: the forward fits (~20 MiB at its peak), the gradients do not
        estimate_train(TINY, overrides=["chip.hbm.capacity=88MiB"], tp=2, micro_batch=1, seq=512, cache_dir=cache)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=3), "--tp 3: tiny-llama has 8 attention heads, not a multiple of 3"),
    (dict(tp=16, pp=8), "--tp 16 x --pp 8 x --dp 1 = 128 ranks, but trn2.48xlarge has 64 (16 chips x 4 logical cores); "
                        "use a bigger system (e.g. --system trn2-ultraserver, or --set topology.efa.size=N for N "
                        "instances)"),
    (dict(pp=5), "--pp 5: the model has 4 decoder layers, fewer than the pipeline stages"),
    (dict(input_tokens=4096), "--input 4096 + --output 128 = 4224 tokens, more than tiny-llama's "
                              "max_position_embeddings 4096 (a serving framework's larger position limit: "
                              "--max-positions)"),
    (dict(input_tokens=4096, max_positions=4200), "--input 4096 + --output 128 = 4224 tokens, more than "
                                                  "--max-positions 4200"),
    (dict(max_positions=0), "--max-positions 0: expected a positive whole number of positions"),
    (dict(dtype="fp8"), "--dtype fp8: expected one of bf16, fp16, fp32"),
    (dict(batch=0), "--batch 0: expected a positive whole number"),
])
def test_bad_plans_and_requests_are_one_line(kwargs, message):
    with pytest.raises(ConfigError) as info:
        estimate_inference(TINY, eager=True, **{"output_tokens": 128, **kwargs})
    assert str(info.value) == message


def test_a_serving_frameworks_position_limit_lets_a_rope_model_run_past_its_config(cache, tmp_path):
    """transformers-neuronx ran Llama-2-7b (max_position_embeddings 4096) at n_positions 8192: with
    --max-positions a RoPE model runs past its config's figure, its decode steps over the longer
    KV cache; a model with learned positions (no rope_theta) is refused beyond its table."""
    from trnsim.workload.models import load_model
    from trnsim.workload.plan import check_sizes

    est, _ = estimate_inference(TINY, tp=2, input_tokens=128, output_tokens=3990, max_positions=8192, cache_dir=cache,
                                serving="none", layers=1)
    assert est.padding["decode_kv_buckets"][-1] > 4096 and est.tpot_ms > 0
    learned = json.loads(Path(TINY).read_text())
    del learned["rope_theta"]
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(learned))
    with pytest.raises(ConfigError) as info:
        check_sizes(load_model(str(path)), input_tokens=4096, output_tokens=130, max_positions=8192)
    assert str(info.value) == ("--max-positions 8,192: beyond learned's max_position_embeddings 4,096, and its "
                               "config has no rotary positions (rope_theta) to run past a learned position table")


def test_plan_places_tp_ranks_innermost():
    plan = Plan(tp=4, pp=2, dp=2)
    assert plan.size == 16 and plan.tp_group(5) == [4, 5, 6, 7] and plan.dp_group(5) == [5, 13]
    assert plan.stages(80) == [(0, 40), (40, 80)] and Plan(pp=3).stages(10) == [(0, 4), (4, 7), (7, 10)]
    roles = plan.roles(80)
    assert [(r.stage, r.rank, r.ranks) for r in roles] == [(0, 0, 8), (1, 4, 8)]
    plan.check(load_system("trn2.48xlarge"), 80)


# ---- the CLI ------------------------------------------------------------------------------------------
def _stable(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("Simulated ")) + "\n"


def test_cli_inference_text_golden(cache, capsys, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    code, out, err = run(capsys, "estimate", "inference", "--model", TINY, "--tp", "4", "--input", "128",
                         "--output", "16", "--samples", "3", "--eager")
    assert code == 0 and err == ""
    assert _stable(out.replace(TINY, "tiny-llama.json")) == (GOLDEN / "estimate_inference_tiny.txt").read_text()


def test_cli_json_and_trace(cache, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    trace = tmp_path / "t.json"
    code, out, _ = run(capsys, "estimate", "inference", "--model", TINY, "--tp", "2", "--input", "64", "--output",
                       "4", "--samples", "2", "--json", "--trace", str(trace), "--eager")
    d = json.loads(out)
    assert code == 0 and d["model"] == "tiny-llama" and d["plan"]["tp"] == 2 and d["ttft_ms"] > 0
    assert set(d["decode"]) >= {"time_ms", "kinds", "compute_ms", "memory_ms", "collective_ms", "bound"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["phase"] for e in events if e["ph"] == "X"} == {"prefill", "decode"}
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"mm", "all_reduce", "scaled_dot_product_attention"}


def test_cli_train_text(cache, capsys, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    code, out, _ = run(capsys, "estimate", "train", "--model", TINY, "--tp", "2", "--dp", "2", "--seq", "64",
                       "--global-batch", "4")
    assert code == 0
    assert "tiny-llama training on trn2.48xlarge (trn2): TP=2 DP=2, 4 ranks; micro-batch 1 x 64 tokens, global " \
           "batch 4 (2 micro-batches per replica), bf16" in out
    assert "MFU" in out and "Backward of one micro-batch" in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-9"], "trnsim: error: unknown model 'llama-9': expected one of bert-large, deepseek-v3, gpt-oss-120b, "
                             "gpt-oss-20b, llama-2-7b, llama-3.1-405b, llama-3.1-70b, llama-3.1-8b, llama-3.2-1b, "
                             "llama-3.3-70b, mixtral-8x7b, qwen3-30b-a3b, qwen3-32b, qwen3-8b, or a path to a Hugging Face "
                             "config.json"),
    (["--model", "llama-3.3-70b", "--tp", "48"], "trnsim: error: --tp 48: llama-3.3-70b has 64 attention heads, not "
                                                 "a multiple of 48"),
    (["--model", "llama-3.3-70b"], "trnsim: error: llama-3.3-70b (80 layers, hidden 8,192, bf16): its weights need at "
                                   "least 94.457 GiB on each of the --tp 1 x --pp 1 ranks holding them, more than a "
                                   "logical core's 24 GiB of HBM on trn2.48xlarge; shard it over more ranks (--tp, --pp) "
                                   "or run fewer --layers\n"),
    (["--model", "/no/such/config.json"], "trnsim: error: model config '/no/such/config.json' not found"),
])
def test_cli_errors_are_one_line_with_status_2(capsys, argv, message):
    code, out, err = run(capsys, "estimate", "inference", *argv)
    assert code == 2 and out == "" and err.startswith(message) and err.count("\n") == 1


def test_a_mixture_of_experts_model(cache):
    """Mixtral: expert weights sharded per expert over TP, their output all-reduced after the
    attention's; a prefill routes every expert its share of tokens, a decode token visits top_k."""
    from trnsim.models import ModelConfig, load_model

    spec = load_model(Path(__file__).parent.parent / "data" / "tiny-mixtral.json")
    est, _ = estimate_inference(spec, eager=True, tp=2, input_tokens=64, output_tokens=2, samples=1, cache_dir=cache)
    per_layer = 2  # o_proj and the experts' output
    assert {c[0]: c[2] for c in est.decode.collectives}["all_reduce"] == per_layer * 2
    experts = 2 * 4 * (2 * 512 // 2 * 256 + 256 * 512 // 2) * 2  # 2 layers' gate_up and down of 4 experts, half each, bf16
    assert experts < est.memory[0].weights_bytes < 2 * experts  # sharded over TP=2, not replicated
    bmm_calls = sum(o[2] for o in est.decode.ops if o[0] == "bmm")  # over the library's bmm kernels
    assert bmm_calls == 2 * 2  # per layer: the experts' two grouped matmuls
    # and the attention of the one token over the cache: the library's token-generation kernel
    assert [o[:3] for o in est.decode.ops if o[0] == "scaled_dot_product_attention"] == \
        [("scaled_dot_product_attention", "attention_tkg", 2)]
    # the same model with every token visiting all 4 experts: a decode token then reads the other
    # 2 experts' weights too (a prefill's 64 tokens reach every expert either way)
    every = ModelConfig(spec.name, spec.path, {**spec.fields, "num_experts_per_tok": 4})
    full, _ = estimate_inference(every, eager=True, tp=2, input_tokens=64, output_tokens=2, samples=1, cache_dir=cache)
    assert full.decode.hbm_bytes - est.decode.hbm_bytes >= experts // 2


@pytest.mark.parametrize("argv,message", [
    (["inference", "--layers", "1000000000"], "--layers 1,000,000,000: tiny-llama has 4 decoder layers; expected 1..4 "
                                              "(--layers runs a shorter model)"),
    (["train", "--layers", "5"], "--layers 5: tiny-llama has 4 decoder layers; expected 1..4 (--layers runs a shorter "
                                 "model)"),
    (["inference", "--samples", "1000000000"], "--samples 1,000,000,000: expected 1..64 decode steps simulated (the "
                                               "others are interpolated between them)"),
    (["inference", "--input", "4000", "--output", "97"], "--input 4000 + --output 97 = 4097 tokens, more than "
                                                         "tiny-llama's max_position_embeddings 4096 (a serving "
                                                         "framework's larger position limit: --max-positions)"),
    (["inference", "--input", "4000", "--output", "97", "--max-positions", "4096"],
     "--input 4000 + --output 97 = 4097 tokens, more than --max-positions 4096"),
    (["train", "--seq", "1000000000"], "--seq 1000000000: more tokens than tiny-llama's max_position_embeddings 4096"),
    (["train", "--global-batch", "100000000"], "--global-batch: 100,000,000 micro-batches per data-parallel replica "
                                               "and step; at most 4,096 (the pipeline schedule is simulated task by "
                                               "task)"),
    # found by the fuzz harness's long run (seed 225): a batch past 2^63 elements was a PyTorch
    # overflow traceback, a smaller one built the model and then ran out of memory
    (["inference", "--batch", "99999999999999999999", "--input", "16", "--output", "2"],
     "--batch 99,999,999,999,999,999,999: the KV cache of 99,999,999,999,999,999,999 x 18 tokens needs at least "
     "1.63709e+09 PiB on each rank, more than a logical core's 24 GiB of HBM on trn2.48xlarge; a smaller --batch, "
     "or shard it (--tp, --pp)"),
    (["train", "--micro-batch", "3000000", "--seq", "32"],
     "--micro-batch 3,000,000: one hidden state of 3,000,000 x 32 tokens needs 45.7764 GiB, more than a logical "
     "core's 24 GiB of HBM on trn2.48xlarge; a smaller --micro-batch (--global-batch accumulates micro-batches)"),
])
def test_size_options_are_bounded_by_the_model_before_torch_runs(capsys, monkeypatch, argv, message):
    """Issue 25: --layers 1000000000 printed nothing for ten minutes (and --samples, --global-batch
    the same); each size is bounded by the model or what a run can simulate, checked before any
    of it is built (the sweep's estimate entries take the same checks)."""
    import torch_bridge.estimate as est

    def never(*a, **k):
        raise AssertionError("the estimate ran")

    monkeypatch.setattr(est, "estimate_inference", never)
    monkeypatch.setattr(est, "estimate_train", never)
    code, out, err = run(capsys, "estimate", argv[0], "--model", TINY, *argv[1:])
    assert (code, out, err) == (2, "", f"trnsim: error: {message}\n")


def test_a_batch_no_core_holds_and_a_zero_dp_are_one_line_in_the_run_too():
    """Found by the fuzz harness's long run (seed 225): ``estimate train --dp 0`` divided the
    global batch by zero (ZeroDivisionError) before the plan was checked, and a batch past 2^63
    elements reached torch.empty (an overflow traceback). The run checks them as the CLI does."""
    with pytest.raises(ConfigError, match=r"^--dp 0: expected a positive whole number of ranks$"):
        estimate_train(TINY, dp=0, seq=32, cache_dir=None)
    with pytest.raises(ConfigError, match=r"^--batch 100,000,000,000,000,000,000: the KV cache of "):
        estimate_inference(TINY, batch=10**20, input_tokens=16, output_tokens=2, samples=1, cache_dir=None)
    with pytest.raises(ConfigError, match=r"^--micro-batch 10,000,000,000,000,000,000: one hidden state "):
        estimate_train(TINY, micro_batch=10**19, seq=32, cache_dir=None)


def test_a_model_whose_weights_no_rank_holds_is_refused_before_it_is_built(tmp_path):
    """A config.json of a billion layers (or a hidden size no HBM holds) is refused by a lower
    bound of its weights, not built layer by layer."""
    import json as _json

    path = tmp_path / "deep.json"
    path.write_text(_json.dumps({**_json.loads(Path(TINY).read_text()), "num_hidden_layers": 10**9}))
    with pytest.raises(ConfigError, match=r"^deep \(1,000,000,000 layers, hidden 256, bf16\): its weights need at least "
                                          r"[0-9.]+ TiB on each of the --tp 4 x --pp 1 ranks holding them, more than a "
                                          r"logical core's 24 GiB of HBM on trn2.48xlarge; shard it over more ranks "
                                          r"\(--tp, --pp\) or run fewer --layers$"):
        estimate_inference(str(path), tp=4)


def test_a_model_whose_code_does_not_import_is_one_line(cache, capsys, monkeypatch):
    """Issue 25: a broken transformers install printed 60 lines; the failed import is named."""
    import importlib

    import transformers

    def broken(*args, **kwargs):  # what transformers' lazy import raises when a model module is broken
        try:
            importlib.import_module("transformers.models.llama.modeling_llama_broken")
        except ImportError as e:
            raise ModuleNotFoundError("Could not import module 'LlamaForCausalLM'. Are this object's requirements "
                                      "defined correctly?") from e

    from torch_bridge import estimate_kernels

    estimate_kernels._matched.cache_clear()  # a model matched earlier in this process is not built again
    for cls in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_config", broken)
    code, out, err = run(capsys, "estimate", "inference", "--model", TINY, "--input", "16", "--output", "2",
                         "--no-cache")
    assert (code, out) == (2, "")
    assert err == (f"trnsim: error: estimate: {TINY}: importing transformers.models.llama.modeling_llama_broken failed "
                   f"(No module named 'transformers.models.llama.modeling_llama_broken'); check the transformers "
                   f"install (pip install -e '.[demo]')\n")


def test_a_model_name_too_long_for_a_file_is_one_line(capsys):
    """Found by the fuzz harness (issue 25): a 3,000-character model name raised OSError (File name
    too long) from the file system."""
    code, out, err = run(capsys, "estimate", "train", "--model", "x" * 3000)
    assert (code, out) == (2, "") and err.startswith("trnsim: error: unknown model 'xxxx") and err.count("\n") == 1
    code, out, err = run(capsys, "estimate", "train", "--model", "/" + "x" * 3000 + ".json")
    assert code == 2 and err.endswith(": cannot read it (File name too long)\n") and err.count("\n") == 1


def test_a_plans_collective_is_charged_beside_its_sibling_groups():
    """The estimate's DP all-reduce on a 2x2 plan of a trn1.32xlarge (groups [0, 2] and [1, 3],
    both across chip 0 -> 1) is the call simulated beside its sibling, slower than alone; a TP
    group on a chip of its own costs what it costs alone. The plan's step is one compiled graph:
    its calls pay the system's graph_launch, not the launch of a call run by itself."""
    from trnsim.collectives import simulate_with_siblings
    from trnsim.collectives.runtime import in_graph
    from trnsim.device import Device
    from torch_bridge.parallel import Comm

    trn1 = load_system("trn1.32xlarge")
    plan = Plan(tp=2, dp=2)
    comm = Comm(trn1, Device(trn1.chip), 0, 0, plan)
    assert comm.system.collectives.launch == trn1.collectives.graph_launch != trn1.collectives.launch
    trn1 = in_graph(trn1)
    dp = comm.report("all-reduce", 16 << 20, plan.dp_group(0), "bf16")
    together, alone = simulate_with_siblings(trn1, "all-reduce", 16 << 20, plan.dp_group(0), plan.size)
    assert plan.dp_group(0) == [0, 2] and dp.time_ticks == together.time_ticks > 1.1 * alone.time_ticks
    tp = comm.report("all-reduce", 16 << 20, plan.tp_group(0), "bf16")
    assert tp.time_ticks == simulate_collective(trn1, "all-reduce", 16 << 20, group=plan.tp_group(0)).time_ticks
