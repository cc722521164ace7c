"""A timing-only step lowered as the compiled path lowers it: elementwise regions fused.

The frameworks run a training step as compiled graphs (neuronx-cc for NxD's XLA graphs,
``torch.compile`` for TorchTitan): chains of elementwise ops, norms, casts and row reductions
become one kernel each, reading their inputs from HBM once and writing only what later ops
use. In a timing-only run the ops arrive one at a time through the dispatcher; :class:`Fuser`
collects the run of ops between two launches that cannot fuse (a matmul, a collective,
attention, a copy between devices, a multi-tensor op) as an FX graph with each node's fake value
as its ``meta["val"]``, exactly the form ``torch.compile`` hands the neuron backend, and lowers it
with the same partitioner (:func:`torch_bridge.compile.fusion.partition`): each region is one
launch of the library's ``fused`` kernel (:mod:`trnsim.kernels.fused`: its program is simulated
as an instruction stream, never a discount on the eager costs), the other ops their eager
kernels. A region's outputs are its values still alive when the run is flushed (kept for the
backward, used by a later op, held by the caller); the others never leave SBUF.

As in the compiled path (:mod:`torch_bridge.compile.graph`), a region whose fused kernel is
slower than its ops' eager kernels, or that the kernel refuses, runs as those eager kernels.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx

from trnsim.device import KernelSpec, OpCost
from trnsim.isa import KernelError

__all__ = ["Fuser"]

#: ops recorded at most before a flush (a long elementwise backward is cut into several graphs)
MAX_NODES = 512


class Fuser:
    """Collects fusable ops of a timing-only run and launches them as regions (module docstring)."""

    def __init__(self, run: Any):
        self.run = run
        self._reset()
        self.flushing = False
        self.costs: dict[tuple[Any, ...], tuple[str, OpCost] | None] = {}
        self.regions = 0

    def _reset(self) -> None:
        self.graph = fx.Graph()
        self.env: dict[int, tuple[fx.Node, Any]] = {}  # id(tensor) -> (node, weak ref)
        self.eager: dict[fx.Node, tuple[str, OpCost]] = {}
        self.order: list[tuple[fx.Node, Any]] = []  # (node, weak ref of its output)
        self.core = 0

    @property
    def pending(self) -> int:
        return len(self.order)

    @staticmethod
    def fusable(func: Any) -> bool:
        """Whether the op may join a region (the fused kernel's programs have a step for it)."""
        from ..compile.fusion import STEPS

        return func in STEPS

    def _standin(self, x: Any) -> Any:
        """A fake tensor with ``x``'s metadata that holds no storage of the run: the graph must not
        keep the run's tensors alive (a value alive at the flush is a region output)."""
        if isinstance(x, (list, tuple)):
            return type(x)(self._standin(y) for y in x)
        if not isinstance(x, torch.Tensor):
            return x
        from .. import _torch  # the private-API fence

        meta = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        return _torch.FakeTensor(self.run._fake, meta, x.device)

    def _node(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            hit = self.env.get(id(x))
            if hit is not None and hit[1]() is x:
                return hit[0]
            node = self.graph.placeholder(f"in{len(self.graph.nodes)}")
            node.meta["val"] = self._standin(x)
            causal = getattr(x, "_trnsim_causal", None)
            if causal is not None:  # torch.triu(ones, d): a region makes it from the indices (compile.fusion)
                node.meta["causal"] = causal
            self.env[id(x)] = (node, weakref.ref(x))
            return node
        if isinstance(x, (list, tuple)):
            return type(x)(self._node(y) for y in x)
        return x

    def record(self, core: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
               eager: tuple[str, OpCost] | None) -> None:
        """Add one op (its eager launch ``eager``: (op, cost), or None for a view) to the graph."""
        if self.order and core != self.core:
            self.flush()
        self.core = core
        node = self.graph.call_function(func, self._node(tuple(args)), {k: self._node(v) for k, v in kwargs.items()})
        node.meta["val"] = self._standin(out)
        if eager is not None:
            self.eager[node] = eager
        if isinstance(out, torch.Tensor):
            ref = weakref.ref(out)
            self.env[id(out)] = (node, ref)
            self.order.append((node, ref))
        else:
            self.order.append((node, lambda: None))
        if len(self.order) >= MAX_NODES:
            self.flush()

    def flush(self) -> None:
        """Lower the ops recorded so far (regions fused, the rest eager) and launch them."""
        if not self.order or self.flushing:
            return
        self.flushing = True
        try:
            self._lower()
        finally:
            self.flushing = False
            self._reset()

    def _lower(self) -> None:
        from ..compile.fusion import partition

        live = [n for n, ref in self.order if ref() is not None]
        self.graph.output(tuple(live))
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        try:
            regions = partition(gm)
        except Exception:  # noqa: BLE001 - a graph the partitioner cannot read runs op by op, as eager
            regions = []
        owner: dict[fx.Node, int] = {}
        for i, r in enumerate(regions):
            for n in r.nodes:
                owner[n] = i
        done: set[int] = set()
        for n in gm.graph.nodes:
            i = owner.get(n)
            if i is None:
                e = self.eager.get(n)
                if e is not None:
                    self.run.launch(self.core, e[0], e[1])
                continue
            if i in done:
                continue
            done.add(i)
            for op, cost in self._region(regions[i]):
                self.run.launch(self.core, op, cost)

    def _region(self, region: Any) -> list[tuple[str, OpCost]]:
        from ..eager import lowering

        eager = [self.eager[n] for n in region.nodes if n in self.eager]
        prog = region.program
        vals = [n.meta["val"] for n in region.inputs + region.outputs if isinstance(n.meta.get("val"), torch.Tensor)]
        if prog is None or not vals or not region.outputs:
            return eager
        big = max(vals, key=lambda t: (t.numel(), t.dim()))
        cols = big.shape[-1] if big.dim() else 1
        rows = big.numel() // max(cols, 1)
        dt = lowering.tile_dtype(region.outputs[0].meta["val"].dtype).name
        key = ("fused", rows, cols, dt, prog)
        hit = self.costs.get(key, False)
        if hit is False:
            try:
                cost = self.run.target.device.cost(KernelSpec.of("fused", (rows, cols), dt, {"program": prog}))
                hit = ("fused_region", cost)
            except KernelError:
                hit = None
            self.costs[key] = hit
        if hit is None or hit[1].ticks > sum(c.ticks for _, c in eager):
            return eager  # the kernel refuses, or is slower than the ops: a compiler keeps them apart
        self.regions += 1
        return [hit]


