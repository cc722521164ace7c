"""torch.autocast("neuron"): TensorE ops run in the autocast dtype; gradients flow to fp32 weights."""

import torch
from torch import nn


def test_autocast_bf16_linear_and_matmul():
    lin = nn.Linear(8, 4).to("neuron")
    x = torch.randn(3, 8, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = lin(x)
        z = x @ x.t()
        s = x + 1  # not an autocast op: stays fp32
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16 and s.dtype == torch.float32
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.device.type == "neuron"


def test_autocast_result_is_the_bf16_datapath_result():
    x = torch.randn(4, 8)
    w = torch.randn(8, 5)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        got = x.to("neuron") @ w.to("neuron")
    want = (x.bfloat16().to("neuron") @ w.bfloat16().to("neuron")).cpu()
    assert torch.equal(got.cpu(), want)


def test_autocast_fp16_conv_and_disabled_region():
    conv = nn.Conv2d(2, 3, 3).to("neuron")
    x = torch.randn(1, 2, 5, 5, device="neuron")
    with torch.autocast("neuron", dtype=torch.float16):
        assert conv(x).dtype == torch.float16
        with torch.autocast("neuron", enabled=False):
            assert conv(x).dtype == torch.float32


def test_autocast_follows_the_accelerator_policy():
    """PyTorch's shared autocast lists, as CUDA, XPU and the others run them: precision-sensitive
    ops in float32, mixed inputs promoted, the rest as they come."""
    x = torch.randn(4, 8, device="neuron")
    w = torch.randn(8, 8, device="neuron")
    target = torch.tensor([1, 2, 3, 4], device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = x @ w
        assert y.dtype == torch.bfloat16
        for out in (torch.softmax(y, -1), torch.log_softmax(y, -1), torch.exp(y), y.pow(2), y.norm(),
                    y.sum(), nn.functional.layer_norm(y, (8,)), nn.functional.cross_entropy(y, target),
                    nn.functional.mse_loss(y, y.detach() + 1)):
            assert out.dtype == torch.float32
        assert torch.addcmul(x, y, y).dtype == torch.float32  # promoted to the widest input
        assert (y + 1).dtype == torch.bfloat16 and torch.relu(y).dtype == torch.bfloat16
        assert torch.softmax(y, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # an explicit dtype wins


def test_autocast_cross_entropy_is_float32_over_the_bf16_logits():
    """A bf16 model's loss under autocast: CPU's kernels on the logits cast to float32, bit for bit
    (the loss was a bf16 log_softmax, 1e-3 off, before the float32 list)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, 128, generator=g) * 0.5).bfloat16()
    target = torch.randint(0, 128, (24,), generator=g)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        got = nn.functional.cross_entropy(logits.to("neuron"), target.to("neuron"))
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu(), nn.functional.cross_entropy(logits.float(), target))


def test_compiled_attention_under_autocast_casts_its_inputs():
    """In a compiled graph the device's attention stands in for F.scaled_dot_product_attention
    below autocast: it casts its floating inputs to the autocast dtype as the eager call's
    autocast kernel does (a float32 query beside a bf16 value, as a rotary embedding leaves them,
    failed to compile), and gives eager autocast's values."""
    import torch_bridge.compile as neuron_compile

    neuron_compile.register()

    def fn(q, k, v):
        return nn.functional.scaled_dot_product_attention(q * 1.0, k, v.to(torch.bfloat16), is_causal=True)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g).to("neuron") for _ in range(3))
    with torch.autocast("neuron", dtype=torch.bfloat16):
        want = fn(q, k, v)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="neuron")(q, k, v)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), want.cpu())
