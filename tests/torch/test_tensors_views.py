"""Tensors on neuron: creation, transfer, real shared storage, views, in-place, out=, dtypes."""

import pytest
import torch


def test_factories_and_transfer_round_trip():
    for t in (torch.zeros(3, device="neuron"), torch.ones(2, 2, device="neuron"), torch.full((2,), 3.5, device="neuron"),
              torch.arange(5, device="neuron"), torch.tensor([1.0, 2.0], device="neuron")):
        assert t.device.type == "neuron"
    x = torch.randn(4, 5)
    assert torch.equal(x.to("neuron").cpu(), x)
    assert torch.equal(x.to("neuron").to("neuron:1").cpu(), x)
    assert x.to("neuron").to(torch.float16).cpu().dtype == torch.float16


def test_storage_is_real_and_shared_by_views():
    a = torch.arange(16.0, device="neuron")
    v = a.view(4, 4)
    assert a.data_ptr() != 0 and v.data_ptr() == a.data_ptr()
    assert v._base is a
    before = a._version
    v[1].fill_(-1)
    v.t()[2:, :2].add_(100)
    assert a._version > before
    want = torch.arange(16.0).view(4, 4)
    want[1] = -1
    want.t()[2:, :2] += 100
    assert torch.equal(v.cpu(), want) and torch.equal(a.cpu(), want.view(16))


def test_item_print_numpy_error():
    t = torch.tensor([2.5], device="neuron")
    assert t.item() == 2.5
    assert "device='neuron:0'" in repr(t)
    with pytest.raises(TypeError, match="Tensor.cpu"):
        t.numpy()


def test_out_and_inplace_and_resize():
    out = torch.empty(0, device="neuron")
    torch.add(torch.ones(3, device="neuron"), 2, out=out)
    assert out.cpu().tolist() == [3.0, 3.0, 3.0]
    r = torch.arange(4.0, device="neuron")
    r.resize_(2, 3)
    assert r.shape == (2, 3) and r.view(-1)[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.float64, torch.complex64])
def test_dtypes_match_cpu(dtype):
    x = (torch.randn(6, 7) * 4).to(dtype)
    ref = (x + x) if dtype != torch.bool else (x | x)
    got = ((x.to("neuron") + x.to("neuron")) if dtype != torch.bool else (x.to("neuron") | x.to("neuron"))).cpu()
    assert torch.equal(got, ref)


def test_conj_copy_does_not_recurse():
    z = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(z.to("neuron").conj().cpu(), z.conj())
    assert torch.equal(torch.fft.fft(z.to("neuron")).cpu(), torch.fft.fft(z))


def test_cpu_scalar_mixes_but_cpu_tensor_does_not():
    a = torch.ones(3, device="neuron")
    assert (a * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)


def test_many_ops_match_cpu():
    x = torch.randn(8, 16)
    n = x.to("neuron")
    checks = {
        "softmax": lambda t: t.softmax(-1), "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (16,)),
        "sort": lambda t: t.sort(-1).values, "cumsum": lambda t: t.cumsum(1), "where": lambda t: torch.where(t > 0, t, -t),
        "gather": lambda t: t.gather(1, torch.zeros(8, 2, dtype=torch.long, device=t.device)),
        "max": lambda t: t.max(dim=0).values, "mean": lambda t: t.mean(), "topk": lambda t: t.topk(3).values,
        "index": lambda t: t[torch.tensor([0, 3], device=t.device)], "cat": lambda t: torch.cat([t, t]),
        "einsum": lambda t: torch.einsum("ij,kj->ik", t, t),
    }
    for name, fn in checks.items():
        torch.testing.assert_close(fn(n).cpu(), fn(x), rtol=1e-5, atol=1e-5, msg=name)


def test_out_of_the_wrong_size_is_resized_like_cpu():
    out = torch.empty(2, device="neuron")
    with pytest.warns(UserWarning, match="resized"):
        r = torch.add(torch.ones(3, device="neuron"), 1, out=out)
    assert r is out and out.cpu().tolist() == [2.0, 2.0, 2.0]


def test_result_over_an_arguments_memory_stays_a_view():
    x = torch.arange(6.0, device="neuron")
    y = torch.ops.aten._unsafe_view(x, [2, 3])  # its schema does not declare the alias
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.add_(1)
    assert y.cpu().view(-1).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_distinct_empty_tensors_are_not_one_tensor():
    # empty tensors share a null memory window; in-place kernels must not see them as overlapping
    a, idx, src = torch.empty(0, device="neuron"), torch.empty(0, dtype=torch.long, device="neuron"), \
        torch.empty(0, device="neuron")
    assert a.put(idx, src).shape == (0,)
    assert torch.take(a, idx).shape == (0,)
