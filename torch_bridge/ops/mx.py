"""``torch.neuron.mx_matmul``: an MX (microscaling) matmul from PyTorch, on trn3's ``nc_matmul_mx``.

PyTorch 2.13 reaches MX formats only through CUDA: ``aten::_scaled_mm`` with block-wise
``float8_e8m0fnu`` scales refuses on CPU ("Invalid scaling configuration"), and torchao's
``MXTensor`` either calls that (its CUTLASS/cuBLAS path) or dequantizes and runs a bf16 matmul
(its emulated path), which the device would time as a bf16 matmul. So the device has an entry
point of its own, in the layout an MX tensor keeps (torchao's ``qdata``/``scale``, OCP MX):

    torch.neuron.mx_matmul(a, a_scale, b, b_scale, out_dtype=torch.bfloat16)

``a`` [M, K] and ``b`` [K, N] in ``float8_e4m3fn`` or ``float8_e5m2`` (they may differ), with one
``float8_e8m0fnu`` scale per 32 consecutive values along K: ``a_scale`` [M, K/32], ``b_scale``
[K/32, N]. The **values** are the dequantized operands' matmul as CPU computes it::

    (a.float() * a_scale.float().repeat_interleave(32, 1)) @ (b.float() * b_scale.float().repeat_interleave(32, 0))

rounded to ``out_dtype`` (the dequantized values are exact in fp32: an fp8 value times a power of
two). The **time** is one launch of the library ``matmul_mx`` kernel (``trnsim kernel matmul_mx``:
quad-packed operands and scales on ``nc_matmul_mx``, four times the bf16 rate), K rounded up to
the 128 values a scale quadrant holds. It needs a NeuronCore-v4 config (trn3); on trn2 it is
refused in one line. On CPU tensors it computes the values above (a reference to compare with).
It is the custom op ``trnsim::mx_matmul`` (a CPU kernel, a neuron kernel, a fake one): one node
under ``torch.compile``, charged by its lowering (``lowering.OPS["mx_matmul"]``) in eager and
timing-only runs alike.
"""

from __future__ import annotations

import torch

from ..eager import values
from ..runtime import runtime

__all__ = ["mx_matmul", "mx_reference"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 32  # values per E8M0 scale (OCP MX)


def mx_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values of an MX matmul, on CPU tensors: dequantize, fp32 matmul, round to ``out_dtype``."""
    da = a.float() * a_scale.float().repeat_interleave(BLOCK, 1)
    db = b.float() * b_scale.float().repeat_interleave(BLOCK, 0)
    return torch.mm(da, db).to(out_dtype)


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
           out_dtype: torch.dtype) -> None:
    what = "torch.neuron.mx_matmul"
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FP8 or t.dim() != 2:
            raise ValueError(f"{what}: {name} must be a 2-d float8_e4m3fn or float8_e5m2 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t.dtype != torch.float8_e8m0fnu:
            raise ValueError(f"{what}: {name} must be float8_e8m0fnu (one E8M0 scale per {BLOCK} values), "
                             f"got {t.dtype}")
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k or k % BLOCK:
        raise ValueError(f"{what}: a {tuple(a.shape)} @ b {tuple(b.shape)}: the contraction must match and be a "
                         f"multiple of {BLOCK}")
    if tuple(a_scale.shape) != (m, k // BLOCK) or tuple(b_scale.shape) != (k // BLOCK, n):
        raise ValueError(f"{what}: scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)}: expected "
                         f"{(m, k // BLOCK)} and {(k // BLOCK, n)} (one per {BLOCK} values along K)")
    if out_dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"{what}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


@torch.library.custom_op("trnsim::mx_matmul", mutates_args=(), device_types="cpu")
def mx_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """See the module docstring (on CPU tensors: the values, :func:`mx_reference`)."""
    _check(a, a_scale, b, b_scale, out_dtype)
    return mx_reference(a, a_scale, b, b_scale, out_dtype)


@mx_matmul.register_kernel("neuron")
def _mx_matmul_neuron(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values on CPU views of the device memory, charged as the ``matmul_mx`` kernel (the
    op's lowering, :func:`torch_bridge.lowering.op_spec`, which timing-only runs charge too)."""
    _check(a, a_scale, b, b_scale, out_dtype)
    cfg = runtime().config
    if not cfg.core.tensor.mx_quad:
        raise RuntimeError(f"torch.neuron.mx_matmul: {cfg.name} has no MX matmul (nc_matmul_mx is NeuronCore-v4's, "
                           f"core.tensor.mx_quad); use a trn3 config, or aten::_scaled_mm for fp8")
    return values.host_kernel("mx_matmul", mx_reference, (a, a_scale, b, b_scale, out_dtype), {})


@mx_matmul.register_fake
def _mx_matmul_fake(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    _check(a, a_scale, b, b_scale, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)

