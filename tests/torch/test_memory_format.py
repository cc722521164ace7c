"""Memory formats follow CPU's propagation on the device (channels_last through a CNN)."""

import copy

import torch
from torch import nn

CL = torch.channels_last


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


def test_conv_keeps_channels_last_like_cpu():
    for cl in (True, False):
        conv = nn.Conv2d(3, 4, 3)
        x = torch.randn(2, 3, 8, 8)
        if cl:
            conv, x = conv.to(memory_format=CL), x.to(memory_format=CL)
        dev = copy.deepcopy(conv).to("neuron")
        want = conv(x)
        got = dev(x.to("neuron"))
        assert got.stride() == want.stride() and got.is_contiguous(memory_format=CL) == cl
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_channels_last_network_forward_backward_match_cpu():
    cpu = _net().to(memory_format=CL)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(2, 3, 10, 10).to(memory_format=CL)
    xc, xn = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    yc, yn = cpu[:4](xc), dev[:4](xn)
    assert yn.stride() == yc.stride()
    cpu[4:](yc).sum().backward()
    dev[4:](yn).sum().backward()
    assert xn.grad.stride() == xc.grad.stride()
    torch.testing.assert_close(xn.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(dev.named_parameters(), cpu.parameters()):
        assert a.grad.stride() == b.grad.stride(), name
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5, msg=name)
