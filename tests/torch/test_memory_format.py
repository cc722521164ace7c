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


def test_pixel_shuffle_and_unshuffle_keep_cpu_s_layout_forward_and_backward():
    """Their CPU kernels keep a channels-last input's layout; the composite decomposition other
    devices run (reshape, permute, clone) laid the result out contiguous (an adversarial values
    hunt found it): the same values, other strides."""
    import torch.nn.functional as F

    for fmt in (CL, torch.contiguous_format):
        x = torch.randn(2, 8, 6, 4, generator=torch.Generator().manual_seed(0)).contiguous(memory_format=fmt)
        for f in (lambda t: F.pixel_shuffle(t, 2), lambda t: F.pixel_unshuffle(t, 2)):
            xc, xn = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
            want, got = f(xc), f(xn)
            assert got.stride() == want.stride()
            assert torch.equal(got.cpu(), want)
            g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).contiguous(memory_format=fmt)
            want.backward(g)
            got.backward(g.to("neuron"))
            assert xn.grad.stride() == xc.grad.stride() and torch.equal(xn.grad.cpu(), xc.grad)


def test_group_norm_s_backward_takes_pytorch_s_formula_for_a_device_other_than_cpu():
    """PyTorch's derivative of native_group_norm hands its backward kernel a contiguous gradient
    and input on every device but CPU (and XPU), where CPU keeps a channels-last input's layout:
    on neuron a channels-last group norm's gradients are CPU's kernel's on contiguous operands
    (the last bits can differ from CPU's own channels-last run, as on CUDA). Its forward is CPU's."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, 10, generator=gen).contiguous(memory_format=CL)
    w, b = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    go = torch.randn(2, 4, 9, 10, generator=gen)
    xn, wn, bn = (t.to("neuron").requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.group_norm(xn, 2, wn, bn)
    y.backward(go.to("neuron"))
    out, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, 2, 4, 90, 2, 1e-5)
    assert torch.equal(y.cpu(), out) and y.stride() == out.stride()
    want = torch.ops.aten.native_group_norm_backward(go.contiguous(), x.contiguous(), mean, rstd, w, 2, 4, 90, 2,
                                                     [True, True, True])
    for got, ref in zip((xn.grad, wn.grad, bn.grad), want):
        assert torch.equal(got.cpu(), ref)
