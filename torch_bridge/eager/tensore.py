"""Values of TensorE ops through trnsim's native datapath (the numbers the PE array and PSUM make).

Operands are rounded to their dtype (they already are: a bf16 tensor holds bf16 values),
products are exact in fp32, the contraction accumulates in fp32 in chunks of the PE array's
contraction rows (``core.tensor.max_contraction``: one matmul instruction each), and PSUM is
copied out with one round-to-nearest-even to the result dtype. Dtypes the PE array does not
take (float64, integers, complex) are computed by the CPU kernel instead, as are transposed and
3-d convolutions and convolution backward (their cost is still a TensorE matmul).
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import torch

from trnsim import native

from .. import _native, _torch

__all__ = ["DATAPATH_DTYPES", "matmul_f32", "bmm_f32", "on_datapath", "bounded", "all_finite", "datapath_product",
           "conv_f32", "conv_on_datapath"]

DATAPATH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_chunk: list[int] = []


def _k_chunk() -> int:
    """Contraction rows per matmul instruction on the configured chip (datasheet §4.2); the
    config is fixed once the device is in use, so it is read once."""
    if not _chunk:
        from ..runtime import runtime

        _chunk.append(runtime().config.core.tensor.max_contraction)
    return _chunk[0]


def on_datapath(*ts: torch.Tensor) -> bool:
    """True when every operand is a non-empty tensor of one dtype the PE array reads."""
    dt = ts[0].dtype
    return dt in DATAPATH_DTYPES and all(t.dtype == dt and t.numel() > 0 for t in ts)


# a quarter of float32's largest value: the margin covers the roundings of k fp32 additions
BOUND = float(torch.finfo(torch.float32).max) / 4


_MAX_ABS_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # trnsim_fast_max_abs's formats


def magnitude(t: torch.Tensor) -> float:
    """The largest ``|x|`` of ``t`` (0 for an empty tensor; NaN or inf when ``t`` holds one). A
    contiguous float32/bfloat16/float16 host tensor is scanned by the fast path's own loop
    (csrc/neuron.cpp ``trnsim_fast_max_abs``: one pass over the bits, the same value) when the
    extension is loaded; otherwise ``aminmax``."""
    n = t.numel()
    if n == 0:
        return 0.0
    code = _MAX_ABS_CODES.get(t.dtype)
    if code is not None and t.device.type == "cpu" and t.is_contiguous() and not _torch.is_zerotensor(t):
        lib = _native.lib
        if lib is not None:
            return float(lib.trnsim_fast_max_abs(t.data_ptr(), n, code))
    lo, hi = torch.aminmax(t)
    lo_f, hi_f = float(lo), float(hi)
    if math.isnan(lo_f) or math.isnan(hi_f):
        return math.nan
    return max(-lo_f, hi_f)


def bounded(k: int, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0, extra: float = 0.0) -> bool:
    """True when ``scale * (sum of k products a_i * b_i) + extra`` stays finite in every order
    and whether or not a multiply and an add are fused: every element finite and
    ``k * max|a| * max|b| * |scale| + extra`` well below float32's largest value. Only then does
    the datapath's result differ from a CPU kernel's by rounding alone. Otherwise which of +inf,
    -inf or NaN a sum gets depends on the kernel: the datapath's fused multiply-add keeps
    ``1e30 * 1e30`` exact and adds it to a -inf accumulator as -inf, where CPU's small bmm (and its
    bf16 mm) rounds the product to +inf first and gets NaN (found by difftest: SDPA 167355199899617);
    callers take CPU's own kernel for such operands, as the convolution does for non-finite ones.

    Matmuls ask it only when the datapath's result is not finite (:func:`all_finite`, the rule the
    native fast path follows too): a product or partial sum that overflows leaves the datapath's
    result non-finite (fma keeps a product exact, and an infinite accumulator stays infinite or
    NaN), so a finite result differs from CPU's by rounding alone, whatever the operands' bound;
    scanning the result also reads far less than the operands (a weight on every call)."""
    bound = float(k) * magnitude(a) * magnitude(b) * abs(scale) + extra
    return bound < BOUND  # (False for NaN)


def all_finite(t: torch.Tensor) -> bool:
    """True when every element of ``t`` is finite. A contiguous float32 tensor (a PSUM result) is
    scanned by the fast path's own loop (csrc/neuron.cpp ``all_finite_f32``: one pass, no
    allocation) when the extension is loaded. Otherwise a finite sum says so in one pass (an
    infinity or a NaN anywhere makes the sum infinite or NaN); only a sum that is not finite
    (that, or finite elements whose sum overflows) asks element by element, which on one CPU
    thread costs 50x the sum."""
    if t.dtype == torch.float32 and t.is_contiguous():
        lib = _native.lib  # (None until the extension is loaded: the sum below)
        if lib is not None:
            return bool(lib.trnsim_fast_all_finite(t.data_ptr(), t.numel()))
    return math.isfinite(t.sum().item()) or bool(t.isfinite().all())


def datapath_product(product: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``product(a, b)`` (:func:`matmul_f32` or :func:`bmm_f32`) where the datapath gives a
    matmul's values: operands on the datapath, and a finite result or operands whose products
    cannot overflow (:func:`bounded`, asked only for a result that is not finite); else None, and
    CPU's kernel gives them. The rule of mm, bmm, the MoE op's linears and the native fast path."""
    if not on_datapath(a, b):
        return None
    p = product(a, b)
    return p if all_finite(p) or bounded(a.shape[-1], a, b) else None


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 through ml_dtypes), keeping its strides."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _native_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` (2-d or 3-d) as the float32 PSUM result of the extension's datapath call, or None
    where it does not take the call (then trnsim.native's route computes the same bits, or raises)."""
    op = _native.op("datapath_f32")  # (None before the extension is loaded, or without it)
    if op is None or a.requires_grad or b.requires_grad:  # (the op has no autograd formula)
        return None
    return op(a, b)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[M,K] @ b[K,N]`` (CPU tensors, same datapath dtype) as a float32 PSUM result [M,N]: the
    native extension's call of the datapath where it takes the call, else trnsim.native's (the
    same bits)."""
    out = _native_product(a, b)
    if out is not None:
        return out
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32)  # (from the host cache in its scope)
    native.matmul(_np(a.t()), _np(b), out=out.numpy(), k_chunk=_k_chunk())
    return out


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[B,M,K] @ b[B,K,N]`` (CPU tensors, same datapath dtype) as float32 PSUM results
    [B,M,N], each item as :func:`matmul_f32` computes it, in one call to the datapath (the native
    extension's where it takes the call, as for matmul_f32)."""
    out = _native_product(a, b)
    if out is not None:
        return out
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.float32)  # (as matmul_f32's)
    native.matmul_batched(_np(a.transpose(1, 2)), _np(b), k_chunk=_k_chunk(), out=out.numpy())
    return out


def _as_2d(x: torch.Tensor, w: torch.Tensor, stride: Any, padding: Any, dilation: Any
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int], tuple[int, int]]:
    """A 1-d convolution as a 2-d one with height 1 (2-d passes through)."""
    if x.dim() == 3:
        return (x.unsqueeze(2), w.unsqueeze(2), (1, stride[0]), (0, padding[0]), (1, dilation[0]))
    return x, w, tuple(stride), tuple(padding), tuple(dilation)  # type: ignore[return-value]


def conv_on_datapath(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> bool:
    """1-d and 2-d forward convolutions in a datapath dtype run as im2col matmuls on the datapath."""
    return not transposed and x.dim() in (3, 4) and on_datapath(x, w)


def _conv_batched(x2: torch.Tensor, w2: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """An ungrouped convolution as one datapath matmul per image, weights[K, C*R*S] @ patches[C*R*S, L]
    (``cols``: the im2col patches [N, C*R*S, L]; None for a 1x1 stride-1 convolution, whose
    patches are the input itself), all in one call: the same numbers per element as one matmul
    over N*L columns (the datapath blocks over columns without changing any element), without
    copying the patches or the output into and out of that layout. float32 [N, K, L]."""
    n, c = x2.shape[:2]
    k = w2.shape[0]
    moving = x2.reshape(n, c, -1) if cols is None else cols
    ck, pixels = moving.shape[1], moving.shape[2]
    if pixels < 8:  # a few pixels per image: one matmul over N*L columns packs the weights once, not per
        # image (4x576 pixels into 144 channels: 0.29 -> 0.13 ms); the same numbers per element
        res = matmul_f32(w2.reshape(k, ck), moving.permute(1, 0, 2).reshape(ck, n * pixels))
        return res.view(k, n, pixels).permute(1, 0, 2).contiguous()
    stationary = _np(w2.reshape(k, ck).t())  # [C*R*S, K]
    out = torch.empty((n, k, pixels), dtype=torch.float32)
    native.matmul_batched(np.broadcast_to(stationary, (n,) + stationary.shape), _np(moving), k_chunk=_k_chunk(),
                          out=out.numpy())
    return out


def im2col(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
           dilation: tuple[int, int], out: tuple[int, int]) -> torch.Tensor:
    """``F.unfold``'s patches [N, C*R*S, Ho*Wo] of a [N, C, H, W] tensor (rows in (C, R, S)
    order, columns in (Ho, Wo) order), as one strided view of the zero-padded input copied once:
    the same elements, 1.7-2.8x faster than unfold's im2col on CPU (8x64x56x56 3x3: 79 ms against
    46; a 3-channel stride-2 stem: 4.5 against 1.5)."""
    (r, s), (ho, wo) = kernel, out
    n, c = x.shape[:2]
    if ho <= 0 or wo <= 0:
        return torch.nn.functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    xp = torch.nn.functional.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x
    sn, sc, sh, sw = xp.stride()
    view = xp.as_strided((n, c, r, s, ho, wo), (sn, sc, dilation[0] * sh, dilation[1] * sw, stride[0] * sh,
                                                stride[1] * sw), xp.storage_offset())
    return view.reshape(n, c * r * s, ho * wo)


def conv_f32(x: torch.Tensor, w: torch.Tensor, stride: Any, padding: Any, dilation: Any, groups: int
             ) -> torch.Tensor:
    """A convolution (CPU tensors [N,C,(H,)W] and [K,C/groups,(R,)S]) as TensorE computes it:
    per group, weights[K/g, C/g*R*S] @ patches[C/g*R*S, N*positions] with fp32 PSUM accumulation
    (for a few output channels per group, as depthwise convolutions have, the datapath's
    :func:`trnsim.native.conv2d_grouped` makes the same numbers without the patches).
    Returns the float32 result [N,K,(Ho,)Wo]."""
    one_d = x.dim() == 3
    x2, w2, st, pad, dil = _as_2d(x, w, stride, padding, dilation)
    n, c, h, wd = x2.shape
    k, cg, r, s = w2.shape
    ho = (h + 2 * pad[0] - dil[0] * (r - 1) - 1) // st[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (s - 1) - 1) // st[1] + 1
    kg, ck = k // groups, cg * r * s

    def unfold() -> torch.Tensor:  # the im2col patches [N, C*R*S, L]
        return im2col(x2, (r, s), st, pad, dil, (ho, wo))
    if groups == 1:  # one matmul per image, in one call: its output is already [N, K, L]
        pointwise = r == s == 1 and st == (1, 1) and pad == (0, 0)
        out = _conv_batched(x2, w2, None if pointwise else unfold())
    elif k // groups <= 8 and native.backend() != "reference":  # depthwise and the like: one row per group
        xp = torch.nn.functional.pad(x2.float(), (pad[1], pad[1], pad[0], pad[0])).numpy()
        out = torch.from_numpy(native.conv2d_grouped(xp, w2.float().numpy(), groups, st, dil, (ho, wo),
                                                     k_chunk=_k_chunk())).view(n, k, -1)
    else:  # every group's matmul in one call to the datapath (each computed as matmul_f32 would)
        patches = unfold().view(n, groups, ck, -1).permute(1, 2, 0, 3).reshape(groups, ck, -1)  # [g, C/g*R*S, N*L]
        res = bmm_f32(w2.reshape(groups, kg, ck), patches)  # [g, K/g, N*L]
        out = res.view(groups, kg, n, -1).permute(2, 0, 1, 3).contiguous().view(n, k, -1)
    out = out.view(n, k, ho, wo)
    return out.squeeze(2) if one_d else out
