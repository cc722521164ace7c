"""Ops given tensors on two devices raise CUDA's error, where they used to compute silently."""

import re

import pytest
import torch
import torch.nn.functional as F

N0, N1 = torch.device("neuron", 0), torch.device("neuron", 1)
MSG = r"^Expected all tensors to be on the same device, but found at least two devices, {} and {}!$"


def _cases(a: torch.device, b: torch.device):
    return {
        "mm": lambda: torch.mm(torch.ones(2, 2, device=a), torch.ones(2, 2, device=b)),
        "addmm": lambda: torch.addmm(torch.ones(2, device=a), torch.ones(2, 2, device=a), torch.ones(2, 2, device=b)),
        "bmm": lambda: torch.bmm(torch.ones(1, 2, 2, device=a), torch.ones(1, 2, 2, device=b)),
        "baddbmm": lambda: torch.baddbmm(torch.ones(1, 2, 2, device=b), torch.ones(1, 2, 2, device=a),
                                         torch.ones(1, 2, 2, device=a)),
        "linear": lambda: F.linear(torch.ones(2, 2, device=a), torch.ones(3, 2, device=b)),
        "matmul": lambda: torch.ones(2, 2, 2, device=a) @ torch.ones(2, 2, device=b),
        "conv2d": lambda: F.conv2d(torch.ones(1, 1, 3, 3, device=a), torch.ones(1, 1, 2, 2, device=b)),
        "conv_bias": lambda: F.conv2d(torch.ones(1, 1, 3, 3, device=a), torch.ones(1, 1, 2, 2, device=a),
                                      torch.ones(1, device=b)),
        "embedding": lambda: F.embedding(torch.tensor([0], device=a), torch.ones(2, 2, device=b)),
        "sdpa": lambda: F.scaled_dot_product_attention(torch.ones(1, 1, 2, 4, device=a), torch.ones(1, 1, 2, 4, device=b),
                                                       torch.ones(1, 1, 2, 4, device=a)),
        "add": lambda: torch.ones(3, device=a) + torch.ones(3, device=b),
        "cat": lambda: torch.cat([torch.ones(2, device=a), torch.ones(2, device=b)]),
        "layer_norm": lambda: F.layer_norm(torch.ones(2, 4, device=a), (4,), torch.ones(4, device=b)),
        "index_select": lambda: torch.ones(3, device=a).index_select(0, torch.tensor([0], device=b)),
    }


@pytest.mark.parametrize("name", sorted(_cases(N0, N1)))
@pytest.mark.parametrize("other", ["cpu", "neuron:1"])
def test_two_devices_raise_cudas_error(name, other):
    other = torch.device(other)
    first, second = sorted((N0, other), key=str)
    with pytest.raises(RuntimeError, match=MSG.format(first, second)):
        _cases(N0, other)[name]()
    with pytest.raises(RuntimeError, match=MSG.format(first, second)):
        _cases(other, N0)[name]()


def test_host_scalars_and_host_indices_still_mix():
    x = torch.arange(4.0, device="neuron")
    assert (x * torch.tensor(2.0)).cpu().tolist() == [0.0, 2.0, 4.0, 6.0]  # a 0-dim host tensor is a scalar
    assert x[torch.tensor([1, 3])].cpu().tolist() == [1.0, 3.0]  # host indices, as on CUDA
    x[torch.tensor([0])] = 9.0
    assert x.cpu().tolist() == [9.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("fast", [True, False])
def test_clamp_takes_host_scalar_bounds_as_cpu_does(fast):
    """clamp's Tensor overloads with a 0-dim host min/max beside device tensors compute CPU's values
    and dtypes (their structured meta refused them as two devices: found by difftest); a 1-d host
    bound is another device, refused with CUDA's error."""
    from torch_bridge import fastpath

    before = fastpath.enabled()
    fastpath.set_enabled(fast)
    try:
        torch.manual_seed(0)
        for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            x = (torch.randn(3, 4) * 4).to(dt)
            for bdt in (torch.float32, torch.int64, torch.float16):
                lo, hi = torch.tensor(-1.5).to(bdt), torch.tensor(2.5).to(bdt)
                calls = {
                    "clamp": lambda t: torch.clamp(t, lo, hi), "clamp_min": lambda t: torch.clamp(t, min=lo),
                    "clamp_max": lambda t: torch.clamp_max(t, hi), "clamp_min_t": lambda t: torch.clamp_min(t, lo),
                    "clamp_": lambda t: t.clone().clamp_(lo, hi), "clamp_max_": lambda t: t.clone().clamp_max_(hi),
                    "out": lambda t: torch.clamp(t, lo, hi, out=torch.empty(0, dtype=t.dtype, device=t.device))}
                for name, call in calls.items():
                    for _ in range(2):  # (the fast path learns a signature's cost, then serves it)
                        try:
                            want = call(x)
                        except RuntimeError as e:  # CPU refuses (an int out= for a float bound): so does neuron
                            with pytest.raises(RuntimeError, match=re.escape(str(e).splitlines()[0])):
                                call(x.to("neuron"))
                            continue
                        got = call(x.to("neuron"))
                        assert got.device.type == "neuron" and got.dtype == want.dtype, (name, dt, bdt)
                        assert torch.equal(got.cpu(), want), (name, dt, bdt)
        with pytest.raises(RuntimeError, match=MSG.format("cpu", N0)):
            torch.clamp(torch.ones(3, device="neuron"), torch.tensor([0.5]))
    finally:
        fastpath.set_enabled(before)


def test_shape_errors_are_cpus():
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(4x4 and 3x3\)$"):
        torch.mm(torch.ones(4, 4, device="neuron"), torch.ones(3, 3, device="neuron"))
    with pytest.raises(RuntimeError, match=r"Expected size for first two dimensions of batch2 tensor"):
        torch.bmm(torch.ones(2, 4, 4, device="neuron"), torch.ones(2, 3, 3, device="neuron"))


def test_copies_between_devices_happen_and_are_charged():
    a = torch.arange(64.0, device="neuron:0")
    with torch.neuron.report_scope() as scope:
        b = a.to("neuron:1")
        c = torch.arange(64.0).to("neuron:1")
    assert b.device == N1 and torch.equal(b.cpu(), c.cpu())
    assert sum(r.calls for r in scope.report.rows if r.op == "_copy_from") == 2
