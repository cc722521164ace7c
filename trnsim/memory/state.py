"""The functional model's memory: SBUF and PSUM as byte arrays per partition, HBM tensors as
flat arrays. Access patterns become numpy views, so engines read and write in place.

New on-chip memory is filled with 0xFF bytes: NaN in every float format (fp32, bf16, fp16,
fp8) and -1 in signed integers, so a kernel that reads a tile it never wrote shows NaN instead
of plausible zeros (the NKI simulator fills new tensors with NaN for the same reason).
"""

from __future__ import annotations

import numpy as np

from ..config import ChipConfig
from ..isa import AP, HbmAP, HbmTensor, TileAP

__all__ = ["DeviceMemory", "POISON"]

POISON = 0xFF


class DeviceMemory:
    def __init__(self, config: ChipConfig):
        c = config.core
        self.sbuf = np.full((c.sbuf.partitions, c.sbuf.partition_bytes), POISON, dtype=np.uint8)
        self.psum = np.full((c.psum.partitions, c.psum.partition_bytes), POISON, dtype=np.uint8)
        self.hbm: dict[int, np.ndarray] = {}

    def bind(self, tensor: HbmTensor, values: np.ndarray | None) -> np.ndarray:
        """Place a tensor in HBM (flat, its dtype); ``values`` already in that dtype or None."""
        if values is None:
            flat = np.full(tensor.nbytes, POISON, dtype=np.uint8).view(tensor.dtype.np_dtype)
        else:
            flat = np.ascontiguousarray(values, dtype=tensor.dtype.np_dtype).reshape(-1).copy()
        self.hbm[tensor.uid] = flat
        return flat

    def view(self, ap: AP) -> np.ndarray:
        """A writable numpy view of ``ap`` with shape ``ap.shape``."""
        if isinstance(ap, HbmAP):
            base = self.hbm[ap.tensor.uid]
            isz = base.itemsize
            return np.lib.stride_tricks.as_strided(
                base[ap.offset:], shape=ap.shape, strides=tuple(s * isz for s, _ in ap.dims), writeable=True
            )
        mem = self.sbuf if ap.space == "sbuf" else self.psum
        pb = mem.shape[1]
        isz = ap.dtype.itemsize
        off = ap.p_start * pb + ap.alloc.addr + ap.offset * isz
        return np.ndarray(
            shape=ap.shape,
            dtype=ap.dtype.np_dtype,
            buffer=mem,
            offset=off,
            strides=(pb,) + tuple(s * isz for s, _ in ap.dims),
        )
