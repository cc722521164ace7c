"""torch_bridge.nki.nki_op: a trnsim.nki kernel as a torch custom op on neuron tensors - values
from the kernel (bit for bit nki.run's), its cost the kernel's own cycle report in the run report
under the op's name, eager and inside torch.compile (one graph node), a backward kernel, in-place
kernels (mutates_args), and the one-line errors users read."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import trnsim.nki as nki
import trnsim.nki.language as nl
from torch_bridge.compile import graph as compile_graph
from torch_bridge.nki import NkiOpError, family_of, nki_op


@nki.jit
def square(x):
    """y = x * x over 128-row tiles of x[R, C] (R a multiple of 128, C <= 512)."""
    R, C = x.shape
    assert R % 128 == 0, "rows must be a multiple of 128"
    y = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(R // 128):
        t = nl.load(x[r * 128:(r + 1) * 128, :])
        nl.store(y[r * 128:(r + 1) * 128, :], value=nl.multiply(t, t))
    return y


@nki.jit
def square_bwd(x, grad):
    """The derivative of square: dx = 2 * x * grad."""
    R, C = x.shape
    dx = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(R // 128):
        t = nl.load(x[r * 128:(r + 1) * 128, :])
        g = nl.load(grad[r * 128:(r + 1) * 128, :])
        nl.store(dx[r * 128:(r + 1) * 128, :], value=nl.multiply(nl.multiply(t, g), 2.0))
    return dx


@nki.jit
def scale_(x, factor=2.0):
    """x *= factor, in place (the kernel writes its input and returns nothing)."""
    R, C = x.shape
    for r in nl.affine_range(R // 128):
        t = nl.load(x[r * 128:(r + 1) * 128, :])
        nl.store(x[r * 128:(r + 1) * 128, :], value=nl.multiply(t, factor))


@nki.jit
def sum_and_diff(a, b):
    """(a + b, a - b): two outputs."""
    R, C = a.shape
    s = nl.ndarray((R, C), dtype=a.dtype, buffer=nl.shared_hbm)
    d = nl.ndarray((R, C), dtype=a.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(R // 128):
        x = nl.load(a[r * 128:(r + 1) * 128, :])
        y = nl.load(b[r * 128:(r + 1) * 128, :])
        nl.store(s[r * 128:(r + 1) * 128, :], value=nl.add(x, y))
        nl.store(d[r * 128:(r + 1) * 128, :], value=nl.subtract(x, y))
    return s, d


SQUARE = nki_op("nkitest::square", square, backward=square_bwd)
SCALE = nki_op("nkitest::scale_", scale_, mutates_args=("x",))
SUM_DIFF = nki_op("nkitest::sum_and_diff", sum_and_diff, outputs=2)


def _x(rows: int = 256, cols: int = 384, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_eager_values_are_the_kernels_and_the_row_its_cycle_report():
    x = _x()
    xn = x.to("neuron")
    with torch.neuron.report_scope() as scope:
        y = SQUARE(xn)
    assert y.device.type == "neuron" and y.shape == x.shape and y.dtype == x.dtype
    own = nki.run(square, x.numpy())
    np.testing.assert_array_equal(y.cpu().numpy(), own.outputs)  # the kernel's own instruction stream
    torch.testing.assert_close(y.cpu(), x * x, rtol=0, atol=0)  # one fp32 multiply per element
    rep = scope.report
    assert [r.op for r in rep.rows] == ["nkitest::square"] and rep.launches == 1
    row = rep.row("nkitest::square")
    assert row.kernel == "nki:square" and row.calls == 1 and not row.generic
    assert row.time_us == pytest.approx(own.report.total_us, rel=1e-9)
    assert torch.ops.nkitest.square(x.to("neuron")).cpu().equal(y.cpu())  # also as torch.ops.<ns>.<name>


def test_bf16_values_match_nki_run_and_repeated_calls_are_charged_each_time():
    x = _x(dtype=torch.bfloat16, seed=1)
    xn = x.to("neuron")
    with torch.neuron.report_scope() as scope:
        a = SQUARE(xn)
        b = SQUARE(xn)
    own = nki.run(square, x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(a.cpu().view(torch.int16).numpy(), own.outputs.view(np.int16))
    assert a.cpu().equal(b.cpu())
    row = scope.report.row("nkitest::square")
    assert row.calls == 2 and row.time_us == pytest.approx(2 * own.report.total_us, rel=1e-9)
    assert family_of(SQUARE).spec([own.outputs]).dtype == "bf16"


def test_two_outputs():
    a, b = _x(128, 64, seed=2), _x(128, 64, seed=3)
    s, d = SUM_DIFF(a.to("neuron"), b.to("neuron"))
    assert s.cpu().equal(a + b) and d.cpu().equal(a - b)


def test_compiled_graph_holds_the_op_as_one_node_with_eager_values_and_cost(monkeypatch):
    graphs: list[torch.fx.GraphModule] = []
    init = compile_graph.CompiledGraph.__init__

    def record(self, gm, kind):
        graphs.append(gm)
        init(self, gm, kind)

    monkeypatch.setattr(compile_graph.CompiledGraph, "__init__", record)
    x = _x(seed=4).to("neuron")
    with torch.neuron.report_scope() as eager:
        want = SQUARE(x) + 1.0
    fn = torch.compile(lambda t: SQUARE(t) + 1.0, backend="neuron", fullgraph=True)
    fn(x)  # compile
    with torch.neuron.report_scope() as compiled:
        got = fn(x)
    assert got.cpu().equal(want.cpu())
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and "nkitest" in str(n.target)]
    assert [str(n.target) for n in calls] == ["nkitest.square.default"]
    row_e, row_c = eager.report.row("nkitest::square"), compiled.report.row("nkitest::square")
    assert row_c.calls == 1 and row_c.time_us == pytest.approx(row_e.time_us, rel=1e-9)


def test_backward_kernel_is_the_ops_derivative_eager_and_compiled():
    x = _x(seed=5)
    xn = x.to("neuron").requires_grad_()
    with torch.neuron.report_scope() as scope:
        SQUARE(xn).backward(torch.ones_like(xn))
    torch.testing.assert_close(xn.grad.cpu(), 2 * x, rtol=0, atol=0)
    row = scope.report.row("nkitest::square_backward")
    assert row.kernel == "nki:square_bwd" and row.calls == 1
    own = nki.run(square_bwd, x.numpy(), np.ones_like(x.numpy())).report
    assert row.time_us == pytest.approx(own.total_us, rel=1e-9)

    xc = x.to("neuron").requires_grad_()
    fn = torch.compile(lambda t: SQUARE(t).sum(), backend="neuron")
    fn(xc).backward()
    torch.testing.assert_close(xc.grad.cpu(), 2 * x, rtol=0, atol=0)


def test_without_a_backward_kernel_differentiating_raises_torchs_error():
    a = _x(128, 64).to("neuron").requires_grad_()
    s, _ = SUM_DIFF(a, a.detach())
    with pytest.raises(RuntimeError, match="does not require grad|no autograd formula|not implemented"):
        s.sum().backward()


def test_in_place_kernel_writes_the_device_memory_eager_and_compiled():
    x = _x(128, 64, seed=6)
    xn = x.to("neuron")
    assert SCALE(xn, 3.0) is None
    assert xn.cpu().equal(x * 3.0)
    with torch.neuron.report_scope() as scope:
        SCALE(xn)  # the default factor
    assert xn.cpu().equal(x * 6.0) and scope.report.row("nkitest::scale_").kernel == "nki:scale_"

    def step(t):
        SCALE(t, 0.5)
        return t + 0.0

    out = torch.compile(step, backend="neuron")(xn)
    assert xn.cpu().equal(x * 3.0) and out.cpu().equal(x * 3.0)


def test_schema_is_read_off_the_kernel_signature():
    assert str(SQUARE._opoverload._schema) == "nkitest::square(Tensor x) -> Tensor"
    assert str(SCALE._opoverload._schema) == "nkitest::scale_(Tensor(a!) x, float factor=2.) -> ()"
    assert str(SUM_DIFF._opoverload._schema) == "nkitest::sum_and_diff(Tensor a, Tensor b) -> (Tensor, Tensor)"


# ---- the one-line errors ------------------------------------------------------------------------
def _line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_call_errors_are_one_line():
    with pytest.raises(NkiOpError) as e:
        SQUARE(_x())
    assert _line(e) == ("nkitest::square: argument 'x' is on cpu; an NKI op runs on neuron tensors "
                        "(move it with .to('neuron'))")
    with pytest.raises(NkiOpError) as e:
        SQUARE(_x(dtype=torch.float64).to("neuron"))
    assert _line(e) == ("nkitest::square: argument 'x' is torch.float64; an NKI kernel takes float32, bfloat16, "
                        "float16, float8_e4m3fn, float8_e5m2, int8/16/32, uint8 or bool tensors: cast it")
    with pytest.raises(NkiOpError) as e:
        SQUARE(_x(100, 64).to("neuron"))
    line = next(i for i, text in enumerate(open(__file__), 1) if text.strip().startswith("assert R % 128"))
    assert _line(e) == f"nkitest::square: test_nki_op.py:{line}: AssertionError: rows must be a multiple of 128"
    if torch.neuron.device_count() > 1:
        with pytest.raises(NkiOpError) as e:
            SUM_DIFF(_x(128, 64).to("neuron:0"), _x(128, 64).to("neuron:1"))
        assert _line(e) == "nkitest::sum_and_diff: arguments are on neuron:0 and neuron:1; an NKI kernel runs on one " \
                           "NeuronCore"


def test_registration_errors_are_one_line():
    with pytest.raises(NkiOpError) as e:
        nki_op("unscoped", square)
    assert _line(e) == "nki_op: the op name must be 'namespace::name', got 'unscoped'"
    with pytest.raises(NkiOpError) as e:
        nki_op("nkitest::square", square)
    assert _line(e) == "nki_op: nkitest::square is already registered"
    with pytest.raises(NkiOpError) as e:
        nki_op("nkitest::bad_mutation", square, mutates_args=("q",))
    assert _line(e) == "nki_op nkitest::bad_mutation: mutates_args names 'q', which the kernel does not take"
    with pytest.raises(NkiOpError) as e:
        nki_op("nkitest::bad_outputs", square, outputs=-1)
    assert _line(e) == "nki_op nkitest::bad_outputs: outputs must be a count of tensors (>= 0), got -1"

    def many(*xs):
        return xs[0]

    with pytest.raises(NkiOpError) as e:
        nki_op("nkitest::varargs", nki.jit(many))
    assert _line(e) == "nki_op nkitest::varargs: the kernel takes *xs; give the op's schema with schema="

    @nki.jit
    def needs_two_grads(x, g1, g2):
        return x

    with pytest.raises(NkiOpError) as e:
        nki_op("nkitest::bad_backward", square, backward=needs_two_grads)
    assert _line(e) == ("nki_op nkitest::bad_backward: backward kernel needs_two_grads takes 2 gradient argument(s) "
                        "after the forward's 1 tensor(s); the op has 1 output(s)")


def test_undeclared_writes_and_wrong_output_counts_fail_at_the_call():
    undeclared = nki_op("nkitest::scale_undeclared", scale_, outputs=0)
    with pytest.raises(NkiOpError) as e:
        undeclared(_x(128, 64).to("neuron"))
    assert _line(e) == ("nkitest::scale_undeclared: the kernel writes its argument 'x'; register the op with "
                        "mutates_args=('x',)")
    one = nki_op("nkitest::sum_and_diff_one", sum_and_diff)
    with pytest.raises(NkiOpError) as e:
        one(_x(128, 64).to("neuron"), _x(128, 64).to("neuron"))
    assert _line(e) == ("nkitest::sum_and_diff_one: the kernel returns 2 tensors, but the op was registered with "
                        "outputs=1; register it with outputs=2")


def test_library_kernel_as_an_op_on_lnc2():
    """A transformer library kernel (trnsim.nki.library) as an nki_op launched on the logical
    core's grid: the attention values against its reference, one launch charged."""
    from trnsim.kernels import get_kernel
    from trnsim.nki import library as nkilib

    attn = nkilib.kernel("attention_tkg", window=64)
    op = nki_op("test_nkilib::attention_tkg", attn[2], outputs=1)
    e = get_kernel("attention_tkg")
    shape, p = (2, 4, 1, 1, 256, 64), {**e.params, "window": 64}
    inp = e.inputs(shape, "bf16", p, np.random.default_rng(0))
    ts = [torch.from_numpy(inp[n]).to(torch.bfloat16 if inp[n].dtype == np.float32 else torch.int32).to("neuron")
          for n in nkilib.signature(attn)[0]]
    out = op(*ts).float().cpu().numpy()
    ref = e.reference(inp, shape, "bf16", p)["out"]
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()
