"""FlexAttention on neuron tensors under the neuron backend: PyTorch's device check lets neuron
through, the compiled forward and backward equal CPU's, and the forward is one launch of the
flash-attention kernel with the score function fused in (causal mask as the kernel's causal mode)."""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import torch_bridge.compile as neuron_compile
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.kernels.fused import FULL, Program

neuron_compile.register()


def _bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.05


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_compiled_flex_attention_matches_cpu_forward_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        want = flex_attention(q, k, v, score_mod=_bias)  # CPU reference (CPU has no flex backward)
    qn, kn, vn = (t.to("neuron").requires_grad_(True) for t in (q, k, v))
    bm = create_block_mask(_causal, 1, 1, 256, 256, device="neuron")
    torch._dynamo.reset()
    f = torch.compile(flex_attention, backend="neuron")
    with torch.neuron.report_scope() as scope:
        out = f(qn, kn, vn, score_mod=_bias)
        out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), want, rtol=1e-4, atol=1e-5)
    # the gradient against autograd through the same math on CPU
    qc, kc, vc = (t.clone().requires_grad_(True) for t in (q, k, v))
    s = qc @ kc.transpose(-1, -2) * 32 ** -0.5
    idx = torch.arange(256)
    s = s + (idx[:, None] - idx[None, :]) * 0.05
    (torch.softmax(s, -1) @ vc).sum().backward()
    for a, b_ in ((qn, qc), (kn, kc), (vn, vc)):
        torch.testing.assert_close(a.grad.cpu(), b_.grad, rtol=1e-3, atol=1e-4)
    rows = {r.op: r for r in scope.report.rows}
    assert rows["flex_attention"].kernel == "attention" and rows["flex_attention"].calls == 1
    assert "flex_attention_backward" in rows
    with torch.neuron.report_scope() as causal:
        f(qn.detach(), kn.detach(), vn.detach(), block_mask=bm)
    assert {r.op: r.kernel for r in causal.report.rows}["flex_attention"] == "attention"


def test_score_function_program_in_the_kernel_matches_numpy():
    # score + (q_idx - kv_idx) * 0.05, as score_program writes it
    prog = Program(((FULL, "fp32"),) * 3, (("tt", "subtract", 1, 2), ("ts", 3, "multiply", 0.05, None, None, False),
                                           ("tt", "add", 0, 4)), ((5, "fp32"),))
    for causal in (False, True):
        out = check_entry(get_kernel("attention"), (1, 2, 200, 64), "fp32", "trn2",
                          {"score_mod": prog, "causal": causal})
        assert out["ok"], out["errors"]


def test_inductor_hard_coded_for_flex_attention_runs_the_neuron_backend():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex_attention(q, k, v, score_mod=_bias)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(flex_attention, backend="inductor")(*(t.to("neuron") for t in (q, k, v)), score_mod=_bias)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    assert [str(w.message) for w in caught if "Inductor" in str(w.message)] == [neuron_compile.INDUCTOR_WARNING]


# ---- score functions reading the head index and captured tensors; block masks -----------------
S = 256
torch.manual_seed(1)
HEAD_BIAS = torch.randn(2)
TABLE = torch.randn(S, S)
_dev = {}


def _captured(name):
    """A captured tensor on neuron (made once: a new tensor per call would recompile)."""
    if name not in _dev:
        _dev[name] = {"head_bias": HEAD_BIAS, "table": TABLE}[name].to("neuron")
    return _dev[name]


def _head_and_table(on):
    bias, table = (HEAD_BIAS, TABLE) if on == "cpu" else (_captured("head_bias"), _captured("table"))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * (h + 1) * 0.5 + bias[h] + table[q_idx, kv_idx]
    return score_mod


def _flex_float64(q, k, v):
    """The same score function's attention in float64 on CPU, written out."""
    s = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    h = torch.arange(q.shape[1], dtype=torch.float64)[None, :, None, None]
    s = s * (h + 1) * 0.5 + HEAD_BIAS.double()[None, :, None, None] + TABLE.double()
    return torch.softmax(s, -1) @ v.double()


def _flex_rows(rep):
    return [(r.op, r.kernel, r.calls) for r in rep.rows if r.op.startswith("flex")]


def test_score_mod_with_the_head_index_and_captured_tensors_is_one_attention_launch():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, S, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex_attention(q, k, v, score_mod=_head_and_table("cpu"))
    torch._dynamo.reset()
    mod = _head_and_table("neuron")
    f = torch.compile(lambda a, b_, c: flex_attention(a, b_, c, score_mod=mod), backend="neuron")
    with warnings.catch_warnings(record=True) as caught, torch.neuron.report_scope() as scope:
        warnings.simplefilter("always")
        got = f(*(t.to("neuron") for t in (q, k, v)))
    # the attention is TensorE work: the PE array adds fp32 products in its own fixed order, CPU's
    # BLAS in an order of its own that differs between CPUs (AVX2 vs AVX-512 machines), so neither is
    # bit-for-bit the other. The tester's rule for the matmul family: no further from the float64
    # result than CPU is, plus fp32's share (1e-5) of the largest magnitude.
    exact = _flex_float64(q, k, v)
    err_dev = (got.cpu().double() - exact).abs().max().item()
    err_cpu = (want.double() - exact).abs().max().item()
    assert err_dev <= err_cpu + 1e-5 * exact.abs().max().item(), (err_dev, err_cpu)
    assert _flex_rows(scope.report) == [("flex_attention", "attention", 1)]  # no extra S x S kernel
    assert not [w for w in caught if "trnsim" in str(w.message)]


def test_a_score_mod_that_cannot_fuse_says_so_in_a_line():
    table = _captured("head_bias")
    torch._dynamo.reset()
    f = torch.compile(lambda a: flex_attention(a, a, a, score_mod=lambda s, b, h, qi, ki: s + table[(qi - ki) % 2]),
                      backend="neuron")
    with warnings.catch_warnings(record=True) as caught, torch.neuron.report_scope() as scope:
        warnings.simplefilter("always")
        f(torch.randn(1, 2, S, 16, device="neuron"))
    lines = [str(w.message) for w in caught if "trnsim" in str(w.message)]
    assert lines == ["trnsim: flex_attention: the score function does not fuse into the attention kernel (it reads a "
                     "captured tensor at a computed index (a gather)); it is charged as one more pass over the "
                     "[B, H, L, S] scores (generic:score_mod)"]
    assert ("flex_attention", "generic:score_mod", 1) in _flex_rows(scope.report)


def _sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 128


def test_a_block_mask_skips_its_fully_masked_blocks():
    """A sliding window over 1024 keys visits 22 of 64 key blocks per head; the kernel walks only
    those (a causal mask's partial blocks are the kernel's causal mode; another mask function's are
    one generic pass over those blocks, said in a line)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1024, 16)
    qn = q.to("neuron")
    cost = {}
    for name, mask in (("dense", None), ("sliding", _sliding), ("causal", _causal)):
        bm = create_block_mask(mask, 1, 2, 1024, 1024, device="neuron") if mask else None
        torch._dynamo.reset()
        f = torch.compile(lambda a: flex_attention(a, a, a, block_mask=bm), backend="neuron")
        with warnings.catch_warnings(record=True) as caught, torch.neuron.report_scope() as scope:
            warnings.simplefilter("always")
            got = f(qn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = flex_attention(q, q, q, block_mask=create_block_mask(mask, 1, 2, 1024, 1024, device="cpu")
                                      if mask else None)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)  # the datapath's fp32 sum order
        rows = {r.kernel: r for r in scope.report.rows if r.op == "flex_attention"}
        cost[name] = rows["attention"].time_us
        lines = [str(w.message) for w in caught if "trnsim" in str(w.message)]
        if name == "sliding":
            assert lines == ["trnsim: flex_attention: the mask function does not fuse into the attention kernel (only "
                             "causal masks do); it is charged as one generic pass over the partially masked blocks "
                             "(generic:flex_mask)"]
            assert rows["generic:flex_mask"].calls == 1
        else:
            assert lines == [] and set(rows) == {"attention"}
    assert cost["sliding"] < 0.6 * cost["dense"] and cost["causal"] < cost["dense"]


def test_kernel_score_inputs_and_block_masks_match_numpy():
    from trnsim.kernels.fused import COL, ROW, SCALAR

    # score * (h + 1) + buf0[h] + buf1[q, kv] + buf2[kv] + buf3[b, h, q]
    prog = Program(((FULL, "fp32"), (SCALAR, "fp32"), (SCALAR, "fp32"), (FULL, "fp32"), (ROW, "fp32"), (COL, "bf16")),
                   (("ts", 1, "add", 1.0, None, None, False), ("tt", "multiply", 0, 6), ("tt", "add", 7, 2),
                    ("tt", "add", 8, 3), ("tt", "add", 9, 4), ("tt", "add", 10, 5)), ((11, "fp32"),))
    params = {"score_mod": prog, "score_inputs": ("h", "buf0[h]", "buf1[q,kv]", "buf2[kv]", "buf3[b,h,q]"),
              "score_buffers": (((2,), "fp32"), ((200, 200), "fp32"), ((200,), "fp32"), ((2, 2, 200), "bf16"))}
    out = check_entry(get_kernel("attention"), (2, 2, 200, 64), "fp32", "trn2", params)
    assert out["ok"], out["errors"]
    window = tuple(tuple(k for k in range(8) if abs(k - qb) <= 1) for qb in range(8))
    causal = tuple(tuple(range(qb + 1)) for qb in range(8))
    wide = tuple((qb // 2,) for qb in range(8))  # 256-key blocks
    lonely = tuple((qb // 2,) if qb % 3 else () for qb in range(8))  # some query blocks attend to nothing: zeros
    for bm, is_causal in (((128, 128, (window,)), False), ((128, 256, (wide, lonely)), False),
                          ((128, 128, (causal,)), True)):
        out = check_entry(get_kernel("attention"), (1, 2, 1024, 64), "bf16", "trn2",
                          {"block_mask": bm, "causal": is_causal})
        assert out["ok"], (bm[:2], out["errors"])
