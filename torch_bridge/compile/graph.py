"""Running a compiled aten graph on the device: regions as fused kernels, the rest as eager ops,
the whole graph as one launch.

:class:`CompiledGraph` is what the backend returns for each forward or backward graph. Its graph
is the aot graph with every region (:func:`torch_bridge.compile.fusion.partition`) replaced by a
call of a :class:`RegionKernel`, and every multi-tensor region (an optimizer step's foreach chain,
:func:`torch_bridge.compile.foreach.partition_foreach`) by a call of a ``ForeachKernel``; the other nodes are the graph's own aten calls, which run through
the neuron dispatcher exactly as in eager mode (values on the datapath or CPU kernels, each
charged as its eager kernel). The graph's launches are collected and issued as one graph launch
(:meth:`trnsim.device.Device.graph`): a compiled graph is one executable, so the host pays one
dispatch for it, as on Neuron, where a compiled graph is one NEFF.

A region's values are its ops' own results, computed on CPU views of the device memory with
16-bit float operands widened to fp32 and the outputs rounded once to their dtypes (what its
fused kernel computes: intermediates stay in fp32 in SBUF), except that an explicit cast rounds
its 16-bit operand to its dtype first, as eager has it; a matmul head runs on the TensorE
datapath and its fp32 PSUM result feeds the rest. So for fp32 graphs compiled values equal eager
values bit for bit; for bf16/fp16 they differ where eager rounds an intermediate that no cast
reads. The region's
time is one launch of its fused kernel, simulated once per input shape; the report row also
carries what its ops would have cost as eager kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from trnsim.device import FusedRegion, KernelSpec, OpCost
from trnsim.isa import KernelError

from .. import _torch
from ..eager import fastpath, lowering, memory, tensore, values
from ..runtime import runtime
from .attention import values_call
from .foreach import ForeachKernel, ForeachRegion, partition_foreach
from .fusion import Region, last_uses, partition
from .reinplace import reinplace_input_updates

__all__ = ["CompiledGraph", "RegionKernel", "rewrite", "runnable"]

aten = torch.ops.aten
_WIDE = (torch.bfloat16, torch.float16)
# a region node's argument: a node's value (fp32-widened), a constant, a list holding nodes, or a
# node's value rounded to its graph dtype first (what an explicit cast reads: see _compile_steps)
_NODE, _CONST, _LIST, _ROUNDED = 0, 1, 2, 3


def _op_name(n: fx.Node) -> str:
    t = n.target
    return t.overloadpacket.__name__ if hasattr(t, "overloadpacket") else getattr(t, "__name__", str(t))


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "neuron":
        return torch.device("cpu")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(y) for y in x)
    return x


def _concrete(val: Any) -> bool:
    """A graph value whose sizes are all numbers (a tensor's; anything else is one)."""
    if isinstance(val, torch.Tensor):
        return all(type(d) is int for d in val.shape)
    if isinstance(val, (list, tuple)):
        return all(_concrete(v) for v in val)
    return not isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _wide(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _WIDE:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_wide(y) for y in x)
    return x


class _Plan:
    """What one input signature of a region launches: its fused kernel's cost (with the eager
    figures it replaces), or, where the kernel cannot take the shapes, its ops' eager costs."""

    def __init__(self, label: str, costs: list[tuple[str, OpCost]], spec: KernelSpec | None = None):
        self.label, self.costs, self.spec = label, costs, spec  # costs: (op shown in reports, cost)
        #: a value of the region (input, intermediate or result) is of a size the host cache serves:
        #: later calls compute inside memory.host_scope (set by the first call, which made the plan)
        self.big = False
        #: later calls of this signature: RegionKernel._call's steps as straight-line code
        #: (RegionKernel._specialise), None until the first call has made it
        self.run: Any = None


class RegionKernel:
    """A region's nodes run as one fused kernel (see the module docstring)."""

    #: when a list, every call appends (region kernel, its kernel spec or None, inputs, outputs):
    #: how tests check a fused kernel's values against the ops' own
    record: list[tuple[Any, ...]] | None = None

    def __init__(self, region: Region, index: int):
        self.region = region
        self.nodes = region.nodes
        self.head = region.head
        self.inputs = region.inputs
        self.outputs = region.outputs
        names = [_op_name(n) for n in ([self.head] if self.head is not None else []) + self.nodes
                 if n.target is not operator.getitem]
        self.ops = tuple(names)
        self.label = "compiled:" + "+".join(dict.fromkeys(names))
        self.index = index
        self.plans: dict[tuple[Any, ...], _Plan] = {}
        self._steps: list[tuple[Any, ...]] | None = None  # _compile_steps, on the first call
        self.__name__ = f"region{index}"
        #: every input's shape is a number in the graph (no symbol): each call has the first call's
        #: signature and device (the graph's guards), so calls after it go straight to its plan
        self._static = all(_concrete(n.meta.get("val")) for n in self.inputs)
        self._only: tuple[_Plan, int] | None = None  # (the plan, the device), once it has its run

    def __repr__(self) -> str:
        return f"<region {self.index}: {self.label}>"

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        only = self._only
        if only is not None and RegionKernel.record is None:  # (a static region's later calls)
            plan, device = only
            if not plan.big:
                return plan.run(args, device)
            with memory.host_scope():
                return plan.run(args, device)
        device = next((a.device.index or 0 for a in args if values.is_neuron(a)), 0)
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        plan = self.plans.get(key)
        if plan is not None and plan.run is not None and RegionKernel.record is None:
            if self._static:
                self._only = (plan, device)
            if not plan.big:
                return plan.run(args, device)
            with memory.host_scope():
                return plan.run(args, device)
        if plan is None or not plan.big:  # (a scope costs ~1 us: small regions go without)
            return self._call(device, key, plan, args)
        with memory.host_scope():
            return self._call(device, key, plan, args)

    def _head(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        """The matmul head's fp32 result, with addmm's bias ``c`` added (the program goes on from it):
        the datapath's PSUM result, unless it is not finite and its operands' products may
        overflow (:func:`tensore.bounded`), where CPU's kernel gives it (eager mm/addmm's rule)."""
        addmm = self.head.target is aten.addmm.default
        if addmm:
            beta, alpha = self.head.kwargs.get("beta", 1), self.head.kwargs.get("alpha", 1)
        if not tensore.on_datapath(a, b):
            p = torch.mm(a.float(), b.float())
        else:
            p = tensore.matmul_f32(a, b)
            if addmm:
                p = values._add_scaled(p, c, alpha, beta)
            if tensore.all_finite(p) or tensore.bounded(a.shape[-1], a, b):
                return p
            p = torch.mm(a, b).float()  # products that may overflow: CPU's kernel (tensore.bounded)
        return values._add_scaled(p, c, alpha, beta) if addmm else p

    def _call(self, device: int, key: tuple[Any, ...], plan: _Plan | None, args: tuple[Any, ...]
              ) -> tuple[torch.Tensor, ...]:
        views = memory.cpu_views(args)
        env: dict[fx.Node, Any] = {}
        for n, v in zip(self.inputs[2 if self.head is not None else 0:], views[2 if self.head is not None else 0:]):
            env[n] = v
        if self.head is not None:
            env[self.head] = self._head(views[0], views[1], self._bias(env))
        steps = self._steps
        if steps is None:
            steps = self._steps = self._compile_steps()
        for n, target, sargs, skw in steps:
            if target is None:  # getitem
                env[n] = env[sargs][skw]
                continue
            fargs = [_wide(env[a]) if kind == _NODE else a if kind == _CONST else
                     env[a[0]].to(a[1]) if kind == _ROUNDED else
                     _wide([env[x] if isinstance(x, fx.Node) else x for x in a]) for kind, a in sargs]
            kw = {k: _wide(env[v]) if node else v for k, node, v in skw}
            env[n] = target(*fargs, **kw)
        outs = []
        for n in self.outputs:
            want = n.meta["val"].dtype
            t = env[n]
            if t.dtype != want:
                t = t.to(want)
            # (a view op's result over an input: a view of that input, never a second owner)
            outs.append(values.result_over(t.contiguous(), args, device))
        if plan is None:
            plan = self.plans[key] = self._plan(args, env)
            plan.big = any(isinstance(v, torch.Tensor) and v.numel() * v.element_size() >= memory.host_cache_min()
                           for v in env.values())
            try:
                plan.run = self._specialise(plan, args, env)
            except Exception:  # (a structure it does not write out: every call walks the ops, as before)
                plan.run = None
        rt = runtime()
        for op, cost in plan.costs:
            if not fastpath.launch(device, op, cost):  # (logged natively, as the fast path's ops are)
                rt.charge(device, op, cost)
        if RegionKernel.record is not None:
            RegionKernel.record.append((self, plan.spec, args, tuple(outs)))
        return tuple(outs)

    def _bias(self, env: dict[fx.Node, Any]) -> torch.Tensor | None:
        """addmm's bias (an input of the region) for :meth:`_head`."""
        return env[self.head.args[0]] if self.head.target is aten.addmm.default else None

    def _specialise(self, plan: _Plan, args: Sequence[Any], env: dict[fx.Node, Any]) -> Any:
        """:meth:`_call` for the later calls of ``plan``'s signature as one generated function
        ``run(args, device)``: the same calls in the same order (views, head, steps, results,
        launches) with what the first call found out written in. Which values are 16-bit floats
        (widened to fp32 where a step reads them) and which results need a dtype conversion follow
        from the signature's dtypes, as every op's result dtype follows from its arguments'; so the
        code converts exactly where :meth:`_call` would. The inputs' CPU views come from one
        native call when the first call's inputs were all neuron tensors it takes (any it refuses
        later: :func:`memory.cpu_views`, as :meth:`_call`)."""
        g: dict[str, Any] = {"memory": memory, "_wide": _wide, "fastpath": fastpath, "runtime": runtime}
        names: dict[fx.Node, str] = {}

        def const(v: Any) -> str:
            name = f"k{len(g)}"
            g[name] = v
            return name

        def read(node: fx.Node) -> str:  # a node's value as a step reads it (_wide)
            v, name = env[node], names[node]
            if isinstance(v, torch.Tensor):
                return f"{name}.float()" if v.dtype in _WIDE else name
            return f"_wide({name})" if isinstance(v, (list, tuple)) else name

        def constant(v: Any) -> str:
            return f"_wide({const(v)})" if isinstance(v, (torch.Tensor, list, tuple)) else const(v)

        lines = ["def run(args, device):"]
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        native = memory.native_views()
        view = [f"v{i}" for i in range(len(args))]
        if native is not None and tensors and all(memory.native_viewable(args[i]) for i in tensors):
            g["_native"] = native
            lines += ["    try:",
                      f"        {', '.join(view[i] for i in tensors)}, = _native([{', '.join(f'args[{i}]' for i in tensors)}])",
                      "    except RuntimeError:",
                      f"        {', '.join(view)}, = memory.cpu_views(args)"]
            lines += [f"    {view[i]} = args[{i}]" for i in range(len(args)) if i not in tensors]
        elif args:
            lines.append(f"    {', '.join(view)}, = memory.cpu_views(args)")
        for i, n in enumerate(self.inputs):
            names[n] = view[i]
        if self.head is not None:
            g["_head"] = self._head
            bias = names[self.head.args[0]] if self.head.target is aten.addmm.default else "None"
            names[self.head] = "h"
            lines.append(f"    h = _head(v0, v1, {bias})")
        def call(target: Any, sargs: Any, skw: Any) -> str:  # a step's op called on its arguments
            parts = []
            for kind, a in sargs:
                if kind == _NODE:
                    parts.append(read(a))
                elif kind == _ROUNDED:
                    parts.append(f"{names[a[0]]}.to({const(a[1])})")
                elif kind == _CONST:
                    parts.append(const(a))
                else:  # a list holding nodes: _wide of the list (16-bit tensors in it widened)
                    items = [read(x) if isinstance(x, fx.Node) else constant(x) for x in a]
                    body = ", ".join(items) + ("," if len(items) == 1 else "")
                    parts.append(f"[{body}]" if type(a) is list else f"({body})" if type(a) is tuple
                                 else f"{const(type(a))}(({body}))")
            for k, node, v in skw:
                parts.append(f"{k}={read(v) if node else const(v)}")
            fn = const(_torch.cpp_op(target) if hasattr(target, "overloadpacket") else target)  # (an OpOverload)
            return f"{fn}({', '.join(parts)})"

        drop = last_uses(self.nodes, (*self.inputs, *self.outputs))
        reuse = self._reuse(env, drop)
        for j, (n, target, sargs, skw) in enumerate(self._steps or ()):
            out = names[n] = f"n{j}"
            value = f"{names[sargs]}[{const(skw)}]" if target is None else \
                call(reuse.get(j, target), sargs, skw)  # (None: getitem)
            lines.append(f"    {out} = {value}")
            if j in drop:
                lines.append(f"    del {', '.join(names[x] for x in drop[j])}")
        outs = []
        g["_over"] = values.result_over
        for n in self.outputs:
            want = n.meta["val"].dtype
            conv = f".to({const(want)})" if env[n].dtype != want else ""
            # a result that may lie in an input's memory (views of an input) is checked as _call does
            own = "_over({}, args, device)" if self._input_view(n) else "memory.adopt({}, device)"
            outs.append(own.format(f"{names[n]}{conv}.contiguous()"))
        lines.append(f"    outs = ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        for op, cost in plan.costs:  # (a handle looked up now; without the fast path's library, launch's lookup)
            h = fastpath.handle(op, cost)
            launch = f"fastpath.launch(device, {const(op)}, {const(cost)})" if h is None else \
                f"fastpath.launch_handle(device, {const(h)})"
            lines.append(f"    if not {launch}:")
            lines.append(f"        runtime().charge(device, {const(op)}, {const(cost)})")
        lines.append("    return outs")
        src = "\n".join(lines)
        exec(compile(src, f"<region {self.index}: {self.label}>", "exec"), g)
        run = g["run"]
        run.source = src
        run.reused = tuple(sorted(reuse))  # the steps written into their first operand (tests read it)
        return run

    def _reuse(self, env: dict[fx.Node, Any], drop: dict[int, list[fx.Node]]) -> dict[int, Any]:
        """The steps whose result may be written into their first operand: ``{step: the op's
        in-place overload}``, for the generated code (:meth:`_specialise`).

        A pointwise op whose ``self`` is an intermediate the region made (not an input, an
        output, the matmul head or a view of anything), read there for the last time, with no
        view of it read at that step or later, and of the result's shape, dtype and (dense,
        contiguous) layout, as every tensor operand is or broadcasts from a single element:
        the in-place overload runs the same kernel over the same elements into memory nothing
        reads again, so the values are the same bits. The result is then made in memory that is
        in the cache, not in a buffer that is not (Inductor reuses a dead buffer the same way;
        the small GPT-2's tanh-GELU forward region runs 4 of its 8 steps so).
        ``env`` is the first call's values (a plan's signature fixes their shapes and dtypes;
        the graph's guards, their layouts)."""
        steps = self._steps or ()
        last = {x: j for j, xs in drop.items() for x in xs}
        root: dict[fx.Node, fx.Node] = {}  # a step's value -> the value owning its memory
        owned = set()  # values of pointwise and other fresh-result steps, the region's own memory
        for n, target, sargs, _ in steps:
            if target is None or not hasattr(target, "overloadpacket"):  # a getitem, a wrapper
                src = sargs if target is None else None
                root[n] = root.get(src, src) if isinstance(src, fx.Node) else n
                continue
            first = sargs[0][1] if sargs and sargs[0][0] == _NODE else None
            if values.op_info(target).is_view or target is aten._unsafe_view.default or target is aten.alias.default:
                root[n] = root.get(first, first) if first is not None else n
            else:
                root[n] = n
                owned.add(n)
        aliases: dict[fx.Node, list[fx.Node]] = {}
        for n, r in root.items():
            if r is not n:
                aliases.setdefault(r, []).append(n)
        outputs = set(self.outputs)
        out: dict[int, Any] = {}
        for j, (n, target, sargs, skw) in enumerate(steps):
            if target is None or not hasattr(target, "overloadpacket") or torch.Tag.pointwise not in target.tags \
                    or torch.Tag.nondeterministic_seeded in target.tags:
                continue
            if not sargs or sargs[0][0] != _NODE:
                continue
            a = sargs[0][1]
            if a not in owned or a in outputs or last.get(a) != j or a not in env or n not in env:
                continue
            if any(x in outputs or last.get(x, len(steps)) >= j for x in aliases.get(a, ())):
                continue  # (a view of it is read here or later: its memory is not free)
            va, vn = env[a], env[n]
            if not (isinstance(va, torch.Tensor) and isinstance(vn, torch.Tensor)) or va.dtype in _WIDE \
                    or va.dtype != vn.dtype or va.shape != vn.shape or not va.is_contiguous() or not vn.is_contiguous():
                continue
            others = [b for kind, b in sargs[1:] if kind == _NODE] + [v for _, node, v in skw if node]
            if any(kind == _LIST for kind, _ in sargs) or any(root.get(b, b) is a for b in others):
                continue
            if not all(not isinstance(env.get(b), torch.Tensor) or
                       (env[b].shape == va.shape and env[b].is_contiguous()) or env[b].numel() == 1 for b in others):
                continue
            inplace = _inplace_overload(target)
            if inplace is not None:
                out[j] = inplace
        return out

    def _input_view(self, n: fx.Node) -> bool:
        """Whether node ``n``'s value may lie in an input's memory: an input itself, or reached from
        one through view ops (``_unsafe_view`` too, which aliases though its schema does not say so)
        and getitems. Every other op's CPU kernel writes a new tensor; the matmul head's result is new."""
        inputs = set(self.inputs)
        while isinstance(n, fx.Node):
            if n in inputs:
                return True
            if n is self.head or n.op != "call_function":
                return False
            if not (n.target is operator.getitem or n.target is aten._unsafe_view.default
                    or values.op_info(n.target).is_view):
                return False
            n = n.args[0]
        return False

    def _compile_steps(self) -> list[tuple[Any, ...]]:
        """The region's nodes as (node, target, args, kwargs) with what does not change between
        calls worked out once: each argument is a node (its value, fp32-widened), a constant
        (moved to CPU) or a list holding nodes; ``_to_copy``'s device is dropped (the values are
        CPU views). A getitem is (node, None, source node, index).

        An explicit cast (``_to_copy``: ``.float()``, ``.half()``) of a 16-bit value reads it
        rounded to its dtype, as eager has it: the region keeps other intermediates in fp32, but
        ``(x.half() * 30000).float()`` read the fp32 product (45,000, finite) where eager's fp16
        one is inf, and errors of ~1,000 fp32 ulps reached fp32 outputs (found by a values hunt;
        Inductor's ``emulate_precision_casts`` rounds at casts the same way)."""
        steps: list[tuple[Any, ...]] = []
        for n in self.nodes:
            if n.target is operator.getitem:
                steps.append((n, None, n.args[0], n.args[1]))
                continue
            sargs = []
            for i, a in enumerate(n.args):
                if isinstance(a, fx.Node):
                    val = a.meta.get("val")
                    if i == 0 and n.target is aten._to_copy.default and isinstance(val, torch.Tensor) \
                            and val.dtype in _WIDE:
                        sargs.append((_ROUNDED, (a, val.dtype)))
                    else:
                        sargs.append((_NODE, a))
                    continue
                c = _to_cpu(a)
                holds = isinstance(c, (list, tuple)) and any(isinstance(x, fx.Node) for x in c)
                sargs.append((_LIST if holds else _CONST, c))
            skw = tuple((k, isinstance(v, fx.Node), v if isinstance(v, fx.Node) else _to_cpu(v))
                        for k, v in n.kwargs.items() if not (n.target is aten._to_copy.default and k == "device"))
            steps.append((n, n.target, tuple(sargs), skw))
        return steps

    # ---- costs -----------------------------------------------------------------------------
    def _meta(self, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """A meta tensor of node ``n``'s value in eager mode: its run shape, its graph dtype."""
        v, val = env[n], n.meta.get("val")
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=val.dtype if isinstance(val, torch.Tensor) else v.dtype, device="meta")
        if isinstance(v, (tuple, list)):
            return type(v)(torch.empty(x.shape, dtype=y.dtype, device="meta") if isinstance(x, torch.Tensor) else x
                           for x, y in zip(v, val))
        return v

    def _eager(self, args: Sequence[Any], env: dict[fx.Node, Any]) -> list[tuple[str, KernelSpec | None]]:
        """The eager kernels of the region's ops (None: a matmul with no products)."""
        meta: dict[fx.Node, Any] = {}
        for n in self.inputs:
            if n in env:
                meta[n] = self._meta(n, env)
        specs: list[tuple[str, KernelSpec | None]] = []
        if self.head is not None:
            a, b = args[0], args[1]
            ta, tb = lowering.matmul_layout(a, b)
            specs.append((_op_name(self.head), lowering.matmul_spec(1, a.shape[0], a.shape[1], b.shape[1], a.dtype,
                                                                    ta, tb)))
            meta[self.head] = self._meta(self.head, env)
            if self.head.target is aten.addmm.default:
                meta[self.head.args[0]] = self._meta(self.head.args[0], env)
        for n in self.nodes:
            meta[n] = self._meta(n, env)
            if n.target is operator.getitem or values.op_info(n.target).is_view:
                continue
            margs = tuple(meta.get(a, a) if isinstance(a, fx.Node) else a for a in n.args)
            mkw = {k: (meta.get(v, v) if isinstance(v, fx.Node) else v) for k, v in n.kwargs.items()}
            ins = lowering.flat_tensors(list(margs) + list(mkw.values()), [])
            specs.append((_op_name(n), lowering.op_spec(_op_name(n), margs, mkw, ins,
                                                        lowering.flat_tensors(meta[n], []))))
        return specs

    def _plan(self, args: Sequence[Any], env: dict[fx.Node, Any]) -> _Plan:
        rt = runtime()
        eager = [(op, rt.cost(spec, "empty matmul (launch only)")) for op, spec in self._eager(args, env)]
        prog = self.region.program
        assert prog is not None
        first = next(iter(self.outputs))
        dt = lowering.tile_dtype(first.meta["val"].dtype).name
        try:
            if self.head is not None:
                a, b = args[0], args[1]
                ta, tb = lowering.matmul_layout(a, b)
                spec = KernelSpec.of("matmul_fused", (a.shape[0], a.shape[1], b.shape[1]),
                                     lowering.matmul_dtype(a.dtype),
                                     {"program": prog, "transpose_a": ta, "transpose_b": tb})
            else:
                ts = [env[n] for n in self.inputs + self.outputs if isinstance(env.get(n), torch.Tensor)]
                big = max(ts, key=lambda t: (t.numel(), t.dim()))
                cols = big.shape[-1] if big.dim() else 1
                rows = big.numel() // max(cols, 1)
                spec = KernelSpec.of("fused", (rows, cols), dt, {"program": prog})
            cost = rt.cost(spec)
        except KernelError:
            return _Plan(self.label, eager)  # the kernel refuses these shapes: its ops' eager kernels
        if cost.ticks > sum(c.ticks for _, c in eager):
            # both are simulated; like a compiler's cost model, keep the faster (the region's values
            # are computed the same way either way: identical to eager's for fp32)
            return _Plan(self.label, eager)
        region = FusedRegion(self.ops, len(eager), sum(c.hbm_bytes for _, c in eager), sum(c.ticks for _, c in eager))
        return _Plan(self.label, [(self.label, dataclasses.replace(cost, region=region))], spec)


def rewrite(gm: fx.GraphModule, regions: Sequence[Region | ForeachRegion]) -> fx.GraphModule:
    """``gm`` with each region's nodes replaced by one call of its :class:`RegionKernel`, in an
    order where every value is defined before use (regions are cycle-free by construction)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    owner: dict[fx.Node, int] = {}
    for ri, r in enumerate(regions):
        for n in r.nodes + ([r.head] if r.head is not None else []):
            owner[n] = ri
    items: list[Any] = []  # ("node", n) or ("region", ri), first appearance order
    seen: set[int] = set()
    for n in graph.nodes:
        ri = owner.get(n)
        if ri is None:
            items.append(("node", n))
        elif ri not in seen:
            seen.add(ri)
            items.append(("region", ri))

    def deps(item: tuple[str, Any]) -> set[Any]:
        nodes = [item[1]] if item[0] == "node" else regions[item[1]].nodes + \
            ([regions[item[1]].head] if regions[item[1]].head is not None else [])
        out: set[Any] = set()
        for n in nodes:
            for a in n.all_input_nodes:
                ra = owner.get(a)
                key = ("region", ra) if ra is not None else ("node", a)
                if key != item:
                    out.add(key)
        return out

    # Kahn's algorithm, ties broken by original position
    import heapq

    pos = {it: min(order[n] for n in ([it[1]] if it[0] == "node" else regions[it[1]].nodes +
                                      ([regions[it[1]].head] if regions[it[1]].head is not None else [])))
           for it in items}
    dmap = {it: deps(it) for it in items}
    users: dict[Any, list[Any]] = {it: [] for it in items}
    for it, ds in dmap.items():
        for d in ds:
            users[d].append(it)
    indeg = {it: len(ds) for it, ds in dmap.items()}
    heap = [(pos[it], i, it) for i, it in enumerate(items) if indeg[it] == 0]
    heapq.heapify(heap)
    idx = {it: i for i, it in enumerate(items)}
    new = fx.Graph()
    env: dict[fx.Node, Any] = {}
    kernels = [ForeachKernel(r, i) if isinstance(r, ForeachRegion) else RegionKernel(r, i)
               for i, r in enumerate(regions)]
    done = 0
    while heap:
        _, _, it = heapq.heappop(heap)
        done += 1
        if it[0] == "node":
            n = it[1]
            env[n] = new.node_copy(n, lambda a: env[a])
        else:
            k = kernels[it[1]]
            call = new.call_function(k, tuple(env[a] for a in k.inputs))
            for j, out in enumerate(k.outputs):
                env[out] = new.call_function(operator.getitem, (call, j))
                env[out].meta = dict(out.meta)
        for u in users[it]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (pos[u], idx[u], u))
    if done != len(items):
        raise AssertionError("compiled regions form a cycle")
    return fx.GraphModule(gm, new)


# ---- layouts as traced ---------------------------------------------------------------------
#: ops whose neuron kernels lay their results out as CPU's kernels do (the eager device's contract,
#: which difftest holds it to) where the fake tensors a graph is traced with lay them out otherwise:
#: PyTorch's fake convolution asks the backend's memory format, which for a PrivateUse1 device
#: (ConvBackend::Overrideable) is contiguous, where CPU's convolution keeps a channels-last input's
#: layout; the reflection and replication paddings' backwards are CPU's channels-last too
#: (found with the fake and real strides of 26 CNN ops side by side: every convolution, forward and
#: backward, and the reflection padding's backward; the replication padding's backward too, checked)
_CPU_LAYOUT_OPS = frozenset(
    getattr(aten, name).default for name in (
        "convolution", "convolution_backward", "reflection_pad1d_backward", "reflection_pad2d_backward",
        "reflection_pad3d_backward", "replication_pad1d_backward", "replication_pad2d_backward",
        "replication_pad3d_backward") if hasattr(aten, name))


def _dims_inner_first(fmt: Any, rank: int) -> list[int] | None:
    if fmt is torch.contiguous_format:
        return list(range(rank - 1, -1, -1))
    if (fmt is torch.channels_last and rank == 4) or (fmt is torch.channels_last_3d and rank == 5):
        return [1, *range(rank - 1, 1, -1), 0]
    return None


def _traced_format(val: Any) -> Any:
    """The memory format a traced value is dense in: contiguous, channels-last or channels-last-3d
    (None: none of them, or not a tensor). Read off its sizes and strides, symbolic ones too (a
    dynamic-shape graph's), where they say so without a guard: each dimension of size other than 1
    has the stride the format gives it."""
    if not isinstance(val, torch.Tensor):
        return None
    shape, stride = val.shape, val.stride()
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        dims = _dims_inner_first(fmt, len(shape))
        if dims is None:
            continue
        want: Any = 1
        for d in dims:
            if not statically_known_true(shape[d] == 1) and not statically_known_true(stride[d] == want):
                break
            want = want * shape[d]
        else:
            return fmt
    return None


def _code_name(op: Any) -> str:
    """An aten overload's name as an identifier of a graph's generated code (``add_Tensor``)."""
    return str(op).replace("aten.", "", 1).replace(".", "_")


class _AsTraced:
    """An op of :data:`_CPU_LAYOUT_OPS` as a compiled graph calls it: each result in the memory
    format the graph was traced with, where the kernel laid it out otherwise.

    The rest of the graph was traced against those layouts: native_group_norm's backward on a
    channels-last input was traced as a contiguous clone of the input beside the convolution's
    gradient, which the trace took for contiguous too (autograd's formula makes both contiguous
    off CPU), so at run time CPU's kernel read a channels-last gradient as a contiguous one: a
    diffusers UNet's compiled gradients were 100% off from its eager ones. The relayout is a host
    copy, like the one the eager convolution makes to give CPU's layout: it is no kernel of the
    program (a compiler lays the result out as it planned), so it is not charged."""

    def __init__(self, op: Any, formats: tuple[Any, ...]):
        self.op = op
        self.formats = formats
        self.__name__ = "as_traced_" + _code_name(op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.op(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(_relayout(t, f) for t, f in zip(out, self.formats))
        return _relayout(out, self.formats[0])


def _relayout(t: Any, fmt: Any) -> Any:
    if fmt is None or not isinstance(t, torch.Tensor) or t.is_contiguous(memory_format=fmt):
        return t
    if not values.is_neuron(t):
        return t.contiguous(memory_format=fmt)
    return memory.relabel(memory.cpu_view(t).contiguous(memory_format=fmt), t.device.index or 0)


def _inplace_overload(op: Any) -> Any:
    """``op``'s in-place overload (``add.Tensor`` -> ``add_.Tensor``) when it exists with the same
    arguments, else None."""
    name = op.name()  # "aten::add.Tensor"
    packet, _, overload = name.partition("::")[2].partition(".")
    inplace = getattr(getattr(aten, packet + "_", None), overload or "default", None)
    if inplace is None:
        return None
    a, b = _torch.op_schema(op).arguments, _torch.op_schema(inplace).arguments
    if [(x.name, str(x.type)) for x in a] != [(x.name, str(x.type)) for x in b]:
        return None
    return inplace


class _DirectOp(functools.partial):
    """An aten op as a graph calls it: its C++ callable behind a C-level call, skipping the
    OpOverload's Python ``__call__`` frame (~0.2 us of a ~2 us small op). The names are for the
    graph's generated code, which binds the callable under them."""

    op: Any


_direct_ops: dict[Any, _DirectOp] = {}


def _direct(op: Any) -> _DirectOp:
    d = _direct_ops.get(op)
    if d is None:
        d = _direct_ops[op] = _DirectOp(_torch.cpp_op(op))
        d.op = op
        d.__name__ = "aten_" + _code_name(op)
        d.__module__ = __name__
    return d


def runnable(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a :class:`CompiledGraph` runs it (a copy): each ``trnsim::attention_values`` call
    made to :func:`~torch_bridge.compile.attention.values_call`, the op's whole computation (an aot
    graph runs without autograd, so the op's dispatch and autograd layers only cost time, ~10 us a
    call); each :data:`_CPU_LAYOUT_OPS` call through :class:`_AsTraced`, its results in the traced
    layouts; every other aten call through :class:`_DirectOp` (the same op and dispatch)."""
    values_op = torch.ops.trnsim.attention_values.default
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is values_op:
            n.target = values_call
        elif n.target in _CPU_LAYOUT_OPS:
            val = n.meta.get("val")
            formats = tuple(_traced_format(v) for v in (val if isinstance(val, (tuple, list)) else (val,)))
            n.target = _AsTraced(n.target, formats) if any(f is not None for f in formats) else _direct(n.target)
        elif hasattr(n.target, "overloadpacket") and n.target.namespace == "aten":
            n.target = _direct(n.target)
    return fx.GraphModule(gm, graph)


class CompiledGraph:
    """A forward or backward aten graph as the neuron backend runs it (module docstring)."""

    def __init__(self, gm: fx.GraphModule, kind: str):
        t0 = time.perf_counter()
        self.kind = kind
        self.source = gm
        from .flex import use_flex_kernels

        use_flex_kernels(gm)  # FlexAttention's higher-order ops run as one flash-attention launch each
        reinplace_input_updates(gm)  # a graph input's scatter (a KV-cache update) writes in place
        self.regions: list[Region | ForeachRegion] = [*partition(gm), *partition_foreach(gm)]
        self.module = runnable(rewrite(gm, self.regions) if self.regions else gm)
        self.compile_seconds = time.perf_counter() - t0

    def __call__(self, *args: Any) -> Any:
        with runtime().device.graph():
            return self.module(*args)
