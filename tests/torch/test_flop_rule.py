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


# ---- every op torch.utils.flop_counter counts -------------------------------------------------
_aten = torch.ops.aten


def _img(dev):
    return _x(dev, 2, 4, 10, 10), _x(dev, 6, 4, 3, 3), _x(dev, 6)


def _fp8(dev, *shape):
    return _x("cpu", *shape).to(torch.float8_e4m3fn).to(dev)


# one call per op in flop_counter's registry that the neuron device can run, calling that very op
REGISTRY_CASES = {
    "aten.mm": lambda d: torch.mm(_x(d, 64, 96), _x(d, 96, 80)),
    "aten.addmm": lambda d: torch.addmm(_x(d, 80), _x(d, 64, 96), _x(d, 96, 80)),
    "aten.bmm": lambda d: torch.bmm(_x(d, 4, 32, 48), _x(d, 4, 48, 40)),
    "aten.baddbmm": lambda d: torch.baddbmm(_x(d, 4, 32, 40), _x(d, 4, 32, 48), _x(d, 4, 48, 40)),
    "aten.convolution": lambda d: _aten.convolution(*_img(d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    "aten._convolution": lambda d: _aten._convolution(*_img(d), [2, 2], [0, 0], [1, 1], False, [0, 0], 1, False,
                                                      False, True, True),
    "aten.convolution_overrideable": lambda d: _aten.convolution_overrideable(*_img(d), [1, 1], [1, 1], [1, 1], False,
                                                                            [0, 0], 1),
    "aten.convolution_backward": lambda d: _aten.convolution_backward(
        _x(d, 2, 6, 10, 10), *_img(d)[:2], [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]),
    "aten._slow_conv2d_forward": lambda d: _aten._slow_conv2d_forward(_img(d)[0], _img(d)[1], [3, 3], None, [1, 1],
                                                                    [1, 1]),
    "aten._scaled_mm": lambda d: torch._scaled_mm(_fp8(d, 64, 128), _fp8(d, 96, 128).t(), torch.tensor(1.0).to(d),
                                                  torch.tensor(1.0).to(d), out_dtype=torch.bfloat16),
}
# torch 2.13's counter registers _slow_conv2d_forward with the convolution formula but calls it
# without `transposed` (TypeError on CPU too): its count is that formula's, applied by hand
BY_FORMULA = {"aten._slow_conv2d_forward": lambda: _conv_count((2, 4, 10, 10), (6, 4, 3, 3), (2, 6, 10, 10))}


def _conv_count(x, w, out):
    from torch.utils.flop_counter import conv_flop_count

    return conv_flop_count(x, w, out, transposed=False)


# flex attention's higher-order ops: FlopCounterMode cannot run them in torch 2.13 (their dense
# fallback dispatches into a mode it does not handle), so the device is held to the registry's
# own formulas for them (test_flex_attention_covers_the_registrys_formulas)
FORMULA_ONLY = {"flex_attention", "flex_attention_backward"}


def _runnable(packet) -> bool:
    """Some overload of the aten op has a CPU or composite kernel: the neuron device, which
    computes on CPU kernels, can run it (the others are CUDA's: flash/efficient/cuDNN attention,
    cuDNN convolution)."""
    for overload in packet.overloads():
        name = packet._qualified_op_name + ("" if overload == "default" else f".{overload}")
        if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in
               ("CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd", "PrivateUse1")):
            return True
    return False


def test_every_op_the_flop_counter_counts_is_covered():
    from torch.utils.flop_counter import flop_registry

    runnable = {str(op) for op in flop_registry if not isinstance(op, torch._ops.OpOverloadPacket) or _runnable(op)}
    assert runnable == set(REGISTRY_CASES) | FORMULA_ONLY


@pytest.mark.parametrize("name", sorted(REGISTRY_CASES))
def test_each_counted_op_is_charged_its_flops(name):
    """flop_counter counting the neuron call itself (the op on neuron tensors, shapes only)."""
    if name in BY_FORMULA:
        with torch.neuron.report_scope() as scope:
            REGISTRY_CASES[name]("neuron")
        counted = BY_FORMULA[name]()
    else:
        with torch.neuron.report_scope() as scope, FlopCounterMode(display=False) as counter:
            REGISTRY_CASES[name]("neuron")
        counted = counter.get_total_flops()
    rep = scope.report
    assert counted > 0 and rep.matmul_flops + rep.engine_flops >= counted, (name, rep.rows)
    assert rep.matmul_flops >= counted, (name, rep.rows)  # on TensorE


def test_flex_attention_covers_the_registrys_formulas():
    from torch.nn.attention.flex_attention import flex_attention
    from torch.utils.flop_counter import flop_registry

    fwd = flop_registry[torch.ops.higher_order.flex_attention]
    bwd = flop_registry[torch.ops.higher_order.flex_attention_backward]
    q = _x("neuron", 1, 2, 256, 32, grad=True)
    torch._dynamo.reset()
    f = torch.compile(flex_attention, backend="neuron")
    with torch.neuron.report_scope() as forward:
        out = f(q, q, q)
    with torch.neuron.report_scope() as backward:
        out.sum().backward()
    meta = torch.empty(1, 2, 256, 32, device="meta")
    assert forward.report.matmul_flops >= fwd(meta, meta, meta) > 0
    assert backward.report.matmul_flops >= bwd(meta, meta, meta, meta, None, meta) > 0


# ---- every op the bridge serves, on the differential tester's samples ---------------------------
_MATMUL_FAMILY = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution_overrideable")


def _difftest():
    import importlib.util
    import sys
    from pathlib import Path

    if "difftest" not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "difftest.py"
        spec = importlib.util.spec_from_file_location("difftest", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["difftest"] = mod  # (its dataclasses look their module up here)
        spec.loader.exec_module(mod)
    return sys.modules["difftest"]


def test_every_served_op_is_charged_the_flops_counted_on_the_testers_samples():
    """The differential tester's op list (benchmarks/difftest.py ``served_ops``: the lowering table
    and every aten op with a neuron kernel) and its samples (dtypes, broadcasting, strides, out=,
    empty and 0-dim tensors): each call on neuron is charged at least the FLOPs flop_counter counts
    for it. Five samples an op; twenty for the matmul family, whose tiny and empty samples count
    nothing, so some count."""
    import dataclasses
    import random
    import warnings

    dt = _difftest()
    tester = dt.Tester(echo=None)
    short, counted_ops, ran = [], set(), 0
    for packet in dt.served_ops():
        for s in tester.samples(packet, 20 if packet in _MATMUL_FAMILY else 5):
            outs = [a for a in s.op._schema.arguments if a.kwarg_only and a.alias_info is not None
                    and a.alias_info.is_write]
            specs = None
            if outs:  # out= tensors as the tester makes them (from CPU's functional result)
                fn = dt.functional_of(s.op)
                probe = dt.run_on(dataclasses.replace(s, op=fn), "cpu") if fn is not None else None
                specs = dt.out_specs(s, probe.result if probe is not None and probe.error is None else None,
                                     random.Random(s.seed))
            m = dt.Materialised(s, "neuron", specs)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with torch.neuron.report_scope() as scope, FlopCounterMode(display=False) as counter:
                        s.op(*m.args, **m.kwargs)
            except Exception:  # noqa: BLE001 - a variant CPU refuses too (the tester compares those)
                continue
            ran += 1
            counted, rep = counter.get_total_flops(), scope.report
            if rep.matmul_flops + rep.engine_flops < counted:
                short.append(f"{s.describe()}: charged {rep.matmul_flops + rep.engine_flops} < {counted}")
            if counted:
                counted_ops.add(packet)
    assert not short, "\n".join(short[:20])
    assert ran > 900 and {"mm", "addmm", "bmm", "baddbmm", "convolution_overrideable"} <= counted_ops, (ran, counted_ops)
