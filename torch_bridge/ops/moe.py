"""Mixtral-style MoE blocks on neuron as one device op: the library's ``moe`` kernel.

Hugging Face's ``MixtralSparseMoeBlock`` runs routing and experts as a loop of small ops: a
router linear, softmax, top-k, a one-hot mask, and per expert that any token chose a ``where``,
a gather, two linears, silu, a product, a scale and an ``index_add_`` - about 12 + 9 x experts
device ops per layer, each dispatched from Python and charged as its own kernel, with a host
sync (``nonzero``) in the middle. A Trainium deployment runs the block as one MoE kernel
(NKI-lib's blockwise MoE), which is what this module makes the neuron device charge:

* **the op** ``torch.ops.trnsim.moe_block(x, router_weight, gate_up_proj, down_proj, top_k,
  normalize) -> (out, router_logits)`` (weights in Hugging Face's layout: ``[E, H]``,
  ``[E, 2F, H]``, ``[E, H, F]``). On neuron tensors its **values** are the block's own ops on
  zero-copy CPU views, with the three linears on the TensorE datapath
  (:func:`torch_bridge.tensore.matmul_f32`, as a neuron ``mm`` computes them) - the numbers the
  block's ops give run one by one on neuron, bit for bit - and its **time** is one launch of the
  library ``moe`` kernel (``trnsim kernel moe``: routing, on-chip token grouping, grouped SwiGLU
  expert matmuls, combine) for ``(tokens, hidden, ffn, experts)``, shown in the run report as
  ``moe_block``. Where the kernel refuses the shapes (a dtype it lacks, more experts than a PSUM
  bank of logits), the call is charged as the block's ops run eagerly, as before. On CPU tensors
  it is the block's ops (Hugging Face's values).
* **autograd**: the derivative is ``trnsim.moe_block_backward``, one op whose values are PyTorch's
  CPU autograd of the block recomputed on the CPU views as the forward computed it (its linears'
  values the datapath's, with CPU's derivative of a linear: so the backward routes every token
  as the forward did); where the kernel takes the shapes, that derivative is written out op by op
  (:func:`_direct_backward`, the same bits without building autograd's graph) - and whose charge
  is what NxD Training runs: one launch
  of the library ``moe_backward`` kernel (the experts' weight and input gradients and the routing
  weights' gradient, by blocks, as NKI's blockwise backward) and the router's backward as eager
  kernels (the ops autograd runs from the routing weights to the router's input and weight),
  shown in the run report as ``moe_block_backward`` rows. Where the kernel refuses the shapes,
  or only the router logits have a gradient, every backward op autograd runs is charged as an
  eager kernel, as before the kernel existed. A backward with ``create_graph`` (a gradient
  penalty) recomputes the block's ops and differentiates them, each op its own launch
  (:func:`_differentiable_grads`): the one op has no derivative of its own.
* **autocast**: inside ``torch.autocast("neuron")`` the block's own ops would run its router's
  linear in autocast's dtype, and its experts' linears too unless the implementation is
  ``grouped_mm`` (``torch._grouped_mm`` is on no autocast list, on CPU or here). The op takes
  those two dtypes (:func:`autocast_dtypes`), so its values are the block's ops under autocast
  bit for bit, and the kernel is charged in the experts' dtype.
* **torch.compile**: both ops have fake implementations, so a compiled graph holds each as one
  node (no graph break at the data-dependent expert loop), run as in eager mode.
* **the lowering point**: ``MixtralSparseMoeBlock.forward`` calls the op when its input is on
  neuron, the model's experts implementation is one of transformers' own (``"grouped_mm"``, the
  default, ``"batched_mm"`` or ``"eager"``: the same math; an implementation registered with
  transformers under another name, such as a ``"neuron"`` one, runs as chosen), the activation
  is silu, no jitter noise is added and nothing hooks the experts module. Forward hooks on the router (how
  ``output_router_logits=True`` records the logits) are called with ``(router_logits, None,
  None)``. CPU models are untouched: the patch is applied when transformers' Mixtral module is
  imported, and only diverts neuron tensors.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from trnsim.device import KernelSpec
from trnsim.isa import KernelError

from .. import _native, _torch
from ..eager import lowering, memory, tensore, values
from ..runtime import Replay, runtime

__all__ = ["moe_block", "moe_block_backward", "moe_spec", "moe_backward_spec", "block_values", "autocast_dtypes",
           "use_moe_kernel", "original_forward",
           "MIXTRAL_MODULE", "HF_IMPLEMENTATIONS", "OP", "BACKWARD_OP"]

OP = "moe_block"
BACKWARD_OP = "moe_block_backward"
MIXTRAL_MODULE = "transformers.models.mixtral.modeling_mixtral"
#: transformers' own experts implementations (the same math as a loop, a batched or a grouped
#: matmul; ``grouped_mm`` is the default): a block set to one of these runs as the MoE op
HF_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")


# ---- the block's computation (Hugging Face's Mixtral, op for op) ----------------------------
def _cpu_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _datapath_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` as a neuron ``mm(x, w.t())`` computes it (fp32 PSUM, one rounding): the
    datapath's result when it is finite or the operands' products cannot overflow, else CPU's
    kernel (values.mm's rule)."""
    wt = w.t()
    p = tensore.datapath_product(tensore.matmul_f32, x, wt)
    return torch.mm(x, wt) if p is None else p.to(x.dtype)


class _DatapathLinear(torch.autograd.Function):
    """:func:`_datapath_linear` with CPU's derivative of ``F.linear`` (``linear_backward``:
    ``grad @ w``, ``grad^T @ x``, contiguous as CPU's): autograd of the block as the device computed its forward. The backward
    recomputes the block from its inputs; with CPU's linears there, a router logit a rounding
    apart could route a token to other experts than the forward did (1 token in ~400k in bf16),
    and that token's gradient went to experts it never reached."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return _datapath_linear(x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        gx = grad.mm(w) if ctx.needs_input_grad[0] else None
        gw = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return gx, gw


def _recompute_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The backward's recomputation of a linear: the forward's values (the datapath's, where it
    computes the dtype) with CPU's derivative."""
    return _DatapathLinear.apply(x, w) if tensore.on_datapath(x, w) else F.linear(x, w)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as an autocast region's matmul takes it: in ``dtype`` (None: as it is)."""
    return t if dtype is None else t.to(dtype)


def _routing(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool,
             linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             router_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """``MixtralTopKRouter``'s ops: (logits, the top-k routing weights, their experts); the
    router's linear in ``router_dtype`` (autocast's, None: the operands' own)."""
    logits = linear(_cast(x, router_dtype), _cast(router_weight, router_dtype))
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return logits, weights, index


def block_values(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 top_k: int, normalize: bool, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _cpu_linear,
                 router_dtype: torch.dtype | None = None, expert_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, router logits) of a Mixtral MoE block on CPU tensors, computed by the same ops in
    the same order as ``MixtralTopKRouter`` + ``MixtralExperts`` (so CPU values are Hugging
    Face's bit for bit); ``linear`` computes the three projections, the router's operands cast
    to ``router_dtype`` and the experts' to ``expert_dtype`` where not None (what autocast
    does to those linears; see :func:`autocast_dtypes`)."""
    logits, weights, index = _routing(x, router_weight, top_k, normalize, linear, router_dtype)
    experts = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in _experts_hit(hit):
        if e == experts:
            continue
        pos, tok = torch.where(mask[e])
        state = x[tok]
        gate, up = linear(_cast(state, expert_dtype), _cast(gate_up_proj[e], expert_dtype)).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        h = linear(_cast(h, expert_dtype), _cast(down_proj[e], expert_dtype))
        h = h * weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out, logits


def _experts_hit(hit: torch.Tensor) -> Any:
    """The experts ``hit`` ([n, 1]) names, as :func:`block_values`' loop takes them: HF's own
    iteration (each a 0-d tensor, compared and indexed with through ``item()``) where a dispatch
    mode sees the ops (the eager charges of :class:`_ChargeEager`, a user's mode), else the same
    numbers as ints (the same values without the unbind, ``eq`` and ``item()`` calls: a ~360 us
    call of 64 tokens over 4 experts takes ~200 us)."""
    if _torch.dispatch_modes():
        return (e[0] for e in hit)
    return hit.flatten().tolist()


_KERNEL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def moe_spec(x: torch.Tensor, gate_up_proj: torch.Tensor, top_k: int, normalize: bool,
             expert_dtype: torch.dtype | None = None) -> KernelSpec | None:
    """The library ``moe`` kernel for a block call: ``(tokens, hidden, ffn, experts)`` in the
    experts' dtype (``expert_dtype``, else ``x``'s; None for a dtype the kernel lacks)."""
    dtype = expert_dtype or x.dtype
    if dtype not in _KERNEL_DTYPES:
        return None
    tokens, hidden = x.shape
    experts, two_f, _ = gate_up_proj.shape
    return KernelSpec.of("moe", (tokens, hidden, two_f // 2, experts), _KERNEL_DTYPES[dtype],
                         {"top_k": int(top_k), "normalize": bool(normalize)})


def moe_backward_spec(x: torch.Tensor, gate_up_proj: torch.Tensor, top_k: int, normalize: bool,
                      expert_dtype: torch.dtype | None = None) -> KernelSpec | None:
    """The library ``moe_backward`` kernel (the experts' gradients) for a block call's backward."""
    spec = moe_spec(x, gate_up_proj, top_k, normalize, expert_dtype)
    return None if spec is None else KernelSpec.of("moe_backward", spec.shape, spec.dtype, dict(spec.params))


# ---- eager charges of ops run on CPU views --------------------------------------------------
_MATMULS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1)}


class _ChargeEager(_torch.TorchDispatchMode):
    """Charge every aten op run inside it (on CPU tensors) to logical core ``index`` as the
    kernel that op would launch on neuron (views as host-only ops), under the report name
    ``op``: how a computation done on CPU views is costed like the same ops run eagerly."""

    def __init__(self, index: int, op: str, record: list[tuple[str, Any]] | None = None):
        super().__init__()
        self.index = index
        self.op = op
        self.rt = runtime()
        self.record = record  # when a list: each host op ("host", name) and launch ("launch", cost), in order

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = values.op_info(func)
        if info.is_view:
            self.rt.host_op(info.name)
            if self.record is not None and not _torch.tracing():
                self.record.append(("host", info.name))
            return out
        # the cost of a call is a function of its signature (values._run's cache key; a matmul's
        # operand layouts too): looked up once per signature, not lowered again on every call
        if _torch.tracing():
            return out  # (runtime.charge's rule: nothing is launched while torch.compile traces)
        layout = None
        if info.name in _MATMULS:
            ia, ib = _MATMULS[info.name]
            layout = lowering.matmul_layout(args[ia], args[ib])
        key = (func, values._signature(args), values._signature(tuple(kwargs.items())), values._signature(out), layout)
        cost = _eager_costs.get(key)
        if cost is None:
            if layout is not None:
                a, b = args[ia], args[ib]
                batch, (m, k), n = (a.shape[0], a.shape[1:], b.shape[-1]) if a.dim() == 3 else (1, a.shape, b.shape[1])
                spec = lowering.matmul_spec(batch, m, k, n, a.dtype, *layout)
                cost = self.rt.cost(spec, "empty matmul (launch only)")
            else:
                ins = lowering.flat_tensors(list(args) + list(kwargs.values()), [])
                cost = self.rt.cost(lowering.op_spec(info.name, args, kwargs, ins, lowering.flat_tensors(out, [])))
            _eager_costs[key] = cost
        self.rt.charge(self.index, self.op, cost)
        if self.record is not None:
            self.record.append(("launch", cost))
        return out


_eager_costs: dict[tuple[Any, ...], Any] = {}  # _ChargeEager's call signature -> its cost


# ---- the ops --------------------------------------------------------------------------------
def _device(name: str, *ts: torch.Tensor) -> int | None:
    """The neuron device of the call (None: CPU tensors); one line for a mix."""
    devices = {t.device for t in ts if t is not None}
    if len(devices) > 1:
        a, b = sorted(map(str, devices))[:2]
        raise RuntimeError(f"trnsim::{name}: tensors on {a} and {b}; the MoE block runs on one device")
    dev = next(iter(devices))
    return (dev.index or 0) if dev.type == "neuron" else None


def _views(*ts: torch.Tensor | None) -> list[Any]:
    return [memory.cpu_view(t) if t is not None and values.is_neuron(t) else t for t in ts]


@torch.library.custom_op("trnsim::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              top_k: int, normalize: bool, router_dtype: torch.dtype | None = None,
              expert_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mixtral MoE block over tokens ``x [T, H]``: (out [T, H], router logits [T, E]), the
    router's and the experts' linears in ``router_dtype`` and ``expert_dtype`` where given (an
    autocast region's: :func:`autocast_dtypes`) - see the module docstring."""
    index = _device(OP, x, router_weight, gate_up_proj, down_proj)
    if index is None:
        out, logits = block_values(x, router_weight, gate_up_proj, down_proj, top_k, normalize, _cpu_linear,
                                   router_dtype, expert_dtype)
        return out, logits
    return values.call_traced(OP, _neuron_forward, index, x, router_weight, gate_up_proj, down_proj, top_k, normalize,
                              router_dtype, expert_dtype)


def _forward_values(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, top_k: int, normalize: bool, router_dtype: torch.dtype | None,
                    expert_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's values as the device computes them (host tensors): :func:`block_values` with
    :func:`_datapath_linear`, in one native call (``trnsim::moe_forward_values``: the same ATen
    calls in the same order) without autocast dtypes, where it takes the call."""
    if router_dtype is None and expert_dtype is None:
        op = _native.op("moe_forward_values")
        got = op(x, router_weight, gate_up_proj, down_proj, top_k, normalize) if op is not None else None
        if got:
            return got[0], got[1]
    return block_values(x, router_weight, gate_up_proj, down_proj, top_k, normalize, _datapath_linear, router_dtype,
                        expert_dtype)


def _neuron_forward(index: int, x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, top_k: int, normalize: bool, router_dtype: torch.dtype | None,
                    expert_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    cx, cr, cg, cd = _views(x, router_weight, gate_up_proj, down_proj)
    out, logits = _forward_values(cx, cr, cg, cd, top_k, normalize, router_dtype, expert_dtype)
    rt = runtime()
    spec = moe_spec(x, gate_up_proj, top_k, normalize, expert_dtype)
    try:
        cost = None if spec is None else rt.cost(spec)
    except KernelError:
        cost = None  # the kernel refuses these shapes: the block's ops, charged as eager kernels
    if cost is not None:
        rt.charge(index, OP, cost)
    else:
        with _ChargeEager(index, OP):
            block_values(cx, cr, cg, cd, top_k, normalize, _cpu_linear, router_dtype, expert_dtype)
    return memory.relabel(out, index), memory.relabel(logits, index)


@moe_block.register_fake
def _moe_block_fake(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, top_k: int, normalize: bool, router_dtype: torch.dtype | None = None,
                    expert_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty((x.shape[0], router_weight.shape[0]), dtype=router_dtype or x.dtype)


@torch.library.custom_op("trnsim::moe_block_backward", mutates_args=())
def moe_block_backward(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                       down_proj: torch.Tensor, grad_out: torch.Tensor | None, grad_logits: torch.Tensor | None,
                       top_k: int, normalize: bool, router_dtype: torch.dtype | None = None,
                       expert_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`moe_block`'s (out, logits) for (x, router_weight, gate_up_proj,
    down_proj) - see the module docstring."""
    index = _device(BACKWARD_OP, x, router_weight, gate_up_proj, down_proj, grad_out, grad_logits)
    dtypes = (router_dtype, expert_dtype)
    if index is None:
        return _backward_values(x, router_weight, gate_up_proj, down_proj, grad_out, grad_logits, top_k, normalize,
                                dtypes, None)
    return values.call_traced(BACKWARD_OP, _neuron_backward, index, x, router_weight, gate_up_proj, down_proj,
                              grad_out, grad_logits, top_k, normalize, dtypes)


def _backward_values(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, grad_out: torch.Tensor | None, grad_logits: torch.Tensor | None,
                     top_k: int, normalize: bool, dtypes: tuple[torch.dtype | None, torch.dtype | None],
                     index: int | None, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _cpu_linear
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU autograd of the block (recomputed on CPU tensors by ``linear``, its router's and
    experts' linears in ``dtypes``); with ``index``, the backward's ops are charged to that
    logical core as eager kernels (the recomputation is not)."""
    leaves = [t.detach().requires_grad_() for t in (x, router_weight, gate_up_proj, down_proj)]
    with torch.enable_grad(), _torch.autograd_inside_op():
        out, logits = block_values(*leaves, top_k, normalize, linear, *dtypes)
        pairs = [(o, g) for o, g in ((out, grad_out), (logits, grad_logits)) if g is not None]
        if index is None:
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
        else:
            with _ChargeEager(index, BACKWARD_OP):
                grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))  # type: ignore[return-value]


def _forward_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A linear's forward values as the device computed them (:func:`_recompute_linear`'s, no graph)."""
    return _datapath_linear(x, w) if tensore.on_datapath(x, w) else F.linear(x, w)


def _linear_grads(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU's derivative of ``F.linear(x, w)`` (as :class:`_DatapathLinear`'s): (``grad @ w``, ``grad^T @ x``)."""
    return grad.mm(w), grad.t().mm(x)


def _direct_backward(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, grad_out: torch.Tensor, grad_logits: torch.Tensor | None, top_k: int,
                     normalize: bool, dtypes: tuple[torch.dtype | None, torch.dtype | None]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's gradients written out: its forward recomputed as the device computed it (the
    same ops as :func:`block_values`, so every token routes as the forward did), then each op's
    derivative as autograd's formula for it, in the block's dtypes (a cast's derivative casts back;
    ``h * weights`` promotes to float32, so its input's gradient is cast to ``h``'s dtype). The
    same numbers as autograd of the recomputed block (:func:`_backward_values`), the input's
    gradient summed in autograd's order, bit for bit; without building and walking the graph,
    which took about half of a 4-expert block's backward on the host (the Mixtral zoo program's
    step was 2.1x CPU's)."""
    router_dtype, expert_dtype = dtypes
    if dtypes == (None, None) and grad_out is not None:
        # the same ATen calls in the same order in one native call, where it takes them
        # (trnsim::moe_backward_values, csrc/neuron.cpp)
        op = _native.op("moe_backward_values")
        got = op(x, router_weight, gate_up_proj, down_proj, grad_out, grad_logits, top_k, normalize) \
            if op is not None else None
        if got:
            return tuple(got)  # type: ignore[return-value]
    xr, wr = _cast(x, router_dtype), _cast(router_weight, router_dtype)
    logits = _forward_linear(xr, wr)
    probs = F.softmax(logits.float(), dim=-1)
    raw, index = torch.topk(probs, top_k, dim=-1)
    total = raw.sum(dim=-1, keepdim=True) if normalize else None
    weights = raw / total if total is not None else raw
    experts = gate_up_proj.shape[0]
    gx = torch.zeros_like(x)
    g_gate_up = torch.zeros_like(gate_up_proj)
    g_down = torch.zeros_like(down_proj)
    g_weights = torch.zeros_like(weights)
    mask = F.one_hot(index, num_classes=experts + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    ran = [e for e in hit.flatten().tolist() if e != experts]
    for e in reversed(ran):  # (autograd reaches the last expert's ops first: the input's gradient
        pos, tok = torch.where(mask[e])  # sums the experts' parts in this order, then the router's)
        state = _cast(x[tok], expert_dtype)
        w_gate_up, w_down = _cast(gate_up_proj[e], expert_dtype), _cast(down_proj[e], expert_dtype)
        gate, up = _forward_linear(state, w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate)
        mid = act * up
        h = _forward_linear(mid, w_down)
        scale = weights[tok, pos, None]
        # out.index_add_(0, tok, (h * scale).to(out.dtype)): the product's gradient is grad_out's rows
        g = grad_out[tok].to(torch.result_type(h, scale))
        g_weights.index_put_((tok, pos), (g * h).sum(dim=-1), accumulate=True)
        g_h = (g * scale).to(h.dtype)
        g_mid, g_w_down = _linear_grads(g_h, mid, w_down)
        g_gate = torch.ops.aten.silu_backward(g_mid * up, gate)
        g_state, g_w_gate_up = _linear_grads(torch.cat([g_gate, g_mid * act], dim=-1), state, w_gate_up)
        g_gate_up[e] = g_w_gate_up
        g_down[e] = g_w_down
        gx.index_add_(0, tok, g_state.to(x.dtype))
    if len(ran) > 1:  # autograd sums the experts' whole-weight gradients: 0 + -0 is +0
        g_gate_up.add_(0.0)
        g_down.add_(0.0)
    # the router: normalisation (weights /= their sum), top-k, softmax, the logits' cast, its linear
    if total is not None:
        g_raw = g_weights / total + (-g_weights * ((raw / total) / total)).sum(dim=-1, keepdim=True)
    else:
        g_raw = g_weights
    g_probs = torch.zeros_like(probs).scatter(-1, index, g_raw)
    g_logits = _torch.softmax_backward_data(g_probs, probs, -1, torch.float32).to(logits.dtype)
    if grad_logits is not None:
        g_logits = g_logits + grad_logits
    g_xr, g_wr = _linear_grads(g_logits, xr, wr)
    gx = gx + g_xr.to(x.dtype)
    return gx, g_wr.to(router_weight.dtype), g_gate_up, g_down


def _neuron_backward(index: int, x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, grad_out: torch.Tensor | None, grad_logits: torch.Tensor | None,
                     top_k: int, normalize: bool, dtypes: tuple[torch.dtype | None, torch.dtype | None]
                     ) -> tuple[torch.Tensor, ...]:
    views = _views(x, router_weight, gate_up_proj, down_proj, grad_out, grad_logits)
    rt = runtime()
    spec = None if grad_out is None else moe_backward_spec(x, gate_up_proj, top_k, normalize, dtypes[1])
    try:
        cost = None if spec is None else rt.cost(spec)
    except KernelError:
        cost = None  # the kernel refuses these shapes: autograd's ops, charged as eager kernels
    if cost is None:
        grads = _backward_values(*views, top_k, normalize, dtypes, index, _recompute_linear)
    else:
        grads = _direct_backward(*views, top_k, normalize, dtypes)
        rt.charge(index, BACKWARD_OP, cost)
        _charge_router_backward(index, views[0], views[1], views[5], top_k, normalize, dtypes[0])
    return tuple(memory.relabel(g, index) for g in grads)


def _charge_router_backward(index: int, x: torch.Tensor, router_weight: torch.Tensor, grad_logits: torch.Tensor | None,
                            top_k: int, normalize: bool, router_dtype: torch.dtype | None) -> None:
    """Charge the router's part of the backward, which the ``moe_backward`` kernel leaves to the
    ops around it (its ``grad_weights`` output -> normalise, top-k, softmax, the router linear,
    and the input gradient's two parts added): those ops as autograd runs them, as eager
    kernels. Their charges read only shapes, so they run on zero gradients; the gradients
    themselves come from the block's whole autograd. Being a function of the shapes, layouts and
    dtypes of ``x`` and the router's weight (and of ``top_k``, ``normalize`` and whether the
    logits have a gradient), the sequence is recorded on a signature's first call and replayed
    after: recomputing the router and its autograd under a dispatch mode cost ~5 ms a call."""
    if _torch.tracing():
        return  # (runtime.charge's rule: nothing is launched while torch.compile traces)
    rt = runtime()
    if _router_memo_device[0] is not rt.device:
        _router_memo.clear()
        _router_memo_device[0] = rt.device
    key = (tuple(x.shape), x.stride(), x.dtype, tuple(router_weight.shape), router_weight.stride(), router_weight.dtype,
           grad_logits is not None, top_k, normalize, router_dtype)
    memo = _router_memo.get(key)
    if memo is not None:
        rt.replay(index, memo)  # (host ops counted at once: one per view cost ~5 us, each draining the device's log)
        return
    events = []
    leaves = [t.detach().requires_grad_() for t in (x, router_weight)]
    with torch.enable_grad(), _torch.autograd_inside_op():
        logits, weights, _ = _routing(*leaves, top_k, normalize, _cpu_linear, router_dtype)
        outs = [weights] + ([logits] if grad_logits is not None else [])
        zeros = [torch.zeros_like(o) for o in outs]  # (made outside the charges: not the device's ops)
        with _ChargeEager(index, BACKWARD_OP, events):
            gx, _ = torch.autograd.grad(outs, leaves, zeros, allow_unused=True)
            if gx is not None:
                gx + gx  # the router's and the experts' parts of the input gradient
    hosts: dict[str, int] = {}
    for kind, what in events:
        if kind == "host":
            hosts[what] = hosts.get(what, 0) + 1
    _router_memo[key] = Replay([(BACKWARD_OP, what) for kind, what in events if kind == "launch"], hosts)


# signature -> the router backward's charges: its launches' costs in order, and its host ops counted by name
_router_memo: dict[tuple[Any, ...], Replay] = {}
_router_memo_device: list[Any] = [None]  # the device model those costs are of


@moe_block_backward.register_fake
def _moe_block_backward_fake(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
                             down_proj: torch.Tensor, grad_out: torch.Tensor | None, grad_logits: torch.Tensor | None,
                             top_k: int, normalize: bool, router_dtype: torch.dtype | None = None,
                             expert_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t) for t in (x, router_weight, gate_up_proj, down_proj))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, router_weight, gate_up_proj, down_proj, top_k, normalize, router_dtype, expert_dtype = inputs
    ctx.save_for_backward(x, router_weight, gate_up_proj, down_proj)
    ctx.top_k, ctx.normalize, ctx.dtypes = top_k, normalize, (router_dtype, expert_dtype)


def _derivative(ctx: Any, grad_out: torch.Tensor | None, grad_logits: torch.Tensor | None) -> tuple[Any, ...]:
    x, router_weight, gate_up_proj, down_proj = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward with create_graph: gradients that carry a graph
        return (*_differentiable_grads(ctx, (x, router_weight, gate_up_proj, down_proj), grad_out, grad_logits),
                None, None, None, None)
    grads = moe_block_backward(x, router_weight, gate_up_proj, down_proj,
                               None if grad_out is None else grad_out.contiguous(),
                               None if grad_logits is None else grad_logits.contiguous(), ctx.top_k, ctx.normalize,
                               *ctx.dtypes)
    return (*grads, None, None, None, None)


def _differentiable_grads(ctx: Any, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor | None,
                          grad_logits: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a backward with ``create_graph`` (a gradient penalty, a Hessian): the
    block's ops recomputed on the device (:func:`block_values`, each op its own launch, as the
    block runs where the op does not take it) and differentiated, so the gradients carry a graph
    back to the inputs. ``moe_block_backward`` has no derivative of its own: through it the
    second-order terms were refused where CPU computes them."""
    wanted = [t.requires_grad for t in inputs]
    out, logits = block_values(*inputs, ctx.top_k, ctx.normalize, _cpu_linear, *ctx.dtypes)
    pairs = [(o, g) for o, g in ((out, grad_out), (logits, grad_logits)) if g is not None]
    wrt = [t for t, w in zip(inputs, wanted) if w]
    if not pairs or not wrt:
        return (None,) * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], create_graph=True,
                                   allow_unused=True))
    return tuple(next(got) if w else None for w in wanted)


moe_block.register_autograd(_derivative, setup_context=_setup_context)


# ---- Mixtral's block on neuron --------------------------------------------------------------
def _takes(block: Any, hidden: torch.Tensor) -> bool:
    """True when a ``MixtralSparseMoeBlock`` call on ``hidden`` runs as the one op."""
    if hidden.device.type != "neuron" or hidden.dim() != 3:
        return False
    experts, gate = block.experts, block.gate
    cfg = getattr(experts, "config", None)
    if getattr(cfg, "_experts_implementation", None) not in HF_IMPLEMENTATIONS:
        return False  # an experts implementation registered for this (e.g. an estimate's): run that
    if getattr(cfg, "hidden_act", "silu") != "silu" or (block.training and block.jitter_noise > 0):
        return False
    if gate._forward_pre_hooks or experts._forward_hooks or experts._forward_pre_hooks:
        return False  # something observes the block's internals: run them
    return True


#: the experts implementations whose linears autocast runs in its dtype (``F.linear``, ``bmm``);
#: ``grouped_mm``'s ``torch._grouped_mm`` is on no autocast list and stays in the weights' dtype
_AUTOCAST_EXPERTS = (None, "eager", "batched_mm")


def autocast_dtypes(block: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(router, experts) dtypes of a block's linears under the neuron autocast region in force:
    what its own ops would compute in, as CPU's autocast runs them (the router's ``F.linear``
    in autocast's dtype; the experts' by their implementation); (None, None) outside one."""
    if not torch.is_autocast_enabled("neuron"):
        return None, None
    dtype = torch.get_autocast_dtype("neuron")
    impl = getattr(getattr(block.experts, "config", None), "_experts_implementation", None)
    return dtype, (dtype if impl in _AUTOCAST_EXPERTS else None)


def _mixtral_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _takes(self, hidden_states):
            return original(self, hidden_states)
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        out, logits = torch.ops.trnsim.moe_block(x, self.gate.weight, self.experts.gate_up_proj,
                                                 self.experts.down_proj, self.gate.top_k, True, *autocast_dtypes(self))
        for hook in self.gate._forward_hooks.values():  # output_router_logits records the logits so
            hook(self.gate, (x,), (logits, None, None))
        return out.reshape(b, s, h)

    forward._trnsim_original = original  # type: ignore[attr-defined]
    return forward


def use_moe_kernel(module: Any = None) -> None:
    """Make ``MixtralSparseMoeBlock`` call the MoE op on neuron tensors (idempotent); ``module``
    is transformers' Mixtral modelling module (imported if not given)."""
    module = module if module is not None else importlib.import_module(MIXTRAL_MODULE)
    cls = module.MixtralSparseMoeBlock
    if not hasattr(cls.forward, "_trnsim_original"):
        cls.forward = _mixtral_forward(cls.forward)


def original_forward(cls: Any) -> Callable[..., torch.Tensor]:
    """The block's own forward (its ops one by one), e.g. to compare against the op."""
    return getattr(cls.forward, "_trnsim_original", cls.forward)
