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
