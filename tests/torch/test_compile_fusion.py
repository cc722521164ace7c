"""Each fusion pattern becomes one real kernel: compiled from PyTorch code, the region's fused
kernel run with values on the simulated chip matches the ops' own results and its numpy
definition, and it moves fewer HBM bytes (and launches fewer kernels) than its ops run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import torch_bridge.compile as neuron_compile
from torch_bridge.compile.graph import RegionKernel
from trnsim import Chip
from trnsim.kernels import build_spec
from trnsim.kernels.fused import FULL, ROW, COL, reference, resolve

neuron_compile.register()
F = nn.functional


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def _rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


# name -> (function, input shapes, needs grad: check the backward graph's regions too)
PATTERNS = {
    "elementwise chain": (lambda x, b: _gelu_tanh(x + b), [(256, 512), (512,)], False),
    "matmul epilogue": (lambda x, w, b: torch.tanh(F.linear(x, w, b)) * 0.5 + x[:, :1], [(256, 128), (384, 128), (384,)],
                        False),
    "softmax": (lambda x: torch.softmax(x * 0.125, -1), [(256, 384)], False),
    "layer norm + residual": (lambda x, r, w, b: F.layer_norm(x + r, (256,), w, b), [(256, 256)] * 2 + [(256,)] * 2,
                              False),
    "rms norm": (_rmsnorm, [(256, 512), (512,)], False),
    "softmax backward": (lambda x: torch.softmax(x * 0.5, -1) * 2.0, [(256, 384)], True),
    "layer norm backward + weight grads": (lambda x, w, b: F.layer_norm(torch.tanh(x), (256,), w, b),
                                           [(256, 256), (256,), (256,)], True),
    "gelu backward + bias grad": (lambda x, b: F.gelu(x + b), [(256, 512), (512,)], True),
}


def _hbm_array(t: torch.Tensor, kind: str) -> np.ndarray:
    a = t.detach().cpu().float().numpy()
    return a.reshape(-1) if kind in (ROW, COL) else a.reshape(-1, a.shape[-1]) if kind == FULL else a.reshape(1)


def _check_region(rk: RegionKernel, spec, args, outs) -> None:
    prog = resolve(spec.params_dict["program"] if hasattr(spec, "params_dict") else dict(spec.params)["program"],
                   spec.shape[-1])
    params = dict(spec.params)
    kernel = build_spec(spec.kernel, spec.shape, spec.dtype, torch.neuron.config(), params)
    inputs: dict[str, np.ndarray] = {}
    arrays = []
    if spec.kernel == "matmul_fused":
        a, b = args[0].detach().cpu().float().numpy(), args[1].detach().cpu().float().numpy()
        inputs["a" if params["transpose_a"] else "lhsT"] = a if params["transpose_a"] else a.T.copy()
        inputs["b" if params["transpose_b"] else "rhs"] = b.T.copy() if params["transpose_b"] else b
        rest = [args[2:][j] for j in rk.region.kernel_inputs]
        arrays.append((a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32))
        rows, cols = spec.shape[0], spec.shape[2]
    else:
        rest = [args[j] for j in rk.region.kernel_inputs]
        rows, cols = spec.shape
    for i, ((kind, _), t) in enumerate(zip(prog.inputs[len(arrays):], rest), start=len(arrays)):
        inputs[f"in{i}"] = _hbm_array(t, kind)
        arrays.append(inputs[f"in{i}"])
    result = Chip(torch.neuron.config()).run(kernel, inputs)
    want = reference(prog, arrays, rows, cols)
    for j, ((v, _), out) in enumerate(zip(prog.outputs, outs)):
        got = np.asarray(result[f"out{j}"], dtype=np.float64).reshape(-1)
        ops = out.detach().cpu().double().numpy().reshape(-1)
        ref = np.asarray(want[j], dtype=np.float64).reshape(-1)
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{rk.label} out{j} vs numpy")
        np.testing.assert_allclose(got, ops, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{rk.label} out{j} vs the ops")


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_is_one_kernel_with_fewer_bytes(name):
    fn, shapes, grad = PATTERNS[name]
    torch.manual_seed(0)
    args = [torch.randn(s).to("neuron").requires_grad_(grad) for s in shapes]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    RegionKernel.record = []
    try:
        with torch.neuron.report_scope() as scope:
            out = compiled(*args)
            if grad:
                (out * out).sum().backward()
        records = list(RegionKernel.record)
    finally:
        RegionKernel.record = None
    torch.testing.assert_close(out.detach().cpu(), fn(*args).detach().cpu(), rtol=1e-5, atol=1e-6)
    assert records, f"{name}: nothing fused"
    for rk, spec, rargs, routs in records:
        assert spec is not None, f"{rk.label}: the kernel refused the shapes"
        _check_region(rk, spec, rargs, routs)
    rep = scope.report
    for row in rep.regions:
        assert row.hbm_bytes < row.eager_hbm_bytes, row
        assert row.calls < row.eager_launches, row
    if grad:
        assert any("backward" in r.op or "sum" in r.op for r in rep.regions), [r.op for r in rep.regions]


def test_a_matmul_whose_result_feeds_its_consumer_twice_does_not_head_it():
    """CLIP's ``e / e.norm(dim=-1)``: the division's region reads the matmul's result directly and
    through the norm (its own region, then a ``pow`` outside). Made the division's head, the
    matmul would sit in a region that needs the norm, which needs the matmul: the graph failed to
    compile ("compiled regions form a cycle"). It stays a plain matmul; the values are CPU's."""
    def fn(x, w):
        e = x @ w
        return e / e.norm(p=2, dim=-1, keepdim=True)

    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(32, 16, generator=gen)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="neuron")(x.to("neuron"), w.to("neuron")).cpu()
    torch.testing.assert_close(got, fn(x, w), rtol=1e-5, atol=1e-6)
