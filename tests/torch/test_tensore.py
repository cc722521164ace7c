"""TensorE ops take their values from trnsim's native datapath: fp32 PSUM accumulation in 128-row
chunks, one RNE rounding to the output dtype."""

import ml_dtypes
import numpy as np
import pytest
import torch

from trnsim.native import reference


def _ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The numpy definition of the datapath on the same operands, rounded like PSUM copy-out."""
    an = a.float().numpy().astype(ml_dtypes.bfloat16) if a.dtype == torch.bfloat16 else a.numpy()
    bn = b.float().numpy().astype(ml_dtypes.bfloat16) if b.dtype == torch.bfloat16 else b.numpy()
    return torch.from_numpy(reference.matmul(np.ascontiguousarray(an.T), bn, k_chunk=128)).to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mm_is_bit_exact_to_the_datapath_definition(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(33, 300, generator=g).to(dtype)
    b = torch.randn(300, 17, generator=g).to(dtype)
    got = (a.to("neuron") @ b.to("neuron")).cpu()
    assert torch.equal(got, _ref(a, b))


def test_bf16_mm_differs_from_cpu_bf16_kernel_but_is_close():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 1024, generator=g).bfloat16()
    b = torch.randn(1024, 64, generator=g).bfloat16()
    got = (a.to("neuron") @ b.to("neuron")).cpu()
    torch.testing.assert_close(got.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)


def test_linear_addmm_bmm_baddbmm_and_transposed_operands():
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(24, 10)
    x = torch.randn(5, 24, generator=g)
    torch.testing.assert_close(lin.to("neuron")(x.to("neuron")).cpu(), lin.cpu()(x), rtol=1e-5, atol=1e-5)
    a, b, c = torch.randn(3, 7, 9, generator=g), torch.randn(3, 9, 4, generator=g), torch.randn(3, 7, 4, generator=g)
    na, nb, nc = a.to("neuron"), b.to("neuron"), c.to("neuron")
    torch.testing.assert_close(torch.bmm(na, nb).cpu(), torch.bmm(a, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.baddbmm(nc, na, nb, beta=0.5, alpha=2).cpu(),
                               torch.baddbmm(c, a, b, beta=0.5, alpha=2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((na.transpose(1, 2).transpose(1, 2)[0].t().t() @ nb[1]).cpu(), a[0] @ b[1])


def test_non_datapath_dtypes_use_the_cpu_kernel():
    a = torch.randint(-5, 5, (4, 6))
    assert torch.equal((a.to("neuron") @ a.t().to("neuron")).cpu(), a @ a.t())
    d = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal((d.to("neuron") @ d.t().to("neuron")).cpu(), d @ d.t())


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_is_the_datapath_matmul_of_its_patches(groups):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 7, generator=g).bfloat16()
    w = torch.randn(6, 4 // groups, 3, 3, generator=g).bfloat16()
    got = torch.nn.functional.conv2d(x.to("neuron"), w.to("neuron"), padding=1, groups=groups).cpu()
    cols = torch.nn.functional.unfold(x, 3, padding=1)  # [N, C*9, L]
    ck, kg = (4 // groups) * 9, 6 // groups
    for gi in range(groups):
        patches = cols[:, gi * ck:(gi + 1) * ck].permute(1, 0, 2).reshape(ck, -1)
        want = _ref(w[gi * kg:(gi + 1) * kg].reshape(kg, ck), patches).view(kg, 2, -1).permute(1, 0, 2)
        assert torch.equal(got[:, gi * kg:(gi + 1) * kg].reshape(2, kg, -1), want)


def test_empty_matmuls_cost_only_the_launch():
    a = torch.ones(0, 5, device="neuron")
    with torch.neuron.report_scope() as scope:
        out = a @ torch.ones(5, 3, device="neuron")
        z = torch.ones(4, 0, device="neuron") @ torch.ones(0, 2, device="neuron")
    assert out.shape == (0, 3) and z.cpu().tolist() == [[0.0, 0.0]] * 4
    assert scope.report.row("mm").kernel == "empty matmul (launch only)"
