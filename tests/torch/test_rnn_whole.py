"""nn.LSTM, nn.GRU and nn.RNN as one op each (torch_bridge/ops/rnn.py): CPU's kernel's values and
gradients bit for bit, and the composite's launches, ticks, host ops and memory figures exactly
(the composite is what the device ran before, and still runs with ``rnn.enabled = False``)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from torch_bridge import fastpath
from torch_bridge.ops import rnn

CASES = [
    (nn.LSTM, {}),
    (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    (nn.LSTM, {"batch_first": True, "bias": False}),
    (nn.LSTM, {"proj_size": 5}),
    (nn.GRU, {"num_layers": 2}),
    (nn.GRU, {"batch_first": True, "bidirectional": True}),
    (nn.RNN, {"num_layers": 2}),
    (nn.RNN, {"nonlinearity": "relu", "bidirectional": True}),
]


def _state(cls, kw):
    batch = 3 if kw.get("batch_first") else 4  # of an input [3, 4, 7]
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h = torch.randn(layers, batch, kw.get("proj_size") or 12, generator=torch.Generator().manual_seed(4))
    if cls is nn.LSTM:
        return h, torch.randn(layers, batch, 12, generator=torch.Generator().manual_seed(5))
    return h


def _run(module, x, state, seed_grad=6):
    """Outputs, the final state, and every gradient of a forward and a backward (state given and
    needing a gradient)."""
    out, st = module(x, state)
    st = st if isinstance(st, tuple) else (st,)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed_grad)).to(out.device)
    ((out * g).sum() + st[0].sum()).backward()
    ins = [x, *(state if isinstance(state, tuple) else (state,))]
    return [out, *st, *(t.grad for t in ins), *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_values_and_gradients_are_cpu_s_bit_for_bit(cls, kw):
    torch.manual_seed(0)
    cpu = cls(7, 12, **kw)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(2))
    state = _state(cls, kw)
    xs = (x.clone().requires_grad_(), x.to("neuron").requires_grad_())
    states = [tuple(t.clone().requires_grad_() for t in state) if isinstance(state, tuple) else
              state.clone().requires_grad_()]
    states.append(tuple(t.to("neuron").requires_grad_() for t in state) if isinstance(state, tuple) else
                  state.to("neuron").requires_grad_())
    want = _run(cpu, xs[0], states[0])
    got = _run(dev, xs[1], states[1])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.device.type == "neuron" and a.stride() == b.stride() and torch.equal(a.cpu(), b)


def _program(cls, kw, fused: bool):
    """Two training steps of ``cls`` (after one untimed), with their report and memory figures."""
    rnn.enabled = fused
    try:
        torch.manual_seed(0)
        m = cls(7, 12, **kw).to("neuron")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(2)).to("neuron")

        def step():
            opt.zero_grad()
            out, _ = m(x)
            out[-1].square().mean().backward()
            opt.step()
            return out.detach().cpu()

        step()
        torch.neuron.synchronize()
        gc.collect()
        torch.neuron.reset_peak_memory_stats()
        with torch.neuron.report_scope(trace=True) as scope:
            outs = [step(), step()]
            torch.neuron.synchronize()
        mem = [torch.neuron.memory_allocated(), torch.neuron.max_memory_allocated()]
        out, _ = m(x)  # between a forward and its backward: the composite's saved activations
        mem += [torch.neuron.memory_allocated(), torch.neuron.max_memory_allocated()]
        (out * 2).sum().backward()  # (the gradient it gets is autograd's own: see the module's memory note)
        mem += [torch.neuron.memory_allocated(), torch.neuron.max_memory_allocated()]
        del out
        rep = scope.report
        t0 = rep.events[0].start
        events = [(e.op, e.kernel, e.start - t0, e.end - t0) for e in rep.events]
        rows = [(r.op, r.kernel, r.calls, r.time_us) for r in rep.rows]
        return outs, (rep.elapsed_us, rep.launches, dict(rep.host_ops), events, rows), mem
    finally:
        rnn.enabled = True


@pytest.mark.parametrize("cls,kw", CASES[:2] + CASES[4:5] + CASES[6:7],
                         ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_time_and_memory_are_the_composite_s(cls, kw):
    learned = len(rnn.LEARNED)
    _, composite, mem_c = _program(cls, kw, fused=False)
    assert len(rnn.LEARNED) == learned  # (the composite ran: nothing learned)
    _, fused, mem_f = _program(cls, kw, fused=True)
    assert len(rnn.LEARNED) > learned
    assert fused == composite
    assert mem_f == mem_c


def test_the_fast_path_off_changes_nothing():
    with fastpath.turned(False):
        outs_slow, rep_slow, mem_slow = _program(nn.LSTM, {"num_layers": 2}, fused=True)
    outs, rep, mem = _program(nn.LSTM, {"num_layers": 2}, fused=True)
    assert rep == rep_slow and mem == mem_slow
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_slow))


def test_without_grad_and_in_inference_mode_values_are_cpu_s():
    torch.manual_seed(1)
    cpu = nn.GRU(5, 6, num_layers=2)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(4, 2, 5)
    want = cpu(x)[0]
    with torch.no_grad():
        assert torch.equal(dev(x.to("neuron"))[0].cpu(), want)
    with torch.inference_mode():
        assert torch.equal(dev(x.to("neuron"))[0].cpu(), want)
    # unbatched and strided inputs
    xt = torch.randn(2, 4, 5).transpose(0, 1)
    assert torch.equal(dev(xt.to("neuron").transpose(0, 1).contiguous().transpose(0, 1))[0].cpu(), cpu(xt)[0])
    assert torch.equal(dev(x[:, 0].to("neuron"))[0].cpu(), cpu(x[:, 0])[0])


def test_calls_it_does_not_take_run_the_composite():
    torch.manual_seed(3)
    x = torch.randn(4, 2, 5)
    learned = len(rnn.LEARNED)
    bf16 = nn.LSTM(5, 6).to("neuron", torch.bfloat16)
    bf16(x.to("neuron", torch.bfloat16))[0].float().sum().backward()
    drop = nn.LSTM(5, 6, num_layers=2, dropout=0.5).to("neuron")  # dropout's masks: the device's generator
    drop(x.to("neuron"))[0].sum().backward()
    with torch.autocast("neuron", dtype=torch.bfloat16):  # the composite's matmuls in bf16, its output too
        assert nn.GRU(5, 6).to("neuron")(x.to("neuron"))[0].dtype == torch.bfloat16
    assert len(rnn.LEARNED) == learned


def test_autograd_refusals_are_cpu_s():
    m = nn.LSTM(5, 6).to("neuron")
    x = torch.randn(4, 2, 5, device="neuron")
    out, _ = m(x)
    out.sum().backward(retain_graph=True)
    g = m.weight_ih_l0.grad.clone()
    out.sum().backward()  # the graph was kept: gradients accumulate, as on CPU
    assert torch.equal(m.weight_ih_l0.grad.cpu(), 2 * g.cpu())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()
    out, _ = m(x)
    with torch.no_grad():
        m.weight_hh_l0.add_(1)  # an optimizer step between the forward and its backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inside_torch_func_transforms_the_composite_runs():
    """torch.func's wrapped tensors expose no memory, and refuse an autograd.Function without
    setup_context: the composite runs there (its values, within the datapath's rounding of CPU's)."""
    from torch.func import functional_call, grad

    torch.manual_seed(4)
    cpu = nn.LSTM(4, 5)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(3, 2, 4)

    def loss(m, xx):
        return lambda p: functional_call(m, p, (xx,))[0].square().sum()

    learned = len(rnn.LEARNED)
    want = grad(loss(cpu, x))({k: v.detach() for k, v in cpu.named_parameters()})
    got = grad(loss(dev, x.to("neuron")))({k: v.detach() for k, v in dev.named_parameters()})
    assert len(rnn.LEARNED) == learned
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-5, atol=1e-6)


def test_recorded_collects_launches_and_host_ops_without_issuing_or_counting_them():
    from torch_bridge.runtime import runtime

    dev = runtime().device
    x = torch.ones(4, 4, device="neuron")
    (x + 1).sum()  # (every signature's cost learned: the block below only launches)
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        before = x * 2  # made before the block: issued and counted as usual
        with dev.recorded() as (launches, host):
            y = (x + 1).view(16)
            y.sum()
        after = x * 3
        torch.neuron.synchronize()
    rep = scope.report
    assert [op for _, op, *_ in launches] == ["add", "sum"] and host == {"view": 1}
    assert [r.op for r in rep.rows] == ["mul"] and rep.launches == 2 and "view" not in rep.host_ops
    assert torch.equal(y.cpu(), torch.full((16,), 2.0)) and before is not None and after is not None


def test_saved_tensor_hooks_run_the_composite():
    """save_on_cpu and non-reentrant checkpointing decide what autograd keeps; the op's host
    graph reads views of device memory the hooks let go of (its gradients were garbage)."""
    import torch.utils.checkpoint as cp

    torch.manual_seed(6)
    cpu = nn.Sequential(nn.Linear(5, 5), nn.LSTM(5, 6))
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(4, 2, 5)
    cpu[1](cpu[0](x))[0].square().sum().backward()
    learned = len(rnn.LEARNED)
    with torch.autograd.graph.save_on_cpu():
        out = dev[1](dev[0](x.to("neuron")))[0]
    junk = [torch.randn(64, 64, device="neuron") for _ in range(8)]  # (reuses freed device memory)
    out.square().sum().backward()
    out = cp.checkpoint(lambda t: dev[1](dev[0](t))[0], x.to("neuron"), use_reentrant=False)
    out.square().sum().backward()
    assert len(rnn.LEARNED) == learned and junk
    for a, b in zip(dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.grad.cpu(), 2 * b.grad, rtol=1e-5, atol=1e-6)


def test_a_gradient_penalty_differentiates_the_gradients():
    torch.manual_seed(7)
    cpu = nn.GRU(3, 4)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(5, 2, 3)
    for m, xx in ((cpu, x), (dev, x.to("neuron"))):
        xx = xx.clone().requires_grad_()
        out = m(xx)[0]
        g, = torch.autograd.grad(out.square().sum(), xx, create_graph=True)
        (out.sum() + g.square().sum()).backward()
    for a, b in zip(dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-6)


def test_a_cpu_autocast_region_is_not_the_device_s():
    torch.manual_seed(8)
    cpu = nn.LSTM(5, 6)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(4, 2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dev(x.to("neuron"))[0]
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), cpu(x)[0])


def test_a_call_mixing_devices_gets_cpu_s_error_when_cpu_would_refuse_it():
    """The composite checks devices before sizes; CPU's tensors share one device, so CPU's error
    for a bad call is about its sizes (found by difftest: a 0-dim input, a host hidden state)."""
    args = (torch.tensor(1.0), torch.tensor(0.0), [torch.randn(1, 4), torch.randn(5, 3)], False, 1, 0.0, True, False,
            True)
    with pytest.raises(IndexError) as want:
        torch.rnn_tanh(*args)
    with pytest.raises(IndexError) as got:
        torch.rnn_tanh(args[0].to("neuron"), args[1], [p.to("neuron") for p in args[2]], *args[3:])
    assert str(got.value) == str(want.value)
    # a valid call with a host hidden state keeps the composite's (CUDA's) device error
    m = nn.LSTM(3, 4).to("neuron")
    h = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="Input and hidden tensors are not at the same device"):
        m(torch.randn(2, 1, 3, device="neuron"), (h, h))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_gradients_batched_by_vmap_are_cpu_s(cls):
    """``autograd.grad(..., is_grads_batched=True)`` and ``jacobian(vectorize=True)`` vmap the
    backward over output gradients, which have no memory of their own: the op's backward read
    them as host views and raised "Cannot access storage of BatchedTensorImpl" where CPU computes
    them. They run the composite's backward now."""
    torch.manual_seed(0)
    m = cls(4, 3, batch_first=True)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
    gs = torch.randn(6, 2, 5, 3, generator=torch.Generator().manual_seed(2))
    got = []
    for dev in ("cpu", "neuron"):
        md, xd = copy.deepcopy(m).to(dev), x.to(dev).requires_grad_()
        batched = torch.autograd.grad(md(xd)[0], xd, gs.to(dev), is_grads_batched=True)[0]
        jac = torch.autograd.functional.jacobian(lambda t: md(t)[0], xd.detach()[:1, :2], vectorize=True)
        got.append((batched.cpu(), jac.cpu()))
    for a, b in zip(got[1], got[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
