"""``torch.autocast("neuron", dtype)``: the policy of every other accelerator's autocast.

The ops' kernels are the native extension's (``csrc/neuron.cpp``, ``AutocastPrivateUse1``:
PyTorch's shared op lists): TensorE ops (matmuls, convolutions, attention) in the autocast dtype,
the precision-sensitive ops (exponentials and logarithms, powers, norms, softmax, the losses) in
float32, ops that mix inputs at the widest input type. Every other op falls through to the
device's kernels, registered here.
"""

from __future__ import annotations

import torch

__all__ = ["register_autocast"]


def register_autocast(fallback: torch.library.Library) -> None:
    """The fallthrough for ops without an autocast kernel (the extension registers the others)."""
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
