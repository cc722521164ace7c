"""What CPU records and refuses around in-place writes, on the neuron device as on CPU, with the
native fast path on and off (its second call of a signature is the fast path's):

* **version counters of ``_foreach_*`` writes.** CPU runs these ops as their composite, a loop of
  per-tensor in-place ops, each bumping its tensor's version; the device's kernels replace that
  loop, and bumped nothing, so a tensor autograd saved and an optimizer step then changed gave a
  backward computed from the new values where CPU refuses it (found by an adversarial values
  hunt: ``torch._foreach_mul_`` on a weight between a forward and its backward).
* **overlap.** A destination that partially overlaps a source (``out=``, ``copy_``) is refused by
  CPU's kernels, which compare storages; the fast path's CPU aliases had one storage each, so
  after a legal call of the same signature the kernel wrote a smeared result.
"""

from __future__ import annotations

import pytest
import torch

from torch_bridge import fastpath


def _foreach_overloads() -> list[tuple[str, str]]:
    out = []
    names = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("aten::_foreach_")})
    for name in names:
        packet = getattr(torch.ops.aten, name)
        for ov in packet.overloads():
            s = getattr(packet, ov)._schema
            if any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
                out.append((name, ov))
    return out


FOREACH_WRITES = _foreach_overloads()
REDUCTIONS = ("aten::_foreach_max", "aten::_foreach_norm", "aten::_foreach_powsum")


def _args(schema, device: str, n: int = 3) -> tuple[list, dict, list[list[torch.Tensor]]]:
    """Arguments for a foreach overload from its schema alone (values in (0.2, 0.9): valid for
    sqrt, log, acos, ...), and the lists it writes."""
    gen = torch.Generator().manual_seed(len(schema.name) * 31 + len(schema.arguments))

    def tensors(shape=(4,)):
        return [(0.2 + 0.7 * torch.rand(shape, generator=gen)).to(device) for _ in range(n)]

    args, kwargs, written = [], {}, []
    for a in schema.arguments:
        t = str(a.type)
        if t == "List[Tensor]":
            # a reduction's outs of its results' shape (an out of another shape is resized, which
            # the device's composite bumps once more than CPU's kernel: a version of 2 for 1)
            v = tensors(() if a.kwarg_only and schema.name in REDUCTIONS else (4,))
            if a.alias_info is not None and a.alias_info.is_write:
                written.append(v)
        elif t == "Tensor":
            v = torch.tensor(0.5, device=device)
        elif t == "number":
            v = 0.5
        elif t == "List[number]":
            v = [0.5] * n
        elif t == "bool":
            v = False
        elif t.startswith("Optional"):
            v = None
        else:
            raise AssertionError(f"no argument made for {t} ({schema})")
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return args, kwargs, written


def _call(name: str, ov: str, device: str):
    op = getattr(getattr(torch.ops.aten, name), ov)
    args, kwargs, written = _args(op._schema, device)
    before = [[t._version for t in ts] for ts in written]
    try:
        op(*args, **kwargs)
        err = None
    except Exception as e:  # noqa: BLE001  (compared with CPU's)
        err = type(e)
    return err, [[t._version - b for t, b in zip(ts, bs)] for ts, bs in zip(written, before)], \
        [[t.cpu() for t in ts] for ts in written]


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_every_foreach_write_bumps_versions_as_cpu(on):
    """Every ``_foreach_*`` overload that writes a list (in place, ``_foreach_copy_``, out=): the
    same error type or none, each written tensor's version moved as CPU's, the same values;
    twice, so that the fast path serves the second call."""
    assert len(FOREACH_WRITES) > 100
    differ = []
    with fastpath.turned(on):
        for name, ov in FOREACH_WRITES:
            want = _call(name, ov, "cpu")
            for _ in range(2):
                got = _call(name, ov, "neuron")
                if got[0] != want[0] or got[1] != want[1] or \
                        any(not torch.equal(g, w) for gs, ws in zip(got[2], want[2]) for g, w in zip(gs, ws)):
                    differ.append((name, ov, want[:2], got[:2]))
                    break
    assert not differ, differ[:5]


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_a_saved_tensor_changed_by_a_foreach_op_refuses_the_backward_as_on_cpu(on):
    def run(device: str):
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 2, bias=False).to(device)
        x = torch.ones(1, 3, device=device, requires_grad=True)
        y = lin(x).sum()  # saves the weight for x's gradient
        with torch.no_grad():
            torch._foreach_mul_([lin.weight], 0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()

    with fastpath.turned(on):
        for _ in range(2):
            run("cpu")
            run("neuron")


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_an_optimizer_step_before_a_second_backward_refuses_it_as_on_cpu(on):
    """GAN-style code: ``backward(retain_graph=True)``, a foreach optimizer step, a second backward
    through the same graph. CPU refuses it; the device computed gradients from the new weights."""
    def run(device: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        out = model(x).sum()
        out.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out, x)

    with fastpath.turned(on):
        for _ in range(2):
            run("cpu")
            run("neuron")


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_a_foreach_write_stops_at_an_inference_tensor_as_cpu_s_loop(on):
    """Outside inference mode, CPU's loop writes and bumps each tensor in turn and raises at the
    first inference tensor: the ones before it written and bumped, it written, the rest not."""
    def run(device: str):
        a, n = torch.ones(3, device=device), torch.ones(3, device=device)
        with torch.inference_mode():
            i = torch.ones(3, device=device)
        with pytest.raises(RuntimeError) as e:
            torch._foreach_mul_([a, i, n], 2.0)
        with torch.inference_mode():  # an inference tensor written inside inference mode: no bump, no error
            torch._foreach_add_([a, i], 1.0)
        return str(e.value), [t.cpu().tolist() for t in (a, i, n)], (a._version, n._version)

    with fastpath.turned(on):
        want = run("cpu")
        assert want[1] == [[3.0] * 3, [3.0] * 3, [1.0] * 3] and want[2] == (2, 0)
        for _ in range(2):
            assert run("neuron") == want


# ---- overlap ----------------------------------------------------------------------------------
# each call reads windows of `a` and writes a window of `b`: apart when they are two tensors (a
# legal call, which teaches the fast path the signature), overlapping when they are one
OVERLAPPING = {
    "mul out=": lambda a, b: torch.mul(a[:4], 2, out=b[1:5]),
    "neg out=": lambda a, b: torch.neg(a[:4], out=b[2:6]),
    "add out=": lambda a, b: torch.add(a[:4], a[2:6], out=b[1:5]),
    "copy_": lambda a, b: b[1:5].copy_(a[:4]),
    "exp out= transposed": lambda a, b: torch.exp(a[:4].view(2, 2), out=b[:4].view(2, 2).t()),
    "where out=": lambda a, b: torch.where(a[:4] > 2, a[:4], a[1:5], out=b[2:6]),
}


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
@pytest.mark.parametrize("case", list(OVERLAPPING))
def test_a_destination_overlapping_a_source_is_refused_as_on_cpu(on, case):
    """After a legal call of each signature (so that the fast path knows it), a partially
    overlapping one is refused with CPU's error and the memory is left as it was."""
    call = OVERLAPPING[case]

    def run(device: str):
        a, b = torch.arange(8.0, device=device), torch.zeros(8, device=device)
        call(a, b)
        x = torch.arange(8.0, device=device)
        with pytest.raises(RuntimeError) as e:
            call(x, x)
        return str(e.value).splitlines()[0], x.cpu().tolist(), b.cpu().tolist()

    with fastpath.turned(on):
        want = run("cpu")
        assert "refer to a single memory location" in want[0], want[0]
        for _ in range(2):
            assert run("neuron") == want


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_disjoint_windows_of_one_storage_and_a_full_overlap_compute_cpu_s_values(on):
    def run(device: str):
        x = torch.arange(12.0, device=device)
        torch.mul(x[:4], 2, out=x[4:8])  # disjoint windows of one storage
        x[8:12].copy_(x[:4])
        torch.add(x[:4], 1, out=x[:4])  # the same window: in place
        torch.exp(x[4:8], out=x[4:8])
        m = torch.arange(6.0, device=device).view(2, 3)
        m[0].copy_(m[1])
        return x.cpu(), m.cpu()

    with fastpath.turned(on):
        want = run("cpu")
        for _ in range(2):
            got = run("neuron")
            assert all(torch.equal(g, w) for g, w in zip(got, want))


# out= over part of an input CPU does not refuse (its check is for dense tensors in TensorIterator
# ops): CPU's values then follow its kernel's write order and threads. The device refuses each in
# CPU's words and writes nothing (difftest: triu.out over a strided int64 input, one element of six
# differing between CPU's run and the device's, CPU's rows being written in parallel).
CPU_RUNS_OVERLAPPING = {  # (as OVERLAPPING: reading `a`, writing `b`; overlapping when one tensor)
    "triu out= one element on": lambda a, b: torch.triu(a[:6].view(2, 3), out=b[1:7].view(2, 3)),
    "neg out= strided, shared elements": lambda a, b: torch.neg(a[0:8:2], out=b[2:10:2]),
    "cumsum out= strided, shared elements": lambda a, b: torch.cumsum(a[0:8:2], 0, out=b[4:12:2]),
    "mm out= over its operand": lambda a, b: torch.mm(a[:4].view(2, 2), a[8:12].view(2, 2), out=b[1:5].view(2, 2)),
}


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
@pytest.mark.parametrize("case", list(CPU_RUNS_OVERLAPPING))
def test_an_out_over_part_of_an_input_is_refused_where_cpu_runs_it(on, case):
    call = CPU_RUNS_OVERLAPPING[case]
    x = torch.arange(12.0)
    call(x, x)  # CPU runs it (and its values are its kernel's write order)
    with fastpath.turned(on):
        for _ in range(2):  # (the second call of a signature is the fast path's)
            call(torch.arange(12.0, device="neuron"), torch.zeros(12, device="neuron"))  # legal: teaches the signature
            x = torch.arange(12.0, device="neuron")
            with pytest.raises(RuntimeError, match="refer to a single memory location"):
                call(x, x)
            assert x.cpu().tolist() == list(range(12))


@pytest.mark.parametrize("on", [True, False], ids=["fast", "python"])
def test_an_out_interleaved_with_its_input_or_on_it_runs_with_cpu_s_values(on):
    """A strided out between an input's elements shares no element; an out of the input's own
    layout is CPU's in-place case; an in-place copy between overlapping windows is not an out=."""
    def run(device: str):
        x = torch.arange(12.0, device=device)
        torch.neg(x[0::2], out=x[1::2])
        torch.cumsum(x[0::3], 0, out=x[1::3])
        m = torch.arange(6.0, device=device).view(2, 3)
        torch.triu(m, out=m.view(2, 3))
        torch.triu(m, 1, out=m)
        y = torch.arange(8.0, device=device).view(2, 4)
        y[:, 1:] = y[:, :-1]
        return x.cpu(), m.cpu(), y.cpu()

    with fastpath.turned(on):
        want = run("cpu")
        for _ in range(2):
            got = run("neuron")
            assert all(torch.equal(g, w) for g, w in zip(got, want))
