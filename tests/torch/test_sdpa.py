"""F.scaled_dot_product_attention on neuron runs as one op (forward and backward), values and
gradients matching CPU, charged as the library flash-attention kernel; calls the kernel cannot
take fall back to the math path."""

from __future__ import annotations

import pytest
import torch
from torch_bridge.values import host_seed
import torch.nn.functional as F

B, H, S, D = 2, 4, 16, 8


def _qkv(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _both(qkv: list[torch.Tensor], **kw: object) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor,
                                                          list[torch.Tensor]]:
    """Output and q/k/v gradients on CPU and on neuron for the same inputs and output gradient."""
    cpu = [t.clone().requires_grad_() for t in qkv]
    dev = [t.to("neuron").requires_grad_() for t in qkv]
    on = {n: (x.to("neuron") if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out_c = F.scaled_dot_product_attention(*cpu, **kw)
    out_d = F.scaled_dot_product_attention(*dev, **on)
    g = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(9))
    grads_c = torch.autograd.grad(out_c, cpu, g)
    grads_d = torch.autograd.grad(out_d, dev, g.to("neuron"))
    return out_c, list(grads_c), out_d, list(grads_d)


def _check(qkv: list[torch.Tensor], tol: float = 1e-5, **kw: object) -> torch.Tensor:
    out_c, gc, out_d, gd = _both(qkv, **kw)
    assert out_d.device.type == "neuron"
    torch.testing.assert_close(out_d.cpu(), out_c, rtol=tol, atol=tol)
    for name, a, b in zip("qkv", gd, gc):
        assert a.device.type == "neuron" and a.shape == b.shape, name
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol, msg=f"grad {name}")
    return out_d


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3}, {"is_causal": True, "scale": 1.7}],
                         ids=["plain", "causal", "scale", "causal-scale"])
def test_values_and_gradients_match_cpu(kw):
    out = _check(_qkv((B, H, S, D), (B, H, S, D), (B, H, S, D)), **kw)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"  # our one op, not the math decomposition


def test_three_dim_inputs():
    _check(_qkv((H, S, D), (H, S, D), (H, S, D)), is_causal=True)


@pytest.mark.parametrize("mask_shape", [(S, S), (B, 1, S, S), (B, H, S, S)])
def test_bool_mask_broadcast(mask_shape):
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # every query row sees a key
    _check(_qkv((B, H, S, D), (B, H, S, D), (B, H, S, D)), attn_mask=mask)


def test_float_mask():
    mask = torch.randn(B, 1, 1, S, generator=torch.Generator().manual_seed(4))
    mask[..., 3] = float("-inf")
    _check(_qkv((B, H, S, D), (B, H, S, D), (B, H, S, D)), attn_mask=mask)


def test_fully_masked_row_gives_zeros_like_cpu():
    mask = torch.ones(S, S, dtype=torch.bool)
    mask[2] = False
    out = _check(_qkv((1, 2, S, D), (1, 2, S, D), (1, 2, S, D)), attn_mask=mask)
    assert not out[..., 2, :].cpu().any()  # CPU's fused kernel writes zeros for a row that sees no key


def test_gqa_repeats_key_value_heads():
    out = _check(_qkv((B, H, S, D), (B, 2, S, D), (B, 2, S, D)), is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"


def test_bf16_autocast_matches_cpu_autocast():
    q, k, v = _qkv((B, H, S, D), (B, H, S, D), (B, H, S, D))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dev = [t.to("neuron").requires_grad_() for t in (q, k, v)]
    with torch.autocast("neuron", dtype=torch.bfloat16):
        got = F.scaled_dot_product_attention(*dev, is_causal=True)
    assert got.dtype == torch.bfloat16 and type(got.grad_fn).__name__ == "_AttentionBackward"
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 and t.grad.device.type == "neuron" for t in dev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    qkv = [t.to(dtype) for t in _qkv((B, H, S, D), (B, H, S, D), (B, H, S, D))]
    _check(qkv, tol=2e-2, is_causal=True)


def test_dropout_falls_back_to_the_math_path():
    qkv = _qkv((B, H, S, D), (B, H, S, D), (B, H, S, D))
    dev = [t.to("neuron").requires_grad_() for t in qkv]
    torch.neuron.manual_seed(5)
    out = F.scaled_dot_product_attention(*dev, dropout_p=0.5)
    assert type(out.grad_fn).__name__ != "_AttentionBackward"
    # the math path's one dropout draw comes from the neuron generator: a host generator seeded
    # from its state draws the same mask
    torch.manual_seed(host_seed(5, 0))
    want = torch.ops.aten._scaled_dot_product_attention_math(*qkv, None, 0.5)[0]
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert dev[0].grad is not None


def test_head_dim_over_128_falls_back():
    _check(_qkv((1, 1, 8, 160), (1, 1, 8, 160), (1, 1, 8, 160)), tol=1e-4, is_causal=True)


def test_mask_with_causal_is_an_error():
    q = torch.randn(1, 1, 4, 8, device="neuron")
    with pytest.raises(RuntimeError, match="attn_mask should not be set"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool, device="neuron"),
                                       is_causal=True)


def test_report_shows_one_attention_kernel_per_call():
    qkv = [t.to("neuron").requires_grad_() for t in _qkv((B, H, S, D), (B, H, S, D), (B, H, S, D))]
    with torch.neuron.report_scope() as scope:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        out.sum().backward()
    rep = scope.report
    fwd = [r for r in rep.rows if r.op == "scaled_dot_product_attention"]
    assert [(r.kernel, r.calls, r.generic) for r in fwd] == [("attention", 1, False)]
    bwd = {r.kernel: r.calls for r in rep.rows if r.op == "scaled_dot_product_attention_backward"}
    # its four matmuls: the packed kernel for small heads (lowering.PACKED_MAX_OUTPUT), bmm otherwise
    assert bwd.pop("generic:softmax_bwd") == 1 and sum(bwd.values()) == 4 and set(bwd) <= {"bmm", "bmm_packed"}
    ops = {r.op for r in rep.rows}
    assert not ops & {"bmm", "_softmax", "_softmax_backward_data", "masked_fill", "where"}  # no math-path ops


def test_mask_adds_a_generic_mask_read():
    q = torch.randn(B, H, S, D, device="neuron")
    mask = torch.ones(S, S, dtype=torch.bool, device="neuron")
    with torch.neuron.report_scope() as scope:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    kernels = {r.kernel for r in scope.report.rows if r.op == "scaled_dot_product_attention"}
    assert kernels == {"attention", "generic:attn_mask"}


def test_inference_mode_uses_the_fused_op():
    q = torch.randn(B, H, S, D, device="neuron")
    with torch.inference_mode(), torch.neuron.report_scope() as scope:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert any(r.op == "scaled_dot_product_attention" and r.kernel == "attention" for r in scope.report.rows)


def test_torch_compile_traces_through_the_math_path():
    """Fake tensors have no memory for the fused op to compute on: tracing takes the math path."""
    q, k, v = (t.to("neuron").requires_grad_() for t in _qkv((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)))

    def loss(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
    got = torch.compile(loss, backend="aot_eager")(q, k, v)
    got.backward()
    torch.testing.assert_close(got.cpu(), loss(q, k, v).cpu(), rtol=1e-5, atol=1e-5)
    assert q.grad is not None and q.grad.device.type == "neuron"
