"""A graph input updated by a scatter, written in place: what a compiled KV-cache update is.

aot_autograd hands the backend a functional graph. A program's ``cache.index_copy_(2, pos, k)``
on a graph input (Hugging Face's static cache, a compiled decode step) arrives as a functional
``index_copy`` that copies the whole cache, then a ``copy_`` of that copy back into the input
(``keep_inference_input_mutations``). Run as written, every decode step copies every layer's
cache twice, where the program, Inductor (its reinplacing pass) and a Neuron compile (an
aliased input and output) write one row. :func:`reinplace_input_updates` puts the in-place op
back where that is sound, so the graph does and is charged what the program does.

Sound where the input is read by nothing but the scatter and the final ``copy_``: no other node
(a view, a read) can see the input before or after it is written, the scatter's other arguments
are not the input, and the scatter's result, now the input itself, holds the same values the
functional op returned. Inputs that alias each other reach the graph as one base
(aot_autograd's synthetic bases), so two inputs are never one memory here.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["reinplace_input_updates", "INPLACE"]

aten = torch.ops.aten

#: functional scatter -> its in-place form (the same kernel: the functional op is a copy of
#: ``self`` and then this one)
INPLACE = {
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_put.default: aten.index_put_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.index_fill.int_Scalar: aten.index_fill_.int_Scalar,
    aten.index_fill.int_Tensor: aten.index_fill_.int_Tensor,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.scatter_reduce.two: aten.scatter_reduce_.two,
}


def reinplace_input_updates(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: each ``copy_(x, scatter(x, ...))`` of a graph input ``x`` read by
    nothing else becomes ``scatter_(x, ...)`` (module docstring). Returns how many it rewrote."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        if not isinstance(dst, fx.Node) or dst.op != "placeholder" or not isinstance(src, fx.Node):
            continue
        inplace = INPLACE.get(src.target)
        if inplace is None or not src.args or src.args[0] is not dst or node.users:
            continue
        if set(dst.users) != {src, node} or any(a is dst for a in src.args[1:]) or \
                any(a is dst for a in src.kwargs.values()):
            continue
        src_val, dst_val = src.meta.get("val"), dst.meta.get("val")
        if not (isinstance(src_val, torch.Tensor) and isinstance(dst_val, torch.Tensor)
                and src_val.dtype == dst_val.dtype and src_val.shape == dst_val.shape):
            continue
        src.target = inplace  # returns its self: the input, now holding what the copy_ would write
        graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
