"""A compiled optimizer step (``torch.compile(opt.step, backend="neuron")``) runs its whole
``_foreach_*`` chain, with the functionalized ``copy_`` back into parameters and state, as one
multi-tensor kernel: values bit-identical to the same optimizer run eagerly over several steps,
one launch per step in place of the chain's, and the region's kernel faster than its ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_bridge.compile as neuron_compile
from torch_bridge.compile.foreach import ForeachKernel

neuron_compile.register()


def _train(make_opt, compiled: bool, steps: int = 4, widths: tuple[int, int, int] = (16, 48, 4)):
    torch.manual_seed(0)
    width_in, hidden, width_out = widths
    model = nn.Sequential(nn.Linear(width_in, hidden), nn.GELU(), nn.LayerNorm(hidden),
                          nn.Linear(hidden, width_out)).to("neuron")
    opt = make_opt(model.parameters())
    torch._dynamo.reset()
    step = torch.compile(opt.step, backend="neuron") if compiled else opt.step
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        if i == 2:  # steady state: the first step creates the state (another graph), the second compiles
            torch.neuron.synchronize()
            torch.neuron.reset_report()
        loss = model(torch.randn(8, width_in, generator=gen).to("neuron")).square().mean()
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()], torch.neuron.report()


OPTIMIZERS = {
    # dynamo compiles AdamW in its capturable form: the eager run it must equal is that form
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, capturable=True)),
    "sgd momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),) * 2,
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_step_is_one_kernel_with_eager_values(name):
    compiled_opt, eager_opt = OPTIMIZERS[name]
    ForeachKernel.record = []
    try:
        losses, params, rep = _train(compiled_opt, True)
        calls = [c for c in ForeachKernel.record if c[1] is not None]
    finally:
        ForeachKernel.record = None
    eager_losses, eager_params, _ = _train(eager_opt, False)
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    assert calls and all(spec.kernel == "foreach_fused" for _, spec, _, _ in calls)
    # the CPU values are computed in place: every updated parameter and state tensor is written by
    # an in-place foreach op, none by a copy of a functional result (same values as eager, above)
    kernel = calls[-1][0]
    n_copies = sum(1 for n in kernel.nodes if n.target is torch.ops.aten.copy_.default)
    assert n_copies > 0 and kernel.in_place[0] and kernel.copies == 0
    # capturable AdamW's lerp weight (a full_like per parameter) is held as one broadcast element
    assert bool(kernel.immediates) == (name == "adamw")
    rows = [r for r in rep.rows if r.is_region and r.kernel == "foreach_fused"]
    assert len(rows) == 1 and rows[0].calls == 2  # one launch per steady step
    row = rows[0]
    assert row.time_us < row.eager_time_us and row.hbm_bytes < row.eager_hbm_bytes
    assert row.eager_launches > 5 * row.calls  # the chain's foreach ops and copies, per step
    assert not [r for r in rep.rows if r.op.startswith("_foreach_") or r.kernel == "generic:copy_d2d"]


def test_adamw_compiled_close_to_default_eager():
    """Eager AdamW (not capturable) computes its bias corrections in Python floats; the compiled
    (capturable) step rounds them to fp32: the parameters agree to a few ulps."""
    make = OPTIMIZERS["adamw"][0]
    _, compiled, _ = _train(make, True)
    _, eager, _ = _train(make, False)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adamw_broadcast_lerp_weight_matches_eager_at_odd_sizes():
    """Parameters whose element counts leave every remainder after the CPU kernels' vector
    stretches (13 x 37, 37, 37 x 5, 5, ...): the compiled step, which reads the lerp weight as one
    broadcast element, equals eager capturable AdamW bit for bit."""
    compiled_opt, eager_opt = OPTIMIZERS["adamw"]
    losses, params, _ = _train(compiled_opt, True, steps=5, widths=(13, 37, 5))
    eager_losses, eager_params, _ = _train(eager_opt, False, steps=5, widths=(13, 37, 5))
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_chain_run_group_by_group_equals_eager(name, monkeypatch):
    """The chain run over groups of the lists' indices (a few parameters at a time, each op over
    a group before the next op; big models' lists are split so) gives eager's values bit for bit,
    odd sizes included; parameters that share a storage run over whole lists."""
    import torch_bridge.compile.foreach as fe

    monkeypatch.setattr(fe, "GROUP_ELEMENTS", 64)
    compiled_opt, eager_opt = OPTIMIZERS[name]
    ForeachKernel.record = []
    try:
        losses, params, _ = _train(compiled_opt, True, steps=5, widths=(13, 37, 5))
        kernel = [c for c in ForeachKernel.record if c[1] is not None][-1][0]
    finally:
        ForeachKernel.record = None
    groups = kernel._group_plan()
    assert groups is not None and len(groups) >= 3  # (13 x 37 = 481 elements: a group of its own)
    assert [(a, b) for a, b, _ in groups][0][0] == 0 and groups[-1][1] == kernel.region.length
    eager_losses, eager_params, _ = _train(eager_opt, False, steps=5, widths=(13, 37, 5))
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))
    # one storage under two inputs: the chain runs over whole lists
    flat = torch.zeros(8)
    assert not fe._apart(fe._storages({"a": flat[:4], "b": flat[4:]}))
    assert fe._apart(fe._storages({"a": torch.zeros(4), "b": torch.zeros(4)}))
