"""Autograd and optimizers on neuron, including the 30-step MLP training loop against CPU."""

import pytest
import torch
from torch import nn


def _train(device: str, steps: int = 30, **adamw: object) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw)
    x = torch.randn(64, 16).to(device)
    y = torch.randint(0, 4, (64,)).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_mlp_30_steps_adamw_matches_cpu():
    cpu_losses, cpu_state = _train("cpu")
    dev_losses, dev_state = _train("neuron")
    assert cpu_losses[-1] < 0.5 * cpu_losses[0]  # it trains
    # fp32 matmuls run on the datapath (fixed 128-row fp32 accumulation), CPU uses its BLAS order:
    # the two differ by rounding only
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=1e-5, atol=1e-6)
    for k in cpu_state:
        torch.testing.assert_close(dev_state[k], cpu_state[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("kind", [{"foreach": False}, {"fused": True}])
def test_adamw_variants_match_cpu(kind):
    cpu_losses, _ = _train("cpu", steps=5, **kind)
    dev_losses, _ = _train("neuron", steps=5, **kind)
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=1e-5, atol=1e-6)


def test_sgd_momentum_and_grads_stay_on_device():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).to("neuron")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        lin(torch.ones(4, 3, device="neuron")).pow(2).sum().backward()
        opt.step()
    assert lin.weight.grad.device.type == "neuron" and isinstance(lin.weight, nn.Parameter)


def test_inplace_on_saved_tensor_is_caught():
    a = torch.ones(3, device="neuron", requires_grad=True)
    b = a.sigmoid()
    b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def test_autograd_grad_matches_cpu():
    x = torch.randn(4, 5, dtype=torch.float64)

    def f(t):
        return (t.tanh() @ t.t()).logsumexp(0).sum()
    xc = x.clone().requires_grad_()
    xn = x.to("neuron").requires_grad_()
    (gc,) = torch.autograd.grad(f(xc), xc)
    (gn,) = torch.autograd.grad(f(xn), xn)
    torch.testing.assert_close(gn.cpu(), gc)


@pytest.mark.parametrize("make", [lambda p, **kw: torch.optim.NAdam(p, lr=1e-2, **kw),
                                  lambda p, **kw: torch.optim.ASGD(p, lr=1e-2, t0=2, **kw)], ids=["nadam", "asgd"])
def test_optimizers_default_to_foreach_on_the_device_as_on_cuda(make):
    """PyTorch's optimizers default to their foreach implementation on an accelerator (CUDA, XPU,
    the PrivateUse1 device) and to the for-loop on CPU; the two round differently (NAdam, ASGD).
    The device's default steps are CPU's foreach=True steps bit for bit."""
    gen = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(50, generator=gen), [torch.randn(50, generator=gen) for _ in range(5)]
    pc, pn = p0.clone().requires_grad_(), p0.to("neuron").requires_grad_()
    oc, on = make([pc], foreach=True), make([pn])
    for g in grads:
        pc.grad, pn.grad = g, g.to("neuron")
        oc.step()
        on.step()
        assert torch.equal(pn.detach().cpu(), pc.detach())
