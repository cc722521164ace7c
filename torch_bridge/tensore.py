"""Values of TensorE ops through trnsim's native datapath (the numbers the PE array and PSUM make).

Operands are rounded to their dtype (they already are: a bf16 tensor holds bf16 values),
products are exact in fp32, the contraction accumulates in fp32 in 128-row chunks, and PSUM is
copied out with one round-to-nearest-even to the result dtype. Dtypes the PE array does not
take (float64, integers, complex) are computed by the CPU kernel instead.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from trnsim import native

__all__ = ["DATAPATH_DTYPES", "matmul_f32", "on_datapath"]

DATAPATH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
K_CHUNK = 128  # partitions per matmul instruction (datasheet §4.2)


def on_datapath(*ts: torch.Tensor) -> bool:
    """True when every operand is a non-empty tensor of one dtype the PE array reads."""
    dt = ts[0].dtype
    return dt in DATAPATH_DTYPES and all(t.dtype == dt and t.numel() > 0 for t in ts)


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 through ml_dtypes), keeping its strides."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[M,K] @ b[K,N]`` (CPU tensors, same datapath dtype) as a float32 PSUM result [M,N]."""
    out = native.matmul(_np(a.t()), _np(b), k_chunk=K_CHUNK)
    return torch.from_numpy(out)
