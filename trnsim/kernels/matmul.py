"""Tiled matmul ``out[M, N] = lhsT[K, M]ᵀ @ rhs[K, N]``, written as an NKI author would.

The contraction dim K sits on the partition axis of both operands, as TensorE wants it (the
NKI matmul tutorial's ``lhsT`` layout). The kernel:

* keeps a block of ``rhs`` columns resident in SBUF (loaded once per column block) and streams
  ``lhsT`` row blocks through a double-buffered pool, so DMA overlaps compute;
* for each stationary tile ``lhsT[k, m]`` issues the matmuls of every PSUM bank of the column
  block back to back, so the stationary stays loaded (no LoadStationary between them);
* accumulates over K in PSUM accumulation groups (one bank per 128x512 output tile);
* evacuates PSUM alternately on VectorE and ScalarE, and stores on a separate DMA queue
  triggered by GpSimd, so stores never block the loads queued on the Sync engine.

Sizes must be multiples of the tile sizes (128 / 128 / 512 on NC-v3); ragged edges are the
kernel library's job.
"""

from __future__ import annotations

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..kernel import Kernel
from ..native.dtypes import get_dtype
from .registry import register_kernel, round_to

__all__ = ["build_matmul"]


def _inputs(shape, dtype, params, rng):
    m, k, n = shape
    return {"lhsT": rng.standard_normal((k, m), dtype=np.float32), "rhs": rng.standard_normal((k, n), dtype=np.float32)}


def _reference(inputs, shape, dtype, params):
    return {"out": round_to(inputs["lhsT"], dtype).T @ round_to(inputs["rhs"], dtype)}


@register_kernel("matmul", dims="MxKxN", dtypes=("bf16", "fp16", "fp32", "fp8_e4m3"), default_shape=(4096, 4096, 4096),
                 summary="out[M,N] = lhsT[K,M]^T @ rhs[K,N], PSUM accumulation over K", inputs=_inputs,
                 reference=_reference)
def build_matmul(m: int, k: int, n: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                 out_dtype: str | None = None, name: str = "matmul") -> Kernel:
    kern = Kernel(name, config)
    cfg = kern.config
    t = cfg.core.tensor
    dt = get_dtype(dtype)
    odt = get_dtype(out_dtype or ("float32" if dt.name == "float32" else "bfloat16"))
    tk = t.max_contraction
    tm = t.stationary_max_free
    tn = min(t.moving_max_free, cfg.core.psum.bank_bytes // 4)
    for dim, size, step in (("M", m, tm), ("K", k, tk), ("N", n, tn)):
        if size % step:
            raise KernelError(f"matmul: {dim}={size} must be a multiple of {step} on {cfg.name}")
    kt_n, mt_n, nt_n = k // tk, m // tm, n // tn
    lhsT = kern.input("lhsT", (k, m), dt)
    rhs = kern.input("rhs", (k, n), dt)
    out = kern.output("out", (m, n), odt)

    # SBUF budget per partition: resident rhs block + double-buffered lhsT block + result tiles
    budget = cfg.core.sbuf.partition_bytes * 3 // 4
    isz = dt.itemsize
    banks = cfg.core.psum.banks
    bn = max(1, min(nt_n, banks // 2, (budget // 2) // max(1, kt_n * tn * isz)))
    bm = max(1, min(mt_n, 4, (budget // 4) // max(1, kt_n * tm * isz)))

    rhs_pool = kern.tile_pool("rhs", bufs=1)
    lhs_pool = kern.tile_pool("lhsT", bufs=2)
    res_pool = kern.tile_pool("res", bufs=2)
    psum_pool = kern.tile_pool("acc", bufs=2 * bn, space="psum")
    evac = 0
    for n0 in range(0, nt_n, bn):
        nb = min(bn, nt_n - n0)
        rhs_tiles = []
        for kt in range(kt_n):
            tile = rhs_pool.tile((tk, nb * tn), dt, name=f"rhs{kt}") if kt == 0 else kern.sbuf((tk, nb * tn), dt)
            kern.dma_copy(tile, rhs[kt * tk:(kt + 1) * tk, n0 * tn:(n0 + nb) * tn], queue=1)
            rhs_tiles.append(tile)
        for m0 in range(0, mt_n, bm):
            mb = min(bm, mt_n - m0)
            lhs_tiles = []
            with kern.scope():
                for kt in range(kt_n):
                    tile = kern.sbuf((tk, mb * tm), dt)
                    kern.dma_copy(tile, lhsT[kt * tk:(kt + 1) * tk, m0 * tm:(m0 + mb) * tm], queue=0)
                    lhs_tiles.append(tile)
                for mi in range(mb):
                    accs = [psum_pool.tile((tm, tn), "fp32") for _ in range(nb)]
                    for kt in range(kt_n):
                        st = lhs_tiles[kt][:, mi * tm:(mi + 1) * tm]
                        for ni in range(nb):
                            kern.nc_matmul(accs[ni], st, rhs_tiles[kt][:, ni * tn:(ni + 1) * tn], accumulate=kt > 0)
                    for ni in range(nb):
                        res = res_pool.tile((tm, tn), odt)
                        kern.tensor_copy(res, accs[ni], engine="vector" if evac % 2 == 0 else "scalar")
                        evac += 1
                        row = (m0 + mi) * tm
                        col = (n0 + ni) * tn
                        kern.dma_copy(out[row:row + tm, col:col + tn], res, engine="gpsimd", queue=0)
        for tile in rhs_tiles[1:]:
            kern.free(tile)
    return kern
