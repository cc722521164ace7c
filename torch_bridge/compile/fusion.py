"""Which nodes of an aten graph fuse, and into what: regions and their tile programs.

A *region* is a set of graph nodes one NeuronCore kernel runs (:mod:`trnsim.kernels.fused`): ops
on one ``[rows, cols]`` layout (rows = leading dims, cols = the last), elementwise or reducing
along a row or down the columns, optionally headed by the matmul whose PSUM evacuation they
become. :func:`partition` grows regions greedily in graph order: a node joins the region of one
of its producers when it has the region's layout and joining makes no cycle (no path from the
region back into the node through a node outside it). Metadata only: shapes, dtypes and strides
of the nodes' fake values; dims are compared as expressions, so dynamic shapes fuse too.

:data:`STEPS` is the table from aten ops to program steps; an op not in it (or a call it cannot
read) is not fused and runs as its eager kernel.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from trnsim.kernels.fused import COL, FULL, ROW, SCALAR, Program

__all__ = ["Region", "partition", "STEPS", "MATMULS", "layout_of", "Unfusable"]

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}


class Unfusable(Exception):
    """A node (or a call of it) the program table cannot express."""


def node_value(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _dim(d: Any) -> str:
    return str(d)


def layout_of(t: Any) -> tuple[str, str] | None:
    """(rows, cols) of a tensor value as comparable expressions: rows = numel / last dim."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    cols = t.shape[-1]
    rows = 1
    for d in t.shape[:-1]:
        rows = rows * d
    return _dim(rows), _dim(cols)


def kind_of(t: torch.Tensor, key: tuple[str, str]) -> str | None:
    """How tensor ``t`` sits in a region of layout ``key``: full, row (per column), col (per row),
    scalar, or None (it does not)."""
    rows, cols = key
    if t.numel() == 1 or t.dim() == 0:
        return SCALAR
    lk = layout_of(t)
    if lk == key and t.is_contiguous():
        return FULL
    shape = [_dim(d) for d in t.shape]
    if shape[-1] == cols and all(d == "1" for d in shape[:-1]) and cols != "1":
        return ROW
    if shape[-1] == "1" and layout_of(t)[0] == rows and t.is_contiguous():  # type: ignore[index]
        return COL
    return None


def last_uses(nodes: Sequence[fx.Node], keep: Sequence[fx.Node]) -> dict[int, list[fx.Node]]:
    """For each position in ``nodes``, the values (nodes) read there for the last time, ``keep``'s
    left out: a region's code drops an intermediate once the op that reads it last has run, as
    FX's own code does. Held to the region's end, its values make a working set far larger than
    eager's, whose results die as they are read: the small GPT-2's GELU region (ten 4 MiB steps)
    then ran each op from memory rather than from the cache, twice as slow (its backward region
    2.1 -> 1.25 ms). Only references go: the values are the same."""
    last: dict[fx.Node, int] = {}
    for j, n in enumerate(nodes):
        for x in n.all_input_nodes:
            last[x] = j
    kept = set(keep)
    out: dict[int, list[fx.Node]] = {}
    for x, j in last.items():
        if x not in kept:
            out.setdefault(j, []).append(x)
    return out


# ---- the program builder --------------------------------------------------------------------
class Builder:
    """Accumulates a region's program: region inputs (outside values) and steps."""

    def __init__(self, key: tuple[str, str]):
        self.key = key
        self.inputs: list[tuple[Any, str, str]] = []  # (fx node, kind, dtype)
        self.steps: list[tuple[Any, ...]] = []
        self.kinds: list[str] = []
        self.values: dict[Any, int] = {}  # fx node (or (node, index)) -> value
        self.head: fx.Node | None = None  # a matmul whose result is input 0

    def input(self, node: fx.Node) -> int:
        if node in self.values:
            return self.values[node]
        v = node_value(node)
        if not isinstance(v, torch.Tensor):
            raise Unfusable(f"input {node} is not a tensor")
        kind = kind_of(v, self.key)
        if kind is None or not v.dtype.is_floating_point:
            raise Unfusable(f"input {node} {tuple(v.shape)} does not fit layout {self.key}")
        idx = len(self.inputs)
        if self.steps:
            raise AssertionError("inputs are added before steps")
        self.inputs.append((node, kind, trn_dtype(v.dtype)))
        self.kinds.append(kind)
        self.values[node] = idx
        return idx

    def kind(self, v: int) -> str:
        return self.kinds[v]

    def add(self, *step: Any) -> int:
        from trnsim.kernels.fused import Program as _P

        self.steps.append(tuple(step))
        prog = _P(tuple((k, d) for _, k, d in self.inputs), tuple(self.steps), ())
        self.kinds = prog.kinds()
        return len(self.kinds) - 1

    # helpers
    def act(self, fn: str, x: int, scale: float = 1.0, bias: float = 0.0) -> int:
        return self.add("act", fn, x, float(scale), float(bias))

    def ts(self, x: int, op0: str, imm0: Any, op1: str | None = None, imm1: Any = None, rev: bool = False) -> int:
        return self.add("ts", x, op0, imm0 if isinstance(imm0, str) else float(imm0), op1,
                        None if imm1 is None else (imm1 if isinstance(imm1, str) else float(imm1)), bool(rev))

    def tt(self, op: str, a: int, b: int) -> int:
        return self.add("tt", op, a, b)

    def red(self, op: str, x: int) -> int:
        return self.add("red", op, x)

    def csum(self, x: int) -> int:
        return self.add("csum", x)

    def mean_row(self, x: int) -> int:
        return self.ts(self.red("add", x), "multiply", "1/cols")


def trn_dtype(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "fp32")


# ---- the op table ---------------------------------------------------------------------------
Handler = Callable[[Builder, fx.Node, Callable[[Any], Any]], Any]
STEPS: dict[Any, Handler] = {}


def _reg(*targets: Any) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for t in targets:
            STEPS[t] = fn
        return fn
    return deco


def scalar_arg(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Unfusable(f"not a number: {x!r}")
    return float(x)


def _binary_op(alu: str, reverse: bool = False) -> Handler:
    def handle(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
        x, y = n.args[0], n.args[1]
        alpha = n.kwargs.get("alpha", 1)
        if reverse:
            x, y = y, x
        if isinstance(y, fx.Node) and isinstance(x, fx.Node):
            vy = val(y)
            if alpha != 1:
                vy = b.ts(vy, "multiply", scalar_arg(alpha))
            return b.tt(alu, val(x), vy)
        if isinstance(x, fx.Node):  # tensor op number
            return b.ts(val(x), alu, scalar_arg(y) * (scalar_arg(alpha) if alu in ("add", "subtract") else 1.0))
        if isinstance(y, fx.Node):  # number op tensor (rsub with a tensor second)
            vy = val(y)
            if alpha != 1:
                vy = b.ts(vy, "multiply", scalar_arg(alpha))
            return b.ts(vy, alu, scalar_arg(x), rev=True)
        raise Unfusable("no tensor operand")
    return handle


_reg(aten.add.Tensor, aten.add.Scalar)(_binary_op("add"))
_reg(aten.sub.Tensor, aten.sub.Scalar)(_binary_op("subtract"))
_reg(aten.rsub.Scalar, aten.rsub.Tensor)(_binary_op("subtract", reverse=True))
_reg(aten.mul.Tensor, aten.mul.Scalar)(_binary_op("multiply"))
_reg(aten.maximum.default)(_binary_op("maximum"))
_reg(aten.minimum.default)(_binary_op("minimum"))


@_reg(aten.div.Tensor, aten.div.Scalar)
def _div(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    if n.kwargs.get("rounding_mode") is not None:
        raise Unfusable("rounding division")
    x, y = n.args[0], n.args[1]
    if isinstance(y, fx.Node):
        return b.tt("divide", val(x), val(y))
    d = scalar_arg(y)
    # by zero: the IEEE reciprocal, +-inf, gives x / +-0 exactly (+-inf, NaN for 0 and NaN); 1.0 / 0
    # was a ZeroDivisionError that failed the compile (found by difftest's long run: div_(0))
    return b.ts(val(x), "multiply", 1.0 / d if d != 0 else math.copysign(math.inf, d))


def _act(fn: str) -> Handler:
    return lambda b, n, val: b.act(fn, val(n.args[0]))


for _t, _fn in {aten.exp.default: "exp", aten.log.default: "log", aten.sqrt.default: "sqrt",
                aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal", aten.sigmoid.default: "sigmoid",
                aten.tanh.default: "tanh", aten.silu.default: "silu", aten.erf.default: "erf",
                aten.sin.default: "sin"}.items():
    STEPS[_t] = _act(_fn)


@_reg(aten.neg.default)
def _neg(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    return b.ts(val(n.args[0]), "multiply", -1.0)


@_reg(aten.relu.default)
def _relu(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    return b.ts(val(n.args[0]), "maximum", 0.0)


@_reg(aten.abs.default)
def _abs(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    return b.ts(val(n.args[0]), "abs_max", 0.0)


@_reg(aten.gelu.default)
def _gelu(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    return b.act("gelu_apprx_tanh" if approx == "tanh" else "gelu", val(n.args[0]))


@_reg(aten.pow.Tensor_Scalar)
def _pow(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    e = scalar_arg(n.args[1])
    x = val(n.args[0])
    if e == 2.0:
        return b.act("square", x)
    if e == 1.0:
        return x
    return b.ts(x, "power", e)


@_reg(aten.tanh_backward.default)
def _tanh_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    g, y = val(n.args[0]), val(n.args[1])
    return b.tt("multiply", g, b.ts(b.act("square", y), "multiply", -1.0, "add", 1.0))  # g * (1 - y^2)


@_reg(aten.sigmoid_backward.default)
def _sigmoid_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    g, y = val(n.args[0]), val(n.args[1])
    return b.tt("multiply", b.tt("multiply", g, y), b.ts(y, "multiply", -1.0, "add", 1.0))  # g * y * (1 - y)


@_reg(aten.gelu_backward.default)
def _gelu_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    approx = n.kwargs.get("approximate", n.args[2] if len(n.args) > 2 else "none")
    if approx != "none":
        raise Unfusable("tanh gelu backward")
    g, x = val(n.args[0]), val(n.args[1])
    cdf = b.ts(b.act("erf", x, 1.0 / math.sqrt(2.0)), "add", 1.0, "multiply", 0.5)
    pdf = b.act("exp", b.act("square", x), -0.5)
    d = b.tt("add", cdf, b.tt("multiply", x, b.ts(pdf, "multiply", 1.0 / math.sqrt(2.0 * math.pi))))
    return b.tt("multiply", g, d)


@_reg(aten.silu_backward.default)
def _silu_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    g, x = val(n.args[0]), val(n.args[1])
    s = b.act("sigmoid", x)
    inner = b.ts(b.tt("multiply", x, b.ts(s, "multiply", -1.0, "add", 1.0)), "add", 1.0)  # 1 + x (1 - s)
    return b.tt("multiply", g, b.tt("multiply", s, inner))


@_reg(aten.threshold_backward.default)
def _threshold_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    # grad where x > threshold else 0, as grad * (x > threshold): equal for finite gradients
    g, x, thr = val(n.args[0]), val(n.args[1]), scalar_arg(n.args[2])
    return b.tt("multiply", g, b.ts(x, "greater", thr))


def _identity(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    return val(n.args[0])


for _t in (aten.clone.default, aten.alias.default, aten.detach.default):
    STEPS[_t] = _identity


@_reg(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    src, out = node_value(n.args[0]), node_value(n)
    if layout_of(src) != layout_of(out) or not src.is_contiguous():
        raise Unfusable("a view that changes the row layout")
    return val(n.args[0])


@_reg(aten.masked_fill.Scalar)
def _masked_fill(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    # only a causal mask (a node marked meta["causal"] = d: torch.triu(ones, d) over the last two
    # dims, broadcast over the leading ones): GpSimd makes it from the indices, it is never loaded
    x, mask, value = n.args[0], n.args[1], n.args[2]
    diag, m, out = _causal(mask), node_value(mask), node_value(n)
    if diag is None or m.dim() < 2 or out.dim() < 2 or tuple(m.shape[-2:]) != tuple(out.shape[-2:]) or \
            any(d != 1 for d in m.shape[:-2]):
        raise Unfusable("masked_fill by a mask that is not a causal one")
    return b.add("causal", val(x), scalar_arg(value), int(out.shape[-2]), int(diag))


def _causal(x: Any) -> int | None:
    return x.meta.get("causal") if isinstance(x, fx.Node) else None


@_reg(aten._to_copy.default)
def _to_copy(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    src, out = node_value(n.args[0]), node_value(n)
    if out.device != src.device or not out.dtype.is_floating_point:
        raise Unfusable("a copy to another device or a non-float dtype")
    x = val(n.args[0])
    return x if out.dtype == src.dtype else b.add("cast", x, trn_dtype(out.dtype))


def _last_dim(n: fx.Node, dim: Any) -> bool:
    nd = node_value(n.args[0]).dim()
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return len(dims) == 1 and dims[0] % nd == nd - 1


def _softmax_steps(b: Builder, x: int) -> int:
    e = b.act("exp", b.tt("subtract", x, b.red("max", x)))
    return b.tt("divide", e, b.red("add", e))


@_reg(aten._softmax.default, aten._safe_softmax.default)
def _softmax(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    if not _last_dim(n, n.args[1]):
        raise Unfusable("softmax over another dim")
    return _softmax_steps(b, val(n.args[0]))


@_reg(aten._log_softmax.default)
def _log_softmax(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    if not _last_dim(n, n.args[1]):
        raise Unfusable("log_softmax over another dim")
    x = val(n.args[0])
    s = b.tt("subtract", x, b.red("max", x))
    return b.tt("subtract", s, b.act("log", b.red("add", b.act("exp", s))))


@_reg(aten._softmax_backward_data.default)
def _softmax_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    if not _last_dim(n, n.args[2]):
        raise Unfusable("softmax backward over another dim")
    g, y = val(n.args[0]), val(n.args[1])
    return b.tt("multiply", y, b.tt("subtract", g, b.red("add", b.tt("multiply", g, y))))


@_reg(aten._log_softmax_backward_data.default)
def _log_softmax_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
    if not _last_dim(n, n.args[2]):
        raise Unfusable("log_softmax backward over another dim")
    g, y = val(n.args[0]), val(n.args[1])
    return b.tt("subtract", g, b.tt("multiply", b.act("exp", y), b.red("add", g)))


def _reduction(op: str, mean: bool = False) -> Handler:
    def handle(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> int:
        src = node_value(n.args[0])
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if n.kwargs.get("dtype") is not None:
            raise Unfusable("a reduction with a dtype")
        nd = src.dim()
        dims = sorted({d % nd for d in ([dims] if isinstance(dims, int) else list(dims or []))})
        x = val(n.args[0])
        if dims == [nd - 1] and nd >= 1:
            if not keepdim and nd > 1:
                raise Unfusable("a row reduction that drops the dim (its output has another layout)")
            r = b.red(op, x)
            return b.ts(r, "multiply", "1/cols") if mean else r
        if op == "add" and not mean and dims == list(range(nd - 1)) and nd >= 2:
            return b.csum(x)  # down the columns: every leading dim
        raise Unfusable("a reduction over other dims")
    return handle


_reg(aten.sum.dim_IntList)(_reduction("add"))
_reg(aten.mean.dim)(_reduction("add", mean=True))
_reg(aten.amax.default)(_reduction("max"))
_reg(aten.amin.default)(_reduction("min"))


@_reg(aten.native_layer_norm.default)
def _layer_norm(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> tuple[int, int, int]:
    x, shape, w, bias, eps = n.args[:5]
    if len(shape) != 1:
        raise Unfusable("layer norm over several dims")
    vx = val(x)
    mean = b.mean_row(vx)
    xc = b.tt("subtract", vx, mean)
    rstd = b.act("rsqrt", b.ts(b.red("add", b.act("square", xc)), "multiply", "1/cols", "add", scalar_arg(eps)))
    y = b.tt("multiply", xc, rstd)
    if w is not None:
        y = b.tt("multiply", y, val(w))
    if bias is not None:
        y = b.tt("add", y, val(bias))
    return y, mean, rstd


@_reg(aten.native_layer_norm_backward.default)
def _layer_norm_bwd(b: Builder, n: fx.Node, val: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
    g, x, shape, mean, rstd, w, bias, mask = n.args[:8]
    if len(shape) != 1:
        raise Unfusable("layer norm over several dims")
    vg, vx = val(g), val(x)
    vr = val(rstd)
    xhat = b.tt("multiply", b.tt("subtract", vx, val(mean)), vr)
    gw = b.tt("multiply", vg, val(w)) if w is not None else vg
    c1 = b.mean_row(b.tt("multiply", gw, xhat))
    c2 = b.mean_row(gw)
    dx = b.tt("multiply", vr, b.tt("subtract", b.tt("subtract", gw, c2), b.tt("multiply", xhat, c1)))
    dw = b.csum(b.tt("multiply", vg, xhat)) if mask[1] and w is not None else None
    db = b.csum(vg) if mask[2] and bias is not None else None
    return dx, dw, db


# ---- regions --------------------------------------------------------------------------------
@dataclass
class Region:
    """A group of graph nodes run as one kernel; ``program`` is built by :meth:`build`."""

    key: tuple[str, str]
    nodes: list[fx.Node] = field(default_factory=list)
    head: fx.Node | None = None  # a matmul whose PSUM evacuation the other nodes become
    program: Program | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    kernel_inputs: list[int] = field(default_factory=list)

    def build(self) -> None:
        """The program, inputs (outside nodes) and outputs (nodes used outside) of the region."""
        members = set(self.nodes) | ({self.head} if self.head is not None else set())
        b = Builder(self.key)
        outside: list[fx.Node] = []
        head = self.head
        if head is not None:
            b.inputs.append((None, FULL, "fp32"))  # input 0: the matmul's fp32 PSUM result
            b.kinds.append(FULL)
            if head.target is aten.addmm.default:
                outside.append(head.args[0])
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in outside and _causal(a) is None:  # a causal mask is not read
                    outside.append(a)
        for a in outside:
            b.input(a)
        if head is not None:
            v = 0
            if head.target is aten.addmm.default:
                beta, alpha = head.kwargs.get("beta", 1), head.kwargs.get("alpha", 1)
                if alpha != 1:
                    v = b.ts(v, "multiply", scalar_arg(alpha))
                if beta != 0:
                    c = b.values[head.args[0]]
                    if beta != 1:
                        c = b.ts(c, "multiply", scalar_arg(beta))
                    v = b.tt("add", v, c)
            b.values[head] = v
        for n in self.nodes:
            emit_node(b, n)
        self.outputs = [n for n in ([self.head] if self.head is not None else []) + self.nodes
                        if any(u not in members for u in n.users) and b.values.get(n) is not None]
        for n in self.outputs:
            v = node_value(n)
            if not isinstance(v, torch.Tensor):
                raise Unfusable(f"region output {n} is not a tensor")
        outs = tuple((b.values[n], trn_dtype(node_value(n).dtype)) for n in self.outputs)
        self.program, keep = prune_inputs(Program(tuple((k, d) for _, k, d in b.inputs), tuple(b.steps), outs))
        self.program.kinds()
        self.inputs = [a for a, _, _ in b.inputs if a is not None]
        # which of the region's inputs (after a head's two operands) the kernel's inputs are
        self.kernel_inputs = [j for j, i in enumerate(i for i, (a, _, _) in enumerate(b.inputs) if a is not None)
                              if i in keep]
        if head is not None:  # the matmul's operands first: the runner computes input 0 from them
            self.inputs = list(head.args[1:3] if head.target is aten.addmm.default else head.args[:2]) + self.inputs
        ops = [n for n in self.nodes if n.target not in _IDENTITY]
        if not self.program.steps or (self.head is None and len(ops) < 2):
            raise Unfusable("a region of one op runs as that op's eager kernel")


def prune_inputs(p: Program) -> tuple[Program, set[int]]:
    """``p`` without the inputs no step or output reads (an op's argument its fused form does
    not need, e.g. a layer norm backward's bias); returns the kept input indices too."""
    from trnsim.kernels.fused import step_args

    used = {a for st in p.steps for a in step_args(st)} | {v for v, _ in p.outputs} | {0}
    n_in = len(p.inputs)
    keep = [i for i in range(n_in) if i in used]
    remap = {old: new for new, old in enumerate(keep)}
    for j in range(len(p.steps)):
        remap[n_in + j] = len(keep) + j

    def fix(st: tuple[Any, ...]) -> tuple[Any, ...]:
        op = st[0]
        if op == "act":
            return (op, st[1], remap[st[2]], *st[3:])
        if op == "tt":
            return (op, st[1], remap[st[2]], remap[st[3]])
        if op == "red":
            return (op, st[1], remap[st[2]])
        return (op, remap[st[1]], *st[2:])

    return Program(tuple(p.inputs[i] for i in keep), tuple(fix(st) for st in p.steps),
                   tuple((remap[v], d) for v, d in p.outputs)), set(keep)


_IDENTITY = {operator.getitem, aten.clone.default, aten.alias.default, aten.detach.default, aten.view.default,
             aten._unsafe_view.default, aten.reshape.default}


def emit_node(b: Builder, n: fx.Node) -> None:
    if n.target is operator.getitem:
        src, i = n.args
        vals = b.values.get(src)
        if not isinstance(vals, tuple) or vals[i] is None:
            raise Unfusable("getitem of a value the region does not have")
        b.values[n] = vals[i]
        return
    handler = STEPS.get(n.target)
    if handler is None:
        raise Unfusable(f"{n.target} has no fused form")

    def val(x: Any) -> int:
        if not isinstance(x, fx.Node):
            raise Unfusable(f"a non-tensor operand {x!r}")
        v = b.values.get(x)
        if v is None or isinstance(v, tuple):
            raise Unfusable(f"operand {x} is not a region value")
        return v

    b.values[n] = handler(b, n, val)


def _fusable(n: fx.Node) -> tuple[str, str] | None:
    """The layout key of a node that may join a region (None: it may not)."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:
        src = n.args[0]
        return _fusable(src) if isinstance(src, fx.Node) else None
    if n.target not in STEPS:
        return None
    tensors = [node_value(a) for a in n.all_input_nodes if not (n.target is aten.masked_fill.Scalar
                                                                 and _causal(a) is not None)]
    out = node_value(n)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    allv = [t for t in tensors + outs if isinstance(t, torch.Tensor)]
    if not allv or any(not isinstance(t, torch.Tensor) for t in tensors):
        return None
    if any(t.device.type != "neuron" for t in allv):
        return None
    if any(free_unbacked_symbols(t) for t in allv):
        return None  # sizes only the run knows (x[x > 0]): layout checks would guard on them, and fail
    big = max(allv, key=lambda t: (t.dim() > 0, _numel_key(t)))
    key = layout_of(big)
    if key is None:
        return None
    if any(kind_of(t, key) is None for t in allv):
        return None
    if any(t.dtype.is_floating_point is False for t in tensors):
        return None
    return key


def _numel_key(t: torch.Tensor) -> int:
    n = t.numel()
    return n if isinstance(n, int) else 1 << (40 + t.dim())  # symbolic: never int() it (that adds a guard)


def partition(gm: fx.GraphModule) -> list[Region]:
    """Regions of ``gm``'s graph, each valid (its program builds); nodes outside run eagerly."""
    group: dict[fx.Node, int] = {}
    regions: list[Region] = []
    anc: dict[fx.Node, frozenset[int]] = {}
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        key = _fusable(n)
        if key is not None:
            chosen = None
            for a in ins:
                gi = group.get(a)
                if gi is None or regions[gi].key != key:
                    continue
                if all(group.get(u) == gi or gi not in anc.get(u, frozenset()) for u in ins):
                    chosen = gi
                    break
            if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
                chosen = group.get(n.args[0])
                if chosen is None:
                    key = None
            if key is not None:
                if chosen is None:
                    regions.append(Region(key))
                    chosen = len(regions) - 1
                regions[chosen].nodes.append(n)
                group[n] = chosen
        a_set: set[int] = set()
        for a in ins:
            a_set |= anc.get(a, frozenset())
            if a in group:
                a_set.add(group[a])
        anc[n] = frozenset(a_set)
    _attach_matmuls(gm, regions, group, anc)
    good = []
    for r in regions:
        try:
            r.build()
        except Unfusable:
            continue
        good.append(r)
    return good


def _attach_matmuls(gm: fx.GraphModule, regions: list[Region], group: dict[fx.Node, int],
                    anc: dict[fx.Node, frozenset[int]]) -> None:
    """Make a matmul the head of the region that consumes its result, when that region is
    elementwise on the matmul's [M, N] layout: its ops become the PSUM evacuation."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in MATMULS:
            continue
        out = node_value(n)
        if not isinstance(out, torch.Tensor) or out.device.type != "neuron" or out.dtype not in (
                torch.float32, torch.bfloat16, torch.float16):
            continue
        users = [u for u in n.users]
        gis = {group.get(u) for u in users} - {None}
        for gi in sorted(gis):
            r = regions[gi]
            if r.head is not None or r.key != layout_of(out):
                continue
            if any(st in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                          aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default,
                          aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
                          aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
                   for st in (m.target for m in r.nodes)):
                continue
            if any(gi in anc.get(a, frozenset()) for a in n.all_input_nodes):
                continue
            if _feeds_back(n, gi, regions, group):
                continue
            r.head = n
            group[n] = gi  # (a later head's check sees it in its region)
            break


def _feeds_back(n: fx.Node, gi: int, regions: list[Region], group: dict[fx.Node, int]) -> bool:
    """Whether the matmul ``n``, moved into region ``gi`` as its head, would feed that region back:
    a user of ``n`` outside it from which a path (through plain nodes and whole regions, each
    run at once) leads into region ``gi``. CLIP's ``image_embeds / image_embeds.norm()``: the
    projection matmul heads the division's region, whose divisor (the norm's region, then a
    ``pow``) reads the matmul: the two regions then need each other."""
    r = regions[gi]
    members = set(r.nodes)
    members.add(n)
    seen_nodes: set[fx.Node] = set()
    seen_regions: set[int] = set()
    todo = [u for m in members for u in m.users if u not in members]
    while todo:
        u = todo.pop()
        if u in members:
            return True
        if u in seen_nodes:
            continue
        seen_nodes.add(u)
        k = group.get(u)
        if k is None:  # (a node of region gi is a member: returned above)
            todo.extend(u.users)
            continue
        if k in seen_regions:
            continue
        seen_regions.add(k)
        other = regions[k]
        for m in other.nodes + ([other.head] if other.head is not None else []):
            seen_nodes.add(m)
            todo.extend(m.users)
    return False
