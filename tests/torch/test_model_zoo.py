"""The model zoo: real architectures, built from CI-sized configs (no downloads), run forward and
backward on neuron and match CPU; ``generate()`` with a dynamic cache gives CPU's tokens.

Hugging Face models cover decoders, encoders, encoder-decoders, vision, speech and mixture of
experts; CNN blocks written here cover a ResNet basic block, a depthwise-separable (MobileNet)
block and a channels-last network. Every model runs in eval mode (dropout off: the device draws
its own random numbers, so masks would differ) with gradients on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 96, 12, 2


def _tokens(batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _lm(cfg_cls: str, model_cls: str, **cfg):
    def build():
        config = getattr(transformers, cfg_cls)(**cfg)
        return getattr(transformers, model_cls)(config), {"input_ids": _tokens()}
    return build


_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)
_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config), {"input_ids": _tokens(), "labels": _tokens()}


def _bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0)
    return transformers.BartForConditionalGeneration(config), {"input_ids": _tokens(), "labels": _tokens()}


def _pixels(channels: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=torch.Generator().manual_seed(2))


def _vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(config), {"pixel_values": _pixels()}


def _convnext():
    config = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                         num_labels=5, image_size=32)
    return transformers.ConvNextForImageClassification(config), {"pixel_values": _pixels()}


def _resnet():
    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="bottleneck", num_labels=5)
    return transformers.ResNetForImageClassification(config), {"pixel_values": _pixels()}


def _wav2vec2():
    config = transformers.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                         hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                         feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                                         mask_time_prob=0.0)
    audio = torch.randn(BATCH, 800, generator=torch.Generator().manual_seed(3))
    return transformers.Wav2Vec2Model(config), {"input_values": audio}


def _whisper():
    config = transformers.WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
                                        max_target_positions=32, dropout=0.0, pad_token_id=0,
                                        decoder_start_token_id=1)
    feats = torch.randn(BATCH, 16, 32, generator=torch.Generator().manual_seed(4))
    return transformers.WhisperForConditionalGeneration(config), {"input_features": feats,
                                                                   "decoder_input_ids": _tokens(seq=6)}


ZOO = {
    # decoders
    "gpt2": _lm("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": _lm("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DEC),
    "mistral": _lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=8, **_DEC),
    "qwen2": _lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_DEC),
    "gpt_neox": _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DEC),
    "opt": _lm("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, ffn_dim=64, max_position_embeddings=64, dropout=0.0, word_embed_proj_dim=32),
    "phi": _lm("PhiConfig", "PhiForCausalLM", **_DEC),
    "gemma": _lm("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8, **_DEC),
    # encoders
    "bert": _lm("BertConfig", "BertForMaskedLM", **_ENC),
    "roberta": _lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1, **{**_ENC, "max_position_embeddings": 70}),
    "distilbert": _lm("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                      hidden_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0),
    "albert": _lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=16, **_ENC),
    "electra": _lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=16, **_ENC),
    # encoder-decoders
    "t5": _t5,
    "bart": _bart,
    # vision
    "vit": _vit,
    "convnext": _convnext,
    "resnet": _resnet,
    # speech
    "wav2vec2": _wav2vec2,
    "whisper": _whisper,
    # mixture of experts
    "mixtral": _lm("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2, **_DEC),
    "qwen2_moe": _lm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     **_DEC),
}


def _first_float(out) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t
    return out[0]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding at the tensor's scale: TensorE accumulates in another order than CPU BLAS."""
    assert actual.device.type == "neuron", what
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=2e-4, atol=2e-5 * max(scale, 1e-3),
                               msg=lambda m: f"{what}: {m}")


def _run(model: nn.Module, inputs: dict[str, torch.Tensor], device: str):
    model = model.to(device)
    out = _first_float(model(**{k: v.to(device) for k, v in inputs.items()}))
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device)
    (out * cot).sum().backward()
    return out


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_and_backward_match_cpu(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    model.eval()
    dev = copy.deepcopy(model)
    out_c = _run(model, inputs, "cpu")
    out_n = _run(dev, inputs, "neuron")
    _close(out_n, out_c, f"{name} output")
    for (pname, a), b in zip(dev.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), pname
        if b.grad is not None:
            _close(a.grad, b.grad, f"{name} grad {pname}")


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "t5"])
def test_generate_with_a_dynamic_cache_gives_cpus_tokens(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    model.eval()
    dev = copy.deepcopy(model).to("neuron")
    prompt = inputs["input_ids"][:1, :5]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = model.generate(prompt, **kwargs)
    got = dev.generate(prompt.to("neuron"), **kwargs)
    assert got.device.type == "neuron"
    assert got.cpu().tolist() == want.tolist()


# ---- CNN blocks written here ------------------------------------------------------------------
class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs with batch norm and an identity (or 1x1) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


class SeparableBlock(nn.Module):
    """MobileNet's depthwise-separable block: a depthwise 3x3, then a pointwise 1x1."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.dw = nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                                nn.ReLU6())
        self.pw = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU6())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(self.dw(x))


CNNS = {
    "resnet_block": lambda: nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, 2)),
    "separable_block": lambda: nn.Sequential(SeparableBlock(8, 16), SeparableBlock(16, 24, 2)),
    "channels_last": lambda: nn.Sequential(BasicBlock(8, 16, 2), SeparableBlock(16, 16)).to(
        memory_format=torch.channels_last),
}


@pytest.mark.parametrize("name", sorted(CNNS))
def test_cnn_blocks_match_cpu_in_training(name):
    torch.manual_seed(0)
    cpu = CNNS[name]()
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(6))
    if name == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    xc, xn = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    yc, yn = cpu(xc), dev(xn)  # training mode: batch norm uses (and updates) batch statistics
    assert yn.stride() == yc.stride()
    _close(yn, yc, f"{name} output")
    yc.square().sum().backward()
    yn.square().sum().backward()
    _close(xn.grad, xc.grad, f"{name} input grad")
    for (pname, a), b in zip(dev.named_parameters(), cpu.parameters()):
        _close(a.grad, b.grad, f"{name} grad {pname}")
    for (bname, a), b in zip(dev.named_buffers(), cpu.buffers()):
        _close(a.float(), b.float(), f"{name} buffer {bname}")
