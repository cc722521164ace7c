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


def _native_route(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """matmul_f32/bmm_f32's numpy route (trnsim.native), which the extension's op stands in for."""
    from torch_bridge import _native
    from torch_bridge.eager import tensore
    from trnsim import native

    if a.dim() == 2:
        out = torch.empty(a.shape[0], b.shape[1])
        native.matmul(tensore._np(a.t()), tensore._np(b), out=out.numpy(), k_chunk=tensore._k_chunk())
    else:
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2])
        native.matmul_batched(tensore._np(a.transpose(1, 2)), tensore._np(b), k_chunk=tensore._k_chunk(),
                              out=out.numpy())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_extension_s_datapath_call_is_the_numpy_route_s_bit_for_bit(dtype):
    """tensore.matmul_f32/bmm_f32 (attention's and the MoE op's matmuls) call the datapath through
    the native extension's ``trnsim::datapath_f32``: the same float32 PSUM bits as trnsim.native's
    route for every operand layout, non-finite results included (the caller decides on those)."""
    from torch_bridge import _native
    from torch_bridge.eager import tensore

    torch.ones(1, device="neuron")  # the extension is loaded with the device
    op = _native.op("datapath_f32")
    assert op is not None
    g = torch.Generator().manual_seed(3)
    for batch, m, k, n in ((4, 1, 16, 20), (3, 7, 300, 5), (2, 129, 130, 64), (1, 1, 1, 1)):
        a = (torch.randn(batch, m, k, generator=g) * 4).to(dtype)
        b = torch.randn(batch, k, n, generator=g).to(dtype)
        a[0, 0, 0] = float("inf") if m > 1 else a[0, 0, 0]
        for x in (a, a.transpose(1, 2).contiguous().transpose(1, 2)):
            for y in (b, b.transpose(1, 2).contiguous().transpose(1, 2), b[:, :, :1].expand(batch, k, n)):
                got, want = tensore.bmm_f32(x, y), _native_route(x, y)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))
                got, want = tensore.matmul_f32(x[-1], y[-1]), _native_route(x[-1], y[-1])
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))
                assert got.dtype == torch.float32 and got.is_contiguous()


def test_the_extension_s_datapath_call_declines_what_the_numpy_route_decides(monkeypatch):
    """None (the numpy route computes or raises) for operands it does not take, and under
    TRNSIM_NATIVE=0 (the numpy reference) or a TRNSIM_NATIVE_THREADS Python refuses."""
    from torch_bridge import _native
    from torch_bridge.eager import tensore

    torch.ones(1, device="neuron")
    op = _native.op("datapath_f32")
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert op(a, b) is not None
    for x, y in ((a.double(), b.double()), (a, b.bfloat16()), (a.int(), b.int()), (a[:0], b), (a, b[:3]),
                 (a.to("neuron"), b.to("neuron")), (a[None], b), (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 4, 5))):
        assert op(x, y) is None
    monkeypatch.setenv("TRNSIM_NATIVE", "0")
    assert op(a, b) is None
    monkeypatch.setenv("TRNSIM_NATIVE", "1")
    monkeypatch.setenv("TRNSIM_NATIVE_THREADS", "lots")
    assert op(a, b) is None
    with pytest.raises(Exception, match="TRNSIM_NATIVE_THREADS"):
        tensore.matmul_f32(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_magnitude_scans_as_aminmax_gives_it(dtype):
    """tensore.magnitude (the exactness checks' max |x|) by the extension's one-pass scan of the
    bits: aminmax's value at every length around the vector widths, with an infinity, a NaN,
    signed zeros, subnormals and the format's largest value; a strided tensor takes aminmax."""
    import math

    from torch_bridge import _native
    from torch_bridge import _native
    from torch_bridge.eager import tensore

    torch.zeros(1, device="neuron") + 1  # (the extension loaded)
    assert _native.lib is not None

    def by_aminmax(t):
        lo, hi = (float(x) for x in torch.aminmax(t))
        return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)

    g = torch.Generator().manual_seed(0)
    big = float(torch.finfo(dtype).max)
    for n in (1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4097):
        for special in (None, math.inf, -math.inf, math.nan, -0.0, 1e-41, -big, big):
            t = (torch.randn(n, generator=g) * 100).to(dtype)
            if special is not None:
                t[int(torch.randint(0, n, (1,), generator=g))] = special
            got, want = tensore.magnitude(t), by_aminmax(t)
            assert (math.isnan(got) and math.isnan(want)) or got == want, (n, special, got, want)
    assert tensore.magnitude(torch.full((9,), -0.0, dtype=dtype)) == 0.0
    assert tensore.magnitude(torch.empty(0, dtype=dtype)) == 0.0
    t = torch.randn(6, 5, generator=g).to(dtype).t()
    assert tensore.magnitude(t) == by_aminmax(t)


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "matmul"])
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.float16, torch.bfloat16, torch.float64])
def test_an_out_of_another_dtype_is_refused_as_cpu_refuses_it(op, out_dtype):
    """The out= kernels resized ``out`` and copied the result into it, which casts: an int32 out
    got truncated values where CPU refuses the call (found by a values hunt)."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    calls = {"mm": lambda a, b, out: torch.mm(a, b, out=out),
             "addmm": lambda a, b, out: torch.addmm(torch.ones(3, 5, device=a.device), a, b, out=out),
             "bmm": lambda a, b, out: torch.bmm(a[None], b[None], out=out),
             "baddbmm": lambda a, b, out: torch.baddbmm(torch.ones(1, 3, 5, device=a.device), a[None], b[None], out=out),
             "matmul": lambda a, b, out: torch.matmul(a, b, out=out)}
    shape = (1, 3, 5) if op in ("bmm", "baddbmm") else (3, 5)
    errors = []
    for device in ("cpu", "neuron", "neuron"):  # (the second neuron call: the same signature again)
        out = torch.full(shape, 7, dtype=out_dtype, device=device)
        with pytest.raises(RuntimeError) as e:
            calls[op](a.to(device), b.to(device), out)
        errors.append(str(e.value))
        assert torch.equal(out.cpu(), torch.full(shape, 7, dtype=out_dtype))  # untouched
    assert errors[1] == errors[2] == errors[0] and errors[0].startswith("Expected out tensor to have dtype float")
