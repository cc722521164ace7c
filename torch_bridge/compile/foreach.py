"""Multi-tensor regions: a compiled optimizer step's ``_foreach_*`` chain as one kernel.

``torch.compile(opt.step)`` gives an aot graph of functional ``_foreach_*`` ops over lists of
tensors (parameters, gradients, optimizer state, step counts), followed by one ``copy_`` per
updated tensor back into the graph input it replaces (functionalization). Run op by op, every
foreach op streams every list through HBM and every ``copy_`` is a launch of its own; Inductor
instead emits one foreach kernel that reads each tensor once and stores the results in place.
:func:`partition_foreach` finds such a chain: foreach ops over lists of one length, the
``getitem`` of their results, ``full_like`` constants (the ``lerp`` weight of a capturable
AdamW, read as an immediate) and the ``copy_`` into graph inputs nothing else reads. Element
``i`` of every list has the shape of tensor ``i`` (or is a one-element step count), so the
chain is one elementwise :class:`~trnsim.kernels.fused.Program` per index, written here for
index 0 (the program is the same for every index; a ``ScalarList`` operand's immediates differ,
which costs the same) and run by the ``foreach_fused`` kernel over every tensor, the ``copy_``
becoming its in-place stores.

:class:`ForeachKernel` computes the values with the ops' own CPU kernels on zero-copy views, in
graph order: bit for bit what the graph's ops compute when run one by one (eager), since they are
the same kernels. An op whose result only replaces its first list (an input it stores into, or a
temporary nothing reads again) runs as its in-place overload, as the optimizer's eager step does,
so the ``copy_`` back becomes a no-op (:func:`_inplace_plan`); the charged kernel is unchanged.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from trnsim.device import FusedRegion, KernelSpec
from trnsim.isa import KernelError
from trnsim.kernels.fused import FULL, SCALAR, Program

from ..eager import lowering, memory, values
from ..runtime import runtime
from .fusion import Builder, Unfusable, last_uses, prune_inputs, scalar_arg, trn_dtype, node_value

__all__ = ["ForeachRegion", "ForeachKernel", "partition_foreach", "FOREACH"]

aten = torch.ops.aten

# ---- the op table: one list index of each foreach op as program steps -------------------------
# a handler gets the builder, the op's list operands at the index (value ids, or floats for
# full_like constants), its scalar arguments and keyword arguments; returns the value id
Handler = Callable[[Builder, list[Any], list[Any], dict[str, Any]], int]
FOREACH: dict[Any, Handler] = {}


def _reg(*names: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for nm in names:
            packet, _, overload = nm.partition(".")
            FOREACH[getattr(getattr(aten, packet), overload or "default")] = fn
        return fn
    return deco


def _num(x: Any) -> float:
    if isinstance(x, fx.Node):
        raise Unfusable("a tensor where a number was expected")
    return scalar_arg(x)


def _mul_by(b: Builder, x: Any, c: float) -> Any:
    if isinstance(x, float):
        return x * c
    return x if c == 1.0 else b.ts(x, "multiply", c)


def _bin(b: Builder, op: str, x: Any, y: Any) -> int:
    """``x op y`` where either may be a constant (a full_like) or a value."""
    if isinstance(x, float) and isinstance(y, float):
        raise Unfusable("an op on two constants")
    if isinstance(y, float):
        return b.ts(x, op, y)
    if isinstance(x, float):
        return b.ts(y, op, x, rev=True)
    return b.tt(op, x, y)


def _elementwise(op: str) -> Handler:
    """``_foreach_<op>``: .Scalar / .ScalarList (an immediate), .List (with alpha), .Tensor."""
    def handle(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
        x = lists[0]
        alpha = _num(kw.get("alpha", 1))
        if len(lists) > 1:
            return _bin(b, op, x, _mul_by(b, lists[1], alpha))
        return b.ts(x, op, _num(scalars[0]) * (alpha if op in ("add", "subtract") else 1.0))
    return handle


for _op, _alu in (("_foreach_add", "add"), ("_foreach_sub", "subtract"), ("_foreach_mul", "multiply"),
                  ("_foreach_div", "divide"), ("_foreach_maximum", "maximum"), ("_foreach_minimum", "minimum")):
    _reg(f"{_op}.Scalar", f"{_op}.List", f"{_op}.ScalarList")(_elementwise(_alu))


def _act(fn: str) -> Handler:
    return lambda b, lists, scalars, kw: b.act(fn, lists[0])


for _op, _fn in (("_foreach_sqrt", "sqrt"), ("_foreach_exp", "exp"), ("_foreach_log", "log"),
                 ("_foreach_sigmoid", "sigmoid"), ("_foreach_tanh", "tanh"), ("_foreach_rsqrt", "rsqrt"),
                 ("_foreach_reciprocal", "reciprocal")):
    _reg(_op)(_act(_fn))


@_reg("_foreach_neg")
def _neg(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
    return b.ts(lists[0], "multiply", -1.0)


@_reg("_foreach_abs")
def _abs(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
    return b.ts(lists[0], "abs_max", 0.0)


@_reg("_foreach_pow.ScalarAndTensor")
def _pow_st(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
    return b.ts(lists[0], "power", _num(scalars[0]), rev=True)  # base ** x


@_reg("_foreach_pow.Scalar", "_foreach_pow.ScalarList")
def _pow_s(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
    e = _num(scalars[0])
    return b.act("square", lists[0]) if e == 2.0 else b.ts(lists[0], "power", e)


def _addc(op: str) -> Handler:
    """``self + value * (t1 op t2)`` (addcmul / addcdiv)."""
    def handle(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
        s, t1, t2 = lists[:3]
        value = _num(scalars[0]) if scalars else _num(kw.get("value", 1))
        if isinstance(t1, float) and op == "multiply":
            prod = _mul_by(b, t2, t1 * value)
        elif isinstance(t2, float):
            prod = _mul_by(b, t1, (t2 if op == "multiply" else 1.0 / t2) * value)
        else:
            prod = _mul_by(b, _bin(b, op, t1, t2), value)
        return _bin(b, "add", s, prod)
    return handle


_reg("_foreach_addcmul.Scalar", "_foreach_addcmul.ScalarList")(_addc("multiply"))
_reg("_foreach_addcdiv.Scalar", "_foreach_addcdiv.ScalarList")(_addc("divide"))


@_reg("_foreach_lerp.Scalar", "_foreach_lerp.List", "_foreach_lerp.ScalarList")
def _lerp(b: Builder, lists: list[Any], scalars: list[Any], kw: dict[str, Any]) -> int:
    s, end = lists[:2]
    d = _bin(b, "subtract", end, s)
    w = lists[2] if len(lists) > 2 else _num(scalars[0])
    return _bin(b, "add", s, _mul_by(b, d, w) if isinstance(w, float) else b.tt("multiply", d, w))


# ---- regions ------------------------------------------------------------------------------------
def _split_args(n: fx.Node) -> tuple[list[list[Any]], list[Any]]:
    """A foreach call's list operands (lists of nodes) and its other positional arguments."""
    lists, scalars = [], []
    for a in n.args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            lists.append(list(a))
        elif isinstance(a, (list, tuple)):
            scalars.append(a[0] if a else None)  # a ScalarList: index 0's immediate (each costs the same)
        elif isinstance(a, fx.Node):
            raise Unfusable("a tensor operand that is not a list")
        else:
            scalars.append(a)
    return lists, scalars


def _length(n: fx.Node) -> int | None:
    if n.op != "call_function" or n.target not in FOREACH:
        return None
    try:
        lists, _ = _split_args(n)
    except Unfusable:
        return None
    lens = {len(x) for x in lists}
    vals = [node_value(x) for lst in lists for x in lst]
    if len(lens) != 1 or any(not isinstance(v, torch.Tensor) for v in vals):
        return None
    # on the device; a host scalar (a step count of a non-capturable optimizer) is the kernel's argument
    if not any(v.device.type == "neuron" for v in vals) or any(v.device.type != "neuron" and v.dim() > 0
                                                               for v in vals):
        return None
    return lens.pop()


@dataclass
class ForeachRegion:
    """A chain of foreach ops run as one multi-tensor kernel; built by :meth:`build`."""

    length: int
    nodes: list[fx.Node] = field(default_factory=list)
    head: None = None
    program: Program | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    sizes: tuple[int, ...] = ()
    inplace: tuple[tuple[int, int], ...] = ()
    dtype: str = "fp32"
    host_scalars: bool = False

    def build(self) -> None:
        members = set(self.nodes)
        consts = {n for n in self.nodes if n.target is aten.full_like.default}
        copies = [n for n in self.nodes if n.target is aten.copy_.default]
        ops = [n for n in self.nodes if n.target in FOREACH]
        if len(ops) < 2:
            raise Unfusable("a region of one foreach op runs as that op's kernel")
        # program inputs: lists of outside tensors, keyed by their index-0 node
        lists_of: dict[fx.Node, tuple[fx.Node, ...]] = {}
        for n in ops:
            for lst in _split_args(n)[0]:
                if lst[0] in members:
                    if any(x not in members for x in lst):
                        raise Unfusable("a list mixing region values and outside tensors")
                    continue
                if any(x in members for x in lst):
                    raise Unfusable("a list mixing region values and outside tensors")
                if lists_of.setdefault(lst[0], tuple(lst)) != tuple(lst):
                    raise Unfusable("two lists share a first tensor but differ")
        for c in consts:
            if any(u not in members for u in c.users):
                raise Unfusable("a full_like read outside the region")
        full = [lst for lst in lists_of.values() if node_value(lst[0]).dim() > 0]
        if not full:
            raise Unfusable("no parameter-sized list")
        sizes = []
        for i in range(self.length):
            ns = {node_value(lst[i]).numel() for lst in full}
            if len(ns) != 1 or any(not node_value(lst[i]).is_contiguous() for lst in full):
                raise Unfusable(f"the tensors at index {i} differ in size or are not contiguous")
            sizes.append(ns.pop())
        for lst in lists_of.values():
            if any((node_value(x).dim() > 0) != (node_value(lst[0]).dim() > 0) or node_value(x).dtype != node_value(lst[0]).dtype
                   or not node_value(x).dtype.is_floating_point for x in lst):
                raise Unfusable("a list mixing scalars and tensors or dtypes, or of a non-float dtype")
        t0 = node_value(full[0][0])
        b = Builder(("1", str(max(t0.numel(), 1))))
        for node in lists_of:
            v = node_value(node)
            kind = SCALAR if v.dim() == 0 else FULL
            b.inputs.append((node, kind, trn_dtype(v.dtype)))
            b.kinds.append(kind)
            b.values[node] = len(b.inputs) - 1
        per: dict[fx.Node, Any] = {}  # node -> its index-0 value (an id, or a float constant)
        for node in lists_of:
            per[node] = b.values[node]
        for n in self.nodes:
            if n.target is operator.getitem:
                if n.args[1] == 0:
                    per[n] = per[n.args[0]]
            elif n in consts:
                per[n] = _num(n.args[1])
            elif n.target in FOREACH:
                lists, scalars = _split_args(n)
                kw = dict(n.kwargs)
                per[n] = FOREACH[n.target](b, [per[lst[0]] for lst in lists], scalars, kw)
        # in-place stores: copy_(input at index i, result at index i), the same input list for every i
        pos = {x: (k, i) for k, (node, lst) in enumerate(lists_of.items()) for i, x in enumerate(lst)}
        stores: dict[tuple[fx.Node, int], set[int]] = {}  # (foreach node, input k) -> indices stored
        for c in copies:
            dst, src = c.args[0], c.args[1]
            if dst not in pos or src.target is not operator.getitem or src.args[0] not in members:
                raise Unfusable("a copy_ that is not a store of a result into an input list")
            if any(u not in members and u is not c for u in dst.users):
                raise Unfusable("an updated input read outside the region")
            k, i = pos[dst]
            if i != src.args[1] or node_value(dst).shape != node_value(src).shape or node_value(dst).dtype != node_value(src).dtype:
                raise Unfusable("a copy_ into another index, shape or dtype")
            stores.setdefault((src.args[0], k), set()).add(i)
        outputs, inplace = [], []
        for (fe, k), idx in stores.items():
            if idx != set(range(self.length)):
                raise Unfusable("a result stored into some of a list's tensors only")
            inplace.append((len(outputs), k))
            outputs.append((per[fe], b.inputs[k][2]))
        self.outputs = [n for n in self.nodes if n not in copies and any(u not in members for u in n.users)]
        for n in self.outputs:
            if n.target is not operator.getitem:
                raise Unfusable("a whole result list read outside the region")
        for fe in dict.fromkeys(n.args[0] for n in self.outputs):
            outputs.append((per[fe], trn_dtype(node_value(fe)[0].dtype)))
        prog = Program(tuple((k, d) for _, k, d in b.inputs), tuple(b.steps), tuple(outputs))
        pruned, keep = prune_inputs(prog)
        remap = {old: new for new, old in enumerate(sorted(keep))}
        self.program = pruned
        self.program.kinds()
        self.inplace = tuple((j, remap[k]) for j, k in inplace)
        self.inputs = [x for lst in lists_of.values() for x in lst]
        for c in consts:  # a full_like's shape operand from outside the region
            for a in c.all_input_nodes:
                if a not in members and a not in self.inputs:
                    self.inputs.append(a)
        self.sizes = tuple(sizes)
        # scalars the host holds (a non-capturable step's bias corrections): the kernel's arguments
        scalar_lists = [lst for lst in lists_of.values() if node_value(lst[0]).dim() == 0]
        self.host_scalars = bool(scalar_lists) and all(node_value(x).device.type == "cpu" for lst in scalar_lists
                                                       for x in lst)
        self.dtype = trn_dtype(t0.dtype)


def partition_foreach(gm: fx.GraphModule) -> list[ForeachRegion]:
    """Multi-tensor regions of ``gm`` (module docstring), each valid (its program builds)."""
    group: dict[fx.Node, int] = {}
    regions: list[ForeachRegion] = []
    anc: dict[fx.Node, frozenset[int]] = {}
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        chosen: int | None = None
        if n.op == "call_function" and n.target is aten.full_like.default:
            anc[n] = frozenset()  # reads its operand's shape only: a constant of the region that uses it
            continue
        length = _length(n)
        if length is not None:
            data = [a for a in ins if not (a.op == "call_function" and a.target is aten.full_like.default)]
            # a producer's region, else the latest region of this length (an op on outside lists only,
            # e.g. the first use of a state list, joins the chain rather than starting a region)
            latest = [gi for gi in range(len(regions) - 1, -1, -1) if regions[gi].length == length][:1]
            for gi in [group[a] for a in data if a in group] + latest:
                if regions[gi].length != length:
                    continue
                if all(group.get(u) == gi or gi not in anc.get(u, frozenset()) for u in data):
                    chosen = gi
                    break
            if chosen is None:
                regions.append(ForeachRegion(length))
                chosen = len(regions) - 1
            for a in ins:
                if a.op == "call_function" and a.target is aten.full_like.default and a not in group:
                    group[a] = chosen
                    regions[chosen].nodes.append(a)
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            chosen = group.get(n.args[0])
        elif (n.op == "call_function" and n.target is aten.copy_.default and n.args[0].op == "placeholder"
              and isinstance(n.args[1], fx.Node)):
            chosen = group.get(n.args[1])
        if chosen is not None:
            regions[chosen].nodes.append(n)
            group[n] = chosen
        a_set: set[int] = set()
        for a in ins:
            a_set |= anc.get(a, frozenset())
            if a in group and not (a.op == "call_function" and a.target is aten.full_like.default):
                a_set.add(group[a])
        anc[n] = frozenset(a_set)
    good = []
    for r in regions:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        r.nodes.sort(key=order.__getitem__)
        try:
            r.build()
        except Unfusable:
            continue
        good.append(r)
    return good


# ---- running one ----------------------------------------------------------------------------------
#: elements of each list a group of indices holds (2 MiB of fp32: the group's tensors stay in the
#: caches across the chain's ops; of 2^16 to 2^20, the fastest for the small GPT-2's compiled AdamW
#: chain, 13 ops over 13 MB lists): :meth:`ForeachKernel._group_plan`
GROUP_ELEMENTS = 1 << 19


def _cpu(x: Any, env: dict[fx.Node, Any]) -> Any:
    if isinstance(x, fx.Node):
        return env[x]
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(y, env) for y in x)
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("cpu")
    return x


def _inplace_plan(r: ForeachRegion) -> tuple[dict[fx.Node, Any], tuple[fx.Node, ...]]:
    """Which foreach ops of ``r`` may run as their in-place overload on the CPU values, with the
    same values: ``{op node: in-place overload}`` and the region inputs they write (which
    :func:`_distinct` checks share memory with no other input).

    ``_foreach_X(a, ...)`` may write its result into ``a`` when nothing reads ``a[i]``'s memory
    after the op but the op's own result: ``a[i]`` a temporary (a functional op's fresh result,
    or an in-place result on one), or an input the region stores into at the end (its ``copy_``),
    read by nothing but that ``copy_``. A ``copy_`` whose source is by then its destination does
    nothing (:meth:`ForeachKernel.__call__`). The in-place overload runs the same CPU kernel per
    tensor as the functional one (the foreach ops on CPU loop over the tensors), so the values are
    bit for bit the same; it saves an allocation per tensor per op and the pass of each ``copy_``
    it makes redundant. Inductor's foreach kernel stores in place the same way."""
    order = {n: i for i, n in enumerate(r.nodes)}
    members = set(r.nodes)
    outputs = set(r.outputs)
    stored = {c.args[0] for c in r.nodes if c.target is aten.copy_.default}
    root: dict[fx.Node, fx.Node] = {}  # a value -> the value that owns its memory
    group: dict[fx.Node, list[fx.Node]] = {}  # an owner -> the values sharing its memory so far
    ops: dict[fx.Node, Any] = {}
    written: list[fx.Node] = []

    def owner(x: fx.Node) -> fx.Node:
        return root.get(x, x)

    def read_after(x: fx.Node, n: fx.Node) -> bool:
        """Is the memory of ``x`` read after ``n`` (but by a copy_ storing into the input it is)?"""
        own = owner(x)
        for y in group.get(own, [own]):
            for u in y.users:
                if u is n or order.get(u, len(order)) < order[n]:
                    continue
                if not (u.target is aten.copy_.default and u.args[0] is y and y is own and y not in members):
                    return True
        return False

    for n in r.nodes:
        if n.target is operator.getitem:
            src = n.args[0]
            if src in ops:  # an in-place op's result is its first list's tensor
                root[n] = owner(src.args[0][n.args[1]])
            group.setdefault(owner(n), []).append(n)
            continue
        if n.target not in FOREACH:
            continue
        inplace = _inplace_of(n)
        getitems = [u for u in n.users if u.target is operator.getitem]
        selfs = n.args[0] if n.args and isinstance(n.args[0], (list, tuple)) else ()
        ok = bool(inplace is not None and selfs and all(isinstance(x, fx.Node) for x in selfs)
                  and not any(u in outputs for u in getitems) and len(n.users) == len(getitems))
        if ok:
            res = node_value(n)
            for i, x in enumerate(selfs):
                v, own = node_value(x), owner(x)
                fresh = own in members and own.target is operator.getitem  # a functional op's result
                if (v.shape != res[i].shape or v.dtype != res[i].dtype or not (fresh or (own not in members and own in stored))
                        or any(owner(y) is own and j != i for a in n.args if isinstance(a, (list, tuple))
                               for j, y in enumerate(a) if isinstance(y, fx.Node))
                        or read_after(x, n)):
                    ok = False
                    break
        if ok:
            ops[n] = inplace
            written.extend(owner(x) for x in selfs if owner(x) not in members)
    return ops, tuple(written)


def _inplace_of(n: fx.Node) -> Any:
    packet = getattr(aten, n.target.overloadpacket.__name__ + "_", None)
    return getattr(packet, n.target._overloadname, None) if packet is not None else None


def _immediates(nodes: Sequence[fx.Node], inplace: dict[fx.Node, Any]) -> frozenset[fx.Node]:
    """The ``full_like`` constants (a capturable AdamW's lerp weight, one per parameter) whose
    value the host may hold as one element broadcast to the shape instead of a filled tensor:
    a number as the value, read only by foreach ops, never in a list an in-place op writes
    (:func:`_inplace_plan` picks none; checked). The foreach ops' CPU kernels read a broadcast
    operand element by element as they read a filled one (the same value at every index, the
    same vectorised and scalar stretches, set by the other operands' layout), so the results are
    the same bits; a filled copy per parameter cost the small GPT-2's compiled AdamW step ~1.5 ms
    of host time (52 fills of 12.8 MB in all) that the eager step, whose lerp takes a number,
    never spends. The charged kernel is unchanged (it reads the weight as an immediate)."""
    written = {x for n in inplace for x in (n.args[0] if n.args and isinstance(n.args[0], (list, tuple)) else ())}
    out = []
    for n in nodes:
        if n.target is not aten.full_like.default or n in written or len(n.args) != 2:
            continue
        if not isinstance(n.args[1], (int, float)) or isinstance(n.args[1], bool):
            continue
        kw = n.kwargs
        if set(kw) - {"dtype", "layout", "device", "pin_memory", "memory_format"} or kw.get("pin_memory") or \
                kw.get("layout") not in (None, torch.strided):
            continue
        if all(u.target in FOREACH for u in n.users):
            out.append(n)
    return frozenset(out)


def _storages(env: dict[fx.Node, Any]) -> dict[int, int]:
    """How many of the region's tensor inputs lie in each storage (by its address): read once a
    call by :func:`_distinct` and :func:`_apart`."""
    seen: dict[int, int] = {}
    for t in env.values():
        if isinstance(t, torch.Tensor):
            p = t.untyped_storage().data_ptr()
            seen[p] = seen.get(p, 0) + 1
    return seen


def _distinct(env: dict[fx.Node, Any], written: tuple[fx.Node, ...], storages: dict[int, int]) -> bool:
    """No tensor an in-place op writes shares memory with another input of the region (then the
    writes would reach a tensor the graph reads as it was: run the functional ops instead);
    ``storages``: :func:`_storages` of ``env``."""
    return all(storages[env[x].untyped_storage().data_ptr()] == 1 for x in written)


def _apart(storages: dict[int, int]) -> bool:
    """Every tensor input in memory of its own (no two share a storage; ``storages``:
    :func:`_storages`): then a group's stores reach no tensor a later group reads, and running
    the chain group by group is running it over whole lists. Parameters in one flat buffer run
    over whole lists."""
    return all(c == 1 for c in storages.values())


def _meta(v: Any) -> torch.Tensor:
    return torch.empty(v.shape, dtype=v.dtype, device="meta")


class ForeachKernel:
    """A :class:`ForeachRegion` run as one ``foreach_fused`` launch (module docstring)."""

    record: list[tuple[Any, ...]] | None = None  # as RegionKernel.record: (kernel, spec, inputs, outputs)

    def __init__(self, region: ForeachRegion, index: int):
        self.region = region
        self.nodes = region.nodes
        self.head = None
        self.inputs = region.inputs
        self.outputs = region.outputs
        names = [n.target.overloadpacket.__name__ for n in self.nodes if hasattr(n.target, "overloadpacket")]
        self.ops = tuple(names)
        self.label = "compiled:foreach:" + "+".join(dict.fromkeys(nm.removeprefix("_foreach_") for nm in names))
        self.index = index
        self.plan: tuple[list[tuple[str, Any]], KernelSpec | None] | None = None
        self.in_place: tuple[dict[fx.Node, Any], tuple[fx.Node, ...]] | None = None  # _inplace_plan's
        self.immediates: frozenset[fx.Node] = frozenset()  # _immediates(), with the in-place plan
        self._splats: dict[fx.Node, tuple[Any, torch.Tensor]] = {}  # their values, kept between calls
        self.copies = 0  # the copy_ stores the last call made (the others were made by in-place ops)
        self._drop: dict[int, list[fx.Node]] | None = None  # graph.last_uses of the nodes, on the first call
        self._groups: list[tuple[int, int, tuple[int, ...]]] | None | bool = False  # _group_plan, on the first call
        self.__name__ = f"foreach_region{index}"

    def __repr__(self) -> str:
        return f"<foreach region {self.index}: {self.label}>"

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        with memory.host_scope():  # the functional ops' new lists come from the host cache
            return self._call(*args)

    def _call(self, *args: Any) -> tuple[torch.Tensor, ...]:
        device = next((a.device.index or 0 for a in args if values.is_neuron(a)), 0)
        env: dict[fx.Node, Any] = {n: (memory.cpu_view(a) if values.is_neuron(a) else a)
                                   for n, a in zip(self.inputs, args)}
        if self.in_place is None:
            self.in_place = _inplace_plan(self.region)
            self.immediates = _immediates(self.nodes, self.in_place[0])
        if self._groups is False:
            self._groups = self._group_plan()
        # (each input's storage, read once: the in-place ops' and the groups' conditions)
        storages = _storages(env) if self.in_place[1] or self._groups is not None else {}
        ops = self.in_place[0] if _distinct(env, self.in_place[1], storages) else {}
        self.copies = 0
        if self._groups is not None and _apart(storages):
            self._run_groups(env, ops, self._groups)
        else:
            self._run(env, ops)
        # (an in-place op's list is its input's: a result in an input's memory is a view of that input)
        outs = tuple(values.result_over(env[n].contiguous(), args, device) for n in self.outputs)
        if self.plan is None:
            self.plan = self._plan()
        rt = runtime()
        for op, cost in self.plan[0]:
            rt.charge(device, op, cost)
        if ForeachKernel.record is not None:
            ForeachKernel.record.append((self, self.plan[1], args, outs))
        return outs

    def _step(self, n: fx.Node, env: dict[fx.Node, Any], ops: dict[fx.Node, Any], args: list[Any],
              kw: dict[str, Any]) -> None:
        """Node ``n`` (not a getitem) on its CPU values ``args``/``kw`` (lists already resolved)."""
        if n.target is aten.copy_.default:
            # the kernel's in-place store; already made by an in-place op (the same tensor)
            dst, src = args[0], args[1]
            if src is not dst:
                dst.copy_(src)
                self.copies += 1
            env[n] = dst
        elif n in self.immediates:
            env[n] = self._splat(n, args[0], n.args[1], n.kwargs.get("dtype"))
        elif n in ops:
            ops[n](*args, **kw)  # an in-place foreach op returns nothing: its result is its first list
            env[n] = args[0]
        else:
            env[n] = n.target(*args, **kw)

    def _run(self, env: dict[fx.Node, Any], ops: dict[fx.Node, Any]) -> None:
        """The chain op by op over whole lists, in graph order."""
        if self._drop is None:
            self._drop = last_uses(self.nodes, (*self.inputs, *self.outputs))
        drop = self._drop
        for i, n in enumerate(self.nodes):
            if n.target is operator.getitem:
                env[n] = env[n.args[0]][n.args[1]]
            else:
                self._step(n, env, ops, _cpu(n.args, env), {k: _cpu(v, env) for k, v in n.kwargs.items()})
            for x in drop.get(i, ()):  # (a list of parameter-sized tensors read for the last time)
                del env[x]

    def _run_groups(self, env: dict[fx.Node, Any], ops: dict[fx.Node, Any],
                    groups: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """The chain group by group of list indices (:meth:`_group_plan`): every op over the
        group's tensors, then the next group. Each foreach op on CPU runs its kernel tensor by
        tensor, so an op over a group's tensors computes, bit for bit, what the op over the whole
        lists computes for them; the group's tensors stay in the cache from one op to the next
        instead of streaming every list through memory once per op (the compiled AdamW step of
        the small GPT-2: 13 ops over 13 MB lists)."""
        nodes, length, outputs = self.nodes, self.region.length, set(self.outputs)

        def part(x: Any, a: int, b: int) -> Any:
            if isinstance(x, (list, tuple)) and len(x) == length:
                return [env[y] if isinstance(y, fx.Node) else y for y in x[a:b]]
            return _cpu(x, env)

        for a, b, positions in groups:
            made = []
            for j in positions:
                n = nodes[j]
                if n.target is operator.getitem:
                    env[n] = env[n.args[0]][n.args[1] - a]
                else:
                    self._step(n, env, ops, [part(x, a, b) for x in n.args],
                               {k: part(v, a, b) for k, v in n.kwargs.items()})
                made.append(n)
            for n in made:  # the group's lists and tensors, read by no later group (its outputs stay)
                if n not in outputs:
                    env.pop(n, None)

    def _group_plan(self) -> list[tuple[int, int, tuple[int, ...]]] | None:
        """Groups of consecutive list indices of about :data:`GROUP_ELEMENTS` elements a list
        (one index at least), each with the positions of the nodes it runs: every foreach op,
        and the nodes of its own indices (a getitem, a ``full_like``, a ``copy_``: each belongs
        to one index). None (the ops over whole lists) for a chain under two groups, or whose
        structure is not that: a list operand of another length, a tensor operand outside the
        lists, a whole list read outside the region."""
        r, nodes = self.region, self.nodes
        if len(r.sizes) != r.length or sum(r.sizes) < 2 * GROUP_ELEMENTS:
            return None
        fe = {n for n in nodes if n.target in FOREACH}
        where: dict[fx.Node, int] = {}  # a per-index node -> its index

        def place(x: fx.Node, i: int) -> bool:
            return where.setdefault(x, i) == i

        for n in fe:
            for x in (*n.args, *n.kwargs.values()):
                if isinstance(x, (list, tuple)):
                    if len(x) != r.length:
                        return None
                    if not all(place(y, i) for i, y in enumerate(x) if isinstance(y, fx.Node)):
                        return None
                elif isinstance(x, fx.Node) and x not in fe:
                    return None
        for n in nodes:
            if n in fe:
                continue
            if n.target is operator.getitem:
                if n.args[0] not in fe or not place(n, n.args[1]):
                    return None
            elif n.target is aten.copy_.default:
                src = n.args[1]
                if src not in where or not place(n, where[src]) or where.get(n.args[0], where[src]) != where[src]:
                    return None
            elif n not in where:
                return None
        if any(n not in where for n in self.outputs):
            return None
        bounds, a, count = [], 0, 0
        for i, size in enumerate(r.sizes):
            if count and count + size > GROUP_ELEMENTS:
                bounds.append((a, i))
                a, count = i, 0
            count += size
        bounds.append((a, r.length))
        if len(bounds) < 2:
            return None
        return [(a, b, tuple(j for j, n in enumerate(nodes) if n in fe or a <= where[n] < b)) for a, b in bounds]

    def _splat(self, n: fx.Node, like: torch.Tensor, value: Any, dtype: torch.dtype | None) -> torch.Tensor:
        """``full_like(like, value, dtype=dtype)``'s value as one element broadcast to ``like``'s
        shape (:func:`_immediates`), made once per shape and dtype."""
        dt = dtype if dtype is not None else like.dtype
        key = (like.shape, dt)
        got = self._splats.get(n)
        if got is None or got[0] != key:
            got = self._splats[n] = (key, torch.full((), value, dtype=dt).expand(like.shape))
        return got[1]

    def _eager(self) -> list[tuple[str, KernelSpec | None]]:
        """The kernels the region's ops launch when run one by one."""
        specs: list[tuple[str, KernelSpec | None]] = []
        for n in self.nodes:
            if n.target is operator.getitem:
                continue
            if n.target is aten.copy_.default:
                specs.append(("_copy_from", lowering.copy_spec("copy_d2d", _meta(node_value(n.args[1])),
                                                               _meta(node_value(n.args[0])))))
            elif n.target is aten.full_like.default:
                specs.append(("fill_", lowering.generic_spec("fill_", [], [_meta(node_value(n))])))
            else:
                lists = [[_meta(node_value(x)) for x in a] for a in n.args if isinstance(a, (list, tuple))
                         and a and isinstance(a[0], fx.Node)]
                out = [_meta(v) for v in node_value(n)] if isinstance(node_value(n), (list, tuple)) else []
                name = n.target.overloadpacket.__name__
                specs.append((name, lowering.fused_spec(name, lists, [], out)))
        return specs

    def _plan(self) -> tuple[list[tuple[str, Any]], KernelSpec | None]:
        rt = runtime()
        eager = [(op, rt.cost(spec, "empty")) for op, spec in self._eager()]
        r = self.region
        spec = KernelSpec.of("foreach_fused", (len(r.sizes), sum(r.sizes)), r.dtype,
                             {"program": r.program, "sizes": r.sizes, "inplace": r.inplace,
                              "scalar_args": r.host_scalars})
        try:
            cost = rt.cost(spec)
        except KernelError:
            return eager, None
        if cost.ticks > sum(c.ticks for _, c in eager):
            return eager, None  # both simulated: keep the faster, as a compiler's cost model would
        region = FusedRegion(self.ops, len(eager), sum(c.hbm_bytes for _, c in eager), sum(c.ticks for _, c in eager))
        return [(self.label, dataclasses.replace(cost, region=region))], spec
