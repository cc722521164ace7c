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


def test_issue_repro_bool_mask_masks_when_queries_and_keys_differ_in_length():
    """A boolean mask with L != S (every decode step with a padding mask) masks the False keys;
    it was added as 0/1 floats: softmax([1, 0]) = [0.731, 0.269] instead of CPU's [1, 0]."""
    q, k = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 2, 2)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    m = torch.tensor([[True, False]])
    got = F.scaled_dot_product_attention(q.to("neuron"), k.to("neuron"), v.to("neuron"), attn_mask=m.to("neuron"))
    assert got.cpu().tolist() == [[[[1.0, 0.0]]]]


def _mask(kind: str, l: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "bool":
        m = torch.rand(l, s, generator=g) > 0.4
        m[:, 0] = True
    elif kind == "bool-dead":  # a query row that sees no key: zeros, as CPU's fused kernel writes
        m = torch.rand(l, s, generator=g) > 0.4
        m[0] = False
    elif kind == "bool-keypad":  # a padding mask over keys, broadcast over heads and queries
        m = torch.ones(B, 1, 1, s, dtype=torch.bool)
        m[0, ..., :2] = False
    elif kind == "float":
        m = torch.randn(l, s, generator=g).to(dtype)
    else:  # "float-dead"
        m = torch.randn(l, s, generator=g).to(dtype)
        m[-1] = float("-inf")
    return m


LENGTHS = [(1, 6), (3, 6), (6, 3), (5, 5)]
MASKS = ["bool", "bool-dead", "bool-keypad", "float", "float-dead"]


@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"L{l}-S{s}" for l, s in LENGTHS])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["", "causal"])
def test_masks_of_each_kind_match_cpu(lengths, kind, is_causal):
    """Boolean and float masks, with L != S (the math path) and L == S (the fused op), with and
    without is_causal (CPU's fused kernel applies both), forward and backward."""
    l, s = lengths
    _check(_qkv((B, H, l, D), (B, H, s, D), (B, H, s, D)), attn_mask=_mask(kind, l, s, torch.float32),
           is_causal=is_causal)


@pytest.mark.parametrize("kind", ["bool", "bool-dead", "float"])
@pytest.mark.parametrize("lengths", [(2, 7), (7, 7)], ids=["L2-S7", "L7-S7"])
def test_masks_with_gqa_match_cpu(kind, lengths):
    l, s = lengths
    _check(_qkv((B, H, l, D), (B, 2, s, D), (B, 2, s, D)), attn_mask=_mask(kind, l, s, torch.float32),
           is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("kind", ["bool", "bool-dead", "float"])
def test_masks_with_three_dim_inputs_match_cpu(kind):
    _check(_qkv((H, 3, D), (H, 6, D), (H, 6, D)), attn_mask=_mask(kind, 3, 6, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [(1, 6), (6, 6)], ids=["L1-S6", "L6-S6"])
@pytest.mark.parametrize("kind", ["bool", "bool-dead", "float"])
def test_masks_in_low_precision_match_cpu(dtype, lengths, kind):
    l, s = lengths
    qkv = [t.to(dtype) for t in _qkv((B, H, l, D), (B, H, s, D), (B, H, s, D))]
    _check(qkv, tol=2e-2, attn_mask=_mask(kind, l, s, dtype), is_causal=True)


def test_mask_with_causal_is_refused_where_cpu_refuses_it():
    """CPU takes attn_mask with is_causal only in its fused kernel (4-D inputs, ...): 3-D inputs
    go to its math path, which refuses the pair; neuron refuses the same calls."""
    q = torch.randn(2, 4, 8)
    m = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="attn_mask should not be set") as cpu:
        F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=True)
    qn = q.to("neuron")
    with pytest.raises(RuntimeError) as dev:
        F.scaled_dot_product_attention(qn, qn, qn, attn_mask=m.to("neuron"), is_causal=True)
    assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float64])
def test_mask_dtype_cpu_refuses_is_refused(mask_dtype):
    q = torch.randn(1, 2, 4, 8)
    m = torch.zeros(4, 4, dtype=mask_dtype)
    with pytest.raises(RuntimeError) as cpu:
        F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    qn = q.to("neuron")
    with pytest.raises(RuntimeError) as dev:
        F.scaled_dot_product_attention(qn, qn, qn, attn_mask=m.to("neuron"))
    assert str(dev.value) == str(cpu.value)


def test_masks_with_the_fast_path_off_match_cpu():
    from torch_bridge import fastpath

    was = fastpath.enabled()
    fastpath.set_enabled(False)
    try:
        for l, s in [(1, 6), (6, 6)]:
            _check(_qkv((B, H, l, D), (B, 2, s, D), (B, 2, s, D)), attn_mask=_mask("bool-dead", l, s, torch.float32),
                   is_causal=True, enable_gqa=True)
    finally:
        fastpath.set_enabled(was)


@pytest.mark.parametrize("lengths", [(1, 6), (6, 6)], ids=["L1-S6", "L6-S6"])
@pytest.mark.parametrize("kind", ["bool", "bool-dead", "float"])
def test_masks_compiled_match_cpu(lengths, kind):
    """torch.compile(backend="neuron"): the attention op (L == S) and the math path (L != S)."""
    l, s = lengths
    q, k, v = _qkv((B, H, l, D), (B, 2, s, D), (B, 2, s, D))
    m = _mask(kind, l, s, torch.float32)

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True)
    want = attend(q, k, v, m)
    dev = [t.to("neuron").requires_grad_() for t in (q, k, v)]
    got = torch.compile(attend, backend="neuron", fullgraph=True)(*dev, m.to("neuron"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    attend(*cpu, m).sum().backward()
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-5)


def _nonfinite(l: int, s: int) -> list[torch.Tensor]:
    q, k, v = _qkv((1, 2, l, 16), (1, 2, s, 16), (1, 2, s, 16), seed=5)
    q[0, 0, 2, 3], k[0, 1, 4, 1] = float("inf"), float("nan")
    return [q, k, v]


def _same_nans(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.isnan(), b.isnan())
    torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_compiled_attention_over_non_finite_inputs_has_cpus_gradients():
    """The compiled graph's attention op (L == S): a forward whose values were CPU's kernel's
    (inputs not finite) has CPU's kernel's backward too, as eager's has (e2a8310); it took the
    datapath's backward from P (dV: 256 NaNs where CPU's has 176)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qkv = _nonfinite(8, 8)
    cpu = [t.clone().requires_grad_() for t in qkv]
    dev = [t.to("neuron").requires_grad_() for t in qkv]
    g = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(1))
    want, got = attend(*cpu), torch.compile(attend, backend="neuron", fullgraph=True)(*dev)
    want.backward(g)
    got.backward(g.to("neuron"))
    _same_nans(got.detach().cpu(), want.detach())
    for a, b in zip(dev, cpu):
        _same_nans(a.grad.cpu(), b.grad)


def test_a_dynamic_shape_graph_gives_cpus_flash_values_and_refuses_their_gradients():
    """A graph traced with symbolic sizes (the second length of a compiled function) could not
    tell at trace time whether CPU computes the call with its flash kernel, so its non-finite
    inputs got the math path's values (112 NaNs where CPU's flash kernel has 48): that is now
    decided when the graph runs. With gradients the traced op-by-op backward cannot give CPU's
    kernel's, so the call is refused in one line."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    fn = torch.compile(attend, backend="neuron", fullgraph=True)
    for l, s in [(8, 8), (6, 10), (5, 12)]:  # the second and third run one dynamic-shape graph
        qkv = _nonfinite(l, s)
        _same_nans(fn(*[t.to("neuron") for t in qkv]).cpu(), attend(*qkv))
    fn = torch.compile(attend, backend="neuron", fullgraph=True)
    fn(*[t.to("neuron").requires_grad_() for t in _qkv((1, 2, 6, 16), (1, 2, 10, 16), (1, 2, 10, 16))])  # finite: fine
    with pytest.raises(NotImplementedError, match="compiled graph with gradients, over inputs that are not finite"):
        fn(*[t.to("neuron").requires_grad_() for t in _nonfinite(6, 10)])


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


@pytest.mark.parametrize("keys", [S, S // 2], ids=["fused", "math-path"])
def test_a_permuted_query_gives_cpus_output_layout(keys):
    """Found by difftest's long run (scaled_dot_product_attention 15959956452718): CPU's flash
    kernel writes into empty_like(query), so Hugging Face's query, view(B, L, H, E).transpose(1, 2),
    gets an output of that layout (strides (L*H*E, E, H*E, 1)); it was contiguous here, on the
    fused op and the math path alike. Values and gradients still CPU's; timing-only the same
    layout; a contiguous query keeps a contiguous output."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(B, H, keys, D, generator=g), torch.randn(B, H, keys, D, generator=g)
    mask = torch.rand(S, keys, generator=g) > 0.3
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q, k, v, m)
        assert want.stride() == (S * H * D, D, H * D, 1)
        qd = q.transpose(1, 2).to("neuron").transpose(1, 2).requires_grad_()
        got = F.scaled_dot_product_attention(qd, k.to("neuron"), v.to("neuron"), None if m is None else m.to("neuron"))
        assert got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        qc = q.clone().requires_grad_()
        gy = torch.randn(want.shape, generator=g)
        (gq,) = torch.autograd.grad(F.scaled_dot_product_attention(qc, k, v, m), qc, gy)
        (gqd,) = torch.autograd.grad(got, qd, gy.to("neuron"))
        torch.testing.assert_close(gqd.cpu(), gq, rtol=1e-5, atol=1e-5)
        with torch.neuron.timing_only() as run:
            qf = torch.empty(B, S, H, D, device="neuron").transpose(1, 2)
            out = F.scaled_dot_product_attention(qf, torch.empty(B, H, keys, D, device="neuron"),
                                                 torch.empty(B, H, keys, D, device="neuron"))
            assert out.stride() == want.stride()
            del qf, out
            run.sweep()  # (nothing of this run stays counted in the device's HBM)
    contiguous = F.scaled_dot_product_attention(*(t.to("neuron") for t in (q.contiguous(), k, v)))
    assert contiguous.is_contiguous()


@pytest.mark.parametrize("l,s", [(7, 7), (64, 64), (5, 9), (9, 5)])
def test_the_causal_write_over_finite_scores_is_the_masked_fill_bit_for_bit(l, s):
    """Finite scores take the flash causal write as an addition (-0.0 on and below the diagonal,
    -inf above): the same bits as masked_fill_, signed zeros and huge values included."""
    from torch_bridge.ops.attention import masked_scores
    g = torch.Generator().manual_seed(l * 100 + s)
    raw = torch.randn(2, 3, l, s, generator=g) * torch.tensor([1e-30, 1.0, 1e30])[torch.randint(0, 3, (2, 3, l, s),
                                                                                            generator=g)]
    raw[0, 0].view(-1)[::3] = 0.0
    raw[0, 1].view(-1)[::2] = -0.0
    for sc in (0.125, 1.0):
        want = masked_scores(raw.clone(), None, True, sc, True)
        got = masked_scores(raw.clone(), None, True, sc, True, finite=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups,l,s", [(2, 1, 24), (4, 3, 40), (2, 16, 16), (3, 7, 130), (1, 5, 5)])
def test_gqa_forward_reads_each_kv_head_once_with_the_repeated_heads_values(dtype, groups, l, s):
    """The forward's GQA matmuls take a K/V head's query heads as the rows of one datapath call
    (no K and V repeated per query head): the same scores, P and output, bit for bit, as with
    K and V repeated, for decode steps, prefills, odd head groups and a permuted query."""
    from torch_bridge.eager import memory, tensore
    from torch_bridge.ops.attention import _flat, _heads, forward_values, masked_scores

    g = torch.Generator().manual_seed(groups * 1000 + l * 10 + s)
    hk, e = 2, 32
    q = torch.randn(2, l, hk * groups, e, generator=g).to(dtype).transpose(1, 2)  # Hugging Face's permuted query
    k, v = (torch.randn(2, hk, s, e, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(2, 1, l, s, generator=g) > 0.2
    for m, causal in ((None, False), (mask, False), (None, l <= s)):
        dq, dk, dv = (t.to("neuron") for t in (q, k, v))
        dm = None if m is None else m.to("neuron")
        out, p, sc, exact = forward_values(dq, dk, dv, dm, causal, None, groups)
        assert exact
        # the repeated-heads computation, as the forward ran it before
        cq, ck, cv = q, _heads(k, groups), _heads(v, groups)
        scores = tensore.bmm_f32(_flat(cq), _flat(ck).transpose(1, 2)).view(q.shape[:-1] + (s,))
        scores = masked_scores(scores, m, causal, sc, True, finite=True)
        want_p = torch.softmax(scores, -1)
        if m is not None or causal:
            dead = scores.amax(-1, keepdim=True) == float("-inf")
            want_p.masked_fill_(dead, 0.0)
        want = tensore.bmm_f32(_flat(want_p.to(dtype)), _flat(cv)).view(q.shape).to(dtype)
        assert torch.equal(memory.cpu_view(p) if p.device.type == "neuron" else p, want_p)
        assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))


# ---- decode steps: the token-generation kernel --------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("active,keys,mask,causal", [(1, 300, None, False), (3, 40, "bool", False),
                                                       (1, 129, "float", False), (2, 40, None, True)],
                         ids=["one", "three-bool-mask", "float-mask", "causal"])
def test_a_decode_step_is_one_attention_tkg_launch_with_cpus_values_and_gradients(dtype, active, keys, mask, causal):
    """A few queries over a longer KV cache (Hugging Face's generate()) in bf16/fp16 run as the
    fused op, charged as the library's attention_tkg (NxD Inference's decode attention), its
    cache read in whole 128-key tiles; values and gradients as CPU's."""
    g = torch.Generator().manual_seed(active * 1000 + keys)
    qkv = [t.to(dtype) for t in _qkv((2, 8, active, 16), (2, 2, keys, 16), (2, 2, keys, 16), seed=keys)]
    kw: dict[str, object] = {"is_causal": causal, "enable_gqa": True}
    if mask == "bool":
        m = torch.rand(2, 1, active, keys, generator=g) > 0.3
        m[..., 0] = True
        kw["attn_mask"] = m
    elif mask == "float":
        kw["attn_mask"] = torch.randn(2, 1, active, keys, generator=g).to(dtype)
    with torch.neuron.report_scope() as scope:
        out = _check(qkv, tol=2e-2, **kw)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
    fwd = [(r.kernel, r.calls) for r in scope.report.rows if r.op == "scaled_dot_product_attention"]
    assert fwd[0] == ("attention_tkg", 1) and fwd[1:] == ([("generic:attn_mask", 1)] if mask else [])
    assert not {r.op for r in scope.report.rows} & {"bmm", "_softmax", "_safe_softmax", "repeat_interleave"}


def test_the_decode_kernel_reads_the_cache_in_whole_tiles():
    from torch_bridge.eager import lowering
    q = torch.empty(4, 8, 1, 64, dtype=torch.bfloat16, device="meta")
    for keys, prior in ((2, 128), (129, 128), (130, 256), (300, 384)):
        (spec,) = lowering.attention_specs(q, None, False, None, kv=(2, keys))
        assert (spec.kernel, spec.shape) == ("attention_tkg", (4, 8, 2, 1, prior, 64))
    assert lowering.attention_specs(q, None, False, None, kv=(8, 1))[0].kernel == "attention"  # as many keys


@pytest.mark.parametrize("dtype,active", [(torch.float32, 1), (torch.bfloat16, 9)], ids=["fp32", "nine-active"])
def test_decode_steps_the_kernel_does_not_take_run_op_by_op(dtype, active):
    """attention_tkg takes bf16/fp16 and up to 8 active queries: other decode steps run as the ops
    of CPU's flash arithmetic, as before, with CPU's values."""
    qkv = [t.to(dtype) for t in _qkv((1, 4, active, 16), (1, 2, 40, 16), (1, 2, 40, 16))]
    with torch.neuron.report_scope() as scope:
        out_c, _, out_d, _ = _both(qkv, enable_gqa=True)
    torch.testing.assert_close(out_d.cpu(), out_c, rtol=2e-2, atol=2e-2)
    assert "attention_tkg" not in {r.kernel for r in scope.report.rows}
    assert "bmm" in {r.op for r in scope.report.rows}


def test_a_call_without_gradients_skips_autograd_but_counts_p_while_it_runs():
    """With nothing to differentiate (no_grad, or no input requiring grad) the fused forward runs
    without autograd's Function: the same output, launches and ticks as when it records a backward,
    and P [.., L, S] fp32 counted on the device while the call runs, then let go, as when the
    Function's context is dropped on return (cumulative figures: unaffected by other tensors'
    frees)."""
    qkv = [t.to(torch.bfloat16) for t in _qkv((2, 8, 1, 16), (2, 2, 40, 16), (2, 2, 40, 16), seed=7)]
    dev = [t.to("neuron") for t in qkv]
    F.scaled_dot_product_attention(*dev, enable_gqa=True)  # cost the signature first
    torch.neuron.synchronize()
    before = torch.neuron.memory_stats()
    with torch.no_grad(), torch.neuron.report_scope() as scope:
        out = F.scaled_dot_product_attention(*dev, enable_gqa=True)
        torch.neuron.synchronize()
    after = torch.neuron.memory_stats()
    assert out.grad_fn is None
    p_bytes = 2 * 8 * 1 * 40 * 4
    made = after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"]
    freed = after["allocated_bytes.all.freed"] - before["allocated_bytes.all.freed"]
    assert made == out.untyped_storage().nbytes() + p_bytes and freed >= p_bytes
    grads = [t.detach().requires_grad_() for t in dev]
    with torch.neuron.report_scope() as recorded:
        out_grad = F.scaled_dot_product_attention(*grads, enable_gqa=True)
        torch.neuron.synchronize()
    assert type(out_grad.grad_fn).__name__ == "_AttentionBackward"
    assert torch.equal(out.cpu().view(torch.int16), out_grad.detach().cpu().view(torch.int16))
    assert scope.report.rows == recorded.report.rows
    assert scope.report.device_us == recorded.report.device_us


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_forward_mode_ad_through_the_fused_op_is_refused_not_dropped(grad):
    """Dual inputs (forward-mode AD) take the Function, which has no jvp and says so: the call
    without autograd's machinery (no input requiring grad) must not drop their tangents."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (t.to(torch.bfloat16).to("neuron") for t in _qkv((1, 4, 1, 16), (1, 2, 20, 16), (1, 2, 20, 16)))
    with fwAD.dual_level(), (torch.enable_grad() if grad else torch.no_grad()):
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            F.scaled_dot_product_attention(dual, k, v, enable_gqa=True)


# ---- a long generation: one check, one price per cache bucket ----------------------------------
def _decode_cases() -> list[tuple[str, dict[str, object]]]:
    """Decode-shaped calls (no mask, more keys than queries), CPU taking or refusing them: each
    a name and what :func:`_decode_call` makes it of."""
    cases = []
    for dtype, kdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.bfloat16, torch.float32)):
        for hq, hk, gqa in ((4, 2, True), (4, 2, False), (4, 4, False), (6, 4, True), (4, 1, True)):
            for l in (1, 3, 8):
                for e, ek in ((16, 16), (16, 8), (160, 160)):
                    for causal, scale, p in ((False, None, 0.0), (True, 0.3, 0.0), (False, None, 0.1)):
                        for dims in ((4, 3, 2) if (hq, hk) == (4, 4) else (4, 3)):  # (2-d: heads do not apply)
                            cases.append((f"{dtype}/{kdtype} h{hq}/{hk} gqa={gqa} l{l} e{e}/{ek} causal={causal} "
                                          f"scale={scale} p={p} {dims}d",
                                          dict(dtype=dtype, kdtype=kdtype, hq=hq, hk=hk, gqa=gqa, l=l, e=e, ek=ek,
                                               causal=causal, scale=scale, p=p, dims=dims)))
    return cases


def _decode_call(c: dict, s: int, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    lead = (2, c["hq"]) if c["dims"] == 4 else (2 * c["hq"],) if c["dims"] == 3 else ()
    klead = (2, c["hk"]) if c["dims"] == 4 else (2 * c["hk"],) if c["dims"] == 3 else ()
    q = torch.empty(lead + (c["l"], c["e"]), dtype=c["dtype"])
    if transposed:  # Hugging Face's query: [B, L, H, E] viewed as [B, H, L, E] (last dim still unit stride)
        q = torch.empty((2, c["l"], c["hq"], c["e"]), dtype=c["dtype"]).transpose(1, 2)
    k = torch.empty(klead + (s, c["ek"]), dtype=c["kdtype"])
    v = torch.empty(klead + (s, c["ek"]), dtype=c["kdtype"])
    return q, k, v


def test_a_decode_steps_verdict_does_not_depend_on_its_key_count():
    """check() keeps CPU's verdict on a decode step CPU takes (no mask, more keys than queries)
    under its sizes without the key count, so that a generation, one key more each token, runs
    CPU's checks once: whether CPU takes the call, the error type it refuses it with and the
    kernel it picks must then be the same for every key count. Swept over CPU's takes and
    refusals: dtypes mixed or not, GQA heads dividing or not, with and without enable_gqa, head
    dims unequal or over 128, causal, scale, dropout, 3-d and 2-d inputs."""
    from torch_bridge.ops import attention as attn
    differ = []
    for name, c in _decode_cases():
        for transposed in ((False, True) if c["dims"] == 4 else (False,)):  # (a 4-d query's layouts)
            verdicts = {}
            for s in (c["l"] + 1, 129, 513, 1030):  # (one past the queries, past a 128-key tile and CPU's 512-key block)
                q, k, v = _decode_call(c, s, transposed)
                assert attn._decode_sizes(q, k, v, None) is not None, name
                refusal, choice = attn._refusal(q, k, v, None, c["p"], c["causal"], c["scale"], c["gqa"])
                verdicts[s] = (None if refusal is None else refusal[0], choice)
            if len(set(verdicts.values())) != 1:
                differ.append((name, transposed, verdicts))
    assert not differ, differ[:3]


def test_a_decode_step_cpu_refuses_gets_the_message_of_its_own_key_count():
    """A refusal is kept by every size: its message may name the key count (2-d inputs whose
    head dims differ), and each call gets its own, not the first token's."""
    for s in (9, 10):
        q, k = torch.zeros(1, 16), torch.zeros(s, 8)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, k)
        with pytest.raises(RuntimeError, match=rf"\b8\D+{s}\b"):
            F.scaled_dot_product_attention(q.to("neuron"), k.to("neuron"), k.to("neuron"))


def test_calls_the_decode_key_does_not_cover_keep_every_size():
    from torch_bridge.ops import attention as attn
    q, k = torch.empty(1, 4, 1, 16), torch.empty(1, 2, 9, 16)
    for args in ((q, k, torch.empty(1, 2, 8, 16), None),  # values and keys of different counts
                 (q, k, k, torch.ones(1, 1, 1, 9, dtype=torch.bool)),  # a mask
                 (torch.empty(1, 4, 9, 16), k, k, None),  # as many queries as keys
                 (torch.empty(1, 4, 12, 16), k, k, None)):  # more queries than keys
        assert attn._decode_sizes(*args) is None


def test_a_long_generation_checks_once_and_prices_each_cache_bucket_once(monkeypatch):
    """Decode steps over one key more each (a generation's tokens): CPU's checks run once and the
    launch is priced once per 128-key bucket of the cache, not once a token (each took ~1 ms);
    values as CPU's, and each step still one attention_tkg launch of its bucket."""
    from torch_bridge.ops import attention as attn
    refusals = []
    real = attn._refusal
    monkeypatch.setattr(attn, "_refusal", lambda *a: refusals.append(a[1].shape[-2]) or real(*a))
    monkeypatch.setattr(attn, "_checked", {})
    monkeypatch.setattr(attn, "_charges", {})
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, 4, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    cache = torch.randn(2, 1, 2, 300, 16, generator=g).to(torch.bfloat16)
    nq = q.to("neuron")
    with torch.neuron.report_scope() as scope, torch.no_grad():
        for s in range(120, 140):
            k, v = cache[0, :, :, :s], cache[1, :, :, :s]
            out = F.scaled_dot_product_attention(nq, k.to("neuron"), v.to("neuron"), enable_gqa=True)
            torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                       rtol=2e-2, atol=2e-2)
    assert refusals == [120]
    assert sorted(key[2] for key in attn._charges) == [(2, ("cache", 128)), (2, ("cache", 256))]  # keys 120-129, 130-139
    rows = [(r.kernel, r.calls) for r in scope.report.rows if r.op == "scaled_dot_product_attention"]
    assert rows == [("attention_tkg", 20)]


def test_inside_a_torch_func_transform_it_is_refused_in_one_line():
    """Its values are CPU's kernels' on the device memory, which torch.func's wrapped tensors do
    not expose (PyTorch's own error named requires_grad_, or a TensorWrapper's storage)."""
    from torch.func import grad

    from torch_bridge.ops.attention import FUNCTORCH

    q = torch.randn(1, 2, 4, 8, device="neuron")
    with pytest.raises(RuntimeError) as e:
        grad(lambda q: F.scaled_dot_product_attention(q, q, q).sum())(q)
    assert str(e.value) == FUNCTORCH and "\n" not in FUNCTORCH


def test_a_head_dim_of_zero_gives_cpu_s_empty_output():
    """CPU's scale is 1/sqrt(0) (inf) and reads no score; the device's divided by zero."""
    q = torch.randn(1, 2, 4, 0, requires_grad=True)
    want = F.scaled_dot_product_attention(q, q, q)
    qn = q.detach().to("neuron").requires_grad_()
    got = F.scaled_dot_product_attention(qn, qn, qn)
    assert got.shape == want.shape == (1, 2, 4, 0) and got.device.type == "neuron"
    got.sum().backward()
    assert qn.grad.shape == q.shape


def _penalty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """A gradient penalty through attention: the task loss plus the squared query gradient, both
    differentiated (create_graph), as WGAN-GP and R1 penalties do."""
    out = F.scaled_dot_product_attention(q, k, v)
    gq, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    (out.sum() + gq.pow(2).sum()).backward()
    return [gq, q.grad, k.grad, v.grad]


def test_a_gradient_penalty_through_cpus_math_path_has_its_second_order_terms():
    """3-d inputs: CPU runs its math path, whose backward is differentiable. The fused op's
    backward returned gradients without history, so the penalty's second-order terms were dropped
    without an error (q.grad 9.9 off where it is 8.8 at most)."""
    qkv = _qkv((3, 5, 8), (3, 5, 8), (3, 5, 8), seed=4)
    want = _penalty(*[t.clone().requires_grad_() for t in qkv])
    got = _penalty(*[t.to("neuron").requires_grad_() for t in qkv])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("queries", [5, 3], ids=["fused", "op-by-op-cpu-valued"])
def test_a_gradient_penalty_through_cpus_flash_kernel_is_refused_as_on_cpu(queries):
    """4-d inputs: CPU's flash kernel has no double backward and CPU refuses; the device computed
    the penalty's gradients without their second-order terms. Also where the call runs op by op
    with CPU's kernel's values (keys of another length, a non-finite query)."""
    from torch_bridge.ops.attention import FLASH_DOUBLE_BACKWARD

    q, k, v = _qkv((2, 3, queries, 8), (2, 3, 5, 8), (2, 3, 5, 8), seed=5)
    if queries != 5:
        q[0, 0, 0, 0] = float("inf")
    for dev in ("cpu", "neuron"):
        ts = [t.to(dev).requires_grad_() for t in (q, k, v)]
        with pytest.raises(RuntimeError, match=FLASH_DOUBLE_BACKWARD):
            _penalty(*ts)


@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 3, 5, 8)], ids=["math", "flash"])
def test_gradients_batched_by_vmap_are_cpu_s(shape):
    """``is_grads_batched`` and ``jacobian(vectorize=True)`` vmap the backward over output
    gradients without memory of their own: the fused backward raised "Cannot access storage of
    BatchedTensorImpl" where CPU computes them."""
    q, k, v = _qkv(shape, shape, shape, seed=6)
    gs = torch.randn((4,) + shape, generator=torch.Generator().manual_seed(7))
    got = []
    for dev in ("cpu", "neuron"):
        ts = [t.to(dev).requires_grad_() for t in (q, k, v)]
        batched = torch.autograd.grad(F.scaled_dot_product_attention(*ts), ts, gs.to(dev), is_grads_batched=True)
        jac = torch.autograd.functional.jacobian(lambda t: F.scaled_dot_product_attention(t, t, t), q.to(dev),
                                                 vectorize=True)
        got.append([t.cpu() for t in batched] + [jac.cpu()])
    for a, b in zip(got[1], got[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_hessian_of_self_attention_counts_each_use_of_its_input_once():
    """One tensor as query, key and value, differentiated twice (``hessian`` builds a graph): the
    recomputed math path's gradient with respect to that tensor sums all three uses, and returned
    once for each of q, k and v it was summed three times (the Hessian 10.1 off, twice its size)."""
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(8))

    def f(t: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(t, t, t).pow(2).sum()

    want = torch.autograd.functional.hessian(f, x)
    got = torch.autograd.functional.hessian(f, x.to("neuron"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["flash", "flash-non-finite", "math", "flash-bool-mask"])
def test_a_mask_written_in_place_after_the_forward_is_refused_where_cpu_refuses(case):
    """CPU's flash kernel saves its float mask for the backward, so writing the mask in place
    before the backward is refused there; the device's backward from CPU's kernel (inputs not
    finite) read the written mask and gave other gradients without a word. CPU's math path (3-d)
    and a boolean mask (which CPU converts to a copy first) compute, as the device does."""
    shape = (2, 4, 8) if case == "math" else (2, 2, 4, 8)
    q, k, v = _qkv(shape, shape, shape, seed=11)
    if case == "flash-non-finite":
        q[0, 0, 0, 0] = 1e30
    g = torch.Generator().manual_seed(12)
    mask = torch.rand(4, 4, generator=g) > 0.3 if case == "flash-bool-mask" else torch.randn(4, 4, generator=g)
    mask[:, 0] = True if mask.dtype == torch.bool else mask[:, 0]
    refuses = case in ("flash", "flash-non-finite")
    got = []
    for dev in ("cpu", "neuron"):
        ts = [t.to(dev).requires_grad_() for t in (q, k, v)]
        m = mask.clone().to(dev)
        out = F.scaled_dot_product_attention(*ts, attn_mask=m)
        m.logical_not_() if m.dtype == torch.bool else m.mul_(5)
        if refuses:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.square().sum().backward()
        else:
            got.append([g.cpu() for g in torch.autograd.grad(out.square().sum(), ts)])
    for a, b in zip(*got) if got else ():
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_a_mask_made_in_inference_mode_still_runs_where_cpu_runs_it():
    """An inference tensor has no version counter to keep: CPU's math path (3-d) takes such a mask."""
    with torch.inference_mode():
        mask = torch.randn(4, 4, generator=torch.Generator().manual_seed(13)).to("neuron")
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(14))
    want = torch.autograd.grad(F.scaled_dot_product_attention(*[q.requires_grad_()] * 3, attn_mask=mask.cpu()).sum(), q)
    qn = q.detach().to("neuron").requires_grad_()
    got = torch.autograd.grad(F.scaled_dot_product_attention(qn, qn, qn, attn_mask=mask).sum(), qn)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["decode", "decode-gqa", "bool", "bool-dead", "float", "permuted", "square",
                                  "scale", "big", "nan", "inf-mask"])
def test_the_native_forward_values_are_the_python_paths_bit_for_bit(dtype, case, monkeypatch):
    """forward_values without is_causal runs in one native call (trnsim::sdpa_values) when it
    takes the call: out and P must be the Python path's bits, and the calls it does not take
    (non-finite operands, +inf in a mask) must reach the Python path."""
    from torch_bridge import _native
    from torch_bridge.ops import attention

    g = torch.Generator().manual_seed(11)
    hq, hk, l, s, e = (8, 2, 1, 37, 16) if case == "decode-gqa" else (4, 4, 2, 19, 8) if case != "square" else (4, 4, 9, 9, 8)
    q = torch.randn(2, hq, l, e, generator=g)
    k, v = torch.randn(2, hk, s, e, generator=g), torch.randn(2, hk, s, e, generator=g)
    mask, scale = None, None
    if case in ("bool", "bool-dead"):
        mask = torch.rand(2, 1, l, s, generator=g) > 0.4
        mask[..., 0] = case == "bool"  # "bool-dead": rows that may see no key
        if case == "bool-dead":
            mask[0, 0, 0] = False
    elif case in ("float", "inf-mask"):
        mask = torch.randn(1, hq, l, s, generator=g).to(dtype)
        if case == "inf-mask":
            mask[0, 0, 0, 3] = float("inf")
    elif case == "scale":
        scale = 0.07
    elif case == "big":
        q = q * 1e37  # products that may overflow float32 (inf in float16): CPU's kernel's values
    elif case == "nan":
        k[1, 0, 3, 2] = float("nan")
    dev = [t.to(dtype).to("neuron") for t in (q, k, v)]
    if case == "permuted":  # Hugging Face's view(B, L, H, E).transpose(1, 2)
        dev[0] = dev[0].transpose(1, 2).contiguous().transpose(1, 2)
    m = None if mask is None else mask.to("neuron")
    groups = hq // hk
    native = _native.op("sdpa_values")
    assert native is not None
    taken = bool(native(*dev, m, scale, groups))
    assert taken == (case not in ("big", "nan", "inf-mask"))
    got = attention.forward_values(*dev, m, False, scale, groups, True)
    monkeypatch.setitem(_native._ops, "sdpa_values", None)
    want = attention.forward_values(*dev, m, False, scale, groups, True)
    assert got[2:] == want[2:]
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(_bits(a), _bits(b))
