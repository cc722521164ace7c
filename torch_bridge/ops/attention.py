"""``F.scaled_dot_product_attention`` on neuron as one device op, forward and backward.

PyTorch picks an SDPA backend through a C++ DispatchStub that Python cannot fill for
PrivateUse1, so without this module attention runs as the math decomposition: about ten device
ops per layer (bmm, scale, mask, softmax, bmm and their backwards), each dispatched from Python
and charged as its own kernel. A Trainium backend runs a fused flash-attention kernel instead.

``scaled_dot_product_attention`` is CompositeImplicitAutograd, and a kernel registered directly
at AutogradPrivateUse1 takes precedence over the composite for neuron tensors (and one at
PrivateUse1 serves calls below autograd, e.g. in inference mode). Both run
:class:`_Attention`, a ``torch.autograd.Function`` whose forward and backward are each one op:

* **values** - QKᵀ, P·V and the backward's four matmuls run through the TensorE datapath
  (:func:`torch_bridge.tensore.bmm_f32`: operands in their dtype, fp32 PSUM accumulation); the
  scaling, masking and softmax run as CPU torch ops in fp32 on zero-copy views, as PyTorch's
  math path does (it upcasts bf16/fp16 to fp32 too). P is cast to the operand dtype before P·V,
  as the PE array reads it.
* **time** - the forward is charged as the library ``attention`` kernel (``causal`` when
  ``is_causal``); an explicit mask runs the non-causal kernel plus a generic kernel that reads
  the mask once. A decode step (up to :data:`TKG_MAX_ACTIVE` queries over more keys, bf16 or
  fp16: Hugging Face's ``generate()`` over its KV cache) is charged as the library's
  token-generation kernel ``attention_tkg``, as NxD Inference runs decode attention, its cache
  read in whole 128-key tiles (:func:`torch_bridge.eager.lowering.attention_specs`). The
  backward keeps P from the forward (as the math path does) and is charged as its four matmul
  kernels (dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q) plus a generic VectorE kernel for the
  softmax backward (reads P and dP, writes dS): five launches, where a fused backward kernel
  would pay one.

Calls the kernels cannot take (dropout, head dim over the PE array's 128 partitions, queries and
keys of different lengths other than a decode step's, different q/v head dims, non-datapath
dtypes, a mask that needs a gradient, mismatched batch dims) run PyTorch's math path, op by op,
as before; a boolean mask is first made the additive 0/-inf mask that path takes
(:func:`additive_mask`), as CPU's ``scaled_dot_product_attention`` does before it picks a
backend (the math op itself adds a bool mask as 0/1).

Every call is checked as CPU checks it first (:func:`check`): CPU's errors for what CPU refuses,
and ``attn_mask`` with ``is_causal=True`` accepted where CPU accepts it (its fused kernel, which
applies both: the mask and the causal -inf added to the scores) and refused where CPU refuses it
(its math path).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

from .. import _native, _torch
from ..eager import lowering, memory, tensore, values
from ..runtime import runtime

__all__ = ["sdpa", "takes", "takes_meta", "check", "additive_mask", "forward_values", "backward_values",
           "charge_forward", "charge_backward"]

FORWARD = "scaled_dot_product_attention"
BACKWARD = "scaled_dot_product_attention_backward"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
MAX_HEAD_DIM = 128  # the attention kernel's limit: D on the PE array's contraction partitions
# decoding over a KV cache (fewer queries than keys): the library's attention_tkg takes up to 8
# active queries per sequence (speculative decoding's draft length), their query heads per kv
# head times that at most 128 columns, in bf16 or fp16
TKG_MAX_ACTIVE = 8
TKG_COLUMNS = 128
TKG_DTYPES = (torch.bfloat16, torch.float16)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
          enable_gqa: bool) -> bool:
    """True when the fused op computes this call; otherwise the math path does."""
    if any(type(t) not in _PLAIN for t in (q, k, v, attn_mask) if t is not None):
        return False  # fake or functional tensors (torch.compile tracing) have no memory to compute on
    return takes_meta(q, k, v, attn_mask, dropout_p, enable_gqa)


def takes_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
               enable_gqa: bool) -> bool:
    """:func:`takes` from metadata alone (a compiled graph's fake tensors)."""
    if dropout_p > 0.0 or q.dim() < 3 or not q.dim() == k.dim() == v.dim():
        return False
    if not tensore.on_datapath(q, k, v) or q.is_nested or q.device != k.device or q.device != v.device:
        return False
    l, e = q.shape[-2:]
    s, ev = v.shape[-2:]
    if e > MAX_HEAD_DIM or ev != e or k.shape[-1] != e or k.shape[-2] != s:
        return False
    hq, hk = q.shape[-3], k.shape[-3]
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-2] != k.shape[:-2]:
        return False
    if hk != hq and not (enable_gqa and hk > 0 and hq % hk == 0):
        return False
    if l != s and not (0 < l <= TKG_MAX_ACTIVE and s > l and q.dtype in TKG_DTYPES
                       and (hq // max(hk, 1)) * l <= TKG_COLUMNS):
        return False  # not a decode step the token-generation kernel takes: op by op
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.device != q.device:
            return False
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return False
        if not _fits(tuple(attn_mask.shape), tuple(q.shape[:-1]) + (s,)):
            return False  # a mask that would widen the scores: the math path (and CPU's error)
    return True


def _fits(mask: tuple[Any, ...], scores: tuple[Any, ...]) -> bool:
    """True when ``mask`` broadcasts to ``scores`` without widening it. Integer sizes are compared
    here (``torch.broadcast_shapes`` costs ~20 us a call, a decode step's attention ~80); symbolic
    ones (a compile's trace) by ``torch.broadcast_shapes``, which adds no guard."""
    if all(type(n) is int for n in mask) and all(type(n) is int for n in scores):
        return len(mask) <= len(scores) and all(m == 1 or m == n for m, n in zip(reversed(mask), reversed(scores)))
    try:
        return torch.broadcast_shapes(mask, scores) == scores
    except RuntimeError:
        return False


FUNCTORCH = ("scaled_dot_product_attention on neuron does not run inside a torch.func transform (grad, vmap, "
             "jacrev, ...): its values are CPU's kernels' on the device's memory, which the transform's wrapped "
             "tensors do not expose; run the transform on CPU tensors, or differentiate with torch.autograd")
CAUSAL_WITH_MASK = "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True"
_FLASH = 1  # sdp::SDPBackend::flash_attention, as CPU's backend choice numbers it

# the call's metadata -> (None (CPU takes it) or (exception type, message) (CPU refuses it), CPU's backend choice)
_checked: dict[tuple[Any, ...], tuple[tuple[type, str] | None, int | None]] = {}


def _scale(scale: float | None, e: int) -> float:
    """The scores' scale as CPU takes it: ``scale``, else 1/sqrt(E) (inf for E = 0, where no
    score is read: CPU's 1/sqrt(0))."""
    return scale if scale is not None else 1.0 / math.sqrt(e) if e else math.inf


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _probe(t: torch.Tensor | None) -> torch.Tensor | None:
    """A host tensor of ``t``'s sizes and dtype whose last dim has stride 1 exactly when ``t``'s
    does, over a few bytes (other strides 0): all of a tensor CPU's backend choice reads, bar
    ``requires_grad``, which it keeps."""
    if t is None:
        return None
    last = 1 if t.dim() == 0 or t.stride(-1) == 1 else 2
    n = t.shape[-1] if t.dim() else 1
    base = torch.empty((n - 1) * last + 1 if n else 0, dtype=t.dtype)
    with torch.enable_grad():
        base.requires_grad_(t.requires_grad)
        return base.as_strided(t.shape, [0] * (t.dim() - 1) + [last] if t.dim() else [])


def _refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
             is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[tuple[type, str] | None, int | None]:
    """CPU's verdict on a call, from metadata, and its backend choice: the input checks of
    ``scaled_dot_product_attention`` (run on meta tensors of the same sizes, which share them) and
    CPU's backend choice (``_fused_sdp_choice`` on :func:`_probe` tensors), which checks masks on
    its own and decides ``attn_mask`` with ``is_causal``: its fused kernel takes the two together,
    its math path refuses them."""
    errors = (RuntimeError, ValueError, IndexError, TypeError)
    try:
        torch.ops.aten.scaled_dot_product_attention.default(
            _meta(q), _meta(k), _meta(v), _meta(mask), dropout_p, is_causal and mask is None, scale=scale,
            enable_gqa=enable_gqa)
        meta_error = None
    except errors as e:
        meta_error = e
    if meta_error is not None and str(meta_error).startswith(_INPUT_CHECKS):
        return (type(meta_error), str(meta_error)), None  # CPU checks the inputs before it picks a backend
    try:  # CPU's choice has checks of its own (a 1-d mask is an IndexError there)
        choice = _torch.fused_sdp_choice(_probe(q), _probe(k), _probe(v), _probe(mask), dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    except errors as e:
        return (type(e), str(e)), None
    if meta_error is not None:  # the math path's own error (shapes that do not multiply, ...)
        return (type(meta_error), str(meta_error)), choice
    if is_causal and mask is not None and choice != _FLASH:
        return (RuntimeError, CAUSAL_WITH_MASK), choice
    return None, choice


# the messages of scaled_dot_product_attention's input checks (validate_sdpa_input), which CPU
# runs before its backend choice
_INPUT_CHECKS = ("Expected query, key, and value", "Expected query, key and value", "Expected attn_mask")


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
          is_causal: bool, scale: float | None, enable_gqa: bool) -> bool:
    """Raise CPU's error for a call CPU refuses (see :func:`_refusal`); cached by metadata. True
    when CPU computes the call with its fused (flash) kernel, whose output is laid out as the query
    is (:func:`laid_out_as_cpu`)."""
    ts = (q, k, v) if mask is None else (q, k, v, mask)
    if q.is_nested or k.is_nested or v.is_nested or (mask is not None and mask.is_nested):
        return False  # nested tensors: PyTorch's own path checks them
    rest = (tuple(t.dtype for t in ts), tuple(t.stride(-1) == 1 if t.dim() else True for t in ts),
            mask is not None and mask.requires_grad, dropout_p > 0.0, bool(is_causal), scale is None, bool(enable_gqa),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    decode = _decode_sizes(q, k, v, mask)
    try:
        known = None if decode is None else _checked.get((decode,) + rest)
        if known is None:
            key = (tuple(t.shape for t in ts),) + rest
            known = _checked.get(key)
    except TypeError:  # an unhashable symbolic size (a dynamic-shape trace): no meta or host tensor can stand for it
        return False
    if known is None:
        # the checks' tensors are their own: real (also inside a compile's trace), unseen by the
        # caller's modes (a flop counter would count the meta math path's matmuls)
        with _torch.DisableTorchFunction(), _torch.disable_current_modes():
            known = _checked[key] = _refusal(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        if decode is not None and known[0] is None:
            _checked[(decode,) + rest] = known  # (a refusal's message may name the key count: kept by its sizes)
    verdict, choice = known
    if verdict is not None:
        raise verdict[0](verdict[1])
    return choice == _FLASH


def _decode_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                  ) -> tuple[Any, ...] | None:
    """A decode step's sizes without its key count, or None for any other call. A decode step
    over a KV cache (no mask, queries, keys and values of one rank over 1, more keys than
    queries) has one key more at each generated token: :func:`check` keeps CPU's verdict on
    such a call, when CPU takes it, under these sizes too, so a long generation checks once,
    not once a token. CPU takes or refuses it, and picks its kernel, whatever the key count
    (``tests/torch/test_sdpa.py`` sweeps it); a refusal stays keyed by every size, as its
    message may name the key count ("got [1, 16] X [8, 1030]")."""
    if mask is None and q.dim() == k.dim() == v.dim() > 1:
        s, l = k.shape[-2], q.shape[-2]
        if type(s) is int and type(l) is int and s > l and v.shape[-2] == s:  # (not symbolic sizes)
            return (q.shape, k.shape[:-2], k.shape[-1], v.shape[:-2], v.shape[-1], "keys > queries")
    return None


def _order(t: torch.Tensor, strides: Any) -> tuple[int, ...]:
    """The strides that place elements (those of dims of size > 1: a size-1 dim's is arbitrary)."""
    return tuple(st for n, st in zip(t.shape, strides) if n > 1)


def cpu_layout(q: torch.Tensor, out: torch.Tensor, flash: bool) -> tuple[int, ...] | None:
    """The strides CPU gives the output where they place its elements otherwise than ``out``'s,
    else None. CPU's flash kernel writes into ``empty_like(query)``: a permuted query (Hugging
    Face's ``view(B, L, H, E).transpose(1, 2)``) gets a permuted output; its math path's output
    is contiguous (found by difftest's long run: (96, 8, 16, 1) on CPU, (96, 48, 8, 1) here)."""
    if not flash or out.shape != q.shape:
        return None
    key = (q.shape, q.stride(), out.stride())
    try:
        got = _layouts.get(key, _UNSEEN)
    except TypeError:  # symbolic sizes or strides (a dynamic-shape trace): worked out, not kept
        return _flash_layout(q, out)
    if got is _UNSEEN:
        got = _layouts[key] = _flash_layout(q, out)
    return got


def _flash_layout(q: torch.Tensor, out: torch.Tensor) -> tuple[int, ...] | None:
    """:func:`cpu_layout` of a flash call, worked out: ``empty_like(q)``'s strides where they place
    the elements otherwise than ``out``'s."""
    want = torch.empty_like(q, device="meta").stride()
    return None if _order(out, want) == _order(out, out.stride()) else want


# (query sizes, query strides, output strides) -> cpu_layout's answer: a decode loop's calls repeat a few
_layouts: dict[tuple[Any, ...], tuple[int, ...] | None] = {}
_UNSEEN = object()


def additive_mask(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
                  ) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for PyTorch's math op: a boolean mask as 0 where True and -inf where
    False in the query's dtype (CPU's ``convert_boolean_attn_mask``), and ``is_causal`` together
    with a mask as that mask plus the causal -inf above the diagonal (the math op refuses the pair)."""
    if attn_mask is None:
        return None, is_causal
    mask = attn_mask
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(mask.logical_not(), -math.inf)
    if is_causal:
        l, s = q.shape[-2], k.shape[-2]
        above = torch.ones(l, s, dtype=torch.bool, device=mask.device).triu_(1)
        mask = mask + torch.zeros(l, s, dtype=mask.dtype, device=mask.device).masked_fill_(above, -math.inf)
    return mask, False


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V with each head repeated for the ``groups`` query heads that share it (GQA)."""
    return x.repeat_interleave(groups, dim=-3) if groups > 1 else x


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Query-side rows ``x [..., H, L, N]`` as ``[batch * H / groups, groups * L, N]``: the
    ``groups`` query heads that share a K/V head (GQA, query head ``h`` reads K/V head ``h //
    groups``) as the rows of one matmul against that head, instead of K and V repeated per query
    head (:func:`_heads`). Each product element is the same dot product, accumulated the same way:
    the datapath computes an element from its row and column alone, whatever rows and columns
    share the call."""
    if groups == 1:
        return _flat(x)
    return x.reshape(-1, groups * x.shape[-2], x.shape[-1])


_causal: dict[tuple[int, int, float], torch.Tensor] = {}


def _causal_bias(l: int, s: int, zero: float = 0.0) -> torch.Tensor:
    """``zero`` on and below the diagonal, -inf above: adding it is a tenth of the time of
    masked_fill_. 0.0 is the math path's causal mask; -0.0 is the flash kernel's causal write
    over finite scores (masked_scores)."""
    key = (l, s, math.copysign(1.0, zero))
    bias = _causal.get(key)
    if bias is None:
        bias = _causal[key] = torch.full((l, s), zero).masked_fill_(torch.ones(l, s, dtype=torch.bool).triu_(1),
                                                                    -math.inf)
    return bias


class _Attention(torch.autograd.Function):
    """SDPA whose forward and backward each run as one neuron op (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                is_causal: bool, scale: float | None, groups: int, flash: bool) -> torch.Tensor:
        out, p, sc, exact = _forward(q, k, v, attn_mask, is_causal, scale, groups, flash)
        ctx.save_for_backward(q, k, v)
        ctx.p = p
        ctx.scale, ctx.groups = sc, groups
        ctx.call = (attn_mask, is_causal, scale, flash)  # (for a backward that builds a graph)
        ctx.mask_version = _version(attn_mask)
        mask = None if attn_mask is None else memory.cpu_view(attn_mask)
        # inputs whose values are CPU's kernel's (datapath_exact): so are their gradients
        ctx.cpu_call = None if exact else (mask, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v = ctx.saved_tensors
        mask, causal, scale, flash = ctx.call
        composite = torch.is_grad_enabled() or _torch.batched_grad(grad_out)  # create_graph, or vmapped gradients
        # a backward that reads the mask, or CPU's flash kernel's, which saves the very mask (a
        # boolean one, or one of another dtype, it converts first: a copy, which it does not check)
        if ctx.cpu_call is not None or composite or (flash and mask is not None and mask.dtype == q.dtype):
            check_mask_version(mask, ctx.mask_version)
        if composite:
            return differentiable_grads(ctx, q, k, v, grad_out, mask, causal, scale, ctx.groups > 1, flash) + \
                (None,) * 5
        index = q.device.index or 0
        if ctx.cpu_call is None:
            dq, dk, dv = backward_values(grad_out, q, k, v, ctx.p, ctx.scale, ctx.groups)
        else:  # CPU's own kernel's backward
            dq, dk, dv = cpu_kernel_grads(q, k, v, *ctx.cpu_call, grad_out)
        charge_backward(index, q, k.shape[-2], q.dtype)
        return (memory.relabel(dq, index), memory.relabel(dk, index), memory.relabel(dv, index),
                None, None, None, None, None)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
             scale: float | None, groups: int, flash: bool) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """The fused forward on neuron tensors: (out, P, scale, exact) with out and P on the device
    (P counted there, as the math path keeps it), the launch charged."""
    index = q.device.index or 0
    out, p, sc, exact = forward_values(q, k, v, attn_mask, is_causal, scale, groups, flash)
    laid = cpu_layout(q, out, flash)
    if laid is not None:  # the kernel writes its output in the layout CPU's has
        out = torch.empty_strided(out.shape, laid, dtype=out.dtype).copy_(out)
    p = memory.relabel(p, index)
    charge_forward(index, q, k, attn_mask, is_causal, scale)
    return memory.relabel(out, index), p, sc, exact


def forward_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                   is_causal: bool, scale: float | None, groups: int, flash: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """The forward's values from neuron tensors: (out, P, scale) as CPU tensors (P in fp32),
    and whether they are the datapath's (:func:`datapath_exact`).

    The scores follow the arithmetic of the CPU kernel that computes the call (``flash``: CPU's
    flash kernel, else its math path), which differ where a score is NaN or infinite: see
    :func:`masked_scores`."""
    if not is_causal:  # the common case (a decode step, a padded batch) in one native call, if it takes it
        # (trnsim::sdpa_values, csrc/neuron.cpp: the same ATen calls in the same order as below, from
        # C++, where the values are the datapath's; an empty list where it does not take the call)
        op = _native.op("sdpa_values")
        got = op(q, k, v, attn_mask, scale, groups) if op is not None else None
        if got:
            return got[0], got[1], _scale(scale, q.shape[-1]), True
    # (one native call: a decode step's tensors are new each time; a host mask as it is)
    hq, hk, hv, mask = memory.cpu_views((q, k, v, attn_mask))
    l, e = q.shape[-2:]
    s = k.shape[-2]
    sc = _scale(scale, e)
    exact = datapath_exact(hq, hk, hv, mask, scale)
    scores = tensore.bmm_f32(_grouped(hq, groups), _flat(hk).transpose(1, 2)).view(q.shape[:-1] + (s,))
    scores = masked_scores(scores, mask, is_causal, sc, flash, finite=exact)
    p = torch.softmax(scores, -1)
    if attn_mask is not None or is_causal:  # a row that sees no key is zeros, as CPU's kernels write it
        dead = scores.amax(-1, keepdim=True) == -math.inf
        if dead.any():
            p.masked_fill_(dead, 0.0)
    if exact:
        out = tensore.bmm_f32(_grouped(p.to(q.dtype), groups), _flat(hv)).view(q.shape).to(q.dtype)
    else:
        out = cpu_kernel(hq, hk, hv, mask, is_causal, scale)
    return out, p, sc, exact


def datapath_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None) -> bool:
    """True when the datapath's attention differs from CPU's kernels by rounding alone (host
    views): Q, K and V finite, no product or partial sum of Q Kᵀ (times the scale) or of P V
    able to overflow (:func:`torch_bridge.tensore.bounded`), a positive finite scale, and no
    +inf or NaN in a float mask (-inf, the masking value, is fine; causal fp16/bf16 calls over
    512 keys gave other NaNs with +inf in the mask).
    Otherwise where a score is +-inf or NaN depends on the kernel's summation order and fusion
    (SDPA 167355199899617: 1e30 * 1e30 - 1e30 * 1e30 is NaN in CPU's small bmm, -inf on the
    datapath), and CPU's flash kernel carries NaN, inf and a non-positive scale through its
    blocked online softmax (key blocks of 512; fp16/bf16 exponentials rounded before P V) in
    ways a one-pass softmax does not (SDPA 17573962839114): CPU's own kernel gives those values."""
    e, s = q.shape[-1], k.shape[-2]
    sc = scale if scale is not None else 1.0 / math.sqrt(e) if e else 1.0
    if not (math.isfinite(sc) and sc > 0):
        return False
    if mask is not None and mask.is_floating_point() and mask.numel() and not float(mask.amax()) < math.inf:
        return False
    return tensore.bounded(e, q, k, sc) and float(s) * tensore.magnitude(v) < tensore.BOUND


def cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
               scale: float | None) -> torch.Tensor:
    """CPU's own scaled_dot_product_attention on host views (the kernel CPU picks for them)."""
    with _torch.DisableTorchFunction(), _torch.disable_current_modes(), torch.no_grad():
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])


def cpu_kernel_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                     scale: float | None, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) on CPU of CPU's own scaled_dot_product_attention of the neuron tensors ``q``,
    ``k``, ``v`` (autograd through the kernel CPU picks, on host views; its flash backward
    recomputes from its blocked statistics); ``mask`` a host tensor or None. Inside a custom op
    (a compiled graph's backward) autograd's dispatch keys are excluded: the guard lets autograd
    record again there."""
    hq, hk, hv = (memory.cpu_view(t).detach().requires_grad_() for t in (q, k, v))
    with _torch.DisableTorchFunction(), _torch.disable_current_modes(), torch.enable_grad(), \
            _torch.autograd_inside_op():
        out = torch.ops.aten.scaled_dot_product_attention.default(
            hq, hk, hv, mask, 0.0, is_causal, scale=scale, enable_gqa=hq.shape[-3] != hk.shape[-3])
        return torch.autograd.grad(out, (hq, hk, hv), memory.cpu_view(grad_out).to(out.dtype))


KV_SPLIT = 512  # CPU's flash kernel's key block (kvSplitSize)


def _q_split(l: int) -> int:
    """CPU's flash kernel's query block (qSplitSize) for ``l`` queries."""
    return 256 if l >= 768 else 64 if l >= 192 else 32


def _skipped(l: int, s: int, device: Any = None) -> torch.Tensor:
    """[l, s]: True at the keys CPU's causal flash kernel never computes for a query: those of
    key blocks that start past the query block's last query (no mask is added there)."""
    qs = min(_q_split(l), l)
    rows = torch.arange(l, device=device)
    num_keys = torch.clamp((rows // qs) * qs + qs, max=s)  # min(m + qBlockSize, kvSize)
    starts = (torch.arange(s, device=device) // KV_SPLIT) * KV_SPLIT
    return starts.unsqueeze(0) >= num_keys.unsqueeze(1)


def masked_scores(raw: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, sc: float, flash: bool,
                  finite: bool = False) -> torch.Tensor:
    """The scores softmax reads, from ``raw`` = Q Kᵀ in fp32 (written in place where it can be),
    as CPU computes them. Both of CPU's kernels add the mask (a boolean mask as 0/-inf, so a NaN
    or +inf score where it is False stays NaN); they differ on ``is_causal``:

    * flash (``cpu_flash_attention``): the causal -inf is written over the scores above the
      diagonal (a NaN or inf there is gone) before they are scaled (a scale of 0 makes it NaN),
      then the mask is added; key blocks (of :data:`KV_SPLIT`) past a query block's last query
      are never computed (-inf, unscaled, no mask);
    * math (``_scaled_dot_product_attention_math``): the scaled scores plus the causal mask as
      0/-inf (a NaN above the diagonal stays NaN); it refuses a mask with ``is_causal``.

    ``finite``: every score in ``raw`` is finite (the caller knows: :func:`datapath_exact`). The
    flash causal write is then an addition of -0.0 on and below the diagonal and -inf above it,
    the same bits as the write (x + -0.0 is x, a finite x + -inf is -inf) at a tenth of its time.
    """
    l, s = raw.shape[-2:]
    if is_causal and flash and finite:
        raw.add_(_causal_bias(l, s, -0.0).to(raw.device))
    elif is_causal and flash:
        raw.masked_fill_(torch.ones(l, s, dtype=torch.bool, device=raw.device).triu_(1), -math.inf)
    raw.mul_(sc)
    if is_causal and not flash:
        raw.add_(_causal_bias(l, s).to(raw.device))
    if mask is not None:
        raw = raw + additive(mask, raw.dtype)
    if is_causal and flash and s > KV_SPLIT:  # never computed: not scaled, no mask added
        raw.masked_fill_(_skipped(l, s, raw.device), -math.inf)
    return raw


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask as the scores take it: a boolean one as 0 where True and -inf where False (CPU's
    ``convert_boolean_attn_mask``), a float one as its values in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), -math.inf)
    return mask.to(dtype)


def flash_decomposed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """CPU's flash kernel's arithmetic op by op on the device, for the calls CPU computes with it
    that the library kernel does not take (queries and keys of different lengths, head dims over
    128, ...): PyTorch's math path, which they ran before, scales Q and K instead of the scores,
    adds the causal mask instead of writing it (:func:`masked_scores`), so a NaN or inf key above
    the diagonal made whole rows NaN where CPU gives numbers."""
    hq, hk = q.shape[-3], k.shape[-3]
    if enable_gqa and hk != hq:
        k, v = k.repeat_interleave(hq // hk, dim=-3), v.repeat_interleave(hq // hk, dim=-3)
    sc = _scale(scale, q.shape[-1])
    raw = torch.matmul(q.float(), k.float().transpose(-2, -1))
    scores = masked_scores(raw, mask, is_causal, sc, True)
    p = _torch.safe_softmax(scores, -1)  # (a row that sees no key: zeros, its gradient too)
    return torch.matmul(p.to(q.dtype), v)


def host_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as a host tensor (a neuron mask's host view; a CPU mask or None as it is)."""
    return mask if mask is None or mask.device.type == "cpu" else memory.cpu_view(mask)


class _CpuValued(torch.autograd.Function):
    """Attention op by op (:func:`flash_decomposed`: L != S, ...) whose values are CPU's kernel's
    (``datapath_exact`` false: non-finite inputs, overflowing products, ...), with gradients: its
    output is CPU's kernel's and its gradients are CPU's kernel's backward's (autograd through
    CPU's SDPA on host views), as the fused path's are (``_Attention``). The op-by-op backward from
    the datapath put NaNs elsewhere (causal, L != S: 40 NaNs in dK where CPU's has 8). The device
    is charged what the op-by-op path runs: the forward's ops, and in the backward their recompute
    and autograd, whose values are dropped."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        out = flash_decomposed(q, k, v, mask, is_causal, scale, enable_gqa)
        hq, hk, hv = (memory.cpu_view(t) for t in (q, k, v))
        memory.cpu_view(out).copy_(cpu_kernel(hq, hk, hv, host_mask(mask), is_causal, scale))
        ctx.save_for_backward(q, k, v)
        ctx.call = (mask, is_causal, scale, enable_gqa)
        ctx.mask_version = _version(mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v = ctx.saved_tensors
        mask, causal, scale, gqa = ctx.call
        check_mask_version(mask, ctx.mask_version)
        if torch.is_grad_enabled() or _torch.batched_grad(grad_out):  # create_graph, or vmapped gradients
            return differentiable_grads(ctx, q, k, v, grad_out, mask, causal, scale, gqa, True) + (None,) * 4
        index = q.device.index or 0
        with torch.enable_grad():  # the device's work (values dropped)
            xs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            torch.autograd.grad(flash_decomposed(*xs, mask, causal, scale, gqa), xs, grad_out)
        grads = cpu_kernel_grads(q, k, v, host_mask(mask), causal, scale, grad_out)
        return tuple(memory.relabel(g, index) for g in grads) + (None, None, None, None)


def _version(mask: torch.Tensor | None) -> int | None:
    """The mask's version counter (None without a mask, or for an inference tensor, which has none)."""
    return None if mask is None or mask.is_inference() else mask._version


def check_mask_version(mask: torch.Tensor | None, version: int | None) -> None:
    """Autograd's refusal of a mask written in place between the forward and a backward that reads
    it: CPU's flash kernel saves the mask for its backward and refuses so; the device's backward
    (CPU's kernel's where the inputs are not finite, the math path recomputed for create_graph or
    batched gradients) read the written mask and gave other gradients without a word. A backward
    from P alone does not read it and runs where CPU's math path does."""
    if version is not None and mask is not None and mask._version != version:
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                           f"inplace operation: [{mask.type()} {list(mask.shape)}] is at version {mask._version}; "
                           f"expected version {version} instead. Hint: the attention mask of "
                           "scaled_dot_product_attention was written in place after the forward")


FLASH_DOUBLE_BACKWARD = "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"


def differentiable_grads(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                         mask: torch.Tensor | None, causal: bool, scale: float | None, gqa: bool, flash: bool
                         ) -> tuple[Any, ...]:
    """The gradients of a backward that builds a graph (``create_graph=True``: a gradient penalty,
    a Hessian-vector product). The fused backward's gradients are new tensors without history, so
    a second differentiation took them as constants and silently dropped their terms. Where CPU
    runs the call with its flash kernel, whose backward has no derivative, CPU's error; where it
    runs its math path, that path recomputed on the device and differentiated with
    ``create_graph``, as CPU's autograd differentiates it (the composite's ops' values).

    Also the gradients of a backward vmapped over its output gradients (``is_grads_batched``,
    ``jacobian(vectorize=True)``), whose batched ``grad_out`` has no memory for the fused
    backward to read ("Cannot access storage of BatchedTensorImpl"): the math path recomputed
    and differentiated, each batch entry as CPU's kernel's backward (within the composite's
    rounding)."""
    need = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():
        if flash:
            raise RuntimeError(FLASH_DOUBLE_BACKWARD)
        # each input through a view of its own: one tensor passed as q, k and v (self-attention's
        # F.scaled_dot_product_attention(x, x, x)) gets each use's gradient once, not their sum thrice
        q, k, v = (t.view_as(t) if n else t for t, n in zip((q, k, v), need))
    else:
        q, k, v = (t.detach().requires_grad_(n) for t, n in zip((q, k, v), need))
    xs = [t for t, n in zip((q, k, v), need) if n]
    with torch.enable_grad():
        m, c = additive_mask(q, k, mask, causal)
        out = _torch.sdpa_math(q, k, v, m, 0.0, c, None, scale=scale, enable_gqa=gqa)[0]
        got = iter(torch.autograd.grad(out, xs, grad_out, create_graph=torch.is_grad_enabled()))
    return tuple(next(got) if n else None for n in need)


def backward_values(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_dev: torch.Tensor,
                    scale: float, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's values from neuron tensors (P from the forward): (dq, dk, dv) on CPU."""
    dt = q.dtype
    p = _flat(memory.cpu_view(p_dev))
    do = _flat(memory.cpu_view(grad_out).to(dt))
    cq = _flat(memory.cpu_view(q))
    ck, cv = _flat(_heads(memory.cpu_view(k), groups)), _flat(_heads(memory.cpu_view(v), groups))
    p_dt = p.to(dt)
    dv = tensore.bmm_f32(p_dt.transpose(1, 2), do)
    dp = tensore.bmm_f32(do, cv.transpose(1, 2))
    ds = _torch.softmax_backward_data(dp, p, -1, torch.float32)
    ds.mul_(scale)
    ds_dt = ds.to(dt)
    dq = tensore.bmm_f32(ds_dt, ck)
    dk = tensore.bmm_f32(ds_dt.transpose(1, 2), cq)
    kv_shape = q.shape[:-3] + (k.shape[-3], groups) + k.shape[-2:]
    dk = dk.view(kv_shape).sum(-3) if groups > 1 else dk.view(k.shape)
    dv = dv.view(kv_shape).sum(-3) if groups > 1 else dv.view(v.shape)
    return dq.view(q.shape).to(dt), dk.to(dt), dv.to(dt)


# (shapes, dtype, mask shape/dtype, causal, scale) -> the costs one forward / backward launches
_charges: dict[tuple[Any, ...], list[Any]] = {}


def _charge(index: int, op: str, key: tuple[Any, ...], specs: Any) -> None:
    rt = runtime()
    costs = _charges.get(key)
    if costs is None:
        costs = _charges[key] = [rt.cost(spec) for spec in specs()]
    for cost in costs:
        rt.charge(index, op, cost)


def charge_forward(index: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float | None) -> None:
    kv = (k.shape[-3], k.shape[-2])
    key = ("fwd", q.shape, lowering.kv_cost_key(kv, q.shape[-2]), q.dtype,
           None if mask is None else (mask.shape, mask.dtype), causal, scale)
    _charge(index, FORWARD, key, lambda: lowering.attention_specs(q, mask, causal, scale, kv=kv))


def charge_backward(index: int, q: torch.Tensor, s: int, dtype: torch.dtype) -> None:
    _charge(index, BACKWARD, ("bwd", q.shape, s, dtype), lambda: lowering.attention_backward_specs(q, s, dtype))


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """The neuron kernel of ``aten::scaled_dot_product_attention``."""
    if _torch.functorch_active():  # (PyTorch's own error there named requires_grad_, or a TensorWrapper's storage)
        raise RuntimeError(FUNCTORCH)
    values.same_device(query, key, value, attn_mask if attn_mask is not None and attn_mask.dim() else None)
    flash = check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not takes(query, key, value, attn_mask, dropout_p, enable_gqa):
        if flash and dropout_p == 0.0:
            exact = True
            if all(type(t) in _PLAIN for t in (query, key, value, attn_mask) if t is not None):
                hq, hk, hv, hmask = memory.cpu_views((query, key, value, attn_mask))
                exact = datapath_exact(hq, hk, hv, hmask, scale)
            if not exact and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)) and \
                    (attn_mask is None or not attn_mask.requires_grad):
                out = _CpuValued.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa)
            else:
                out = flash_decomposed(query, key, value, attn_mask, is_causal, scale, enable_gqa)
                if not exact:  # CPU's flash kernel's values (see datapath_exact)
                    memory.cpu_view(out).copy_(cpu_kernel(hq, hk, hv, hmask, is_causal, scale))
        else:
            mask, causal = additive_mask(query, key, attn_mask, is_causal)
            out = _torch.sdpa_math(query, key, value, mask, dropout_p, causal, None, scale=scale,
                                   enable_gqa=enable_gqa)[0]
        laid = cpu_layout(query, out, flash)
        # (op by op, the math path's result is a matmul's, contiguous: one more copy lays it out as CPU's)
        return out if laid is None else torch.empty_strided(out.shape, laid, dtype=out.dtype,
                                                            device=out.device).copy_(out)
    groups = query.shape[-3] // key.shape[-3]
    if _forward_ad._current_level < 0 and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, attn_mask))):
        # nothing to differentiate (inference, a decode step): the forward without autograd's
        # Function machinery (~15 us a call); P is made, counted and let go as when the Function's
        # context is dropped on return. Inside a forward-mode AD level the Function runs, which
        # refuses dual inputs in one line (it has no jvp): a plain call would drop their tangents.
        return _forward(query, key, value, attn_mask, is_causal, scale, groups, flash)[0]
    return _Attention.apply(query, key, value, attn_mask, is_causal, scale, groups, flash)
