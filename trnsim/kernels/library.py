"""Importing this module registers every built-in kernel (see :mod:`trnsim.kernels.registry`)."""

from . import attention, conv, elementwise, embedding, matmul, norm, reduce, transpose  # noqa: F401
