"""The Hugging Face model families an ML engineer brings on day one, each at a tiny size from its
config (random weights, nothing downloaded), on neuron against CPU: the forward's logits, greedy
``generate()``, AdamW training steps in fp32 and bf16, and compiled training for a few.

test_models.py covers GPT-2, Llama and BERT in depth; this file covers the breadth: decoder-only
families with their own attention variants (Qwen2/3 with grouped-query attention, Mistral's and
Gemma 2's sliding windows, Gemma's and OLMo 2's norms, Phi's partial rotary, GPT-NeoX's parallel
residual, Falcon's fused QKV, BLOOM's ALiBi, OPT's learned positions, a Qwen3 MoE), encoder-decoders
(T5's relative position buckets, BART), encoders (DistilBERT, RoBERTa) and Whisper's convolutional
audio encoder; and vision and audio models trained a few steps (ConvNeXt, Swin's shifted windows,
Hugging Face's ResNet, DeiT, MobileViT, SegFormer, CLIP's contrastive loss, wav2vec 2.0's
convolutional feature encoder with CTC). Bounds: fp32 within 1e-5 (the TensorE datapath rounds its
fp32 sums in another order than MKL: the runs differ by ~1e-7); bf16 within 2e-2 relative (one or
two bf16 steps of the loss); greedy tokens identical. Dropout (and wav2vec 2.0's time masking,
stochastic depth) is off: the two devices' generators draw differently.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")
T = transformers

VOCAB = 128
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

# name -> (config factory, model class, kind)
FAMILIES: dict[str, tuple[Callable[[], Any], Any, str]] = {
    "qwen2": (lambda: T.Qwen2Config(**_SMALL, num_key_value_heads=2), T.Qwen2ForCausalLM, "causal"),
    "qwen3": (lambda: T.Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=16), T.Qwen3ForCausalLM, "causal"),
    "qwen3_moe": (lambda: T.Qwen3MoeConfig(**_SMALL, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2), T.Qwen3MoeForCausalLM, "causal"),
    "mistral": (lambda: T.MistralConfig(**_SMALL, num_key_value_heads=2, sliding_window=8), T.MistralForCausalLM,
                "causal"),
    "gemma": (lambda: T.GemmaConfig(**_SMALL, num_key_value_heads=1, head_dim=16), T.GemmaForCausalLM, "causal"),
    "gemma2": (lambda: T.Gemma2Config(**_SMALL, num_key_value_heads=2, head_dim=16, sliding_window=8),
               T.Gemma2ForCausalLM, "causal"),
    "olmo2": (lambda: T.Olmo2Config(**_SMALL, pad_token_id=0, eos_token_id=2), T.Olmo2ForCausalLM, "causal"),
    "phi": (lambda: T.PhiConfig(**_SMALL), T.PhiForCausalLM, "causal"),
    "gpt_neox": (lambda: T.GPTNeoXConfig(**_SMALL), T.GPTNeoXForCausalLM, "causal"),
    "falcon": (lambda: T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
               T.FalconForCausalLM, "causal"),
    "bloom": (lambda: T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4), T.BloomForCausalLM,
              "causal"),
    "opt": (lambda: T.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                num_attention_heads=4, word_embed_proj_dim=64), T.OPTForCausalLM, "causal"),
    "t5": (lambda: T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                              decoder_start_token_id=0), T.T5ForConditionalGeneration, "seq2seq"),
    "bart": (lambda: T.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128), T.BartForConditionalGeneration, "seq2seq"),
    "distilbert": (lambda: T.DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4),
                   T.DistilBertForMaskedLM, "masked"),
    "roberta": (lambda: T.RobertaConfig(**_SMALL), T.RobertaForMaskedLM, "masked"),
    "whisper": (lambda: T.WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                        suppress_tokens=[], begin_suppress_tokens=[]),
                T.WhisperForConditionalGeneration, "speech"),
}
COMPILED = ("qwen3_moe", "gemma2", "t5", "falcon")  # one of each kind of attention and block the backend fuses
# generate() with a static cache: transformers compiles the decode step itself on a neuron model
STATIC = ("gemma2", "qwen2", "mistral", "t5")


# name -> (config factory, model class, kind of inputs): trained in fp32 against CPU
VISION_AUDIO: dict[str, tuple[Callable[[], Any], Any, str]] = {
    "convnext": (lambda: T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=5,
                                          image_size=32), T.ConvNextForImageClassification, "image"),
    "swin": (lambda: T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4, num_labels=5), T.SwinForImageClassification, "image"),
    "resnet": (lambda: T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5),
               T.ResNetForImageClassification, "image"),
    "deit": (lambda: T.DeiTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, num_labels=5),
             T.DeiTForImageClassification, "image"),
    "mobilevit": (lambda: T.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                            neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=5),
                  T.MobileViTForImageClassification, "image"),
    "segformer": (lambda: T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                            hidden_sizes=[16, 32], num_attention_heads=[1, 2], decoder_hidden_size=32,
                                            num_labels=5),
                  T.SegformerForSemanticSegmentation, "segmentation"),
    "clip": (lambda: T.CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=16),
                                  vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4), projection_dim=16),
             T.CLIPModel, "contrastive"),
    "wav2vec2": (lambda: T.Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 2),
                                          conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                          num_conv_pos_embedding_groups=4, mask_time_prob=0.0),
                 T.Wav2Vec2ForCTC, "ctc"),
}


def _vision_audio_inputs(kind: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.tensor([1, 3]))
    if kind == "segmentation":
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g),
                    labels=torch.randint(0, 5, (2, 32, 32), generator=g))
    if kind == "contrastive":
        return dict(input_ids=torch.randint(0, 64, (2, 8), generator=g),
                    pixel_values=torch.randn(2, 3, 32, 32, generator=g), return_loss=True)
    return dict(input_values=torch.randn(2, 400, generator=g), labels=torch.randint(1, 32, (2, 5), generator=g))


def _no_dropout(cfg: Any) -> Any:
    for key, value in cfg.to_dict().items():  # the devices' generators would draw different masks
        if any(w in key for w in ("dropout", "drop_path", "layerdrop")) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


def _model(name: str, dtype: torch.dtype = torch.float32) -> Any:
    make, cls, _ = FAMILIES[name]
    cfg = _no_dropout(make())
    torch.manual_seed(0)
    return cls(cfg).to(dtype)


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def _features(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)).to(dtype)


def _loss(name: str, model: Any, device: str, dtype: torch.dtype) -> torch.Tensor:
    x = _ids().to(device)
    kind = FAMILIES[name][2]
    if kind == "speech":
        return model(input_features=_features(dtype).to(device), labels=x[:, :5].contiguous()).loss
    if kind == "seq2seq":
        return model(input_ids=x, labels=x[:, :5].contiguous()).loss
    return model(input_ids=x, labels=x).loss


def _train(name: str, base: Any, device: str, dtype: torch.dtype, compiled: bool = False, steps: int = 3
           ) -> list[float]:
    model = copy.deepcopy(base).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend="neuron" if device == "neuron" else "aot_eager")
    losses = []
    for _ in range(steps):
        loss = _loss(name, model, device, dtype)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forward_and_greedy_generate_match_cpu(name):
    model = _model(name).eval()
    kind = FAMILIES[name][2]
    ids = _ids()
    if kind == "speech":
        kwargs = dict(input_features=_features(), decoder_input_ids=ids[:, :5])
    elif kind == "seq2seq":
        kwargs = dict(input_ids=ids, decoder_input_ids=ids[:, :5])
    else:
        kwargs = dict(input_ids=ids)
    with torch.no_grad():
        ref = model(**kwargs).logits
        got = copy.deepcopy(model).to("neuron")(**{k: v.to("neuron") for k, v in kwargs.items()}).logits.cpu()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if kind in ("causal", "seq2seq"):
        prompt = ids[:1, :6]
        kw = dict(max_new_tokens=6, do_sample=False)
        with torch.no_grad():
            want = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
            on = copy.deepcopy(model).to("neuron")
            p = prompt.to("neuron")
            have = on.generate(p, attention_mask=torch.ones_like(p), **kw)
        assert have.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_training_matches_cpu(name):
    base = _model(name)
    cpu, neuron = _train(name, base, "cpu", torch.float32), _train(name, base, "neuron", torch.float32)
    assert _rel(cpu, neuron) < 1e-5, (cpu, neuron)
    assert neuron[-1] < neuron[0]  # (it learns)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_training_is_within_bf16_rounding_of_cpu(name):
    base = _model(name, torch.bfloat16)
    cpu, neuron = _train(name, base, "cpu", torch.bfloat16), _train(name, base, "neuron", torch.bfloat16)
    assert _rel(cpu, neuron) < 2e-2, (cpu, neuron)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_training_matches_cpus_compiled_training(name):
    """torch.compile(model, backend="neuron") against the same model compiled on CPU (aot_eager:
    the same graphs, CPU's kernels)."""
    base = _model(name)
    cpu = _train(name, base, "cpu", torch.float32, compiled=True)
    neuron = _train(name, base, "neuron", torch.float32, compiled=True)
    assert _rel(cpu, neuron) < 1e-5, (cpu, neuron)


@pytest.mark.parametrize("name, compiled", [(n, False) for n in VISION_AUDIO] + [("clip", True), ("swin", True)])
def test_vision_and_audio_training_matches_cpu(name, compiled):
    """Three AdamW steps against CPU's eager ones; compiled for CLIP and Swin too (CLIP's
    normalised embeddings failed to compile: "compiled regions form a cycle")."""
    make, cls, kind = VISION_AUDIO[name]
    torch.manual_seed(0)
    losses = _vision_losses(cls(_no_dropout(make())), _vision_audio_inputs(kind), compiled)
    assert _rel(losses["cpu"], losses["neuron"]) < 1e-5, losses


def _vision_losses(base: Any, inputs: dict[str, Any], compiled: bool) -> dict[str, list[float]]:
    """Three AdamW steps of ``base`` on CPU (eager) and on neuron (compiled if asked): the losses."""
    losses = {}
    for device in ("cpu", "neuron"):
        model = copy.deepcopy(base).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = model
        if compiled and device == "neuron":
            torch._dynamo.reset()
            step = torch.compile(model, backend="neuron")
        run = []
        for _ in range(3):
            loss = step(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[device] = run
    return losses


@pytest.mark.parametrize("name", ["resnet", "convnext", "mobilevit"])
def test_channels_last_compiled_training_matches_cpu(name):
    """``model.to(memory_format=torch.channels_last)`` with channels-last images, compiled: three
    AdamW steps against CPU's eager ones. The graph's convolutions ran in CPU's layout where it
    was traced with PyTorch's fake (contiguous) one: a view of a result failed ("view size is not
    compatible"), and a group norm after one gave wrong gradients."""
    make, cls, kind = VISION_AUDIO[name]
    torch.manual_seed(0)
    base = cls(_no_dropout(make())).to(memory_format=torch.channels_last)
    inputs = _vision_audio_inputs(kind)
    inputs["pixel_values"] = inputs["pixel_values"].contiguous(memory_format=torch.channels_last)
    losses = _vision_losses(base, inputs, True)
    assert _rel(losses["cpu"], losses["neuron"]) < 1e-5, losses


def test_compiled_autocast_training_is_within_autocasts_rounding():
    """torch.compile under torch.autocast("neuron"): Qwen2's rotary embedding leaves the query in
    float32 beside a bf16 value, which failed to compile; the loss is as close to float32 as eager
    autocast's."""
    base = _model("qwen2")
    want = _train("qwen2", base, "cpu", torch.float32, steps=1)[0]
    model = copy.deepcopy(base).to("neuron").train()
    torch._dynamo.reset()
    run = torch.compile(model, backend="neuron")
    x = _ids().to("neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        loss = run(input_ids=x, labels=x).loss
    loss.backward()
    assert abs(loss.item() - want) / want < 1e-3


@pytest.mark.parametrize("name", STATIC)
def test_static_cache_generate_gives_cpus_tokens(name):
    """``cache_implementation="static"``: on neuron transformers compiles the decode step (the
    neuron backend), on CPU it runs eagerly; the greedy tokens are CPU's. (Gemma 2's went to 0
    from the second step while a fused region's view result pointed at freed memory.)"""
    model = _model(name).eval()
    prompt = _ids(10)
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        on = copy.deepcopy(model).to("neuron")
        p = prompt.to("neuron")
        torch._dynamo.reset()
        have = on.generate(p, attention_mask=torch.ones_like(p), **kw)
    assert have.cpu().tolist() == want.tolist()
