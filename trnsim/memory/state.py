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
    """``sbuf_bytes``/``psum_bytes``: bytes per partition to hold (default: the whole
    partition); a kernel needs only up to its allocators' high-water mark, so a config with 1 GiB
    partitions does not cost 128 GiB of host memory to run a small kernel with values."""

    def __init__(self, config: ChipConfig, sbuf_bytes: int | None = None, psum_bytes: int | None = None):
        c = config.core
        sb = c.sbuf.partition_bytes if sbuf_bytes is None else max(1, sbuf_bytes)
        pb = c.psum.partition_bytes if psum_bytes is None else max(1, psum_bytes)
        self.sbuf = np.full((c.sbuf.partitions, sb), POISON, dtype=np.uint8)
        self.psum = np.full((c.psum.partitions, pb), POISON, dtype=np.uint8)
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
            # strided through raw bytes of the element size: as_strided rebuilds the array from its
            # __array_interface__, whose typestr ml_dtypes' float8_e5m2 gives as '<f1', which numpy
            # cannot read back (the other ml_dtypes floats say '<V1'/'<V2')
            raw = base.view(np.dtype((np.void, isz)))
            return np.lib.stride_tricks.as_strided(
                raw[ap.offset:], shape=ap.shape, strides=tuple(s * isz for s, _ in ap.dims), writeable=True
            ).view(base.dtype)
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
