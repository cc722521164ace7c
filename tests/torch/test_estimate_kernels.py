"""`trnsim estimate inference` as Neuron serves a model: decoder layers lowered to the NKI library
kernels by matching their modules (torch_bridge.nxdi), at Neuron's buckets (trnsim.buckets)."""

import json
from pathlib import Path

import pytest

from torch_bridge import nxdi
from torch_bridge.estimate import estimate_inference
from torch_bridge.estimate_kernels import lowered
from trnsim.buckets import BucketError, default_buckets, power_buckets
from trnsim.cli import main
from trnsim.config import ConfigError, load_system
from trnsim.costcache import CachedDevice, CostCache
from trnsim.models import ModelConfig, load_model

DATA = Path(__file__).parent.parent / "data"
TINY = str(DATA / "tiny-llama.json")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


def ops(calls):
    return [c.op for c in calls]


def test_a_llama_layer_becomes_the_library_kernels_nxdi_runs():
    prog = lowered(load_model(TINY), nxdi.Shards(tp=4, sp=True))
    layer = prog.layers[1]
    assert layer.attention == nxdi.Attention("gqa", 8, 2, 32, 32) and layer.ffn.kind == "dense"
    dec = nxdi.lower_layer(layer, prog.shards, batch=1, tokens=1, prior=0, cache=256, first=False, decode=True)
    assert ops(dec) == ["qkv", "attention_tkg", "oproj", "all_reduce", "mlp", "all_reduce"]
    qkv = dict(dec[0].spec.params)
    assert dec[0].spec.shape == (1, 1, 256, 2, 1, 32)  # 8 heads / 4, 2 KV heads replicated to one per rank
    assert qkv["residual"] and qkv["norm"] == "rmsnorm" and qkv["rope"]
    assert dec[1].spec.shape == (1, 2, 1, 1, 256, 32) and dict(dec[1].spec.params)["cache_update"]
    assert dec[4].spec.shape == (1, 1, 256, 128) and dec[3].nbytes == 256 * 2
    pre = nxdi.lower_layer(layer, prog.shards, batch=1, tokens=128, prior=0, cache=128, first=False, decode=False)
    assert ops(pre) == ["binary", "rmsnorm", "all_gather", "qkv", "attention_cte", "oproj", "reduce_scatter",
                        "binary", "rmsnorm", "all_gather", "mlp", "reduce_scatter"]
    assert pre[0].spec.shape == (32, 256) and dict(pre[3].spec.params)["norm"] == "none"
    # a prompt TP does not divide runs without SP: the decode layout's fused norms and all-reduces
    odd = nxdi.lower_layer(layer, prog.shards, batch=1, tokens=130, prior=0, cache=130, first=True, decode=False)
    assert ops(odd) == ["qkv", "attention_cte", "oproj", "all_reduce", "mlp", "all_reduce"]
    assert not dict(odd[0].spec.params)["residual"]  # the first layer has no residual to add


def test_a_mixture_of_experts_layer_and_expert_parallelism():
    spec = load_model(DATA / "tiny-mixtral.json")
    prog = lowered(spec, nxdi.Shards(tp=2, ep=2))
    f = prog.layers[0].ffn
    assert (f.kind, f.experts, f.top_k) == ("moe", 4, 2)
    dec = nxdi.lower_layer(prog.layers[0], prog.shards, batch=1, tokens=1, prior=0, cache=128, first=False,
                           decode=True)
    assert ops(dec)[-5:] == ["binary", "rmsnorm", "router_topk", "moe_tkg", "all_reduce"]
    e = dec[-2].spec
    assert e.shape[2:] == (f.inter, 2) and dict(e.params)["top_k"] == 1  # 2 of 4 experts here, 1 of a token's 2 picks
    with pytest.raises(ConfigError, match="--ep 3: expert parallelism must divide --tp 2"):
        nxdi.layer_weight_bytes(prog.layers[0], nxdi.Shards(tp=2, ep=3))


def test_the_estimate_is_the_lowered_kernels_on_the_device(cache):
    """The decode step launches exactly the lowered calls, and takes at least their kernels' time
    back to back (the collectives wait for them)."""
    est, _ = estimate_inference(TINY, tp=4, input_tokens=200, output_tokens=4, cache_dir=cache)
    assert est.lowering["decode"][0].startswith("qkv 1x1x256x2x1x32")
    # Neuron's default buckets up to the sequence (prompt + output: 204), a multiple of TP with SP
    assert est.padding["prefill_tokens"] == 204 and est.padding["decode_kv_buckets"] == [256]
    assert est.buckets == {"context": [128, 204], "kv": [128, 256], "batch": [1]}
    launches = 4 * 6 + 2 + 4  # 4 layers; embedding + all-gather; norm, LM head, max, all-gather
    assert est.decode.launches == launches + 1  # and the step's one host dispatch
    dev = CachedDevice(load_system("trn2.48xlarge").chip, CostCache(cache))
    prog = lowered(load_model(TINY), nxdi.Shards(tp=4, sp=True))
    kernel_ms = sum(dev.cost(c.spec).ticks for layer in range(4) for c in nxdi.lower_layer(
        prog.layers[layer], prog.shards, batch=1, tokens=1, prior=0, cache=256, first=layer == 0, decode=True)
        if c.spec is not None) / load_system("trn2.48xlarge").tick_hz * 1e3
    assert kernel_ms < est.tpot_ms
    eager, _ = estimate_inference(TINY, tp=4, input_tokens=200, output_tokens=4, cache_dir=cache, eager=True)
    assert eager.decode.launches > 5 * est.decode.launches and not eager.lowering


def test_buckets_follow_neurons_default_rule_and_pad():
    assert power_buckets(128, 12288) == (128, 256, 512, 1024, 2048, 4096, 8192, 12288)
    b = default_buckets(12288, 12800, 6, tp=64, sp=True)
    assert b.context_for(10000) == 12288 and b.kv_for(10001) == 12800 and b.batch_for(3) == 4 and b.batch_for(5) == 6
    assert default_buckets(1000, 2000, 1, tp=64, sp=True).context == (128, 256, 512, 1024)  # multiples of TP
    with pytest.raises(BucketError, match="a prefill of 12,289: more than the largest context bucket 12,288"):
        b.context_for(12289)
    est, _ = estimate_inference(TINY, tp=2, input_tokens=100, output_tokens=60, context_buckets=[128, 512],
                                kv_buckets=[128, 256], cache_dir=None, serving="none")  # the device's steps alone
    assert est.padding["prefill_tokens"] == 128 and est.padding["prefill_padding_percent"] == pytest.approx(21.875)
    assert est.padding["decode_kv_buckets"] == [128, 256] and len(est.decode_samples) == 2
    assert est.decode_samples[0][1] < est.decode_samples[1][1]  # a longer KV bucket reads more


@pytest.mark.parametrize("fields,message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "a quantised checkpoint (quantization_config.quant_method="
                                                          "mxfp4): trnsim estimates bf16"),
])
def test_unsupported_features_are_refused_in_one_line(tmp_path, fields, message):
    spec = load_model(TINY)
    p = tmp_path / "m.json"
    p.write_text(json.dumps({**spec.fields, **fields}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate_inference(str(p), tp=2, input_tokens=64, output_tokens=2, cache_dir=None)


@pytest.mark.parametrize("fields,why", [
    ({"hidden_act": "weird"}, "KeyError: 'weird'"),
    ({"head_dim": 15}, "StrictDataclassClassValidationError"),
    ({"mlp_bias": "no"}, "StrictDataclassFieldValidationError"),
    ({"rope_theta": "big"}, "TypeError"),
])
def test_a_config_transformers_refuses_is_one_line_naming_the_file(tmp_path, capsys, fields, why):
    """transformers raises its own exceptions for a bad field, from deep in its code (found by the
    hardening hunt: 40-60 lines of traceback and status 1): one line naming the file, status 2."""
    from trnsim.cli import main

    spec = load_model(TINY)
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**spec.fields, **fields}))
    code = main(["estimate", "inference", "--model", str(p), "--input", "64", "--output", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"trnsim: error: {p}: transformers cannot build a model from this config (") and why in err[0]


def test_cli_prints_what_a_decode_and_a_prefill_layer_became(cache, capsys, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    code = main(["estimate", "inference", "--model", TINY, "--tp", "4", "--input", "200", "--output", "4"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert "A decode layer became: qkv 1x1x256x2x1x32" in out and "A prefill layer became: " in out
    assert "buckets     prefill 200 -> 204 tokens (2.0% padding); decode KV bucket 256" in out


@pytest.mark.parametrize("argv,message", [
    (["--kv-buckets", "1,x"], "--kv-buckets '1,x': expected a comma-separated list"),
    (["--max-context", "0"], "--max-context 0: expected a positive whole number"),
    (["--eager", "--max-model-len", "512"], "--max-model-len: a kernel-lowering option; --eager"),
    (["--sp", "--no-sp"], "--sp and --no-sp: give one of them"),
    (["--no-replay"], "--no-replay: an --eager option (the kernel lowering runs every decoder layer's kernels"),
    (["--max-context", "9000"], "--max-context 9,000: more than --max-model-len 1,152 (its default"),
    (["--ep", "3"], "--ep 3: expert parallelism must divide --tp 4"),
    (["--context-buckets", "64"], "a prefill of 1,024: more than the largest context bucket 64"),
    # was run with the last decode steps clamped into the 128 bucket (-788% of the KV read "padding")
    (["--kv-buckets", "100"], "a KV cache of 1,151: more than the largest KV bucket 128"),
    (["--draft-model", TINY, "--speculation-length", "4"], "--draft-model: give --acceptance (the rate"),
    (["--draft-model", TINY, "--speculation-length", "4", "--acceptance", "0.5", "--eager"],
     "--draft-model: fused speculation runs the NKI library kernels as NxDI does; --eager runs one model op by op"),
    (["--acceptance", "0.5"], "--acceptance: speculation needs a draft model (--draft-model)"),
])
def test_cli_bad_kernel_options_are_one_line(capsys, argv, message):
    code = main(["estimate", "inference", "--model", TINY, "--tp", "4", "--no-cache", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("trnsim: error: " + message) and err.count("\n") == 1


# ---- the model families people serve (shipped configs from the published config.json values) -----------
def short(name, layers):
    return load_model(name).with_layers(layers)


def test_qwen3_norms_q_and_k_before_rope():
    prog = lowered(short("qwen3-32b", 2), nxdi.Shards(tp=64))
    dec = nxdi.lower_layer(prog.layers[1], prog.shards, batch=1, tokens=1, prior=0, cache=1024, first=False,
                           decode=True)
    assert ops(dec)[:4] == ["qkv", "rmsnorm", "rope", "attention_tkg"]
    assert not dict(dec[0].spec.params)["rope"]  # the QKV kernel's fused RoPE cannot take the q/k norm between
    assert dec[0].spec.shape == (1, 1, 5120, 1, 1, 128)  # 64 heads / 64; 8 KV heads replicated to one per rank
    assert dec[-2].spec.shape == (1, 1, 5120, 400)  # 25,600 / 64


def test_qwen3_moe_routes_over_its_experts():
    prog = lowered(short("qwen3-30b-a3b", 2), nxdi.Shards(tp=8, ep=8))
    f = prog.layers[1].ffn
    assert (f.kind, f.experts, f.top_k, f.inter, f.shared_inter) == ("moe", 128, 8, 768, 0)
    dec = nxdi.lower_layer(prog.layers[1], prog.shards, batch=4, tokens=1, prior=0, cache=1024, first=False,
                           decode=True)
    router, experts = dec[-3].spec, dec[-2].spec
    assert router.shape == (4, 2048, 128) and experts.shape == (4, 2048, 768, 16)  # 16 experts a rank, whole


def test_gpt_oss_sinks_alternating_windows_and_biases():
    prog = lowered(short("gpt-oss-120b", 4), nxdi.Shards(tp=16))
    windows = [layer.attention.window for layer in prog.layers]
    assert windows == [128, 0, 128, 0] and all(layer.attention.sinks for layer in prog.layers)
    a, f = prog.layers[0].attention, prog.layers[0].ffn
    assert a.qkv_bias and a.o_bias and f.router_bias and (f.experts, f.top_k) == (128, 4)
    dec = nxdi.lower_layer(prog.layers[0], prog.shards, batch=1, tokens=1, prior=0, cache=2048, first=False,
                           decode=True)
    attn = dict(dec[1].spec.params)
    # a sliding-window layer's rolling cache holds its window (NxDI: rounded up to a multiple of 128),
    # so its decode attention reads 128 positions of a 2,048 bucket; a full layer reads the bucket
    assert attn["window"] == 128 and attn["sinks"] and dec[1].spec.shape == (1, 4, 1, 1, 128, 64)
    full = nxdi.lower_layer(prog.layers[1], prog.shards, batch=1, tokens=1, prior=0, cache=2048, first=False,
                            decode=True)
    assert full[1].spec.shape == (1, 4, 1, 1, 2048, 64)
    assert [nxdi.cache_positions(layer, 2048) for layer in prog.layers] == [128, 2048, 128, 2048]
    assert nxdi.cache_positions(prog.layers[0], 100) == 100  # never more than the sequence
    from torch_bridge.estimate_kernels import _memory
    from trnsim.workload.plan import Role
    per = nxdi.kv_bytes_per_token(prog.layers[0], prog.shards)
    _, kv = _memory(prog, Role(0, (0, 4), 0, 16), True, 2, 2048)
    assert kv == 2 * per * (128 + 2048 + 128 + 2048)


def test_deepseek_v3_mla_and_shared_experts():
    prog = lowered(short("deepseek-v3", 4), nxdi.Shards(tp=64, ep=64))
    assert [layer.ffn.kind for layer in prog.layers] == ["dense", "dense", "dense", "moe"]  # first_k_dense_replace 3
    a, f = prog.layers[3].attention, prog.layers[3].ffn
    assert (a.kind, a.q_lora_rank, a.kv_lora_rank, a.rope_dim) == ("mla", 1536, 512, 64)
    assert (f.experts, f.top_k, f.router_act, f.shared_inter) == (256, 8, "sigmoid", 2048)
    dec = nxdi.lower_layer(prog.layers[3], prog.shards, batch=1, tokens=1, prior=0, cache=4096, first=False,
                           decode=True)
    # decode attention is the MLA kernel over the latent cache (2 heads per rank), no bmm stand-ins;
    # prefill keeps the absorbed form as bmm kernels
    assert "mla_tkg" in ops(dec) and "bmm" not in ops(dec) and "attention_tkg" not in ops(dec)
    assert dec[ops(dec).index("mla_tkg")].spec.shape == (1, 2, 4096, 512, 64, 128)
    pre = nxdi.lower_layer(prog.layers[3], prog.shards, batch=1, tokens=256, prior=0, cache=4096, first=False,
                           decode=False)
    assert "bmm" in ops(pre) and "mla_tkg" not in ops(pre)
    assert ops(dec)[-4:] == ["router_topk", "moe_tkg", "mlp", "all_reduce"]  # routed, then the shared expert
    assert dec[-3].spec.shape[2:] == (2048, 4)  # 256 experts over EP 64, each whole
    # the latent cache: 512 + 64 values a token a layer, on every rank
    assert nxdi.kv_bytes_per_token(prog.layers[3], prog.shards) == 576 * 2


def test_a_family_estimates_end_to_end(cache):
    est, _ = estimate_inference("gpt-oss-120b", tp=16, layers=2, input_tokens=256, output_tokens=3, cache_dir=cache)
    assert est.ttft_ms > 0 and est.tpot_ms > 0 and not [a for a in est.assumptions if "refused" in a]
    assert "moe_tkg 1x2880x180x128" in "; ".join(est.lowering["decode"])


def test_sweep_estimate_entries_take_the_lowering_options(tmp_path):
    from trnsim.estimate_points import estimate_points, run_estimate_point

    system = load_system("trn2.48xlarge")
    (model, shape, dtype, params), = estimate_points(
        [{"mode": "inference", "model": TINY, "tp": 2, "input": 100, "output": 3, "max_context": 128,
          "max_model_len": 256}], "spec", system)
    row = run_estimate_point(system, model, shape, dtype, dict(params))
    direct, _ = estimate_inference(TINY, tp=2, input_tokens=100, output_tokens=3, max_context=128, max_model_len=256,
                                   cache_dir=None)
    assert row["error"] == "" and row["ttft_ms"] == pytest.approx(direct.ttft_ms, abs=1e-4)
    with pytest.raises(ConfigError, match="eager: expected true or false"):
        estimate_points([{"mode": "inference", "model": TINY, "eager": "yes"}], "spec", system)


def test_the_kinds_of_layer_a_model_has():
    from torch_bridge.estimate_kernels import layer_kinds

    assert layer_kinds(lowered(short("gpt-oss-120b", 4), nxdi.Shards(tp=16))) == (
        "2 x GQA (sinks, window 128), MoE 128 experts top 4 (every other layer from 0)",
        "2 x GQA (sinks), MoE 128 experts top 4 (every other layer from 1)")
    assert layer_kinds(lowered(short("deepseek-v3", 5), nxdi.Shards(tp=64, ep=64))) == (
        "3 x MLA, dense MLP (layers 0-2)", "2 x MLA, MoE 256 experts top 8 + shared MLP (layers 3-4)")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_dtype_the_library_kernels_do_not_all_take_is_refused(dtype):
    with pytest.raises(ConfigError, match=f"--dtype {dtype}: the library's transformer kernels take bf16; run --eager"):
        estimate_inference(TINY, tp=2, input_tokens=64, output_tokens=2, dtype=dtype, cache_dir=None)


def test_moe_routing_busiest_ep_rank():
    """The busiest EP rank's routed load: the expected maximum of Binomial loads (random) against a
    Monte Carlo of distinct top-k picks, the mean share (balanced), EP=1 unchanged, a bad name refused."""
    import numpy as np

    f = nxdi.FeedForward("moe", 2048, experts=256, top_k=8)
    sh = lambda r: nxdi.Shards(64, 64, True, "bf16", r)  # noqa: E731
    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((300, 1024, 256)), axis=2)[:, :, :8] // 4  # rank of each pick (4 experts a rank)
    mc = np.mean([np.bincount(p.ravel(), minlength=64).max() for p in picks])
    assert abs(nxdi.expected_max_binomial(1024 * 8, 4 / 256, 64) - mc) < 0.01 * mc
    assert nxdi.routed_load(f, sh("random"), 1024) == (155, 1)
    assert nxdi.routed_load(f, sh("balanced"), 1024) == (128, 1)  # 1,024 x 8 pairs over 64 ranks
    assert nxdi.routed_load(f, sh("random"), 1) == (1, 1)  # a decode token: some rank has one pick
    assert nxdi.routed_load(f, nxdi.Shards(64, 1), 16) == (16, 8)  # every expert on every rank
    with pytest.raises(nxdi.Unsupported, match="--moe-routing 'skewed'"):
        nxdi.routed_load(f, sh("skewed"), 4)
    from trnsim.workload.buckets import MOE_ROUTINGS

    assert set(MOE_ROUTINGS) == set(nxdi.ROUTINGS)  # the CLI's choices are the lowering's


def test_fused_speculation_is_k_draft_steps_and_the_target_over_k_tokens(cache, tmp_path):
    """NxDI's fused speculation: one decode graph runs k single-token steps of the draft and the
    target over k tokens (each sampled); TPOT is that step over the tokens it yields on average;
    the prefill runs the draft's prefill after the target's; the draft's weights are held too."""
    kw = dict(tp=2, input_tokens=200, output_tokens=20, cache_dir=cache, serving="none")
    plain, _ = estimate_inference(TINY, **kw)
    full, _ = estimate_inference(TINY, draft_model=TINY, speculation_length=3, acceptance=1.0, **kw)
    none, _ = estimate_inference(TINY, draft_model=TINY, speculation_length=3, acceptance=0.0, **kw)
    one_step = 4 * 6 + 2 + 4  # a single-token step's launches: 4 layers, embedding + all-gather, norm/head/max/gather
    assert full.decode.launches == 3 * one_step + one_step + 1  # 3 draft steps, the target, one dispatch
    target = [c for c in full.decode.ops if c[0] == "attention_tkg"]
    assert target and full.speculation["draft_decode"][0].startswith("qkv 1x1x256x4x1x32")
    step = full.decode_samples[0][1]
    assert full.tpot_ms == pytest.approx(step / 3) and none.tpot_ms == pytest.approx(step)
    assert step > plain.decode_samples[0][1]  # more work per step than one plain decode step
    assert full.ttft_ms > plain.ttft_ms and full.ttft_ms == none.ttft_ms  # the acceptance does not enter TTFT
    assert full.memory[0].weights_bytes > plain.memory[0].weights_bytes
    assert full.speculation["tokens_per_step"] == 3.0
    # a draft as big as the target: 4 single-token steps' work for 3 tokens, slower than not speculating
    assert full.tokens_per_s == pytest.approx(20 / ((full.ttft_ms + 19 * full.tpot_ms) / 1e3))
    assert full.tokens_per_s < plain.tokens_per_s
    other = json.loads(Path(TINY).read_text())
    other["vocab_size"] = 2048
    path = tmp_path / "other-vocab.json"
    path.write_text(json.dumps(other))
    with pytest.raises(ConfigError) as info:
        estimate_inference(TINY, draft_model=str(path), speculation_length=3, acceptance=0.5, **kw)
    assert str(info.value) == ("--draft-model other-vocab: vocabulary of 2048 tokens, the target tiny-llama's has 1024; "
                               "a draft shares the target's tokenizer")
    with pytest.raises(ConfigError) as info:
        estimate_inference(TINY, draft_model=TINY, speculation_length=3, acceptance=0.5, eager=True, **kw)
    assert str(info.value) == ("--draft-model: fused speculation runs the NKI library kernels as NxDI does; --eager "
                               "runs one model op by op")
