"""Training as the frameworks run it (issue 29): the HBM of a step's recipe, worked by hand for a
tiny Llama (hidden 256, 8 heads of 32, 2 KV heads, MLP 512, vocabulary 1024) at TP=2, 64 tokens.

Per-layer saves, no recomputation, TP=2 (T = 64 tokens, h = 256; local: 4 query heads = 128
features, 1 KV head = 32, MLP 256), bytes:

* each RMSNorm: its fp32 input (T h 4 = 65,536), the rsqrt (T 4 = 256), the bf16 normalised
  value the weight multiplies (T h 2 = 32,768): 98,560, twice;
* the q/k/v projections' input (the norm's output, one tensor for the three): 32,768;
* flash attention: q after RoPE (T 128 2 = 16,384), k (T 32 2 = 4,096), v (4,096), its output
  (16,384), its softmax statistics (4 heads x T fp32 = 1,024): 41,984;
* o_proj's input: the output itself (its transpose(1, 2).contiguous() is a view, as on CPU, whose
  SDPA returns that layout for a permuted query): 0;
* the MLP's input (shared by gate and up): 32,768; SiLU's input, its output, up's output and the
  product down_proj reads (T 256 2 = 32,768 each): 131,072.

Sum: 435,712 per layer. Sequence parallel halves the norms' tokens and keeps the blocks' inputs
as the rank's shard (gathered again in the backward), the attention and MLP at full length:
2 x 49,280 + 16,384 + 41,984 + 16,384 + 131,072 = 304,384.
"""

import json
from pathlib import Path

import pytest

from torch_bridge.estimate import estimate_train
from trnsim.cli import main
from trnsim.training import Recipe, RecipeError, in_flight

TINY = str(Path(__file__).parent.parent / "data" / "tiny-llama.json")
BERT = str(Path(__file__).parent.parent / "data" / "tiny-bert.json")
T, H, V, TP = 64, 256, 1024, 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


def _act(cache, layers, **kw):
    # q/k/v and gate/up as separate linears, as worked by hand above (NxD's fused ones keep the fused
    # output alive through the value view attention saves)
    est, _ = estimate_train(TINY, tp=TP, layers=layers, micro_batch=1, seq=T, global_batch=1, cache_dir=cache,
                            fused_projections=False, **kw)
    (m,) = est.train_memory
    return m


def _per_layer(cache, **kw):
    return _act(cache, 4, **kw).activations - _act(cache, 2, **kw).activations


@pytest.mark.parametrize("sp,recompute,expected", [
    (False, "none", 435_712),
    (True, "none", 304_384),
    # full: a checkpointed layer keeps only its input (T h bf16; its shard with SP)
    (False, "full", T * H * 2),
    (True, "full", T // TP * H * 2),
    # selective (NxDT's module list): each norm keeps its bf16 input (32,768 instead of 98,560) and
    # the activation-multiply's SiLU output is recomputed (32,768 fewer)
    (False, "selective", 435_712 - 2 * (98_560 - T * H * 2) - T * 256 * 2),
])
def test_recomputation_keeps_the_bytes_worked_by_hand(cache, sp, recompute, expected):
    assert _per_layer(cache, sp=sp, recompute=recompute) / 2 == expected


def test_core_attention_keeps_its_scores_unless_recomputed(cache):
    """NxD's CoreAttention (SDK 2.15's Llama-2 example; 4 local heads of T x T scores at TP=2)
    keeps, per layer, the fp32 softmax (4 T T 4 = 65,536; the causal mask, one per run, is not a
    layer's), the bf16 probabilities the value matmul reads (32,768) and the key and
    value heads repeated to the 4 query heads the two matmuls read (2 x 4 T 32 2 = 32,768, where
    the recomputed one keeps the one local KV head's, 2 x T 32 2 = 8,192); recomputing it
    (``--recompute attention``, with the example's activation-multiply: SiLU's output, T 256 2 =
    32,768) keeps only its inputs - what the checkpointed flash kernel keeps."""
    core = _per_layer(cache, attention="core", recompute="none")
    again = _per_layer(cache, attention="core", recompute="attention")
    kv = 2 * 4 * T * 32 * 2 - 2 * T * 32 * 2
    assert (core - again) / 2 == 4 * T * T * 4 + 4 * T * T * 2 + kv + T * 256 * 2
    assert again == _per_layer(cache, attention="flash", recompute="attention")


def test_vocab_parallel_loss_keeps_the_local_softmax_only(cache):
    """Gathered: the loss's fp32 log-softmax over the whole vocabulary (T V 4) stays for the
    backward; vocab-parallel: the fp32 softmax over the rank's V / tp (T V / 2 4). The gathered
    loss also keeps its int64 labels (shifted and padded: about 2 T 8 bytes)."""
    gathered = _act(cache, 2, loss="gathered").activations
    split = _act(cache, 2, loss="vocab-parallel").activations
    assert gathered - split == pytest.approx(T * V * 4 * (1 - 1 / TP), abs=2 * (T + 1) * 8 + 16)


def test_zero1_and_fsdp_shard_the_optimizer_by_the_data_parallel_ranks(cache):
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="none")
    whole = est.train_memory[0]
    params = whole.master // 4  # the rank's parameters
    assert whole.weights == pytest.approx(2 * params, abs=1024)  # bf16, and the rotary embedding's buffer
    assert whole.optimizer == 8 * params and whole.gradients == 4 * params
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="zero1")
    z = est.train_memory[0]
    assert z.weights == whole.weights and z.gradients == whole.gradients
    assert z.master == pytest.approx(whole.master / 4, abs=16) and z.optimizer == pytest.approx(whole.optimizer / 4,
                                                                                              abs=32)
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="fsdp")
    f = est.train_memory[0]
    assert f.gradients == pytest.approx(whole.gradients / 4, abs=16) and f.master == z.master
    assert f.peak < z.peak
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, precision="bf16",
                            sharding="none")
    b = est.train_memory[0]
    assert b.master == 0 and b.optimizer == 4 * params and b.gradients == 2 * params


def test_fsdp_shards_and_reduces_the_parameters_outside_the_layers_too(cache):
    """FSDP2 as TorchTitan applies it shards every decoder block and then the root module: the
    embedding, final norm and LM head are a unit too, all-gathered when the forward starts and
    reduce-scattered when the backward ends. The estimate left them out (found by a hunt): their
    weights counted whole, and no data-parallel reduction of their gradients was charged at all,
    so an FSDP step came out faster than a ZeRO-1 one that reduces every gradient."""
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="zero1")
    z = est.train_memory[0]
    est, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="fsdp")
    f = est.train_memory[0]
    assert f.weights == pytest.approx(z.weights / 4, abs=4096)  # every parameter as its 1/dp shard
    assert f.activations == z.activations  # (the gathered root is a temporary, not an activation)

    def calls(est, part, name):
        return sum(c[2] for c in getattr(est, part).collectives if c[0] == name)

    layers = json.loads(Path(TINY).read_text())["num_hidden_layers"]
    zero1, _ = estimate_train(TINY, tp=2, dp=4, micro_batch=1, seq=T, cache_dir=cache, sharding="zero1")
    # one gather and one reduction per unit: each layer, and the root
    assert calls(est, "forward", "all_gather") == calls(zero1, "forward", "all_gather") + layers + 1
    assert calls(est, "backward", "reduce_scatter") == calls(zero1, "backward", "reduce_scatter") + layers + 1


def test_pipeline_stages_hold_the_micro_batches_in_flight(cache):
    est, _ = estimate_train(TINY, tp=2, pp=2, micro_batch=1, seq=T, global_batch=4, cache_dir=cache)
    first, last = est.train_memory
    assert first.in_flight == 2 and last.in_flight == 1
    assert in_flight(8, 0, 32) == 8 and in_flight(8, 7, 32) == 1 and in_flight(8, 0, 3) == 3


def test_a_stage_whose_in_flight_activations_do_not_fit_is_an_oom(cache):
    import torch

    with pytest.raises(torch.OutOfMemoryError, match=r"stage 0 needs .* at its peak, 4 micro-batches' activations"):
        estimate_train(TINY, overrides=["chip.hbm.capacity=220MiB"], tp=2, pp=4, micro_batch=1, seq=2048,
                       global_batch=8, cache_dir=cache)


def test_recipe_errors_are_one_line():
    with pytest.raises(RecipeError, match=r"^--recompute 'some': expected one of none, selective, attention, full$"):
        Recipe(recompute="some").check()
    with pytest.raises(RecipeError, match=r"^--attention 'sdpa': expected one of flash, core$"):
        Recipe(attention="sdpa").check()
    with pytest.raises(RecipeError, match=r"^tp_overlap 1: expected true or false$"):
        Recipe(tp_overlap=1).check()
    with pytest.raises(RecipeError, match=r"^recipe key 'zero': expected one of "):
        Recipe.of({"zero": 1})
    with pytest.raises(RecipeError, match=r"^--virtual-stages 2: only the interleaved schedule"):
        Recipe(virtual_stages=2).check()


@pytest.mark.parametrize("argv,message", [
    (["--loss", "full"], "trnsim: error: --loss 'full': expected one of vocab-parallel, gathered\n"),
    (["--sharding", "zero3"], "trnsim: error: --sharding 'zero3': expected one of none, zero1, fsdp\n"),
    (["--virtual-stages", "0", "--schedule", "interleaved"],
     "trnsim: error: --virtual-stages 0: expected a whole number 1..64\n"),
    # was accepted, and ran the one stage as it runs without a schedule
    (["--schedule", "interleaved", "--virtual-stages", "2"],
     "trnsim: error: --schedule interleaved: one pipeline stage (--pp 1) has no schedule to interleave; use --pp 2 "
     "or more, or --schedule 1f1b\n"),
    # was scheduled: 2 layers a stage as 3 chunks of 2/3 of a layer each
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3"],
     "trnsim: error: --virtual-stages 3: pipeline stage 0's 2 decoder layers do not split into 3 model chunks "
     "(Megatron and NxD need its layers a multiple of the chunks)\n"),
])
def test_cli_recipe_errors(capsys, argv, message):
    code = main(["estimate", "train", "--model", TINY, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == message


def test_cli_prints_the_memory_breakdown(cache, capsys, monkeypatch):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    code = main(["estimate", "train", "--model", TINY, "--tp", "2", "--dp", "2", "--seq", "64", "--recompute", "full"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "HBM         stage 0 (4 ranks): weights " in out and "fp32 master" in out and "AdamW moments" in out
    assert "activations " in out and "x 1 micro-batch" in out
    assert "recipe      vocab-parallel loss, recompute full, ZeRO-1" in out


def test_a_gradient_bucket_hides_behind_the_backward():
    """Two layers, hand-worked: the backward finishes layer 2's gradients (1 MiB) at tick 100 and
    layer 1's at 200 (its end); a bucket holds one layer (cap 1 MiB); each bucket's reduction takes
    60 ticks. Overlapped, bucket A runs 100-160 under layer 1's backward and only bucket B's 60
    ticks (200-260) are exposed; after the backward, both run: 200-260-320, 120 exposed."""
    from trnsim.training import gradient_buckets, overlap_buckets

    mib = 2 ** 20
    buckets = gradient_buckets([(100, mib), (200, mib)], mib)
    assert buckets == [(100, mib), (200, mib)]
    exposed, spans = overlap_buckets([t for t, _ in buckets], [60, 60], 200)
    assert spans == [(100, 160), (200, 260)] and exposed == 60
    exposed, spans = overlap_buckets([t for t, _ in buckets], [60, 60], 200, overlap=False)
    assert spans == [(200, 260), (260, 320)] and exposed == 120
    # a reduction longer than the rest of the backward delays the next bucket: 100-250, then 250-310
    assert overlap_buckets([100, 200], [150, 60], 200) == (110, [(100, 250), (250, 310)])
    # one bucket bigger than every gradient: it closes with the last one, nothing to hide behind
    assert gradient_buckets([(100, mib), (200, mib)], 512 * mib) == [(200, 2 * mib)]


def test_small_buckets_overlap_the_data_parallel_reduction_in_a_step(cache):
    kw = dict(tp=2, dp=4, micro_batch=1, seq=256, cache_dir=cache)
    after, _ = estimate_train(TINY, overlap=False, bucket_mb=1, **kw)
    hidden, _ = estimate_train(TINY, overlap=True, bucket_mb=1, **kw)
    assert after.backward.time_ms == hidden.backward.time_ms
    assert 0 < hidden.dp_reduce_ms < after.dp_reduce_ms
    assert hidden.step_ms == pytest.approx(after.step_ms - (after.dp_reduce_ms - hidden.dp_reduce_ms))


def test_the_fused_lowering_runs_regions_and_one_optimizer_kernel(cache):
    kw = dict(tp=2, dp=2, sp=True, micro_batch=1, seq=256, cache_dir=cache)
    eager, _ = estimate_train(TINY, fused=False, **kw)
    fused, _ = estimate_train(TINY, fused=True, **kw)
    ops = {o[0]: o for o in fused.forward.ops + fused.backward.ops}
    assert ops["fused_region"][1] == "fused" and "fused_region" not in {o[0] for o in eager.forward.ops}
    assert fused.forward.launches < eager.forward.launches and fused.backward.launches < eager.backward.launches
    assert fused.step_ms < eager.step_ms and fused.optimizer_ms < eager.optimizer_ms
    # the same model computes the same matmuls either way (plus the fused norms' column sums on TensorE)
    assert eager.forward.matmul_flops <= fused.forward.matmul_flops <= 1.001 * eager.forward.matmul_flops


def test_attention_dropout_runs_in_the_flash_kernel_when_the_step_is_compiled(cache):
    # BERT's attention drops probabilities (p = 0.1): eager takes PyTorch's math path (batched
    # matmuls, softmax, dropout as kernels of their own); the compiled step runs the flash kernel
    # with VectorE's dropout in it, and its backward as the kernel's passes
    kw = dict(dp=1, micro_batch=4, seq=128, cache_dir=cache, loss="gathered", sharding="none")
    eager, _ = estimate_train(BERT, fused=False, **kw)
    fused, _ = estimate_train(BERT, fused=True, **kw)
    e_ops = {(o[0], o[1]) for o in eager.forward.ops + eager.backward.ops}
    f_ops = {(o[0], o[1]) for o in fused.forward.ops + fused.backward.ops}
    assert ("bmm", "bmm") in e_ops and ("scaled_dot_product_attention", "attention") not in e_ops
    assert ("scaled_dot_product_attention", "attention") in f_ops
    assert ("scaled_dot_product_attention_backward", "attention") in f_ops
    assert not {o for o in f_ops if o[0] in ("bmm", "softmax", "_softmax_backward_data")}
    # the hidden states' dropouts stay (2 per layer + the embeddings'), the attention's go
    calls = {o[0]: o[2] for o in eager.forward.ops}, {o[0]: o[2] for o in fused.forward.ops}
    assert calls[0]["native_dropout"] == 3 * 2 + 1 and calls[1]["native_dropout"] == 2 * 2 + 1
    assert fused.step_ms < eager.step_ms


def test_shipped_plans_load_and_name_their_source():
    from trnsim.training import load_plan, plan_names

    names = plan_names()
    assert {"nxd-llama3.1-8b-trn1-v9a", "nxd-llama3.1-70b-trn1-v9b", "nxd-llama2-7b-trn1-v9c",
            "hf-bert-large-ph1-trn1-v10", "torchtitan-qwen3-8b-trn2", "nxdt-llama3-70b-trn2"} <= set(names)
    for n in names:
        p = load_plan(n)
        assert p["model"] and isinstance(p["recipe"], Recipe)
    v9b = load_plan("nxd-llama3.1-70b-trn1-v9b")
    assert (v9b["tp"], v9b["pp"], v9b["dp"], v9b["seq"], v9b["global_batch"]) == (32, 8, 4, 8192, 1024)
    assert v9b["recipe"].sharding == "zero1" and v9b["overrides"] == ["topology.efa.size=32"]


@pytest.mark.parametrize("text,message", [
    ("model: x\nfoo: 1\n", "unknown key 'foo': expected one of about, source, model"),
    ("model: x\ntp: 0\n", "tp: expected a positive whole number, got 0"),
    ("model: x\nrecipe: {recompute: most}\n", "recipe: --recompute 'most': expected one of none, selective, attention, full"),
    ("tp: 2\n", "model: expected a model name or config.json path"),
])
def test_bad_plan_files_are_one_line(tmp_path, capsys, text, message):
    f = tmp_path / "plan.yaml"
    f.write_text(text)
    code = main(["estimate", "train", "--plan", str(f)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("trnsim: error: ") and message in err and err.count("\n") == 1


def test_a_plan_runs_and_an_option_beside_it_changes_one_axis(cache, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(cache))
    f = tmp_path / "tiny.yaml"
    f.write_text(f"model: {TINY}\nsystem: trn2.48xlarge\ntp: 2\ndp: 2\nsp: true\nseq: 64\nglobal_batch: 4\n"
                 f"recipe: {{recompute: full, sharding: zero1}}\n")
    assert main(["estimate", "train", "--plan", str(f)]) == 0
    out, _ = capsys.readouterr()
    assert "TP=2 DP=2 SP, 4 ranks; micro-batch 1 x 64 tokens, global batch 4" in out and "recompute full" in out
    assert main(["estimate", "train", "--plan", str(f), "--recompute", "none", "--dp", "1"]) == 0
    out, _ = capsys.readouterr()
    assert "TP=2 SP, 2 ranks" in out and "recompute none" in out and "ZeRO-1" in out


def test_the_ledger_predicts_from_a_plan_with_the_row_keys_over_it(monkeypatch):
    """A ledger row's ``plan:`` fills estimate_train's arguments; the row's own keys win."""
    import torch_bridge.estimate as est_mod
    from trnsim.validate import predictors

    seen = {}

    def fake(**kw):
        seen.update(kw)
        raise est_mod.EstimateError("stop")
    monkeypatch.setattr(est_mod, "estimate_train", fake)
    with pytest.raises(Exception, match="stop"):
        predictors._estimate({"mode": "train", "plan": "nxd-llama3.1-8b-trn1-v9a", "recompute": "full",
                              "set": ["chip.hbm.capacity=8GiB"]}, "trn1", [])
    assert seen["tp"] == 32 and seen["dp"] == 32 and seen["recipe"].recompute == "full"
    assert seen["overrides"] == ["topology.efa.size=32", "chip.hbm.capacity=8GiB"]


def test_an_moe_steps_all_to_all_scales_with_the_tokens_routed(cache):
    """Expert parallelism over 4 data-parallel ranks (TP=2: ranks 0, 2, 4, 6): each layer's routed
    tokens (seq x top_k rows of hidden 256, bf16) go to their experts' ranks and back, forward and
    backward; each all-to-all costs rank 0 what trnsim's collective model gives for those bytes, so
    it grows with the tokens routed (sequence and top_k). The step is one compiled graph: its
    collectives pay the system's graph_launch in place of a standalone call's launch."""
    from trnsim.collectives import simulate_collective
    from trnsim.collectives.runtime import in_graph
    from trnsim.config import load_system
    from trnsim.models import ModelConfig, load_model

    spec = load_model(Path(__file__).parent.parent / "data" / "tiny-mixtral.json")
    top4 = ModelConfig(spec.name, spec.path, {**spec.fields, "num_experts_per_tok": 4})
    seen = {}
    for model, seq, k in ((spec, 1024, 2), (spec, 2048, 2), (top4, 1024, 4)):
        est, _ = estimate_train(model, tp=2, dp=4, micro_batch=1, seq=seq, cache_dir=cache, ep=4)
        for step in (est.forward, est.backward):
            ((op, _, calls, ms),) = [c for c in step.collectives if c[0] == "all_to_all"]
            assert calls == 2 * 2  # dispatch and combine in each of the 2 layers
            rep = simulate_collective(in_graph(load_system("trn2.48xlarge")), "all-to-all", seq * k * 256 * 2,
                                      group=[0, 2, 4, 6], dtype="bf16")
            own = (rep.end_of(0) - rep.start_ticks[0]) * 1e3 / rep.tick_hz
            # the launch carries the collective's DMA demand, shared with the core's other queues: within 10%
            assert ms / calls == pytest.approx(own, rel=0.1)
        seen[(seq, k)] = ms / calls
    # each rank holds 4 / 4 = 1 expert's weights: a quarter of the unsplit experts    assert seen[(2048, 2)] > 1.3 * seen[(1024, 2)] and seen[(1024, 4)] == pytest.approx(seen[(2048, 2)], rel=0.1)
    one, _ = estimate_train(spec, tp=2, dp=4, micro_batch=1, seq=1024, cache_dir=cache)
    split, _ = estimate_train(spec, tp=2, dp=4, micro_batch=1, seq=1024, cache_dir=cache, ep=4)
    experts = 2 * 4 * (2 * 512 // 2 * 256 + 256 * 512 // 2) * 2  # 2 layers x 4 experts, TP=2, bf16
    assert one.train_memory[0].weights - split.train_memory[0].weights == pytest.approx(experts * 3 / 4, abs=64)


def test_expert_parallelism_errors_are_one_line():
    with pytest.raises(RecipeError, match=r"^--ep 3: expert parallelism splits the data-parallel ranks; --dp 4 is not "
                                          r"a multiple of it$"):
        estimate_train(TINY, dp=4, seq=64, ep=3)
    with pytest.raises(RecipeError, match=r"^--ep 2: the model has no experts to split"):
        estimate_train(TINY, dp=2, seq=64, ep=2)


def test_the_interleaved_schedule_shrinks_the_bubble():
    """4 ranks, forward 100 and backward 200 ticks a micro-batch, no transfer time: 1F1B takes
    (m + p - 1) x 300; interleaving v chunks per rank shortens the bubble (Megatron's bound:
    (p - 1) / v of the micro-batch time), never below the ideal m x 300; one chunk is 1F1B."""
    from trnsim.workload.plan import pipeline_1f1b
    from trnsim.workload.training import pipeline_interleaved

    for m in (8, 32):
        plain = pipeline_1f1b([100] * 4, [200] * 4, [0] * 3, [0] * 3, m)[0]
        assert plain == (m + 3) * 300
        assert pipeline_interleaved([100] * 4, [200] * 4, [0] * 3, m, 1)[0] == plain
        two = pipeline_interleaved([100] * 4, [200] * 4, [0] * 3, m, 2)[0]
        four = pipeline_interleaved([100] * 4, [200] * 4, [0] * 3, m, 4)[0]
        assert m * 300 <= (m + 3 / 4) * 300 <= four < two < plain


def test_nxd_fused_projections_are_one_matmul_each(cache):
    kw = dict(tp=2, dp=2, sp=True, micro_batch=1, seq=256, cache_dir=cache)
    apart, _ = estimate_train(TINY, fused_projections=False, **kw)
    fused, _ = estimate_train(TINY, fused_projections=True, **kw)
    mm = lambda rep: sum(o[2] for o in rep.ops if o[0] == "mm")  # noqa: E731
    # per layer: q, k, v, o, gate, up, down -> qkv, o, gate_up, down (the LM head's once)
    assert mm(apart.forward) - mm(fused.forward) == 4 * 3
    assert fused.forward.matmul_flops == apart.forward.matmul_flops
    assert fused.train_memory[0].weights == apart.train_memory[0].weights
    assert fused.step_ms < apart.step_ms


def test_qwen3_q_and_k_norms_stay_whole_and_sum_their_gradients_over_tp(cache, tmp_path):
    """Transformers' Qwen3 TP plan marks the per-head q/k norms 'replicated_with_grad_allreduce';
    the TP sharding refused that style, so the shipped TorchTitan Qwen3 plan stopped with an error
    (found by a hunt). Such a module stays whole on every rank, and its weight's gradient is
    all-reduced over the TP group when the backward reaches it."""
    cfg = json.loads(Path(TINY).read_text())
    cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32)
    path = tmp_path / "tiny-qwen3.json"
    path.write_text(json.dumps(cfg))
    est, _ = estimate_train(str(path), tp=2, dp=1, micro_batch=1, seq=T, cache_dir=cache, sharding="none")

    def calls(part):
        return sum(c[2] for c in getattr(est, part).collectives if c[0] == "all_reduce")

    llama, _ = estimate_train(TINY, tp=2, dp=1, micro_batch=1, seq=T, cache_dir=cache, sharding="none")
    more = calls("backward") - sum(c[2] for c in llama.backward.collectives if c[0] == "all_reduce")
    assert more == 2 * cfg["num_hidden_layers"]  # q_norm's and k_norm's, in each layer
