"""A graph input updated by a scatter, written in place: what a compiled KV-cache update is.

aot_autograd hands the backend a functional graph. A program's ``cache.index_copy_(2, pos, k)``
on a graph input (Hugging Face's static cache, a compiled decode step) arrives as a functional
``index_copy`` that copies the whole cache, then a ``copy_`` of that copy back into the input
(``keep_inference_input_mutations``). Run as written, every decode step copies every layer's
cache twice, where the program, Inductor (its reinplacing pass) and a Neuron compile (an
aliased input and output) write one row. :func:`reinplace_input_updates` puts the in-place op
back where that is sound, so the graph does and is charged what the program does. A write into a
view of the input (``cache[:, :, pos:pos + 1] = k``) arrives as a ``slice_scatter`` (or
``select_scatter``, ``diagonal_scatter``) and its ``copy_`` back, and becomes the view's ``copy_``.

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


#: a view's scatter (what functionalization makes of a write into a view: ``cache[:, :, 5:6] = k``)
#: -> the view it writes through, whose arguments are the scatter's after its ``src``
VIEW_OF = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
}


def _flat(args: object) -> list[object]:
    out: list[object] = []
    for a in args if isinstance(args, (list, tuple)) else (args,):
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else (a,))
    return out


def _rewrite_window(window: fx.Node, scatter: fx.Node, view: object) -> bool:
    """``x[5:6] = k`` functionalized reads the window it writes: ``w = slice(x, ..)``,
    ``c = copy(w, k)`` (k broadcast and cast to the window), ``slice_scatter(x, c, ..)``. Where that
    is the whole of it, ``c`` becomes ``w.copy_(k)``, the write itself (True); False otherwise."""
    new = scatter.args[1]
    if not (window.target is view and window.args[0] is scatter.args[0] and not window.kwargs
            and tuple(window.args[1:]) == tuple(scatter.args[2:]) and not scatter.kwargs
            and isinstance(new, fx.Node) and new.target is aten.copy.default and new.args[0] is window
            and not new.kwargs and list(window.users) == [new] and list(new.users) == [scatter]):
        return False
    new.target = aten.copy_.default  # (its value, the window, is read by nothing: the scatter goes)
    return True


def _alike(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and \
        va.shape == vb.shape


def reinplace_input_updates(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: each ``copy_(x, scatter(x, ...))`` of a graph input ``x`` read by
    nothing else becomes ``scatter_(x, ...)``, and each ``copy_(x, slice_scatter(x, src, ...))``
    (or select/diagonal) becomes ``slice(x, ...).copy_(src)`` (module docstring). Returns how
    many it rewrote."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        if not isinstance(dst, fx.Node) or dst.op != "placeholder" or not isinstance(src, fx.Node):
            continue
        inplace, view = INPLACE.get(src.target), VIEW_OF.get(src.target)
        if (inplace is None and view is None) or not src.args or src.args[0] is not dst or node.users:
            continue
        if any(a is dst for a in _flat(src.args[1:])) or any(a is dst for a in _flat(list(src.kwargs.values()))):
            continue
        others = set(dst.users) - {src, node}
        if others:  # a view's scatter may read the window it writes (_rewrite_window); any other read is unsound
            if view is None or len(others) != 1 or not _rewrite_window(others.pop(), src, view):
                continue
        elif not _alike(src, dst) or (view is not None and (src.kwargs or len(src.args) < 2)):
            continue
        elif inplace is not None:
            src.target = inplace  # returns its self: the input, now holding what the copy_ would write
            graph.erase_node(node)
            done += 1
            continue
        else:
            with graph.inserting_before(src):
                window = graph.call_function(view, (dst, *src.args[2:]))
                graph.call_function(aten.copy_.default, (window, src.args[1]))
        src.replace_all_uses_with(dst)  # (the copy_ back too, which goes with the scatter)
        graph.erase_node(node)
        graph.erase_node(src)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
