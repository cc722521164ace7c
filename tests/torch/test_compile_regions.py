"""A compiled region's later calls run its generated code (RegionKernel._specialise): the same
values, bit for bit, and the same launches, report rows and ticks as its first call's path
(RegionKernel._call), which every call takes while ``RegionKernel.record`` is set."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import torch_bridge.compile as neuron_compile
from torch_bridge import fastpath
from torch_bridge.compile.graph import RegionKernel

neuron_compile.register()
F = nn.functional


def _rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


# name -> (function, input shapes, dtype)
PROGRAMS = {
    "fp32 chain": (lambda x, b: torch.tanh(x + b) * 0.5 - x, [(64, 96), (96,)], torch.float32),
    "bf16 chain": (lambda x, b: torch.tanh(x + b) * 0.5 - x, [(64, 96), (96,)], torch.bfloat16),
    "bf16 rms norm": (_rmsnorm, [(32, 128), (128,)], torch.bfloat16),
    "fp16 softmax": (lambda x: torch.softmax(x * 0.125, -1) + 1.0, [(16, 80)], torch.float16),
    "linear epilogue": (lambda x, w, b: torch.tanh(F.linear(x, w, b)) * 0.5 + x[:, :1], [(32, 48), (40, 48), (40,)],
                        torch.float32),
    "bf16 linear epilogue": (lambda x, w, b: F.silu(F.linear(x, w, b)) * 2.0, [(16, 32), (24, 32), (24,)],
                             torch.bfloat16),
    "layer norm": (lambda x, w, b: F.layer_norm(x * 2.0, (64,), w, b) + 1.0, [(24, 64), (64,), (64,)], torch.float32),
}


@contextlib.contextmanager
def _generic():
    """Every region call takes RegionKernel._call (the path whose results the generated code must give)."""
    RegionKernel.record = []
    try:
        yield RegionKernel.record
    finally:
        RegionKernel.record = None


def _figures(rep):
    return (rep.rows, rep.host_ops, rep.elapsed_us, rep.device_us, rep.dispatches)


def _calls(compiled, args, n):
    outs, figs = [], []
    for _ in range(n):
        with torch.neuron.report_scope() as scope:
            out = compiled(*args)
            torch.neuron.synchronize()
        outs.append(out.cpu())
        figs.append(_figures(scope.report))
    return outs, figs


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_later_calls_give_the_first_calls_values_and_figures(name, fast):
    fn, shapes, dtype = PROGRAMS[name]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).to(dtype).to("neuron") for s in shapes]
    before = fastpath.enabled()
    fastpath.set_enabled(fast)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="neuron")
        with _generic() as rec:
            first, first_figs = _calls(compiled, args, 2)
        kernels = {r[0] for r in rec}
        assert kernels, f"{name}: nothing fused"
        later, later_figs = _calls(compiled, args, 2)
        assert all(p.run is not None for k in kernels for p in k.plans.values())
    finally:
        fastpath.set_enabled(before)
    for got in first[1:] + later:
        assert got.dtype == first[0].dtype
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                           first[0].view(torch.uint8) if got.dtype != torch.bool else first[0]), name
    for figs in first_figs[1:] + later_figs:
        assert figs == first_figs[1], name  # (the first call also made the plans: its own figures)
    # and the values are the program's on CPU within the region's documented rounding
    cpu = fn(*[a.cpu() for a in args])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(later[-1].float(), cpu.float(), **tol)


def test_an_input_the_native_views_refuse_takes_the_generic_views():
    """A later call whose input carries a neg bit (the native views refuse it) computes from
    memory.cpu_views' windows: the same values as the plain input."""
    fn, shapes, dtype = PROGRAMS["fp32 chain"]
    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(s, generator=gen).to("neuron") for s in shapes]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    with _generic() as rec:
        compiled(*args)
    rk, _spec, rargs, routs = rec[0]
    plan = next(iter(rk.plans.values()))
    assert plan.run is not None
    neg = [torch._neg_view(a.neg()) if isinstance(a, torch.Tensor) else a for a in rargs]
    assert any(isinstance(a, torch.Tensor) and a.is_neg() for a in neg)
    plain = rk(*rargs)
    refused = rk(*neg)
    for a, b, c in zip(routs, plain, refused):
        assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c.cpu())


def test_a_graphs_attention_values_call_the_function_directly():
    """A compiled graph's ``trnsim::attention_values`` node calls its computation directly
    (compile.attention.values_call: the aot graph runs without autograd), with the values of the
    eager device's attention, bit for bit, and of a non-finite query CPU's kernel's, as the op gave."""
    from torch_bridge.compile.attention import values_call
    from torch_bridge.compile.graph import CompiledGraph

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, m) * 2.0

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 16, generator=gen) for n in (1, 23, 23))
    m = torch.rand(1, 1, 1, 23, generator=gen) > 0.3
    args = [t.to("neuron") for t in (q, k, v, m)]
    torch._dynamo.reset()
    made: list[CompiledGraph] = []
    init = CompiledGraph.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    CompiledGraph.__init__ = record
    try:
        compiled = torch.compile(fn, backend="neuron")
        outs = [compiled(*args).cpu() for _ in range(2)]
    finally:
        CompiledGraph.__init__ = init
    assert any(n.target is values_call for g in made for n in g.module.graph.nodes)
    eager = fn(*args).cpu()
    assert torch.equal(outs[0], eager) and torch.equal(outs[1], eager)
    torch.testing.assert_close(outs[0], fn(q, k, v, m), rtol=1e-5, atol=1e-5)
    q[0, 0, 0, 0] = float("inf")
    args[0] = q.to("neuron")
    got = compiled(*args).cpu()
    assert not got.isfinite().all()
    torch.testing.assert_close(got, fn(*args).cpu(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, fn(q, k, v, m), rtol=1e-5, atol=1e-5, equal_nan=True)


_UNARY = [torch.tanh, torch.sigmoid, torch.relu, F.silu, lambda x: x * x, lambda x: torch.rsqrt(x.abs() + 1.0),
          lambda x: torch.exp(x.clamp(-4, 4)), lambda x: x.float(), lambda x: x.to(torch.bfloat16),
          lambda x: torch.softmax(x, -1), lambda x: x - x.mean(-1, keepdim=True), lambda x: x.sum(-1, keepdim=True)]
_BINARY = [torch.add, torch.mul, torch.sub, lambda x, y: torch.where(x > 0, x, y), torch.maximum,
           lambda x, y: x * 0.5 + y]


def _random_program(rng):
    """A chain of elementwise and row ops over two inputs, as the fusion pass takes them."""
    steps = [(rng.randrange(2), rng.randrange(len(_UNARY) if k % 2 else len(_BINARY))) for k in range(rng.randint(3, 7))]

    def fn(x, y):
        a, b = x, y
        for k, (which, op) in enumerate(steps):
            if k % 2:
                a = _UNARY[op](a) if which else a
                b = b if which else _UNARY[op](b)
            else:
                c = _BINARY[op](a, b.to(a.dtype))
                a, b = (c, b) if which else (a, c)
        return (a.float() + b.float()).tanh()
    return fn


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_give_their_first_calls_values(seed):
    """Random chains of elementwise and row ops, fp32/bf16/fp16: every later call (generated
    code) bit for bit the first call's path, regions hit."""
    import random

    rng = random.Random(seed)
    fn = _random_program(rng)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    rows, cols = rng.choice([(8, 16), (32, 48), (5, 7)])
    gen = torch.Generator().manual_seed(seed)
    args = [torch.randn(rows, cols, generator=gen).to(dtype).to("neuron") for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    with _generic() as rec:
        first, first_figs = _calls(compiled, args, 2)
    kernels = {r[0] for r in rec}
    later, later_figs = _calls(compiled, args, 2)
    assert kernels and all(p.run is not None for k in kernels for p in k.plans.values())
    for got in first[1:] + later:
        assert torch.equal(got.view(torch.uint8), first[0].view(torch.uint8))
    assert all(f == first_figs[1] for f in later_figs)


def test_last_uses_names_each_intermediate_once_after_its_last_reader():
    """graph.last_uses (the region code's and the foreach region's drops): an intermediate read
    twice goes after its second reader; inputs and outputs are never dropped."""
    from torch_bridge.compile.fusion import last_uses

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.tanh.default, (x,))
    b = g.call_function(torch.ops.aten.mul.Tensor, (a, 0.5))
    c = g.call_function(torch.ops.aten.mul.Tensor, (b, a))
    d = g.call_function(torch.ops.aten.sub.Tensor, (c, x))
    g.output(d)
    nodes = [a, b, c, d]
    assert last_uses(nodes, (x, d)) == {2: [a, b], 3: [c]}
    assert last_uses(nodes, (x, c, d)) == {2: [a, b]}


def test_generated_code_drops_intermediates_as_it_goes():
    """The region's generated code deletes each intermediate after the step that reads it last
    (held to the end, a big region's values outgrow the cache), never an input or a result."""
    def fn(x, b):
        t = torch.tanh(x + b)
        return t * 0.5 - t * x
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(64, 96, generator=gen).to("neuron"), torch.randn(96, generator=gen).to("neuron")]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    with _generic() as rec:
        first = compiled(*args).cpu()
    rk = rec[0][0]
    src = next(iter(rk.plans.values())).run.source
    dropped = [name.strip() for line in src.splitlines() if line.strip().startswith("del ")
               for name in line.strip()[4:].split(",")]
    assert dropped and len(dropped) == len(set(dropped)), src
    assert all(name.startswith("n") for name in dropped), src  # steps only: no input view (v*) or head
    later = compiled(*args).cpu()
    assert torch.equal(later, first)
    torch.testing.assert_close(later, fn(*[a.cpu() for a in args]), rtol=1e-5, atol=1e-5)


def test_a_result_that_views_an_input_keeps_that_memory():
    """A region whose result is a view of one of its inputs (here ``view`` of a matmul's result,
    which no other node keeps) returns a view of that input, not a relabelled host view: a host
    view does not own its memory, so the result pointed at memory the graph then freed, and new
    allocations overwrote it (found with Gemma 2's static-cache generate: tokens went to 0 from
    the second decode step)."""
    def fn(x, w, r):
        h = torch.mm(x, w).view(2, 4, 64)
        var = h.pow(2).mean(-1, keepdim=True)
        return (h + r) * torch.rsqrt(var + 1e-6), h.view(8, 64)

    gen = torch.Generator().manual_seed(4)
    host = [torch.randn(8, 32, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(2, 4, 64, generator=gen)]
    want = fn(*host)
    args = [t.to("neuron") for t in host]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    with _generic() as rec:
        first = compiled(*args)  # RegionKernel._call
    assert any("view" in r[0].label for r in rec)
    later = compiled(*args)  # the generated code
    junk = [torch.full((8, 64), 7.0, device="neuron") for _ in range(32)]  # reuses freed memory
    for got in (first, later):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
    assert all(j.cpu().eq(7.0).all() for j in junk)


def test_dead_intermediates_take_the_results_of_pointwise_steps_in_place():
    """The generated code writes a pointwise step's result into its first operand when that is
    an intermediate of the region read there for the last time (RegionKernel._reuse): the first
    call's values bit for bit. Inputs and results are left alone (here ``y``, a result of the
    region: its slice ``z`` is taken outside it and read at the end)."""
    def fn(x, b):
        y = x * 2.0 + b
        z = y.view(-1)[:96]
        w = torch.tanh(y * 3.0) * 0.5
        return w + 1.0 - z.view(1, 96)

    gen = torch.Generator().manual_seed(5)
    host = [torch.randn(64, 96, generator=gen), torch.randn(96, generator=gen)]
    args = [t.to("neuron") for t in host]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="neuron")
    with _generic() as rec:
        first = compiled(*args).cpu()
    later = [compiled(*args).cpu() for _ in range(2)]
    assert all(torch.equal(x, first) for x in later)
    assert torch.equal(first, fn(*host))  # (the same kernels one by one)
    rk = rec[0][0]
    run = next(iter(rk.plans.values())).run
    steps = rk._steps
    reused = {str(steps[j][1]) for j in run.reused}
    assert "aten.tanh.default" in reused, run.source
    for j in run.reused:
        a = steps[j][2][0][1]
        assert a not in rk.inputs and a not in rk.outputs
    by_three = [j for j, s in enumerate(steps) if s[1] is torch.ops.aten.mul.Tensor and 3.0 in [a for _, a in s[2]]]
    assert by_three and not set(by_three) & set(run.reused)  # y, a result


def test_reuse_leaves_an_intermediate_whose_view_is_read_later():
    """RegionKernel._reuse on a hand-made region: ``tanh(a)`` may not write into ``a`` while a
    view of ``a`` is read after it, and may when none is; inputs and results are never written."""
    from torch_bridge.compile.fusion import last_uses

    aten = torch.ops.aten

    def plan(with_view):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        a = g.call_function(aten.mul.Tensor, (x, 2.0))
        nodes = [a]
        v = None
        if with_view:
            v = g.call_function(aten.view.default, (a, [6, 8]))
            nodes.append(v)
        b = g.call_function(aten.tanh.default, (a,))
        c = g.call_function(aten.add.Tensor, (b, v if with_view else b))
        nodes += [b, c]
        g.output(c)
        rk = RegionKernel.__new__(RegionKernel)
        rk.nodes, rk.inputs, rk.outputs, rk.head = nodes, [x], [c], None
        rk._steps = rk._compile_steps()
        xs = torch.randn(6, 8)
        env = {x: xs}
        for n in nodes:
            env[n] = n.target(*[env[y] if isinstance(y, torch.fx.Node) else y for y in n.args])
        return {str(rk._steps[j][1]) for j in rk._reuse(env, last_uses(nodes, (x, c)))}

    assert plan(False) == {"aten.tanh.default"}  # (add's operand b is read twice there: not freed)
    assert plan(True) == {"aten.add.Tensor"}  # a's view is read by add: tanh leaves a alone
