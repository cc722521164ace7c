"""Whole models with padding masks give CPU's logits and tokens (issue 24).

Hugging Face's tiny Llama, GPT-2, BERT and T5, built from their configs with a fixed seed (no
weights are downloaded), with left and right padding (attention_mask with zeros), static and
dynamic cache ``generate()`` with padding, encoder key-padding masks; and
``nn.MultiheadAttention`` with ``key_padding_mask`` and ``attn_mask`` of both kinds (bool and
float). Logits match within the TensorE's fp32 summation order (1e-4); tokens exactly. The
left-padded Llama ``generate()`` cases live in test_compile_generate.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import torch_bridge.compile as neuron_compile

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
neuron_compile.register()

TOL = 1e-4
VOCAB = 128


def _pair(cls: Any, cfg: Any) -> tuple[Any, Any]:
    """The same randomly initialised model on CPU and on neuron (weights copied, not reseeded)."""
    torch.manual_seed(0)
    cpu = cls(cfg).eval()
    dev = cls(cfg).eval()
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to("neuron")


def _padded(left: bool, b: int = 3, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with 0, 3 and 5 padding positions on the left or right."""
    ids = torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, n, dtype=torch.long)
    for row, pad in enumerate((0, 3, 5)[:b]):
        if pad:
            if left:
                mask[row, :pad] = 0
            else:
                mask[row, n - pad:] = 0
    return ids * mask, mask


def _llama() -> Any:
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _gpt2() -> Any:
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                                   eos_token_id=1, pad_token_id=0)


def _t5() -> Any:
    return transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
                                 vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


DECODERS = {"llama": (transformers.LlamaForCausalLM, _llama), "gpt2": (transformers.GPT2LMHeadModel, _gpt2)}


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
@pytest.mark.parametrize("arch", list(DECODERS))
def test_decoder_logits_with_padding_match_cpu(arch, left):
    cls, cfg = DECODERS[arch]
    cpu, dev = _pair(cls, cfg())
    ids, mask = _padded(left)
    with torch.no_grad():
        want = cpu(ids, attention_mask=mask).logits
        got = dev(ids.to("neuron"), attention_mask=mask.to("neuron")).logits.cpu()
    real = mask.bool()  # padding positions' logits are nobody's answer
    torch.testing.assert_close(got[real], want[real], rtol=TOL, atol=TOL)


def _generate_both(cpu: Any, dev: Any, ids: torch.Tensor, mask: torch.Tensor, cache: str, new: int = 10) -> None:
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask, output_logits=True,
              return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"  # compiles the decode step with backend="neuron"
    want = cpu.generate(ids, **kw)
    torch._dynamo.reset()
    got = dev.generate(ids.to("neuron"), **dict(kw, attention_mask=mask.to("neuron")))
    assert got.sequences.cpu().tolist() == want.sequences.tolist()
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a.cpu(), b, rtol=TOL, atol=TOL, msg=f"step {step}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpt2_left_padded_generate_matches_cpu(cache):
    cpu, dev = _pair(transformers.GPT2LMHeadModel, _gpt2())
    ids, mask = _padded(left=True)
    _generate_both(cpu, dev, ids, mask, cache)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_bert_key_padding_mask_logits_match_cpu(left):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  vocab_size=VOCAB, max_position_embeddings=64)
    cpu, dev = _pair(transformers.BertForMaskedLM, cfg)
    ids, mask = _padded(left)
    with torch.no_grad():
        want = cpu(ids, attention_mask=mask).logits
        got = dev(ids.to("neuron"), attention_mask=mask.to("neuron")).logits.cpu()
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=TOL, atol=TOL)


def test_t5_padded_encoder_logits_match_cpu():
    cpu, dev = _pair(transformers.T5ForConditionalGeneration, _t5())
    ids, mask = _padded(left=False)
    dec = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = cpu(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        got = dev(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron"),
                  decoder_input_ids=dec.to("neuron")).logits.cpu()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5_padded_generate_matches_cpu(cache):
    cpu, dev = _pair(transformers.T5ForConditionalGeneration, _t5())
    ids, mask = _padded(left=False)
    _generate_both(cpu, dev, ids, mask, cache, new=8)


# ---- nn.MultiheadAttention and nn.TransformerEncoder ------------------------------------------
def _masks(batch: int, l: int, s: int) -> dict[str, Any]:
    kpm_bool = torch.zeros(batch, s, dtype=torch.bool)
    kpm_bool[1, -3:] = True  # True = padding (MultiheadAttention's sense)
    kpm_float = torch.zeros(batch, s)
    kpm_float[1, -3:] = float("-inf")
    am_bool = torch.rand(l, s, generator=torch.Generator().manual_seed(2)) > 0.7
    am_bool[:, 0] = False  # every query sees a key
    am_float = torch.randn(l, s, generator=torch.Generator().manual_seed(3))
    return {"kpm": {"none": None, "bool": kpm_bool, "float": kpm_float},
            "am": {"none": None, "bool": am_bool, "float": am_float}}


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_multihead_attention_masks_match_cpu(batch_first, need_weights, grad):
    """Every pair of key_padding_mask and attn_mask kinds (none, bool, float); in eval without
    weights and gradients PyTorch takes its fused fast path (_native_multi_head_attention)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    dev = copy.deepcopy(mha).to("neuron")
    l, s, b = 5, 7, 3
    g = torch.Generator().manual_seed(1)
    q = torch.randn((b, l, 32) if batch_first else (l, b, 32), generator=g)
    kv = torch.randn((b, s, 32) if batch_first else (s, b, 32), generator=g)
    masks = _masks(b, l, s)
    on = (lambda t: None if t is None else t.to("neuron"))
    for kpm_kind, kpm in masks["kpm"].items():
        for am_kind, am in masks["am"].items():
            with torch.set_grad_enabled(grad):
                want = mha(q, kv, kv, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
                got = dev(on(q), on(kv), on(kv), key_padding_mask=on(kpm), attn_mask=on(am), need_weights=need_weights)
            for w, d in zip(want, got):
                if w is None:
                    assert d is None
                    continue
                torch.testing.assert_close(d.detach().cpu(), w.detach(), rtol=TOL, atol=TOL, equal_nan=True,
                                           msg=f"key_padding_mask={kpm_kind} attn_mask={am_kind}")


def test_transformer_encoder_padding_mask_refuses_nested_tensors_in_one_line():
    """In eval mode with a src_key_padding_mask, nn.TransformerEncoder packs the batch into a
    nested tensor, which the device does not hold: one line says so (it failed inside PyTorch
    with "NestedTensorImpl doesn't support sizes"); without nested tensors it matches CPU."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1, -3:] = True
    nested = torch.nn.TransformerEncoder(copy.deepcopy(layer), 2).eval().to("neuron")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        nested(x.to("neuron"), src_key_padding_mask=kpm.to("neuron"))
    cpu = torch.nn.TransformerEncoder(copy.deepcopy(layer), 2, enable_nested_tensor=False).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    with torch.no_grad():
        want = cpu(x, src_key_padding_mask=kpm)
        got = dev(x.to("neuron"), src_key_padding_mask=kpm.to("neuron")).cpu()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
