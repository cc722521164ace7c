"""The FLOP rule: every op is charged at least the FLOPs ``torch.utils.flop_counter`` counts for it,
and matmul FLOPs run on TensorE (the OpInfo harness checks it on every sample, too)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def _charged_and_counted(case):
    """(neuron report, FLOPs it charged, FLOPs flop_counter counts for the same code on CPU)."""
    with FlopCounterMode(display=False) as counter:
        case("cpu")
    with torch.neuron.report_scope() as scope:
        case("neuron")
    rep = scope.report
    return rep, rep.matmul_flops + rep.engine_flops, counter.get_total_flops()


def _x(dev, *shape, grad=False):
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)


CASES = {
    "mm": lambda d: _x(d, 64, 96) @ _x(d, 96, 80),
    "bmm_small_heads": lambda d: torch.bmm(_x(d, 192, 11, 16), _x(d, 192, 16, 11)),
    "linear": lambda d: F.linear(_x(d, 8, 32), _x(d, 48, 32), _x(d, 48)),
    "conv2d": lambda d: F.conv2d(_x(d, 2, 8, 16, 16), _x(d, 16, 8, 3, 3), padding=1),
    "conv_grouped": lambda d: F.conv2d(_x(d, 2, 8, 16, 16), _x(d, 16, 2, 3, 3), padding=1, groups=4),
    "conv_depthwise": lambda d: F.conv2d(_x(d, 2, 24, 16, 16), _x(d, 24, 1, 5, 5), padding=2, groups=24),
    "conv1d": lambda d: F.conv1d(_x(d, 2, 8, 32), _x(d, 8, 8, 3)),
    "conv_backward": lambda d: F.conv2d(_x(d, 2, 8, 12, 12, grad=True), _x(d, 6, 8, 3, 3, grad=True),
                                        stride=2).sum().backward(),
    "mlp_backward": lambda d: F.linear(F.gelu(F.linear(_x(d, 16, 32, grad=True), _x(d, 64, 32, grad=True))),
                                       _x(d, 8, 64, grad=True)).sum().backward(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_charged_flops_cover_flop_counter(name):
    rep, charged, counted = _charged_and_counted(CASES[name])
    assert counted > 0 and charged >= counted, (name, charged, counted)


@pytest.mark.parametrize("name", ["mm", "bmm_small_heads", "linear", "conv2d", "conv_grouped", "mlp_backward"])
def test_matmul_flops_run_on_tensore(name):
    rep, _, counted = _charged_and_counted(CASES[name])
    assert rep.matmul_flops >= counted
    assert all(not r.generic for r in rep.rows if r.matmul_flops), [r.kernel for r in rep.rows]


def test_attention_covers_flop_counters_formulas():
    # CPU's fused attention is not in flop_counter's registry (it counts 0 there): hold the device
    # to flop_counter's own sdpa formulas. Two deliberate differences, both where the formula counts
    # work the device's kernels do not do: causal attention skips the masked-out blocks, and the
    # backward keeps P from the forward (four matmuls: dV, dP, dQ, dK) where the formula assumes a
    # flash backward that recomputes QKᵀ (a fifth).
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (2, 4, 32, 16)
    qkv = [_x("neuron", *shape, grad=True) for _ in range(3)]
    with torch.neuron.report_scope() as scope:
        out = F.scaled_dot_product_attention(*qkv)
    forward = sdpa_flop_count(shape, shape, shape)
    assert scope.report.matmul_flops >= forward > 0
    with torch.neuron.report_scope() as scope:
        out.sum().backward()
    assert scope.report.matmul_flops >= 2 * forward == sdpa_backward_flop_count(shape, shape, shape, shape) * 4 // 5
    with torch.neuron.report_scope() as scope:
        F.scaled_dot_product_attention(*[_x("neuron", 1, 2, 256, 64) for _ in range(3)], is_causal=True)
    full = sdpa_flop_count((1, 2, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64))
    assert full // 2 < scope.report.matmul_flops < full  # the diagonal blocks and those below it


def test_depthwise_backward_is_charged_its_macs():
    # flop_counter's conv backward formula ignores groups for the weight gradient (its own note:
    # "I skip those for the sake of brevity"), counting a depthwise one as dense - groups x the
    # work. The device charges what the kernels do: input and weight gradients, each the forward's MACs.
    def fwd(d):
        return F.conv2d(_x(d, 2, 8, 12, 12, grad=True), _x(d, 8, 1, 3, 3, grad=True), groups=8)

    rep, _, counted_fwd = _charged_and_counted(fwd)
    assert rep.row("convolution").engine_flops >= counted_fwd > 0
    rep, _, _ = _charged_and_counted(lambda d: fwd(d).sum().backward())
    assert rep.row("convolution_backward").engine_flops == 2 * rep.row("convolution").engine_flops


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to("neuron")


def test_eval_fast_paths_are_charged_their_matmuls():
    enc, x = _encoder(), _x("neuron", 2, 16, 64)
    with torch.neuron.report_scope() as train:
        enc.train()(x)
    with torch.no_grad(), torch.neuron.report_scope() as fast:
        enc.eval()(x)
    assert {r.op for r in fast.report.rows} == {"_transformer_encoder_layer_fwd"}  # the fused fast path ran
    assert fast.report.matmul_flops == train.report.matmul_flops > 0
    mha = nn.MultiheadAttention(64, 4, batch_first=True).to("neuron")
    with torch.neuron.report_scope() as slow:
        mha.train()(x, x, x, need_weights=False)
    with torch.no_grad(), torch.neuron.report_scope() as fused:
        mha.eval()(x, x, x, need_weights=False)
    assert {r.op for r in fused.report.rows} == {"_native_multi_head_attention"}
    assert fused.report.matmul_flops == slow.report.matmul_flops > 0
