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
