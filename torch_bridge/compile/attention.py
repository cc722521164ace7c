"""Attention in compiled graphs: one op, forward and backward, as in eager mode.

Left alone, aot_autograd would trace ``F.scaled_dot_product_attention`` on fake tensors through
PyTorch's math decomposition (bmm, scale, mask, softmax, bmm: ten ops and a [B, H, L, S] score
matrix through HBM per layer). :func:`use_attention_op` points the dynamo graph's attention
calls that the library's flash-attention kernel takes at ``trnsim::attention`` instead, a custom
op whose backward is ``trnsim::attention_backward``: the aot graphs then hold one node each, and
they compute and cost exactly what the eager device's attention does
(:mod:`torch_bridge.attention`: the flash-attention kernel forward; its four matmuls and the
softmax backward after).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..ops import attention as eager_attention
from ..eager import memory

__all__ = ["use_attention_op", "sdpa", "values_call"]

SDPA = torch.nn.functional.scaled_dot_product_attention
ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default  # (a graph may call the op itself)


@torch.library.custom_op("trnsim::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
              groups: int, flash: bool = True) -> tuple[Tensor, Tensor]:
    """(out, P): the eager device's attention forward (P, fp32, is kept for the backward);
    ``flash``: CPU computes the call with its flash kernel (its arithmetic, not the math path's)."""
    index = q.device.index or 0
    with memory.host_scope():  # (its results and temporaries from the host cache, as call_traced's)
        out, p, _, _ = eager_attention.forward_values(q, k, v, mask, causal, scale, groups, flash)
    eager_attention.charge_forward(index, q, k, mask, causal, scale)
    return memory.relabel(out, index), memory.relabel(p, index)


@attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
      groups: int, flash: bool = True) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1] + (k.shape[-2],), dtype=torch.float32)


@torch.library.custom_op("trnsim::attention_backward", mutates_args=())
def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, p: Tensor, mask: Tensor | None, causal: bool,
                       scale: float | None, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """The eager device's attention backward: from P, or, where the forward's values were CPU's
    kernel's (:func:`torch_bridge.ops.attention.datapath_exact` false), CPU's kernel's backward."""
    index = q.device.index or 0
    hq, hk, hv, hm = memory.cpu_views((q, k, v, mask))  # (one native call; a host mask as it is)
    with memory.host_scope():
        if eager_attention.datapath_exact(hq, hk, hv, hm, scale):
            sc = scale if scale is not None else q.shape[-1] ** -0.5
            dq, dk, dv = eager_attention.backward_values(grad, q, k, v, p, sc, groups)
        else:
            dq, dk, dv = eager_attention.cpu_kernel_grads(q, k, v, hm, causal, scale, grad)
    eager_attention.charge_backward(index, q, k.shape[-2], q.dtype)
    return memory.relabel(dq, index), memory.relabel(dk, index), memory.relabel(dv, index)


@attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, p: Tensor, mask: Tensor | None, causal: bool,
      scale: float | None, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, mask, causal, scale, groups, _flash = inputs
    ctx.save_for_backward(q, k, v, output[1], mask)
    ctx.call = (causal, scale, groups)


def _backward(ctx: Any, grad_out: Tensor, grad_p: Tensor | None) -> tuple[Any, ...]:
    q, k, v, p, mask = ctx.saved_tensors
    causal, scale, groups = ctx.call
    dq, dk, dv = attention_backward(grad_out.contiguous(), q, k, v, p, mask, causal, scale, groups)
    return dq, dk, dv, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("trnsim::attention_values", mutates_args=())
def attention_values(out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                     scale: float | None, enable_gqa: bool, grads: bool = False) -> Tensor:
    """``out``, the traced op-by-op flash arithmetic's result for a call CPU computes with its
    flash kernel, with CPU's own kernel's values where the datapath's cannot be CPU's
    (:func:`torch_bridge.ops.attention.datapath_exact`: inputs not finite, products that may
    overflow, ...), which only the values decide, as the eager device does. No kernel of its
    own (nothing is charged): the traced ops are the computation; the copy of ``out`` is there
    because a custom op may not return its input. Whether CPU computes the call with its flash
    kernel is decided here, on the call's sizes (a dynamic-shape graph's trace had symbols)."""
    return values_call(out, q, k, v, mask, causal, scale, enable_gqa, grads)


def values_call(out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                scale: float | None, enable_gqa: bool, grads: bool = False) -> Tensor:
    """:func:`attention_values`' computation, which a compiled graph calls directly
    (:func:`torch_bridge.compile.graph.runnable`: its graphs run without autograd, so the op's
    dispatch and autograd layers only cost time, ~10 us a call)."""
    index = out.device.index or 0
    hq, hk, hv, ho, hm = memory.cpu_views((q, k, v, out, mask))  # (one native call; a host mask as it is)
    res = ho.clone()
    if eager_attention.check(q, k, v, mask, 0.0, causal, scale, enable_gqa) and \
            not eager_attention.datapath_exact(hq, hk, hv, hm, scale):
        if grads:
            raise NotImplementedError(
                f"neuron: scaled_dot_product_attention in a compiled graph with gradients, over inputs that are not "
                f"finite or whose products may overflow (q {tuple(q.shape)}, k {tuple(k.shape)}): its gradients "
                f"would not be CPU's flash kernel's; run it eagerly (torch.compiler.disable) or with finite inputs")
        res.copy_(eager_attention.cpu_kernel(hq, hk, hv, hm, causal, scale))
    return memory.relabel(res, index)


@attention_values.register_fake
def _(out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
      enable_gqa: bool, grads: bool = False) -> Tensor:
    return torch.empty_like(out)


def _values_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return grad, None, None, None, None, None, None, None, None  # (the traced ops carry the gradients)


attention_values.register_autograd(_values_backward)


def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` as a compiled graph calls it: the attention op where
    the flash-attention kernel takes the call; otherwise the eager device's op-by-op path, traced
    (CPU's flash arithmetic, or PyTorch's math path), and for CPU's flash calls
    :func:`attention_values` after it. Under ``torch.autocast("neuron")`` its floating arguments
    are first cast to the autocast dtype, as the eager call's autocast kernel casts them
    (attention is a lower-precision op): this function stands in for that call in the graph,
    and a rotary-embedded query in float32 beside a bf16 value otherwise failed to compile."""
    if query.device.type == "neuron" and torch.is_autocast_enabled("neuron"):
        dt = torch.get_autocast_dtype("neuron")
        query, key, value, attn_mask = (t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                                        else t for t in (query, key, value, attn_mask))
    if query.device.type == "neuron" and eager_attention.takes_meta(query, key, value, attn_mask, dropout_p,
                                                                     enable_gqa):
        flash = eager_attention.check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return attention(query, key, value, attn_mask, bool(is_causal), scale, query.shape[-3] // key.shape[-3],
                         flash)[0]
    out = SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if query.device.type == "neuron" and dropout_p == 0.0 and \
            all(t.device == query.device for t in (query, key, value)) and \
            (_symbolic(query, key, value, attn_mask) or
             eager_attention.check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)):
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return attention_values(out, query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa), grads)
    return out


def _symbolic(*ts: Tensor | None) -> bool:
    """A dynamic-shape trace: which kernel CPU picks is known only at run time."""
    return any(type(d) is not int for t in ts if t is not None for d in t.shape)


def use_attention_op(gm: fx.GraphModule) -> None:
    """Point ``gm``'s attention calls at :func:`sdpa` (in place)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (SDPA, ATEN_SDPA):
            n.target = sdpa
            changed = True
    if changed:
        gm.recompile()
