"""Modules on neuron: .to(), state_dict, save/load (both ways, weights_only), deepcopy, pickle, conv."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn


def test_module_to_neuron_keeps_parameter_objects():
    m = nn.Linear(4, 3)
    p = m.weight
    m.to("neuron")
    assert m.weight is p and isinstance(p, nn.Parameter) and p.device.type == "neuron"  # as on CUDA
    assert m.neuron() is m and m.cpu().weight is p and p.device.type == "cpu"


def test_tied_weights_stay_tied():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head}).to("neuron")
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "neuron"
    model.head(model.emb(torch.tensor([1, 2], device="neuron"))).sum().backward()
    assert model.emb.weight.grad.device.type == "neuron"
    assert list(dict(model.named_parameters())) == ["emb.weight"]


def test_hf_gpt2_ties_and_matches_cpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 97, (2, 12))
    ref = model(ids).logits.detach()
    dev = model.to("neuron")
    assert dev.lm_head.weight is dev.transformer.wte.weight
    out = dev(ids.to("neuron")).logits
    torch.testing.assert_close(out.detach().cpu(), ref, rtol=1e-4, atol=1e-4)
    out.float().pow(2).mean().backward()
    assert dev.transformer.wte.weight.grad.device.type == "neuron"


def test_save_load_both_ways_and_weights_only():
    m = nn.Linear(4, 3).to("neuron")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    for kwargs, dev in (({}, "neuron"), ({"map_location": "cpu"}, "cpu"), ({"weights_only": True}, "neuron")):
        buf.seek(0)
        sd = torch.load(buf, **kwargs)
        assert sd["weight"].device.type == dev
        assert torch.equal(sd["weight"].cpu(), m.weight.detach().cpu())
    cpu_buf = io.BytesIO()
    torch.save(nn.Linear(4, 3).state_dict(), cpu_buf)
    cpu_buf.seek(0)
    assert torch.load(cpu_buf, map_location="neuron")["bias"].device.type == "neuron"
    fresh = nn.Linear(4, 3)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh.weight, m.weight.detach().cpu())


def test_deepcopy_and_pickle():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to("neuron")
    c = copy.deepcopy(m)
    assert c[0].weight.device.type == "neuron" and c[0].weight.data_ptr() != m[0].weight.data_ptr()
    assert torch.equal(c[0].weight.cpu(), m[0].weight.cpu())
    t = pickle.loads(pickle.dumps(torch.arange(3.0, device="neuron")))
    assert t.device.type == "neuron" and t.cpu().tolist() == [0.0, 1.0, 2.0]


def test_cnn_forward_backward_matches_cpu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 4, 3, stride=2, groups=2), nn.Flatten())
    x = torch.randn(2, 3, 12, 12)
    ref = net(x)
    ref.sum().backward()
    ref_grad = net[0].weight.grad.clone()
    net.zero_grad()
    dev = net.to("neuron")
    out = dev(x.to("neuron"))
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev[0].weight.grad.cpu(), ref_grad, rtol=1e-4, atol=1e-4)


def test_transformer_encoder_layer_matches_cpu():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    ref = layer(x)
    got = copy.deepcopy(layer).to("neuron")(x.to("neuron"))
    torch.testing.assert_close(got.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
