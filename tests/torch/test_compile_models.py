"""Compiled models equal eager ones on the device, forward and backward: an MLP, a CNN, and
GPT-2 and Llama from small Hugging Face configs (no downloads). fp32 regions compute what their
eager ops compute, so most results are bit-identical; tolerances allow for the few ops whose
CPU kernels reduce in another order on differently laid-out memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_bridge.compile as neuron_compile

neuron_compile.register()
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.SiLU(), nn.LayerNorm(64),
                                 nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """ResNet-style: conv, batch norm, relu, a residual block, pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(x.mean((2, 3)))


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = b.abs().max().item()
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6 * max(scale, 1e-3), msg=what)


def _check(model: nn.Module, run, inputs) -> None:
    eager = copy.deepcopy(model).to("neuron")
    comp = copy.deepcopy(model).to("neuron")
    torch._dynamo.reset()
    compiled = torch.compile(comp, backend="neuron")
    with torch.neuron.report_scope() as scope:
        out_c = run(compiled, inputs)
        out_c.backward()
    out_e = run(eager, inputs)
    out_e.backward()
    _close(out_c.detach(), out_e.detach(), "loss")
    for (name, pe), pc in zip(eager.named_parameters(), comp.parameters()):
        if pe.grad is not None:
            _close(pc.grad, pe.grad, f"grad of {name}")
    rep = scope.report
    assert rep.regions, "nothing fused"
    assert rep.graph_launches >= 2  # forward and backward, one launch each
    assert rep.launches_saved > 0 and rep.hbm_bytes_saved > 0


def test_mlp():
    torch.manual_seed(0)
    x = torch.randn(16, 32).to("neuron")
    _check(MLP(), lambda m, x: m(x).pow(2).mean(), x)


def test_cnn():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16).to("neuron")
    _check(CNN(), lambda m, x: nn.functional.cross_entropy(m(x), torch.arange(4, device="neuron")), x)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_causal_lm(build):
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to("neuron")
    _check(build(), lambda m, x: m(x, labels=x, use_cache=False).loss, tokens)


def test_bf16_regions_round_once():
    """A bf16 region keeps its intermediates in fp32 and rounds its outputs once: compiled equals
    the chain computed in fp32 and rounded at the end, and differs from eager, which rounds after
    every op (each within one bf16 step of the other)."""
    def chain(x, b):
        return torch.tanh((x + b) * 1.7) * x

    torch.manual_seed(0)
    x = torch.randn(64, 256).to(torch.bfloat16).to("neuron")
    b = torch.randn(256).to(torch.bfloat16).to("neuron")
    torch._dynamo.reset()
    got = torch.compile(chain, backend="neuron")(x, b).cpu()
    eager = chain(x, b).cpu()
    want = chain(x.cpu().float(), b.cpu().float()).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(got, eager)
    torch.testing.assert_close(got.float(), eager.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("f", [
    lambda x: (x.half() * 30000).float() / 30000,  # eager's fp16 product overflows to -inf
    lambda x: (x.bfloat16() + 1000).float() - 1000,  # bf16 absorbs the small part
    lambda x: (x.bfloat16() * 3).float().sum(),
    lambda x: ((x.bfloat16() * 7).half() * 3).float(),  # bf16 then fp16: rounded twice, as eager
], ids=["fp16-overflow", "bf16-absorbs", "bf16-sum", "bf16-to-fp16"])
def test_an_explicit_cast_reads_its_operand_rounded_as_eager_does(f):
    """A region keeps intermediates in fp32, but a cast of a 16-bit value reads it rounded to its
    dtype: ``(x.half() * 30000).float()`` read the finite fp32 product (found by a values hunt)."""
    x = torch.tensor([1.5, -0.3, -2.2, 0.6])
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="neuron")
    want = f(x)
    for _ in range(2):  # (the second call: the region's specialised code)
        got = compiled(x.to("neuron")).cpu()
        assert torch.equal(got, want), (got, want)
    assert torch.equal(f(x.to("neuron")).cpu(), want)


def test_sizes_only_the_run_knows_run_eagerly_in_the_graph():
    """An op whose output size depends on the data (``x[x > 0.5]``, ``arange(n.item())``) made
    the fusion pass guard on an unbacked size: BackendCompilerFailed (found by a values hunt).
    (The config's own patch: pytest 9.2's monkeypatch deletes a module attribute served by the
    module's __getattr__ on undo, which took the setting out of dynamo's config for every later
    compile of the run.)"""
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        for f in (lambda x: x[x > 0.5] * 2, lambda x: torch.arange((x > 0).sum().item(), device=x.device) * 2):
            torch._dynamo.reset()
            got = torch.compile(f, backend="neuron", fullgraph=True)(x.to("neuron"))
            assert torch.equal(got.cpu(), f(x))
